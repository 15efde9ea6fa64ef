"""Layer-skip calibration: which decoder layers the draft leaves out, how long its chains are,
and below which confidence a chain ends.

Usage:
    result = load_or_calibrate(target)          # cached per model, precision, machine, settings
    result = calibrate(target, CalibrationConfig(seed=1), prompts=[ids, ...], costs=SkipCosts(...))
    result.skip_layers, result.draft_length, result.min_confidence, result.expected_speedup

What is measured. `num_prompts` sample prompts (CALIBRATION_PROMPTS, drawn with the seed; not
MT-Bench, so that benchmarks are not calibrated on) are continued greedily by the full target for
`new_tokens` tokens. One full forward over each prompt + continuation keeps the residual stream
entering every layer and the target's argmax at each continuation row. A skip set S is scored
teacher-forced: the draft (the target without S, its context computed by itself, as its own KV
cache holds it when decoding) runs over the same sequences, started from the residual entering
min(S) (the layers before it are the same in both), and each continuation row records whether
the draft's argmax equals the target's (an accepted greedy draft) and the draft's top
probability (its confidence).

The objective. The rows are replayed as decoding steps: a chain of up to k drafts that ends at
the first draft whose confidence is below c; accepted = the matching prefix; each step emits
accepted + 1 tokens. Costs are in units of one plain target step:
    one draft forward       = overhead + (1 - overhead) * kept layers / L
    verifying T tokens      = the target's measured verification curve (sizing.py), T = 1 is 1
S's score is the best tokens / cost over (k, c): its modeled speedup over plain decoding.
(After a rejection the replay still counts the chain's remaining draft forwards, with the
confidences of the true tokens: an approximation of the cost side only.)

The search (deterministic for given prompts and costs; the seed only draws the prompts):
1. rank the layers by block influence, 1 - cos(residual entering, residual leaving), averaged
   over the continuation rows (ShortGPT's measure; read off the reference pass, no forward):
   a layer that barely turns the residual stream is the first to skip;
2. from no skipped layer, add the best (by score) of the next `beam` ranked layers, repeatedly;
   stop after `patience` additions without a new best score;
3. keep the best set seen (never the empty set) with its k and c.
"""

from __future__ import annotations

import hashlib
import json
import platform
import random
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from torch import Tensor

from eyas.engine.speculative.sizing import CostModel
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.utils.io import cache_dir, write_json_atomic

CALIBRATION_PROMPTS = [
    "Explain how a refrigerator keeps food cold, in simple terms.",
    "Write a short story about a lighthouse keeper who finds a message in a bottle.",
    "List five tips for staying focused while working from home, with one sentence each.",
    "Write a Python function that checks whether a string is a palindrome, and explain it.",
    "Draft a polite email asking a colleague to move our meeting from Tuesday to Thursday.",
    "A train travels 180 km in 2 hours. What is its average speed? Show your reasoning.",
    "Summarize the water cycle in one paragraph for a ten-year-old.",
    "Compare cats and dogs as pets: give two advantages of each.",
]


@dataclass
class CalibrationConfig:
    num_prompts: int = 4
    new_tokens: int = 32  # greedy continuation per prompt (the rows that are scored)
    seed: int = 0  # draws the prompts
    max_draft_tokens: int = 8  # longest chain considered
    confidences: tuple[float, ...] = (0.0, 0.3, 0.5, 0.7, 0.9)  # thresholds c considered
    beam: int = 2  # ranked layers tried per addition
    patience: int = 2  # additions without a new best before the search stops

    def __post_init__(self) -> None:
        for name in ("num_prompts", "new_tokens", "max_draft_tokens", "beam", "patience"):
            if int(getattr(self, name)) < 1:
                raise EyasError(f"layer-skip calibration: {name} must be >= 1, got {getattr(self, name)}")
        self.confidences = tuple(float(c) for c in self.confidences)
        if not self.confidences or any(not 0.0 <= c < 1.0 for c in self.confidences):
            raise EyasError("layer-skip calibration: confidences must be in [0, 1)")


