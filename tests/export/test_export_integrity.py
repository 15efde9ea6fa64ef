"""Exports the engines load: digests checked by --check and the import, finiteness, layer ids
against the target's depth, the target's dtype by default, a verifier the engines resolve."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eyas.cli.main import main
from eyas.eagle3.checkpoint import save_head
from eyas.eagle3.config import Eagle3Config
from eyas.eagle3.head import Eagle3Head
from eyas.eagle3.vocab import build_draft_vocab
from eyas.errors import EyasError
from eyas.export.check import check_export
from eyas.export.formats import export_head, import_head
from eyas.models.config import ModelConfig
from eyas.models.registry import ALIASES
from eyas.utils.integrity import write_manifest

V, N, H, L = 64, 16, 16, 30
SMOLLM2_ID = "HuggingFaceTB/SmolLM2-135M-Instruct"
TARGET = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=24, num_hidden_layers=L,
                     num_attention_heads=4, num_key_value_heads=2, head_dim=4)


def make_head(target_model: str = "tiny", layer_ids=(2, 15, 27)) -> Eagle3Head:
    torch.manual_seed(0)
    config = Eagle3Config(hidden_size=H, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=4, vocab_size=V, draft_vocab_size=N, target_hidden_size=H,
                          target_layer_ids=list(layer_ids), target_num_hidden_layers=L,
                          target_model=target_model)
    head = Eagle3Head(config)
    head.set_vocab(build_draft_vocab(torch.arange(V) % 5, N))
    return head.eval()


def export(folder, fmt: str = "vllm", **options):
    options = {"dtype": "float32", "target_name": SMOLLM2_ID, **options}
    return export_head(make_head(), folder, fmt, **options)


def edit(folder, config=None, tensors=None) -> None:
    """Change an export and write its manifest again, so that only the planted fault remains."""
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))
    if tensors is not None:
        save_file(tensors, str(folder / "model.safetensors"))
    write_manifest(folder, ["config.json", "model.safetensors"])


def errors(folder, **options) -> str:
    report = check_export(folder, **options)
    assert not report.ok, report.render()
    return " | ".join(report.errors)


def test_a_fresh_export_verifies(tmp_path) -> None:
    folder = export(tmp_path / "x")
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "manifest.json"}
    report = check_export(folder, target_config=TARGET)
    assert report.ok and not report.warnings, report.render()


def test_one_flipped_byte_fails_check_and_import(tmp_path, capsys) -> None:
    folder = export(tmp_path / "x")
    data = bytearray((folder / "model.safetensors").read_bytes())
    data[-20] ^= 0x01
    (folder / "model.safetensors").write_bytes(bytes(data))
    assert "model.safetensors is corrupted: its sha256 differs" in errors(folder)
    with pytest.raises(EyasError, match="is corrupted"):
        import_head(folder)
    assert main(["export", "--check", str(folder)]) == 1
    captured = capsys.readouterr()
    assert "FAILED" in captured.out and "is corrupted" in captured.out and "Traceback" not in captured.err


def test_a_truncated_export_is_a_clear_error(tmp_path, capsys) -> None:
    folder = export(tmp_path / "x")
    weights = folder / "model.safetensors"
    weights.write_bytes(weights.read_bytes()[:1000])
    found = errors(folder)
    assert "model.safetensors is truncated or was changed: 1000 bytes" in found
    assert "model.safetensors cannot be read" in found
    assert main(["export", "--check", str(folder)]) == 1
    assert "Traceback" not in capsys.readouterr().err
    (folder / "manifest.json").unlink()  # without a manifest the reader still names the file
    assert "model.safetensors cannot be read" in errors(folder)
    with pytest.raises(EyasError, match="model.safetensors is not a readable safetensors file"):
        import_head(folder)


@pytest.mark.parametrize("value,count", [(float("nan"), "1 NaN and 0 infinite"),
                                         (float("inf"), "0 NaN and 1 infinite")])
def test_non_finite_weights_fail_check(tmp_path, value, count) -> None:
    folder = export(tmp_path / "x")
    tensors = load_file(str(folder / "model.safetensors"))
    tensors["midlayer.mlp.down_proj.weight"][3, 4] = value
    edit(folder, tensors=tensors)
    assert f"midlayer.mlp.down_proj.weight holds {count} values" in errors(folder)


def test_removing_the_marker_cannot_hide_an_off_by_one(tmp_path) -> None:
    folder = export(tmp_path / "x")
    config = json.loads((folder / "config.json").read_text())
    del config["eyas_export"]
    config["eagle_aux_hidden_state_layer_ids"] = [1, 14, 26]  # SGLang's ids in a vLLM file
    (folder / "config.json").write_text(json.dumps(config))
    assert "config.json is truncated or was changed" in errors(folder, target_config=TARGET)


@pytest.mark.parametrize("ids,message", [
    ([27, 15, 2], "not in ascending order"),
    ([2, 2, 27], "repeat a layer"),
    ([2, 15, 30], "id 30 is out of range: boundary ids are 1..29 for a target of 30 layers"),
    ([0, 15, 27], "id 0 is out of range: boundary ids are 1..29"),
])
def test_layer_ids_are_checked_against_the_target(tmp_path, ids, message) -> None:
    folder = export(tmp_path / "x")
    config = json.loads((folder / "config.json").read_text())
    config["eagle_aux_hidden_state_layer_ids"] = ids
    config["eyas_export"]["target_layer_ids"] = ids
    edit(folder, config=config)
    assert message in errors(folder, target_config=TARGET)


def test_export_refuses_ids_the_engines_cannot_capture(tmp_path) -> None:
    with pytest.raises(EyasError, match="id 0 is out of range"):
        export_head(make_head(layer_ids=(0, 15, 27)), tmp_path / "x", "vllm", dtype="float32")
    with pytest.raises(EyasError, match="id 30 is out of range"):
        export_head(make_head(layer_ids=(2, 15, 30)), tmp_path / "y", "vllm", dtype="float32")


def test_the_dtype_defaults_to_the_targets(tmp_path) -> None:
    export_head(make_head("smollm2-135m"), tmp_path / "alias", "sglang")
    assert json.loads((tmp_path / "alias" / "config.json").read_text())["torch_dtype"] == "bfloat16"
    with safe_open(str(tmp_path / "alias" / "model.safetensors"), framework="pt") as handle:
        assert handle.get_tensor("fc.weight").dtype == torch.bfloat16
    target = tmp_path / "target"
    target.mkdir()
    (target / "config.json").write_text(json.dumps({"model_type": "llama", "torch_dtype": "float16"}))
    export_head(make_head(str(target)), tmp_path / "folder", "vllm")
    assert json.loads((tmp_path / "folder" / "config.json").read_text())["torch_dtype"] == "float16"
    export_head(make_head("tiny"), tmp_path / "model", "vllm", model=str(target))  # --model tells it
    assert json.loads((tmp_path / "model" / "config.json").read_text())["torch_dtype"] == "float16"
    with pytest.raises(EyasError, match="cannot tell the target's dtype.*pass --dtype"):
        export_head(make_head("tiny"), tmp_path / "unknown", "vllm")


def test_check_flags_a_dtype_sglang_would_refuse(tmp_path) -> None:
    export_head(make_head("smollm2-135m"), tmp_path / "s", "sglang", dtype="float32")
    assert "the weights are float32, the target is bfloat16" in errors(tmp_path / "s", target_dtype="bfloat16")
    export_head(make_head("smollm2-135m"), tmp_path / "v", "vllm", dtype="float32")
    report = check_export(tmp_path / "v", target_dtype="bfloat16")  # vLLM runs the draft in the target's
    assert report.ok and "the target is bfloat16" in " ".join(report.warnings)
    config = json.loads((tmp_path / "v" / "config.json").read_text())
    edit(tmp_path / "v", config={**config, "torch_dtype": "bfloat16"})
    assert "config.json says torch_dtype bfloat16, the weights are float32" in errors(tmp_path / "v")


def test_the_speculators_verifier_is_a_name_the_engines_resolve(tmp_path) -> None:
    entry = ALIASES["smollm2-135m"]
    assert entry.hf_id == SMOLLM2_ID and entry.filename.startswith(SMOLLM2_ID.split("/")[1] + ".")
    export_head(make_head("smollm2-135m"), tmp_path / "a", "speculators")
    config = json.loads((tmp_path / "a" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == SMOLLM2_ID
    with pytest.raises(EyasError, match="no Hugging Face id in the model registry: pass --target-name"):
        export_head(make_head("/data/my-target"), tmp_path / "b", "speculators", dtype="float32")
    with pytest.raises(EyasError, match="is an eyas alias"):
        export_head(make_head(), tmp_path / "c", "speculators", dtype="float32", target_name="smollm2-135m")
    export_head(make_head("/data/my-target"), tmp_path / "d", "speculators", dtype="float32",
                target_name="org/my-target")
    config = json.loads((tmp_path / "d" / "config.json").read_text())
    assert config["speculators_config"]["verifier"]["name_or_path"] == "org/my-target"
    config["speculators_config"]["verifier"]["name_or_path"] = "smollm2-135m"  # what older eyas wrote
    edit(tmp_path / "d", config=config)
    assert f"its Hugging Face id is {SMOLLM2_ID}" in errors(tmp_path / "d")


def test_cli_export_defaults_and_check_with_model(tmp_path, capsys) -> None:
    head_dir = save_head(make_head("smollm2-135m"), tmp_path / "head")
    assert main(["export", "--head", str(head_dir), "--format", "speculators", "--out", str(tmp_path / "spec")]) == 0
    config = json.loads((tmp_path / "spec" / "config.json").read_text())
    assert config["torch_dtype"] == "bfloat16"
    assert config["speculators_config"]["verifier"]["name_or_path"] == SMOLLM2_ID
    other = save_head(make_head("/data/my-target"), tmp_path / "other")
    capsys.readouterr()
    assert main(["export", "--head", str(other), "--format", "vllm", "--out", str(tmp_path / "v")]) == 2
    err = capsys.readouterr().err
    assert "pass --dtype" in err and "Traceback" not in err and not (tmp_path / "v").exists()
