"""The fused int4 decoder layer (models/fused_cpu.py): it is what an int4 target runs on a CPU,
it gives a token the same bits in a one-token step and in a tree verification pass (the
property lossless speculation rests on), and it agrees with the Python layers."""

import os
import shutil
from unittest import mock

import pytest
import torch

from eyas.models import extension
from eyas.models.kv_cache import KVCache
from eyas.models.quant import int4_available

pytestmark = [
    pytest.mark.skipif(not int4_available(), reason="no CPU int4 kernel in this PyTorch"),
    pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                       reason="no C++ compiler to build the fused layer"),
]

PROMPT = torch.tensor([[1, 504, 3458, 314, 253, 1789, 28, 6120, 30, 260, 2114, 5549]])  # [1, 12]


@pytest.fixture(scope="module", params=["int8dot", "torch"])
def int4_target(request, smollm_int4_target):
    """The int4 target with each int4 layout its fused layers can run (quant.Int4Linear):
    eyas's int8dot kernel's (AVX512-VNNI or AVX2; both give the same bits,
    test_int4_int8dot.py) and PyTorch's (what a CPU without AVX2 runs)."""
    if request.param == "int8dot":
        if smollm_int4_target.model.layers[0].mlp.down_proj.layout != "int8dot":
            pytest.skip("no int8dot kernel here: the int4 target uses PyTorch's kernel")
        return smollm_int4_target
    from eyas.engine.target import load_target

    with mock.patch.dict(os.environ, {"EYAS_INT4_KERNEL": "torch"}):
        target = load_target("smollm2-135m", dtype="int4")
    assert target.model.layers[0].mlp.down_proj.layout == "torch"
    return target


def new_cache(target, rows=1, slots=32, dtype=None):
    config = target.config
    return KVCache(config.num_hidden_layers, rows, config.num_key_value_heads, slots, config.head_dim,
                   dtype=dtype or target.kv_dtype)


def test_an_int4_target_on_a_cpu_runs_the_fused_layers_with_a_float16_cache(smollm_int4_target,
                                                                            smollm_target, monkeypatch):
    model = smollm_int4_target.model
    assert extension.module() is not None  # g++ is on every machine of this project's kind
    assert model.fused_layers() is not None and len(model.fused_layers()) == 30
    monkeypatch.delenv("EYAS_KV_DTYPE", raising=False)
    assert smollm_int4_target.kv_dtype == torch.float16  # the default (--kv-dtype auto)
    assert smollm_target.model.fused_layers() is None  # float32 weights: the Python layers


@pytest.mark.parametrize("kv", [torch.float32, torch.float16], ids=["kv-float32", "kv-float16"])
@pytest.mark.parametrize("context", [12, 62])  # 62: the tree's slots 62..65 cross a 64-slot chunk
def test_a_tree_verification_pass_gives_each_row_the_bits_of_one_token_steps(int4_target, context, kv):
    """Rows a, b, c, d: b and c are children of a, d of b. Each row's hidden state must equal,
    bit for bit, the one-token decode of its path (a, b, d) or (a, c); with the float32 cache
    and the float16 one (EYAS_KV_DTYPE)."""
    model = int4_target.model
    prompt = PROMPT.repeat(1, 6)[:, :context]  # [1, context]
    a, b, c, d = 2683, 314, 1345, 28
    n = context
    with torch.inference_mode():
        tree_cache = new_cache(int4_target, slots=96, dtype=kv)
        model(prompt, cache=tree_cache, write_at=0, logits_at=None)
        visible = torch.zeros(4, n + 4, dtype=torch.bool)  # [T, S]: slots 0..n-1 context, then the tree
        visible[:, :n] = True
        for row, path in enumerate([[n], [n, n + 1], [n, n + 2], [n, n + 1, n + 3]]):
            visible[row, path] = True
        tree = model(torch.tensor([[a, b, c, d]]), positions=torch.tensor([[n, n + 1, n + 1, n + 2]]),
                     cache=tree_cache, write_at=n, attn_mask=visible[None], kv_len=n + 4,
                     logits_at=None).hidden  # [1, 4, H]
        steps = {}
        for path in ([a, b, d], [a, c]):
            cache = new_cache(int4_target, slots=96, dtype=kv)
            model(prompt, cache=cache, write_at=0, logits_at=None)
            steps[tuple(path)] = [model(torch.tensor([[token]]), cache=cache, write_at=n + i,
                                        logits_at=None).hidden[0, 0] for i, token in enumerate(path)]
    assert torch.equal(tree[0, 0], steps[(a, b, d)][0])
    assert torch.equal(tree[0, 1], steps[(a, b, d)][1])
    assert torch.equal(tree[0, 3], steps[(a, b, d)][2])
    assert torch.equal(tree[0, 2], steps[(a, c)][1])


