"""The int4 target's fused stack (models/fused_cpu.py FusedStack, csrc/int4_stack.cpp
Int4Stack): one C++ call for every layer gives the bits of one call per layer, and in a pass
over a random draft tree of T = 2..64 rows each row gets the bits of the same row run alone
(the property that keeps speculation lossless), on each int8 dot-product implementation. The
EAGLE-3 taps it copies out in the same call are the bits of calls split at the taps (dense and
ragged passes, skipped layers, float16 and float32 caches), keyed by model layer in the forward."""

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


# ---- taps: the residual stream entering chosen layers, from the same one call ---------------

TINY_LAYERS = 4


@pytest.fixture(scope="module")
def tiny_int4_target(tmp_path_factory, smollm_tokenizer):
    """A random 4-layer int4 model with head dim 64 (the attention's float16 path), fused."""
    from eyas.engine.target import load_target
    from tiny_models import build_tiny_model

    folder = build_tiny_model(tmp_path_factory.mktemp("tiny-int4"), smollm_tokenizer, hidden_size=128,
                              intermediate_size=256, num_attention_heads=2, num_key_value_heads=1,
                              num_hidden_layers=TINY_LAYERS)
    with pytest.MonkeyPatch.context() as patch:  # its int4 conversion stays out of the user's cache
        patch.setenv("EYAS_CACHE", str(tmp_path_factory.mktemp("tiny-int4-cache")))
        target = load_target(str(folder), dtype="int4")
    assert isinstance(target.model.fused_layers(), fused_cpu.FusedStack)
    return target


def prefilled_cache(target, kv: torch.dtype, rows: int, context: int) -> KVCache:
    """A cache of `rows` rows, each holding `context` random tokens of its own."""
    config = target.config
    cache = KVCache(config.num_hidden_layers, rows, config.num_key_value_heads, 48, config.head_dim, dtype=kv)
    ids = torch.randint(0, 49152, (rows, context), generator=torch.Generator().manual_seed(context))
    target.model(ids, cache=cache, write_at=0, logits_at=None)
    return cache


def pass_inputs(model, ids: torch.Tensor, positions: torch.Tensor) -> tuple[torch.Tensor, ...]:
    """x [N, H] and cos, sin [N, D] of tokens ids, positions [B, T] (N = B * T)."""
    cos_table, sin_table = model.rope_tables(int(positions.max()) + 1)
    x = model.embed_tokens(ids).reshape(ids.numel(), -1).contiguous()
    return x, cos_table[positions].reshape(ids.numel(), -1), sin_table[positions].reshape(ids.numel(), -1)


def split_calls(stack, x, cos, sin, cache, run, slots, kv_len, mask, sequences, tap_before):
    """The taps as the forward took them from separate calls: one call per stretch of `run`
    between tap positions. Returns the output [N, H] and the taps [N, len(tap_before), H]."""
    entering, start = {}, 0
    for position in sorted(set(tap_before)) + [len(run)]:
        x = stack.run(x, cos, sin, cache, run[start:position], slots, kv_len, mask, sequences)
        entering[position], start = x, position
    return x, torch.stack([entering[p] for p in tap_before], dim=1)


def layer_by_layer(stack, x, cos, sin, cache, run, slots, kv_len, mask, tap_before):
    """The same from one int4_decoder_layer call per layer (a dense pass)."""
    entering = [x]
    for index in run:
        keys, values = cache.layer_tensors(index)
        x = fused_cpu.run_layer(stack[index], x, cos, sin, keys, values, slots, kv_len, mask)
        entering.append(x)
    return x, torch.stack([entering[p] for p in tap_before], dim=1)


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize("skip", [(), (1,)])
def test_taps_from_one_call_are_the_bits_of_split_calls_and_of_one_call_per_layer(tiny_int4_target, kv, skip):
    """A dense pass of 2 rows x 3 tokens: the one call's output and taps (in any order, repeated,
    at the input and at the output) equal those of one call per stretch between taps and of one
    int4_decoder_layer call per layer, and every call writes the same keys and values."""
    model = tiny_int4_target.model
    stack = model.fused_layers()
    run = [index for index in range(TINY_LAYERS) if index not in skip]
    tap_before = [0, 2, 1, len(run), 2]
    context, length = 20, 3
    ids = torch.randint(0, 49152, (2, length), generator=torch.Generator().manual_seed(7))
    positions = (context + torch.arange(length)).expand(2, length).contiguous()  # [B, T]
    mask = torch.ones(length, context + length, dtype=torch.bool).tril(context).expand(2, length, -1)
    with torch.inference_mode():
        caches = [prefilled_cache(tiny_int4_target, kv, 2, context) for _ in range(3)]
        x, cos, sin = pass_inputs(model, ids, positions)
        args = (cos, sin)
        taps = x.new_empty(len(x), len(tap_before), x.shape[1])  # [N, K, H]
        out = stack.run(x, *args, caches[0], run, positions, context + length, mask, None, tap_before, taps)
        split_out, split_taps = split_calls(stack, x, *args, caches[1], run, positions, context + length, mask,
                                            None, tap_before)
        layer_out, layer_taps = layer_by_layer(stack, x, *args, caches[2], run, positions, context + length,
                                               mask, tap_before)
    assert torch.equal(taps[:, 0], x) and torch.equal(taps[:, 3], out)
    assert torch.equal(out, split_out) and torch.equal(taps, split_taps)
    assert torch.equal(out, layer_out) and torch.equal(taps, layer_taps)
    assert not torch.equal(taps[:, 1], taps[:, 2])
    for cache in caches[1:]:
        assert torch.equal(cache.keys, caches[0].keys) and torch.equal(cache.values, caches[0].values)


