"""Draft-tree sizing from measured costs, not GPU defaults.

On a GPU verifying 60 tokens costs about one token's step; on a CPU it does not (SmolLM2-135M:
8 tokens ~2.2 single-token steps). So the best tree is chosen from:

- `CostModel`: the measured wall time of one target pass over T tokens (T = 1..64) and of one
  draft-head pass over R rows, at the batch size in use; measured once per machine, model and
  precision and cached as JSON under the eyas cache.
- `RankStats`: acceptance observed online: at depth d, how often the target's token was the
  draft's rank-r child (r = 1..k) or none of them.
- `expected_tokens(shape, ranks)`: builds the candidate set the EAGLE-2 expansion would build
  for that shape (a node's probability of lying on the accepted path = the product of its rank
  probabilities along the path), keeps the best total - 1, and sums their probabilities: the
  expected accepted tokens per step; + 1 for the bonus token.
- `choose_shape`: the (depth, top_k, total) that maximises expected tokens per second.

A steep verification curve picks a short chain; a flat one picks a wide, deep tree.
"""

from __future__ import annotations

import hashlib
import heapq
import json
import os
import platform
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path
from typing import Callable

import torch

from eyas.models import fused_cpu
from eyas.utils.io import cache_dir, write_json_atomic

TOKEN_SIZES = (1, 2, 3, 4, 5, 6, 8, 10, 12, 16, 20, 24, 32, 48, 64)
PRIOR_RANKS = (0.55, 0.12, 0.05, 0.03)  # P(target token = rank-r child), before any data
COST_VERSION = "8"  # part of the cache key: bumped when what a measurement times changes


@dataclass
class CostModel:
    verify_seconds: dict[int, float]  # tokens in one target pass -> seconds
    draft_seconds: dict[int, float] = field(default_factory=lambda: {1: 0.0})  # head rows -> s

    @staticmethod
    def _interpolate(table: dict[int, float], x: int) -> float:
        points = sorted(table.items())
        if x <= points[0][0]:
            return points[0][1]
        if len(points) == 1:  # one measurement: proportional beyond it
            return points[0][1] * x / points[0][0]
        for (x0, y0), (x1, y1) in zip(points, points[1:]):
            if x <= x1:
                return y0 + (y1 - y0) * (x - x0) / (x1 - x0)
        (x0, y0), (x1, y1) = points[-2], points[-1]  # extrapolate the last segment
        return y1 + (y1 - y0) * (x - x1) / max(x1 - x0, 1)

    def verify(self, tokens: int) -> float:
        return self._interpolate(self.verify_seconds, tokens)

    def draft(self, rows: int) -> float:
        return self._interpolate(self.draft_seconds, rows)

    def tree_draft(self, depth: int, top_k: int) -> float:
        """Seconds of drafting a depth x top_k tree: one head pass per level, the first over
        one row, each further one over the top_k nodes expanded."""
        return sum(self.draft(1 if level == 1 else top_k) for level in range(1, depth + 1))

    def calibrated(self, plain_factor: float, speculative_factor: float) -> CostModel:
        """This model with a one-token pass scaled by `plain_factor` and every other pass and
        head pass by `speculative_factor`: what the decode loop measured against what was
        modelled (Eagle3Proposer.step_seconds)."""
        verify = {t: s * (plain_factor if t == 1 else speculative_factor)
                  for t, s in self.verify_seconds.items()}
        verify.setdefault(1, self.verify(1) * plain_factor)
        return CostModel(verify, {r: s * speculative_factor for r, s in self.draft_seconds.items()})

    def relative(self) -> dict[int, float]:
        """Verification cost relative to a single-token step (what the docs quote)."""
        one = self.verify(1)
        return {t: round(s / one, 3) for t, s in sorted(self.verify_seconds.items())}


