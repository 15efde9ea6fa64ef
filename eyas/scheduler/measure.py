"""Measure the serving engine in-process: output tokens/s against concurrency, per configuration.

Usage:
    python -m eyas.scheduler.measure --model smollm2-135m --prompts code \\
        --configs none ngram:auto ngram:always --concurrency 1 4 16 --max-tokens 128
    python -m eyas.scheduler.measure --configs none none+overlap ngram:auto ngram:auto+overlap
    python -m eyas.scheduler.measure --check-plain      # also check greedy == plain decoding
    python -m eyas.scheduler.measure --prompts repeated --num-prompts 32 --max-tokens 96 \
        --configs none suffix --concurrency 4 16 --rounds 2   # each prompt asked twice
    python -m eyas.scheduler.measure --prompts repeated --num-prompts 32 --max-tokens 96 \
        --configs none suffix --concurrency 16 --warmup 1 --rounds 6   # warm, paired ratios

    python -m eyas.scheduler.measure --num-prompts 32 --configs none~off none~3 \
        --concurrency 4 16 --rounds 3   # prefill as the budget allows vs priced (--prefill-stretch)

A configuration is DRAFT[:SPECULATION][+overlap][~STRETCH], e.g. `ngram:auto+overlap` or
`eagle3:smollm2-135m+ngram:auto` (a DRAFT may carry its own +ngram graft); `~3` or `~off` sets
the engine's prefill_stretch (default: EngineConfig's). Each row reports output tokens/s, the
median time per output token of a request after its first (TPOT) and the median / 90th
percentile time to its first token (TTFT, from submission). For each
concurrency C, C requests are kept in flight (closed loop) until every prompt has been answered
(the prompt list repeats to at least 2C requests); tokens/s = generated tokens / wall time. At
each concurrency the configurations run one after the other, `--rounds` times, interleaved and
each round starting one configuration later, so that noise from a shared machine and the
warm-up of whichever runs first hit all alike; the median round is reported (every round's
tokens/s is in the JSON), and each configuration's tokens/s over the first one's, round by
round, with its median (`ratios`, `median_ratio`: on a shared, noisy machine the pairs of one
round are closer in time than two medians). `--warmup N` runs N unmeasured rounds of every
configuration first (the KV pool grows to its size there, as in a server that has run a while).
Greedy decoding.
This measures the engine alone (no HTTP); a load generator against `eyas serve` measures the
server as deployed.
"""

from __future__ import annotations

import argparse
import json
import threading
import time
from dataclasses import dataclass

from eyas.engine.sampling import SamplingParams
from eyas.engine.target import PRECISIONS, Target
from eyas.errors import EyasError
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.engine import Engine


@dataclass
class RunConfig:
    draft: str
    speculation: str
    overlap: bool
    prefill_stretch: float | None = EngineConfig.prefill_stretch

    @classmethod
    def parse(cls, text: str) -> RunConfig:
        stretch = EngineConfig.prefill_stretch
        head, mark, value = text.rpartition("~")
        if mark:
            try:
                stretch = None if value == "off" else float(value)
            except ValueError:
                raise EyasError(f"bad configuration '{text}': ~ takes a number or 'off'") from None
            text = head
        spec, flag = (text[: -len("+overlap")], "overlap") if text.endswith("+overlap") else (text, "")
        if "+" in spec.replace("+ngram", "").replace("+suffix", ""):
            raise EyasError(f"bad configuration '{text}': the suffixes are +ngram and +suffix "
                            "(EAGLE-3) and +overlap")
        draft, speculation = spec, "auto"
        for mode in ("auto", "always", "never"):
            if spec.endswith(":" + mode):
                draft, speculation = spec[: -len(mode) - 1], mode
        return cls(draft, speculation, flag == "overlap", stretch)


def run_closed_loop(engine: Engine, prompts: list[list[int]], params: SamplingParams,
                    concurrency: int) -> dict:
    """Keep `concurrency` requests in flight until all prompts are answered. The engine's loop
    runs on this thread (as in `eyas serve`); the load comes from a client thread."""
    lock = threading.Condition()
    state = {"next": 0, "done": 0, "tokens": 0, "accepted": 0, "drafted": 0}
    outputs: list[list[int]] = [[] for _ in prompts]
    submitted, first, last = [0.0] * len(prompts), [None] * len(prompts), [0.0] * len(prompts)

    def submit_next() -> None:
        index = state["next"]
        state["next"] += 1

        def on_output(output) -> None:
            now = time.perf_counter()
            if output.token_ids and first[index] is None:
                first[index] = now
            last[index] = now
            outputs[index].extend(output.token_ids)
            if output.finished:
                with lock:
                    state["done"] += 1
                    state["tokens"] += output.completion_tokens
                    spec = output.speculative or {}
                    state["accepted"] += spec.get("accepted_tokens", 0)
                    state["drafted"] += spec.get("draft_tokens", 0)
                    if state["next"] < len(prompts):
                        submit_next()
                    lock.notify()
        submitted[index] = time.perf_counter()
        engine.submit(prompts[index], params, on_output)

    finished = threading.Event()

    def client() -> None:
        with lock:
            for _ in range(min(concurrency, len(prompts))):
                submit_next()
            while state["done"] < len(prompts):
                lock.wait(1.0)
        finished.set()

    started = time.perf_counter()
    load = threading.Thread(target=client, name="measure-client")
    load.start()
    engine.run(stop_when=finished.is_set)
    load.join()
    seconds = time.perf_counter() - started
    ttft = sorted(f - s for f, s in zip(first, submitted) if f is not None)
    tpot = sorted((e - f) / (len(out) - 1) for f, e, out in zip(first, last, outputs)
                  if f is not None and len(out) > 1)
    return {"tokens_per_s": state["tokens"] / seconds, "seconds": seconds, "tokens": state["tokens"],
            "accepted": state["accepted"], "drafted": state["drafted"], "outputs": outputs,
            "tpot_ms": 1000 * quantile(tpot, 0.5), "ttft_ms": 1000 * quantile(ttft, 0.5),
            "ttft_p90_ms": 1000 * quantile(ttft, 0.9)}


