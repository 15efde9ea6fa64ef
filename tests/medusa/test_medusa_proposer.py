"""Medusa proposer: best-first trees over rank paths, the hidden row it reads after each
verification, greedy output equal to plain decoding (single request, batched serving, SmolLM2),
and --draft errors. Random heads: acceptance is not the point."""

from __future__ import annotations

import math

import pytest
import torch

from spec_checks import assert_batched_serving_equals_plain, assert_greedy_equals_plain
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.draft import DraftTree, VerifyResult
from eyas.engine.speculative.methods import build_proposer
from eyas.engine.speculative.policy import PolicyConfig
from eyas.engine.speculative.proposers.eagle3 import TreeShape
from eyas.engine.speculative.proposers.medusa import MedusaProposer, best_paths, static_scores
from eyas.errors import EyasError
from eyas.medusa import MedusaConfig, MedusaHeads, save_medusa
from eyas.models.llama import ForwardOutput

ALWAYS = PolicyConfig(enabled=False)
PROMPT = list(range(300, 316))


def random_heads(target, seed: int = 0, num_heads: int = 3) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig.for_target(target.config, num_heads=num_heads))
    with torch.no_grad():
        for block in heads.blocks:
            block[0].linear.weight.normal_(0, 0.05)
    heads.set_output_layer(target.model.lm_head)
    return heads.eval()


@pytest.fixture(scope="module")
def heads_dir(tmp_path_factory, tiny_target):
    folder = tmp_path_factory.mktemp("medusa") / "head"
    save_medusa(random_heads(tiny_target), folder)
    return folder


def test_best_paths_by_hand() -> None:
    log = torch.tensor([[math.log(0.6), math.log(0.3)],
                        [math.log(0.5), math.log(0.4)]])
    # paths by score: (0) .6, (1) .3, (0,0) .3, (0,1) .24, (1,0) .15, (1,1) .12
    nodes = best_paths(log, 5)
    assert nodes == [(0, 1, 0), (0, 1, 1), (1, 2, 0), (1, 2, 1), (2, 2, 0)]
    assert best_paths(log, 1) == [(0, 1, 0)]
    assert len(best_paths(log, 100)) == 6  # every path of depth <= 2, rank < 2


def test_static_tree_is_the_same_every_step() -> None:
    nodes = best_paths(static_scores(3, 2), 6)
    # priors .55 / .12: the chain of top-1 guesses first, then the rank-2 siblings near the root
    assert nodes == [(0, 1, 0), (1, 2, 0), (2, 3, 0), (0, 1, 1), (1, 2, 1), (4, 2, 0)]


def test_tree_tokens_come_from_the_accepted_row(tiny_target) -> None:
    heads = random_heads(tiny_target)
    proposer = MedusaProposer(heads, TreeShape.parse("chain:3"))
    proposer.begin(tiny_target, PROMPT, SamplingParams())
    hidden = torch.randn(1, 4, tiny_target.config.hidden_size)  # root + 3 nodes
    tree = DraftTree.chain([7, 8, 9])
    proposer.observe(tree, VerifyResult([1, 2], [7, 8], 5, is_bonus=False),
                     ForwardOutput(logits=None, hidden=hidden, taps=None))
    drafted = proposer.propose(PROMPT + [7, 8, 5], 3)
    expected = heads(hidden[:, 2:3])[0, 0].argmax(-1)  # node 2 was the last accepted
    assert drafted.tokens.tolist() == expected.tolist()
    assert drafted.parents.tolist() == [0, 1, 2]


def test_greedy_equals_plain_and_reads_the_final_hidden_state(tiny_target, heads_dir) -> None:
    params = SamplingParams(max_tokens=32)
    plain = generate(tiny_target, PROMPT, params).token_ids
    for tree in ("auto", "3,2,6", "chain:3"):
        proposer = build_proposer(f"medusa:{heads_dir}", tiny_target, tree=tree)
        result = speculative_generate(tiny_target, PROMPT, params, proposer, 6, policy=ALWAYS)
        assert result.token_ids == plain, tree
        assert result.stats["speculative"]["draft_tokens"] > 0
        # the hidden state kept is the target's at the row that predicted the last token
        ids = torch.tensor([PROMPT + result.token_ids[:-1]])
        full = tiny_target.model(ids, logits_at=None).hidden[0, -1]
        assert torch.allclose(proposer.last_hidden, full, atol=1e-4)


