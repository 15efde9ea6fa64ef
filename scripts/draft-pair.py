"""Does a draft model pay for its target? Plain and speculative decoding side by side, prompt by
prompt, timed in CPU seconds (1 thread: a busy machine stretches both alike), with the costs
that decide it measured in the same run.

    OMP_NUM_THREADS=1 python scripts/draft-pair.py TARGET DRAFT [DATASET] [PROMPTS] [TOKENS] [FLAGS]
    OMP_NUM_THREADS=1 python scripts/draft-pair.py qwen2.5-coder-1.5b qwen2.5-coder-0.5b mtbench 6 64
    ... --no-policy   # every step drafts (the method itself, without the fallback to plain)
    ... --vocab=0     # also, side by side: greedy drafts over N first token ids + the special
                      # tokens (proposers/draft_vocabulary.py; 0: the whole vocabulary)
    ... --unpriced    # also, side by side: the same draft unpriced (the whole budget every step)

Printed: per prompt, plain and speculative CPU seconds, their ratio, tau, the steps that fell
back to plain; then the medians and totals, and the arithmetic: one draft token's cost, the
target's pass over T = 1..k+1 tokens, and the speed-up that tau predicts from them,

    tau x verify(1) / (verify(k + 1) + k x draft_token)

Greedy output is checked equal to plain on every prompt.
"""

from __future__ import annotations

import statistics
import sys
import time

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.methods import DRAFT_VOCABULARY, build_proposer
from eyas.engine.speculative.policy import PolicyConfig
from eyas.engine.speculative.proposers.draft_model import DraftModelProposer
from eyas.engine.speculative.sizing import measure_verify_costs
from eyas.engine.target import load_target
from eyas.scheduler.measure import load_prompts


def cpu_seconds(fn):
    started = time.process_time()
    value = fn()
    return value, time.process_time() - started


@torch.inference_mode()
def draft_token_seconds(proposer, repeats: int = 12) -> float:
    """CPU seconds of one greedy draft token after 256 cached tokens (median), as propose() runs it."""
    proposer.begin(proposer.draft, [0] * 256, SamplingParams())
    proposer.propose([0] * 256, 1)  # catch-up: the draft's prefill
    times = []
    for index in range(repeats):
        ids = [0] * (257 + index)
        _, seconds = cpu_seconds(lambda: proposer.propose(ids, 1))
        times.append(seconds)
    return statistics.median(times)


