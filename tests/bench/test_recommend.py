"""`eyas recommend`: the decision on synthetic measurements (a pure function), the config's
checks, and one end-to-end CLI run on the tiny random model."""

from __future__ import annotations

import json

import pytest

from eyas.bench.recommend import Measurement, RecommendConfig, rationale, recommend
from eyas.cli.main import main
from eyas.errors import EyasError

HEAD = "eagle3:runs/head"


def measured(level: int, method: str, tokens_per_s: float, tau: float | None = None) -> Measurement:
    """A measurement with 100 verification steps and the accepted drafts that give `tau`."""
    steps = 100 if tau is not None else 0
    accepted = round((tau - 1) * steps) if tau is not None else 0
    return Measurement(level, method, None if method == "none" else 4, tokens_per_s,
                       verification_steps=steps, accepted_tokens=accepted)


SWEEP = [  # plain, ngram (tau 1.3) and an EAGLE-3 head (tau 2.5) at four levels
    measured(1, "none", 100.0), measured(1, "ngram", 130.0, 1.3), measured(1, HEAD, 160.0, 2.5),
    measured(2, "none", 180.0), measured(2, "ngram", 200.0, 1.3), measured(2, HEAD, 190.0, 2.5),
    measured(4, "none", 300.0), measured(4, "ngram", 290.0, 1.3), measured(4, HEAD, 310.0, 2.5),
    measured(8, "none", 400.0), measured(8, "ngram", 330.0, 1.3), measured(8, HEAD, 300.0, 2.5),
]


def test_the_fastest_method_wins_where_it_clears_the_threshold():
    choices = recommend(SWEEP, min_speedup=1.05)
    assert [c.concurrency for c in choices] == [1, 2, 4, 8]
    assert [c.label for c in choices] == [f"{HEAD} k=4", "ngram k=4", "none", "none"]
    assert [round(c.speedup, 3) for c in choices] == [1.6, 1.111, 1.0, 1.0]
    assert [c.plain_tokens_per_s for c in choices] == [100.0, 180.0, 300.0, 400.0]
    assert choices[0].acceptance_length == pytest.approx(2.5)
    # at 4 the head is the fastest speculative candidate but only 1.033x: plain is recommended
    assert choices[2].best_speculative == f"{HEAD} k=4"
    assert choices[2].best_speculative_speedup == pytest.approx(310 / 300)
    assert choices[2].serve_flags("always") == "--draft none"
    assert choices[1].serve_flags("always") == "--draft ngram --num-draft-tokens 4 --speculation always"
    # a lower threshold lets the head's 1.033x through
    assert recommend(SWEEP, min_speedup=1.0)[2].label == f"{HEAD} k=4"


def test_rationale_is_computed_from_the_numbers():
    text = rationale(SWEEP, recommend(SWEEP, 1.05), 1.05)
    assert ("ngram: tau 1.30 on this workload; speculation pays up to concurrency 2, not beyond "
            "(1.30x at 1, 1.11x at 2, 0.97x at 4, 0.82x at 8)") in text
    assert ("a speculative step takes 1.00x the time of a plain step at concurrency 1 and 1.58x "
            "at 8 (tau / speedup)") in text
    assert f"{HEAD}: tau 2.50 on this workload; speculation pays up to concurrency 2" in text
    assert (f"Recommended: {HEAD} k=4 at concurrency 1 (1.60x); ngram k=4 at concurrency 2 "
            "(1.11x); plain decoding at concurrency 4, 8.") in text


@pytest.mark.parametrize("speedups, phrase", [
    ([1.2, 1.1, 1.06], "pays at every measured concurrency"),
    ([0.9, 0.8, 0.7], "does not pay at any measured concurrency"),
    ([0.9, 1.2, 1.3], "pays from concurrency 2 on, not below"),
    ([1.2, 0.9, 1.3], "pays at concurrency 1, 4, not at 2"),
])
def test_where_speculation_pays(speedups, phrase):
    sweep = []
    for level, speedup in zip([1, 2, 4], speedups):
        sweep += [measured(level, "none", 100.0), measured(level, "ngram", 100.0 * speedup, 1.5)]
    assert f"ngram: tau 1.50 on this workload; speculation {phrase}" in rationale(
        sweep, recommend(sweep), 1.05)


