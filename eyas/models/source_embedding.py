"""`SourceEmbedding`: a token embedding read from the checkpoint's own bytes, row by row.

Why: a 1.5B Qwen's embedding is 151,936 x 1,536: 933 MB in float32, more than the whole int4
decoder, yet a decoding step looks up one row of it and a 512-token prefill 512 rows. An int4
target whose embedding is not tied to its output layer therefore keeps the table as the GGUF
holds it (Q4_K: 131 MB, memory-mapped, in the page cache rather than the process's memory) and
dequantizes only the rows looked up, with the same block formula as a whole-table load
(gguf.quants), so every row equals the float32 table's row bit for bit.

`weight` (the whole float32 table) is still there for what needs all of it (an EAGLE-3 head
shares the target's embedding): it is dequantized on first use and kept. `dtype`, `device`,
`num_embeddings` and `embedding_dim` answer without it.

Usage:
    embed = SourceEmbedding.from_gguf(source.tensors["model.embed_tokens.weight"])
    x = embed(torch.tensor([[1, 2, 3]]))     # [1, 3, H] float32
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from eyas.models.gguf_header import GGUFTensor
from eyas.models.gguf_loader import dequantize_data


class SourceEmbedding(nn.Module):
    def __init__(self, tensor: GGUFTensor) -> None:
        super().__init__()
        from gguf import quants

        qtype = tensor.tensor_type
        readable = qtype.name in ("F32", "F16", "BF16") or qtype in quants._type_traits
        if len(tensor.dims) != 2 or not readable:
            raise ValueError(f"{tensor.name}: a {qtype.name} tensor of shape {tensor.dims} is not "
                             f"read row by row")
        self.tensor = tensor
        self.embedding_dim, self.num_embeddings = tensor.dims  # GGUF order: [H, V]
        self.dtype = torch.float32
        self.device = torch.device("cpu")
        self._table: Tensor | None = None

    @classmethod
    def from_gguf(cls, tensor: GGUFTensor) -> SourceEmbedding:
        return cls(tensor)

    def rows(self, ids: np.ndarray) -> np.ndarray:
        """Dequantized rows [N, H] float32 of the token ids [N]."""
        rows = dequantize_data(self.tensor, self.tensor.data[ids])  # read from the map
        return np.ascontiguousarray(rows, dtype=np.float32)

    def forward(self, input_ids: Tensor) -> Tensor:  # [...] -> [..., H]
        if self._table is not None:
            return nn.functional.embedding(input_ids, self._table)
        ids = input_ids.reshape(-1).cpu().numpy()
        if ids.size and (ids.min() < 0 or ids.max() >= self.num_embeddings):
            raise IndexError(f"token id out of range [0, {self.num_embeddings})")
        unique, inverse = np.unique(ids, return_inverse=True)
        rows = torch.from_numpy(self.rows(unique))[torch.from_numpy(inverse)]
        return rows.reshape(*input_ids.shape, self.embedding_dim).to(input_ids.device)

    @property
    def has_table(self) -> bool:
        """Whether the float32 table was built (by `weight`); until then rows come from the file."""
        return self._table is not None

    @property
    def weight(self) -> Tensor:
        """The whole float32 table [V, H], dequantized on first use and kept."""
        if self._table is None:
            chunk = 8192
            table = torch.empty(self.num_embeddings, self.embedding_dim, dtype=torch.float32)
            for start in range(0, self.num_embeddings, chunk):
                ids = np.arange(start, min(start + chunk, self.num_embeddings))
                table[start : start + len(ids)] = torch.from_numpy(self.rows(ids))
            self._table = table
        return self._table

    def extra_repr(self) -> str:
        return (f"{self.num_embeddings}, {self.embedding_dim}, from {self.tensor.tensor_type.name} "
                f"rows of {self.tensor.name}")
