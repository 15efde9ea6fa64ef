"""The fast GGUF header reader gives what gguf.GGUFReader gives: metadata, tensor table, data."""

from __future__ import annotations

import gguf
import numpy as np
import pytest

from eyas.errors import EyasError
from eyas.models.gguf_header import read_gguf_header


def write_file(path, alignment: int | None = None):
    writer = gguf.GGUFWriter(str(path), "qwen2")
    if alignment is not None:
        writer.add_custom_alignment(alignment)
    writer.add_uint32("qwen2.block_count", 2)
    writer.add_float32("qwen2.rope.freq_base", 1e6)
    writer.add_bool("tokenizer.ggml.add_bos_token", False)
    writer.add_string("general.name", "tiny")
    writer.add_array("tokenizer.ggml.tokens", ["a", "bc", "", "d" * 300])
    writer.add_array("tokenizer.ggml.token_type", [1, 1, 3, 1])
    rng = np.random.default_rng(0)
    writer.add_tensor("token_embd.weight", gguf.quants.quantize(rng.standard_normal((4, 64)).astype(np.float32),
                                                                gguf.GGMLQuantizationType.Q8_0),
                      raw_dtype=gguf.GGMLQuantizationType.Q8_0)
    writer.add_tensor("output_norm.weight", rng.standard_normal(64).astype(np.float32))
    writer.add_tensor("blk.0.attn_q.weight", rng.standard_normal((8, 64)).astype(np.float16))
    writer.write_header_to_file()
    writer.write_kv_data_to_file()
    writer.write_tensors_to_file()
    writer.close()
    return path


@pytest.mark.parametrize("alignment", [None, 64])
def test_the_header_matches_gguf_reader(tmp_path, alignment):
    path = write_file(tmp_path / "m.gguf", alignment)
    header = read_gguf_header(path, arrays=("tokenizer.ggml.tokens",))
    reader = gguf.GGUFReader(str(path))
    assert header.metadata["general.architecture"] == "qwen2"
    assert header.metadata["qwen2.block_count"] == 2
    assert header.metadata["qwen2.rope.freq_base"] == pytest.approx(1e6)
    assert header.metadata["tokenizer.ggml.add_bos_token"] is False
    assert header.metadata["tokenizer.ggml.tokens"] == ["a", "bc", "", "d" * 300]
    assert "tokenizer.ggml.token_type" not in header.metadata  # arrays skipped unless asked
    assert list(header.tensors) == [t.name for t in reader.tensors]
    for tensor in reader.tensors:
        mine = header.tensors[tensor.name]
        assert mine.tensor_type == tensor.tensor_type
        assert list(mine.dims) == list(tensor.shape)
        assert (mine.data_offset, mine.n_bytes) == (tensor.data_offset, tensor.n_bytes)
        assert mine.data.dtype == tensor.data.dtype and mine.data.shape == tensor.data.shape
        assert np.array_equal(mine.data, tensor.data)


def test_bad_files_say_what_is_wrong(tmp_path):
    path = write_file(tmp_path / "m.gguf")
    data = path.read_bytes()
    (tmp_path / "short.gguf").write_bytes(data[:-10])
    with pytest.raises(EyasError, match="truncated"):
        read_gguf_header(tmp_path / "short.gguf")
    (tmp_path / "cut.gguf").write_bytes(data[:60])
    with pytest.raises(EyasError, match="not a readable GGUF"):
        read_gguf_header(tmp_path / "cut.gguf")
    (tmp_path / "text.gguf").write_bytes(b"hello world, not a model at all")
    with pytest.raises(EyasError, match="no 'GGUF' magic"):
        read_gguf_header(tmp_path / "text.gguf")
    (tmp_path / "empty.gguf").write_bytes(b"")
    with pytest.raises(EyasError, match="not a readable GGUF"):
        read_gguf_header(tmp_path / "empty.gguf")
