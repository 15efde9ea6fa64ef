"""`eagle3`: an EAGLE-3 head drafts a dynamic tree (EAGLE-2 expansion) from the target's taps.

Rows of the head: the row at position p reads (feature of p, token p + 1) and predicts token
p + 2. Committed rows (positions 0..n-1 after a prompt of n tokens and root x_n) use the
target's fused taps; tree rows use the head's own output of their parent row.

Per step:
1. Catch up: the head runs over the rows that the last verification made final (root and the
   accepted tokens, with the target's taps from that same pass), extending its committed KV.
2. Expand: depth 1 = top-k of the last committed row; each further level expands the current
   top-k nodes (by cumulative log-probability) together in one head pass, each yielding top-k
   children; every child stays a candidate.
3. Rerank: the best `total_tokens - 1` candidates by cumulative score (a child never outscores
   its parent, so they form a connected subtree), ordered parents first.
Tree rows are scratch: only committed rows stay in the head's KV.
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import Tensor

from eyas.engine.speculative.draft import DraftTree
from eyas.errors import EyasError


@dataclass
class TreeShape:
    depth: int = 4  # expansion levels
    top_k: int = 2  # children per expanded node, and nodes expanded per level
    total_tokens: int = 8  # root + drafts sent to verification

    def __post_init__(self) -> None:
        if self.depth < 1 or self.top_k < 1 or self.total_tokens < 2:
            raise EyasError("tree shape needs depth >= 1, top_k >= 1, total_tokens >= 2")

    @classmethod
    def parse(cls, text: str) -> TreeShape:
        """'chain:K' or 'DEPTH,TOPK,TOTAL'."""
        try:
            if text.startswith("chain:"):
                k = int(text.split(":", 1)[1])
                return cls(depth=k, top_k=1, total_tokens=k + 1)
            depth, top_k, total = (int(x) for x in text.split(","))
            return cls(depth, top_k, total)
        except ValueError as error:
            raise EyasError(f"bad tree shape '{text}'; accepted: chain:K or DEPTH,TOPK,TOTAL") from error


@dataclass
class _Node:
    token: int  # target id
    parent: int  # index into the candidate list, -1 = the root
    score: float  # cumulative log-probability
    depth: int
    hidden_row: int  # row of the head pass that produced this node's distribution's input


class Eagle3Proposer:
    name = "eagle3"

    def __init__(self, head, shape: TreeShape | None = None) -> None:
        self.head = head
        self.shape = shape or TreeShape()
        self.tap_layers = tuple(head.config.target_layer_ids)
        self.past: tuple[Tensor, Tensor] | None = None  # committed KV [1, KV, n, D]
        self.committed = 0  # committed rows (= positions 0..committed-1)
        self.pending_taps: Tensor | None = None  # [1, m, 3H] taps of rows to commit
        self.last_hidden: Tensor | None = None  # [1, 1, H] output of the last committed row
        self.last_logits: Tensor | None = None  # [1, N] its draft logits

    def begin(self, target, prompt_ids, params) -> None:
        if target.model.embed_tokens.weight.shape[0] != self.head.config.vocab_size:
            raise EyasError("the EAGLE-3 head was trained for a target with another vocabulary")
        self.past, self.committed, self.pending_taps = None, 0, None
        self.last_hidden = self.last_logits = None

    # -- feedback from the target ---------------------------------------------------------
    def observe(self, tree, result, output) -> None:
        """Keep the taps of the rows that became final: all prompt rows after the prefill,
        the root and the accepted nodes after a verification."""
        if output is None or output.taps is None:
            return
        if result is None:  # the prefill
            taps = output.taps
        else:
            rows = torch.tensor([0] + list(result.accepted_nodes), device=output.taps.device)
            taps = output.taps[:, rows]
        # Plain steps (no propose in between) pile up rows; the next catch-up takes them all.
        self.pending_taps = taps if self.pending_taps is None else torch.cat([self.pending_taps, taps], 1)

    # -- drafting -------------------------------------------------------------------------
    @torch.inference_mode()
    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        self._catch_up(token_ids)
        if max_nodes <= 0 or self.last_logits is None:
            return DraftTree.empty()
        budget = min(self.shape.total_tokens - 1, max_nodes)
        candidates = self._expand(token_ids, budget)
        return self._rerank(candidates, budget)

    def _catch_up(self, token_ids: list[int]) -> None:
        if self.pending_taps is None:
            return
        taps = self.pending_taps.to(self.head.fc.weight.dtype)
        count = taps.shape[1]
        start = self.committed
        if start + count + 1 > len(token_ids):
            # rows need the token one position later; plain steps leave gaps we cannot fill
            self.pending_taps = None
            return
        device = taps.device
        ids = torch.tensor([token_ids[start + 1 : start + count + 1]], device=device)
        positions = torch.arange(start, start + count, device=device)[None]
        out = self.head(taps, ids, positions, past_kv=self.past)
        self.past = out.past_kv
        self.committed += count
        self.last_hidden = out.hidden[:, -1:]
        self.last_logits = out.logits[:, -1]
        self.pending_taps = None

    def _expand(self, token_ids: list[int], budget: int) -> list[_Node]:
        head, shape = self.head, self.shape
        device = self.last_logits.device
        log_probs = torch.log_softmax(self.last_logits.float(), dim=-1)[0]  # [N]
        k = min(shape.top_k, budget)
        top = torch.topk(log_probs, k)
        targets = head.draft_to_target(top.indices).tolist()
        candidates = [_Node(t, -1, float(s), 1, -1) for t, s in zip(targets, top.values.tolist())]
        frontier = list(range(len(candidates)))
        hidden_of: dict[int, Tensor] = {}  # candidate -> its row's output hidden [H]
        parent_hidden = self.last_hidden[0, 0]
        tree_keys: list[int] = []  # candidate id of each tree row in the scratch KV
        past = self.past
        for depth in range(2, shape.depth + 1):
            if not frontier:
                break
            # One head pass over the frontier rows: hidden = parent's output, token = node's.
            hiddens = torch.stack([hidden_of.get(candidates[c].parent, parent_hidden)
                                   if candidates[c].parent >= 0 else parent_hidden
                                   for c in frontier])[None]  # [1, F, H]
            ids = torch.tensor([[candidates[c].token for c in frontier]], device=device)
            position = self.committed + depth - 2  # a depth-d node's row is at n + d - 1
            positions = torch.full((1, len(frontier)), position, device=device)
            mask = self._tree_mask(candidates, frontier, tree_keys, device)
            out = head(hiddens, ids, positions, attn_mask=mask, past_kv=past)
            past = out.past_kv
            tree_keys.extend(frontier)
            scores = torch.log_softmax(out.logits.float(), dim=-1)[0]  # [F, N]
            child_top = torch.topk(scores, shape.top_k, dim=-1)
            children: list[int] = []
            for row, parent in enumerate(frontier):
                hidden_of[parent] = out.hidden[0, row]
                child_targets = head.draft_to_target(child_top.indices[row]).tolist()
                for token, score in zip(child_targets, child_top.values[row].tolist()):
                    candidates.append(_Node(token, parent, candidates[parent].score + score, depth, row))
                    children.append(len(candidates) - 1)
            children.sort(key=lambda c: -candidates[c].score)
            frontier = children[: shape.top_k]
        return candidates

    def _tree_mask(self, candidates: list[_Node], frontier: list[int], tree_keys: list[int],
                   device: torch.device) -> Tensor:
        """[1, F, committed + len(tree_keys) + F]: committed rows, ancestors among earlier tree
        rows, and itself."""
        columns = self.committed + len(tree_keys) + len(frontier)
        mask = torch.zeros(1, len(frontier), columns, dtype=torch.bool, device=device)
        mask[0, :, : self.committed] = True
        where = {c: self.committed + i for i, c in enumerate(tree_keys)}
        for row, node in enumerate(frontier):
            ancestor = candidates[node].parent
            while ancestor >= 0:
                mask[0, row, where[ancestor]] = True
                ancestor = candidates[ancestor].parent
            mask[0, row, self.committed + len(tree_keys) + row] = True
        return mask

    def _rerank(self, candidates: list[_Node], budget: int) -> DraftTree:
        order = sorted(range(len(candidates)), key=lambda c: (-candidates[c].score, candidates[c].depth))
        kept = set(order[:budget])
        kept_sorted = sorted(kept, key=lambda c: (candidates[c].depth, -candidates[c].score))
        node_of = {c: i + 1 for i, c in enumerate(kept_sorted)}
        tokens, parents = [], []
        for c in kept_sorted:
            parent = candidates[c].parent
            if parent >= 0 and parent not in node_of:
                continue  # cannot happen with log-probabilities; guards ties
            tokens.append(candidates[c].token)
            parents.append(node_of.get(parent, 0))
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))
