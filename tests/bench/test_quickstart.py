"""`eyas quickstart`: every step end to end on a tiny random model, then a resumed run that skips
what is done, and the summary read back from the files the steps wrote."""

from __future__ import annotations

import json

import pytest

from eyas.cli.main import main
from eyas.errors import EyasError
from eyas.quickstart import QuickstartConfig, plan_steps, run_quickstart
from tiny_models import build_tiny_model


@pytest.fixture(scope="module")
def tiny_chat_model(tmp_path_factory, smollm_tokenizer):
    return build_tiny_model(tmp_path_factory.mktemp("tiny-quickstart"), smollm_tokenizer,
                            num_hidden_layers=6, max_position_embeddings=2048)


def test_steps_are_eyas_commands_and_skip_what_is_missing(tmp_path):
    config = QuickstartConfig(model=str(tmp_path / "m"), out=str(tmp_path / "q"), serving=False)
    steps = {step.name: step for step in plan_steps(config)}
    assert list(steps) == ["prepare", "regenerate", "render", "features", "train", "eval-own",
                           "eval-shipped", "eval-shipped-ngram", "serve-compare"]
    assert steps["eval-shipped"].skip_reason == f"no head is shipped for {tmp_path / 'm'}"
    assert steps["eval-shipped-ngram"].skip_reason == steps["eval-shipped"].skip_reason
    assert steps["serve-compare"].skip_reason == "--no-serving"
    assert steps["train"].argv[:2] == ["train", "--model"] and "--resume" in steps["train"].argv
    with pytest.raises(EyasError, match="prompts must be >= 1"):
        QuickstartConfig(prompts=0)


def test_quickstart_end_to_end_on_a_tiny_model(tiny_chat_model, tmp_path, capsys):
    out = tmp_path / "quick"
    args = ["quickstart", "--model", str(tiny_chat_model), "--out", str(out), "--source-limit", "300",
            "--prompts", "6", "--answer-tokens", "12", "--batch-size", "6", "--draft-vocab-size", "512",
            "--ttt-steps", "2", "--epochs", "1", "--eval-prompts", "2", "--eval-tokens", "8",
            "--tree", "chain:2", "--serve-prompts", "2", "--serve-tokens", "6", "--serve-concurrency", "1,2", "--no-progress"]
    assert main(args) == 0
    printed = capsys.readouterr()
    summary = json.loads((out / "summary.json").read_text())
    # 1-5: data and training, read back from each step's own files
    assert summary["prepared"]["train"] > 100
    assert summary["regenerated"]["written"] == 6 and summary["regenerated"]["tokens"] > 0
    assert summary["features"]["samples"] >= 5 and summary["features"]["bytes"] > 0
    assert (out / "train" / "head" / "model.safetensors").is_file()
    # 6: the head trained here, evaluated; greedy speculative output equals plain
    own = summary["eval-own"]
    assert own["prompts"] == 2 and own["identical_outputs"] == 2 and own["tau"] >= 1.0
    assert "eval-shipped" not in summary  # no head is shipped for a random model
    # 8: both servers answered at both concurrency levels
    serving = summary["serving_output_tokens_per_s"]
    assert sorted(serving) == ["ngram", "none"]
    assert all(set(levels) == {"1", "2"} and min(levels.values()) > 0 for levels in serving.values())
    assert (out / "serving" / "report.md").is_file()
    assert "| eval-own | head trained here: tau" in printed.out
    assert "$ eyas data prepare --source sharegpt" in printed.err
    # Run again: every step is done already, nothing recomputed, the same summary.
    calls = []
    again = run_quickstart(QuickstartConfig(
        model=str(tiny_chat_model), out=str(out), source_limit=300, prompts=6, answer_tokens=12,
        batch_size=6, draft_vocab_size=512, ttt_steps=2, epochs=1, eval_prompts=2, eval_tokens=8,
        tree="chain:2", serve_prompts=2, serve_tokens=6, serve_concurrency="1,2", progress=False),
        run_command=lambda argv: calls.append(argv) or 0)
    assert calls == []
    assert again["eval-own"] == own
