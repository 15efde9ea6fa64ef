"""The EAGLE-3 proposer's per-step path (kept buffers, masks left out for chains, sliced RoPE
tables and taps, the output layer's kernels called directly, draft ids mapped in Python)
against a plain reference of the same steps: every tensor created anew, a tril mask for
committed rows, an explicit tree mask at every level, indexed taps and tables, the head's modules.
On the shipped SmolLM2 head beside the int4 target (the fused head), run in lockstep over real
decoding: the same trees (tokens, parents), the same candidates' scores bit for bit, the same
head logits and KV cache."""

from __future__ import annotations

import shutil
import struct

import pytest
import torch
from torch import Tensor

from eyas.eagle3.fused import FusedHead, HeadCache
from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.policy import PolicyConfig
from eyas.engine.speculative.proposers.eagle3 import Eagle3Proposer, TreeShape, _Node
from eyas.models import extension

pytestmark = pytest.mark.skipif(shutil.which("c++") is None and shutil.which("g++") is None,
                                reason="no C++ compiler to build the extension")


def reference_run(fused: FusedHead, hidden: Tensor, input_ids: Tensor, positions: Tensor, first_slot: int,
                  cache: HeadCache, mask: Tensor | None) -> Tensor:
    """FusedHead.run with every tensor made per call (hidden [T, *], ids, positions [T])."""
    head, length = fused.head, input_ids.shape[0]
    if hidden.shape[-1] == head.config.fused_input_size:
        hidden = head.fc(hidden)
    hidden = hidden.float().contiguous()
    kv_len = first_slot + length
    cache.ensure(kv_len)
    if mask is None and length > 1:
        mask = torch.ones(length, kv_len, dtype=torch.bool).tril(first_slot)
    slots = torch.arange(first_slot, kv_len)[None]
    embeds = head.embed_tokens(input_ids).float().contiguous()
    cos, sin = fused.rope(positions)  # indexed tables
    attn = head.midlayer.self_attn
    return extension.module().int4_decoder_layer(
        hidden, *fused.weights, 32, fused.eps, cos, sin, cache.keys, cache.values, slots, kv_len,
        None if mask is None else mask[None], attn.num_heads, attn.num_kv_heads, embeds, fused.norm_embeds)


class ReferenceProposer(Eagle3Proposer):
    """The steps written plainly: taps indexed, positions as tensors, a mask at every level."""

    def observe(self, tree, result, output) -> None:
        if result is None or output is None or output.taps is None:
            return super().observe(tree, result, output)
        if tree is not None and tree.size:
            self._record_ranks(tree, result)
        taps = output.taps[:, torch.tensor([0] + list(result.accepted_nodes))]
        self.pending_taps.append(taps)
        self.pending_positions.append(self.next_position)
        self.next_position += taps.shape[1]
        self.pending_unverified += [not any(self.node_ranks)] * taps.shape[1]

    def _logits(self, hidden: Tensor) -> Tensor:
        return self.head.compute_logits(hidden)[0]

    def _head_pass(self, hidden, ids, positions, mask, scratch=None) -> Tensor:
        first_slot = self.committed + (scratch or 0)
        return reference_run(self.fused, hidden[0], torch.tensor(ids), torch.tensor(positions), first_slot, self.kv,
                             None if mask is None else mask[0])[None]

    def _expand(self, token_ids: list[int], budget: int) -> list[_Node]:
        head, shape = self.head, self.shape
        log_probs = torch.log_softmax(self.last_logits.float(), dim=-1)[0]
        top = torch.topk(log_probs, min(shape.top_k, budget))
        targets = head.draft_to_target(top.indices).tolist()
        candidates = [_Node(t, -1, float(s), 1, r + 1)
                      for r, (t, s) in enumerate(zip(targets, top.values.tolist()))]
        frontier = list(range(len(candidates)))
        hidden_of: dict[int, Tensor] = {}
        tree_keys: list[int] = []
        for depth in range(2, min(shape.depth, budget) + 1):
            if not frontier:
                break
            hiddens = torch.stack([hidden_of.get(candidates[c].parent, self.last_hidden[0, 0])
                                   for c in frontier])[None]
            ids = [candidates[c].token for c in frontier]
            columns = self.committed + len(tree_keys) + len(frontier)
            mask = torch.zeros(1, len(frontier), columns, dtype=torch.bool)
            mask[0, :, : self.committed] = True
            where = {c: self.committed + i for i, c in enumerate(tree_keys)}
            for row, node in enumerate(frontier):
                ancestor = candidates[node].parent
                while ancestor >= 0:
                    mask[0, row, where[ancestor]] = True
                    ancestor = candidates[ancestor].parent
                mask[0, row, self.committed + len(tree_keys) + row] = True
            out = self._head_pass(hiddens, ids, [self.last_position + depth - 1] * len(frontier), mask,
                                  scratch=len(tree_keys))
            tree_keys.extend(frontier)
            scores = torch.log_softmax(self._logits(out).float(), dim=-1)
            child_top = torch.topk(scores, shape.top_k, dim=-1)
            children = []
            for row, parent in enumerate(frontier):
                hidden_of[parent] = out[0, row]
                tokens = head.draft_to_target(child_top.indices[row]).tolist()
                for rank, (token, score) in enumerate(zip(tokens, child_top.values[row].tolist())):
                    candidates.append(_Node(token, parent, candidates[parent].score + score, depth, rank + 1))
                    children.append(len(candidates) - 1)
            children.sort(key=lambda c: -candidates[c].score)
            frontier = children[: shape.top_k]
        self.candidates = candidates
        return candidates


