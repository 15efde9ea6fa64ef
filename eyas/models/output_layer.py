"""`ScreenedOutputLayer`: the float32 output layer, and an exact greedy argmax at int8 cost.

Why: SmolLM2's output layer (49152 x 576) is the widest matmul of the model. In float32 it
reads 113 MB per pass: 2.7 ms of an 18 ms int4 decoding step, and more for a verification
pass over several tokens. Greedy decoding needs only each row's argmax, and that can be
found exactly without computing every logit exactly:

1. an int8 copy of the weights (one scale per vocabulary row) gives approximate logits at a
   quarter of the bytes;
2. a rigorous bound on each approximate logit's error (weight rounding, bf16 rounding of the
   input, float32 accumulation, bf16 rounding of the output) turns each into an interval;
3. only the logits whose interval reaches the best lower bound can be the argmax: they are
   computed exactly in float32 (typically a handful of 49,152), each from its own row alone.

The returned row holds the float32 logit at every candidate and the approximate value
elsewhere, which is strictly below the exact maximum: its argmax (first index among equal
maxima included) is the argmax of the float32 logits. Nothing else may be read from it, so
sampling from full probabilities (top-k, top-p, processors) uses the plain float32 product
(`forward`); plain-temperature sampling draws through the same screen (`sample_tokens`, the
Gumbel-max trick: engine/gumbel.py). A candidate's
float32 logit is its own dot product; a matmul over all rows may round it differently in the
last bit (as matmuls over different row counts already do), which can only matter at a tie
within ~1e-6.

Each row's candidates and their exact values depend on that row alone, so a row's argmax is
the same whichever rows share its pass (a float32 matmul's rounding depends on the row count).

Two screens compute steps 1 and 2: where the extension has integer dot products (AVX512-VNNI
or AVX2, models/extension.py int8dot_kernel), the extension's (csrc/int8_screen.cpp: 8-bit
integer activations with a power-of-two step per 32 inputs, or 14-bit ones per row with
EYAS_SCREEN_ACTIVATIONS=14 (twice the integer work, fewer candidates), integer dot products, the bound computed beside each logit in the same
pass, and step 3 in the same call: no pass over [R, V] in PyTorch); elsewhere PyTorch's int8
kernel on bf16 activations, with the bound below and step 3 in PyTorch. An output layer read
row by row from its checkpoint (a row source) takes its candidates from the extension
(`int8_screen_candidates`) and computes their exact logits from their own rows. Both bounds are
rigorous, so the argmax is the same either way; only the number of candidates differs.

Memory: the float32 weight is held once, as rows [V, H] (shared with a tied embedding). A
transposed copy [H, V] for `forward` (models/cpu_linear.py: 16% faster at one token on
SmolLM2's output layer) is added only while it is small (TRANSPOSED_MAX_BYTES): a 1.5B Qwen's
untied output layer is 933 MB, and a second copy would cost more memory than its int4 decoder.

Usage:
    layer = ScreenedOutputLayer(model.lm_head, rows=model.embed_tokens.weight)
    logits = layer(hidden)                  # [..., V] exact float32 (sampling)
    argmax_ok = layer.greedy_logits(hidden)  # [..., V] whose argmax is exact (greedy)
    tokens = layer.sample_tokens(hidden, inverse_temperatures, keys)  # [R] exact samples
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor, nn

from eyas.models import extension
from eyas.models.quant import row_chunks

BF16_UNIT = 2.0 ** -8  # unit roundoff of bfloat16 (8 significant bits)
F32_UNIT = 2.0 ** -24
SAFETY = 1.01  # the bound is rigorous; this covers the rounding of computing the bound itself
TRANSPOSED_MAX_BYTES = 256 << 20  # a transposed float32 copy for `forward` up to this size


class ScreenedOutputLayer(nn.Module):
    def __init__(self, layer: nn.Module, rows: Tensor | None = None,
                 screen: dict[str, Tensor] | None = None) -> None:
        """layer: an nn.Linear (weight [V, H]), a TransposedLinear (weight_t [H, V]), or a row
        source (models/source_embedding.py: the checkpoint's own quantized rows, dequantized
        when read; then no float copy is held until `forward` first needs every logit). rows:
        the same weight as [V, H], when the model holds it anyway (a tied input embedding).
        screen: the screen's buffers as `screen_buffers` gave them (the int4 cache), instead of
        computing them. Candidates' exact logits read whole rows (a column gather from [H, V]
        costs ~50x more)."""
        super().__init__()
        self.row_source = layer if hasattr(layer, "rows") else None
        if self.row_source is not None:
            weight = None
            shape = (layer.num_embeddings, layer.embedding_dim)
            chunk = lambda start, stop: torch.from_numpy(layer.rows(np.arange(start, stop)))  # noqa: E731
        else:
            if rows is None:
                rows = layer.weight_t.t().contiguous() if hasattr(layer, "weight_t") else layer.weight
            weight = rows.detach().float()  # [V, H]
            shape = tuple((layer.weight_t.t() if hasattr(layer, "weight_t") else layer.weight).shape)
            if tuple(weight.shape) != shape:
                raise ValueError(f"rows {tuple(weight.shape)} do not match the layer's {shape}")
            chunk = lambda start, stop: weight[start:stop]  # noqa: E731
        weight_t = None
        if weight is not None and weight.numel() * 4 <= TRANSPOSED_MAX_BYTES:
            weight_t = (layer.weight_t.detach().float() if hasattr(layer, "weight_t")
                        else weight.t().contiguous())  # [H, V]
        self.register_buffer("weight_t", weight_t)  # None: `forward` reads the rows
        self.register_buffer("weight", weight)  # [V, H], shared with the embedding when tied
        self.out_features, self.in_features = shape  # [V, H]
        hidden = self.in_features
        self.accumulation = hidden * F32_UNIT / (1 - hidden * F32_UNIT)
        self.int8dot = _int8dot_screen(shape)
        for name, tensor in (screen if screen is not None else self._build_screen(chunk)).items():
            self.register_buffer(name, tensor)

    def _build_screen(self, chunk) -> dict[str, Tensor]:
        """The screen's buffers, from the rows [start, stop) that `chunk` gives."""
        codes, scale, weight_error, approx_norm = _int8_rows(chunk, self.out_features)
        buffers = {"scale": scale,  # [V] bf16
                   "weight_error": weight_error,  # [V] |W_j - A_j|
                   "approx_norm": approx_norm}  # [V] |A_j|
        if self.int8dot:  # the packed copy replaces the codes
            buffers["packed"] = extension.module().int8_screen_pack(codes)
            buffers["code_sums"] = codes.sum(dim=1, dtype=torch.int32)  # [V]
            buffers["scale_float"] = scale.float()  # [V]
        else:
            buffers["codes"] = codes  # [V, H]
        return buffers

    def screen_buffers(self) -> dict[str, Tensor]:
        """What `screen=` takes back: every buffer but the float weights."""
        return {name: tensor for name, tensor in self.named_buffers()
                if name not in ("weight", "weight_t")}

    @property
    def reads_rows(self) -> bool:
        """Whether the layer reads its weight rows from the checkpoint one by one (a lean row
        source, its float32 table never built): the exact re-checks read only their rows."""
        return self.row_source is not None and not self.row_source.has_table

    def full_weight(self) -> Tensor:
        """The float32 weight [V, H] (a row source dequantizes it on first use and keeps it)."""
        return self.weight if self.row_source is None else self.row_source.weight

    def forward(self, x: Tensor) -> Tensor:  # [..., H] -> [..., V], every logit exact
        if self.weight_t is None:
            return nn.functional.linear(x, self.full_weight())
        return x @ self.weight_t

    def greedy_logits(self, x: Tensor) -> Tensor:  # [..., H] -> [..., V], exact argmax only
        shape = x.shape
        flat = x.reshape(-1, shape[-1]).float()  # [R, H]
        if flat.shape[0] == 0:
            return flat.new_zeros(*shape[:-1], self.out_features)
        if self.int8dot and not self.reads_rows:  # steps 1-3 in one C++ call (csrc/int8_screen.cpp)
            approx = torch.ops.eyas.int8_screen_greedy(flat, self.packed, self.scale_float, self.code_sums,
                                                       self.weight_error, self.approx_norm,
                                                       self.full_weight())
            return approx.reshape(*shape[:-1], self.out_features)
        if self.int8dot:  # steps 1-2 and the candidates in one C++ call; their rows read here
            approx, rows, columns = torch.ops.eyas.int8_screen_candidates(
                flat, self.packed, self.scale_float, self.code_sums, self.weight_error, self.approx_norm)
        else:
            approx, bound = self.screen(flat)  # [R, V] each
            best_lower = (approx - bound).amax(dim=1, keepdim=True)  # [R, 1]
            rows, columns = (approx + bound >= best_lower).nonzero(as_tuple=True)  # the candidates [P]
        approx[rows, columns] = self._exact(flat, rows, columns)
        return approx.reshape(*shape[:-1], self.out_features)

    def greedy_tokens(self, x: Tensor) -> list[int]:  # [..., H] -> each row's argmax, Python ints
        """argmax(greedy_logits(x)) per row, the first of equal maxima: in one C++ call that
        returns only the indices where the extension screens with the full float32 table (no
        [R, V] logits for a caller to read after a pass, when every small op runs cold)."""
        if self.int8dot and not self.reads_rows:
            return extension.module().int8_screen_argmax(x, self.packed, self.scale_float, self.code_sums,
                                                         self.weight_error, self.approx_norm, self.full_weight())
        return self.greedy_logits(x).argmax(dim=-1).reshape(-1).tolist()

    def _exact(self, flat: Tensor, rows: Tensor, columns: Tensor) -> Tensor:
        """The float32 logits of the pairs (rows [P] of flat [R, H], columns [P]) -> [P], each
        from its own weight row (a lean row source dequantizes only those rows)."""
        if self.reads_rows:
            unique, inverse = torch.unique(columns, return_inverse=True)
            weights = torch.from_numpy(self.row_source.rows(unique.numpy()))[inverse]  # [P, H]
        else:
            weights = self.full_weight()[columns]
        return (flat[rows] * weights).sum(dim=1)  # [P], row by row

    def sample_tokens(self, x: Tensor, inverse_temperatures: Tensor, keys: Tensor,
                      noise_ids: Tensor | None = None) -> Tensor:
        """One exact sample of softmax(logits / T) per row of x [R, H] -> [R] int64, by the
        Gumbel-max trick over the screen (engine/gumbel.py, csrc/gumbel_screen.cpp):
        inverse_temperatures [R] float32 (1/T), keys [R] int64 (each row's noise). noise_ids
        [V] int64: the layer's row j draws with the noise of token id noise_ids[j] (a subset
        of a vocabulary drawing as the whole would: DraftVocabulary); the result is the index
        of a row of this layer either way."""
        flat = x.reshape(-1, x.shape[-1]).float()  # [R, H]
        scales = inverse_temperatures.float()  # [R]
        if not self.int8dot:  # PyTorch's screen: the full product
            from eyas.engine.gumbel import gumbel_argmax

            return gumbel_argmax(self(flat), scales, keys, noise_ids)
        if not self.reads_rows and noise_ids is None:  # steps 1-3 in one C++ call
            tokens, _ = torch.ops.eyas.int8_screen_gumbel(flat, self.packed, self.scale_float, self.code_sums,
                                                          self.weight_error, self.approx_norm, self.full_weight(),
                                                          scales, keys)
            return tokens
        # the screen and its candidates in one C++ call; their exact values from their own rows
        ids = noise_ids if noise_ids is not None else torch.empty(0, dtype=torch.int64)
        rows, columns, noise = torch.ops.eyas.int8_screen_gumbel_candidates(
            flat, self.packed, self.scale_float, self.code_sums, self.weight_error, self.approx_norm,
            scales, keys, ids)  # [P] each, by row then column
        values = self._exact(flat, rows, columns) * scales[rows] + noise  # fl(fl(l * (1/T)) + g)
        return first_argmax(values, rows, columns, flat.shape[0], self.out_features)

    def sample_token_ids(self, x: Tensor, inverse_temperatures: list[float], keys: list[int]) -> list[int]:
        """`sample_tokens` for x [..., H] (R rows) with each row's 1/T (float32 values) and
        noise key as Python numbers, the draws as Python ints: in one C++ call where the
        extension screens with the full float32 table (no small PyTorch ops after a pass)."""
        if self.int8dot and not self.reads_rows:
            return extension.module().int8_screen_gumbel_ids(x, self.packed, self.scale_float, self.code_sums,
                                                             self.weight_error, self.approx_norm,
                                                             self.full_weight(), inverse_temperatures, keys)
        flat = x.reshape(-1, x.shape[-1])
        return self.sample_tokens(flat, torch.tensor(inverse_temperatures, dtype=torch.float32),
                                  torch.tensor(keys, dtype=torch.int64)).tolist()

    def screen(self, x: Tensor) -> tuple[Tensor, Tensor]:
        """x [R, H] float32 -> (approximate logits, bound on their error) [R, V] each."""
        if self.int8dot:
            return extension.module().int8_screen(x, self.packed, self.scale_float, self.code_sums,
                                                     self.weight_error, self.approx_norm)
        rounded = x.to(torch.bfloat16)
        approx = torch.cat([torch._weight_int8pack_mm(part, self.codes, self.scale)
                            for part in rounded.split(row_chunks(x.shape[0]))]).float()  # [R, V]
        return approx, self.error_bound(x, rounded, approx)

    def error_bound(self, x: Tensor, rounded: Tensor, approx: Tensor) -> Tensor:
        """|exact logit - approximate logit| <= the returned [R, V], for inputs x [R, H], of
        PyTorch's int8 kernel (the extension's screen computes its own).

        exact - approx = x.(W - A) + (x - bf16(x)).A + float32 accumulation + bf16 output:
        Cauchy-Schwarz on the first two, the standard n*u bound on the third, and the unit
        roundoff of bfloat16 on the last (relative to the output itself).
        """
        x_norm = x.norm(dim=1, keepdim=True)  # [R, 1]
        input_error = (x - rounded.float()).norm(dim=1, keepdim=True)
        accumulated = self.accumulation * rounded.float().norm(dim=1, keepdim=True)
        bound = x_norm * self.weight_error + (input_error + accumulated) * self.approx_norm
        bound += approx.abs() * (BF16_UNIT / (1 - BF16_UNIT))
        return bound * SAFETY + 1e-6


