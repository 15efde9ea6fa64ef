"""`eyas generate`: answer one prompt with the target, streaming to the terminal.

Examples:
    eyas generate --prompt "Explain speculative decoding in two sentences."
    eyas generate --model ./Qwen2.5-0.5B-Instruct --prompt "Hi" --temperature 0.7 --seed 1
    eyas generate --raw --prompt "def fibonacci(n):" --max-tokens 64 --stop "\\n\\n"
    eyas generate --system "You are terse." --prompt "What is a KV cache?"
"""

from __future__ import annotations

import argparse
import sys

from eyas.cli.common import add_model_args, add_sampling_args, sampling_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="answer a prompt (plain or speculative decoding), streamed",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    parser.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    parser.add_argument("--system", default=None, help="an optional system message")
    parser.add_argument("--raw", action="store_true",
                        help="feed the prompt as plain text, without the chat template")
    add_sampling_args(parser)
    parser.add_argument("--quiet-stats", action="store_true", help="do not print timing stats")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from eyas.engine.generate import generate
    from eyas.engine.target import load_target
    from eyas.models.tokenizer import chat_prompt_ids, raw_prompt_ids

    params = sampling_from_args(args)
    target = load_target(args.model, dtype=args.dtype, device=args.device)
    if args.raw:
        prompt_ids = raw_prompt_ids(target.tokenizer, args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = chat_prompt_ids(target.tokenizer, messages)
    result = generate(target, prompt_ids, params,
                      on_text=lambda text: (sys.stdout.write(text), sys.stdout.flush()))
    sys.stdout.write("\n")
    if not args.quiet_stats:
        stats = result.stats
        print(f"[{len(result.token_ids)} tokens, finish={result.finish_reason}, "
              f"precision={target.precision}, TTFT {stats['ttft_s'] * 1000:.0f} ms, "
              f"{stats['tokens_per_s']:.1f} tok/s]", file=sys.stderr)
    return 0