def test_rows_of_a_batch_with_their_own_slots_equal_each_row_alone(int4_target):
    """The serving engine's layout: B rows, tensor slots [B, T], a mask [B, T, S]."""
    model = int4_target.model
    prompts = [PROMPT[:, :7], PROMPT[:, 3:]]  # 7 and 9 tokens
    with torch.inference_mode():
        alone = []
        for prompt in prompts:
            cache = new_cache(int4_target)
            model(prompt, cache=cache, write_at=0, logits_at=None)
            alone.append(model(torch.tensor([[2683]]), cache=cache, write_at=prompt.shape[1],
                               logits_at=None).hidden[0, 0])
        cache = new_cache(int4_target, rows=2)
        for row, prompt in enumerate(prompts):  # prefill each row in its own cache row
            single = new_cache(int4_target)
            model(prompt, cache=single, write_at=0, logits_at=None)
            cache.keys[:, row], cache.values[:, row] = single.keys[:, 0], single.values[:, 0]
        slots = torch.tensor([[7], [9]])  # [B, T]
        mask = torch.zeros(2, 1, 10, dtype=torch.bool)
        mask[0, 0, :8] = True
        mask[1, 0, :10] = True
        batch = model(torch.tensor([[2683], [2683]]), positions=slots, cache=cache, write_at=slots,
                      attn_mask=mask, kv_len=10, logits_at=None).hidden  # [2, 1, H]
    assert torch.equal(batch[0, 0], alone[0])
    assert torch.equal(batch[1, 0], alone[1])


def test_the_fused_and_the_python_layers_agree(int4_target):
    """The same model through both paths, for each int4 layout: the rounding of activations
    for the int4 matmuls may differ in a last bit here and there (RMSNorm sums in another
    order, float64 attention in the Python layers), nothing more."""
    model = int4_target.model
    hidden = {}
    try:
        for fused in (False, True):
            model.fused_plan = None if fused else False  # False: the Python layers
            with torch.inference_mode():
                cache = new_cache(int4_target, dtype=torch.float64)
                out = model(PROMPT, cache=cache, write_at=0, logits_at="all")
                hidden[fused] = (out.hidden, out.logits)
    finally:
        model.fused_plan = None
    (h_py, logits_py), (h_fused, logits_fused) = hidden[False], hidden[True]
    assert h_fused.shape == h_py.shape == (1, 12, 576)
    assert (h_fused - h_py).abs().max() <= 0.01 * h_py.abs().max()  # measured: 0.4%
    assert (logits_fused - logits_py).abs().max() <= 0.02 * logits_py.abs().max()
    assert torch.equal(logits_fused.argmax(-1), logits_py.argmax(-1))


def test_a_write_past_the_cache_is_an_index_error(smollm_int4_target):
    model = smollm_int4_target.model
    with torch.inference_mode():
        cache = new_cache(smollm_int4_target, slots=12)
        model(PROMPT, cache=cache, write_at=0, logits_at=None)
        with pytest.raises(IndexError, match="KV cache overflow"):
            model(torch.tensor([[2683]]), cache=cache, write_at=torch.tensor([[12]]), kv_len=12,
                  logits_at=None)
        with pytest.raises(IndexError, match="KV cache overflow"):
            model(torch.tensor([[2683]]), cache=cache, write_at=12, logits_at=None)


