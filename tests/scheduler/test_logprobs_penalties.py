"""Logprobs and penalties through the batched engine (tiny model), drafts on and off.

- greedy logprobs with drafts (tree verification rows) equal those without to float tolerance,
  and both equal log_softmax of one plain forward over prompt + output;
- prompt logprobs across chunked prefill equal one forward over the whole prompt;
- penalties and logit_bias with drafts give plain decoding's tokens under the same parameters.
"""

from __future__ import annotations

import random
import threading

import pytest
import torch

from scheduler_support import run_all
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.engine import Engine


def prompts() -> list[list[int]]:
    rng = random.Random(1)
    varied = [[rng.randrange(100, 5000) for _ in range(rng.randrange(20, 50))] for _ in range(3)]
    return varied + [[5, 6, 7, 8, 9] * 8]  # repetitive: n-grams match


def serve(target, draft: str, jobs):
    config = EngineConfig(max_running=4, prefill_chunk=16, initial_kv_slots=16, speculation="always")
    engine = Engine(target, config, draft=draft).start()
    try:
        return run_all(engine, jobs)
    finally:
        engine.shutdown()


def full_logprobs(target, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward over ids: row p predicts ids[p + 1]."""
    with torch.inference_mode():
        logits = target.model(torch.tensor([ids])).logits[0]
    return torch.log_softmax(logits.float(), dim=-1)


@pytest.fixture(scope="module")
def logprob_jobs():
    params = SamplingParams(max_tokens=16, ignore_eos=True, logprobs=3, prompt_logprobs=2)
    return [(p, params) for p in prompts()]


def collect(target, draft, jobs):
    """Run jobs through an engine; per request (tokens, [entries], prompt entries, final)."""
    outputs = {}
    config = EngineConfig(max_running=4, prefill_chunk=16, initial_kv_slots=16, speculation="always")
    engine = Engine(target, config, draft=draft).start()
    done = [threading.Event() for _ in jobs]
    try:
        for index, (prompt, params) in enumerate(jobs):
            record = outputs.setdefault(index, {"tokens": [], "entries": [], "prompt": None, "final": None})

            def on_output(output, record=record, event=done[index]):
                record["tokens"] += output.token_ids
                record["entries"] += output.logprobs or []
                if output.prompt_logprobs is not None:
                    record["prompt"] = output.prompt_logprobs
                if output.finished:
                    record["final"] = output
                    event.set()
            engine.submit(prompt, params, on_output)
        for event in done:
            assert event.wait(120)
    finally:
        engine.shutdown()
    return [outputs[i] for i in range(len(jobs))]


@pytest.mark.parametrize("draft", ["ngram:3,1,3", "self"])
def test_greedy_logprobs_with_drafts_equal_those_without(tiny_target, logprob_jobs, draft):
    plain = collect(tiny_target, "none", logprob_jobs)
    drafted = collect(tiny_target, draft, logprob_jobs)
    assert sum(r["final"].speculative["accepted_tokens"] for r in drafted) > 0
    for (prompt, params), alone, spec in zip(logprob_jobs, plain, drafted):
        assert spec["tokens"] == alone["tokens"] == generate(tiny_target, prompt, params).token_ids
        assert len(spec["entries"]) == len(alone["entries"]) == spec["final"].completion_tokens == 16
        reference = full_logprobs(tiny_target, prompt + spec["tokens"])
        for position, (a, b) in enumerate(zip(alone["entries"], spec["entries"])):
            assert a.token == b.token == spec["tokens"][position]
            expected = float(reference[len(prompt) - 1 + position, a.token])
            assert a.logprob == pytest.approx(expected, abs=1e-4)
            assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
            assert [t for t, _ in a.top] == [t for t, _ in b.top] and len(a.top) == 3
            assert a.top[0][0] == a.token  # greedy: the chosen token is the most likely


def test_prompt_logprobs_across_chunks_equal_one_forward(tiny_target, logprob_jobs):
    results = collect(tiny_target, "none", logprob_jobs)
    for (prompt, _), result in zip(logprob_jobs, results):
        entries = result["prompt"]
        assert len(prompt) > 16 and len(entries) == len(prompt)  # several prefill chunks
        assert entries[0] is None
        reference = full_logprobs(tiny_target, prompt)
        for position in range(1, len(prompt)):
            entry = entries[position]
            assert entry.token == prompt[position]
            assert entry.logprob == pytest.approx(float(reference[position - 1, entry.token]), abs=1e-4)
            assert len(entry.top) == 2
            assert entry.top[0][1] == pytest.approx(float(reference[position - 1].max()), abs=1e-4)


@pytest.mark.parametrize("draft", ["ngram:3,1,3", "self"])
def test_penalties_and_bias_with_drafts_equal_plain(tiny_target, draft):
    variants = [
        SamplingParams(max_tokens=20, ignore_eos=True, presence_penalty=0.8, frequency_penalty=0.6),
        SamplingParams(max_tokens=20, ignore_eos=True, repetition_penalty=1.5),
        SamplingParams(max_tokens=20, ignore_eos=True, logit_bias={6: 5.0, 7: -100.0},
                       frequency_penalty=1.2),
    ]
    jobs = [(prompt, params) for params in variants for prompt in prompts()[2:]]
    results = serve(tiny_target, draft, jobs)
    changed = 0
    for (prompt, params), (tokens, text, final) in zip(jobs, results):
        alone = generate(tiny_target, prompt, params)
        assert tokens == alone.token_ids
        unpenalised = generate(tiny_target, prompt, SamplingParams(max_tokens=20, ignore_eos=True))
        changed += tokens != unpenalised.token_ids
        if params.logit_bias:
            assert 7 not in tokens
    assert changed >= 3  # the parameters really change the output
    assert sum(r[2].speculative["draft_tokens"] for r in results) > 0