def _interleaved_medians(steps: dict[int, Callable[[], None]], repeats: int,
                         before: Callable[[], None] | None = None) -> dict[int, float]:
    """Median seconds of each step, timed in `repeats` rounds that visit every size in turn: a
    burst of load on a shared machine then lands on one round of many sizes, not on every repeat
    of one size (timed size after size, such a burst once priced a one-token pass above a
    two-token one, and the sizer drafted trees that ran at 0.96x plain).

    Each round visits the sizes from the largest down, so that a pass is timed after one of
    the next size up, as decoding runs them (passes of a few rows, one after the other). A
    pass of few rows right after a wide one runs slower for several passes: on a 2-core Xeon
    (model 167) a one-token pass took 6.0, 5.8, 5.2, 4.8 ms after a 64-token pass against
    4.4 ms after a two-token one. Visited in increasing order, each round timed its one-token
    pass right after the previous round's 64-token one, and the curve priced a one-token pass
    at 6.5 ms where decoding's took 4.3, and two to four tokens hardly more: the sizer took
    drafts for nearly free."""
    order = sorted(steps, reverse=True)
    for size in order:
        steps[size]()  # warm-up
    times: dict[int, list[float]] = {size: [] for size in steps}
    for _ in range(repeats):
        for size in order:
            step = steps[size]
            if before is not None:
                before()
            started = time.perf_counter()
            step()
            times[size].append(time.perf_counter() - started)
    return {size: sorted(values)[len(values) // 2] for size, values in times.items()}


def _own_load() -> float:
    """This process's share of the load average: its CPU seconds over its life (0 where /proc
    cannot say when it started)."""
    try:
        ticks = os.sysconf("SC_CLK_TCK")
        started = int(Path("/proc/self/stat").read_text().rsplit(")", 1)[1].split()[19]) / ticks
        alive = float(Path("/proc/uptime").read_text().split()[0]) - started
    except (OSError, ValueError, IndexError):
        return 0.0
    used = os.times()
    return (used.user + used.system) / max(alive, 1.0)


def machine_busy() -> bool:
    """Whether other work competes for the cores now: the 1-minute load average, less this
    process's own share of it, above one core. Costs measured then are not worth caching."""
    try:
        load = os.getloadavg()[0]
    except OSError:  # no load average on this platform
        return False
    return load - _own_load() > 1.0


def _evict_caches(megabytes: int = 64) -> Callable[[], None]:
    """A call that reads `megabytes` of other memory: in decoding, the head runs right after a
    target pass has pushed its weights out of the CPU caches, and a head pass timed with warm
    caches cost half of what the decode loop then saw (old BENCHMARKS.md section 6g)."""
    buffer = torch.ones(megabytes * (1 << 20) // 4)
    return lambda: float(buffer.sum())


# What the timed passes read and predict: text, so that the output layer's screen leaves as few
# candidates to re-check exactly as in decoding. A context of one repeated id leaves the model
# unsure of everything: the 1.5B Qwen's re-check then read hundreds of rows, 13% of its pass.
SAMPLE_TEXT = (
    "The river rose in the night, and by morning the lower fields were under water. Farmers "
    "moved their animals to the hill, where the old church stood, and waited for the rain to "
    "stop. In the town the baker opened as usual, because people still needed bread, and the "
    "school stayed closed for three days. When the water went down, it left mud on every road "
    "and a line on the walls that showed how high it had come. def mean(values):\n    "
    "return sum(values) / len(values)\n\nprint(mean([1, 2, 3, 4]))\n")


def sample_tokens(target, count: int) -> torch.Tensor:
    """[1, count] token ids of SAMPLE_TEXT (repeated as needed) in the target's tokenizer; ids
    0.. where a target has no tokenizer."""
    tokenizer = getattr(target, "tokenizer", None)
    ids = tokenizer(SAMPLE_TEXT)["input_ids"] if tokenizer is not None else []
    ids = [i for i in ids if i < target.config.vocab_size] or list(range(min(64, target.config.vocab_size)))
    repeated = (ids * (count // len(ids) + 1))[:count]
    return torch.tensor([repeated], dtype=torch.long, device=target.device)


def prefill_context(target, cache, context: int) -> None:
    """Writes `context` tokens of sample text at slots 0.. of every row of `cache` (what
    verify_pass and bench/profile.py's batch_pass follow)."""
    ids = sample_tokens(target, context).expand(cache.batch_size, context).contiguous()  # [B, context]
    target.model(ids, cache=cache, write_at=0, logits_at=None)


@torch.inference_mode()
def measure_verify_costs(target, context: int = 256, sizes=TOKEN_SIZES, repeats: int = 5
                         ) -> dict[int, float]:
    """Seconds of one target pass over T new tokens after `context` cached tokens.

    Measured as greedy verification runs (the output layer screens for the argmax, see
    models/output_layer.py); sampled verification costs a little more per token."""
    from eyas.engine.generate import new_cache

    cache = new_cache(target, 1, context + max(sizes) + 1)
    prefill_context(target, cache, context)
    return _interleaved_medians({size: verify_pass(target, cache, context, size) for size in sizes}, repeats)


def verify_pass(target, cache, context: int, size: int) -> Callable[[], None]:
    """One greedy target pass over `size` new tokens written after `context` cached ones, each
    seeing the context and every new token (the tree mask for size > 1): the pass
    measure_verify_costs times, and bench/profile.py splits."""
    device = target.device
    ids = sample_tokens(target, context + size)[:, context:]  # [1, T]: the text goes on
    mask = torch.ones(1, size, context + size, dtype=torch.bool, device=device)  # [1, T, context + T]

    def step() -> None:
        target.model(ids, cache=cache, write_at=context, attn_mask=mask if size > 1 else None,
                     kv_len=context + size, greedy=True)
    return step


@torch.inference_mode()
def measure_draft_costs(head, context: int = 256, rows=(1, 2, 3, 4, 6, 8), repeats: int = 5
                        ) -> dict[int, float]:
    """Seconds of one head pass over R rows after `context` committed rows, logits included,
    on the path the proposer takes (the fused C++ layer where it is built, eagle3/fused.py,
    else Eagle3Head.forward), each timed after the CPU caches were emptied (on a CPU)."""
    from eyas.eagle3.fused import FusedHead

    config = head.config
    device, dtype = head.device, head.dtype
    past_taps = torch.zeros(1, context, config.fused_input_size, dtype=dtype, device=device)
    context_ids = torch.zeros(1, context, dtype=torch.long, device=device)
    fused = FusedHead.build(head)
    evict = _evict_caches() if device.type == "cpu" else None
    if fused is not None:
        cache = fused.new_cache()
        fused.run(past_taps[0], context_ids[0], torch.arange(context), 0, cache)
    else:
        past = head(past_taps, context_ids, torch.arange(context, device=device)[None]).past_kv
    steps = {}
    for count in rows:
        hidden = torch.zeros(1, count, config.hidden_size, dtype=dtype, device=device)
        ids = torch.zeros(1, count, dtype=torch.long, device=device)
        positions = torch.full((1, count), context, device=device)
        mask = torch.ones(1, count, context + count, dtype=torch.bool, device=device)
        if fused is not None:
            def step(hidden=hidden, ids=ids, positions=positions, mask=mask):
                return head.compute_logits(fused.run(hidden[0], ids[0], positions[0], context, cache, mask[0]))
        else:
            def step(hidden=hidden, ids=ids, positions=positions, mask=mask):
                return head(hidden, ids, positions, attn_mask=mask, past_kv=past)
        steps[count] = step
    return _interleaved_medians(steps, repeats, before=evict)


def cost_cache_path(key: str) -> Path:
    digest = hashlib.sha256(key.encode()).hexdigest()[:16]
    return cache_dir() / "costs" / f"{digest}.json"


def load_or_measure(target, head=None, sizes: tuple[int, ...] = TOKEN_SIZES) -> CostModel:
    """The cost model of this machine + model + precision (+ head), measured once and cached;
    `sizes`: the pass lengths T measured (a draft model's single-token pass: (1, 2))."""
    from eyas.eagle3.fused import FusedHead

    head_key = "" if head is None else json.dumps({**head.config.to_dict(), "precision": head.precision,
                                                   "fused": FusedHead.supported(head)}, sort_keys=True)
    layers = fused_cpu.kernel_tag(target.model)  # fused or Python layers, int4 kernel, sources
    key = "|".join([COST_VERSION, str(target.folder), target.precision, layers, str(target.device),
                    str(torch.get_num_threads()), platform.processor() or platform.machine(),
                    torch.__version__, head_key] + ([] if sizes == TOKEN_SIZES else [str(sizes)]))
    path = cost_cache_path(key)
    if path.is_file():
        raw = json.loads(path.read_text())
        return CostModel({int(k): v for k, v in raw["verify_seconds"].items()},
                         {int(k): v for k, v in raw["draft_seconds"].items()})
    busy = machine_busy()
    model = CostModel(measure_verify_costs(target, sizes=sizes),
                      measure_draft_costs(head) if head is not None else {1: 0.0})
    if busy or machine_busy():  # used now, measured again by the next process
        print(f"[eyas] note: the machine was busy (load average {os.getloadavg()[0]:.1f}) while the "
              f"draft-tree sizer timed its passes; they are not cached", flush=True)
    else:
        write_json_atomic(path, {"key": key, **asdict(model)})
    return model


@dataclass
class TreeChoice:
    depth: int
    top_k: int
    total_tokens: int
    expected_tokens: float  # per step, bonus included
    seconds: float  # per step: verification + drafting
    tokens_per_second: float


def candidate_probabilities(depth: int, top_k: int, ranks: list[float]) -> list[float]:
    """P(on the accepted path) of every candidate the EAGLE-2 expansion builds for a depth x
    top_k tree under rank probabilities, largest first."""
    rank_probs = [ranks[r] if r < len(ranks) else 0.0 for r in range(top_k)]
    candidates = [p for p in rank_probs]  # depth 1
    frontier = heapq.nlargest(top_k, candidates)
    for _ in range(2, depth + 1):
        children = [parent * p for parent in frontier for p in rank_probs]
        candidates.extend(children)
        frontier = heapq.nlargest(top_k, children)
    return sorted(candidates, reverse=True)


def accepted_by_size(depth: int, top_k: int, ranks: list[float]) -> list[float]:
    """Expected accepted tokens per step of a depth x top_k tree cut to n candidates, for n =
    0, 1, ... every candidate (the best n are kept: a running sum of candidate_probabilities)."""
    sums = [0.0]
    for probability in candidate_probabilities(depth, top_k, ranks):
        sums.append(sums[-1] + probability)
    return sums


def expected_tokens(depth: int, top_k: int, total: int, ranks: list[float]) -> float:
    """Expected tokens per step (bonus included) of an EAGLE-2 tree under rank probabilities:
    the best total - 1 candidates are kept."""
    accepted = accepted_by_size(depth, top_k, ranks)
    return 1.0 + accepted[min(max(total - 1, 0), len(accepted) - 1)]


def best_prefix(on_path: list[float], cost: CostModel, draft_seconds: float = 0.0,
                plain: bool = True, draft_per_token: float = 0.0) -> int:
    """How many candidates to verify, best first (`on_path`: each one's probability of lying on
    the accepted path, never rising), for the most expected tokens per second, (1 + sum of the
    first n) / (verify(1 + n) + draft_seconds + n x draft_per_token). 0 is a plain step,
    1 / verify(1); with plain=False at least one candidate is verified."""
    best_count, best_rate = (0, 1.0 / cost.verify(1)) if plain else (1, 0.0)
    tokens = 1.0
    for count, probability in enumerate(on_path, start=1):
        tokens += probability
        rate = tokens / (cost.verify(count + 1) + draft_seconds + count * draft_per_token)
        if rate > best_rate:
            best_count, best_rate = count, rate
    return best_count


def choose_shape(cost: CostModel, ranks: list[float], max_depth: int = 8, max_top_k: int = 4,
                 max_total: int = 64) -> TreeChoice:
    """The shape with the most expected tokens per second (plain decoding = depth 0)."""
    # Every shape reads the same verification costs: look them up once (the single-stream loop
    # chooses again every 16 steps, and ~1,300 interpolations each time cost ~3% of a step).
    verify = [0.0] + [cost.verify(total) for total in range(1, max_total + 1)]
    plain = verify[1]
    best = TreeChoice(0, 0, 1, 1.0, plain, 1.0 / plain)
    for depth in range(1, max_depth + 1):
        for top_k in range(1, max_top_k + 1):
            draft_seconds = cost.tree_draft(depth, top_k)
            largest = min(max_total, 1 + sum(top_k ** min(level, 2) for level in range(1, depth + 1)))
            accepted = accepted_by_size(depth, top_k, ranks)
            for total in range(2, largest + 1):
                tokens = 1.0 + accepted[min(total - 1, len(accepted) - 1)]
                seconds = verify[total] + draft_seconds
                if tokens / seconds > best.tokens_per_second:
                    best = TreeChoice(depth, top_k, total, tokens, seconds, tokens / seconds)
    return best


class RankStats:
    """Online estimate of P(target token = rank-r child) with the prior as pseudo-counts."""

    def __init__(self, max_rank: int = 4, prior_weight: float = 20.0) -> None:
        self.counts = [p * prior_weight for p in PRIOR_RANKS[:max_rank]]
        self.counts += [0.0] * (max_rank - len(self.counts))
        self.total = prior_weight

    def record(self, rank: int | None) -> None:
        """rank: 1-based rank of the accepted child among the drafted children, None = miss."""
        self.total += 1
        if rank is not None and rank <= len(self.counts):
            self.counts[rank - 1] += 1

    @property
    def probabilities(self) -> list[float]:
        return [c / self.total for c in self.counts]
