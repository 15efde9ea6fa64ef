"""The float16 KV cache of the fused int4 layers (the default where they run): keys and values are
rounded to float16 once, when written, with the bits torch's .to(torch.float16) gives (round to
nearest even); the cache's copies (compaction, row copies, growth) move those bits unchanged;
one-token and T-token passes give each row the same bits over it; the setting is a load option
with float32 kept as a choice."""

import shutil

import pytest
import torch

from eyas.errors import EyasError
from eyas.models.kv_cache import KVCache, LayerSubsetKVCache
from eyas.models.quant import int4_available



def needs_fused(test):
    """Skip where the fused int4 layers cannot run (no int4 kernel, no compiler)."""
    test = pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this PyTorch")(test)
    return pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                              reason="no C++ compiler to build the fused layer")(test)


PROMPT = torch.tensor([[1, 504, 3458, 314, 253, 1789, 28, 6120, 30, 260, 2114, 5549]])  # [1, 12]


def new_cache(target, kv: torch.dtype, rows: int = 1, slots: int = 32) -> KVCache:
    config = target.config
    return KVCache(config.num_hidden_layers, rows, config.num_key_value_heads, slots, config.head_dim, dtype=kv)


def bits(x: torch.Tensor) -> torch.Tensor:
    return x.contiguous().view(torch.int16)


# ---- the cache alone ----------------------------------------------------------------------

def test_a_float16_cache_rounds_once_to_nearest_even_and_its_copies_keep_the_bits():
    generator = torch.Generator().manual_seed(0)
    cache = KVCache(num_layers=2, batch_size=2, num_kv_heads=1, max_slots=8, head_dim=4, dtype=torch.float16)
    k = torch.randn(2, 1, 5, 4, generator=generator) * 3  # [B, KV, T, D] float32
    k[0, 0, 0, :3] = torch.tensor([1 + 2**-11, 1 + 3 * 2**-11, 65519.0])  # ties to even; the largest finite
    cache.write(1, 0, k, -k)
    keys, values = cache.read(1, 5)
    assert keys.dtype == torch.float16
    assert torch.equal(bits(keys), bits(k.to(torch.float16)))
    assert torch.equal(bits(values), bits((-k).to(torch.float16)))
    assert keys[0, 0, 0, :3].tolist() == [1.0, 1 + 2 * 2**-10, 65504.0]
    # compaction and row copies move the stored bits, never re-round them
    stored = cache.keys[1, 0, 0].clone()
    cache.compact(0, [1, 4], start=1)
    assert torch.equal(bits(cache.keys[1, 0, 0, 1:3]), bits(stored[[1, 4]]))
    cache.copy_row(0, 1, 3)
    assert torch.equal(bits(cache.keys[:, 1, :, :3]), bits(cache.keys[:, 0, :, :3]))
    # slots given per row (the serving engine's scattered writes) round the same way
    cache.write(0, torch.tensor([[6, 2], [7, 0]]), k[:, :, :2], k[:, :, :2])
    assert torch.equal(bits(cache.keys[0, 0, :, [6, 2]]), bits(k[0, :, :2].to(torch.float16)))


def test_a_grown_layer_subset_cache_keeps_its_float16_bits():
    cache = LayerSubsetKVCache([3, 5], batch_size=1, num_kv_heads=1, max_slots=4, head_dim=2, dtype=torch.float16)
    k = torch.tensor([[[[0.1, 0.2], [0.3, 0.4]]]])  # [1, 1, 2, 2]
    cache.write(5, 0, k, k)
    bigger = cache.grown(8)
    assert bigger.keys.dtype == torch.float16 and bigger.max_slots == 8
    assert torch.equal(bits(bigger.read(5, 2)[0]), bits(k.to(torch.float16)))


# ---- the fused int4 layers over it --------------------------------------------------------

@needs_fused
@pytest.mark.parametrize("name", ["float32", "float16"])
def test_the_kv_dtype_is_a_load_option(name, monkeypatch):
    from eyas.engine.target import load_target

    monkeypatch.delenv("EYAS_KV_DTYPE", raising=False)
    target = load_target("smollm2-135m", dtype="int4", kv_dtype=name)
    assert target.model.fused_layers() is not None
    assert target.kv_dtype == getattr(torch, name)
    with pytest.raises(EyasError, match="accepted: auto, float32, float16"):
        load_target("smollm2-135m", dtype="int4", kv_dtype="bfloat16")


@needs_fused
def test_auto_is_float16_unless_the_environment_says_otherwise(smollm_int4_target, monkeypatch):
    model = smollm_int4_target.model
    assert model.kv_dtype_choice == "auto"
    monkeypatch.delenv("EYAS_KV_DTYPE", raising=False)
    assert smollm_int4_target.kv_dtype == torch.float16
    monkeypatch.setenv("EYAS_KV_DTYPE", "float32")
    assert smollm_int4_target.kv_dtype == torch.float32


