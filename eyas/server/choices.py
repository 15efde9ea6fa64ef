"""The engine requests behind one HTTP request: `n` samples of each prompt, merged into choices.

A request with `n` samples and P prompts (completions take a list of prompts) becomes P x n
engine requests, submitted together so that they batch; choice `index = prompt_index * n +
sample_index`, as OpenAI and vLLM number them. Sample i of a seeded request is seeded with
seed + i (`SamplingParams.for_sample`), so every prompt's sample i gets the same seed.

Usage (inside a route):
    choices = ChoiceSet(engine, asyncio.get_running_loop())
    choices.submit(prompts, n, params_for, processors_for)   # RequestRejected / QueueFull
    while not choices.finished:
        choice, output = await choices.next()                # or next(merge=True): see there
    choices.usage()

Outputs reach the event loop through the loop's `OutputRelay` (relay.py): one wake-up per
engine step, whatever the number of requests in it.
"""

from __future__ import annotations

import asyncio
from collections import deque
from dataclasses import dataclass, field, replace
from typing import Any, Callable

from eyas.engine.logits_process import LogitsProcessor
from eyas.engine.logprobs import TokenLogprob
from eyas.engine.sampling import SamplingParams
from eyas.scheduler.engine import Engine
from eyas.scheduler.request import Request as EngineRequest
from eyas.scheduler.request import RequestOutput
from eyas.server.relay import OutputRelay


@dataclass
class Choice:
    index: int
    prompt_index: int
    prompt_ids: list[int]
    request: EngineRequest | None = None
    texts: list[str] = field(default_factory=list)
    logprobs: list[TokenLogprob] = field(default_factory=list)
    prompt_logprobs: list[TokenLogprob | None] | None = None
    final: RequestOutput | None = None
    started: bool = False  # a stream has sent this choice's first chunk
    offset: int = 0  # characters streamed so far (completions logprobs' text_offset)

    @property
    def text(self) -> str:
        return "".join(self.texts)


class ChoiceSet:
    def __init__(self, engine: Engine, loop: asyncio.AbstractEventLoop) -> None:
        self.engine = engine
        self.relay = OutputRelay.of(loop)
        self.pending: deque[tuple[int, RequestOutput]] = deque()  # delivered, not yet taken
        self.waiter: asyncio.Future | None = None  # next() waiting for a delivery
        self.choices: list[Choice] = []
        self.unfinished = 0  # choices whose final output has not been taken yet

    def submit(self, prompts: list[list[int]], n: int,
               params_for: Callable[[list[int]], SamplingParams],
               processors_for: Callable[[list[int], SamplingParams], list[LogitsProcessor]]) -> None:
        """Submit every (prompt, sample); if one is refused, abort those already in and
        re-raise (RequestRejected: it does not fit; QueueFull)."""
        for prompt_index, prompt_ids in enumerate(prompts):
            params = params_for(prompt_ids)
            for sample in range(n):
                choice = Choice(prompt_index * n + sample, prompt_index, prompt_ids)
                sample_params = params.for_sample(sample)
                try:
                    choice.request = self.engine.submit(
                        prompt_ids, sample_params, self._callback(choice.index),
                        logits_processors=processors_for(prompt_ids, sample_params))
                except Exception:
                    self.abort_unfinished()
                    raise
                self.choices.append(choice)
                self.unfinished += 1

    def _callback(self, index: int) -> Callable[[RequestOutput], None]:
        def on_output(output: RequestOutput) -> None:  # on the engine thread
            self.relay.post(self, (index, output))
        return on_output

    def deliver(self, items: list[tuple[int, RequestOutput]]) -> None:
        """On the event loop (the relay): outputs in the order the engine emitted them."""
        self.pending.extend(items)
        waiter = self.waiter
        if waiter is not None and not waiter.done():
            waiter.set_result(None)

    async def next(self, merge: bool = False) -> tuple[Choice, RequestOutput]:
        """The next output of any choice, folded into that choice's text and logprobs.

        merge: with a single choice, every output already delivered comes back as one (texts,
        tokens and logprobs joined; the totals and the finish of the last), so that a stream
        that falls behind the engine sends one event for several steps, not one per step. An
        output that failed is never merged into another."""
        while not self.pending:
            self.waiter = self.relay.loop.create_future()
            try:
                await self.waiter
            finally:
                self.waiter = None
        index, output = self.pending.popleft()
        if merge and len(self.choices) == 1:
            while self.pending and not output.finished and self.pending[0][1].finish_reason != "error":
                output = merged(output, self.pending.popleft()[1])
        choice = self.choices[index]
        choice.texts.append(output.text)
        if output.logprobs:
            choice.logprobs.extend(output.logprobs)
        if output.prompt_logprobs is not None:
            choice.prompt_logprobs = output.prompt_logprobs
        if output.finished:
            if choice.final is None:
                self.unfinished -= 1
            choice.final = output
        return choice, output

    @property
    def finished(self) -> bool:
        return self.unfinished == 0

    def abort_unfinished(self) -> None:
        for choice in self.choices:
            if choice.final is None and choice.request is not None:
                self.engine.abort(choice.request.request_id)

    def usage(self) -> dict[str, int]:
        """Prompt tokens once per prompt, completion tokens summed over every choice (as
        OpenAI and vLLM count them)."""
        prompts: dict[int, int] = {}
        completion = 0
        for choice in self.choices:
            prompts[choice.prompt_index] = len(choice.prompt_ids)
            completion += choice.final.completion_tokens if choice.final is not None else 0
        prompt = sum(prompts.values())
        return {"prompt_tokens": prompt, "completion_tokens": completion,
                "total_tokens": prompt + completion}

    def speculative(self) -> dict[str, Any] | None:
        """The drafting statistics of the request: the one choice's, or summed over choices."""
        stats = [c.final.speculative for c in self.choices if c.final is not None and c.final.speculative]
        if len(stats) <= 1:
            return stats[0] if stats else None
        summed: dict[str, Any] = {"method": stats[0]["method"], "choices": len(stats)}
        for key in ("verification_steps", "draft_tokens", "accepted_tokens", "plain_steps"):
            summed[key] = sum(s.get(key, 0) for s in stats)
        steps = summed["verification_steps"]
        summed["acceptance_length"] = round(1 + summed["accepted_tokens"] / steps, 4) if steps else 1.0
        return summed


def merged(first: RequestOutput, second: RequestOutput) -> RequestOutput:
    """Two successive outputs of one request as one: the new text, tokens and logprobs of both;
    the totals, finish and statistics of the second."""
    logprobs = first.logprobs
    if second.logprobs is not None:
        logprobs = (first.logprobs or []) + second.logprobs
    return replace(second, text=first.text + second.text, token_ids=first.token_ids + second.token_ids,
                   logprobs=logprobs,
                   prompt_logprobs=first.prompt_logprobs if first.prompt_logprobs is not None
                   else second.prompt_logprobs)
