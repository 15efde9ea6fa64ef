"""`eyas eval`: how well a drafting method does on a prompt set, single stream.

Examples:
    eyas eval --draft eagle3:smollm2-135m --dataset mtbench     # the shipped head
    eyas eval --draft eagle3:runs/smol/head --num-prompts 16 --tree chain:3 --output-dir runs/eval
    eyas eval --draft ngram --dataset code --dtype float32
    eyas eval --draft eagle3:runs/smol/head --temperature 1 --seed 0    # sampled: tau only
    eyas eval diagnose --head runs/smol/head     # what limits a head (`eyas eval diagnose -h`)

Every prompt is decoded plain, then speculatively, right after each other. Reported overall and
per category (MT-Bench has 8): tau (1 + accepted / verification steps; the bonus token counts),
acceptance rate by draft position, tokens/s of each and the speedup (medians over prompts,
prefill included), and under greedy decoding how many outputs are identical to plain (all of
them, or eyas has a bug). Writes eval.json (every prompt's figures) and eval.md to
--output-dir. The never-slower fallback is off by default, so that the method itself is
measured; --fallback measures what `eyas serve` would do.
"""

from __future__ import annotations

import argparse
import sys
from pathlib import Path

from eyas.bench.evaluate import DATASETS, EvalConfig
from eyas.cli.common import add_model_args


def register(subparsers: argparse._SubParsersAction) -> None:
    defaults = EvalConfig.__dataclass_fields__
    parser = subparsers.add_parser(
        "eval", help="tau, acceptance by position and speedup of a drafting method, per category",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--draft", default=defaults["draft"].default,
                        help="drafting method, as in `eyas generate --draft` (default: the "
                             "shipped SmolLM2 head, %(default)s)")
    parser.add_argument("--tree", default="auto",
                        help="EAGLE-3 draft tree: auto, chain:K or DEPTH,TOPK,TOTAL (default: auto)")
    parser.add_argument("--num-draft-tokens", type=int, default=defaults["num_draft_tokens"].default,
                        help="most draft tokens per step for methods without a tree of their "
                             "own (default: %(default)s)")
    parser.add_argument("--dataset", default="mtbench", choices=DATASETS,
                        help="prompt set: MT-Bench first turns (80, 8 categories) or the code set "
                             "(default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=defaults["num_prompts"].default,
                        help="default: %(default)s (all of MT-Bench)")
    parser.add_argument("--max-tokens", type=int, default=128, help="default: %(default)s")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy, where outputs must equal plain (default: 0)")
    parser.add_argument("--seed", type=int, default=0,
                        help="sampling seed of prompt i is SEED + i (default: 0)")
    parser.add_argument("--fallback", action="store_true",
                        help="let the never-slower policy switch speculation off when it does not pay")
    parser.add_argument("--output-dir", default="runs/eval",
                        help="where eval.json and eval.md go (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bar")
    parser.set_defaults(func=run)
    # `eyas eval diagnose ...`: what limits a head (eyas/cli/eval_diagnose.py)
    from eyas.cli import eval_diagnose

    eval_diagnose.register(parser.add_subparsers(dest="eval_command", metavar="diagnose"))


def run(args: argparse.Namespace) -> int:
    from eyas.bench.evaluate import format_markdown, run_eval
    from eyas.utils.io import write_json_atomic, write_text_atomic

    config = EvalConfig(model=args.model, dtype=args.dtype, draft=args.draft, tree=args.tree,
                        num_draft_tokens=args.num_draft_tokens, dataset=args.dataset,
                        num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                        temperature=args.temperature, seed=args.seed, fallback=args.fallback)
    report = run_eval(config, progress=not args.no_progress)
    markdown = format_markdown(report)
    out = Path(args.output_dir)
    write_json_atomic(out / "eval.json", report)
    write_text_atomic(out / "eval.md", markdown)
    sys.stdout.write(markdown)
    print(f"[eyas] wrote {out / 'eval.json'} and {out / 'eval.md'}", file=sys.stderr)
    return 0


def main(argv: list[str] | None = None) -> int:
    from eyas.cli.main import run_subcommand

    return run_subcommand("eval", argv)


if __name__ == "__main__":
    raise SystemExit(main())
