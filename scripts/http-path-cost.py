"""CPU of the HTTP path alone, per streamed token: the app in front of a stand-in engine.

The stand-in takes requests like `Engine.submit` and, on its own thread, emits one token of
text for every running request every `--step-ms` (as an engine step does), then a final
output. Nothing computes, so the CPU seconds of the app's event loop thread (uvicorn) and of
the stand-in's thread per output token are the HTTP path's own cost, free of the model's noise.
The load comes from `eyas bench serve` in a second process; its sweep CPU is reported too.

Usage:
    PYTHONPATH=$PWD python scripts/http-path-cost.py --concurrency 1 16 --client raw
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import tempfile
import threading
import time
from pathlib import Path
from types import SimpleNamespace

from eyas.scheduler.request import RequestOutput
from eyas.utils.thread_cpu import thread_cpu_seconds


class StandInEngine:
    """What the app uses of `Engine`, with a clock instead of a model."""

    def __init__(self, tokenizer, step_s: float, tokens: int) -> None:
        self.target = SimpleNamespace(tokenizer=tokenizer, config=SimpleNamespace(vocab_size=len(tokenizer)))
        self.max_model_len = 4096
        self.alive = True
        self.step_s, self.tokens = step_s, tokens
        self.running: list[dict] = []
        self.lock = threading.Lock()
        self.count = 0
        self.thread = threading.Thread(target=self.loop, name="stand-in-engine", daemon=True)
        self.thread.start()

    def submit(self, prompt_ids, params, on_output, logits_processors=()):
        with self.lock:
            self.count += 1
            request = {"id": f"r{self.count}", "left": min(params.max_tokens, self.tokens),
                       "done": 0, "prompt": len(prompt_ids), "on_output": on_output}
            self.running.append(request)
        return SimpleNamespace(request_id=request["id"])

    def abort(self, request_id: str) -> None:
        pass

    def shutdown(self, *args, **kwargs) -> None:
        self.alive = False

    def loop(self) -> None:
        while self.alive:
            time.sleep(self.step_s)
            with self.lock:
                running = list(self.running)
            for request in running:
                request["done"] += 1
                request["left"] -= 1
                finished = request["left"] == 0
                request["on_output"](RequestOutput(request["id"], " word", [42], finished,
                                                   "length" if finished else None, request["prompt"],
                                                   request["done"]))
                if finished:
                    with self.lock:
                        self.running.remove(request)


def thread_cpu(name: str) -> float:
    return thread_cpu_seconds().get(name, 0.0)


def main() -> int:
    parser = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    parser.add_argument("--concurrency", nargs="+", type=int, default=[1, 16])
    parser.add_argument("--num-prompts", type=int, default=32)
    parser.add_argument("--max-tokens", type=int, default=96)
    parser.add_argument("--step-ms", type=float, default=8.0)
    parser.add_argument("--client", default="raw", help="bench serve --client ('default': no flag)")
    parser.add_argument("--http", default="auto", help="uvicorn's HTTP implementation (auto, h11, httptools)")
    parser.add_argument("--loop", default="auto", help="uvicorn's event loop (auto, asyncio, uvloop)")
    parser.add_argument("--profile", default=None, help="cProfile (thread CPU clock) of the event loop thread to PATH")
    args = parser.parse_args()

    from eyas.models.tokenizer import load_tokenizer
    from eyas.server.app import ServerSettings, create_app
    from eyas.server.metrics import ServerMetrics
    from eyas.server.runner import BackgroundServer

    engine = StandInEngine(load_tokenizer("smollm2-135m"), args.step_ms / 1e3, args.max_tokens)
    app = create_app(engine, ServerSettings(model_name="smollm2-135m"), ServerMetrics("smollm2-135m"),
                     start_engine=False)
    server = BackgroundServer(app, http=args.http, loop=args.loop)
    if args.profile:
        import cProfile

        def profiled_run() -> None:
            profile = cProfile.Profile(time.thread_time)
            try:
                profile.runcall(server.server.run)
            finally:
                profile.dump_stats(args.profile)

        server.thread = threading.Thread(target=profiled_run, name="eyas-http", daemon=True)
    server.start()
    for concurrency in args.concurrency:
        out = Path(tempfile.mkdtemp(prefix="http-path-"))
        command = [sys.executable, "-m", "eyas", "bench", "serve", "--url", server.url,
                   "--num-prompts", str(args.num_prompts), "--max-tokens", str(args.max_tokens),
                   "--concurrency", str(concurrency), "--warmup", "1", "--tokenizer", "none",
                   "--output-dir", str(out), "--no-progress"]
        if args.client != "default":
            command += ["--client", args.client]
        http_before, engine_before = thread_cpu("eyas-http"), thread_cpu("stand-in-engine")
        subprocess.run(command, check=True, stdout=subprocess.DEVNULL)
        http_s = thread_cpu("eyas-http") - http_before
        engine_s = thread_cpu("stand-in-engine") - engine_before
        result = json.loads((out / "result.json").read_text())["results"][0]
        tokens = result["total_output_tokens"] + concurrency * min(16, args.max_tokens)  # + warm-up
        print(json.dumps({"concurrency": concurrency, "client": args.client, "http": args.http,
                          "loop": args.loop,
                          "http_thread_ms_per_token": round(1e3 * http_s / tokens, 4),
                          "engine_thread_ms_per_token": round(1e3 * engine_s / tokens, 4),
                          "client_ms_per_token": round(result.get("client_cpu_ms_per_output_token") or -1, 4),
                          "tokens_per_s": round(result["output_throughput"], 1)}), flush=True)
    server.stop()
    return 0


if __name__ == "__main__":
    raise SystemExit(main())
