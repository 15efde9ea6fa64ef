"""The int4 target's fused stack (models/fused_cpu.py FusedStack, csrc/int4_decoder_layer.cpp
Int4Stack): one C++ call for every layer gives the bits of one call per layer, and in a pass
over a random draft tree of T = 2..64 rows each row gets the bits of the same row run alone
(the property that keeps speculation lossless), on each int8 dot-product implementation."""

import contextlib
import shutil
import time

import pytest
import torch

from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.tree import node_depths, tree_mask
from eyas.models import extension, fused_cpu
from eyas.models.kv_cache import KVCache
from eyas.models.quant import int4_available

pytestmark = [
    pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this PyTorch"),
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                       reason="no C++ compiler to build the fused layer"),
]

CONTEXT = torch.tensor([[1, 504, 3458, 314, 253, 1789, 28, 6120, 30, 260, 2114, 5549] * 5])  # [1, 60]


@contextlib.contextmanager
def kernel(name):
    """Runs the block on int8 dot-product implementation `name`, then restores the one in use."""
    if extension.int8dot_kernel() is None:
        pytest.skip("no int8 dot-product kernel here")
    ext = extension.module()
    if name not in ext.int8dot_kernels():
        pytest.skip(f"this CPU's build has no {name} kernel")
    before = ext.int8dot_kernel()
    ext.set_int8dot_kernel(name)
    try:
        yield
    finally:
        ext.set_int8dot_kernel(before)


def new_cache(target, slots=160):
    config = target.config
    return KVCache(config.num_hidden_layers, 1, config.num_key_value_heads, slots, config.head_dim,
                   dtype=target.kv_dtype)


def random_tree(size: int, context: int, seed: int) -> tuple[torch.Tensor, torch.Tensor]:
    """A tree of `size` nodes after `context` tokens: node 0 the root, each later node a child
    of an earlier one. Returns positions [1, T] and the mask [1, T, context + T]."""
    generator = torch.Generator().manual_seed(seed)
    parents = torch.tensor([int(torch.randint(0, i, (1,), generator=generator)) for i in range(1, size)],
                           dtype=torch.long)
    tree = DraftTree(torch.zeros(size - 1, dtype=torch.long), parents)
    mask = torch.cat([torch.ones(size, context, dtype=torch.bool), tree_mask(tree)], dim=1)
    return torch.tensor([[0] + node_depths(tree)]) + context, mask[None]


def test_the_stack_in_one_call_gives_the_bits_of_one_call_per_layer(smollm_int4_target):
    model = smollm_int4_target.model
    stack = model.fused_layers()
    assert isinstance(stack, fused_cpu.FusedStack) and len(stack) == 30
    positions, mask = random_tree(9, CONTEXT.shape[1], seed=0)
    with torch.inference_mode():
        caches = [new_cache(smollm_int4_target) for _ in range(2)]
        for cache in caches:
            model(CONTEXT, cache=cache, write_at=0, logits_at=None)
        ids = torch.randint(0, 49152, (1, 9), generator=torch.Generator().manual_seed(1))
        x = model.embed_tokens(ids).reshape(9, -1).contiguous()
        cos_table, sin_table = model.rope_tables(int(positions.max()) + 1)
        cos, sin = cos_table[positions].reshape(9, -1), sin_table[positions].reshape(9, -1)
        slots = torch.arange(60, 69)[None]
        together = stack.run(x, cos, sin, caches[0], list(range(30)), slots, 69, mask)
        apart = x
        for index in range(30):
            keys, values = caches[1].layer_tensors(index)
            apart = fused_cpu.run_layer(stack[index], apart, cos, sin, keys, values, slots, 69, mask)
    assert torch.equal(together, apart)
    assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)


@pytest.mark.parametrize("name", ["avx512vnni", "avx2"])
@pytest.mark.parametrize("size", [2, 9, 33, 64])
def test_each_row_of_a_random_tree_gets_the_bits_of_the_row_alone(smollm_int4_target, name, size):
    """A pass over T tree rows, then each row again alone (a one-token pass that sees the same
    keys and values): the hidden states must be equal bit for bit, and so must the keys and
    values each pass wrote."""
    model = smollm_int4_target.model
    context = CONTEXT.shape[1]
    positions, mask = random_tree(size, context, seed=size)
    ids = torch.randint(0, 49152, (1, size), generator=torch.Generator().manual_seed(size))
    with kernel(name), torch.inference_mode():
        cache = new_cache(smollm_int4_target)
        model(CONTEXT, cache=cache, write_at=0, logits_at=None)
        tree = model(ids, positions=positions, cache=cache, write_at=context, attn_mask=mask,
                     kv_len=context + size, logits_at=None).hidden[0]  # [T, H]
        written = cache.keys[:, :, :, : context + size].clone()
        alone = torch.stack([
            model(ids[:, row: row + 1], positions=positions[:, row: row + 1], cache=cache,
                  write_at=torch.tensor([[context + row]]), attn_mask=mask[:, row: row + 1],
                  kv_len=context + size, logits_at=None).hidden[0, 0]
            for row in range(size)])
    assert torch.equal(cache.keys[:, :, :, : context + size], written)
    mismatched = [row for row in range(size) if not torch.equal(tree[row], alone[row])]
    assert not mismatched, f"rows {mismatched} of {size} differ from the row alone"