def ragged_pass(counts: tuple[int, ...], rows: tuple[int, ...], context: int, seed: int):
    """A ragged pass: counts[s] new tokens of sequence s in cache row rows[s], after `context`
    cached tokens, each seeing the context and its own earlier tokens. Returns ids, positions
    [1, N], sequences [N] and mask [N, kv_len]."""
    kv_len = context + max(counts)
    positions, sequences, masks = [], [], []
    for count, row in zip(counts, rows):
        for t in range(count):
            positions.append(context + t)
            sequences.append(row)
            masks.append(torch.arange(kv_len) <= context + t)
    ids = torch.randint(0, 49152, (1, len(positions)), generator=torch.Generator().manual_seed(seed))
    return ids, torch.tensor([positions]), torch.tensor(sequences), torch.stack(masks)


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
def test_taps_of_a_ragged_pass_from_one_call_are_the_bits_of_split_calls(tiny_int4_target, kv):
    model = tiny_int4_target.model
    stack = model.fused_layers()
    run = [0, 2, 3]  # layer 1 left out
    tap_before = [3, 1, 0, 1]
    context = 16
    ids, positions, sequences, mask = ragged_pass((2, 1, 3), (2, 0, 1), context, seed=11)
    slots = positions[0].contiguous()  # [N]
    kv_len = mask.shape[1]
    with torch.inference_mode():
        caches = [prefilled_cache(tiny_int4_target, kv, 3, context) for _ in range(2)]
        x, cos, sin = pass_inputs(model, ids, positions)
        taps = x.new_empty(len(x), len(tap_before), x.shape[1])
        out = stack.run(x, cos, sin, caches[0], run, slots, kv_len, mask, sequences, tap_before, taps)
        split_out, split_taps = split_calls(stack, x, cos, sin, caches[1], run, slots, kv_len, mask, sequences,
                                            tap_before)
    assert torch.equal(out, split_out) and torch.equal(taps, split_taps)
    assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)


@pytest.mark.parametrize("kv", [torch.float32, torch.float16])
@pytest.mark.parametrize("ragged", [False, True], ids=["dense", "ragged"])
def test_forward_taps_are_keyed_by_model_layer_around_skipped_layers(tiny_int4_target, kv, ragged):
    """Transformer.forward's taps come from one stack call: tap k is the residual entering model
    layer k whatever layers are skipped (a skipped layer's tap is the next layer's input),
    len(layers) is the last output before the norm, in tap_layers' order with repeats; they
    equal one stack call per layer, and asking for them changes no bit of the hidden state."""
    model = tiny_int4_target.model
    stack = model.fused_layers()
    tap_layers, skip = (4, 0, 1, 2, 1), (1,)
    context = 12
    if ragged:
        ids, positions, sequences, mask = ragged_pass((3, 1), (1, 0), context, seed=5)
        slots, kv_len = positions[0].contiguous(), mask.shape[1]
        arguments = dict(positions=positions, write_at=positions, attn_mask=mask[None], kv_len=kv_len,
                         sequences=sequences)
        rows = 2
    else:
        ids = torch.randint(0, 49152, (2, 3), generator=torch.Generator().manual_seed(3))
        positions = (context + torch.arange(3)).expand(2, 3).contiguous()
        slots, kv_len, sequences = positions, context + 3, None
        mask = torch.ones(3, kv_len, dtype=torch.bool).tril(context).expand(2, 3, kv_len)
        arguments = dict(write_at=context)
        rows = 2
    with torch.inference_mode():
        caches = [prefilled_cache(tiny_int4_target, kv, rows, context) for _ in range(3)]
        out = model(ids, cache=caches[0], tap_layers=tap_layers, skip_layers=skip, logits_at=None, **arguments)
        plain = model(ids, cache=caches[1], skip_layers=skip, logits_at=None, **arguments)
        x, cos, sin = pass_inputs(model, ids, positions)
        entering = []
        for index in range(TINY_LAYERS):
            entering.append(x)
            if index not in skip:
                x = stack.run(x, cos, sin, caches[2], [index], slots, kv_len, mask, sequences)
        entering.append(x)
    expected = torch.cat([entering[k] for k in tap_layers], dim=-1).view(*ids.shape, -1)  # [B, T, 5H]
    assert out.taps.shape == (*ids.shape, len(tap_layers) * model.config.hidden_size)
    assert torch.equal(out.taps, expected)
    assert torch.equal(out.hidden, model.norm(x).view(*ids.shape, -1)) and torch.equal(out.hidden, plain.hidden)
    assert torch.equal(caches[0].keys, caches[2].keys) and torch.equal(caches[0].values, caches[2].values)


