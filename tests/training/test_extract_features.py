"""`eyas features` on a tiny target: stored values, resume, settings guard, storage estimate."""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest
import torch

from eyas.errors import EyasError
from eyas.features import extract
from eyas.features.extract import FeatureConfig, extract_features
from eyas.features.store import FeatureStore, bytes_per_token
from eyas.features.tokenized import read_tokenized


def test_stored_features_are_the_targets_taps_and_last_hidden(feature_store_dir, tiny_target, tokenized_file) -> None:
    store = FeatureStore(feature_store_dir)
    assert store.meta.target_layer_ids == [2, 4, 5]  # {2, L//2, L-3} for L = 8
    assert store.meta.dtype == "float32" and len(store) == 24
    samples = read_tokenized(tokenized_file)
    for number in (0, 13):
        stored = store.sample(number)
        assert torch.equal(stored.input_ids, samples[number].input_ids)
        assert torch.equal(stored.loss_mask, samples[number].loss_mask)
        out = tiny_target.model(stored.input_ids[None], tap_layers=(2, 4, 5))
        assert torch.equal(stored.taps, out.taps[0])
        assert torch.equal(stored.hidden, out.hidden[0])
        # hidden is after the final norm: lm_head(hidden) is the target's logits
        assert torch.allclose(tiny_target.model.lm_head(stored.hidden), out.logits[0], atol=1e-5)


def test_resume_computes_only_the_missing_shard(tmp_path, feature_store_dir, tiny_target, tiny_target_dir,
                                                tokenized_file) -> None:
    copy = tmp_path / "store"
    shutil.copytree(feature_store_dir, copy)
    original = json.loads((copy / "index.json").read_text())
    for name in ("shard-00001.safetensors", "shard-00001.json", "index.json"):
        (copy / name).unlink()
    seen = []
    hook = tiny_target.model.register_forward_hook(lambda m, args, kwargs, out: seen.append(args[0].shape[1]),
                                                   with_kwargs=True)
    try:
        extract_features(FeatureConfig(model=str(tiny_target_dir), data=str(tokenized_file), output=str(copy),
                                       dtype="float32", samples_per_shard=10), target=tiny_target, progress=False)
    finally:
        hook.remove()
    assert len(seen) == 10 and sum(seen) == original["shards"][1]["shapes"]["input_ids"][0]
    resumed = json.loads((copy / "index.json").read_text())
    assert [s["sha256"] for s in resumed["shards"]] == [s["sha256"] for s in original["shards"]]


def test_other_settings_on_the_same_folder_are_refused(feature_store_dir, tiny_target, tiny_target_dir,
                                                       tokenized_file) -> None:
    with pytest.raises(EyasError, match=r"other settings \(dtype: 'float32' -> 'bfloat16'\)"):
        extract_features(FeatureConfig(model=str(tiny_target_dir), data=str(tokenized_file),
                                       output=str(feature_store_dir), dtype="bfloat16", samples_per_shard=10),
                         target=tiny_target, progress=False)


def test_refuses_with_the_figures_when_the_disk_is_too_small(tmp_path, monkeypatch, tiny_target_dir,
                                                             tokenized_file) -> None:
    monkeypatch.setattr(extract, "free_bytes", lambda folder: 1000)
    tokens = sum(len(s) for s in read_tokenized(tokenized_file))
    need = tokens * bytes_per_token(32, 3, "bfloat16")
    with pytest.raises(EyasError, match=r"need 0\.\d MiB more but 0\.0 MiB are free") as error:
        extract_features(FeatureConfig(model=str(tiny_target_dir), data=str(tokenized_file),
                                       output=str(tmp_path / "store")), progress=False)
    assert "train online" in str(error.value) and "--dtype" not in str(error.value)  # already bf16
    assert not (tmp_path / "store").exists()
    assert need == tokens * (4 * 32 * 2 + 5)  # 3 taps + last hidden in bf16, id and mask


def test_dry_run_estimates_and_writes_nothing(tmp_path, tiny_target_dir, tokenized_file, capsys) -> None:
    summary = extract_features(FeatureConfig(model=str(tiny_target_dir), data=str(tokenized_file),
                                             output=str(tmp_path / "store"), dry_run=True), progress=False)
    tokens = sum(len(s) for s in read_tokenized(tokenized_file))
    assert summary.num_tokens == tokens and summary.bytes >= tokens * bytes_per_token(32, 3, "bfloat16")
    assert "24 samples" in capsys.readouterr().out
    assert not (tmp_path / "store").exists()


@pytest.mark.slow
def test_two_ranks_under_torchrun_split_the_shards(tmp_path, feature_store_dir, tiny_target_dir,
                                                   tokenized_file) -> None:
    out = tmp_path / "store"
    command = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_port", "29637",
               "-m", "eyas.cli.features", "--model", str(tiny_target_dir), "--data", str(tokenized_file),
               "--out", str(out), "--dtype", "float32", "--samples-per-shard", "10"]
    subprocess.run(command, check=True, capture_output=True, cwd=Path(__file__).parents[2], timeout=300)
    single = json.loads((feature_store_dir / "index.json").read_text())
    double = json.loads((out / "index.json").read_text())
    assert [s["sha256"] for s in double["shards"]] == [s["sha256"] for s in single["shards"]]


def test_batched_extraction_matches_one_sample_at_a_time(tmp_path, feature_store_dir, tiny_target,
                                                         tiny_target_dir, tokenized_file) -> None:
    extract_features(FeatureConfig(model=str(tiny_target_dir), data=str(tokenized_file), output=str(tmp_path / "b"),
                                   dtype="float32", samples_per_shard=10, batch_size=4),
                     target=tiny_target, progress=False)
    batched, single = FeatureStore(tmp_path / "b"), FeatureStore(feature_store_dir)
    assert len(batched) == len(single)
    for number in range(len(single)):  # right padding never reaches a real row (causal attention)
        a, b = batched.sample(number), single.sample(number)
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.allclose(a.taps, b.taps, atol=1e-5) and torch.allclose(a.hidden, b.hidden, atol=1e-5)
