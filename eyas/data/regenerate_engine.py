"""In-process regeneration through the serving engine: continuous batching over conversations.

Usage (what `eyas data regenerate --model M` runs; see eyas/data/regenerate.py):
    run_with_engine(config, pending, output, report, bar, started)

`config.concurrency` conversations are in flight at once. Each one is driven by a worker
thread that renders its next turn with the target's chat template, submits it to the engine and
waits for the answer, so a conversation's turns go in order (turn 2 is asked on turn 1's
regenerated answer) while different conversations decode together: the engine admits a new
turn into the running batch as soon as another one finishes (no padding to the longest prompt,
no batch waiting for its slowest row). The engine's loop runs on this (the main) thread, the one
that loaded the model, as `eyas serve` runs it (eyas/scheduler/loop.py says why); the workers do
no torch work, only templates and bookkeeping.

Greedy answers equal those of the fixed-batch path (`batch_size`), turn for turn (tested).
Sampled answers with a seed use seed + 1,000 x (the record's place among those pending) + turn,
so a rerun with the same seed over the same input gives the same answers.
"""

from __future__ import annotations

import threading
import time
from typing import Any, Iterator

from eyas.data.endpoint import Answer
from eyas.data.records import Conversation
from eyas.data.resume import ResumableJsonl

SEED_STRIDE = 1000  # seeds per record: one per turn


def run_with_engine(config: Any, pending: list[Conversation], output: ResumableJsonl,
                    report: Any, bar: Any, started: float) -> None:
    """Regenerate `pending` with `config.concurrency` conversations in the engine at once."""
    from eyas.data.regenerate import prompt_history, record_written, regenerated_record
    from eyas.data.templates import TemplateError, render_prompt
    from eyas.engine.sampling import SamplingParams
    from eyas.engine.target import load_target
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine

    assert config.model is not None
    target = load_target(config.model, dtype=config.dtype, device=config.device)
    context = target.config.context_length
    rows = config.concurrency
    # A CPU step costs about its rows: 512 tokens keeps each step short. A GPU step costs about
    # the same for 512 rows or 2,048: a larger budget lets new turns prefill beside full decoding.
    step_tokens = max(512, rows) if target.device.type == "cpu" else max(2048, 2 * rows)
    engine = Engine(target, EngineConfig(max_running=rows, max_waiting=rows, max_step_tokens=step_tokens,
                                         max_model_len=context, speculation="never"), draft="none")
    report.model_load_seconds = time.perf_counter() - started
    started = time.perf_counter()  # tokens/s counts decoding only
    sampling = config.sampling
    by = f"in-process:{config.model}"
    queue: Iterator[tuple[int, Conversation]] = iter(enumerate(pending))
    lock = threading.Lock()  # the queue, the output file, the report and the bar
    finished = threading.Event()
    remaining = [rows]  # workers still running
    errors: list[BaseException] = []

    def params_for(index: int, turn: int, prompt_len: int) -> SamplingParams:
        seed = None if sampling.seed is None else sampling.seed + SEED_STRIDE * index + turn
        return SamplingParams(max_tokens=min(sampling.max_tokens, context - prompt_len),
                              temperature=sampling.temperature, top_p=sampling.top_p,
                              top_k=sampling.top_k, seed=seed)

    def regenerate_one(index: int, conversation: Conversation) -> None:
        history, user_turns = prompt_history(conversation)
        answers: list[Answer] = []
        for turn, user_turn in enumerate(user_turns):
            # 1. The turn's prompt, rendered by the target's template on the history so far.
            history.append({"role": "user", "content": user_turn})
            try:
                prompt = render_prompt(target.tokenizer, history)
            except TemplateError:
                return _skip(report, bar, lock, "template_error")
            if len(prompt) >= context - 1:  # the same limit as the fixed-batch path
                return _skip(report, bar, lock, "prompt_too_long")
            # 2. Its answer, decoded in the engine's running batch; it joins the history.
            result = engine.generate(prompt, params_for(index, turn, len(prompt)))
            history.append({"role": "assistant", "content": result.text})
            answers.append(Answer(result.text, len(result.token_ids), result.finish_reason))
        # 3. The finished conversation: one atomic append.
        with lock:
            output.append(regenerated_record(conversation, history, answers, by))
            record_written(report, answers, bar, started)

    def worker() -> None:
        try:
            while not errors:
                with lock:
                    item = next(queue, None)
                if item is None:
                    return
                regenerate_one(*item)
        except BaseException as error:  # surfaces on the main thread once the engine stops
            errors.append(error)
        finally:
            with lock:
                remaining[0] -= 1
                if remaining[0] == 0:
                    finished.set()

    workers = [threading.Thread(target=worker, name=f"eyas-regenerate-{i}", daemon=True)
               for i in range(rows)]
    for thread in workers:
        thread.start()
    try:
        engine.run(stop_when=finished.is_set)  # returns once every worker is done and the engine idle
    finally:
        errors.append(StopIteration())  # workers take no new conversation (Ctrl-C, a failure)
        engine.shutdown(drain=False, timeout=5)
    if not isinstance(errors[0], StopIteration):
        raise errors[0]


def _skip(report: Any, bar: Any, lock: threading.Lock, reason: str) -> None:
    with lock:
        report.failed[reason] += 1
        bar.update(1)