@dataclass
class SkipCosts:
    """Costs relative to one plain target step (see the module docstring)."""

    overhead: float  # share of a one-token step outside the decoder layers (the output layer)
    verify: dict[int, float]  # tokens in one target pass -> cost relative to one token
    curve: CostModel = field(init=False, repr=False, compare=False)

    def __post_init__(self) -> None:
        if not 0.0 <= self.overhead < 1.0 or 1 not in self.verify:
            raise EyasError("layer-skip costs need an overhead in [0, 1) and a verify cost at 1 token")
        self.curve = CostModel(self.verify)  # interpolates between the measured sizes

    def verify_cost(self, tokens: int) -> float:
        return self.curve.verify(tokens)

    def draft_cost(self, kept_layers: int, num_layers: int) -> float:
        return self.overhead + (1.0 - self.overhead) * kept_layers / num_layers

    @staticmethod
    def output_share(target: Target) -> float:
        """Multiply-adds of the output layer / those of a whole one-token step (from the config)."""
        c = target.config
        attention = c.hidden_size * (c.num_attention_heads + 2 * c.num_key_value_heads) * c.head_dim
        layer = attention + c.num_attention_heads * c.head_dim * c.hidden_size + 3 * c.hidden_size * c.intermediate_size
        output = c.hidden_size * c.vocab_size
        return output / (output + c.num_hidden_layers * layer)

    @classmethod
    def measured(cls, target: Target) -> SkipCosts:
        """The output layer's share, and the target's verification curve measured by sizing.py
        (once per machine, model and precision; cached), made non-decreasing in T (noise on a
        shared machine only ever adds time)."""
        from eyas.engine.speculative.sizing import load_or_measure

        relative = load_or_measure(target).relative()
        verify, floor = {}, float("inf")
        for tokens in sorted(relative, reverse=True):
            floor = min(floor, relative[tokens])
            verify[tokens] = floor
        verify[1] = 1.0
        return cls(cls.output_share(target), dict(sorted(verify.items())))


@dataclass
class CalibrationResult:
    skip_layers: list[int]
    draft_length: int  # the best k
    min_confidence: float  # the best c
    acceptance: float  # share of rows where the draft's argmax is the target's
    tokens_per_step: float  # modeled, with the best k and c
    expected_speedup: float  # modeled tokens per plain-step cost (1 = plain decoding)
    evaluated: int  # skip sets measured
    seconds: float
    prompts: int
    rows: int  # continuation rows scored

    def summary(self) -> dict:
        return {k: (round(v, 4) if isinstance(v, float) else v) for k, v in asdict(self).items()}


@dataclass
class _Reference:
    ids: Tensor  # [B, T] prompt + continuation, right-padded
    residuals: Tensor  # [B, T, (L + 1) * H] residual entering each layer (L = after the last)
    rows: tuple[Tensor, Tensor]  # (batch index, time index) [N] each: rows predicting continuation
    row_groups: list[int]  # rows per sequence, in order (the replay walks each sequence)
    argmax: Tensor  # [N] the target's token at those rows


def _sample_prompts(target: Target, config: CalibrationConfig) -> list[list[int]]:
    from eyas.models.tokenizer import chat_prompt_ids, raw_prompt_ids

    chosen = random.Random(config.seed).sample(CALIBRATION_PROMPTS,
                                               min(config.num_prompts, len(CALIBRATION_PROMPTS)))
    tokenizer = target.tokenizer
    if getattr(tokenizer, "chat_template", None):
        return [chat_prompt_ids(tokenizer, [{"role": "user", "content": text}]) for text in chosen]
    return [raw_prompt_ids(tokenizer, text) for text in chosen]


