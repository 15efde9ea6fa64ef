"""Sampling with speculation draws from exactly the target's distribution (chi-square tests),
and the same tests fail when the acceptance rule is deliberately broken."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.speculative import acceptance
from eyas.engine.speculative.acceptance import accept_sampling
from eyas.engine.speculative.draft import DraftTree
from stat_checks import chi_square_p_value, homogeneity_p_value

P_VALUE = 1e-3


P = torch.tensor([[0.30, 0.25, 0.20, 0.15, 0.10, 0.0],  # root row: the first emitted token
                  [0.05, 0.05, 0.10, 0.20, 0.30, 0.30],
                  [0.40, 0.10, 0.10, 0.10, 0.10, 0.20],
                  [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]], dtype=torch.float64)
Q = torch.tensor([[0.05, 0.10, 0.50, 0.05, 0.20, 0.10],
                  [0.30, 0.30, 0.10, 0.10, 0.10, 0.10],
                  [0.10, 0.10, 0.10, 0.10, 0.10, 0.50]], dtype=torch.float64)


def first_token_counts(make_tree, trials=20000, seed=0) -> torch.Tensor:
    generator = torch.Generator().manual_seed(seed)
    counts = torch.zeros(P.shape[1], dtype=torch.float64)
    for _ in range(trials):
        tree = make_tree(generator)
        result = accept_sampling(tree, P[: tree.size + 1], generator)
        counts[result.emitted[0]] += 1
    return counts


def sampled_chain(generator):
    tokens = [int(torch.multinomial(Q[i], 1, generator=generator)) for i in range(3)]
    return DraftTree.chain(tokens, draft_probs=Q.clone())


def top2_tree(generator):
    # deterministic drafts: two root children (2 and 4); node 1 has a child (5)
    return DraftTree(torch.tensor([2, 4, 5]), torch.tensor([0, 0, 1]))


@pytest.mark.parametrize("make_tree", [sampled_chain, top2_tree], ids=["chain-with-q", "top-k-tree"])
def test_first_emitted_token_follows_the_target(make_tree):
    counts = first_token_counts(make_tree)
    assert chi_square_p_value(counts, P[0]) > P_VALUE


def test_second_token_follows_the_target_after_an_accepted_first():
    generator = torch.Generator().manual_seed(1)
    counts = torch.zeros(P.shape[1], dtype=torch.float64)
    for _ in range(30000):
        tokens = [int(torch.multinomial(Q[i], 1, generator=generator)) for i in range(2)]
        tree = DraftTree.chain(tokens, draft_probs=Q[:2].clone())
        result = accept_sampling(tree, P[:3], generator)
        if result.accepted_tokens[:1] == [4]:
            counts[result.emitted[1]] += 1
    # after accepting token 4 at node 1, the next token is distributed as P[1]
    assert counts.sum() > 1000
    assert chi_square_p_value(counts, P[1]) > P_VALUE


def test_a_broken_rule_is_caught(monkeypatch):
    """Accepting every draft (no p/q test) must fail the same chi-square test."""

    def accept_everything(tree, target_probs, generator):
        from eyas.engine.speculative.draft import VerifyResult

        tokens = tree.tokens.tolist()
        bonus = int(torch.multinomial(target_probs[len(tokens)], 1, generator=generator))
        return VerifyResult(list(range(1, len(tokens) + 1)), tokens, bonus, True)

    monkeypatch.setattr(acceptance, "_accept_chain_with_q", accept_everything)
    counts = first_token_counts(sampled_chain, trials=5000)
    assert chi_square_p_value(counts, P[0]) < P_VALUE


def test_a_residual_without_subtracting_q_is_caught(monkeypatch):
    """Resampling from p instead of norm(max(0, p - q)) after a rejection is biased."""
    original = torch.Tensor.clamp

    def no_subtraction(tree, target_probs, generator):
        from eyas.engine.speculative.draft import VerifyResult

        tokens = tree.tokens.tolist()
        path = []
        for index, token in enumerate(tokens):
            p, q = target_probs[index], tree.draft_probs[index]
            if float(torch.rand((), generator=generator)) < min(1.0, float(p[token] / q[token])):
                path.append(index + 1)
                continue
            return VerifyResult(path, tokens[: len(path)],
                                int(torch.multinomial(p, 1, generator=generator)), False)
        return VerifyResult(path, tokens, int(torch.multinomial(target_probs[-1], 1, generator=generator)), True)

    assert original is torch.Tensor.clamp
    monkeypatch.setattr(acceptance, "_accept_chain_with_q", no_subtraction)
    counts = first_token_counts(sampled_chain, trials=20000)
    assert chi_square_p_value(counts, P[0]) < P_VALUE


def test_end_to_end_on_a_tiny_model_matches_plain_sampling(tiny_target, tmp_path_factory, smollm_tokenizer):
    """temperature 1, top-k 6: the second generated token's distribution, with a separate
    random draft model proposing, equals plain sampling's (many seeds)."""
    from tiny_models import build_tiny_model
    from eyas.engine.generate import generate
    from eyas.engine.sampling import SamplingParams
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.policy import PolicyConfig
    from eyas.engine.speculative.proposers.draft_model import DraftModelProposer
    from eyas.engine.target import load_target

    draft_dir = build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), smollm_tokenizer, seed=1)
    proposer = DraftModelProposer(load_target(str(draft_dir), dtype="float32"))
    prompt = list(range(200, 210))
    first = generate(tiny_target, prompt, SamplingParams(max_tokens=1)).token_ids[0]
    prompt = prompt + [first]  # fix the first token so the second is what speculation decides
    runs = 600

    def histogram(spec: bool) -> dict[int, int]:
        counts: dict[int, int] = {}
        for seed in range(runs):
            params = SamplingParams(max_tokens=2, temperature=1.0, top_k=6, seed=seed, ignore_eos=True)
            if spec:
                out = speculative_generate(tiny_target, prompt, params, proposer, 2,
                                           policy=PolicyConfig(enabled=False)).token_ids
            else:
                out = generate(tiny_target, prompt, params).token_ids
            key = out[1]
            counts[key] = counts.get(key, 0) + 1
        return counts

    plain, spec = histogram(False), histogram(True)
    p_value, dof = homogeneity_p_value(plain, spec)
    assert dof >= 2 and p_value > P_VALUE, (plain, spec)
