"""Regeneration throughput: fixed batches against the serving engine, alternated in one process.

Usage:
    OMP_NUM_THREADS=2 python scripts/bench-regenerate.py --input prepared/train.jsonl \
        --model smollm2-135m --prompts 64 --max-tokens 128 --rounds 2 \
        --arm batch:32 --arm engine:32
    python scripts/bench-regenerate.py --input prepared/train.jsonl --model smollm2-135m \
        --arm engine:32 --arm engine:32:int4        # the same engine, float32 against int4

Each arm runs `eyas data regenerate` (run_regenerate, the same code as the CLI) on the same
first --prompts records into a fresh output, greedy, with the target loaded once and shared, so
the arms differ only in how they decode. Arms alternate round by round (a shared machine's load
changes over minutes); the table gives each arm's tokens/s per round, the median, and the ratio
to the first arm. Greedy answers of every arm are compared with the first arm's (conversations
whose regenerated turns are equal). An arm may name its own precision (`engine:32:int4`;
--dtype otherwise); each precision's target is loaded once.
"""

from __future__ import annotations

import argparse
import json
import statistics
import tempfile
from pathlib import Path

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch

import eyas.engine.target as target_module
from eyas.data.endpoint import SamplingConfig
from eyas.data.pii.policy import PiiConfig
from eyas.data.regenerate import RegenerateConfig, run_regenerate


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--input", required=True)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="float32")
    parser.add_argument("--prompts", type=int, default=64)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--rounds", type=int, default=2)
    parser.add_argument("--arm", action="append", default=None,
                        help="batch:N (fixed batches of N) or engine:N (N conversations in flight), "
                             "optionally :DTYPE (a precision of --dtype's)")
    args = parser.parse_args()
    arms = args.arm or ["batch:32", "engine:32"]
    work = Path(tempfile.mkdtemp(prefix="bench-regenerate-"))
    prompts = work / "prompts.jsonl"
    with open(args.input, encoding="utf-8") as source:
        prompts.write_text("".join(line for _, line in zip(range(args.prompts), source)))
    # 1. Each precision's target once, shared by its arms (loading is not what is measured).
    load = target_module.load_target
    loaded = {dtype: load(args.model, dtype=dtype) for dtype in {arm_dtype(arm, args.dtype) for arm in arms}}
    target_module.load_target = lambda model, dtype, **k: loaded[dtype]
    rates: dict[str, list[float]] = {arm: [] for arm in arms}
    answers: dict[str, list] = {}
    for round_number in range(args.rounds):
        for arm in arms:
            kind, size = arm.split(":")[:2]
            output = work / f"{arm.replace(':', '-')}-{round_number}.jsonl"
            config = RegenerateConfig(
                input=str(prompts), output=output, model=args.model, dtype=arm_dtype(arm, args.dtype),
                batch_size=int(size) if kind == "batch" else None,
                concurrency=int(size) if kind == "engine" else 32,
                sampling=SamplingConfig(max_tokens=args.max_tokens), pii=PiiConfig(enabled=False),
                progress=False)
            report = run_regenerate(config).to_dict()
            rates[arm].append(report["tokens_per_second"])
            records = [json.loads(line) for line in output.read_text().splitlines()]
            answers[arm] = sorted((r["id"], r["conversations"]) for r in records)
            print(f"round {round_number + 1} {arm}: {report['completion_tokens']} tokens, "
                  f"{report['tokens_per_second']:.1f} tok/s", flush=True)
    # 2. The table.
    first = statistics.median(rates[arms[0]])
    print(f"\n{args.prompts} prompts x <= {args.max_tokens} tokens, {args.model} (--dtype {args.dtype}), "
          f"{torch.get_num_threads()} threads")
    for arm in arms:
        median = statistics.median(rates[arm])
        same = sum(mine == theirs for mine, theirs in zip(answers[arm], answers[arms[0]]))
        print(f"{arm:>15}: {' '.join(f'{r:.1f}' for r in rates[arm])} tok/s, median {median:.1f}, "
              f"{median / first:.2f}x {arms[0]}; conversations equal to {arms[0]}'s: "
              f"{same} of {len(answers[arm])}")


def arm_dtype(arm: str, default: str) -> str:
    """The precision an arm names (`engine:32:int4`), else the default."""
    parts = arm.split(":")
    return parts[2] if len(parts) > 2 else default


if __name__ == "__main__":
    main()