def test_a_method_that_never_drafted_is_not_recommended():
    sweep = [measured(1, "none", 100.0), measured(1, "ngram", 120.0)]  # 1.2x, but zero steps: noise
    (choice,) = recommend(sweep)
    assert choice.label == "none" and choice.speedup == 1.0 and choice.best_speculative is None
    assert "ngram: no draft was verified on this workload" in rationale(sweep, [choice], 1.05)


def test_plain_is_required():
    with pytest.raises(EyasError, match="no plain"):
        recommend([measured(1, "ngram", 120.0, 1.5)])


def test_config_checks_and_adds_the_baseline():
    assert RecommendConfig(methods=["ngram", "self"]).methods == ["none", "ngram", "self"]
    for kwargs, message in [
        (dict(methods=["lookahead"]), "accepted: none, ngram"),
        (dict(methods=["ngram", "ngram"]), "methods must differ"),
        (dict(concurrency=[1, 1]), "distinct levels"),
        (dict(concurrency=[0, 2]), "distinct levels"),
        (dict(num_draft_tokens=[0]), "num_draft_tokens"),
        (dict(speculation="never"), "accepted: always, auto"),
        (dict(dataset="alpaca"), "accepted: mtbench, code, sharegpt, random, jsonl:PATH"),
        (dict(rounds=0), "rounds must be >= 1"),
        (dict(min_speedup=0.9), "min_speedup"),
    ]:
        with pytest.raises(EyasError, match=message):
            RecommendConfig(**kwargs)


def test_cli_end_to_end_on_the_tiny_model(tiny_model_dir, prompts_file, tmp_path, capsys):
    output = tmp_path / "recommend.json"
    code = main(["recommend", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--dataset", f"jsonl:{prompts_file}", "--num-prompts", "2", "--max-tokens", "16",
                 "--concurrency", "1,2", "--rounds", "2", "--methods", "ngram;self",
                 "--num-draft-tokens", "2", "--output", str(output)])
    captured = capsys.readouterr()
    assert code == 0
    assert "| concurrency | none tok/s | ngram k=2 tok/s | self k=2 tok/s |" in captured.out
    assert "Recommended:" in captured.out
    assert "concurrency 2, round 2/2, self k=2:" in captured.err  # progress
    report = json.loads(output.read_text())
    assert report["config"]["methods"] == ["none", "ngram", "self"]
    assert report["precision"] == "float32"
    rows = report["measurements"]
    assert [(r["concurrency"], r["label"]) for r in rows] == [
        (level, label) for level in (1, 2) for label in ("none", "ngram k=2", "self k=2")]
    for row in rows:
        assert row["requests"] == 2 * row["concurrency"]  # the prompts repeat to 2x the level
        assert row["tokens"] == 16 * row["requests"]  # random weights: no EOS, max_tokens each
        assert row["tokens_per_s"] > 0 and len(row["rounds_tokens_per_s"]) == 2
        assert row["outputs_equal_to_plain"] == row["requests"]  # lossless greedy
    self_rows = [r for r in rows if r["method"] == "self"]
    assert all(r["acceptance_length"] == 3.0 for r in self_rows)  # the target drafts for itself
    assert rows[0]["acceptance_length"] is None and rows[0]["verification_steps"] == 0
    choices = report["recommendations"]
    assert [c["concurrency"] for c in choices] == [1, 2]
    assert all(c["label"] in ("none", "ngram k=2", "self k=2") and c["speedup"] >= 1.0
               for c in choices)
    assert report["rationale"].startswith("ngram: ") and "self: tau 3.00" in report["rationale"]


def test_cli_prompt_too_long_is_a_user_error(tiny_model_dir, tmp_path, capsys):
    prompts = tmp_path / "long.jsonl"
    prompts.write_text(json.dumps({"prompt": "word " * 400}) + "\n")  # the tiny model holds 256
    code = main(["recommend", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--dataset", f"jsonl:{prompts}", "--num-prompts", "1", "--max-tokens", "8",
                 "--concurrency", "1", "--rounds", "1"])
    err = capsys.readouterr().err
    assert code == 2 and "prompt 1 does not fit" in err and "Traceback" not in err
