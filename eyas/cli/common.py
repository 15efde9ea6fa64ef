"""Flags shared by several subcommands (model, precision, device, sampling)."""

from __future__ import annotations

import argparse

from eyas.engine.sampling import SamplingParams
from eyas.engine.target import PRECISIONS
from eyas.models.fused_cpu import KV_DTYPE_CHOICES


def add_model_args(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--model", default="smollm2-135m",
                        help="alias (smollm2-135m), Hugging Face folder, or .gguf file "
                             "(default: %(default)s)")
    parser.add_argument("--dtype", default="auto", choices=PRECISIONS,
                        help="precision; auto on CPU = int4 for a GGUF of <= 6 bits, int8 for a GGUF of "
                             "more (Q8_0, F16: 8-bit weights, a Q8_0 file's exactly), float32 for a "
                             "Hugging Face folder; bfloat16 on CUDA (default: %(default)s)")
    parser.add_argument("--device", default="cpu", help="cpu, cuda or cuda:N (default: %(default)s)")


def add_kv_dtype_arg(parser: argparse.ArgumentParser) -> None:
    parser.add_argument("--kv-dtype", default="auto", choices=KV_DTYPE_CHOICES,
                        help="KV cache of an int4 target on a CPU (the fused layers): float16 (half the "
                             "bytes attention reads, widened to float32 when read) or float32; auto = "
                             "float16 (float32 for head dims other than 64 and 128), or EYAS_KV_DTYPE "
                             "where set; other precisions keep their own (default: %(default)s)")


def add_sampling_args(parser: argparse.ArgumentParser, max_tokens: int = 256) -> None:
    parser.add_argument("--max-tokens", type=int, default=max_tokens,
                        help="most new tokens (default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=0.0,
                        help="0 = greedy (default: %(default)s)")
    parser.add_argument("--top-p", type=float, default=1.0, help="nucleus mass (default: 1.0)")
    parser.add_argument("--top-k", type=int, default=0, help="0 = off (default: 0)")
    parser.add_argument("--seed", type=int, default=None, help="seed for reproducible sampling")
    parser.add_argument("--stop", action="append", default=[],
                        help="stop string (repeatable); the output ends before it")


def sampling_from_args(args: argparse.Namespace) -> SamplingParams:
    return SamplingParams(max_tokens=args.max_tokens, temperature=args.temperature,
                          top_p=args.top_p, top_k=args.top_k, seed=args.seed, stop=args.stop)
