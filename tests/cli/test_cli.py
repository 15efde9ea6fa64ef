"""CLI: help texts, clear errors with a non-zero exit and no traceback, a real generate run."""

from __future__ import annotations

import subprocess
import sys

import pytest

from eyas.cli.main import main


def run_cli(args, capsys):
    code = main(args)
    captured = capsys.readouterr()
    return code, captured.out, captured.err


def test_help_lists_subcommands(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["--help"])
    assert exit_info.value.code == 0
    out = capsys.readouterr().out
    for command in ("generate", "bench"):
        assert command in out


def test_unknown_alias_lists_what_is_accepted(capsys):
    code, _, err = run_cli(["generate", "--model", "no-such-model", "--prompt", "hi"], capsys)
    assert code == 2
    assert "unknown model 'no-such-model'" in err and "smollm2-135m" in err
    assert "Traceback" not in err


def test_missing_gguf_file(capsys, tmp_path):
    code, _, err = run_cli(["generate", "--model", str(tmp_path / "absent.gguf"), "--prompt", "x"], capsys)
    assert code == 2 and "absent.gguf" in err and "Traceback" not in err


def test_folder_without_config(capsys, tmp_path):
    code, _, err = run_cli(["generate", "--model", str(tmp_path), "--prompt", "x"], capsys)
    assert code == 2 and "without config.json" in err


def test_prompt_longer_than_context(capsys, tiny_model_dir):
    long_prompt = "word " * 400  # the tiny model's context is 256 tokens
    code, _, err = run_cli(["generate", "--model", str(tiny_model_dir), "--raw", "--prompt",
                            long_prompt], capsys)
    assert code == 2
    assert "context is 256 tokens" in err and "Traceback" not in err


def test_bad_sampling_value(capsys, tiny_model_dir):
    code, _, err = run_cli(["generate", "--model", str(tiny_model_dir), "--prompt", "x",
                            "--temperature", "5"], capsys)
    assert code == 2 and "temperature must be in [0, 2]" in err


def test_generate_streams_the_same_text_as_the_api(capsys, tiny_target, tiny_model_dir):
    from eyas.engine.generate import generate
    from eyas.engine.sampling import SamplingParams
    from eyas.models.tokenizer import chat_prompt_ids

    code, out, err = run_cli(["generate", "--model", str(tiny_model_dir), "--prompt", "Hello",
                              "--max-tokens", "10", "--dtype", "float32"], capsys)
    assert code == 0
    ids = chat_prompt_ids(tiny_target.tokenizer, [{"role": "user", "content": "Hello"}])
    expected = generate(tiny_target, ids, SamplingParams(max_tokens=10)).text
    assert out == expected + "\n"
    assert "tok/s" in err


def test_console_script_runs_as_a_module():
    result = subprocess.run([sys.executable, "-m", "eyas", "--version"], capture_output=True, text=True)
    assert result.returncode == 0 and result.stdout.startswith("eyas ")


def test_an_unknown_kv_dtype_is_refused_with_the_accepted_ones(capsys):
    with pytest.raises(SystemExit) as exit_info:
        main(["generate", "--prompt", "x", "--kv-dtype", "bfloat16"])
    assert exit_info.value.code == 2
    err = capsys.readouterr().err
    assert "--kv-dtype" in err and "'auto', 'float32', 'float16'" in err
