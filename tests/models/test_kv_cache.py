"""KV cache: slot writes, compaction, row copies; decoding over a compacted cache is exact."""

from __future__ import annotations

import torch

from eyas.engine.generate import new_cache
from eyas.models.kv_cache import KVCache


def make_cache(batch=2, slots=8) -> KVCache:
    return KVCache(num_layers=2, batch_size=batch, num_kv_heads=1, max_slots=slots, head_dim=2)


def test_int_start_write_and_read():
    cache = make_cache()
    k = torch.arange(2 * 1 * 3 * 2, dtype=torch.float32).view(2, 1, 3, 2)
    cache.write(1, 2, k, -k)
    keys, values = cache.read(1, 5)
    assert torch.equal(keys[:, :, 2:5], k)
    assert torch.equal(values[:, :, 2:5], -k)
    assert torch.count_nonzero(keys[:, :, :2]) == 0
    assert torch.count_nonzero(cache.keys[0]) == 0  # other layers untouched


def test_scattered_slot_write_per_row():
    cache = make_cache()
    k = torch.tensor([[[[1.0, 1.0], [2.0, 2.0]]], [[[3.0, 3.0], [4.0, 4.0]]]])  # [B=2, KV=1, T=2, D=2]
    slots = torch.tensor([[5, 1], [0, 7]])
    cache.write(0, slots, k, k)
    assert cache.keys[0, 0, 0, 5].tolist() == [1.0, 1.0]
    assert cache.keys[0, 0, 0, 1].tolist() == [2.0, 2.0]
    assert cache.keys[0, 1, 0, 0].tolist() == [3.0, 3.0]
    assert cache.keys[0, 1, 0, 7].tolist() == [4.0, 4.0]
    assert torch.count_nonzero(cache.keys[0, 0, 0]) == 4  # two slots x two dims


def test_scattered_slot_write_of_one_row_of_a_pool_view():
    """One row (the serving engine at concurrency 1) takes index_copy_; a view of a larger
    pool writes through to the pool."""
    pool = make_cache(batch=3)
    row = KVCache.__new__(KVCache)
    row.keys, row.values, row.max_slots = pool.keys[:, 1:2], pool.values[:, 1:2], pool.max_slots
    k = torch.tensor([[[[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]]])  # [B=1, KV=1, T=3, D=2]
    row.write(1, torch.tensor([[6, 0, 3]]), k, -k)
    assert pool.keys[1, 1, 0, [6, 0, 3]].tolist() == [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]]
    assert pool.values[1, 1, 0, [6, 0, 3]].tolist() == [[-1.0, -2.0], [-3.0, -4.0], [-5.0, -6.0]]
    assert torch.count_nonzero(pool.keys) == 6  # nothing else was written, in any row or layer


def test_compact_moves_kept_slots_down_in_order_on_every_layer():
    cache = make_cache(batch=1)
    for layer in range(2):
        values = torch.arange(8, dtype=torch.float32).view(1, 1, 8, 1).expand(1, 1, 8, 2) + 10 * layer
        cache.write(layer, 0, values, values)
    cache.compact(0, [3, 6, 7], start=3)  # keep slots 3, 6, 7 as 3, 4, 5
    for layer in range(2):
        assert cache.keys[layer, 0, 0, :6, 0].tolist() == [x + 10 * layer for x in [0, 1, 2, 3, 6, 7]]
        assert cache.values[layer, 0, 0, :6, 0].tolist() == [x + 10 * layer for x in [0, 1, 2, 3, 6, 7]]
    before = cache.keys.clone()
    cache.compact(0, [3, 4, 5], start=3)  # an accepted chain: already in place, nothing moves
    cache.compact(0, torch.tensor([3, 4]), start=3)
    assert torch.equal(cache.keys, before)


def test_overflow_is_an_error():
    cache = make_cache(slots=4)
    try:
        cache.write(0, 3, torch.zeros(2, 1, 2, 2), torch.zeros(2, 1, 2, 2))
    except IndexError as error:
        assert "overflow" in str(error)
    else:
        raise AssertionError("writing past the last slot must fail")


@torch.inference_mode()
def test_decoding_after_compaction_equals_decoding_without_speculation(tiny_target):
    """Write junk 'draft' entries into scratch slots, keep some by compaction, then decode:
    the logits equal those of a cache that only ever saw the accepted tokens."""
    model = tiny_target.model
    generator = torch.Generator().manual_seed(3)
    prompt = torch.randint(3, 1000, (1, 10), generator=generator)
    accepted = torch.randint(3, 1000, (1, 2), generator=generator)
    following = torch.randint(3, 1000, (1, 1), generator=generator)
    # Reference: plain cache with prompt + accepted, then the next token.
    plain = new_cache(tiny_target, 1, 32)
    model(prompt, cache=plain, write_at=0)
    model(accepted, cache=plain, write_at=10)
    expected = model(following, cache=plain, write_at=12).logits
    # Speculative: prompt, then 4 draft tokens at slots 10..13 where the accepted tokens sit at
    # draft positions 1 and 3 (a tree: both are children along one path), others rejected.
    spec = new_cache(tiny_target, 1, 32)
    model(prompt, cache=spec, write_at=0)
    junk = torch.randint(3, 1000, (1, 1), generator=generator)
    drafts = torch.cat([junk, accepted[:, :1], junk, accepted[:, 1:]], dim=1)  # [1, 4]
    positions = torch.tensor([[10, 10, 11, 11]])
    mask = torch.zeros(1, 4, 14, dtype=torch.bool)
    mask[:, :, :10] = True
    mask[0, 0, 10] = mask[0, 1, 11] = True  # two roots
    mask[0, 2, [10, 12]] = True  # child of the junk root
    mask[0, 3, [11, 13]] = True  # child of the accepted root
    model(drafts, positions, cache=spec, write_at=10, attn_mask=mask, kv_len=14)
    spec.compact(0, [11, 13], start=10)
    got = model(following, cache=spec, write_at=12).logits
    assert torch.allclose(got, expected, atol=1e-5)
    assert torch.allclose(spec.keys[:, :, :, :13], plain.keys[:, :, :, :13], atol=1e-6)
