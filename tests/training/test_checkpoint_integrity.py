"""Checkpoint integrity: every file checked against the manifest before it is read; damaged
files are one-line errors naming the file; `--resume` falls back to the newest checkpoint that
verifies, to the same weights as a run resumed from that checkpoint directly."""

from __future__ import annotations

import shutil

import pytest
import torch

from eyas.eagle3.config import Eagle3Config
from eyas.eagle3.head import Eagle3Head
from eyas.eagle3.vocab import build_draft_vocab
from eyas.errors import EyasError
from eyas.training.checkpoints import (
    checkpoint_dir,
    list_checkpoints,
    restore_checkpoint,
    restore_newest_checkpoint,
    save_checkpoint,
)
from eyas.training.config import TrainConfig
from eyas.training.trainer import Trainer

V, N, H = 40, 8, 16


def small_head(seed: int) -> tuple[Eagle3Head, torch.optim.Optimizer]:
    torch.manual_seed(seed)
    config = Eagle3Config(hidden_size=H, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=4, vocab_size=V, draft_vocab_size=N, target_hidden_size=H,
                          target_layer_ids=[2, 4, 5], target_num_hidden_layers=8)
    head = Eagle3Head(config)
    head.set_vocab(build_draft_vocab(torch.arange(V) % 3, N))
    optimizer = torch.optim.AdamW([p for p in head.parameters() if p.requires_grad], lr=1e-3)
    return head, optimizer


def saved_run(tmp_path, steps=(2, 4)):
    """A run folder with a checkpoint per step, each after one AdamW step of its own."""
    head, optimizer = small_head(0)
    for step in steps:
        sum(p.sum() for p in head.parameters() if p.requires_grad).backward()
        optimizer.step()
        optimizer.zero_grad()
        save_checkpoint(tmp_path / "run", step, head, optimizer,
                        {"schedule": {"total_steps": 8}, "settings": {}}, keep=5)
    return tmp_path / "run", head


def flip_byte(path) -> None:
    data = bytearray(path.read_bytes())
    data[-8] ^= 0x01
    path.write_bytes(bytes(data))