def first_argmax(values: Tensor, rows: Tensor, columns: Tensor, count: int, width: int) -> Tensor:
    """Each row's column of largest value, the first among equal maxima: values, rows, columns
    [P] (every row among 0..count-1 present at least once) -> [count] int64."""
    best = torch.full((count,), float("-inf")).scatter_reduce(0, rows, values, "amax")  # [count]
    at_best = values == best[rows]
    first = torch.full((count,), width, dtype=torch.int64)
    return first.scatter_reduce(0, rows[at_best], columns[at_best], "amin")


def _int8_rows(chunk, vocab: int, rows_per_chunk: int = 8192
               ) -> tuple[Tensor, Tensor, Tensor, Tensor]:
    """The rows of a [V, H] weight (`chunk(start, stop)` gives rows [start, stop) as float32) ->
    int8 codes [V, H], bf16 scale [V], |W_j - A_j| [V] and |A_j| [V], where A = codes * scale is
    what the int8 kernels multiply by. Computed a block of rows at a time: each row's values
    depend on that row alone, and the temporaries stay a block's size (whole, they were three
    float32 copies of the output layer: ~2.8 GB for a 152k x 1536 one)."""
    codes = scale = None
    weight_error, approx_norm = torch.empty(vocab), torch.empty(vocab)
    for start in range(0, vocab, rows_per_chunk):
        rows = slice(start, min(start + rows_per_chunk, vocab))
        part = chunk(rows.start, rows.stop).float()
        if codes is None:
            codes = torch.empty(vocab, part.shape[1], dtype=torch.int8)
            scale = torch.empty(vocab, dtype=torch.bfloat16)
        scale[rows] = (part.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16)
        codes[rows] = (part / scale[rows].float()[:, None]).round().clamp(-127, 127).to(torch.int8)
        approx = codes[rows].float() * scale[rows].float()[:, None]
        weight_error[rows] = (part - approx).norm(dim=1)
        approx_norm[rows] = approx.norm(dim=1)
    return codes, scale, weight_error, approx_norm


def _int8dot_screen(shape: torch.Size) -> bool:
    """Whether the extension's screen can take a [V, H] output layer here."""
    vocab, hidden = shape
    return vocab % 16 == 0 and hidden % 4 == 0 and hidden <= 2048 and extension.int8dot_kernel() is not None