def test_a_float16_cache_stays_close_to_float32_and_speculation_stays_lossless(smollm_int4_target,
                                                                             mtbench_prompt_ids, monkeypatch):
    """The float16 cache (the default): keys and values rounded to float16, read back into
    float32. The hidden states move by float16 rounding only, and greedy speculative decoding
    still equals plain decoding on it, and on the float32 cache that stays an option."""
    from eyas.engine.generate import generate
    from eyas.engine.sampling import SamplingParams
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.methods import build_proposer
    from eyas.engine.speculative.policy import PolicyConfig

    model = smollm_int4_target.model
    ids = torch.tensor([mtbench_prompt_ids[0]])
    with torch.inference_mode():
        hidden = {}
        for kv in (torch.float32, torch.float16):
            cache = new_cache(smollm_int4_target, slots=ids.shape[1] + 2, dtype=kv)
            model(ids[:, :-1], cache=cache, write_at=0, logits_at=None)
            out = model(ids[:, -1:], cache=cache, write_at=ids.shape[1] - 1, logits_at="all")
            hidden[kv] = (out.hidden[0, 0], out.logits[0, 0])
    (h32, l32), (h16, l16) = hidden[torch.float32], hidden[torch.float16]
    assert not torch.equal(h32, h16)  # the cache did change
    assert (h16 - h32).abs().max() <= 0.01 * h32.abs().max()
    assert l16.argmax() == l32.argmax()
    params = SamplingParams(max_tokens=32)
    proposer = build_proposer("eagle3:smollm2-135m", smollm_int4_target, "2,2,3")  # drafts every step
    for kv in ("float16", "float32"):  # the default and the option (EYAS_KV_DTYPE)
        monkeypatch.setenv("EYAS_KV_DTYPE", kv)
        assert smollm_int4_target.kv_dtype == getattr(torch, kv)
        for prompt in mtbench_prompt_ids[:2]:
            plain = generate(smollm_int4_target, prompt, params).token_ids
            spec = speculative_generate(smollm_int4_target, prompt, params, proposer, 4,
                                        policy=PolicyConfig(enabled=False))
            assert spec.token_ids == plain
    monkeypatch.setenv("EYAS_KV_DTYPE", "bfloat16")
    with pytest.raises(ValueError, match="accepted values are float32, float16"):
        smollm_int4_target.kv_dtype


def test_decode_one_gives_forward_s_bits(int4_target):
    """A single-stream plain step through `decode_one` (Python ints in, no batch) writes the same
    keys and values and returns the same hidden state and taps, bit for bit, as `forward` over
    the same token, position and cache; a float32 model's Python layers are left to `forward`."""
    model, taps = int4_target.model, (2, 15, 30)
    caches = [new_cache(int4_target) for _ in range(2)]
    with torch.inference_mode():
        for cache in caches:
            model(PROMPT, cache=cache, logits_at=None)
        for step, token in enumerate([260, 2114, 5549]):
            position = PROMPT.shape[1] + step
            want = model(torch.tensor([[token]]), torch.tensor([[position]]), cache=caches[0],
                         write_at=position, kv_len=position + 1, tap_layers=taps, logits_at=None)
            got = model.decode_one(token, position, caches[1], taps)
            assert got is not None and got.logits is None
            assert torch.equal(got.hidden, want.hidden) and torch.equal(got.taps, want.taps)
            assert got.hidden.shape == (1, 1, model.config.hidden_size)
            assert torch.equal(caches[1].keys, caches[0].keys) and torch.equal(caches[1].values, caches[0].values)
        assert model.decode_one(260, 0, caches[1], (31,)) is None  # no such boundary: forward's error


