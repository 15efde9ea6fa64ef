"""`eyas recommend`: measure, per concurrency level, which drafting method pays on your workload.

Examples:
    eyas recommend                                         # smollm2-135m, mtbench, none vs ngram vs suffix
    eyas recommend --dataset repeated --num-draft-tokens 4,16  # traffic that repeats: suffix decoding
    eyas recommend --dataset code --concurrency 1,2,4,8 --rounds 3 --output runs/recommend.json
    eyas recommend --draft-dir runs/head                   # + eagle3:runs/head
    eyas recommend --methods "none;ngram;ngram:3,1,3" --num-draft-tokens 2,4
    eyas recommend --dataset jsonl:my_prompts.jsonl --num-prompts 16 --max-tokens 256
    eyas recommend --num-prompts 4 --max-tokens 32 --concurrency 1,4 --rounds 1   # a quick look

Instead of rules of thumb ("speculate when the accelerator is under half busy and answers are
long"), this runs the target through the serving engine in-process, closed loop (C requests in
flight at concurrency C), once per candidate and level: plain decoding (`none`) and every
method of --methods, each with every --num-draft-tokens setting. Candidates are interleaved at
each level and the order rotates between rounds, so that noise hits all alike; tokens/s is the
median over --rounds. Then, per level, the fastest candidate is recommended when it beats plain
by at least --min-speedup, otherwise plain decoding; a paragraph explains why from the numbers
(tau, the acceptance length = 1 + accepted / verification steps; speedups; what a speculative
step costs relative to a plain one). Greedy decoding: every candidate writes the same answers.

Methods are `eyas serve --draft` specs: none, ngram[:MAX_N[,MIN_N[,MATCHES]]],
suffix[:CACHE_MB[,MAX_DEPTH]], model:PATH_OR_ALIAS[@DTYPE], self, eagle3:DIR (separate them with ';', or ',' where no option follows).
The table goes to stdout, progress to stderr, and --output FILE.json keeps every measurement.
"""

from __future__ import annotations

import argparse
import sys

from eyas.utils.io import write_json_atomic


def int_list(text: str) -> list[int]:
    try:
        return [int(value) for value in text.split(",") if value.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,4,8, "
                                         f"got '{text}'") from None


def register(subparsers: argparse._SubParsersAction) -> None:
    from eyas.bench.recommend import SPECULATION_MODES, RecommendConfig
    from eyas.engine.target import PRECISIONS

    d = RecommendConfig()
    parser = subparsers.add_parser(
        "recommend", help="measure which drafting method pays at which concurrency",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default=d.model, help="target model spec (default: %(default)s)")
    parser.add_argument("--dtype", default=d.dtype, choices=PRECISIONS,
                        help="precision (default: %(default)s)")
    parser.add_argument("--dataset", default=d.dataset,
                        help="mtbench, code, sharegpt, random or jsonl:PATH (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts,
                        help="prompts of the workload sample (default: %(default)s)")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="default: %(default)s")
    parser.add_argument("--concurrency", type=int_list, default=d.concurrency,
                        help=f"levels of requests in flight (default: {','.join(map(str, d.concurrency))})")
    parser.add_argument("--methods", default=None,
                        help="candidate --draft specs (default: none,ngram,suffix, plus eagle3:DIR with "
                             "--draft-dir); none is always measured")
    parser.add_argument("--draft-dir", default=None,
                        help="an EAGLE-3 head folder, added to the methods as eagle3:DIR")
    parser.add_argument("--num-draft-tokens", type=int_list, default=d.num_draft_tokens,
                        help="settings tried per method: most draft tokens per request per step "
                             f"(default: {','.join(map(str, d.num_draft_tokens))})")
    parser.add_argument("--speculation", default=d.speculation, choices=SPECULATION_MODES,
                        help="the engine's policy while measuring: always draft, or auto (drafts "
                             "sized from measured costs, as eyas serve does) (default: %(default)s)")
    parser.add_argument("--rounds", type=int, default=d.rounds,
                        help="runs per candidate and level; the median counts (default: %(default)s)")
    parser.add_argument("--min-speedup", type=float, default=d.min_speedup,
                        help="recommend speculation only when at least this much faster than "
                             "plain (default: %(default)s)")
    parser.add_argument("--output", default=None, metavar="FILE.json", help="write the report here")
    parser.set_defaults(func=run)


def methods_from_args(methods: str | None, draft_dir: str | None) -> list[str]:
    from eyas.bench.recommend import RecommendConfig
    from eyas.cli.bench import split_systems

    chosen = split_systems(methods) if methods else RecommendConfig().methods
    if draft_dir and f"eagle3:{draft_dir}" not in chosen:
        chosen = [*chosen, f"eagle3:{draft_dir}"]
    return chosen


def run(args: argparse.Namespace) -> int:
    from eyas.bench.recommend import RecommendConfig, format_markdown, run_recommend

    config = RecommendConfig(model=args.model, dtype=args.dtype, dataset=args.dataset,
                             num_prompts=args.num_prompts, max_tokens=args.max_tokens,
                             concurrency=args.concurrency,
                             methods=methods_from_args(args.methods, args.draft_dir),
                             num_draft_tokens=args.num_draft_tokens, speculation=args.speculation,
                             rounds=args.rounds, min_speedup=args.min_speedup)
    report = run_recommend(config)
    print(format_markdown(report))
    if args.output:
        write_json_atomic(args.output, report)
        print(f"report written to {args.output}", file=sys.stderr)
    return 0
