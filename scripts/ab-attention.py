"""A/B of the fused stack's attention (csrc/attention.cpp) between two checkouts, alternating in
one run: the "attention" phase of the stack's own timers (csrc/phase_timer.h, CPU clock, one
thread) in real passes of an int4 target over a one-token step, random draft trees of 8..64 rows
and prefill chunks of 256 rows, all after `--context` cached tokens (the chunk also after 1,000).

Each checkout runs in its own worker process (its sources on PYTHONPATH, its extension folder in
EYAS_EXT_DIR, OMP_NUM_THREADS=1); the parent asks A then B for one pass of each case, `--rounds`
times, and prints the medians per 30-layer pass (ms), their ratio, and the useful multiply-adds
per ns (scores and weighted sums of the keys each query sees) next to the machine's FMA peak
where the run measured one.

Usage:
    python scripts/ab-attention.py --a /work/main --a-ext ~/.cache/eyas/ext --b . --b-ext /tmp/ext-b
    python scripts/ab-attention.py --a /work/main --b . --rounds 9 --cases 1,8,32,prefill256
"""

from __future__ import annotations

import argparse
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

TREE_ROWS = (8, 16, 32, 64)


def cases(context: int) -> dict[str, tuple[int, int]]:
    """name -> (context, rows): a one-token step, trees, and prefill chunks of 256 rows."""
    table = {"1": (context, 1)}
    table.update({str(rows): (context, rows) for rows in TREE_ROWS})
    table["prefill256"] = (context, 256)
    table["prefill256@1000"] = (1000, 256)
    return table


def tree_mask(context: int, size: int, seed: int):
    """[1, T, context + T]: a random tree (each node a child of an earlier one) after the context."""
    import torch

    from eyas.engine.speculative.draft import DraftTree
    from eyas.engine.speculative.tree import tree_mask as draft_tree_mask

    generator = torch.Generator().manual_seed(seed)
    parents = torch.tensor([int(torch.randint(0, node, (1,), generator=generator)) for node in range(1, size)],
                           dtype=torch.long)
    tree = DraftTree(torch.zeros(size - 1, dtype=torch.long), parents)
    return torch.cat([torch.ones(size, context, dtype=torch.bool), draft_tree_mask(tree)], dim=1)[None]


def worker(model: str) -> None:
    """Reads case names on stdin; answers each with the attention phase's CPU seconds of one pass."""
    import torch

    from eyas.engine.generate import new_cache
    from eyas.engine.speculative.sizing import prefill_context, sample_tokens
    from eyas.engine.target import load_target
    from eyas.models import extension

    target = load_target(model, dtype="int4")
    native = extension.module()
    contexts = {}
    table = cases(256)
    for context in sorted({context for context, _ in table.values()}):
        cache = new_cache(target, 1, context + 257)
        with torch.inference_mode():
            prefill_context(target, cache, context)
        contexts[context] = cache
    print(json.dumps({"ready": True}), flush=True)
    for line in sys.stdin:
        name = line.strip()
        context, rows = table[name]
        ids = sample_tokens(target, context + rows)[:, context:]  # [1, T]
        if name.startswith("prefill"):
            mask = (torch.arange(context + rows)[None, :] <= (context + torch.arange(rows))[:, None])[None]
        else:
            mask = tree_mask(context, rows, seed=rows)
        native.phase_seconds(reset=True)
        native.set_phase_timing(True, "cpu")
        with torch.inference_mode():
            target.model(ids, cache=contexts[context], write_at=context, attn_mask=mask if rows > 1 else None,
                         kv_len=context + rows, greedy=True)
        native.set_phase_timing(False)
        seconds = dict(native.phase_seconds(reset=True))["attention"]
        print(json.dumps({"case": name, "seconds": seconds}), flush=True)


def start(checkout: Path, ext: str | None, model: str) -> subprocess.Popen:
    env = dict(os.environ, PYTHONPATH=str(checkout), OMP_NUM_THREADS="1")
    if ext:
        env["EYAS_EXT_DIR"] = ext
    process = subprocess.Popen([sys.executable, __file__, "--worker", "--model", model], cwd=checkout, env=env,
                               stdin=subprocess.PIPE, stdout=subprocess.PIPE, text=True)
    assert json.loads(process.stdout.readline()).get("ready")
    return process


def ask(process: subprocess.Popen, name: str) -> float:
    process.stdin.write(name + "\n")
    process.stdin.flush()
    return json.loads(process.stdout.readline())["seconds"]


def useful_fma(context: int, rows: int, name: str, layers: int = 30, heads: int = 9, head_dim: int = 64) -> int:
    """Multiply-adds of the scores and weighted sums over the keys each query sees."""
    if name.startswith("prefill"):
        keys = sum(context + t + 1 for t in range(rows))
    elif rows == 1:
        keys = context + 1
    else:
        keys = int(tree_mask(context, rows, seed=rows).sum())
    return 2 * keys * heads * head_dim * layers


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--a", type=Path, help="checkout A (e.g. the main branch)")
    parser.add_argument("--b", type=Path, help="checkout B")
    parser.add_argument("--a-ext", help="EYAS_EXT_DIR for A (default: inherited)")
    parser.add_argument("--b-ext", help="EYAS_EXT_DIR for B (default: inherited)")
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--rounds", type=int, default=7)
    parser.add_argument("--cases", default=",".join(cases(256)), help="comma-separated: " + ", ".join(cases(256)))
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    args = parser.parse_args()
    if args.worker:
        worker(args.model)
        return
    if args.a is None or args.b is None:
        parser.error("--a and --b name the two checkouts")
    table = cases(256)
    names = [name.strip() for name in args.cases.split(",") if name.strip()]
    unknown = [name for name in names if name not in table]
    if unknown:
        parser.error(f"unknown cases {unknown}: expected some of {', '.join(table)}")
    a, b = start(args.a.resolve(), args.a_ext, args.model), start(args.b.resolve(), args.b_ext, args.model)
    times = {(side, name): [] for side in "ab" for name in names}
    for _ in range(args.rounds):
        for name in names:
            times["a", name].append(ask(a, name))
            times["b", name].append(ask(b, name))
    for process in (a, b):
        process.stdin.close()
        process.wait()
    print(f"attention phase, CPU time, 1 thread, median of {args.rounds} alternating rounds (A = {args.a}, B = {args.b})")
    print(f"{'case':>16} {'A ms':>9} {'B ms':>9} {'A/B':>6} {'B FMA/ns':>9}")
    for name in names:
        context, rows = table[name]
        median_a, median_b = statistics.median(times["a", name]), statistics.median(times["b", name])
        rate = useful_fma(context, rows, name) / median_b / 1e9
        print(f"{name:>16} {median_a * 1e3:9.3f} {median_b * 1e3:9.3f} {median_a / median_b:6.2f} {rate:9.1f}")


if __name__ == "__main__":
    main()
