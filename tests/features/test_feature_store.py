"""Feature store: write, read back, index contents, checksums, a corrupted shard."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.errors import EyasError
from eyas.features.store import (
    FeatureStore,
    SampleFeatures,
    StoreMeta,
    bytes_per_token,
    read_shard_entry,
    write_index,
    write_shard,
)

H = 8


def sample(name: str, length: int, seed: int) -> SampleFeatures:
    generator = torch.Generator().manual_seed(seed)
    return SampleFeatures(
        id=name,
        input_ids=torch.randint(0, 100, (length,), generator=generator),
        loss_mask=(torch.arange(length) >= length // 2).long(),
        taps=torch.randn(length, 3 * H, generator=generator),
        hidden=torch.randn(length, H, generator=generator),
    )


def write_store(folder, dtype=torch.bfloat16, dtype_name="bfloat16"):
    shards = [[sample("a", 5, 0), sample("b", 3, 1)], [sample("c", 7, 2)]]
    entries = [write_shard(folder, i, shard, dtype, skipped=["empty"] if i else []) for i, shard in enumerate(shards)]
    meta = StoreMeta(target_model="tiny", target_layer_ids=[2, 4, 5], target_num_hidden_layers=8,
                     hidden_size=H, vocab_size=100, dtype=dtype_name, max_length=64)
    write_index(folder, meta, entries)
    return [s for shard in shards for s in shard]


def test_write_then_read_back(tmp_path) -> None:
    samples = write_store(tmp_path)
    store = FeatureStore(tmp_path)
    assert len(store) == 3 and store.num_tokens == 15
    for number, original in enumerate(samples):
        read = store.sample(number)
        assert read.id == original.id == store.sample_id(number)
        assert torch.equal(read.input_ids, original.input_ids)
        assert torch.equal(read.loss_mask, original.loss_mask)
        assert read.taps.dtype == torch.bfloat16 and read.taps.shape == (store.length(number), 3 * H)
        assert torch.equal(read.taps, original.taps.to(torch.bfloat16))
        assert torch.equal(read.hidden, original.hidden.to(torch.bfloat16))
    arrays = list(store.iter_token_arrays())
    assert [ids.tolist() for ids, _ in arrays] == [s.input_ids.tolist() for s in samples]


def test_index_records_shapes_dtype_and_checksums(tmp_path) -> None:
    write_store(tmp_path)
    index = json.loads((tmp_path / "index.json").read_text())
    assert index["format"] == "eyas-features" and index["dtype"] == "bfloat16"
    assert index["target_layer_ids"] == [2, 4, 5] and index["num_samples"] == 3
    assert index["num_tokens"] == 15
    first = index["shards"][0]
    assert first["file"] == "shard-00000.safetensors" and len(first["sha256"]) == 64
    assert first["shapes"] == {"input_ids": [8], "loss_mask": [8], "offsets": [3], "taps": [8, 3 * H],
                               "hidden": [8, H]}
    assert first["bytes"] == (tmp_path / "shard-00000.safetensors").stat().st_size
    assert index["shards"][1]["skipped"] == ["empty"]
    assert read_shard_entry(tmp_path, 1).sample_ids == ["c"]
    assert read_shard_entry(tmp_path, 2) is None
    # the payload matches the documented per-token cost (plus a small header)
    payload = 8 * bytes_per_token(H, 3, "bfloat16") + 3 * 8
    assert payload < first["bytes"] < payload + 1024


def test_float32_store_is_exact(tmp_path) -> None:
    samples = write_store(tmp_path, torch.float32, "float32")
    assert torch.equal(FeatureStore(tmp_path).sample(2).taps, samples[2].taps)


def test_corrupted_shard_is_detected_with_a_clear_error(tmp_path) -> None:
    write_store(tmp_path)
    path = tmp_path / "shard-00001.safetensors"
    data = bytearray(path.read_bytes())
    data[-5] ^= 0xFF  # one flipped byte inside the tensor data
    path.write_bytes(bytes(data))
    store = FeatureStore(tmp_path)
    assert torch.equal(store.sample(0).input_ids, store.sample(0).input_ids)  # shard 0 is fine
    with pytest.raises(EyasError, match=r"shard-00001.safetensors is corrupted: sha256 .* re-run"):
        store.sample(2)
    with pytest.raises(EyasError, match="corrupted"):
        FeatureStore(tmp_path).verify()


def test_missing_shard_and_missing_index(tmp_path) -> None:
    write_store(tmp_path)
    (tmp_path / "shard-00000.safetensors").unlink()
    with pytest.raises(EyasError, match="shard-00000.safetensors is missing"):
        FeatureStore(tmp_path).sample(0)
    with pytest.raises(EyasError, match="no index.json"):
        FeatureStore(tmp_path / "elsewhere")


def test_unknown_dtype_is_refused() -> None:
    with pytest.raises(EyasError, match="accepted: bfloat16, float16, float32"):
        StoreMeta(target_model="x", target_layer_ids=[1, 2, 3], target_num_hidden_layers=4, hidden_size=8,
                  vocab_size=10, dtype="int8", max_length=8)
