"""The head's fused inference path (eagle3/fused.py) against Eagle3Head.forward: the same
layer, so the same hidden states up to float rounding and the same drafts, on the shipped
SmolLM2 head beside the int4 target (whose taps it reads)."""

import shutil

import pytest
import torch

from eyas.eagle3.fused import FusedHead, HeadCache

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler to build the extension")


@pytest.fixture(scope="module")
def proposer(smollm_int4_target):
    from eyas.engine.speculative.methods import build_proposer

    proposer = build_proposer("eagle3:smollm2-135m", smollm_int4_target, tree="chain:1")
    if proposer.fused is None:
        pytest.skip("no fused head here (no int8dot kernel: EYAS_FUSED=0 or a CPU without AVX2)")
    return proposer


@torch.inference_mode()
def test_the_fused_layer_computes_the_heads_layer(smollm_int4_target, proposer, mtbench_prompt_ids):
    """Committed rows (causal, from the target's taps), then a tree level of 3 rows at one
    position that see the committed rows and themselves only."""
    head, fused = proposer.head, proposer.fused
    ids = torch.tensor([mtbench_prompt_ids[0]])
    taps = smollm_int4_target.model(ids, logits_at=None, tap_layers=proposer.tap_layers).taps
    count = ids.shape[1] - 1
    reference = head(taps[:, :count], ids[:, 1:], torch.arange(count)[None], compute_logits=False)
    cache = fused.new_cache()
    hidden = fused.run(taps[0, :count], ids[0, 1:], torch.arange(count), 0, cache)  # [count, H]
    # float rounding only (the int4 matmuls are the same kernel; norms, RoPE and attention are
    # other code): a wrong mask, position or weight would be off by the values' own size
    assert hidden.shape == (count, 576)
    assert (hidden - reference.hidden[0]).abs().max() <= 1e-4 * reference.hidden.abs().max()
    # the cache holds the rows' keys at their positions, as the Python path's past does
    keys = reference.past_kv[0]
    assert (cache.keys[:, :, :count] - keys).abs().max() <= 1e-4 * keys.abs().max()
    tokens = torch.tensor([[198, 504, 2114]])
    parents = reference.hidden[:, -1:].expand(1, 3, -1)  # [1, 3, H]
    mask = torch.zeros(1, 3, count + 3, dtype=torch.bool)
    mask[0, :, :count] = True
    mask[0, torch.arange(3), count + torch.arange(3)] = True
    expected = head(parents, tokens, torch.full((1, 3), count), attn_mask=mask, past_kv=reference.past_kv)
    tree = fused.run(parents[0], tokens[0], torch.full((3,), count), count, cache, mask[0])
    # the matmuls quantize their inputs to 14 bits: where the two paths' float rounding puts an
    # input on either side of a step, an output moves by ~2**-13 of its row's size (measured up
    # to 1.2e-4 on an AMD EPYC, under 1e-4 on a Xeon); 1e-3 allows a few such steps, where a
    # wrong mask, position or weight moves the rows by their own size
    assert (tree - expected.hidden[0]).abs().max() <= 1e-3 * expected.hidden.abs().max()
    logits = head.compute_logits(tree[None])[0]
    assert torch.equal(logits.argmax(-1), expected.logits[0].argmax(-1))
    assert torch.equal(logits.topk(4).indices, expected.logits[0].topk(4).indices)


@torch.inference_mode()
def test_a_step_from_ints_gives_run_s_bits(smollm_int4_target, proposer, mtbench_prompt_ids):
    """`step` (one C++ call: fc, embedding and rotary rows, slots and the causal mask gathered
    there) gives `run`'s hidden states and cache bit for bit: committed rows from the target's
    taps, one more row, then a tree level of 3 rows at one position with its mask."""
    fused = proposer.fused
    assert fused.native is not None
    ids = mtbench_prompt_ids[0]
    taps = smollm_int4_target.model(torch.tensor([ids]), logits_at=None, tap_layers=proposer.tap_layers).taps
    count = len(ids) - 2
    caches = [fused.new_cache(), fused.new_cache()]
    want = fused.run(taps[0, :count], ids[1 : count + 1], list(range(count)), 0, caches[0])[None]
    got = fused.step(taps[:, :count], ids[1 : count + 1], list(range(count)), 0, caches[1])
    assert torch.equal(got, want)
    want = fused.run(taps[0, count : count + 1], [ids[-1]], [count], count, caches[0])[None]
    got = fused.step(taps[:, count : count + 1], [ids[-1]], [count], count, caches[1])
    assert torch.equal(got, want)
    parents = got[:, -1:].expand(1, 3, -1)  # [1, 3, H]: the head's own outputs
    mask = torch.zeros(1, 3, count + 4, dtype=torch.bool)
    mask[0, :, : count + 1] = True
    mask[0, torch.arange(3), count + 1 + torch.arange(3)] = True
    want = fused.run(parents[0], [198, 504, 2114], [count + 1] * 3, count + 1, caches[0], mask[0])[None]
    got = fused.step(parents, [198, 504, 2114], [count + 1] * 3, count + 1, caches[1], mask)
    assert torch.equal(got, want)
    assert torch.equal(caches[1].keys, caches[0].keys) and torch.equal(caches[1].values, caches[0].values)


@torch.inference_mode()
def test_token_embeddings_from_ints_are_the_lookup_s(proposer):
    """`embeds` of ints copies the table's rows into a kept buffer: F.embedding's floats, for
    one id, several, repeated ones and past the buffer's capacity (then the lookup itself)."""
    weight = proposer.head.embed_tokens.weight
    for ids in ([260], [1, 504, 3458], [7, 7, 9, 7], list(range(100, 170))):
        assert torch.equal(proposer.fused.embeds(ids), torch.nn.functional.embedding(torch.tensor(ids), weight))
    assert torch.equal(proposer.fused.embeds(torch.tensor([5, 6])), weight[5:7])


def test_the_cache_grows_and_keeps_its_rows():
    cache = HeadCache(kv_heads=3, head_dim=64, slots=4)
    cache.keys[0, :, :4] = torch.arange(4.0)[None, :, None]
    cache.ensure(3)
    assert cache.keys.shape[2] == 4  # big enough already
    cache.ensure(5)
    assert cache.keys.shape == (1, 3, 8, 64) and cache.values.shape == (1, 3, 8, 64)  # doubled
    assert torch.equal(cache.keys[0, 1, :4, 0], torch.arange(4.0))
    cache.ensure(100)
    assert cache.keys.shape[2] == 100 and torch.equal(cache.keys[0, 2, :4, 5], torch.arange(4.0))


def test_the_proposer_runs_the_fused_head_beside_an_int4_target_only(smollm_int4_target, smollm_target,
                                                                   proposer):
    from eyas.engine.speculative.methods import build_proposer

    assert isinstance(proposer.fused, FusedHead) and proposer.head.precision == "int4"
    assert build_proposer("eagle3:smollm2-135m", smollm_target, tree="chain:1").fused is None  # float32
