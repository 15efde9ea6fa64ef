"""`eyas export`: write a trained head in the layout SGLang, vLLM or speculators loads; check it.

The layer ids are converted to each engine's convention (SGLang: boundary - 1; vLLM and
speculators: boundary ids) and d2t/t2d travel in the checkpoint. The weights are written in the
target's dtype (bfloat16 for SmolLM2) unless --dtype says otherwise, a manifest.json records the
sha256 of each file, and the speculators verifier is the target's Hugging Face id.

Examples:
    eyas export --head runs/smol/head --format sglang --out export/smol-sglang
    eyas export --head runs/smol/head --format vllm --out export/smol-vllm
    eyas export --head runs/smol/head --format speculators --out export/smol-spec \\
        --speculative-tokens 3
    eyas export --head runs/llama/head --format speculators --out export/llama-spec \\
        --target-name meta-llama/Llama-3.1-8B-Instruct     # a target that is not an eyas alias
    eyas export --check export/smol-sglang --model smollm2-135m
    eyas export --import export/smol-vllm --out runs/smol/head-from-vllm

Serving the export:
    vllm serve TARGET --speculative-config \\
        '{"method": "eagle3", "model": "export/smol-vllm", "num_speculative_tokens": 3}'
    python -m sglang.launch_server --model TARGET --speculative-algorithm EAGLE3 \\
        --speculative-draft-model-path export/smol-sglang --speculative-num-steps 3 \\
        --speculative-eagle-topk 1 --speculative-num-draft-tokens 4
"""

from __future__ import annotations

import argparse
import sys

from eyas.errors import EyasError

FORMATS = ("sglang", "vllm", "speculators")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "export", help="export a head for SGLang / vLLM / speculators, or check an export",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    action = parser.add_mutually_exclusive_group(required=True)
    action.add_argument("--head", help="an eyas head folder (e.g. OUT/head of `eyas train`) to export")
    action.add_argument("--check", metavar="DIR", help="validate an exported folder and report")
    action.add_argument("--import", dest="import_dir", metavar="DIR",
                        help="convert an SGLang / vLLM / speculators head back into an eyas head")
    parser.add_argument("--format", choices=FORMATS,
                        help="target layout (required with --head; detected for --check/--import)")
    parser.add_argument("--out", help="output folder (must be new or empty)")
    parser.add_argument("--dtype", default="auto", choices=("auto", "float32", "bfloat16", "float16"),
                        help="weight precision of the export; auto = the target's torch_dtype, from "
                             "the model registry or the target folder's config.json (default: auto)")
    parser.add_argument("--model", help="the target (alias, folder, .gguf): needed by "
                                        "--with-embedding; checks vocabulary and layer count with --check")
    parser.add_argument("--with-embedding", action="store_true",
                        help="include embed_tokens.weight (engines share the target's otherwise)")
    parser.add_argument("--speculative-tokens", type=int, default=3,
                        help="speculators: proposal length written in the config (default: %(default)s)")
    parser.add_argument("--target-name", help="speculators: verifier name_or_path, the Hugging Face "
                                              "id (or path) the engine loads the target from; "
                                              "default: the id of a registered alias, else required")
    parser.set_defaults(func=run_export)


def run_export(args: argparse.Namespace) -> int:
    from eyas.eagle3.checkpoint import load_head, save_head
    from eyas.export.check import check_export
    from eyas.export.formats import export_head, import_head
    from eyas.export.target import target_dtype_of
    from eyas.features.target_io import describe_target, load_output_weights

    if args.check:
        target_config = describe_target(args.model).config if args.model else None
        target_dtype = target_dtype_of(args.model) if args.model else None
        report = check_export(args.check, args.format, target_config, target_dtype)
        print(report.render())
        return 0 if report.ok else 1
    if not args.out:
        raise EyasError("--out is required with --head and --import")
    embedding = load_output_weights(describe_target(args.model))[0] if args.model else None
    if args.import_dir:
        head = import_head(args.import_dir, args.format, embedding=embedding)
        save_head(head, args.out, include_embedding=False)
        print(f"[eyas] imported {args.import_dir} as an eyas head in {args.out}")
        return 0
    if not args.format:
        raise EyasError(f"--format is required with --head; accepted: {', '.join(FORMATS)}")
    head = load_head(args.head, embedding=embedding)
    out = export_head(head, args.out, args.format, dtype=args.dtype,
                      include_embedding=args.with_embedding, speculative_tokens=args.speculative_tokens,
                      target_name=args.target_name, model=args.model)
    report = check_export(out, args.format)
    print(report.render())
    return 0 if report.ok else 1


def main(argv: list[str] | None = None) -> int:
    """`python -m eyas.cli.export ...` (what torchrun launches) runs `eyas export ...`."""
    from eyas.cli.main import run_subcommand

    return run_subcommand("export", argv)


if __name__ == "__main__":
    sys.exit(main())
