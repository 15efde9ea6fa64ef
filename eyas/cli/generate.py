"""`eyas generate`: answer one prompt with the target, streaming to the terminal.

Examples:
    eyas generate --prompt "Explain speculative decoding in two sentences."
    eyas generate --model ./Qwen2.5-0.5B-Instruct --prompt "Hi" --temperature 0.7 --seed 1
    eyas generate --raw --prompt "def fibonacci(n):" --max-tokens 64 --stop "\\n\\n"
    eyas generate --system "You are terse." --prompt "What is a KV cache?"
    eyas generate --draft ngram --num-draft-tokens 4 --prompt "Repeat: a b c d a b c d"
    eyas generate --draft model:./Qwen2.5-Coder-0.5B-Instruct --model ./Qwen2.5-Coder-1.5B-Instruct ...
    eyas generate --draft medusa:runs/medusa/head --num-draft-tokens 8 --prompt "..."
    eyas generate --draft layerskip:auto --prompt "..."          # calibrated once, then cached
    eyas generate --draft layerskip:10-19 --prompt "..."         # skip decoder layers 10..19
    eyas generate --draft suffix --num-draft-tokens 16 --prompt "Repeat: a b c d a b c d"

--draft picks the drafting method: none (plain decoding), ngram[:MAX_N[,MIN_N[,MATCHES]]]
(prompt lookup), model:PATH_OR_ALIAS[@DTYPE] (a smaller model with the same tokenizer), self (the
target drafts for itself: a correctness check, never faster), eagle3:DIR (an EAGLE-3 head
trained with `eyas train`; --tree sets its draft tree), medusa:DIR (Medusa heads trained with
`eyas train --method medusa`; --tree sets their tree), layerskip[:auto|LAYERS[:MIN_CONFIDENCE]]
(the target drafts with some decoder layers skipped: LAYERS lists the skipped ones, 0-based;
auto calibrates them; docs/drafting-methods.md), suffix[:CACHE_MB[,MAX_DEPTH]] (suffix decoding:
continuations seen earlier in this request or in earlier requests' outputs, a tree sized by how
often each was seen), eagle3:DIR+suffix (both in one tree). After the answer, the
acceptance length tau (1 + accepted / verification steps) and the draft/verify time split
are printed. Speculation that does not pay falls back to plain decoding for a while
(--no-fallback keeps it on).
"""

from __future__ import annotations

import argparse
import sys

from eyas.cli.common import add_kv_dtype_arg, add_model_args, add_sampling_args, sampling_from_args


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "generate", help="answer a prompt (plain or speculative decoding), streamed",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_model_args(parser)
    add_kv_dtype_arg(parser)
    parser.add_argument("--prompt", required=True, help="the user message (or raw text with --raw)")
    parser.add_argument("--system", default=None, help="an optional system message")
    parser.add_argument("--raw", action="store_true",
                        help="feed the prompt as plain text, without the chat template")
    add_sampling_args(parser)
    parser.add_argument("--draft", default="none",
                        help="none | ngram[:MAX_N[,MIN_N[,MATCHES]]] | model:PATH_OR_ALIAS[@DTYPE] | self | "
                             "eagle3:DIR | eagle3:DIR+ngram[:MAX_N,MIN_N,GRAFT_TOKENS] (prompt lookup grafted "
                             "onto the head's tree) | suffix[:CACHE_MB[,MAX_DEPTH]] (suffix decoding: this request's "
                             "text and a store of earlier outputs) | eagle3:DIR+suffix[:CACHE_MB[,MAX_DEPTH]] "
                             "| medusa:DIR | layerskip[:auto|LAYERS[:MIN_CONFIDENCE]] "
                             "(LAYERS: decoder layers to skip, 0-based, e.g. 4,5,6 or 10-19) "
                             "(default: %(default)s)")
    parser.add_argument("--num-draft-tokens", type=int, default=4,
                        help="most draft tokens per verification step (default: %(default)s)")
    parser.add_argument("--tree", default="auto",
                        help="EAGLE-3 / Medusa draft tree: auto, chain:K or DEPTH,TOPK,TOTAL "
                             "(default: auto)")
    parser.add_argument("--no-fallback", action="store_true",
                        help="keep speculating even when it measures slower than plain decoding")
    parser.add_argument("--quiet-stats", action="store_true", help="do not print timing stats")
    parser.set_defaults(func=run)


def run(args: argparse.Namespace) -> int:
    from eyas.engine.generate import generate
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.methods import build_proposer
    from eyas.engine.speculative.policy import PolicyConfig
    from eyas.engine.target import load_target
    from eyas.errors import EyasError
    from eyas.models.tokenizer import chat_prompt_ids, raw_prompt_ids

    params = sampling_from_args(args)
    if args.num_draft_tokens < 1:
        raise EyasError("--num-draft-tokens must be >= 1")
    target = load_target(args.model, dtype=args.dtype, device=args.device, kv_dtype=args.kv_dtype)
    proposer = build_proposer(args.draft, target, tree=args.tree)
    if args.raw:
        prompt_ids = raw_prompt_ids(target.tokenizer, args.prompt)
    else:
        messages = ([{"role": "system", "content": args.system}] if args.system else [])
        messages.append({"role": "user", "content": args.prompt})
        prompt_ids = chat_prompt_ids(target.tokenizer, messages)
    def on_text(text: str) -> None:
        sys.stdout.write(text)
        sys.stdout.flush()

    if proposer is None:
        result = generate(target, prompt_ids, params, on_text=on_text)
    else:
        result = speculative_generate(target, prompt_ids, params, proposer, args.num_draft_tokens,
                                      on_text=on_text,
                                      policy=PolicyConfig(enabled=not args.no_fallback))
    sys.stdout.write("\n")
    if not args.quiet_stats:
        stats = result.stats
        print(f"[{len(result.token_ids)} tokens, finish={result.finish_reason}, "
              f"precision={target.precision}, TTFT {stats['ttft_s'] * 1000:.0f} ms, "
              f"{stats['tokens_per_s']:.1f} tok/s]", file=sys.stderr)
        spec = stats.get("speculative")
        if spec:
            rates = ", ".join(f"{r:.2f}" for r in spec["acceptance_rate_per_position"])
            print(f"[{spec['method']}: tau {spec['acceptance_length']:.2f} over "
                  f"{spec['verification_steps']} verification steps, acceptance by position "
                  f"[{rates}], draft {spec['draft_seconds']:.2f} s, verify "
                  f"{spec['verify_seconds']:.2f} s, plain steps {spec['plain_steps']} "
                  f"({spec['plain_seconds']:.2f} s), fallbacks {spec['fallbacks']}]", file=sys.stderr)
    return 0
