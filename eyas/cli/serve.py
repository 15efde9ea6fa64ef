"""`eyas serve`: an OpenAI-compatible server with speculative decoding across the batch.

Examples:
    eyas serve --model smollm2-135m --draft ngram
    eyas serve --model smollm2-135m --draft none --port 8001 --max-running 8
    eyas serve --model ./Qwen2.5-Coder-1.5B-Instruct --draft model:./Qwen2.5-Coder-0.5B-Instruct
    eyas serve --model smollm2-135m --draft eagle3:./heads/smol --api-key "$EYAS_API_KEY"
    python -m eyas.cli.serve --model smollm2-135m --draft ngram      # the same, as a module

Then, with any OpenAI client:
    curl http://127.0.0.1:8000/v1/chat/completions -H 'Content-Type: application/json' \\
      -d '{"model": "smollm2-135m", "messages": [{"role": "user", "content": "Hi"}]}'

--draft: none | ngram[:MAX_N[,MIN_N[,MATCHES]]] | model:PATH_OR_ALIAS[@DTYPE] | self | eagle3:DIR |
medusa:DIR | layerskip[:auto|LAYERS[:MIN_CONFIDENCE]] | suffix[:CACHE_MB[,MAX_DEPTH]] (suffix
decoding; its store of earlier outputs is shared by every request, at most CACHE_MB, default
64) | eagle3:DIR+suffix[:CACHE_MB[,MAX_DEPTH]] (docs/drafting-methods.md).
With a draft, every running request's drafts are verified in one target pass per step; how
many draft tokens each request gets is chosen per step from the target's measured step costs
and each request's acceptance (--speculation auto), so speculation shrinks and switches off
as the batch grows. The server binds 127.0.0.1 unless --host says otherwise; SIGTERM lets
in-flight requests finish (for at most --drain-timeout seconds, then they end with
finish_reason "abort"), then exits. See docs/serving.md for endpoints, metrics and errors.
"""

from __future__ import annotations

import argparse
import logging
import os
import sys

from eyas.cli.common import add_kv_dtype_arg, add_model_args
from eyas.scheduler.config import SPECULATION_MODES, EngineConfig

