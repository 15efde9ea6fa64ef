"""`eyas eval`: the summary arithmetic on hand-made rows, and a real run on SmolLM2 with the
target drafting for itself (every draft is accepted, so tau and the rates are known exactly)."""

from __future__ import annotations

import json

import pytest

from eyas.bench.evaluate import EvalConfig, format_markdown, summarize
from eyas.cli.main import main
from eyas.errors import EyasError


def _row(index, category, steps, accepted_pp, drafted_pp, plain=(10, 1.0), spec=(10, 0.5), same=True):
    return {"index": index, "category": category, "prompt_tokens": 5,
            "plain_tokens": plain[0], "plain_seconds": plain[1],
            "spec_tokens": spec[0], "spec_seconds": spec[1], "identical": same,
            "steps": steps, "accepted": sum(accepted_pp), "drafted": sum(drafted_pp) * 2,
            "plain_steps": 0, "accepted_per_position": accepted_pp,
            "drafted_per_position": drafted_pp, "tree": None}


def test_summary_per_category_and_position():
    rows = [
        _row(0, "writing", steps=4, accepted_pp=[4, 2], drafted_pp=[4, 4]),
        _row(1, "math", steps=2, accepted_pp=[1, 0, 0], drafted_pp=[2, 2, 2], spec=(10, 2.0), same=False),
        _row(2, "writing", steps=4, accepted_pp=[2, 1], drafted_pp=[4, 4], plain=(20, 1.0)),
    ]
    report = summarize(EvalConfig(draft="ngram"), rows, "float32")
    overall = report["overall"]
    # 6 + 1 + 3 accepted over 4 + 2 + 4 steps
    assert overall["tau"] == pytest.approx(2.0)
    # position 1: (4 + 1 + 2) / (4 + 2 + 4); position 2: (2 + 0 + 1) / 10; position 3: 0 / 2
    assert overall["acceptance_rate_per_position"] == [0.7, 0.3, 0.0]
    assert overall["identical_outputs"] == 2 and report["not_identical"] == [1]
    writing = report["per_category"]["writing"]
    assert writing["prompts"] == 2 and writing["tau"] == pytest.approx(1 + 9 / 8)
    # medians: plain 10 and 20 tok/s, speculative 20 and 20 tok/s; ratios 2.0 and 1.0
    assert writing["plain_median_tokens_per_s"] == 15.0
    assert writing["speedup_median"] == 1.5
    assert writing["speedup_total"] == pytest.approx((20 / 1.0) / (30 / 2.0), abs=1e-3)
    assert report["per_category"]["math"]["speedup_median"] == 0.5
    markdown = format_markdown(report)
    assert "| math | 1 | 1.50 | 10.0 | 5.0 | 0.50x | 0/1 |" in markdown
    assert "prompts [1]" in markdown


def test_bad_config_names_what_is_accepted():
    with pytest.raises(EyasError, match="accepted: mtbench, code"):
        EvalConfig(dataset="gsm8k")
    with pytest.raises(EyasError, match="nothing to evaluate"):
        EvalConfig(draft="none")


def test_eval_cli_self_draft_on_smollm2(tmp_path, capsys):
    code = main(["eval", "--model", "smollm2-135m", "--dtype", "int4", "--draft", "self",
                 "--num-draft-tokens", "3", "--num-prompts", "2", "--max-tokens", "12",
                 "--output-dir", str(tmp_path), "--no-progress"])
    assert code == 0
    report = json.loads((tmp_path / "eval.json").read_text())
    overall = report["overall"]
    # The target drafting for itself: every draft accepted, outputs identical to plain.
    assert overall["identical_outputs"] == 2 and report["not_identical"] == []
    assert overall["accepted_tokens"] == overall["draft_tokens"] > 0
    assert overall["acceptance_rate_per_position"] == [1.0, 1.0, 1.0]
    for row in report["prompts"]:
        if row["spec_tokens"] == 12:  # no EOS: steps of 3 + 1, 3 + 1, 2 + 1 after the first token
            assert (row["steps"], row["accepted"]) == (3, 8)
    assert list(report["per_category"]) == ["writing", "roleplay"]
    assert (tmp_path / "eval.md").read_text() == capsys.readouterr().out
