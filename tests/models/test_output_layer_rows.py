"""The output layer's int8 rows, computed a block of rows at a time, equal the whole-matrix
computation bit for bit (each row depends on itself alone)."""

import torch

from eyas.models.output_layer import _int8_rows


def test_int8_rows_by_blocks_equal_the_whole_matrix():
    torch.manual_seed(0)
    weight = torch.randn(3001, 96) * 0.1  # [V, H]
    weight[7] = 0  # an all-zero row: the scale's floor
    scale = (weight.abs().amax(dim=1) / 127).clamp(min=1e-12).to(torch.bfloat16)
    codes = (weight / scale.float()[:, None]).round().clamp(-127, 127).to(torch.int8)
    approx = codes.float() * scale.float()[:, None]
    whole = (codes, scale, (weight - approx).norm(dim=1), approx.norm(dim=1))
    for rows_per_chunk in (8192, 1000, 7):
        got_all = _int8_rows(lambda start, stop: weight[start:stop], weight.shape[0], rows_per_chunk)
        for expected, got in zip(whole, got_all):
            assert torch.equal(expected, got)


def test_a_row_source_output_layer_gives_the_float_layers_argmax_and_logits(tmp_path):
    """An output layer read from GGUF rows (no float copy) screens as the float one does: the
    same argmax on every row, exact logits when every one is asked for, and its screen buffers
    round-trip (what the int4 cache keeps)."""
    import numpy as np
    from random_checkpoints import write_gguf

    from eyas.models.gguf_loader import GGUFSource
    from eyas.models.output_layer import ScreenedOutputLayer
    from eyas.models.source_embedding import SourceEmbedding

    table = np.random.default_rng(5).standard_normal((512, 64)).astype(np.float32)
    source = GGUFSource(write_gguf(tmp_path / "o.gguf", {"output.weight": (table, "Q8_0")}))
    full = source.get("lm_head.weight")  # [V, H] float32
    linear = torch.nn.Linear(64, 512, bias=False)
    linear.weight.data = full.clone()
    reference = ScreenedOutputLayer(linear)
    lean = ScreenedOutputLayer(SourceEmbedding(source.tensors["lm_head.weight"]))
    assert lean.weight is None and lean.row_source._table is None
    x = torch.randn(9, 64)
    x[3] = x[2]  # a repeated row
    expected = (x @ full.t()).argmax(dim=1)
    assert torch.equal(lean.greedy_logits(x).argmax(dim=1), expected)
    assert torch.equal(reference.greedy_logits(x).argmax(dim=1), expected)
    assert lean.row_source._table is None  # greedy read only the candidates' rows
    again = ScreenedOutputLayer(SourceEmbedding(source.tensors["lm_head.weight"]), screen=lean.screen_buffers())
    for name, tensor in lean.screen_buffers().items():
        assert torch.equal(getattr(again, name), tensor), name
    assert torch.equal(again.greedy_logits(x).argmax(dim=1), expected)
    torch.testing.assert_close(lean(x), x @ full.t())  # every logit: the table, made on demand


def test_a_row_source_output_layer_draws_as_the_full_logits_without_a_float_table(tmp_path):
    """A sampled row through an output layer read from GGUF rows is the Gumbel draw over every
    float32 logit (the screen's candidates re-checked from their own rows), and no float table
    is built for it (a 1.5B model's is 0.93 GB)."""
    import numpy as np
    from random_checkpoints import write_gguf

    from eyas.engine import gumbel
    from eyas.models.gguf_loader import GGUFSource
    from eyas.models.output_layer import ScreenedOutputLayer
    from eyas.models.source_embedding import SourceEmbedding

    if not gumbel.available():
        import pytest

        pytest.skip("the C++ extension is not built here")
    table = np.random.default_rng(6).standard_normal((512, 64)).astype(np.float32) * 0.5
    source = GGUFSource(write_gguf(tmp_path / "o.gguf", {"output.weight": (table, "Q8_0")}))
    full = source.get("lm_head.weight")  # [V, H] float32
    lean = ScreenedOutputLayer(SourceEmbedding(source.tensors["lm_head.weight"]))
    x = torch.randn(300, 64, generator=torch.Generator().manual_seed(7))
    for temperature in (0.5, 1.0):
        scales = torch.full((300,), gumbel.inverse_temperature(temperature))
        keys = torch.tensor([gumbel.noise_key(99, position) for position in range(300)])
        drawn = lean.sample_tokens(x, scales, keys)
        assert torch.equal(drawn, gumbel.gumbel_argmax(x @ full.t(), scales, keys))
        assert len(set(drawn.tolist())) > 50  # draws, not one argmax
    assert lean.row_source._table is None
