"""Layer-skip calibration: the replay objective by hand, the teacher-forced shortcut against a
plain skipping forward, reproducibility with a seed, the per-model cache, and `layerskip:auto`."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative import layerskip_calibrate as calibration
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.layerskip_calibrate import (
    CalibrationConfig,
    SkipCosts,
    calibrate,
    load_or_calibrate,
    replay,
)
from eyas.engine.speculative.methods import build_proposer
from eyas.engine.speculative.policy import PolicyConfig
from tiny_models import build_tiny_model

COSTS = SkipCosts(overhead=0.2, verify={1: 1.0, 2: 1.2, 4: 1.5, 8: 2.0})
SMALL = dict(num_prompts=3, new_tokens=16, max_draft_tokens=4)


pytestmark = pytest.mark.usefixtures("one_thread")  # tests/conftest.py


@pytest.fixture(scope="module")
def six_layer_target(tmp_path_factory, smollm_tokenizer):
    from eyas.engine.target import load_target

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-6"), smollm_tokenizer, num_hidden_layers=6)
    return load_target(str(folder), dtype="float32")


def test_replay_by_hand() -> None:
    # one sequence of 5 rows; the draft is right at rows 0, 1, 3, 4 and unsure at row 1
    matches, confidence = [True, True, False, True, True], [0.9, 0.4, 0.9, 0.9, 0.9]
    verify_3 = 1.35  # COSTS interpolated between 2 and 4 tokens
    # k = 2, no threshold. Step 1 drafts rows 0-1, both right: 3 tokens (the bonus is row 2's
    # token). Step 2 drafts rows 3-4, both right: 3 tokens. Each: 2 draft forwards + verify(3).
    tokens, cost, steps = replay(matches, confidence, [5], 2, 0.0, 0.5, COSTS)
    assert (tokens, steps) == (6, 2) and cost == pytest.approx(2 * (2 * 0.5 + verify_3))
    # threshold 0.5. Step 1 drafts row 0 and stops at row 1 (2 forwards, verify(2)): 2 tokens.
    # Step 2 drafts rows 2 (wrong) and 3: 1 token. Step 3 drafts rows 3-4: 3 tokens.
    tokens, cost, steps = replay(matches, confidence, [5], 2, 0.5, 0.5, COSTS)
    assert (tokens, steps) == (6, 3)
    assert cost == pytest.approx((2 * 0.5 + 1.2) + 2 * (2 * 0.5 + verify_3))


def test_teacher_forced_shortcut_equals_a_plain_skipping_forward(six_layer_target) -> None:
    target = six_layer_target
    prompts = calibration._sample_prompts(target, CalibrationConfig(**SMALL))
    reference = calibration._reference(target, prompts, 8)
    skip = frozenset({2, 4})
    matches, confidence = calibration.measure_skip_set(target, reference, skip)
    out = target.model(reference.ids, logits_at=None, skip_layers=skip)
    probs = torch.softmax(target.model.lm_head(out.hidden[reference.rows]), -1)
    assert torch.allclose(confidence, probs.max(-1).values, atol=1e-5)
    assert torch.equal(matches, probs.argmax(-1) == reference.argmax)
    assert reference.row_groups == [8, 8, 8]


def test_calibration_is_reproducible_with_a_seed(six_layer_target) -> None:
    config = CalibrationConfig(seed=7, **SMALL)
    first = calibrate(six_layer_target, config, costs=COSTS)
    second = calibrate(six_layer_target, config, costs=COSTS)
    keys = ("skip_layers", "draft_length", "min_confidence", "acceptance", "expected_speedup")
    assert {k: getattr(first, k) for k in keys} == {k: getattr(second, k) for k in keys}
    assert first.skip_layers and set(first.skip_layers) < set(range(6))
    assert 1 <= first.draft_length <= 4 and first.rows == 3 * 16
    assert 1.0 <= first.tokens_per_step <= 5.0
    other = calibration._sample_prompts(six_layer_target, CalibrationConfig(seed=8, **SMALL))
    assert other != calibration._sample_prompts(six_layer_target, config)  # the seed draws prompts


def test_cached_per_model_and_used_by_auto(six_layer_target, tmp_path, monkeypatch) -> None:
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    monkeypatch.setattr(calibration.SkipCosts, "measured", classmethod(lambda cls, target: COSTS))
    monkeypatch.setattr(calibration, "CalibrationConfig",
                        lambda: CalibrationConfig(**SMALL))  # a smaller default for the test
    result = load_or_calibrate(six_layer_target)
    files = list((tmp_path / "layerskip").glob("*.json"))
    assert len(files) == 1 and json.loads(files[0].read_text())["result"]["skip_layers"] == result.skip_layers

    def refuse(*args, **kwargs):
        raise AssertionError("calibrated again instead of reading the cache")

    monkeypatch.setattr(calibration, "calibrate", refuse)
    assert load_or_calibrate(six_layer_target) == result
    proposer = build_proposer("layerskip:auto", six_layer_target)
    assert list(proposer.config.skip_layers) == result.skip_layers
    assert proposer.config.max_draft_tokens == result.draft_length
    assert build_proposer("layerskip:auto:0.3", six_layer_target).config.min_confidence == 0.3
    params = SamplingParams(max_tokens=24)
    plain = generate(six_layer_target, [300, 301, 302, 303], params).token_ids
    spec = speculative_generate(six_layer_target, [300, 301, 302, 303], params, proposer, 4,
                                policy=PolicyConfig(enabled=False))
    assert spec.token_ids == plain
    assert spec.stats["speculative"]["calibration"]["skip_layers"] == result.skip_layers