def test_bad_tap_positions_are_refused_with_what_is_accepted(tiny_int4_target):
    model = tiny_int4_target.model
    stack = model.fused_layers()
    ids = torch.tensor([[5, 6]])
    with torch.inference_mode():
        cache = prefilled_cache(tiny_int4_target, torch.float32, 1, 4)
        x, cos, sin = pass_inputs(model, ids, torch.tensor([[4, 5]]))
        slots, mask = torch.tensor([[4, 5]]), torch.ones(1, 2, 6, dtype=torch.bool)

        def run(tap_before, taps):
            return stack.run(x, cos, sin, cache, [0, 1, 2], slots, 6, mask, None, tap_before, taps)

        for position in (4, -1):
            with pytest.raises(IndexError, match=rf"tap position {position} of a run of 3 layers: 0 .* 3"):
                run([0, position], x.new_empty(2, 2, x.shape[1]))
        with pytest.raises(RuntimeError, match=r"taps: \[N, len\(tap_before\), H\] float32"):
            run([0, 3], x.new_empty(2, 3, x.shape[1]))
        with pytest.raises(RuntimeError, match="come together"):
            run([1], None)
        with pytest.raises(RuntimeError, match="come together"):
            run([], x.new_empty(2, 0, x.shape[1]))
        for layer in (5, -1):
            with pytest.raises(ValueError, match=r"each must be a boundary id 0 \.\. 4"):
                model(ids, cache=cache, write_at=4, tap_layers=(2, layer), logits_at=None)


def test_the_targets_three_taps_from_one_call_are_the_bits_of_four_calls(smollm_int4_target):
    """SmolLM2's taps (2, 15, 27) over a two-row verification pass: the forward's one stack call
    gives the taps, hidden state and cache of the four calls split at the taps."""
    model = smollm_int4_target.model
    stack = model.fused_layers()
    context, tap_layers = CONTEXT.shape[1], (2, 15, 27)
    ids = torch.tensor([[2683, 314]])
    positions = torch.tensor([[context, context + 1]])
    with torch.inference_mode():
        caches = [new_cache(smollm_int4_target) for _ in range(2)]
        for cache in caches:
            model(CONTEXT, cache=cache, write_at=0, logits_at=None)
        out = model(ids, cache=caches[0], write_at=context, tap_layers=tap_layers, logits_at=None)
        x, cos, sin = pass_inputs(model, ids, positions)
        mask = torch.ones(2, context + 2, dtype=torch.bool).tril(context)[None]
        split_out, split_taps = split_calls(stack, x, cos, sin, caches[1], list(range(30)), positions,
                                            context + 2, mask, None, list(tap_layers))
    assert torch.equal(out.taps, split_taps.reshape(1, 2, -1))
    assert torch.equal(out.hidden, model.norm(split_out)[None])
    assert torch.equal(caches[0].keys, caches[1].keys) and torch.equal(caches[0].values, caches[1].values)


def test_the_final_norm_after_the_stack_has_f_rms_norms_bits(smollm_int4_target):
    """The forward's final RMSNorm runs in the extension (one call, not PyTorch's small ops
    after the pass) where that gives F.rms_norm's bits, as on x86 it does."""
    model = smollm_int4_target.model
    stack = model.fused_layers()
    x = torch.randn(7, model.config.hidden_size, generator=torch.Generator().manual_seed(3))
    x *= torch.logspace(-2, 2, 7)[:, None]
    expected = torch.nn.functional.rms_norm(x, (x.shape[-1],), model.norm.weight, model.norm.eps)
    with torch.inference_mode():
        normed = stack.final_norm(x[None], model.norm)  # [1, 7, H]
    assert stack._norm_in_cpp
    assert normed.shape == (1, 7, x.shape[-1]) and torch.equal(normed[0], expected)
