"""Head integrity: the manifest catches a flipped byte, a truncation, an empty or missing file
and a cut config; heads written before manifests load with a warning; the shipped head verifies;
layer ids are refused unless distinct, ascending and (for the engines) in 1..L-1."""

from __future__ import annotations

import json
import shutil

import pytest
import torch

from eyas.cli.main import main
from eyas.eagle3.checkpoint import load_head, save_head
from eyas.eagle3.config import Eagle3Config, check_target_layer_ids
from eyas.eagle3.head import Eagle3Head
from eyas.eagle3.shipped import shipped_head_dir
from eyas.eagle3.vocab import build_draft_vocab
from eyas.errors import EyasError
from eyas.utils.integrity import read_manifest, verify_files

V, N, H = 50, 12, 16


def make_head(**overrides) -> Eagle3Head:
    torch.manual_seed(0)
    values = dict(hidden_size=H, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=4, vocab_size=V, draft_vocab_size=N, target_hidden_size=H,
                  target_layer_ids=[2, 15, 27], target_num_hidden_layers=30, target_model="smollm2-135m")
    values.update(overrides)
    head = Eagle3Head(Eagle3Config(**values))
    head.set_vocab(build_draft_vocab(torch.arange(V) % 7, N))
    return head.eval()


def flip_byte(path, offset_from_end: int = 16) -> None:
    """Flip one bit of one byte near the end of the file (inside the last tensor's data)."""
    data = bytearray(path.read_bytes())
    data[len(data) - offset_from_end] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.fixture
def head_dir(tmp_path):
    return save_head(make_head(), tmp_path / "head")


def test_a_saved_head_lists_both_files_with_their_digests(head_dir) -> None:
    manifest = read_manifest(head_dir)
    assert set(manifest) == {"config.json", "model.safetensors"}
    assert manifest["model.safetensors"].bytes == (head_dir / "model.safetensors").stat().st_size
    assert verify_files(head_dir, ["config.json", "model.safetensors"]) is True


def test_one_flipped_byte_fails_load_and_export(head_dir, tmp_path, capsys) -> None:
    flip_byte(head_dir / "model.safetensors")
    with pytest.raises(EyasError, match=r"model.safetensors is corrupted: its sha256 differs"):
        load_head(head_dir)
    code = main(["export", "--head", str(head_dir), "--format", "vllm", "--out", str(tmp_path / "x")])
    err = capsys.readouterr().err
    assert code == 2 and "model.safetensors is corrupted" in err
    assert "Traceback" not in err and len(err.strip().splitlines()) == 1
    assert not (tmp_path / "x").exists()


@pytest.mark.parametrize("fault,message", [
    ("truncate", r"model.safetensors is truncated or was changed: \d+ bytes, manifest.json records"),
    ("empty", r"model.safetensors is empty \(manifest.json records \d+ bytes\)"),
    ("missing", r"model.safetensors"),
    ("cut_config", r"config.json is truncated or was changed"),
])
def test_damaged_files_are_one_line_errors(head_dir, fault, message) -> None:
    weights = head_dir / "model.safetensors"
    if fault == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif fault == "empty":
        weights.write_bytes(b"")
    elif fault == "missing":
        weights.unlink()
    else:
        text = (head_dir / "config.json").read_text()
        (head_dir / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(EyasError, match=message):
        load_head(head_dir)


@pytest.mark.parametrize("fault,message", [
    ("truncate", r"model.safetensors is not a readable safetensors file"),
    ("empty", r"model.safetensors is empty \(0 bytes\)"),
    ("cut_config", r"config.json is not valid JSON"),
])
def test_heads_without_a_manifest_fail_clearly_too(head_dir, fault, message) -> None:
    (head_dir / "manifest.json").unlink()
    weights = head_dir / "model.safetensors"
    if fault == "truncate":
        weights.write_bytes(weights.read_bytes()[:-100])
    elif fault == "empty":
        weights.write_bytes(b"")
    else:
        text = (head_dir / "config.json").read_text()
        (head_dir / "config.json").write_text(text[: len(text) // 2])
    with pytest.raises(EyasError, match=message):
        load_head(head_dir)


def test_a_head_written_before_manifests_loads_with_a_warning(head_dir, capsys) -> None:
    original = load_head(head_dir)
    (head_dir / "manifest.json").unlink()
    capsys.readouterr()
    loaded = load_head(head_dir)
    assert "has no manifest.json" in capsys.readouterr().err
    for name, tensor in original.state_dict().items():
        if name == "embed_tokens.weight":  # not in the file (shared from the target)
            continue
        assert torch.equal(loaded.state_dict()[name], tensor), name


def test_the_shipped_head_verifies_against_its_manifest(tmp_path) -> None:
    folder = shipped_head_dir("smollm2-135m")
    assert folder is not None
    assert verify_files(folder, ["config.json", "model.safetensors"]) is True
    copy = tmp_path / "shipped"
    shutil.copytree(folder, copy)
    flip_byte(copy / "model.safetensors", offset_from_end=1000)
    with pytest.raises(EyasError, match="is corrupted"):
        load_head(copy)


def test_layer_ids_must_be_distinct_ascending_and_capturable() -> None:
    assert check_target_layer_ids([2, 15, 27], 30) == [2, 15, 27]
    assert check_target_layer_ids([1, 15, 29], 30) == [1, 15, 29]
    with pytest.raises(EyasError, match=r"\[27, 15, 2\] are not in ascending order.*\[2, 15, 27\]"):
        check_target_layer_ids([27, 15, 2], 30)
    with pytest.raises(EyasError, match=r"\[2, 2, 27\] repeat a layer"):
        check_target_layer_ids([2, 2, 27], 30)
    with pytest.raises(EyasError, match=r"id 0 is out of range: boundary ids are 1..29"):
        check_target_layer_ids([0, 15, 27], 30)
    with pytest.raises(EyasError, match=r"id 30 is out of range: boundary ids are 1..29"):
        check_target_layer_ids([2, 15, 30], 30)
    with pytest.raises(EyasError, match="must be integers"):
        check_target_layer_ids(["a", 15, 27], 30)
    # eyas's own engine can read the embeddings (0) and the last layer's output (L) ...
    assert check_target_layer_ids([0, 15, 30], 30, allow_edges=True) == [0, 15, 30]
    # ... but a head config never holds unsorted or repeated ids (the concatenation order)
    with pytest.raises(EyasError, match="not in ascending order"):
        make_head(target_layer_ids=[27, 15, 2])
    with pytest.raises(EyasError, match="repeat a layer"):
        make_head(target_layer_ids=[15, 15, 27])


def test_a_head_with_unsorted_ids_on_disk_is_refused(head_dir) -> None:
    config = json.loads((head_dir / "config.json").read_text())
    config["target_layer_ids"] = [27, 15, 2]
    (head_dir / "config.json").write_text(json.dumps(config))
    (head_dir / "manifest.json").unlink()  # an older head: only the ids are wrong
    with pytest.raises(EyasError, match="not in ascending order"):
        load_head(head_dir)
