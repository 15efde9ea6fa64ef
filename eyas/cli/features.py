"""`eyas features`: run the target over tokenized conversations and store the head's inputs.

Stores input ids, loss mask, the three taps (residual entering layers {2, L//2, L-3} by default,
boundary ids, recorded in the index) and the last hidden state, as sharded safetensors with an
index (shapes, dtype, sha256 per shard). The storage is estimated first; the run refuses, with
the figures, when the disk lacks room. Re-running the same command resumes.

Examples:
    eyas features --model smollm2-135m --data train.tokenized.jsonl --out features/smol
    eyas features --model smollm2-135m --data train.tokenized.jsonl --out features/smol --dry-run
    eyas features --model ./Llama-3.2-1B --data train.jsonl --out feats --layer-ids 2,8,13 --dtype float16
    torchrun --nproc_per_node 4 -m eyas.cli.features --model M --data train.jsonl --out feats --device cuda
    eyas features --verify features/smol       # check every shard's sha256
"""

from __future__ import annotations

import argparse
import sys
from dataclasses import MISSING, fields

from eyas.errors import EyasError


def _default(name: str) -> object:
    from eyas.features.config import FeatureConfig

    field = FeatureConfig.__dataclass_fields__[name]
    return field.default if field.default is not MISSING else None


def _layer_ids(text: str) -> list[int]:
    try:
        return [int(part) for part in text.split(",") if part.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers like 2,15,27, got {text!r}")


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "features", help="store the target's hidden states for offline head training",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    s = argparse.SUPPRESS  # defaults live in FeatureConfig only
    parser.add_argument("--model", default=s, help="target: alias (smollm2-135m), HF folder or .gguf")
    parser.add_argument("--data", default=s, help="tokenized conversations .jsonl (see docs/training.md)")
    parser.add_argument("--out", dest="output", default=s, help="store folder")
    parser.add_argument("--layer-ids", dest="target_layer_ids", type=_layer_ids, default=s,
                        help="tap layers as boundary ids (k = residual entering layer k), "
                             "default 2,L//2,L-3")
    parser.add_argument("--dtype", default=s, choices=("bfloat16", "float16", "float32"),
                        help=f"storage precision (default: {_default('dtype')})")
    parser.add_argument("--max-length", type=int, default=s,
                        help=f"tokens per sample; longer ones are truncated (default: {_default('max_length')})")
    parser.add_argument("--batch-size", type=int, default=s,
                        help=f"samples per target forward (default: {_default('batch_size')})")
    parser.add_argument("--samples-per-shard", type=int, default=s,
                        help=f"(default: {_default('samples_per_shard')})")
    parser.add_argument("--device", default=s, help="cpu, cuda or cuda:N (default: cpu)")
    parser.add_argument("--target-dtype", default=s,
                        help=f"precision of the target forward (default: {_default('target_dtype')})")
    parser.add_argument("--dry-run", action="store_true", default=s,
                        help="print the storage estimate and stop")
    parser.add_argument("--no-space-check", dest="check_space", action="store_false", default=s,
                        help="write even when the estimate exceeds the free disk space")
    parser.add_argument("--verify", metavar="DIR", default=None,
                        help="verify the sha256 of every shard of an existing store, then stop")
    parser.set_defaults(func=run_features)


def run_features(args: argparse.Namespace) -> int:
    from eyas.features.extract import FeatureConfig, extract_features, gib
    from eyas.features.store import FeatureStore

    if args.verify:
        store = FeatureStore(args.verify)
        store.verify()
        print(f"[eyas] {args.verify}: {len(store.shards)} shards, {len(store)} samples, "
              f"{store.num_tokens} tokens: all checksums match")
        return 0
    names = {f.name for f in fields(FeatureConfig)}
    flags = {k: v for k, v in vars(args).items() if k in names}
    missing = [flag for flag, key in (("--model", "model"), ("--data", "data"), ("--out", "output"))
               if key not in flags]
    if missing:
        raise EyasError(f"eyas features needs {', '.join(missing)}")
    summary = extract_features(FeatureConfig(**flags))
    if summary.seconds > 0:
        print(f"[eyas] {summary.output}: {summary.num_samples} samples, {summary.num_tokens} tokens, "
              f"{gib(summary.bytes)} ({summary.bytes / max(summary.num_tokens, 1):.0f} B/token); "
              f"{summary.tokens_per_second:.0f} tokens/s on this rank"
              + (f"; rebuilt {len(summary.rebuilt)} bad shards ({', '.join(summary.rebuilt)})" if summary.rebuilt else ""))
    return 0


def main(argv: list[str] | None = None) -> int:
    """`python -m eyas.cli.features ...` (what torchrun launches) runs `eyas features ...`."""
    from eyas.cli.main import run_subcommand

    return run_subcommand("features", argv)


if __name__ == "__main__":
    sys.exit(main())
