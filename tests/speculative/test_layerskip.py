"""Layer-skip self-speculation: layer lists, greedy output equal to plain decoding (one request,
batched serving, SmolLM2), the draft's own KV cache after rejections, confidence-ended chains."""

from __future__ import annotations


import pytest
import torch

from spec_checks import assert_batched_serving_equals_plain, assert_greedy_equals_plain
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.methods import build_proposer
from eyas.engine.speculative.policy import PolicyConfig
from eyas.engine.speculative.proposers import draft_model
from eyas.engine.speculative.proposers.layerskip import LayerSkipConfig, LayerSkipProposer, parse_layers
from eyas.errors import EyasError
from eyas.models.kv_cache import LayerSubsetKVCache
from tiny_models import build_tiny_model

ALWAYS = PolicyConfig(enabled=False)
PROMPT = list(range(300, 316))


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def four_layer_target(tmp_path_factory, smollm_tokenizer):
    from eyas.engine.target import load_target

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-4"), smollm_tokenizer, num_hidden_layers=4)
    return load_target(str(folder), dtype="float32")


def test_layer_lists_and_their_errors(four_layer_target) -> None:
    assert parse_layers("4-6,9") == [4, 5, 6, 9]
    assert LayerSkipConfig(4, (3, 1, 1)).skip_layers == (1, 3)
    assert LayerSkipConfig(4, (1, 3)).kept_layers == (0, 2)
    for text in ("4-x", "6-4", "a,b"):
        with pytest.raises(EyasError, match="bad layer list"):
            parse_layers(text)
    with pytest.raises(EyasError, match="layers \\[4\\] do not exist.*0..3"):
        LayerSkipConfig(4, (1, 4))
    with pytest.raises(EyasError, match="keep at least one"):
        LayerSkipConfig(4, (0, 1, 2, 3))
    with pytest.raises(EyasError, match="no layer to skip"):
        LayerSkipConfig(4, ())
    with pytest.raises(EyasError, match="MIN_CONFIDENCE must be in"):
        build_proposer("layerskip:1:1.5", four_layer_target)
    with pytest.raises(EyasError, match="bad MIN_CONFIDENCE"):
        build_proposer("layerskip:1:high", four_layer_target)
    proposer = build_proposer("layerskip:1-2:0.25", four_layer_target)
    assert proposer.config.skip_layers == (1, 2) and proposer.config.min_confidence == 0.25


@pytest.mark.parametrize("spec", ["layerskip:1", "layerskip:1-2", "layerskip:0,3"])
def test_greedy_equals_plain(four_layer_target, spec, monkeypatch) -> None:
    monkeypatch.setattr(draft_model, "INITIAL_SPARE_SLOTS", 3)  # the draft cache must grow
    target = four_layer_target
    params = SamplingParams(max_tokens=32)
    plain = generate(target, PROMPT, params).token_ids
    proposer = build_proposer(spec, target)
    result = speculative_generate(target, PROMPT, params, proposer, 5, policy=ALWAYS)
    assert result.token_ids == plain
    spec_stats = result.stats["speculative"]
    assert spec_stats["draft_tokens"] > 0 and spec_stats["skip_layers"] == list(proposer.config.skip_layers)
    assert proposer.cache.max_slots > len(PROMPT) + 3  # grown on the way
    assert proposer.cache.keys.shape[0] == len(proposer.config.kept_layers)  # kept layers only


def test_draft_cache_after_rejections_equals_a_fresh_prefill(four_layer_target) -> None:
    """The draft cache is rolled back by token ids: after many rejected drafts, the entries it
    holds for the valid prefix are those of one pass of the skipping draft over that prefix."""
    target = four_layer_target
    config = LayerSkipConfig(4, (1, 2))
    proposer = LayerSkipProposer(target, config)
    result = speculative_generate(target, PROMPT, SamplingParams(max_tokens=40), proposer, 4,
                                  policy=ALWAYS)
    stats = result.stats["speculative"]
    assert 0 < stats["accepted_tokens"] < stats["draft_tokens"]  # there were rejections
    final = PROMPT + result.token_ids
    valid = proposer._common_prefix(final)
    assert valid > len(PROMPT) + 20
    fresh = LayerSubsetKVCache(config.kept_layers, 1, target.config.num_key_value_heads, valid,
                               target.config.head_dim)
    target.model(torch.tensor([final[:valid]]), cache=fresh, write_at=0, logits_at=None,
                 skip_layers=frozenset(config.skip_layers))
    assert torch.allclose(proposer.cache.keys[:, :, :, :valid], fresh.keys, atol=1e-5)
    assert torch.allclose(proposer.cache.values[:, :, :, :valid], fresh.values, atol=1e-5)


def test_a_confidence_threshold_ends_chains_early(four_layer_target) -> None:
    target = four_layer_target
    params = SamplingParams(max_tokens=32)
    plain = generate(target, PROMPT, params).token_ids
    drafted = {}
    for threshold in (0.0, 0.5):
        proposer = LayerSkipProposer(target, LayerSkipConfig(4, (1,), min_confidence=threshold))
        result = speculative_generate(target, PROMPT, params, proposer, 5, policy=ALWAYS)
        assert result.token_ids == plain
        drafted[threshold] = result.stats["speculative"]["draft_tokens"]
    assert drafted[0.5] < drafted[0.0]


def test_sampling_is_reproducible_with_a_seed(four_layer_target) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.9, seed=5)
    proposer = build_proposer("layerskip:2", four_layer_target)
    runs = [speculative_generate(four_layer_target, PROMPT, params, proposer, 4, policy=ALWAYS).token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 24


def test_batched_serving_equals_plain(four_layer_target) -> None:
    assert assert_batched_serving_equals_plain(four_layer_target, "layerskip:1-2", seed=1) > 0


@pytest.mark.parametrize("prompts,tokens", [(2, 32), pytest.param(8, 64, marks=pytest.mark.slow)])
def test_smollm2_greedy_equals_plain(smollm_int4_target, mtbench_prompt_ids, prompts, tokens) -> None:
    target = smollm_int4_target  # the fused int4 stack runs the shallow draft passes too
    proposer = build_proposer("layerskip:12-17", target)
    totals = assert_greedy_equals_plain(target, mtbench_prompt_ids[:prompts], proposer, 4, tokens)
    assert totals["accepted_tokens"] > 0  # 24 of 30 layers draft well enough to be accepted sometimes


@pytest.mark.slow
def test_smollm2_calibrated_auto_equals_plain(smollm_target, mtbench_prompt_ids, tmp_path,
                                              monkeypatch) -> None:
    """layerskip:auto on the real model: calibration (fixed costs, a private cache), then
    greedy output equal to plain decoding."""
    from eyas.engine.speculative import layerskip_calibrate as calibration

    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    costs = calibration.SkipCosts(overhead=0.2, verify={1: 1.0, 4: 1.4, 8: 2.0, 16: 2.2})
    monkeypatch.setattr(calibration.SkipCosts, "measured", classmethod(lambda cls, target: costs))
    proposer = build_proposer("layerskip:auto", smollm_target)
    assert proposer.calibration["rows"] == 4 * 32
    assert_greedy_equals_plain(smollm_target, mtbench_prompt_ids[:4], proposer, 4, 64)
