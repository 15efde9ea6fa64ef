"""The features of an int4 target on a CPU come from its fused layer stack: the values that the
serving engine hands an EAGLE-3 head while it drafts."""

from __future__ import annotations

import torch

from eyas.features.target_io import compute_target_features
from eyas.models.kv_cache import KVCache

TAPS = (2, 15, 27)


def test_int4_features_are_the_engine_prefill_taps_bit_for_bit(smollm_int4_target, mtbench_prompt_ids) -> None:
    model = smollm_int4_target.model
    assert model.fused_layers() is not None
    first, second = mtbench_prompt_ids[0], mtbench_prompt_ids[1]
    ids = torch.tensor([first])
    taps, hidden = compute_target_features(model, ids, TAPS)  # [1, T, 3H], [1, T, H]
    config = model.config
    # the engine's prefill: a cache row with room to decode, the prompt written from slot 0
    cache = KVCache(config.num_hidden_layers, 1, config.num_key_value_heads, len(first) + 64,
                    config.head_dim, dtype=model.kv_dtype)
    with torch.no_grad():
        out = model(ids, cache=cache, tap_layers=TAPS, logits_at=None)
    assert taps.shape == (1, len(first), 3 * config.hidden_size)
    assert torch.equal(taps, out.taps) and torch.equal(hidden, out.hidden)
    # a right-padded batch gives each sample its own features (rows never depend on other rows)
    length = max(len(first), len(second))
    batch = torch.tensor([first + [0] * (length - len(first)), second + [0] * (length - len(second))])
    batch_taps, batch_hidden = compute_target_features(model, batch, TAPS)
    alone_taps, _ = compute_target_features(model, torch.tensor([second]), TAPS)
    assert torch.equal(batch_taps[0, : len(first)], taps[0])
    assert torch.equal(batch_taps[1, : len(second)], alone_taps[0])
    assert torch.equal(batch_hidden[0, : len(first)], hidden[0])
