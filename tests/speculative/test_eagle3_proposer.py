"""EAGLE-3 proposer: committed-row alignment, tree expansion against explicit head passes,
and greedy output equal to plain decoding (with a random head: acceptance is not the point)."""

from __future__ import annotations

import pytest
import torch

from eyas.eagle3.config import Eagle3Config
from eyas.eagle3.head import Eagle3Head
from eyas.eagle3.vocab import build_draft_vocab
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.policy import PolicyConfig
from eyas.engine.speculative.proposers.eagle3 import Eagle3Proposer, TreeShape
from stat_checks import homogeneity_p_value

PROMPT = list(range(300, 316))


@pytest.fixture(scope="module")
def random_head(tiny_target):
    torch.manual_seed(0)
    config = Eagle3Config.for_target(tiny_target.config, draft_vocab_size=512,
                                     target_layer_ids=[0, 1, 2])
    head = Eagle3Head(config)
    counts = torch.zeros(tiny_target.config.vocab_size)
    counts[torch.randperm(tiny_target.config.vocab_size)[:2000]] = 1.0
    head.set_vocab(build_draft_vocab(counts, 512))
    head.set_embedding(tiny_target.model.embed_tokens.weight)
    with torch.no_grad():
        head.lm_head.weight.mul_(10)  # decisive top-k
    return head.eval()


def test_tree_shape_parsing():
    assert TreeShape.parse("chain:3") == TreeShape(depth=3, top_k=1, total_tokens=4)
    assert TreeShape.parse("5,3,16") == TreeShape(depth=5, top_k=3, total_tokens=16)
    with pytest.raises(Exception, match="DEPTH,TOPK,TOTAL"):
        TreeShape.parse("big")


@pytest.mark.parametrize("shape", ["chain:3", "3,2,7", "4,3,10"])
def test_greedy_eagle3_equals_plain(tiny_target, random_head, shape):
    params = SamplingParams(max_tokens=24, ignore_eos=True)
    expected = generate(tiny_target, PROMPT, params).token_ids
    proposer = Eagle3Proposer(random_head, TreeShape.parse(shape))
    result = speculative_generate(tiny_target, PROMPT, params, proposer, 16,
                                  policy=PolicyConfig(enabled=False))
    assert result.token_ids == expected
    assert result.stats["speculative"]["draft_tokens"] > 0


@torch.inference_mode()
def test_committed_rows_equal_one_causal_pass_over_the_final_sequence(tiny_target, random_head):
    proposer = Eagle3Proposer(random_head, TreeShape.parse("3,2,6"))
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    result = speculative_generate(tiny_target, PROMPT, params, proposer, 8,
                                  policy=PolicyConfig(enabled=False))
    sequence = PROMPT + result.token_ids
    rows = proposer.committed
    taps = tiny_target.model(torch.tensor([sequence]), tap_layers=proposer.tap_layers).taps
    reference = random_head(taps[:, :rows], torch.tensor([sequence[1 : rows + 1]]),
                            torch.arange(rows)[None])
    keys, values = proposer.past
    assert keys.shape[2] == rows
    assert torch.allclose(keys, reference.past_kv[0], atol=1e-4)
    assert torch.allclose(values, reference.past_kv[1], atol=1e-4)


@torch.inference_mode()
def test_second_level_scores_match_an_explicit_head_pass(tiny_target, random_head):
    from eyas.engine.generate import new_cache

    proposer = Eagle3Proposer(random_head, TreeShape(depth=2, top_k=2, total_tokens=7))
    proposer.begin(tiny_target, PROMPT, SamplingParams())
    cache = new_cache(tiny_target, 1, 64)
    out = tiny_target.model(torch.tensor([PROMPT]), cache=cache, write_at=0,
                            tap_layers=proposer.tap_layers)
    proposer.observe(None, None, out)
    root = int(out.logits[0, -1].argmax())
    tree = proposer.propose(PROMPT + [root], 6)
    depth1 = [i for i, p in enumerate(tree.parents.tolist()) if p == 0]
    assert len(depth1) == 2
    # explicit: last committed row's output + depth-1 token at position n
    log_probs = torch.log_softmax(proposer.last_logits[0].float(), -1)
    parent_token = int(tree.tokens[depth1[0]])
    parent_draft_id = int(random_head.t2d[: parent_token].sum())  # draft ids are sorted target ids
    step = random_head(proposer.last_hidden, torch.tensor([[parent_token]]),
                       torch.tensor([[len(PROMPT)]]), past_kv=proposer.past)
    child_scores = log_probs[parent_draft_id] + torch.log_softmax(step.logits[0, 0].float(), -1)
    best_child = int(random_head.draft_to_target(child_scores.argmax()[None])[0])
    children = [int(tree.tokens[i]) for i, p in enumerate(tree.parents.tolist()) if p == depth1[0] + 1]
    assert best_child in children


