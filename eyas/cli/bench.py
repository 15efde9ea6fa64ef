"""`eyas bench`: measure decoding speed.

Examples:
    eyas bench offline                                   # eyas (auto, float32) vs transformers
    eyas bench offline --systems eyas:int4,eyas:float32,hf,hf-lookup,llama.cpp --num-prompts 8
    eyas bench offline --dataset code --max-tokens 64 --output runs/offline.json
    eyas bench offline --draft ngram                     # plain beside n-gram speculation
    eyas bench offline --peers                           # + every peer this machine can run
    eyas bench offline --systems "eyas:float32;hf-assisted:smollm2-135m;hf" --num-prompts 4
    eyas bench offline --systems "eyas:float32;eyas:float32+ngram:3,1,3" --num-draft-tokens 6
    eyas bench offline --systems "eyas:auto;eyas:auto+eagle3:smollm2-135m;eyas:auto+eagle3:smollm2-135m~chain:1"

    eyas bench costs --model smollm2-135m --dtype int4   # cost of a pass over T tokens, and its floor
    eyas bench costs --model smollm2-135m --dtype int4 --prefill 512   # and a 512-token prefill
    eyas bench profile --model smollm2-135m --tokens 1,8,32   # where a pass's time goes

    eyas bench serve --url http://127.0.0.1:8000 --label eagle3 --concurrency 1,2,4,8,16
    eyas bench serve --url http://127.0.0.1:8000 --dataset random --input-len 512 --ignore-eos
    eyas bench plot runs/bench/plain/result.json runs/bench/eagle3/result.json --output-dir runs/bench/both
    eyas bench compare --model smollm2-135m --draft none --draft ngram --draft eagle3=eagle3:runs/head
    eyas bench soak --model smollm2-135m --minutes 30 --concurrency 32   # every drafting method in turn
    eyas bench soak --model smollm2-135m --minutes 2 --drafts none

`offline` runs MT-Bench first turns (or the code set) single-stream through each system in one
run, interleaved prompt by prompt, and prints tokens/s and the ratio to transformers `generate`.
Systems: eyas[:PRECISION[+DRAFT]] (precision auto, float32, bfloat16, int4, int8; DRAFT as in
`eyas generate --draft`, e.g. eyas:float32+ngram), hf (transformers generate, float32),
hf-lookup (its prompt lookup decoding), hf-assisted:DRAFT (its assisted generation with DRAFT,
an alias or a path to a model with the target's tokenizer, as the assistant; the only such pair
embedded is smollm2-135m drafting for itself), llama.cpp (when llama-cpp-python is installed).
--peers adds every peer available here: llama.cpp (when it imports and the model has a GGUF),
hf-lookup, hf-assisted (the draft of --draft model:M, else the target itself) and hf, last, as
the row the others' outputs are compared with.
Speculative rows show tau, the acceptance length (1 + accepted / verification steps).

`costs` and `profile` print this machine's CPU, the int8 instruction set in use, and its read
bandwidth and integer multiply-add peak (measured by a short probe, cached per machine); from
them, each pass's floor (bench/floors.py) and, for `profile`, each part's. `offline` prints the
same machine lines above its table.

`serve` sweeps concurrency levels against any OpenAI-compatible server (eyas, vLLM, SGLang):
TTFT, TPOT, ITL, end-to-end latency, throughput, and acceptance from /metrics; it writes
result.json, report.md and two PNG plots. `plot` merges runs into one report; `compare` starts
`eyas serve` once per --draft configuration and sweeps each. `soak` runs a long mixed load
(half streamed, a tenth of the streams cancelled) against a server per drafting method and
reports lost requests, 5xx, KV rows left in use and resident memory growth. See
docs/benchmarks.md and docs/serving.md.
"""

from __future__ import annotations

import argparse
from datetime import datetime
from typing import TYPE_CHECKING

