"""`eyas bench`: measure decoding speed.

Examples:
    eyas bench offline                                   # eyas (auto, float32) vs transformers
    eyas bench offline --systems eyas:int4,eyas:float32,hf,hf-lookup,llama.cpp --num-prompts 8
    eyas bench offline --dataset code --max-tokens 64 --output runs/offline.json

`offline` runs MT-Bench first turns (or the code set) single-stream through each system in one
run, interleaved prompt by prompt, and prints tokens/s and the ratio to transformers `generate`.
Systems: eyas[:PRECISION] (auto, float32, bfloat16, int4), hf (transformers generate, float32),
hf-lookup (its prompt lookup decoding), llama.cpp (when llama-cpp-python is installed).
"""

from __future__ import annotations

import argparse
import json

from eyas.utils.io import write_json_atomic


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (offline single-stream, ...)",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    offline = sub.add_parser("offline", help="single-stream tokens/s of eyas beside its peers",
                             description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    offline.add_argument("--model", default="smollm2-135m", help="model spec (default: %(default)s)")
    offline.add_argument("--dataset", default="mtbench", help="mtbench or code (default: %(default)s)")
    offline.add_argument("--num-prompts", type=int, default=8, help="default: %(default)s")
    offline.add_argument("--max-tokens", type=int, default=128, help="default: %(default)s")
    offline.add_argument("--systems", default="eyas:auto,eyas:float32,hf",
                         help="comma-separated systems (default: %(default)s)")
    offline.add_argument("--output", default=None, help="write the JSON report here")
    offline.set_defaults(func=run_offline_cli)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def run_offline_cli(args: argparse.Namespace) -> int:
    from eyas.bench.offline import OfflineConfig, format_report, run_offline

    config = OfflineConfig(model=args.model, dataset=args.dataset, num_prompts=args.num_prompts,
                           max_tokens=args.max_tokens, systems=args.systems.split(","))
    report = run_offline(config)
    print(format_report(report))
    if args.output:
        write_json_atomic(args.output, report)
        print(f"report written to {args.output}")
    return 0
