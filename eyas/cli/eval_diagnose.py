"""`eyas eval diagnose`: what limits a draft head, on a fixed held-out split.

Examples:
    eyas eval diagnose                                           # the shipped SmolLM2 head
    eyas eval diagnose --head runs/head/train/head --held-out-prompts 48 --max-tokens 128
    eyas eval diagnose --vocab-data runs/head/train.tokenized.jsonl --mtbench-prompts 0

Measured over the same positions (the target rows that predict an answer token), on the
target's greedy answers to held-out prompts (the eval split of `eyas data prepare`, never
trained on) and to a slice of the training prompts, both picked by a fixed hash of the ids:
  coverage     share of positions whose greedy token lies inside the head's draft vocabulary,
               and inside vocabularies of other sizes built by eyas's frequency rule
  peakedness   share of positions where the target's top-1 probability is < 0.5, and its mean
  head         accuracy at each TTT step, teacher-forced on the target's features (training vs
               held out shows under- or over-fitting), step 0 by the target's confidence
  layer-skip   first-step agreement of the target without its n least influential layers
  MT-Bench     acceptance by draft position (`eyas eval`), unless --mtbench-prompts 0
Writes diagnose.json (every figure, atomically) and diagnose.md to --output-dir and prints
the table. docs/training.md, "What limits the head", reads the shipped head's.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eyas.bench.diagnose.config import TARGET_DTYPES, DiagnoseConfig


def _ints(text: str) -> tuple[int, ...]:
    try:
        return tuple(int(part) for part in text.split(",") if part.strip())
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers, got '{text}'") from None


def register(eval_subparsers: argparse._SubParsersAction) -> None:
    d = {name: field.default for name, field in DiagnoseConfig.__dataclass_fields__.items()}
    parser = eval_subparsers.add_parser(
        "diagnose", help="what limits a draft head: coverage, peakedness, per-step accuracy, "
                         "layer-skip, MT-Bench acceptance",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=d["model"], help="target (default: %(default)s)")
    parser.add_argument("--head", default=d["head"],
                        help="head folder or shipped head name (default: %(default)s)")
    parser.add_argument("--target-dtype", default=d["target_dtype"], choices=TARGET_DTYPES,
                        help="precision of the teacher-forced target passes; the shipped head's "
                             "features were float32 (default: %(default)s)")
    parser.add_argument("--prompts", default=None,
                        help="folder with the train.jsonl and eval.jsonl of `eyas data prepare` "
                             "(default: the embedded ShareGPT, prepared as the shipped head's "
                             "recipe did, cached)")
    parser.add_argument("--held-out-prompts", type=int, default=d["held_out_prompts"],
                        help="default: %(default)s")
    parser.add_argument("--train-prompts", type=int, default=d["train_prompts"],
                        help="0 = no training slice (default: %(default)s)")
    parser.add_argument("--train-pool", type=int, default=d["train_pool"],
                        help="the training slice is picked from the first N lines of train.jsonl "
                             "(default: %(default)s, the shipped head's first stage)")
    parser.add_argument("--max-tokens", type=int, default=d["max_tokens"],
                        help="greedy answer length (default: %(default)s)")
    parser.add_argument("--vocab-sizes", type=_ints, default=d["vocab_sizes"],
                        help="frequency-rule vocabulary sizes (default: 8192,16384,32768)")
    parser.add_argument("--vocab-data", default=d["vocab_data"],
                        help="tokenized .jsonl whose answer tokens are counted, or "
                             "sharegpt-answers (default: %(default)s)")
    parser.add_argument("--vocab-pool", type=int, default=d["vocab_pool"],
                        help="sharegpt-answers: count the answers to the first N train prompts "
                             "(default: %(default)s)")
    parser.add_argument("--ttt-steps", type=int, default=d["ttt_steps"], help="default: %(default)s")
    parser.add_argument("--skip-counts", type=_ints, default=d["skip_counts"],
                        help="layer-skip drafts leaving out n layers, for each n (default: 1,2,4)")
    parser.add_argument("--mtbench-prompts", type=int, default=d["mtbench_prompts"],
                        help="0 = no MT-Bench run (default: %(default)s)")
    parser.add_argument("--mtbench-tokens", type=int, default=d["mtbench_tokens"],
                        help="default: %(default)s")
    parser.add_argument("--eval-dtype", default=d["eval_dtype"],
                        help="precision of the MT-Bench run (default: %(default)s)")
    parser.add_argument("--tree", default=None,
                        help="MT-Bench draft tree, as `eyas eval --tree` (default: chain:K, K = --ttt-steps)")
    parser.add_argument("--output-dir", default="runs/diagnose",
                        help="where diagnose.json and diagnose.md go (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars or log lines")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from eyas.bench.diagnose import format_table, run_diagnose
    from eyas.utils.io import write_json_atomic, write_text_atomic

    config = DiagnoseConfig(
        model=args.model, head=args.head, target_dtype=args.target_dtype, prompts=args.prompts,
        held_out_prompts=args.held_out_prompts, train_prompts=args.train_prompts,
        train_pool=args.train_pool, max_tokens=args.max_tokens, vocab_sizes=args.vocab_sizes,
        vocab_data=args.vocab_data, vocab_pool=args.vocab_pool, ttt_steps=args.ttt_steps,
        skip_counts=args.skip_counts, mtbench_prompts=args.mtbench_prompts,
        mtbench_tokens=args.mtbench_tokens, eval_dtype=args.eval_dtype, tree=args.tree)
    log = (lambda message: None) if args.no_progress else (
        lambda message: print(f"[eyas] diagnose: {message}", file=sys.stderr, flush=True))
    report = run_diagnose(config, progress=not args.no_progress, log=log)
    table = format_table(report)
    out = Path(args.output_dir)
    write_json_atomic(out / "diagnose.json", report)
    write_text_atomic(out / "diagnose.md", table)
    sys.stdout.write(table)
    print(f"[eyas] wrote {out / 'diagnose.json'} and {out / 'diagnose.md'}", file=sys.stderr)
    return 0