def quantile(values: list[float], q: float) -> float:
    """The q-quantile of sorted values (nearest rank; 0 for none)."""
    if not values:
        return 0.0
    return values[min(len(values) - 1, int(q * len(values)))]


def load_prompts(target: Target, name: str, count: int) -> list[list[int]]:
    from eyas.bench.prompts import CODE_PROMPTS, mtbench_first_turns
    from eyas.models.tokenizer import chat_prompt_ids

    if name == "repeated":  # eyas.bench.repeated: first asks, then the same again
        from eyas.bench.repeated import repeated_prompts

        return [chat_prompt_ids(target.tokenizer, list(m)) for m in repeated_prompts(count)]
    questions = CODE_PROMPTS[:count] if name == "code" else mtbench_first_turns(count)
    return [chat_prompt_ids(target.tokenizer, [{"role": "user", "content": q}]) for q in questions]


def main(argv: list[str] | None = None) -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--model", default="smollm2-135m")
    parser.add_argument("--dtype", default="auto", choices=PRECISIONS)
    parser.add_argument("--prompts", default="mtbench", choices=["mtbench", "code", "repeated"])
    parser.add_argument("--num-prompts", type=int, default=8)
    parser.add_argument("--max-tokens", type=int, default=128)
    parser.add_argument("--configs", nargs="+", default=["none", "ngram:auto"])
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 2, 4, 8, 16])
    parser.add_argument("--num-draft-tokens", type=int, default=4)
    parser.add_argument("--rounds", type=int, default=1)
    parser.add_argument("--warmup", type=int, default=0,
                        help="unmeasured rounds of every configuration at each concurrency first")
    parser.add_argument("--check-plain", action="store_true", help="compare outputs with generate()")
    parser.add_argument("--json", default=None, help="write the results here")
    args = parser.parse_args(argv)
    if args.rounds < 1 or args.warmup < 0:
        parser.error(f"--rounds must be >= 1 and --warmup >= 0, got {args.rounds} and {args.warmup}")

    from eyas.engine.generate import generate
    from eyas.engine.target import load_target

    target = load_target(args.model, dtype=args.dtype)
    base = load_prompts(target, args.prompts, args.num_prompts)
    params = SamplingParams(max_tokens=args.max_tokens)
    configs = [RunConfig.parse(text) for text in args.configs]
    engines = {}
    for text, config in zip(args.configs, configs):
        engines[text] = Engine(target, EngineConfig(
            max_running=max(args.concurrency), speculation=config.speculation, overlap=config.overlap,
            num_draft_tokens=args.num_draft_tokens, prefill_stretch=config.prefill_stretch,
            prefix_caching=False), draft=config.draft)  # the prompts repeat: no prefix reuse
    expected = [generate(target, p, params).token_ids for p in base] if args.check_plain else None
    results = []
    print(f"model {args.model} ({target.precision}), prompts {args.prompts} x {len(base)}, "
          f"{args.max_tokens} new tokens, greedy")
    for concurrency in args.concurrency:
        prompts = base * max(1, -(-2 * concurrency // len(base)))
        runs: dict[str, list[dict]] = {text: [] for text in engines}
        order = list(engines.items())
        for round_index in range(-args.warmup, args.rounds):  # each round starts one configuration later
            shift = round_index % len(order)
            for text, engine in order[shift:] + order[:shift]:
                store = engine.proposers.suffix_store()
                if store is not None:  # suffix decoding: earlier runs' answers must not help
                    store.clear()
                run = run_closed_loop(engine, prompts, params, concurrency)
                if round_index >= 0:
                    runs[text].append(run)
        first = runs[order[0][0]]
        for text, rounds in runs.items():
            run = sorted(rounds, key=lambda r: r["tokens_per_s"])[len(rounds) // 2]  # the median round
            equal = None
            if expected is not None:
                equal = all(out == expected[i % len(base)]
                            for r in rounds for i, out in enumerate(r["outputs"]))
            accepted = run["accepted"] / run["drafted"] if run["drafted"] else 0.0
            row = {"concurrency": concurrency, "config": text,
                   "tokens_per_s": round(run["tokens_per_s"], 2),
                   "rounds_tokens_per_s": [round(r["tokens_per_s"], 2) for r in rounds],
                   "tpot_ms": round(run["tpot_ms"], 2), "ttft_ms": round(run["ttft_ms"], 1),
                   "ttft_p90_ms": round(run["ttft_p90_ms"], 1),
                   "rounds_tpot_ms": [round(r["tpot_ms"], 2) for r in rounds],
                   "seconds": round(run["seconds"], 3), "tokens": run["tokens"],
                   "draft_tokens": run["drafted"], "accepted_rate": round(accepted, 3),
                   "equal_to_plain": equal}
            ratios = [r["tokens_per_s"] / f["tokens_per_s"] for r, f in zip(rounds, first)]
            row["ratios"] = [round(x, 3) for x in ratios]
            row["median_ratio"] = round(sorted(ratios)[len(ratios) // 2], 3)
            results.append(row)
            print(json.dumps(row))
    for engine in engines.values():
        engine.shutdown()
    if args.json:
        with open(args.json, "w") as handle:
            json.dump({"args": vars(args), "results": results}, handle, indent=1)
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