def bits(candidates: list[_Node]) -> list[tuple]:
    return [(c.token, c.parent, c.depth, c.rank, struct.pack("<d", c.score)) for c in candidates]


class Lockstep(Eagle3Proposer):
    """The proposer as shipped, with the reference fed the same steps and compared each time."""

    def __init__(self, head, shape: TreeShape) -> None:
        super().__init__(head, shape)
        self.reference = ReferenceProposer(head, shape)
        self.compared = 0

    def begin(self, target, prompt_ids, params) -> None:
        super().begin(target, prompt_ids, params)
        self.reference.begin(target, prompt_ids, params)

    def observe(self, tree, result, output) -> None:
        self.reference.observe(tree, result, output)
        super().observe(tree, result, output)

    def _expand(self, token_ids: list[int], budget: int) -> list[_Node]:
        self.candidates = super()._expand(token_ids, budget)
        return self.candidates

    def propose(self, token_ids: list[int], max_nodes: int):
        expected = self.reference.propose(token_ids, max_nodes)
        tree = super().propose(token_ids, max_nodes)
        assert torch.equal(tree.tokens, expected.tokens) and torch.equal(tree.parents, expected.parents)
        assert bits(self.candidates) == bits(self.reference.candidates)
        assert torch.equal(self.last_logits, self.reference.last_logits)
        assert self.committed == self.reference.committed
        assert torch.equal(self.kv.keys, self.reference.kv.keys)  # committed and tree rows
        assert torch.equal(self.kv.values, self.reference.kv.values)
        self.compared += 1
        return tree


@pytest.mark.parametrize("shape", ["4,3,8", "chain:3", "3,2,6"])
def test_the_proposer_drafts_the_references_trees_bit_for_bit(smollm_int4_target, mtbench_prompt_ids, shape):
    from eyas.engine.speculative.methods import build_proposer

    built = build_proposer("eagle3:smollm2-135m", smollm_int4_target, tree=shape)
    if built.fused is None:
        pytest.skip("no fused head here (no int8dot kernel: EYAS_FUSED=0 or a CPU without AVX2)")
    proposer = Lockstep(built.head, TreeShape.parse(shape))
    params = SamplingParams(max_tokens=24)
    for prompt in mtbench_prompt_ids[:2]:
        expected = generate(smollm_int4_target, prompt, params).token_ids
        result = speculative_generate(smollm_int4_target, prompt, params, proposer, 8,
                                      policy=PolicyConfig(enabled=False))
        assert result.token_ids == expected
    assert proposer.compared >= 8


def test_kept_buffers_equal_the_tensors_made_per_call(smollm_int4_target):
    from eyas.engine.speculative.methods import build_proposer

    fused = build_proposer("eagle3:smollm2-135m", smollm_int4_target, tree="chain:1").fused
    if fused is None:
        pytest.skip("no fused head here")
    for rows, first_slot in [(2, 0), (3, 7), (16, 600), (5, 1100), (17, 3)]:
        expected = torch.ones(rows, first_slot + rows, dtype=torch.bool).tril(first_slot)
        assert torch.equal(fused.causal_mask(rows, first_slot), expected)
        assert torch.equal(fused.slots(first_slot, rows), torch.arange(first_slot, first_slot + rows)[None])
    for positions in ([5], [3, 4, 5, 6], [9, 9, 9], [2, 3, 5, 6], [700, 1300]):
        cos, sin = fused.rope(positions)
        expected_cos, expected_sin = fused.rope(torch.tensor(positions))
        assert cos.is_contiguous() and torch.equal(cos, expected_cos) and torch.equal(sin, expected_sin)
