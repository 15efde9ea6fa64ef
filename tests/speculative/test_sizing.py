"""Tree sizing from measured costs: synthetic cost curves and rank probabilities."""

from __future__ import annotations

import pytest

from eyas.engine.speculative.sizing import CostModel, RankStats, choose_shape, expected_tokens

RANKS = [0.6, 0.15, 0.06, 0.03]


def curve(per_token: float, draft: float = 0.02) -> CostModel:
    """Verification of T tokens costs 1 + per_token * (T - 1) single-token steps."""
    return CostModel({t: 1.0 + per_token * (t - 1) for t in (1, 2, 4, 8, 16, 32, 64)},
                     {r: draft for r in (1, 2, 4, 8)})


def test_expected_tokens_of_a_chain_is_the_geometric_sum():
    # chain of 3 with top-1 probability 0.6: 1 + 0.6 + 0.36 + 0.216
    assert expected_tokens(3, 1, 4, RANKS) == pytest.approx(1 + 0.6 + 0.36 + 0.216)


def test_expected_tokens_of_a_tree_counts_the_best_nodes():
    # depth 2, top-2, total 4 (3 drafts): depth-1 {0.6, 0.15}, depth-2 children of 0.6 and
    # 0.15: {0.36, 0.09, 0.09, 0.0225}: the best three are 0.6, 0.36, 0.15
    assert expected_tokens(2, 2, 4, RANKS) == pytest.approx(1 + 0.6 + 0.36 + 0.15)


def test_interpolation_and_extrapolation():
    cost = CostModel({1: 1.0, 8: 2.4})
    assert cost.verify(1) == 1.0 and cost.verify(8) == 2.4
    assert cost.verify(4) == pytest.approx(1.0 + 1.4 * 3 / 7)
    assert cost.verify(15) == pytest.approx(2.4 + 1.4)


def test_expensive_verification_picks_a_chain():
    choice = choose_shape(curve(per_token=0.25), RANKS)
    assert choice.top_k == 1 and choice.depth >= 1
    assert choice.total_tokens == choice.depth + 1


def test_cheap_verification_picks_a_wider_deeper_tree():
    steep = choose_shape(curve(per_token=0.25), RANKS)
    flat = choose_shape(curve(per_token=0.005), RANKS)
    assert flat.top_k >= 2
    assert flat.total_tokens > steep.total_tokens
    assert flat.tokens_per_second > steep.tokens_per_second


def test_speculation_that_cannot_pay_picks_plain_decoding():
    choice = choose_shape(curve(per_token=1.0, draft=0.5), [0.05, 0.01])
    assert choice.depth == 0 and choice.total_tokens == 1


def test_rank_stats_move_from_the_prior_towards_the_data():
    stats = RankStats(max_rank=2, prior_weight=10)
    for _ in range(90):
        stats.record(1)
    for _ in range(10):
        stats.record(None)
    probability = stats.probabilities[0]
    assert 0.8 < probability < 0.9  # (5.5 + 90) / 110
    assert probability == pytest.approx((0.55 * 10 + 90) / 110)


def test_timed_passes_read_text_so_the_screen_leaves_decodings_few_candidates(smollm_int4_target):
    """The cost curve times passes over sample text: the output screen then re-checks about one
    candidate a row, as in decoding; over one repeated id it re-checked ~180 a row (SmolLM2)."""
    import torch

    from eyas.engine.generate import new_cache
    from eyas.engine.speculative.sizing import prefill_context, sample_tokens

    target = smollm_int4_target
    ids = sample_tokens(target, 300)
    assert ids.shape == (1, 300) and len(set(ids[0].tolist())) > 50  # text, not one id
    assert target.tokenizer.decode(ids[0, :6].tolist()).startswith("The river rose")
    lm = target.model.lm_head
    cache = new_cache(target, 1, 300)
    with torch.inference_mode():
        prefill_context(target, cache, 256)
        hidden = target.model(ids[:, 256:288], cache=cache, write_at=256, logits_at=None).hidden[0]
        approx, bound = lm.screen(hidden.float().contiguous())  # [32, V] each
    candidates = ((approx + bound) >= (approx - bound).amax(dim=1, keepdim=True)).sum(dim=1)
    assert int(candidates.median()) <= 2 and int(candidates.max()) <= 16


def test_passes_are_timed_in_rounds_so_a_burst_of_load_hits_every_size_once(monkeypatch):
    """Each round visits every size; a burst lasting as long as one size's repeats would have
    priced that size alone (a one-token pass above a two-token one), and the medians of rounds
    do not see it."""
    from eyas.engine.speculative import sizing

    clock, calls = [0.0], []
    monkeypatch.setattr(sizing.time, "perf_counter", lambda: clock[0])
    cost = {1: 3.0, 2: 3.5, 4: 5.0}

    def step_of(size):
        def step():
            calls.append(size)
            burst = 10.0 if 4 <= len(calls) <= 6 else 0.0  # the first timed round only
            clock[0] += cost[size] + burst
        return step

    medians = sizing._interleaved_medians({size: step_of(size) for size in cost}, repeats=3)
    assert calls == [4, 2, 1] * 4  # a warm-up, then three rounds, each from the largest down
    assert medians == cost


def test_each_pass_is_timed_after_the_next_larger_one_as_in_decoding(monkeypatch):
    """A pass of few rows right after a wide one runs slower (a fake clock: a pass of under 16
    rows costs 2 ms more right after a 64-token pass). Rounds from the largest size down time
    the one-token pass after a two-token one; in increasing order every round timed it after
    the last round's 64."""
    from eyas.engine.speculative import sizing

    clock, calls = [0.0], []
    monkeypatch.setattr(sizing.time, "perf_counter", lambda: clock[0])
    cost = {1: 3.0, 2: 3.5, 32: 22.0, 64: 40.0}

    def step_of(size):
        def step():
            after_wide = bool(calls) and calls[-1] == 64
            calls.append(size)
            clock[0] += cost[size] + (2.0 if after_wide and size < 16 else 0.0)
        return step

    medians = sizing._interleaved_medians({size: step_of(size) for size in (1, 2, 32, 64)}, repeats=5)
    assert medians == cost


def test_costs_measured_on_a_busy_machine_are_used_but_not_cached(monkeypatch, tiny_target):
    from eyas.engine.speculative import sizing

    paths = []
    real_path = sizing.cost_cache_path

    def cache_path(key: str):
        paths.append(real_path(key + "|busy-test"))  # not a model that other tests measured
        return paths[-1]

    monkeypatch.setattr(sizing, "cost_cache_path", cache_path)
    monkeypatch.setattr(sizing, "machine_busy", lambda: True)
    model = sizing.load_or_measure(tiny_target, sizes=(1, 2))
    assert set(model.verify_seconds) == {1, 2} and all(s > 0 for s in model.verify_seconds.values())
    assert not paths[-1].exists()
    monkeypatch.setattr(sizing, "machine_busy", lambda: False)
    sizing.load_or_measure(tiny_target, sizes=(1, 2))
    assert paths[-1].exists()
    paths[-1].unlink()