@torch.inference_mode()
def _reference(target: Target, prompts: list[list[int]], new_tokens: int) -> _Reference:
    from eyas.engine.generate import generate_batch
    from eyas.engine.sampling import SamplingParams

    params = SamplingParams(max_tokens=new_tokens, ignore_eos=True)
    outputs = generate_batch(target, prompts, params)
    sequences = [p + output.token_ids for p, output in zip(prompts, outputs)]
    length = max(len(s) for s in sequences)
    ids = torch.zeros(len(sequences), length, dtype=torch.long)
    batch_index, time_index, groups = [], [], []
    for row, (prompt, sequence) in enumerate(zip(prompts, sequences)):
        ids[row, : len(sequence)] = torch.tensor(sequence)
        times = list(range(len(prompt) - 1, len(sequence) - 1))  # row t predicts token t + 1
        batch_index += [row] * len(times)
        time_index += times
        groups.append(len(times))
    ids = ids.to(target.device)
    rows = (torch.tensor(batch_index, device=target.device), torch.tensor(time_index, device=target.device))
    num_layers = target.config.num_hidden_layers
    out = target.model(ids, tap_layers=tuple(range(num_layers + 1)), logits_at=None)
    argmax = target.model.lm_head(out.hidden[rows]).argmax(-1)
    return _Reference(ids, out.taps, rows, groups, argmax)


def block_influence(reference: _Reference, hidden_size: int) -> list[float]:
    """1 - mean cosine similarity of the residual entering and leaving each layer."""
    rows = reference.residuals[reference.rows].float()  # [N, (L + 1) * H]
    per_boundary = rows.view(rows.shape[0], -1, hidden_size)  # [N, L + 1, H]
    cosine = torch.cosine_similarity(per_boundary[:, :-1], per_boundary[:, 1:], dim=-1)  # [N, L]
    return (1.0 - cosine.mean(0)).tolist()


@torch.inference_mode()
def measure_skip_set(target: Target, reference: _Reference, skip: frozenset[int]
                     ) -> tuple[Tensor, Tensor]:
    """matches [N] bool and confidence [N] of the draft without `skip`, teacher-forced over the
    reference rows."""
    hidden_size = target.config.hidden_size
    first = min(skip)
    start = reference.residuals[..., first * hidden_size : (first + 1) * hidden_size]  # [B, T, H]
    out = target.model(reference.ids, input_embeds=start, logits_at=None,
                       skip_layers=frozenset(range(first)) | skip)
    probs = torch.softmax(target.model.lm_head(out.hidden[reference.rows]).float(), -1)  # [N, V]
    best = probs.max(-1)
    return best.indices == reference.argmax, best.values


def replay(matches: list[bool], confidence: list[float], groups: list[int], k: int, threshold: float,
           draft_cost: float, costs: SkipCosts) -> tuple[int, float, int]:
    """(tokens, cost, steps) of decoding the reference rows with chains of <= k drafts that end
    at a draft below `threshold` (the module docstring's objective)."""
    tokens, cost, steps = 0, 0.0, 0
    offset = 0
    for count in groups:
        position = 0
        while position < count:
            drafted = accepted = forwards = 0
            matching = True
            for i in range(min(k, count - position)):
                row = offset + position + i
                forwards += 1  # forward i yields draft i (the first one feeds the root)
                if confidence[row] < threshold:
                    break
                drafted += 1
                matching = matching and matches[row]
                accepted += 1 if matching else 0
            tokens += accepted + 1
            cost += forwards * draft_cost + costs.verify_cost(drafted + 1)
            steps += 1
            position += accepted + 1
        offset += count
    return tokens, cost, steps


@dataclass
class _Trial:
    skip: frozenset[int]
    speedup: float  # the best modeled tokens / cost
    draft_length: int  # its k
    min_confidence: float  # its c
    tokens_per_step: float
    acceptance: float  # share of rows where the draft's argmax is the target's


def score(skip: frozenset[int], matches: Tensor, confidence: Tensor,
          groups: list[int], num_layers: int, config: CalibrationConfig, costs: SkipCosts) -> _Trial:
    """One skip set's best (k, c) by the replay of the module docstring."""
    match_list, confidence_list = matches.tolist(), confidence.tolist()
    draft_cost = costs.draft_cost(num_layers - len(skip), num_layers)
    best = _Trial(skip, 0.0, 1, 0.0, 1.0, float(matches.float().mean()))
    for k in range(1, config.max_draft_tokens + 1):
        for threshold in config.confidences:
            tokens, cost, steps = replay(match_list, confidence_list, groups, k, threshold,
                                         draft_cost, costs)
            if tokens / cost > best.speedup + 1e-12:
                best.speedup, best.draft_length, best.min_confidence = tokens / cost, k, threshold
                best.tokens_per_step = tokens / steps
    return best


