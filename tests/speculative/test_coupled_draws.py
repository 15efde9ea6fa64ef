"""Coupled draws (engine/speculative/coupled_draws.py): drafts ranked with the noise the target
draws with. The noise at a draft's ids is the target's, bit for bit; positions line up with the
executor's draws (a draft model equal to the target is accepted at every position, and its
seeded output equals plain decoding's); the shipped EAGLE-3 head is accepted more often with it
than without, on the same tokens, alone and served with other requests; the sharpening factor
that matches the target is learned; a draft model's subset draws with each id's noise, and its
price per drafted token counts the draw."""

from __future__ import annotations

import pytest
import torch

from eyas.engine import gumbel
from eyas.engine.gumbel import inverse_temperature, noise_key
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.coupled_draws import KEPT_POSITIONS, CoupledDraws

pytestmark = pytest.mark.skipif(not gumbel.available(), reason="the C++ extension is not built here")


def test_noise_at_ids_equals_the_full_rows_columns():
    keys = torch.tensor([noise_key(12345, 0), noise_key(12345, 7), -3], dtype=torch.int64)
    ids = torch.randperm(49152, generator=torch.Generator().manual_seed(0))[:8192]
    full = gumbel.gumbel_noise(keys, 49152)  # [3, V]
    assert torch.equal(torch.ops.eyas.gumbel_noise_at(keys, ids), full[:, ids])
    with pytest.raises(RuntimeError, match="ids must be >= 0"):
        torch.ops.eyas.gumbel_noise_at(keys, torch.tensor([4, -1]))


def test_positions_keys_and_scores():
    coupling = CoupledDraws(inverse_temperature(0.7), noise_base=99, prompt_len=10)
    # after 10 prompt tokens and 3 output tokens (the root last), a depth-d draft fills output
    # position 3 + d - 1: the executor draws it with noise_key(base, num_output + depth - 1)
    assert [coupling.position(13, depth) for depth in (1, 2, 3)] == [3, 4, 5]
    assert coupling.key(4) == noise_key(99, 4)
    ids = torch.tensor([5, 0, 40000])
    logits = torch.tensor([[1.0, -2.0, 0.5], [0.0, 0.0, 3.0]])
    noise = gumbel.gumbel_noise(torch.tensor([noise_key(99, 4)]), 49152)[0, ids]
    scale = inverse_temperature(0.7)
    assert torch.equal(coupling.scores(logits, ids, 4), logits * scale + noise)
    assert torch.equal(coupling.scores(logits, ids, 4, sharpness=1.5), logits * (scale * 1.5) + noise)


def test_noise_rows_are_kept_per_position_and_bounded():
    coupling = CoupledDraws(1.0, noise_base=1, prompt_len=0)
    ids = torch.arange(64)
    first = coupling.noise(0, ids)
    assert coupling.noise(0, ids) is first  # kept
    for position in range(1, KEPT_POSITIONS + 5):
        coupling.noise(position, ids)
    assert len(coupling._noise) == KEPT_POSITIONS and 0 not in coupling._noise  # oldest dropped
    other = torch.arange(64, 128)
    assert torch.equal(coupling.noise(3, other), gumbel.gumbel_noise(torch.tensor([coupling.key(3)]), 128)[0, 64:])


def test_bad_settings_are_rejected():
    with pytest.raises(ValueError, match="inverse_temperature"):
        CoupledDraws(0.0, noise_base=1, prompt_len=0)
    with pytest.raises(ValueError, match="prompt_len"):
        CoupledDraws(1.0, noise_base=1, prompt_len=-1)


def _decode(target, prompt, params, proposer, monkeypatch, coupled: bool):
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.policy import PolicyConfig

    monkeypatch.setenv("EYAS_COUPLED_DRAFTS", "1" if coupled else "0")
    return speculative_generate(target, prompt, params, proposer, 4, policy=PolicyConfig(enabled=False))


def test_a_draft_equal_to_the_target_is_accepted_at_every_position(tiny_target, monkeypatch):
    """The draft model drawing with each position's noise through the same output layer draws
    what the target draws there: every draft is accepted, and the seeded output is plain's."""
    from eyas.engine.generate import generate
    from eyas.engine.speculative.proposers.draft_model import DraftModelProposer

    prompt = list(range(300, 312))
    for seed in range(3):
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        plain = generate(tiny_target, prompt, params).token_ids
        spec = _decode(tiny_target, prompt, params, DraftModelProposer(tiny_target, name="self"), monkeypatch, True)
        assert spec.token_ids == plain
        stats = spec.stats["speculative"]
        assert stats["draft_tokens"] >= 12 and stats["accepted_tokens"] == stats["draft_tokens"]


def test_the_shipped_head_is_accepted_more_with_coupled_draws(smollm_int4_target, mtbench_prompt_ids, monkeypatch):
    """Temperature 1, one draft a step (the head's first guess), seeded: both runs emit plain
    decoding's tokens, and the coupled run's drafts are the target's draws more often."""
    from eyas.engine.generate import generate
    from eyas.engine.speculative.methods import build_proposer

    accepted = {False: 0, True: 0}
    proposers = {coupled: build_proposer("eagle3:smollm2-135m", smollm_int4_target, tree="chain:1")
                 for coupled in (False, True)}  # one per setting for all prompts: the learned
    # sharpness carries over, as the server's per-request copies share it
    for index, prompt in enumerate(mtbench_prompt_ids[:4]):
        params = SamplingParams(max_tokens=48, temperature=1.0, seed=index, ignore_eos=True)
        plain = generate(smollm_int4_target, prompt, params).token_ids
        for coupled, proposer in proposers.items():
            spec = _decode(smollm_int4_target, prompt, params, proposer, monkeypatch, coupled)
            assert spec.token_ids == plain
            accepted[coupled] += spec.stats["speculative"]["accepted_tokens"]
    assert accepted[True] > accepted[False] > 0, accepted