from eyas.cli.common import add_kv_dtype_arg
from eyas.engine.target import PRECISIONS
from eyas.errors import EyasError
from eyas.utils.io import write_json_atomic

COST_CONTEXT = 256  # cached tokens before the timed passes of `eyas bench costs`

if TYPE_CHECKING:
    from eyas.bench.serve_client import SweepConfig


def register(subparsers: argparse._SubParsersAction) -> None:
    parser = subparsers.add_parser("bench", help="benchmarks (offline single-stream, serving sweeps)",
                                   description=__doc__,
                                   formatter_class=argparse.RawDescriptionHelpFormatter)
    sub = parser.add_subparsers(dest="bench_command", metavar="BENCH")
    _register_offline(sub)
    _register_costs(sub)
    _register_profile(sub)
    _register_serve(sub)
    _register_plot(sub)
    _register_compare(sub)
    _register_soak(sub)
    parser.set_defaults(func=lambda args: parser.print_help() or 2)


def _register_offline(sub: argparse._SubParsersAction) -> None:
    offline = sub.add_parser("offline", help="single-stream tokens/s of eyas beside its peers",
                             description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    offline.add_argument("--model", default="smollm2-135m", help="model spec (default: %(default)s)")
    offline.add_argument("--dataset", default="mtbench",
                         help="mtbench, code or repeated (questions asked again, conversations re-sent; default: %(default)s)")
    offline.add_argument("--num-prompts", type=int, default=8, help="default: %(default)s")
    offline.add_argument("--max-tokens", type=int, default=128, help="default: %(default)s")
    offline.add_argument("--systems", default=None,
                         help="systems separated by ';' or ',' (default: eyas:auto,eyas:float32,hf; "
                              "with --draft D: eyas:auto,eyas:auto+D,hf)")
    offline.add_argument("--draft", default=None, help="add a speculative row with this method")
    offline.add_argument("--peers", action="store_true",
                         help="add every peer available on this machine: llama.cpp, hf-lookup, "
                              "hf-assisted (draft of --draft model:M, else the target), hf")
    offline.add_argument("--num-draft-tokens", type=int, default=4,
                         help="draft tokens per step for speculative rows (default: %(default)s)")
    offline.add_argument("--tree", default="auto",
                         help="draft tree of EAGLE-3 and Medusa rows: auto (sized on measured costs), "
                              "chain:K or DEPTH,TOPK,TOTAL; one system's own: a '~TREE' suffix, e.g. "
                              "eyas:auto+eagle3:smollm2-135m~chain:1 (default: %(default)s)")
    offline.add_argument("--output", default=None, help="write the JSON report here")
    offline.set_defaults(func=run_offline_cli)


def _register_costs(sub: argparse._SubParsersAction) -> None:
    costs = sub.add_parser(
        "costs", help="measure the target's verification cost for 1..64 tokens in one pass",
        description="Measure one target pass over T new tokens (after 256 cached ones) for "
                    "T = 1..64, relative to a single-token step: the curve that sizes draft trees "
                    "(cached per machine, model and precision). With the int8 kernels, also this "
                    "machine's measured read bandwidth, integer peak and float peak (a probe, "
                    "cached per machine) and each T's floor: max(bytes / bandwidth, integer "
                    "multiply-adds / integer peak + attention's float multiply-adds / float peak), "
                    "and the % of it reached.\n\nExample:\n"
                    "    eyas bench costs --model smollm2-135m --dtype float32",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    costs.add_argument("--model", default="smollm2-135m", help="model spec (default: %(default)s)")
    costs.add_argument("--dtype", default="auto", choices=PRECISIONS, help="precision (default: %(default)s)")
    add_kv_dtype_arg(costs)
    costs.add_argument("--repeats", type=int, default=7, help="timed passes per size (median)")
    costs.add_argument("--prefill", type=int, default=None, metavar="N",
                       help="also time the prefill of an N-token prompt: one pass, the engine's "
                            "chunks of --prefill-chunk tokens, and the engine end to end")
    costs.add_argument("--prefill-chunk", type=int, default=None,
                       help="tokens per prefill pass in the engine (default: eyas serve's, 256)")
    costs.add_argument("--probe-again", action="store_true",
                       help="measure this machine's bandwidth and integer and float peaks again (they are cached)")
    costs.set_defaults(func=run_costs_cli)


def run_costs_cli(args: argparse.Namespace) -> int:
    from eyas.bench.floors import (costs_table, describe_limits, describe_work, floor_seconds, model_work,
                                   prefill_work)
    from eyas.engine.speculative.sizing import measure_verify_costs
    from eyas.engine.target import load_target
    from eyas.models.probe import machine_limits

    if args.prefill is not None and args.prefill < 1:
        raise EyasError(f"--prefill must be >= 1 tokens, got {args.prefill}")
    if args.prefill_chunk is not None and args.prefill_chunk < 1:
        raise EyasError(f"--prefill-chunk must be >= 1 tokens, got {args.prefill_chunk}")
    target = load_target(args.model, dtype=args.dtype, kv_dtype=args.kv_dtype)
    limits = machine_limits(refresh=args.probe_again)  # probed once per machine, then cached
    for line in describe_limits(limits):
        print(line)
    work = model_work(target.model) if limits is not None else None
    if work is not None:
        print(describe_work(work))
    costs = measure_verify_costs(target, context=COST_CONTEXT, repeats=args.repeats)
    print(f"verification cost of {args.model} ({target.precision}, KV cache "
          f"{str(target.kv_dtype).removeprefix('torch.')}), one greedy pass over T tokens "
          f"after {COST_CONTEXT} cached:")
    for line in costs_table(costs, work, limits, COST_CONTEXT):
        print(line)
    if args.prefill is not None:
        from eyas.bench.prefill import measure_prefill

        from eyas.scheduler.config import EngineConfig

        chunk = args.prefill_chunk or EngineConfig().prefill_chunk
        timing = measure_prefill(target, tokens=args.prefill, chunk=chunk,
                                 repeats=args.repeats)
        for line in timing.describe():
            print(line)
        if work is not None:
            floor, bound_by = floor_seconds(prefill_work(work, args.prefill), limits)
            print(f"  floor {floor * 1e3:.1f} ms ({bound_by}: {args.prefill / floor:.0f} tokens/s; causal "
                  f"attention counted); the chunked passes at {100 * floor / timing.chunked_s:.0f}% of it")
    return 0


def _register_profile(sub: argparse._SubParsersAction) -> None:
    from eyas.bench.profile import ProfileConfig

    d = ProfileConfig()
    profile = sub.add_parser(
        "profile", help="where the time of a target pass goes, part by part, beside each part's floor",
        description="Time one greedy target pass over T new tokens (after --context cached ones) "
                    "and its parts: inside the one C++ call of the decoder stack, each matmul, the "
                    "activation rounding, attention with the tree mask, norms, rotary, SiLU, "
                    "residuals and thread waits; the output screen and its exact re-check, "
                    "Python; each in ms, % of the pass and its own floor (bytes / measured "
                    "bandwidth, multiply-adds / measured integer peak; attention's float "
                    "multiply-adds / measured float peak).\n\nExample:\n"
                    "    eyas bench profile --model smollm2-135m --tokens 1,8,32\n"
                    "    eyas bench profile --sequences 16 --tokens 1 --context 200   # a serving step",
        formatter_class=argparse.RawDescriptionHelpFormatter)
    profile.add_argument("--model", default=d.model, help="model spec (default: %(default)s)")
    profile.add_argument("--dtype", default=d.dtype, choices=PRECISIONS, help="precision (default: %(default)s)")
    add_kv_dtype_arg(profile)
    profile.add_argument("--tokens", type=_concurrency_list, default=d.tokens,
                         help="new tokens per pass, comma-separated (default: 1,8,32)")
    profile.add_argument("--context", type=int, default=d.context, help="cached tokens (default: %(default)s)")
    profile.add_argument("--sequences", type=int, default=d.sequences,
                         help="requests in each pass, each its own KV cache row with --context cached "
                              "tokens and T new ones, laid out as the server's KV pool lays them out: "
                              "the serving engine's continuous-batching step (T = 1: plain decoding "
                              "of that many requests; default: %(default)s)")
    profile.add_argument("--repeats", type=int, default=d.repeats, help="timed passes per T (median)")
    profile.add_argument("--clock", default=d.clock, choices=("wall", "cpu"),
                         help="wall time, or the thread's CPU time (a loaded machine; needs OMP_NUM_THREADS=1)")
    profile.add_argument("--probe-again", action="store_true",
                         help="measure this machine's bandwidth and integer and float peaks again (they are cached)")
    profile.set_defaults(func=run_profile_cli)


def run_profile_cli(args: argparse.Namespace) -> int:
    from eyas.bench.profile import ProfileConfig, format_profile, run_profile

    try:
        config = ProfileConfig(args.model, args.dtype, tuple(args.tokens), args.context, args.repeats, args.clock,
                               args.kv_dtype, args.sequences)
    except ValueError as error:
        raise EyasError(str(error)) from None
    profiles, header = run_profile(config, refresh_limits=args.probe_again)
    for line in header + format_profile(profiles):
        print(line)
    return 0


def split_systems(text: str) -> list[str]:
    """'eyas:int4,eyas:int4+ngram:3,1,3,hf' -> systems; commas inside a draft option stay.

    ';' always separates; ',' separates unless the next piece starts with a digit (a draft
    option: a number, or a layer range such as 5-9).
    """
    systems: list[str] = []
    for chunk in text.split(";"):
        for piece in chunk.split(","):
            piece = piece.strip()
            if not piece:
                continue
            if systems and piece[0].isdigit():
                systems[-1] += "," + piece
            else:
                systems.append(piece)
    return systems


def offline_systems(model: str, systems: str | None = None, draft: str | None = None,
                    peers: bool = False, with_llama_cpp: bool | None = None) -> list[str]:
    """The systems of `eyas bench offline` from its flags; with --peers, the peers come after the
    eyas rows (each once), plain transformers last."""
    from eyas.bench.peers import peer_systems

    if systems:
        chosen = split_systems(systems)
    elif draft:
        chosen = ["eyas:auto", f"eyas:auto+{draft}", "hf"]
    else:
        chosen = ["eyas:auto", "eyas:float32", "hf"]
    if not peers:
        return chosen
    added = peer_systems(model, draft, with_llama_cpp)
    return [system for system in chosen if system not in added] + added


def run_offline_cli(args: argparse.Namespace) -> int:
    from eyas.bench.offline import OfflineConfig, format_report, run_offline

    systems = offline_systems(args.model, args.systems, args.draft, args.peers)
    config = OfflineConfig(model=args.model, dataset=args.dataset, num_prompts=args.num_prompts,
                           max_tokens=args.max_tokens, systems=systems,
                           num_draft_tokens=args.num_draft_tokens, tree=args.tree)
    report = run_offline(config)
    for line in _limits_lines():
        print(line)
    print(format_report(report))
    if args.output:
        write_json_atomic(args.output, report)
        print(f"report written to {args.output}")
    return 0


def _limits_lines() -> list[str]:
    """This machine's CPU, instruction set and measured limits (the header of offline and costs)."""
    from eyas.bench.floors import describe_limits
    from eyas.models.probe import machine_limits

    try:
        return describe_limits(machine_limits())
    except RuntimeError as error:  # the probe could not run: say so, the benchmark stands
        return [f"limits not measured: {error}"]


# ----- serving sweeps: serve, plot, compare -----

def _concurrency_list(text: str) -> list[int]:
    try:
        return [int(level) for level in text.split(",") if level.strip()]
    except ValueError:
        raise argparse.ArgumentTypeError(f"expected comma-separated integers such as 1,2,4,8,16, "
                                         f"got '{text}'") from None


def _add_sweep_args(parser: argparse.ArgumentParser) -> None:
    """Flags of SweepConfig; their defaults are the dataclass's own."""
    from eyas.bench.serve_client import ENDPOINTS, SweepConfig

    d = SweepConfig()
    parser.add_argument("--dataset", default=d.dataset,
                        help="mtbench, sharegpt, random, repeated or jsonl:PATH (default: %(default)s)")
    parser.add_argument("--num-prompts", type=int, default=d.num_prompts,
                        help="requests per concurrency level (default: %(default)s)")
    parser.add_argument("--concurrency", type=_concurrency_list, default=d.concurrency,
                        help=f"levels of requests in flight (default: {','.join(map(str, d.concurrency))})")
    parser.add_argument("--max-tokens", type=int, default=d.max_tokens, help="default: %(default)s")
    parser.add_argument("--endpoint", choices=list(ENDPOINTS), default=d.endpoint,
                        help="chat = /v1/chat/completions, completions = /v1/completions "
                             "(default: %(default)s)")
    parser.add_argument("--temperature", type=float, default=d.temperature, help="default: %(default)s")
    parser.add_argument("--ignore-eos", action="store_true",
                        help="ask the server to generate max_tokens every time (vLLM/SGLang/eyas)")
    parser.add_argument("--continuous-usage-stats", action="store_true",
                        help="ask for usage in every chunk (vLLM), for exact tokens per chunk")
    parser.add_argument("--input-len", type=int, default=d.input_len,
                        help="prompt tokens of the random dataset (default: %(default)s)")
    parser.add_argument("--seed", type=int, default=d.seed, help="random dataset seed (default: 0)")
    parser.add_argument("--warmup", type=int, default=d.warmup,
                        help="warm-up rounds per level, each `concurrency` short requests "
                             "(default: %(default)s)")
    parser.add_argument("--tokenizer", default=d.tokenizer,
                        help="counts tokens the server does not report; 'none' for no tokenizer "
                             "(default: %(default)s)")
    parser.add_argument("--request-timeout", type=float, default=d.request_timeout,
                        help="seconds per request (default: %(default)s)")
    parser.add_argument("--level-timeout", type=float, default=d.level_timeout,
                        help="seconds per concurrency level (default: %(default)s)")
    parser.add_argument("--workload", choices=["single", "multiturn"], default=d.workload,
                        help="single: one request per prompt; multiturn: ShareGPT conversations "
                             "sent turn by turn with their history, TTFT of turns 2+ reported "
                             "apart (default: %(default)s)")
    parser.add_argument("--max-turns", type=int, default=d.max_turns,
                        help="multiturn: most user turns per conversation (default: %(default)s)")
    parser.add_argument("--client", choices=["raw", "httpx"], default=d.client,
                        help="HTTP client of the streamed requests: raw (a small asyncio client, "
                             "little CPU per chunk, for a load generator on the server's own "
                             "cores) or httpx (honours proxy settings) (default: %(default)s)")
    parser.add_argument("--no-progress", action="store_true", help="no progress bars")


def _sweep_from_args(args: argparse.Namespace) -> SweepConfig:
    from eyas.bench.serve_client import SweepConfig

    return SweepConfig(dataset=args.dataset, num_prompts=args.num_prompts,
                       concurrency=args.concurrency, max_tokens=args.max_tokens,
                       endpoint=args.endpoint, temperature=args.temperature,
                       ignore_eos=args.ignore_eos, continuous_usage_stats=args.continuous_usage_stats,
                       input_len=args.input_len, seed=args.seed, warmup=args.warmup,
                       tokenizer=args.tokenizer, request_timeout=args.request_timeout,
                       level_timeout=args.level_timeout, workload=args.workload,
                       max_turns=args.max_turns, client=args.client)


def _register_serve(sub: argparse._SubParsersAction) -> None:
    serve = sub.add_parser("serve", help="latency/throughput sweep against an OpenAI-compatible server",
                           description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    serve.add_argument("--url", required=True, help="server base URL, e.g. http://127.0.0.1:8000")
    serve.add_argument("--model", default=None,
                       help="model name sent to the server (default: the first of /v1/models)")
    serve.add_argument("--label", default="default",
                       help="this configuration's name in tables and plots (default: %(default)s)")
    serve.add_argument("--output-dir", default=None,
                       help="where result.json, report.md and the plots go "
                            "(default: runs/bench/LABEL-DATE)")
    _add_sweep_args(serve)
    serve.set_defaults(func=run_serve_cli)


def run_serve_cli(args: argparse.Namespace) -> int:
    from eyas.bench.report import markdown_report, write_run
    from eyas.bench.serve_bench import run_serve_benchmark
    from eyas.bench.serve_client import ServeBenchConfig

    config = ServeBenchConfig(url=args.url, label=args.label, model=args.model,
                              sweep=_sweep_from_args(args))
    run = run_serve_benchmark(config, progress=not args.no_progress)
    output_dir = args.output_dir or f"runs/bench/{args.label}-{datetime.now():%Y%m%d-%H%M%S}"
    paths = write_run(run, output_dir)
    print(markdown_report([run]))
    print("written: " + ", ".join(str(path) for path in paths))
    return 0


def _register_plot(sub: argparse._SubParsersAction) -> None:
    plot = sub.add_parser("plot", help="merge serve runs into one report and plots",
                          description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    plot.add_argument("runs", nargs="+", metavar="RUN.json", help="result.json files of serve runs")
    plot.add_argument("--output-dir", required=True, help="where report.md and the plots go")
    plot.set_defaults(func=run_plot_cli)


def run_plot_cli(args: argparse.Namespace) -> int:
    from eyas.bench.report import load_run, markdown_report, write_report

    runs = [load_run(path) for path in args.runs]
    paths = write_report(runs, args.output_dir)
    print(markdown_report(runs))
    print("written: " + ", ".join(str(path) for path in paths))
    return 0


def _register_compare(sub: argparse._SubParsersAction) -> None:
    from eyas.bench.compare import CompareConfig

    d = CompareConfig()
    compare = sub.add_parser("compare", help="start eyas serve per draft configuration, sweep each",
                             description=__doc__,
                             formatter_class=argparse.RawDescriptionHelpFormatter)
    compare.add_argument("--model", default=d.model, help="target model spec (default: %(default)s)")
    compare.add_argument("--draft", action="append", dest="drafts", default=None,
                         metavar="DRAFT|LABEL=DRAFT",
                         help="a configuration for `eyas serve --draft` (repeatable; "
                              "default: none and ngram)")
    compare.add_argument("--output-dir", default=d.output_dir, help="default: %(default)s")
    compare.add_argument("--server-command", default=d.server_command,
                         help="server command template with {python} {model} {draft} {host} "
                              "{port} (default: %(default)s)")
    compare.add_argument("--start-timeout", type=float, default=d.start_timeout,
                         help="seconds to wait for /health (default: %(default)s)")
    compare.add_argument("--stop-timeout", type=float, default=d.stop_timeout,
                         help="seconds from SIGTERM to SIGKILL (default: %(default)s)")
    _add_sweep_args(compare)
    compare.set_defaults(func=run_compare_cli)


def run_compare_cli(args: argparse.Namespace) -> int:
    from eyas.bench.compare import CompareConfig, run_compare
    from eyas.bench.report import markdown_report

    config = CompareConfig(model=args.model, drafts=args.drafts or CompareConfig().drafts,
                           output_dir=args.output_dir, server_command=args.server_command,
                           start_timeout=args.start_timeout, stop_timeout=args.stop_timeout,
                           sweep=_sweep_from_args(args))
    outcome = run_compare(config, progress=not args.no_progress)
    print(markdown_report(outcome["runs"], outcome["failures"]))
    print(f"report and plots written to {config.output_dir}")
    if outcome["failures"]:
        raise EyasError(f"not measured: {', '.join(outcome['failures'])} (see the report)")
    return 0


def _register_soak(sub: argparse._SubParsersAction) -> None:
    from eyas.bench import soak as soak_module

    d = soak_module.SoakConfig()
    soak = sub.add_parser("soak", help="a long mixed load against eyas serve, per drafting method: "
                                       "lost requests, 5xx, KV rows, memory growth",
                          description=soak_module.__doc__,
                          formatter_class=argparse.RawDescriptionHelpFormatter)
    soak.add_argument("--model", default=d.model, help="target model spec (default: %(default)s)")
    soak.add_argument("--minutes", type=float, default=d.minutes,
                      help="in all, split evenly between the drafting methods (default: %(default)s)")
    soak.add_argument("--concurrency", type=int, default=d.concurrency,
                      help="clients, one request in flight each (default: %(default)s)")
    soak.add_argument("--drafts", default=None,
                      help="drafting methods in turn, ';'- or ','-separated `eyas serve --draft` "
                           "values (default: none, ngram, eagle3:MODEL where a head is shipped for "
                           "the model, self, layerskip:auto)")
    soak.add_argument("--dataset", default=d.dataset,
                      help="'+'-joined prompt sets: mtbench, sharegpt, jsonl:PATH (default: %(default)s)")
    soak.add_argument("--min-tokens", type=int, default=d.min_tokens, help="default: %(default)s")
    soak.add_argument("--max-tokens", type=int, default=d.max_tokens, help="default: %(default)s")
    soak.add_argument("--stream-share", type=float, default=d.stream_share, help="default: %(default)s")
    soak.add_argument("--cancel-share", type=float, default=d.cancel_share,
                      help="share of streams the client closes mid-way (default: %(default)s)")
    soak.add_argument("--sample-seconds", type=float, default=d.sample_seconds,
                      help="resident memory sampling period (default: %(default)s)")
    soak.add_argument("--warmup-seconds", type=float, default=d.warmup_seconds,
                      help="memory baseline after this long, at most 40%% of a method's time "
                           "(default: %(default)s)")
    soak.add_argument("--server-flags", default=d.server_flags,
                      help="more `eyas serve` flags, e.g. '--max-running 16 --dtype int4'")
    soak.add_argument("--request-timeout", type=float, default=d.request_timeout,
                      help="seconds without a byte before a client gives up (counted as timed "
                           "out) (default: %(default)s)")
    soak.add_argument("--seed", type=int, default=d.seed, help="default: %(default)s")
    soak.add_argument("--output", default=d.output, help="JSON report (default: %(default)s)")
    soak.set_defaults(func=run_soak_cli)


def run_soak_cli(args: argparse.Namespace) -> int:
    from eyas.bench.soak import SoakConfig, default_drafts, format_table, run_soak

    drafts = split_systems(args.drafts) if args.drafts else default_drafts(args.model)
    config = SoakConfig(model=args.model, minutes=args.minutes, concurrency=args.concurrency,
                        drafts=drafts, dataset=args.dataset,
                        min_tokens=args.min_tokens, max_tokens=args.max_tokens,
                        stream_share=args.stream_share, cancel_share=args.cancel_share,
                        sample_seconds=args.sample_seconds, warmup_seconds=args.warmup_seconds,
                        server_flags=args.server_flags, request_timeout=args.request_timeout,
                        seed=args.seed, output=args.output)
    report = run_soak(config)
    print(format_table(report))
    print(f"report written to {config.output}")
    if not report["ok"]:
        raise EyasError("the soak found lost requests, 5xx answers, KV rows left in use or a "
                        "method that did not run (see the table)")
    return 0