def test_sampling_is_reproducible_with_a_seed(tiny_target, heads_dir) -> None:
    params = SamplingParams(max_tokens=24, temperature=0.8, seed=3)
    proposer = build_proposer(f"medusa:{heads_dir}", tiny_target)
    runs = [speculative_generate(tiny_target, PROMPT, params, proposer, 6, policy=ALWAYS).token_ids
            for _ in range(2)]
    assert runs[0] == runs[1] and len(runs[0]) == 24


def test_batched_serving_equals_plain(tiny_target, heads_dir) -> None:
    assert assert_batched_serving_equals_plain(tiny_target, f"medusa:{heads_dir}", seed=0) > 0


def test_bad_specs_are_user_errors(tiny_target, heads_dir, tmp_path) -> None:
    with pytest.raises(EyasError, match="medusa:DIR"):
        build_proposer("medusa", tiny_target)
    with pytest.raises(EyasError, match="no such folder"):
        build_proposer(f"medusa:{tmp_path / 'nothing'}", tiny_target)
    with pytest.raises(EyasError, match="draft 3 tokens ahead at most"):
        build_proposer(f"medusa:{heads_dir}", tiny_target, tree="4,2,8")
    other = tmp_path / "other"
    save_medusa(MedusaHeads(MedusaConfig(32, 256, draft_vocab_size=64)), other)
    with pytest.raises(EyasError, match="trained for another target"):
        build_proposer(f"medusa:{other}", tiny_target)


@pytest.mark.parametrize("prompts,tokens", [(2, 32), pytest.param(8, 64, marks=pytest.mark.slow)])
def test_smollm2_greedy_equals_plain(smollm_int4_target, mtbench_prompt_ids, prompts, tokens) -> None:
    """A random (untrained) set of 4 heads reading SmolLM2's own output layer (int4)."""
    target = smollm_int4_target
    proposer = MedusaProposer(random_heads(target, num_heads=4))
    totals = assert_greedy_equals_plain(target, mtbench_prompt_ids[:prompts], proposer, 6, tokens)
    assert totals["draft_tokens"] > 0


def test_coupled_draws_rank_each_head_with_the_noise_of_its_position(tiny_target) -> None:
    """A sampled request's drafts (coupled_draws.py): head k's first candidate is the argmax of
    its logits / T plus the noise of the output position k + 1 ahead; seeded output is plain's."""
    from eyas.engine import gumbel
    from eyas.engine.speculative.coupled_draws import CoupledDraws

    if not gumbel.available():
        pytest.skip("the C++ extension is not built here")
    heads = random_heads(tiny_target)
    proposer = MedusaProposer(heads, TreeShape.parse("chain:3"))
    proposer.begin(tiny_target, PROMPT, SamplingParams(temperature=0.8))
    coupling = CoupledDraws(1 / 0.8, noise_base=5, prompt_len=len(PROMPT))
    proposer.draw_with(coupling)
    hidden = torch.randn(1, 1, tiny_target.config.hidden_size)
    proposer.observe(DraftTree.empty(), None, ForwardOutput(logits=None, hidden=hidden, taps=None))
    context = PROMPT + [7, 8]  # two output tokens: depth k + 1 fills output position 2 + k
    drafted = proposer.propose(context, 3)
    logits = heads(hidden[:, :1])[0, 0].float()  # [K, V]
    ids = torch.arange(logits.shape[-1])
    noise = gumbel.gumbel_noise(torch.tensor([coupling.key(2 + k) for k in range(3)]), logits.shape[-1])
    assert drafted.tokens.tolist() == (logits * (1 / 0.8) + noise).argmax(-1).tolist()
    assert not torch.equal(drafted.tokens, logits.argmax(-1))  # the noise changed some guess
    assert proposer.target_ids.tolist() == ids.tolist()  # heads sharing the target's output layer

    params = SamplingParams(max_tokens=24, temperature=1.0, seed=4, ignore_eos=True)
    plain = generate(tiny_target, PROMPT, params).token_ids
    result = speculative_generate(tiny_target, PROMPT, params, MedusaProposer(heads), 6, policy=ALWAYS)
    assert result.token_ids == plain
