"""An untied GGUF embedding read row by row equals the whole-table load, for every GGUF type."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from random_checkpoints import write_gguf

from eyas.models.gguf_loader import GGUFSource
from eyas.models.source_embedding import SourceEmbedding


@pytest.mark.parametrize("kind", ["Q8_0", "Q4_1", "Q5_0", "F16", "F32", "BF16"])
def test_rows_equal_the_dequantized_table(tmp_path, kind):
    table = np.random.default_rng(3).standard_normal((40, 64)).astype(np.float32)
    path = write_gguf(tmp_path / "e.gguf", {"token_embd.weight": (table, kind)})
    source = GGUFSource(path)
    full = source.get("model.embed_tokens.weight")  # [V, H] float32, the whole-table path
    embed = SourceEmbedding(source.tensors["model.embed_tokens.weight"])
    assert (embed.num_embeddings, embed.embedding_dim) == (40, 64)
    ids = torch.tensor([[3, 0, 39, 3], [7, 7, 1, 2]])
    assert torch.equal(embed(ids), full[ids])
    assert embed._table is None  # the lookup built no table
    assert torch.equal(embed.weight, full)  # the whole table, on demand
    assert torch.equal(embed(ids), full[ids])
    with pytest.raises(IndexError, match="out of range"):
        SourceEmbedding(source.tensors["model.embed_tokens.weight"])(torch.tensor([40]))