def test_served_sampled_requests_with_coupled_drafts_equal_plain(smollm_int4_target, mtbench_prompt_ids):
    """Four seeded temperature-1 requests served at once with the shipped head (one ragged pass
    a step, every request drafting): each emits its plain decoding's tokens."""
    from eyas.engine.generate import generate
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine

    prompts = mtbench_prompt_ids[4:8]
    params = [SamplingParams(max_tokens=24, temperature=1.0, seed=10 + i, ignore_eos=True) for i in range(4)]
    plain = [generate(smollm_int4_target, p, q).token_ids for p, q in zip(prompts, params)]
    config = EngineConfig(max_running=4, speculation="always", tree="1,2,3")
    engine = Engine(smollm_int4_target, config, draft="eagle3:smollm2-135m").start()
    try:
        results = engine.generate_many(prompts, params, 120)
    finally:
        engine.shutdown()
    assert [r.token_ids for r in results] == plain
    assert sum(r.stats["speculative"]["accepted_tokens"] for r in results) > 0


def test_the_sharpness_that_matches_the_target_is_learned():
    """A draft whose logits are the target's halved: under factor 2 its coupled first
    candidate is the target's draw every time, so 2 is learned; a draft equal to the target
    keeps 1. Until one beats it, the prior is used."""
    from eyas.engine.speculative.coupled_draws import SHARPNESS_CHOICES, Sharpness

    generator = torch.Generator().manual_seed(0)
    target = torch.randn(64, 512, generator=generator) * 3  # [positions, V]
    ids = torch.arange(512)
    coupling = CoupledDraws(1.0, noise_base=7, prompt_len=0)
    noise = torch.stack([coupling.noise(position, ids) for position in range(64)])
    drawn = (target + noise).argmax(-1).tolist()  # the target's draws
    for draft, expected in ((target / 2, 2.0), (target, 1.0)):
        sharpness = Sharpness(prior=1.5)
        assert sharpness.value == 1.5
        sharpness.learn(coupling, draft, ids, list(range(64)), drawn)
        assert sharpness.seen == 64 and sharpness.value == expected
        assert sharpness.hits[SHARPNESS_CHOICES.index(expected)] == 64
    with pytest.raises(ValueError, match="prior"):
        Sharpness(prior=1.1)


def test_a_coupled_chain_prices_each_draw_with_its_pass(tiny_target, monkeypatch):
    """A priced draft model's cost per drafted token is its one-row pass and, when it draws with
    the target's noise, the draw through its output screen after it."""
    import time

    from eyas.engine.speculative.proposers import draft_model

    prompt = list(range(300, 312))
    proposer = draft_model.DraftModelProposer(tiny_target, name="self")
    proposer.begin(tiny_target, prompt, SamplingParams(temperature=1.0))
    proposer.draw_with(CoupledDraws(1.0, noise_base=3, prompt_len=len(prompt)))
    measured = []

    class Pricing:  # what ChainPricing is asked for by propose()
        draft_pass = 1e-3

        def length(self, max_nodes: int) -> int:
            return max_nodes

        def measured(self, kind: str, seconds: float, modelled: float) -> None:
            measured.append((kind, seconds))

    proposer.pricing = Pricing()
    draw = draft_model.sample_rows

    def slow_draw(*args):  # 5 ms of this thread's CPU before each draw
        end = time.thread_time() + 0.005
        while time.thread_time() < end:
            pass
        return draw(*args)

    monkeypatch.setattr(draft_model, "sample_rows", slow_draw)
    tree = proposer.propose(prompt + [5], 3)
    assert tree.size == 3 and tree.draft_probs is None  # a deterministic chain
    drafts = [seconds for kind, seconds in measured if kind == "draft"]
    assert len(drafts) == 2 and min(drafts) >= 0.005  # the two one-row passes, each with its draw


def test_a_vocabulary_subset_draws_with_each_token_ids_noise(tiny_target, monkeypatch):
    """DraftVocabulary.draw is the argmax over the subset's ids of l / T + g at those ids (the
    target's noise there); a draft model over the subset, drawing this way, keeps plain output."""
    from eyas.engine.generate import generate
    from eyas.engine.speculative.proposers.draft_model import DraftModelProposer
    from eyas.engine.speculative.proposers.draft_vocabulary import DraftVocabulary

    vocabulary = DraftVocabulary.build(tiny_target, 16384)
    ids = vocabulary.ids
    hidden = torch.randn(6, tiny_target.config.hidden_size, generator=torch.Generator().manual_seed(1))
    with torch.inference_mode():
        full = tiny_target.model.lm_head(hidden)  # [6, V] exact
    scale = inverse_temperature(0.8)
    for row in range(6):
        key = noise_key(21, row)
        noise = gumbel.gumbel_noise(torch.tensor([key]), full.shape[-1])[0]
        expected = int(ids[(full[row, ids] * scale + noise[ids]).argmax()])
        assert vocabulary.draw(hidden[row : row + 1], scale, key) == expected

    prompt = list(range(300, 312))
    params = SamplingParams(max_tokens=24, temperature=1.0, seed=2, ignore_eos=True)
    plain = generate(tiny_target, prompt, params).token_ids
    spec = _decode(tiny_target, prompt, params, DraftModelProposer(tiny_target, vocabulary_size=16384),
                   monkeypatch, True)
    assert spec.token_ids == plain
    # accepted where the target's draw lies in the subset (a third of a random model's vocabulary)
    assert spec.stats["speculative"]["accepted_tokens"] > 0
