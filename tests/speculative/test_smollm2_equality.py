"""The central invariant on a real model: greedy speculative output == plain greedy output.

SmolLM2-135M in int4 (the default precision, fused C++ layers) and in float32 (the reference
path, ~10x slower a token: 2 prompts by default, 8 in the slow run), MT-Bench first turns x 64
new tokens, with the n-gram proposer (a tree of several matches, so tree verification is
exercised too), with the target drafting for itself (where every draft must be accepted), with
a separate draft model and with the shipped EAGLE-3 head (dynamic trees, alone and with the
prompt-lookup branch grafted on).
"""

from __future__ import annotations

import pytest

from spec_checks import assert_greedy_equals_plain
from eyas.eagle3.shipped import shipped_head_dir
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.proposers.draft_model import DraftModelProposer
from eyas.engine.speculative.proposers.ngram import NgramConfig, NgramProposer

NEW_TOKENS = 64


@pytest.fixture(scope="module")
def plain_outputs(smollm_target, mtbench_prompt_ids):
    """`plain_outputs(n)`: float32 plain greedy outputs of the first n prompts, each decoded once
    for the module (a float32 token costs ~10x an int4 one)."""
    params = SamplingParams(max_tokens=NEW_TOKENS)
    decoded: list[list[int]] = []

    def first(n: int) -> list[list[int]]:
        while len(decoded) < n:
            decoded.append(generate(smollm_target, mtbench_prompt_ids[len(decoded)], params).token_ids)
        return decoded[:n]

    return first


@pytest.mark.parametrize("prompts", [2, pytest.param(8, marks=pytest.mark.slow)])
def test_ngram_tree_greedy_equals_plain(smollm_target, mtbench_prompt_ids, plain_outputs, prompts):
    proposer = NgramProposer(NgramConfig(max_n=3, min_n=1, max_matches=3))
    totals = assert_greedy_equals_plain(smollm_target, mtbench_prompt_ids[:prompts], proposer, 6,
                                        NEW_TOKENS, plain_outputs(prompts))
    assert totals["draft_tokens"] > 0  # the proposer really proposed


@pytest.mark.slow  # float32; the int4 target's counterpart runs by default
def test_self_drafting_accepts_every_draft_and_equals_plain(smollm_target, mtbench_prompt_ids,
                                                            plain_outputs):
    proposer = DraftModelProposer(smollm_target, name="self")
    totals = assert_greedy_equals_plain(smollm_target, mtbench_prompt_ids, proposer, 4, NEW_TOKENS,
                                        plain_outputs(8))
    assert totals["accepted_tokens"] == totals["draft_tokens"] > 0


def test_int4_speculative_equals_int4_plain(smollm_int4_target, mtbench_prompt_ids):
    """int4 takes bf16 activations, which would amplify any rounding noise that separates a
    one-token pass from a verification pass; its fused layers compute every row the same way
    in any pass (models/fused_cpu.py), which keeps them token-identical."""
    target = smollm_int4_target
    prompts = mtbench_prompt_ids[:4]
    params = SamplingParams(max_tokens=NEW_TOKENS)
    expected = [generate(target, prompt, params).token_ids for prompt in prompts]
    tree_proposer = NgramProposer(NgramConfig(max_n=3, min_n=1, max_matches=3))
    assert_greedy_equals_plain(target, prompts, tree_proposer, 6, NEW_TOKENS, expected)
    assert_greedy_equals_plain(target, prompts, DraftModelProposer(target, name="self"), 4,
                               NEW_TOKENS, expected)


def test_a_greedy_int4_draft_model_drafts_through_the_single_stream_call(smollm_int4_target, mtbench_prompt_ids,
                                                                         monkeypatch):
    """A greedy int4 draft model feeds its catch-up and each draft token through
    `Transformer.decode_rows` and takes the screen's argmax as an int (`_next_token`): the same
    chains as its generic forward and logits, step after step."""
    target = smollm_int4_target
    prompt = mtbench_prompt_ids[0]
    params = SamplingParams(max_tokens=NEW_TOKENS)
    answer = generate(target, prompt, params).token_ids
    chains = {}
    for fast in (True, False):
        proposer = DraftModelProposer(target, name="self")
        proposer.priced = False
        if not fast:
            monkeypatch.setattr(proposer, "_next_token", lambda ids, write_at: None)
        calls = []
        original = target.model.decode_rows
        monkeypatch.setattr(target.model, "decode_rows", lambda *a, **k: calls.append(1) or original(*a, **k))
        proposer.begin(target, prompt, params)
        chains[fast] = [proposer.propose(prompt + answer[:n], 4).tokens.tolist() for n in (1, 2, 5, 6, 20)]
        monkeypatch.undo()
        assert bool(calls) == fast
    assert chains[True] == chains[False]
    assert chains[True][0] == answer[1:5]  # the target drafting itself: its own next tokens