def test_phase_timers_change_no_bit_and_cover_the_call(smollm_int4_target):
    """The stack's per-phase timers (csrc/phase_timer.h): a pass timed gives the bits of a pass
    untimed, every phase of a layer is charged, and the phases add up to the call's wall time."""
    model = smollm_int4_target.model
    stack = model.fused_layers()
    ext = extension.module()
    positions, mask = random_tree(9, CONTEXT.shape[1], seed=3)
    ids = torch.randint(0, 49152, (1, 9), generator=torch.Generator().manual_seed(3))
    results, seconds = [], {}
    with torch.inference_mode():
        for timing in (False, True):
            cache = new_cache(smollm_int4_target)
            model(CONTEXT, cache=cache, write_at=0, logits_at=None)
            x = model.embed_tokens(ids).reshape(9, -1).contiguous()
            cos_table, sin_table = model.rope_tables(int(positions.max()) + 1)
            cos, sin = cos_table[positions].reshape(9, -1), sin_table[positions].reshape(9, -1)
            ext.phase_seconds(reset=True)
            ext.set_phase_timing(timing)
            try:
                started = time.perf_counter()
                out = stack.run(x, cos, sin, cache, list(range(30)), torch.arange(60, 69)[None], 69, mask)
                wall = time.perf_counter() - started
            finally:
                ext.set_phase_timing(False)
            seconds[timing] = ext.phase_seconds(reset=True)
            results.append((out, cache.keys.clone(), cache.values.clone()))
    assert all(torch.equal(a, b) for a, b in zip(*results))
    assert set(seconds[False].values()) == {0.0}  # nothing charged with the timers off
    timed = seconds[True]
    for phase in ("qkv", "o", "gate_up", "down", "quantize", "attention", "norms", "rotary", "silu_mul",
                  "stack_other"):
        assert timed[phase] > 0, phase
    # the residuals run where o and down finish their columns: their own phase on one thread only
    assert (timed["residuals"] > 0) == (torch.get_num_threads() == 1)
    if torch.get_num_threads() == 1:  # with more, the caller waits only for chunks a worker claimed
        assert timed["sync"] == 0
    # the matmuls are most of the work (waits aside: a loaded machine can leave a thread waiting long)
    assert timed["qkv"] + timed["o"] + timed["gate_up"] + timed["down"] > 0.3 * (wall - timed["sync"])
    assert 0.8 * wall < sum(timed.values()) <= wall


def test_the_stack_gives_the_same_bits_on_one_thread_and_on_two(smollm_int4_target):
    """The worker pool (csrc/worker_pool.h) cuts a region into chunks by whichever thread claims
    them first: a pass over a tree must give the same hidden states and cache on 1, 2 and 3
    threads, with either way of handing out a region (segments per thread, or chunks in turn)."""
    ext = extension.module()
    model = smollm_int4_target.model
    stack = model.fused_layers()
    positions, mask = random_tree(33, CONTEXT.shape[1], seed=5)
    ids = torch.randint(0, 49152, (1, 33), generator=torch.Generator().manual_seed(5))
    threads = torch.get_num_threads()
    results = []
    try:
        with torch.inference_mode():
            for split, count in (("segments", 1), ("segments", 2), ("chunks", 2), ("segments", 3), ("chunks", 1),
                                 ("chunks", 3), ("segments", 2)):
                ext.set_pool_split(split)
                torch.set_num_threads(count)
                cache = new_cache(smollm_int4_target)
                model(CONTEXT, cache=cache, write_at=0, logits_at=None)
                x = model.embed_tokens(ids).reshape(33, -1).contiguous()
                cos_table, sin_table = model.rope_tables(int(positions.max()) + 1)
                cos, sin = cos_table[positions].reshape(33, -1), sin_table[positions].reshape(33, -1)
                out = stack.run(x, cos, sin, cache, list(range(30)), torch.arange(60, 93)[None], 93, mask)
                results.append((out, cache.keys.clone(), cache.values.clone()))
    finally:
        torch.set_num_threads(threads)
        ext.set_pool_split("segments")
    for result in results[1:]:
        assert all(torch.equal(a, b) for a, b in zip(results[0], result))
