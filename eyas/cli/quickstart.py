"""`eyas quickstart`: the whole pipeline on the embedded default, small (what `make demo` runs).

Examples:
    eyas quickstart                                  # SmolLM2-135M, ShareGPT, ~10 min on 2 cores
    eyas quickstart --prompts 200 --epochs 5         # a bigger head, same steps
    eyas quickstart --no-serving                     # skip the serving comparison
    eyas quickstart --restart                        # redo every step

Steps, each an ordinary eyas command printed before it runs:
  1 prepare        eyas data prepare: ShareGPT prompts, PII/DLP filter, train/eval split
  2 regenerate     eyas data regenerate: answers written by the target itself
  3 render         eyas data render: the target's chat template, loss mask on the answers
  4 features       eyas features: hidden-state features, offline store
  5 train          eyas train: a small EAGLE-3 head with training-time test
  6 eval-own       eyas eval: that head on MT-Bench (tau, speedup, identical outputs)
  7 eval-shipped   eyas eval: the head shipped with eyas for this model
  8 eval-shipped-ngram  eyas eval: the same head with the prompt-lookup branch grafted on
                   (--draft eagle3:NAME+ngram), the fastest method on a CPU
  9 serve-compare  eyas bench compare: eyas serve with none, ngram, eagle3; TPOT and
                   throughput against concurrency, report.md and PNG plots
Then a summary table (also in OUT/summary.md and summary.json). Interrupted? Run the same
command again: finished steps are skipped and the interrupted one resumes.

A head trained on a few dozen conversations for a few minutes shows the pipeline working, not
a useful speedup; the shipped head (docs/training.md: how it was trained) shows the speedup.
"""

from __future__ import annotations

import argparse
import sys

from eyas.quickstart import QuickstartConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    d = {name: f.default for name, f in QuickstartConfig.__dataclass_fields__.items()}
    parser = subparsers.add_parser(
        "quickstart", help="the whole pipeline, small, on the embedded default (make demo)",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=d["model"], help="target (default: %(default)s)")
    parser.add_argument("--out", default=d["out"], help="run folder (default: %(default)s)")
    parser.add_argument("--source", default=d["source"],
                        help="prompt source for `eyas data prepare` (default: %(default)s)")
    parser.add_argument("--source-limit", type=int, default=d["source_limit"],
                        help="records read from the source (default: %(default)s)")
    parser.add_argument("--prompts", type=int, default=d["prompts"],
                        help="prompts answered by the target and trained on (default: %(default)s)")
    parser.add_argument("--answer-tokens", type=int, default=d["answer_tokens"],
                        help="most tokens per answer (default: %(default)s)")
    parser.add_argument("--batch-size", type=int, default=d["batch_size"],
                        help="regeneration batch (default: %(default)s)")
    parser.add_argument("--draft-vocab-size", type=int, default=d["draft_vocab_size"],
                        help="default: %(default)s")
    parser.add_argument("--ttt-steps", type=int, default=d["ttt_steps"], help="default: %(default)s")
    parser.add_argument("--epochs", type=float, default=d["epochs"], help="default: %(default)s")
    parser.add_argument("--lr", type=float, default=d["learning_rate"], help="default: %(default)s")
    parser.add_argument("--eval-prompts", type=int, default=d["eval_prompts"],
                        help="MT-Bench prompts per evaluation (default: %(default)s)")
    parser.add_argument("--eval-tokens", type=int, default=d["eval_tokens"], help="default: %(default)s")
    parser.add_argument("--tree", default=d["tree"],
                        help="EAGLE-3 draft tree for both evaluations: auto, chain:K or "
                             "DEPTH,TOPK,TOTAL (default: %(default)s)")
    parser.add_argument("--head", default=None,
                        help="head for step 7 (default: the one shipped for --model; none: skip)")
    parser.add_argument("--no-serving", action="store_true", help="skip step 8")
    parser.add_argument("--serve-prompts", type=int, default=d["serve_prompts"], help="default: %(default)s")
    parser.add_argument("--serve-tokens", type=int, default=d["serve_tokens"], help="default: %(default)s")
    parser.add_argument("--serve-concurrency", default=d["serve_concurrency"], help="default: %(default)s")
    parser.add_argument("--restart", action="store_true", help="redo finished steps too")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from eyas.quickstart import format_summary, run_quickstart

    config = QuickstartConfig(
        model=args.model, out=args.out, source=args.source, source_limit=args.source_limit,
        prompts=args.prompts, answer_tokens=args.answer_tokens, batch_size=args.batch_size,
        draft_vocab_size=args.draft_vocab_size, ttt_steps=args.ttt_steps, epochs=args.epochs,
        learning_rate=args.lr, eval_prompts=args.eval_prompts, eval_tokens=args.eval_tokens,
        tree=args.tree, head=args.head, serving=not args.no_serving, serve_prompts=args.serve_prompts,
        serve_tokens=args.serve_tokens, serve_concurrency=args.serve_concurrency,
        progress=not args.no_progress)
    summary = run_quickstart(config, restart=args.restart)
    sys.stdout.write("\n" + format_summary(summary))
    return 0


def main(argv: list[str] | None = None) -> int:
    from eyas.cli.main import run_subcommand

    return run_subcommand("quickstart", argv)


if __name__ == "__main__":
    raise SystemExit(main())