DEFAULTS = EngineConfig()


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser(
        "serve", help="OpenAI-compatible HTTP server with speculative decoding",
        description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    parser.set_defaults(func=run)


def add_arguments(parser: argparse.ArgumentParser) -> None:
    add_model_args(parser)
    add_kv_dtype_arg(parser)
    parser.add_argument("--draft", default="none",
                        help="none | ngram[:MAX_N[,MIN_N[,MATCHES]]] | model:PATH_OR_ALIAS[@DTYPE] | self | "
                             "eagle3:DIR | eagle3:DIR+ngram[:MAX_N,MIN_N,GRAFT_TOKENS] (prompt lookup grafted "
                             "onto the head's tree) | suffix[:CACHE_MB[,MAX_DEPTH]] (suffix decoding: this request's "
                             "text and a store of earlier outputs) | eagle3:DIR+suffix[:CACHE_MB[,MAX_DEPTH]] "
                             "| medusa:DIR | layerskip[:auto|LAYERS[:MIN_CONFIDENCE]] "
                             "(LAYERS: decoder layers to skip, e.g. 10-19) (default: %(default)s)")
    parser.add_argument("--num-draft-tokens", type=int, default=DEFAULTS.num_draft_tokens,
                        help="most draft tokens per request per step (default: %(default)s)")
    parser.add_argument("--tree", default="auto",
                        help="EAGLE-3 / Medusa draft tree: auto, chain:K or DEPTH,TOPK,TOTAL; capped at "
                             "--num-draft-tokens nodes per request (default: %(default)s)")
    parser.add_argument("--speculation", default=DEFAULTS.speculation, choices=SPECULATION_MODES,
                        help="auto: draft tokens per step from measured costs (never slower than "
                             "plain); always; never (default: %(default)s)")
    parser.add_argument("--host", default="127.0.0.1", help="bind address (default: %(default)s)")
    parser.add_argument("--port", type=int, default=8000, help="(default: %(default)s)")
    parser.add_argument("--served-model-name", default=None,
                        help="the model id clients send (default: the --model value)")
    parser.add_argument("--api-key", default=os.environ.get("EYAS_API_KEY"),
                        help="require 'Authorization: Bearer KEY' on /v1 routes "
                             "(default: $EYAS_API_KEY, else no key)")
    parser.add_argument("--max-running", type=int, default=DEFAULTS.max_running,
                        help="requests decoded together, one KV row each (default: %(default)s)")
    parser.add_argument("--max-waiting", type=int, default=DEFAULTS.max_waiting,
                        help="queued requests before 503 (default: %(default)s)")
    parser.add_argument("--max-model-len", type=int, default=None,
                        help="prompt + output tokens per request (default: min(context, 4096))")
    parser.add_argument("--max-step-tokens", type=int, default=DEFAULTS.max_step_tokens,
                        help="token budget per step (default: %(default)s)")
    parser.add_argument("--prefill-chunk", type=int, default=DEFAULTS.prefill_chunk,
                        help="most prompt tokens per request per step (default: %(default)s)")
    parser.add_argument("--prefill-stretch", type=stretch, default=DEFAULTS.prefill_stretch,
                        help="while requests decode, a step that also prefills joining prompts may "
                             "take at most this multiple of its plain decode pass (prompt tokens "
                             "priced with the measured step costs; at least 32 a step). Lower: "
                             "steadier time per output token (TPOT) for the running requests, a "
                             "later first token (TTFT) for joining ones; 'off': prefill fills "
                             "--max-step-tokens (default: "
                             f"{'off' if DEFAULTS.prefill_stretch is None else DEFAULTS.prefill_stretch})")
    overlap = parser.add_mutually_exclusive_group()
    overlap.add_argument("--overlap", dest="overlap", action="store_true", default=DEFAULTS.overlap,
                         help="schedule step N+1 and postprocess step N-1 on a helper thread "
                              "while step N computes")
    overlap.add_argument("--no-overlap", dest="overlap", action="store_false",
                         help=f"one step at a time (default: {'overlap' if DEFAULTS.overlap else 'no overlap'})")
    prefix = parser.add_mutually_exclusive_group()
    prefix.add_argument("--prefix-cache", dest="prefix_caching", action="store_true",
                        default=DEFAULTS.prefix_caching,
                        help="keep finished requests' KV rows and reuse them for prompts that "
                             "start the same way (default: on)")
    prefix.add_argument("--no-prefix-cache", dest="prefix_caching", action="store_false",
                        help="prefill every prompt whole")
    parser.add_argument("--max-body-bytes", type=int, default=1 << 20,
                        help="larger request bodies get 413 (default: %(default)s)")
    parser.add_argument("--max-n", type=int, default=None,
                        help="most samples per request, n (default: 16, ServerSettings.max_n)")
    parser.add_argument("--max-prompts", type=int, default=None,
                        help="most prompts in one /v1/completions request (default: 64)")
    parser.add_argument("--drain-timeout", type=float, default=30.0,
                        help="seconds that running requests get to finish after SIGTERM/Ctrl-C; then "
                             "they end with finish_reason 'abort' (streams: a final chunk and [DONE]); "
                             "keep it below your orchestrator's grace period (default: %(default)s)")
    parser.add_argument("--log-level", default="info", choices=["debug", "info", "warning", "error"])


def stretch(text: str) -> float | None:
    """--prefill-stretch: a multiple > 1, or 'off'."""
    if text == "off":
        return None
    try:
        return float(text)
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected a number > 1 or 'off', got '{text}'") from None


def run(args: argparse.Namespace) -> int:
    from eyas.engine.target import load_target
    from eyas.errors import EyasError
    from eyas.scheduler.engine import Engine
    from eyas.scheduler.proposers import check_spec
    from eyas.server.app import ServerSettings, create_app
    from eyas.server.metrics import ServerMetrics
    from eyas.server.runner import serve_with_engine

    logging.basicConfig(level=args.log_level.upper(), format="%(asctime)s %(name)s %(levelname)s %(message)s")
    log = logging.getLogger("eyas.serve")
    config = EngineConfig(
        max_running=args.max_running, max_waiting=args.max_waiting, max_model_len=args.max_model_len,
        max_step_tokens=args.max_step_tokens, prefill_chunk=args.prefill_chunk,
        prefill_stretch=args.prefill_stretch,
        num_draft_tokens=args.num_draft_tokens, speculation=args.speculation, overlap=args.overlap,
        tree=args.tree, prefix_caching=args.prefix_caching)
    settings = ServerSettings(model_name=args.served_model_name or args.model, api_key=args.api_key,
                              max_body_bytes=args.max_body_bytes,
                              **{name: value for name, value in (("max_n", args.max_n),
                                                                 ("max_prompts", args.max_prompts))
                                 if value is not None})
    if args.drain_timeout < 0:
        raise EyasError(f"--drain-timeout must be >= 0 seconds, got {args.drain_timeout}")
    check_spec(args.draft)  # before the (slow) model load
    target = load_target(args.model, dtype=args.dtype, device=args.device, kv_dtype=args.kv_dtype)
    metrics = ServerMetrics(settings.model_name, num_positions=args.num_draft_tokens)
    engine = Engine(target, config, draft=args.draft, observer=metrics)
    if engine.proposers.suffix_store() is not None:
        metrics.watch_suffix_store(engine.proposers.suffix_store().stats)
    log.info("model %s (%s), draft %s, %d rows x up to %d tokens, KV %s, %.1f MiB per 1k slots, overlap %s, "
             "prefix cache %s", settings.model_name, target.precision, args.draft, config.max_running,
             engine.max_model_len, str(target.kv_dtype).removeprefix("torch."),
             engine.pool.bytes_per_slot() * 1000 / 2**20,
             "on" if config.overlap else "off", "on" if config.prefix_caching else "off")
    if engine.costs is not None:
        log.info("measured step costs (ms): %s", engine.costs.as_dict())
    app = create_app(engine, settings, metrics, start_engine=False)
    serve_with_engine(app, engine, args.host, args.port, args.log_level, args.drain_timeout)
    return 0


def main(argv: list[str] | None = None) -> int:
    from eyas.errors import EyasError

    parser = argparse.ArgumentParser(prog="eyas serve", description=__doc__,
                                     formatter_class=argparse.RawDescriptionHelpFormatter)
    add_arguments(parser)
    try:
        return run(parser.parse_args(argv))
    except EyasError as error:
        print(f"eyas: error: {error}", file=sys.stderr)
        return 2


if __name__ == "__main__":
    sys.exit(main())