def test_auto_tree_measures_costs_once_and_stays_lossless(tiny_target, random_head, tmp_path,
                                                          monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    params = SamplingParams(max_tokens=20, ignore_eos=True)
    expected = generate(tiny_target, PROMPT, params).token_ids
    proposer = Eagle3Proposer(random_head, None, resize_every=2)
    result = speculative_generate(tiny_target, PROMPT, params, proposer, 32,
                                  policy=PolicyConfig(enabled=False))
    assert result.token_ids == expected
    spec = result.stats["speculative"]
    assert spec["tree_mode"] == "auto"
    depth, top_k, total = (int(x) for x in spec["tree"].split(","))
    assert depth >= 1 and top_k >= 1 and total >= 2
    # a random head is almost never right: the rank estimate fell below the prior
    assert spec["rank_probabilities"][0] < 0.55
    assert len(list((tmp_path / "costs").glob("*.json"))) == 1  # measured once, cached


@pytest.mark.slow  # ~1,000 short generations: minutes on 2 busy cores (make test-all runs it)
def test_sampling_with_an_eagle3_tree_follows_the_target(tiny_target, random_head):
    """temperature 1, top-k 6: the second generated token's distribution with EAGLE-3 trees
    (top-k siblings, verified sibling by sibling) equals plain sampling's (chi-square test of
    homogeneity over 500 seeds each)."""
    proposer = Eagle3Proposer(random_head, TreeShape.parse("2,3,6"))
    prompt = PROMPT + generate(tiny_target, PROMPT, SamplingParams(max_tokens=1)).token_ids
    runs = 500

    def histogram(spec: bool) -> dict[int, int]:
        counts: dict[int, int] = {}
        for seed in range(runs):
            params = SamplingParams(max_tokens=2, temperature=1.0, top_k=6, seed=seed, ignore_eos=True)
            if spec:
                out = speculative_generate(tiny_target, prompt, params, proposer, 6,
                                           policy=PolicyConfig(enabled=False)).token_ids
            else:
                out = generate(tiny_target, prompt, params).token_ids
            counts[out[1]] = counts.get(out[1], 0) + 1
        return counts

    plain, spec = histogram(False), histogram(True)
    p_value, dof = homogeneity_p_value(plain, spec)
    assert dof >= 2 and p_value > 1e-3, (plain, spec)


def test_the_proposer_prices_the_tree_it_drafts_under_a_budget(random_head):
    """What the serving rule reads (eyas.scheduler.speculation.TreePricing): the expected tokens
    of the tree `propose` drafts under a budget (the shape cut to budget + 1 tokens) and one
    head pass per level."""
    from eyas.engine.speculative.sizing import CostModel, expected_tokens

    proposer = Eagle3Proposer(random_head)  # auto: shape from measured costs
    assert proposer.expected_tokens(4) is None  # nothing measured yet: the chain model applies
    proposer.cost = CostModel({1: 0.010, 8: 0.020}, {1: 0.002, 2: 0.003})
    proposer.shape = TreeShape(depth=3, top_k=2, total_tokens=6)
    ranks = proposer.ranks.probabilities
    assert proposer.expected_tokens(2) == pytest.approx(expected_tokens(3, 2, 3, ranks))
    assert proposer.expected_tokens(64) == pytest.approx(expected_tokens(3, 2, 6, ranks))
    assert proposer.expected_tokens(1) == pytest.approx(1 + ranks[0])
    for _ in range(10):  # new acceptance statistics: the price follows them
        proposer.ranks.record(1)
    assert proposer.ranks.probabilities[0] > ranks[0]
    assert proposer.expected_tokens(1) == pytest.approx(1 + proposer.ranks.probabilities[0])
    proposer.shape = TreeShape(depth=1, top_k=2, total_tokens=3)  # and a new shape
    assert proposer.expected_tokens(64) == pytest.approx(expected_tokens(1, 2, 3, proposer.ranks.probabilities))
    proposer.shape = TreeShape(depth=3, top_k=2, total_tokens=6)
    assert proposer.draft_seconds(1) == pytest.approx(0.002)  # one level, one row
    assert proposer.draft_seconds(2) == pytest.approx(0.002 + 0.003)  # two levels
    assert proposer.draft_seconds(9) == pytest.approx(0.002 + 2 * 0.003)  # the shape's three
    fixed = Eagle3Proposer(random_head, TreeShape(3, 2, 6))
    fixed.cost = proposer.cost
    assert fixed.expected_tokens(4) is None  # a fixed tree is not priced


@torch.inference_mode()
def test_rows_of_passes_without_taps_leave_a_gap_at_their_true_positions(tiny_target, random_head):
    """Plain steps whose pass computed no taps (the fallback kept them plain) are left out of
    the head's KV; the rows it keeps are those of one head pass over the kept positions."""
    from types import SimpleNamespace

    from eyas.engine.speculative.draft import DraftTree
    from eyas.models.llama import ForwardOutput

    sequence = PROMPT + generate(tiny_target, PROMPT, SamplingParams(max_tokens=7, ignore_eos=True)).token_ids
    taps = tiny_target.model(torch.tensor([sequence]), tap_layers=random_head.config.target_layer_ids).taps
    n = len(PROMPT)
    proposer = Eagle3Proposer(random_head, TreeShape.parse("chain:2"))
    proposer.begin(tiny_target, PROMPT, SamplingParams())
    proposer.observe(None, None, ForwardOutput(None, None, taps[:, :n]))  # the prefill
    plain_step = SimpleNamespace(accepted_nodes=[])
    without_taps = {1, 2}  # the second and third decode steps computed no taps
    for step in range(6):  # the root of step j sits at position n + j
        position = n + step
        output = None if step in without_taps else ForwardOutput(None, None, taps[:, position : position + 1])
        proposer.observe(DraftTree.empty(), plain_step, output if output is not None
                         else ForwardOutput(None, None, None))
    proposer.propose(sequence[: n + 7], 2)
    kept = list(range(n)) + [n, n + 3, n + 4, n + 5]
    assert proposer.committed == len(kept) and proposer.last_position == n + 5
    reference = random_head(taps[:, kept], torch.tensor([[sequence[p + 1] for p in kept]]),
                            torch.tensor([kept]))
    keys, values = proposer.past
    assert torch.allclose(keys, reference.past_kv[0], atol=1e-4)
    assert torch.allclose(values, reference.past_kv[1], atol=1e-4)
    assert torch.allclose(proposer.last_hidden, reference.hidden[:, -1:], atol=1e-4)


def test_greedy_eagle3_with_rows_left_out_equals_plain(tiny_target, random_head):
    """Long runs of plain steps (warm-up, fallbacks) skip the taps of all but their last pass:
    the drafts that follow come from a head KV with gaps, and output stays plain's."""
    params = SamplingParams(max_tokens=40, ignore_eos=True)
    expected = generate(tiny_target, PROMPT, params).token_ids
    proposer = Eagle3Proposer(random_head, TreeShape.parse("chain:3"))
    result = speculative_generate(tiny_target, PROMPT, params, proposer, 8,
                                  policy=PolicyConfig(warmup_plain_steps=6, backoff=5))
    assert result.token_ids == expected
    assert result.stats["speculative"]["draft_tokens"] > 0
    assert proposer.committed < proposer.last_position + 1  # rows were left out