def main(target_name: str, draft_name: str, dataset: str = "mtbench", num_prompts: int = 6,
         max_tokens: int = 64, policy: bool = True, k: int = 4, vocabulary: int | None = None,
         unpriced: bool = False) -> None:
    target = load_target(target_name, dtype="int4")
    proposer = build_proposer(f"model:{draft_name}", target)
    others = {}  # systems beside it: label -> proposer
    if vocabulary is not None:
        others[f"vocabulary {vocabulary or 'whole'}"] = DraftModelProposer(proposer.draft, priced=True,
                                                                vocabulary_size=vocabulary)
    if unpriced:
        others[f"unpriced k={k}"] = DraftModelProposer(proposer.draft, vocabulary_size=DRAFT_VOCABULARY)
    params = SamplingParams(max_tokens=max_tokens)
    prompts = load_prompts(target, dataset, num_prompts)
    config = PolicyConfig(enabled=policy)
    generate(target, prompts[0], SamplingParams(max_tokens=4))  # warm-up
    speculative_generate(target, prompts[0], SamplingParams(max_tokens=8), proposer, k, policy=config)
    for other in others.values():
        speculative_generate(target, prompts[0], SamplingParams(max_tokens=8), other, k, policy=config)
    rows, other_rows = [], {label: [] for label in others}
    print(f"{target_name} (int4) + draft {draft_name} ({proposer.draft.precision}), {dataset}, "
          f"{len(prompts)} x {max_tokens} tokens, k={k}, policy {'on' if policy else 'off'}, "
          f"{torch.get_num_threads()} thread(s), CPU seconds")
    print("prompt  tokens  plain_s  spec_s  speedup  tau   draft_s verify_s plain_steps fallbacks equal")
    for index, prompt in enumerate(prompts):
        plain, plain_s = cpu_seconds(lambda: generate(target, prompt, params))
        spec, spec_s = cpu_seconds(lambda: speculative_generate(target, prompt, params, proposer, k,
                                                                policy=config))
        stats = spec.stats["speculative"]
        equal = spec.token_ids == plain.token_ids
        rows.append((len(plain.token_ids), plain_s, spec_s, stats["acceptance_length"]))
        print(f"{index:6d}  {len(plain.token_ids):6d}  {plain_s:7.2f}  {spec_s:6.2f}  {plain_s / spec_s:6.2f}x"
              f"  {stats['acceptance_length']:4.2f}  {stats['draft_seconds']:7.2f} {stats['verify_seconds']:8.2f}"
              f" {stats['plain_steps']:11d} {stats['fallbacks']:9d} {equal}")
        for label, other in others.items():
            result, other_s = cpu_seconds(lambda: speculative_generate(target, prompt, params, other, k,
                                                                       policy=config))
            other_rows[label].append((plain_s, other_s, result.stats["speculative"]["acceptance_length"]))
            print(f"        {label}: {other_s:6.2f} s  {plain_s / other_s:5.2f}x  tau "
                  f"{result.stats['speculative']['acceptance_length']:4.2f}  "
                  f"equal {result.token_ids == plain.token_ids}")
        if "cost_ratios" in stats:  # the chain's prices after this prompt (chain_pricing.py)
            print(f"        prices: {stats['cost_ratios']}, draft pass {stats['draft_pass_ms']} ms, "
                  f"target pass {stats['verify_1_ms']} ms, acceptance {stats['acceptance_rates'][:5]}")
    ratios = [p / s for _, p, s, _ in rows]
    total = sum(p for _, p, _, _ in rows) / sum(s for _, _, s, _ in rows)
    print(f"speed-up: median {statistics.median(ratios):.2f}x, total {total:.2f}x "
          f"(tokens/s ratios, CPU time)")
    for label, pairs in other_rows.items():
        print(f"{label}: median {statistics.median([p / s for p, s, _ in pairs]):.2f}x, "
              f"total {sum(p for p, _, _ in pairs) / sum(s for _, s, _ in pairs):.2f}x")
    # The arithmetic beside it.
    saved, time.perf_counter = time.perf_counter, time.process_time  # CPU time, as above
    try:
        verify = measure_verify_costs(target, sizes=tuple(range(1, k + 2)))
    finally:
        time.perf_counter = saved
    draft = draft_token_seconds(DraftModelProposer(proposer.draft, vocabulary_size=DRAFT_VOCABULARY))
    # tau of k-token chains: the unpriced system's where it ran, else the priced one's
    chains = other_rows.get(f"unpriced k={k}") or rows
    taus = [tau for *_, tau in chains if tau > 0]
    tau = statistics.mean(taus) if taus else 1.0
    step = verify[k + 1] + k * draft
    print("target pass, ms by T: " + ", ".join(f"{t}: {s * 1e3:.1f}" for t, s in verify.items())
          + f"; draft token {draft * 1e3:.1f} ms (CPU time)")
    print(f"predicted at tau {tau:.2f}, k={k}: {tau:.2f} x {verify[1] * 1e3:.1f} / ({verify[k + 1] * 1e3:.1f}"
          f" + {k} x {draft * 1e3:.1f}) = {tau * verify[1] / step:.2f}x; the draft costs"
          f" {draft / verify[1]:.2f} of a target token, verifying {k + 1} {verify[k + 1] / verify[1]:.2f}")


if __name__ == "__main__":
    flags = [a for a in sys.argv[1:] if a.startswith("--")]
    args = [a for a in sys.argv[1:] if not a.startswith("--")]
    if len(args) < 2:
        raise SystemExit(__doc__)
    vocab = [int(f.split("=", 1)[1]) for f in flags if f.startswith("--vocab=")]
    main(args[0], args[1], *(args[2:3]), *[int(a) for a in args[3:5]], policy="--no-policy" not in flags,
         vocabulary=vocab[0] if vocab else None, unpriced="--unpriced" in flags)
