"""Acceptance with one draw per node (accept_drawn, engine/gumbel.py): the emitted tokens follow
the target (chi-square, deterministic drafts), a broken noise schedule is caught, and with the
engine a seeded plain-temperature request emits the same tokens with or without speculation."""

from __future__ import annotations

import pytest
import torch

from eyas.engine import gumbel
from eyas.engine.gumbel import gumbel_argmax, noise_key
from eyas.engine.speculative.acceptance import accept_drawn
from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.tree import node_depths
from stat_checks import chi_square_p_value

pytestmark = pytest.mark.skipif(not gumbel.available(), reason="the C++ extension is not built here")

P_VALUE = 1e-3
P = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.0],  # root row: the first emitted token
                  [0.05, 0.05, 0.10, 0.20, 0.30, 0.30],
                  [0.40, 0.10, 0.10, 0.10, 0.10, 0.20],
                  [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]], dtype=torch.float64)
TREE = DraftTree(torch.tensor([2, 4, 5]), torch.tensor([0, 0, 1]))  # root -> 2 (-> 5), 4


def emitted(trials: int, same_noise_everywhere: bool = False) -> list[list[int]]:
    """`trials` verifications of TREE against P, each with its own noise base; each node draws
    with the noise of its depth (the output position it fills)."""
    logits = P.float().log()  # [4, V]: softmax(log P) = P
    depths = [0] + node_depths(TREE)
    scale = torch.ones(len(depths))
    out = []
    for trial in range(trials):
        keys = torch.tensor([noise_key(trial, 0 if same_noise_everywhere else depth) for depth in depths])
        draws = gumbel_argmax(logits, scale, keys).tolist()
        out.append(accept_drawn(TREE, draws).emitted)
    return out


def test_first_and_second_tokens_follow_the_target():
    runs = emitted(30000)
    first = torch.bincount(torch.tensor([r[0] for r in runs]), minlength=6).double()
    assert chi_square_p_value(first, P[0]) > P_VALUE
    # after accepting node 1 (token 2), the next token is drawn at node 1: distributed as P[1]
    second = torch.bincount(torch.tensor([r[1] for r in runs if r[0] == 2]), minlength=6).double()
    assert second.sum() > 4000
    assert chi_square_p_value(second, P[1]) > P_VALUE
    # node 2 (token 4) is a leaf: the bonus after it is drawn at row 2, distributed as P[2]
    bonus = torch.bincount(torch.tensor([r[1] for r in runs if r[0] == 4]), minlength=6).double()
    assert chi_square_p_value(bonus, P[2]) > P_VALUE


def test_reusing_one_noise_for_every_position_is_caught():
    """The same noise at depth 0 and 1 ties the second token to the first: rejected."""
    runs = emitted(30000, same_noise_everywhere=True)
    second = torch.bincount(torch.tensor([r[1] for r in runs if r[0] == 2]), minlength=6).double()
    assert chi_square_p_value(second, P[1]) < P_VALUE


def test_a_drafted_token_is_accepted_exactly_when_it_is_the_draw():
    result = accept_drawn(TREE, [4, 0, 3, 1])  # the root draws 4: node 2 (a leaf), then its draw 3
    assert (result.accepted_nodes, result.next_token, result.is_bonus) == ([2], 3, True)
    result = accept_drawn(TREE, [1, 0, 3, 1])  # no child is 1: 1 is the recovered token
    assert (result.accepted_nodes, result.emitted, result.is_bonus) == ([], [1], False)
    result = accept_drawn(TREE, [2, 0, 3, 1])  # node 1, whose child 5 is not its draw 0
    assert (result.accepted_nodes, result.emitted, result.is_bonus) == ([1], [2, 0], False)


class ScriptProposer:
    """Drafts the tokens of a known completion, every third one replaced by a wrong token (so
    rejections and recovered tokens happen), as a chain under the root."""

    name = "script"
    tap_layers = ()

    def __init__(self, completion: list[int]) -> None:
        self.completion = completion
        self.prompt_len = 0

    def begin(self, target, prompt_ids, params) -> None:
        self.prompt_len = len(prompt_ids)

    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        position = len(token_ids) - self.prompt_len  # output tokens so far, the root included
        tokens = self.completion[position : position + max_nodes]
        tokens = [t if (position + i) % 3 else (t + 1) % 49152 for i, t in enumerate(tokens)]
        return DraftTree.chain(tokens)

    def observe(self, tree, result, output) -> None:
        pass


def test_seeded_speculative_sampling_equals_plain_sampling(tiny_target):
    """Each position's draw uses that position's noise, in a plain step or at a tree node: with
    the same seed, the speculative output equals the plain one token for token."""
    from eyas.engine.generate import generate
    from eyas.engine.sampling import SamplingParams
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.policy import PolicyConfig

    prompt = list(range(300, 312))
    for seed in range(4):
        params = SamplingParams(max_tokens=24, temperature=1.0, seed=seed, ignore_eos=True)
        plain = generate(tiny_target, prompt, params).token_ids
        assert plain == generate(tiny_target, prompt, params).token_ids  # reproducible
        proposer = ScriptProposer(plain)
        spec = speculative_generate(tiny_target, prompt, params, proposer, 4,
                                    policy=PolicyConfig(enabled=False))
        assert spec.token_ids == plain
        assert spec.stats["speculative"]["accepted_tokens"] > 0
    other = generate(tiny_target, prompt, SamplingParams(max_tokens=24, temperature=1.0, seed=99,
                                                         ignore_eos=True)).token_ids
    assert other != plain