def _shipped_head_proposer(target, tree: str, graft: str = ""):
    from eyas.engine.speculative.methods import build_proposer

    assert shipped_head_dir("smollm2-135m") is not None, "the shipped SmolLM2 head is missing"
    return build_proposer("eagle3:smollm2-135m" + graft, target, tree=tree)


@pytest.mark.slow  # float32; the int4 target's counterpart runs by default
def test_shipped_eagle3_head_greedy_equals_plain(smollm_target, mtbench_prompt_ids, plain_outputs):
    proposer = _shipped_head_proposer(smollm_target, "4,3,8")
    totals = assert_greedy_equals_plain(smollm_target, mtbench_prompt_ids, proposer, 8, NEW_TOKENS,
                                        plain_outputs(8))
    assert totals["accepted_tokens"] > len(mtbench_prompt_ids) * NEW_TOKENS // 4  # a trained head


def test_shipped_eagle3_head_int4_equals_int4_plain(smollm_int4_target, mtbench_prompt_ids):
    """Beside an int4 target the head's linears are int4 too (methods.py): still lossless,
    still a trained head's acceptance."""
    proposer = _shipped_head_proposer(smollm_int4_target, "4,3,8")
    assert proposer.head.precision == "int4"
    # its layer runs as one C++ call where the target's do (eagle3/fused.py)
    assert (proposer.fused is not None) == (smollm_int4_target.model.fused_layers() is not None
                                            and proposer.head.midlayer.mlp.down_proj.layout == "int8dot")
    totals = assert_greedy_equals_plain(smollm_int4_target, mtbench_prompt_ids[:4], proposer, 8,
                                        NEW_TOKENS)
    assert totals["accepted_tokens"] > 4 * NEW_TOKENS // 4


@pytest.mark.slow  # float32; grafts run by default on a tiny target and, with suffix, on this model
def test_shipped_head_with_an_ngram_graft_equals_plain(smollm_target, mtbench_prompt_ids,
                                                       plain_outputs):
    """The n-gram branch grafted onto the head's tree (`eagle3:smollm2-135m+ngram`)."""
    proposer = _shipped_head_proposer(smollm_target, "3,2,4", "+ngram:3,1,4")
    totals = assert_greedy_equals_plain(
        smollm_target, mtbench_prompt_ids, proposer, 8, NEW_TOKENS, plain_outputs(8),
        counters=("draft_tokens", "accepted_tokens", "ngram_grafted_nodes"))
    assert totals["ngram_grafted_nodes"] > 0  # branches were grafted, and verified
    assert totals["accepted_tokens"] > len(mtbench_prompt_ids) * NEW_TOKENS // 4


def test_a_draft_model_runs_in_int4_beside_an_int4_target_and_equals_plain(smollm_int4_target,
                                                                          mtbench_prompt_ids):
    """`model:PATH` beside an int4 target loads the draft in int4 (its own model and KV cache,
    the same fast path); the same weights as the target, so every draft is accepted."""
    from eyas.engine.speculative.methods import build_proposer, draft_model_precision
    from eyas.errors import EyasError

    target = smollm_int4_target
    assert draft_model_precision(target, "smollm2-135m") == ("smollm2-135m", "int4")
    assert draft_model_precision(target, "dir/m@v2@float32") == ("dir/m@v2", "float32")
    with pytest.raises(EyasError, match="accepted: auto"):
        draft_model_precision(target, "smollm2-135m@int3")
    proposer = build_proposer("model:smollm2-135m", target)
    assert proposer.draft.precision == "int4" and proposer.draft is not target and proposer.priced
    proposer.priced = False  # a draft the target's size never pays when priced: draft every step
    prompts = mtbench_prompt_ids[:2]
    params = SamplingParams(max_tokens=NEW_TOKENS)
    expected = [generate(target, prompt, params).token_ids for prompt in prompts]
    totals = assert_greedy_equals_plain(target, prompts, proposer, 4, NEW_TOKENS, expected)
    assert totals["accepted_tokens"] == totals["draft_tokens"] > 0