@pytest.mark.parametrize("fault,message", [
    ("flip_weights", r"step-0000004/model.safetensors is corrupted: its sha256 differs"),
    ("truncate_weights", r"step-0000004/model.safetensors is truncated or was changed"),
    ("empty_weights", r"step-0000004/model.safetensors is empty \(manifest.json records \d+ bytes\)"),
    ("cut_state", r"step-0000004/trainer_state.json is truncated or was changed"),
    ("missing_optimizer", r"step-0000004/optimizer.pt is missing \(manifest.json lists it"),
])
def test_damaged_checkpoint_files_are_named(tmp_path, fault, message) -> None:
    run, _ = saved_run(tmp_path)
    folder = checkpoint_dir(run, 4)
    if fault == "flip_weights":
        flip_byte(folder / "model.safetensors")
    elif fault == "truncate_weights":
        (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-64])
    elif fault == "empty_weights":
        (folder / "model.safetensors").write_bytes(b"")
    elif fault == "cut_state":
        text = (folder / "trainer_state.json").read_text()
        (folder / "trainer_state.json").write_text(text[: len(text) // 2])
    else:
        (folder / "optimizer.pt").unlink()
    head, optimizer = small_head(1)
    with pytest.raises(EyasError, match=message):
        restore_checkpoint(folder, head, optimizer)


@pytest.mark.parametrize("fault,message", [
    ("truncate_weights", r"model.safetensors is not a readable safetensors file"),
    ("empty_weights", r"model.safetensors is empty \(0 bytes\)"),
    ("cut_state", r"trainer_state.json is not valid JSON"),
    ("missing_optimizer", r"optimizer.pt is missing"),
    ("truncate_optimizer", r"optimizer.pt cannot be read"),
])
def test_checkpoints_without_a_manifest_fail_clearly_too(tmp_path, fault, message) -> None:
    run, _ = saved_run(tmp_path)
    folder = checkpoint_dir(run, 4)
    (folder / "manifest.json").unlink()  # as written before manifests
    if fault == "truncate_weights":
        (folder / "model.safetensors").write_bytes((folder / "model.safetensors").read_bytes()[:-64])
    elif fault == "empty_weights":
        (folder / "model.safetensors").write_bytes(b"")
    elif fault == "cut_state":
        text = (folder / "trainer_state.json").read_text()
        (folder / "trainer_state.json").write_text(text[: len(text) // 2])
    elif fault == "missing_optimizer":
        (folder / "optimizer.pt").unlink()
    else:
        (folder / "optimizer.pt").write_bytes((folder / "optimizer.pt").read_bytes()[:200])
    head, optimizer = small_head(1)
    with pytest.raises(EyasError, match=message):
        restore_checkpoint(folder, head, optimizer)


def test_restore_falls_back_and_sets_the_bad_checkpoint_aside(tmp_path, capsys) -> None:
    run, _ = saved_run(tmp_path)
    head_at_2, optimizer_at_2 = small_head(1)
    restore_checkpoint(checkpoint_dir(run, 2), head_at_2, optimizer_at_2)
    flip_byte(checkpoint_dir(run, 4) / "model.safetensors")
    head, optimizer = small_head(1)
    folder, state = restore_newest_checkpoint(run, head, optimizer)
    assert folder == checkpoint_dir(run, 2) and state["step"] == 2
    err = capsys.readouterr().err
    assert "checkpoint step-0000004 is unusable" in err and "is corrupted" in err
    assert "falling back to step-0000002" in err
    for name, tensor in head_at_2.state_dict().items():
        assert torch.equal(head.state_dict()[name], tensor), name
    assert [step for step, _ in list_checkpoints(run)] == [2]
    assert (run / "checkpoints" / "step-0000004.unusable" / "model.safetensors").is_file()


def test_resume_refuses_when_no_checkpoint_verifies(tmp_path) -> None:
    run, _ = saved_run(tmp_path)
    for step in (2, 4):
        (checkpoint_dir(run, step) / "optimizer.pt").unlink()
    head, optimizer = small_head(1)
    with pytest.raises(EyasError, match=r"cannot resume: no checkpoint .* verifies \(step-0000004: .*"
                                        r"optimizer.pt is missing.*step-0000002: "):
        restore_newest_checkpoint(run, head, optimizer)
    assert restore_newest_checkpoint(tmp_path / "fresh", head, optimizer) is None  # nothing to resume


def config(tmp_path, name, model, features, **overrides) -> TrainConfig:
    values = dict(model=str(model), output=str(tmp_path / name), features=str(features), draft_vocab_size=64,
                  ttt_steps=2, micro_batch_size=2, grad_accum=1, max_steps=6, save_every=2,
                  keep_checkpoints=3, log_every=1, learning_rate=1e-3, progress=False)
    values.update(overrides)
    return TrainConfig(**values)


def test_resume_skips_a_bit_flipped_latest_checkpoint(tmp_path, tiny_target_dir, feature_store_dir,
                                                      capsys) -> None:
    # 1. A run killed after its checkpoint at step 4 (checkpoints 2 and 4 on disk).
    Trainer(config(tmp_path, "run", tiny_target_dir, feature_store_dir)).train(stop_after=4)
    assert [step for step, _ in list_checkpoints(tmp_path / "run")] == [2, 4]
    # 2. The reference: the same run resumed from step 2 directly.
    shutil.copytree(tmp_path / "run", tmp_path / "reference")
    shutil.rmtree(checkpoint_dir(tmp_path / "reference", 4))
    reference = Trainer(config(tmp_path, "reference", tiny_target_dir, feature_store_dir, resume=True))
    assert reference.start_step == 2
    reference.train()
    # 3. One flipped bit in the latest checkpoint: --resume says so and takes step 2.
    flip_byte(checkpoint_dir(tmp_path / "run", 4) / "model.safetensors")
    capsys.readouterr()
    resumed = Trainer(config(tmp_path, "run", tiny_target_dir, feature_store_dir, resume=True))
    err = capsys.readouterr().err
    assert "checkpoint step-0000004 is unusable" in err and "falling back to step-0000002" in err
    assert resumed.start_step == 2
    resumed.train()
    expected = reference.head.state_dict()
    for name, tensor in resumed.head.state_dict().items():
        assert torch.equal(tensor, expected[name]), name
    assert [step for step, _ in list_checkpoints(tmp_path / "run")] == [2, 4, 6]
