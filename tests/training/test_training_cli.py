"""The `eyas features`, `eyas train` and `eyas export` command lines on the tiny target."""

from __future__ import annotations

import argparse
import json

import pytest

from eyas.cli import export as export_cli
from eyas.cli import features as features_cli
from eyas.cli import train as train_cli


def test_flags_map_onto_the_config_and_absent_flags_keep_its_defaults() -> None:
    parser = argparse.ArgumentParser()
    train_cli.register(parser.add_subparsers())
    args = parser.parse_args(["train", "--model", "m", "--data", "d.jsonl", "--out", "o", "--lr", "3e-4",
                              "--target-layer-ids", "2,4,5", "--no-init-lm-head", "--resume"])
    config = train_cli.config_from_args(args)
    assert config.learning_rate == 3e-4 and config.target_layer_ids == [2, 4, 5]
    assert config.init_lm_head_from_target is False and config.resume is True
    assert config.ttt_steps == 7 and config.ttt_decay == 0.8  # TrainConfig's defaults
    assert config.max_time_s is None
    for text, seconds in (("900", 900.0), ("90s", 90.0), ("45m", 2700.0), ("1.5h", 5400.0)):
        args = parser.parse_args(["train", "--model", "m", "--data", "d", "--out", "o", "--max-time", text])
        assert train_cli.config_from_args(args).max_time_s == seconds
    for bad in ("0", "-5m", "2d", "soon"):
        with pytest.raises(argparse.ArgumentTypeError, match="positive duration like 900, 900s, 45m"):
            train_cli._duration(bad)


def test_preset_then_flags(tmp_path) -> None:
    preset = tmp_path / "preset.yaml"
    preset.write_text("model: m\ndata: d.jsonl\nttt_steps: 3\nlearning_rate: 0.001\n")
    parser = argparse.ArgumentParser()
    train_cli.register(parser.add_subparsers())
    config = train_cli.config_from_args(parser.parse_args(["train", "--config", str(preset), "--out", "o",
                                                           "--lr", "0.002"]))
    assert (config.ttt_steps, config.learning_rate, config.data) == (3, 0.002, "d.jsonl")
    preset.write_text("model: m\nlearning_rat: 1\n")
    with pytest.raises(Exception, match="unknown keys \\['learning_rat'\\]"):
        train_cli.config_from_args(parser.parse_args(["train", "--config", str(preset), "--out", "o"]))


def test_missing_flags_are_a_user_error(capsys) -> None:
    assert train_cli.main(["--data", "x.jsonl"]) == 2
    assert "needs --model and --out" in capsys.readouterr().err
    assert features_cli.main(["--model", "m"]) == 2
    assert "needs --data, --out" in capsys.readouterr().err


def test_features_train_export_check(tmp_path, tiny_target_dir, tokenized_file, capsys) -> None:
    store, run = tmp_path / "store", tmp_path / "run"
    assert features_cli.main(["--model", str(tiny_target_dir), "--data", str(tokenized_file),
                              "--out", str(store), "--dtype", "bfloat16"]) == 0
    assert "24 samples" in capsys.readouterr().out
    assert features_cli.main(["--verify", str(store)]) == 0
    assert "all checksums match" in capsys.readouterr().out
    assert train_cli.main(["--model", str(tiny_target_dir), "--features", str(store), "--out", str(run),
                           "--draft-vocab-size", "64", "--ttt-steps", "2", "--max-steps", "2",
                           "--no-progress"]) == 0
    out = capsys.readouterr().out
    assert "head written to" in out and "estimated acceptance length" in out
    for fmt in ("sglang", "vllm", "speculators"):  # a folder target has no registered hub id: name it
        assert export_cli.main(["--head", str(run / "head"), "--format", fmt, "--out", str(tmp_path / fmt),
                                "--target-name", "org/tiny-target"]) == 0
        assert export_cli.main(["--check", str(tmp_path / fmt), "--model", str(tiny_target_dir)]) == 0
        assert f"OK ({fmt} format)" in capsys.readouterr().out
    # an off-by-one in the layer ids is caught
    config_path = tmp_path / "sglang" / "config.json"
    config = json.loads(config_path.read_text())
    config["eagle_config"]["eagle_aux_hidden_state_layer_ids"] = [2, 4, 5]  # boundary ids written as-is
    config_path.write_text(json.dumps(config))
    assert export_cli.main(["--check", str(tmp_path / "sglang")]) == 1
    assert "off-by-one" in capsys.readouterr().out


@pytest.mark.parametrize("ids,message", [("5,4,2", "not in ascending order"), ("2,2,5", "repeat a layer"),
                                         ("0,4,5", "id 0 is out of range: boundary ids are 1..7"),
                                         ("2,4,8", "id 8 is out of range: boundary ids are 1..7")])
def test_layer_ids_the_engines_cannot_use_are_refused(tmp_path, tiny_target_dir, tokenized_file, capsys,
                                                      ids, message) -> None:
    assert train_cli.main(["--model", str(tiny_target_dir), "--data", str(tokenized_file),
                           "--out", str(tmp_path / "run"), "--target-layer-ids", ids, "--no-progress"]) == 2
    err = capsys.readouterr().err
    assert message in err and "Traceback" not in err and len(err.strip().splitlines()) == 1