def calibrate(target: Target, config: CalibrationConfig | None = None,
              prompts: list[list[int]] | None = None, costs: SkipCosts | None = None,
              log: bool = False) -> CalibrationResult:
    """The greedy search of the module docstring; `prompts` replace the drawn sample prompts."""
    config = config or CalibrationConfig()
    costs = costs or SkipCosts.measured(target)
    started = time.perf_counter()
    num_layers = target.config.num_hidden_layers
    if num_layers < 2:
        raise EyasError("layer skipping needs a target with at least 2 decoder layers")
    reference = _reference(target, prompts or _sample_prompts(target, config), config.new_tokens)
    trials: list[_Trial] = []

    def evaluate(skip: frozenset[int]) -> _Trial:
        matches, confidence = measure_skip_set(target, reference, skip)
        trials.append(score(skip, matches, confidence, reference.row_groups, num_layers,
                            config, costs))
        return trials[-1]

    # 1. Rank the layers by how little each one changes the residual stream.
    influence = block_influence(reference, target.config.hidden_size)
    ranked = sorted(range(num_layers), key=lambda layer: (influence[layer], layer))
    # 2. Greedy additions from that ranking.
    skip: frozenset[int] = frozenset()
    best: _Trial | None = None
    stalled = 0
    while len(skip) < num_layers - 1 and stalled < config.patience:
        candidates = [layer for layer in ranked if layer not in skip][: config.beam]
        added = max((evaluate(skip | {layer}) for layer in candidates),
                    key=lambda trial: (trial.speedup, -max(trial.skip - skip)))
        skip = added.skip
        if log:
            print(f"[eyas] layerskip calibration: skip {sorted(skip)} -> modeled speedup "
                  f"{added.speedup:.3f} (k={added.draft_length}, c={added.min_confidence}, "
                  f"acceptance {added.acceptance:.3f})", file=sys.stderr, flush=True)
        if best is None or added.speedup > best.speedup + 1e-9:
            best, stalled = added, 0
        else:
            stalled += 1
    # 3. The best set seen.
    assert best is not None
    return CalibrationResult(
        skip_layers=sorted(best.skip), draft_length=best.draft_length,
        min_confidence=best.min_confidence, acceptance=best.acceptance,
        tokens_per_step=best.tokens_per_step, expected_speedup=best.speedup, evaluated=len(trials),
        seconds=time.perf_counter() - started, prompts=len(reference.row_groups),
        rows=sum(reference.row_groups))


def calibration_cache_path(target: Target, config: CalibrationConfig) -> Path:
    key = "|".join([str(target.folder), target.precision, str(target.device),
                    str(torch.get_num_threads()), platform.processor() or platform.machine(),
                    torch.__version__, json.dumps(asdict(config), sort_keys=True)])
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "layerskip" / f"{digest}.json"


def load_or_calibrate(target: Target, config: CalibrationConfig | None = None) -> CalibrationResult:
    """The calibration of this model, precision, machine and config: measured once, cached."""
    config = config or CalibrationConfig()
    path = calibration_cache_path(target, config)
    if path.is_file():
        raw = json.loads(path.read_text())
        return CalibrationResult(**raw["result"])
    print(f"[eyas] layerskip: calibrating which layers to skip on {config.num_prompts} sample "
          f"prompts (once; cached in {path.parent})", file=sys.stderr, flush=True)
    result = calibrate(target, config)
    write_json_atomic(path, {"config": asdict(config), "result": asdict(result)})
    print(f"[eyas] layerskip: skip {result.skip_layers} of {target.config.num_hidden_layers} layers, "
          f"chains of <= {result.draft_length}, confidence >= {result.min_confidence}: acceptance "
          f"{result.acceptance:.2f}, modeled speedup {result.expected_speedup:.2f} "
          f"({result.seconds:.0f} s)", file=sys.stderr, flush=True)
    if result.expected_speedup < 1.0:
        print("[eyas] layerskip: no skip set is modeled to beat plain decoding on this model and "
              "machine; the fallback policy will switch speculation off where it does not pay",
              file=sys.stderr, flush=True)
    return result