def test_decode_rows_gives_forward_s_bits_over_a_draft_tree(int4_target):
    """A single-stream drafting step through `decode_rows` (a root and a 4-node tree: 1 -> root,
    2 -> 1, 3 -> root, 4 -> 3) gives forward's hidden states, taps and KV cache bit for bit."""
    from eyas.engine.speculative.draft import DraftTree
    from eyas.scheduler.batch import tree_row

    model, taps = int4_target.model, (0, 7, 30)
    tree = DraftTree(torch.tensor([2114, 5549, 30, 260]), torch.tensor([0, 1, 0, 3]))
    caches = [new_cache(int4_target) for _ in range(2)]
    context = PROMPT.shape[1]
    tokens, positions, mask = tree_row(504, tree, context)
    assert positions == [context + d for d in (0, 1, 2, 1, 2)]
    with torch.inference_mode():
        for cache in caches:
            model(PROMPT, cache=cache, logits_at=None)
        want = model(torch.tensor([tokens]), torch.tensor([positions]), cache=caches[0], write_at=context,
                     attn_mask=mask, kv_len=context + 5, tap_layers=taps, logits_at=None)
        got = model.decode_rows(tokens, positions, context, mask, caches[1], taps)
    assert torch.equal(got.hidden, want.hidden) and torch.equal(got.taps, want.taps)
    assert torch.equal(caches[1].keys, caches[0].keys) and torch.equal(caches[1].values, caches[0].values)
    assert model.decode_rows(tokens, positions, context, None, caches[1]) is None  # several rows need a mask


def test_decode_one_leaves_other_models_to_forward(smollm_target):
    cache = new_cache(smollm_target)
    with torch.inference_mode():
        assert smollm_target.model.decode_one(260, 0, cache) is None  # float32: the Python layers


def test_greedy_tokens_are_the_output_logits_argmax(int4_target, smollm_target):
    """`greedy_tokens` (Python ints, no logits out of the screen's C++ call) gives each row's
    argmax of `output_logits(hidden, greedy=True)`; a float32 model's plain output layer too."""
    for target in (int4_target, smollm_target):
        model = target.model
        with torch.inference_mode():
            hidden = model(PROMPT, logits_at=None).hidden  # [1, T, H]
            want = model.output_logits(hidden, greedy=True).argmax(-1).reshape(-1).tolist()
            assert model.greedy_tokens(hidden) == want
            assert model.greedy_tokens(hidden[0, -1:]) == want[-1:]


def test_decode_one_reads_a_checkpoint_embedding_row_by_row(int4_target, tmp_path):
    """A target whose embedding is read from the checkpoint row by row (SourceEmbedding: an
    untied GGUF embedding, 933 MB in float32 for a 1.5B Qwen) takes the single-stream step on
    the token's own row, with the same bits, and never builds the float32 table."""
    from random_checkpoints import write_gguf

    from eyas.models.gguf_loader import GGUFSource
    from eyas.models.source_embedding import SourceEmbedding

    model = int4_target.model
    table = model.embed_tokens.weight.detach()[:4096].numpy()  # the prompt's and the step's ids
    path = write_gguf(tmp_path / "e.gguf", {"token_embd.weight": (table, "F32")})
    source = SourceEmbedding(GGUFSource(path).tensors["model.embed_tokens.weight"])
    caches = [new_cache(int4_target) for _ in range(2)]
    position = PROMPT.shape[1]
    with torch.inference_mode():
        for cache in caches:
            model(PROMPT, cache=cache, logits_at=None)
        want = model.decode_rows([260, 2114], [position, position + 1], position,
                                 torch.ones(1, 2, position + 2, dtype=torch.bool).tril(position), caches[0])
        original = model.embed_tokens  # a submodule: set back by hand (monkeypatch would delete it)
        model.embed_tokens = source
        try:
            got = model.decode_rows([260, 2114], [position, position + 1], position,
                                    torch.ones(1, 2, position + 2, dtype=torch.bool).tril(position), caches[1])
            assert model.decode_one(5000, position, caches[1]) is None  # out of its range: forward's error
        finally:
            model.embed_tokens = original
    assert got is not None and torch.equal(got.hidden, want.hidden)
    assert torch.equal(caches[1].keys, caches[0].keys)
    assert source._table is None
