"""Per-request fault isolation: a fault injected into one request's work at any stage of a step
(prefill, draft, verify, sample, detokenize) ends that request alone with finish_reason
'error' and its stage; every other request of the batch gets the tokens it gets alone.

One batch per drafting method carries a healthy greedy request, a healthy seeded sampling
request and one faulted request per stage, all concurrent (the faulted ones fail mid-answer,
after their first tokens, or at their prompt's second chunk).
"""

from __future__ import annotations

import random
import time

import pytest

from scheduler_support import run_all
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.draft import DraftTree
from eyas.errors import EyasError
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.engine import Engine
from eyas.scheduler.faults import STAGES


def healthy_jobs(prompts: list[list[int]]) -> list[tuple[list[int], SamplingParams]]:
    return [(prompts[0], SamplingParams(max_tokens=16, ignore_eos=True)),
            (prompts[1], SamplingParams(max_tokens=16, temperature=0.9, seed=11, ignore_eos=True)),
            (prompts[2], SamplingParams(max_tokens=16, ignore_eos=True))]


def faulted_jobs(prompts: list[list[int]]) -> list[tuple[str, list[int], SamplingParams]]:
    """One request per stage, told apart by max_tokens (30 + stage index); each fails before
    its answer is done."""
    return [(stage, prompts[index % len(prompts)], SamplingParams(max_tokens=30 + index, ignore_eos=True,
                                                                  temperature=0.7 if stage == "sample" else 0.0,
                                                                  seed=3))
            for index, stage in enumerate(STAGES)]


def inject_every_stage(engine: Engine) -> None:
    for index, stage in enumerate(STAGES):
        tokens = 30 + index
        if stage == "prefill":  # at the prompt's second chunk
            engine.faults.inject(stage, when=lambda r, t=tokens: r.max_new_tokens == t and r.context_length > 0)
        else:  # mid-answer, after a few tokens
            engine.faults.inject(stage, when=lambda r, t=tokens: r.max_new_tokens == t and r.num_output >= 3)


def check_isolation(target, draft: str, prompts: list[list[int]], **config) -> None:
    options = {"max_running": 8, "prefill_chunk": 8, "initial_kv_slots": 16, "speculation": "always",
               "num_draft_tokens": 3, **config}
    engine = Engine(target, EngineConfig(**options), draft=draft).start()
    try:
        healthy = healthy_jobs(prompts)
        alone = [run_all(engine, [job], 300)[0] for job in healthy]
        inject_every_stage(engine)
        faulted = faulted_jobs(prompts)
        results = run_all(engine, healthy + [(prompt, params) for _, prompt, params in faulted], 300)
        assert engine.num_running == 0 and engine.pool.num_free == engine.pool.rows
    finally:
        engine.shutdown()
    for (tokens, text, final), (alone_tokens, alone_text, alone_final) in zip(results, alone):
        assert tokens == alone_tokens and text == alone_text
        assert final.finish_reason == alone_final.finish_reason == "length" and final.error is None
    for (stage, _, params), (tokens, _, final) in zip(faulted, results[len(healthy):]):
        if stage == "draft" and draft == "none":  # nothing drafts: the request is healthy
            assert final.finish_reason == "length" and len(tokens) == params.max_tokens
            continue
        assert final.finish_reason == "error", stage
        assert final.error.startswith(f"{stage}: InjectedFault"), final.error
        assert len(tokens) < params.max_tokens


def tiny_prompts() -> list[list[int]]:
    rng = random.Random(1)
    return [[rng.randrange(100, 5000) for _ in range(length)] for length in (21, 13, 30)] + \
        [[5, 6, 7, 8, 9] * 5]


@pytest.mark.parametrize("draft", ["none", "ngram:3,1,3", "self", "layerskip:1"])
def test_a_fault_at_any_stage_fails_that_request_alone(tiny_target, draft):
    check_isolation(tiny_target, draft, tiny_prompts())


def test_the_shipped_head_isolates_faults(smollm_int4_target, mtbench_prompt_ids):
    check_isolation(smollm_int4_target, "eagle3:smollm2-135m", mtbench_prompt_ids[:4],
                    tree="2,2,3", overlap=True, prefill_chunk=32)


@pytest.mark.slow
def test_a_medusa_head_isolates_faults(tiny_target, tmp_path):
    import torch

    from eyas.medusa import MedusaConfig, MedusaHeads, save_medusa

    torch.manual_seed(0)
    heads = MedusaHeads(MedusaConfig.for_target(tiny_target.config, num_heads=3))
    heads.set_output_layer(tiny_target.model.lm_head)
    save_medusa(heads.eval(), tmp_path / "medusa")
    check_isolation(tiny_target, f"medusa:{tmp_path / 'medusa'}", tiny_prompts())


class OutOfVocabulary:
    """Wraps a proposer; drafts a token id the target has no embedding for, which breaks the
    whole batched pass (not one row of it)."""

    def __init__(self, inner, vocab_size: int) -> None:
        self.inner, self.vocab_size = inner, vocab_size
        self.name, self.tap_layers = inner.name, inner.tap_layers

    def begin(self, target, prompt_ids, params):
        self.prompt_len = len(prompt_ids)
        self.inner.begin(target, prompt_ids, params)

    def propose(self, token_ids, max_nodes) -> DraftTree:
        if len(token_ids) < self.prompt_len + 4:  # by then the others share its steps
            return self.inner.propose(token_ids, max_nodes)
        return DraftTree.chain([self.vocab_size + 7] * max_nodes)

    def observe(self, tree, result, output):
        self.inner.observe(tree, result, output)


def test_a_request_that_breaks_the_batched_pass_fails_alone(tiny_target):
    """The shared pass raises; each row is redone alone and only the bad one fails."""
    engine = Engine(tiny_target, EngineConfig(max_running=4, speculation="always"), draft="ngram:3,1,3")
    healthy = healthy_jobs(tiny_prompts())
    engine.start()
    try:
        alone = [run_all(engine, [job])[0] for job in healthy]
        good = engine.proposers.prototype
        engine.proposers.prototype = OutOfVocabulary(good, tiny_target.config.vocab_size)
        bad = engine.submit(tiny_prompts()[3], SamplingParams(max_tokens=20, ignore_eos=True))
        engine.proposers.prototype = good
        results = run_all(engine, healthy)
        for _ in range(500):
            if bad.finish_reason is not None:
                break
            time.sleep(0.02)
    finally:
        engine.shutdown()
    assert [r[0] for r in results] == [a[0] for a in alone]
    assert bad.finish_reason == "error" and bad.failure.stage == "verify"


def test_a_seed_beyond_64_bits_is_refused_at_the_door():
    with pytest.raises(EyasError, match="seed"):
        SamplingParams(seed=2**70)
    with pytest.raises(EyasError, match="seed"):
        SamplingParams(seed=-1)
    assert SamplingParams(seed=2**63 - 1).generator() is not None