def test_auto_keeps_float32_where_attention_has_no_float16_path(monkeypatch):
    from eyas.models import fused_cpu

    monkeypatch.delenv("EYAS_KV_DTYPE", raising=False)
    monkeypatch.setattr(fused_cpu, "int8dot_kernel", lambda: "avx2")
    assert fused_cpu.kv_dtype("auto", 64) == torch.float16
    assert fused_cpu.kv_dtype("auto", 128) == torch.float16
    assert fused_cpu.kv_dtype("auto", 16) == torch.float32  # e.g. a tiny test model's heads
    assert fused_cpu.kv_dtype("float16", 16) == torch.float16  # asked for: the first pass refuses it
    monkeypatch.setattr(fused_cpu, "int8dot_kernel", lambda: None)  # no AVX2 build
    assert fused_cpu.kv_dtype("auto", 64) == torch.float32


@needs_fused
def test_the_fused_layers_write_the_bits_of_torchs_rounding(smollm_int4_target):
    """Layer 0's keys and values depend on the tokens alone (not on any cache read), so the
    float16 cache must hold exactly the float32 cache's entries rounded by torch."""
    model = smollm_int4_target.model
    with torch.inference_mode():
        caches = {kv: new_cache(smollm_int4_target, kv) for kv in (torch.float32, torch.float16)}
        for cache in caches.values():
            model(PROMPT, cache=cache, write_at=0, logits_at=None)
    wide, half = caches[torch.float32], caches[torch.float16]
    assert torch.count_nonzero(wide.keys[0, :, :, :12]) > 0
    assert torch.equal(bits(half.keys[0]), bits(wide.keys[0].to(torch.float16)))
    assert torch.equal(bits(half.values[0]), bits(wide.values[0].to(torch.float16)))
    assert torch.count_nonzero(half.keys[:, :, :, 12:]) == 0  # nothing past the written slots


@needs_fused
def test_one_token_steps_and_one_pass_give_the_same_bits_over_a_float16_cache(smollm_int4_target):
    """A prefill of 12 tokens in one pass, and the same tokens one per pass: equal hidden
    states and equal caches, bit for bit, in every layer."""
    model = smollm_int4_target.model
    with torch.inference_mode():
        whole = new_cache(smollm_int4_target, torch.float16)
        together = model(PROMPT, cache=whole, write_at=0, logits_at=None).hidden[0]  # [12, H]
        steps = new_cache(smollm_int4_target, torch.float16)
        alone = torch.stack([model(PROMPT[:, t : t + 1], cache=steps, write_at=t, logits_at=None).hidden[0, 0]
                             for t in range(PROMPT.shape[1])])  # [12, H]
    assert torch.equal(together, alone)
    assert torch.equal(bits(whole.keys), bits(steps.keys)) and torch.equal(bits(whole.values), bits(steps.values))


@needs_fused
def test_decoding_after_compaction_over_a_float16_cache_equals_decoding_without_drafts(smollm_int4_target):
    """Draft rows written to scratch slots, two of them kept by compaction: the next step's
    logits and the cache equal, bit for bit, those of a cache that only saw the kept tokens."""
    model = smollm_int4_target.model
    n = PROMPT.shape[1]
    accepted, junk, following = [2683, 314], 1345, torch.tensor([[28]])
    with torch.inference_mode():
        plain = new_cache(smollm_int4_target, torch.float16)
        model(PROMPT, cache=plain, write_at=0, logits_at=None)
        for i, token in enumerate(accepted):
            model(torch.tensor([[token]]), cache=plain, write_at=n + i, logits_at=None)
        expected = model(following, cache=plain, write_at=n + 2, logits_at="all").logits
        spec = new_cache(smollm_int4_target, torch.float16)
        model(PROMPT, cache=spec, write_at=0, logits_at=None)
        drafts = torch.tensor([[junk, accepted[0], junk, accepted[1]]])  # two roots, a child each
        mask = torch.zeros(1, 4, n + 4, dtype=torch.bool)  # [B, T, S]
        mask[:, :, :n] = True
        mask[0, 0, n] = mask[0, 1, n + 1] = True
        mask[0, 2, [n, n + 2]] = True
        mask[0, 3, [n + 1, n + 3]] = True
        model(drafts, torch.tensor([[n, n, n + 1, n + 1]]), cache=spec, write_at=n, attn_mask=mask,
              kv_len=n + 4, logits_at=None)
        spec.compact(0, [n + 1, n + 3], start=n)
        got = model(following, cache=spec, write_at=n + 2, logits_at="all").logits
    assert torch.equal(got, expected)
    assert torch.equal(bits(spec.keys[:, :, :, : n + 3]), bits(plain.keys[:, :, :, : n + 3]))
