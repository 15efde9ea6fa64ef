"""`medusa`: K Medusa heads read the target's last hidden state and guess the K tokens after
the root; their top-k guesses are combined into a tree that the target verifies as usual.

After each verification the proposer keeps the target's hidden state at the last accepted
position p (the row that predicted the root, token p + 1); head k's top candidates are the
tree's depth-k tokens (token p + 1 + k). The heads do not see the draft tokens above them, so
every depth-k node of a tree holds one of the same top-k tokens of head k; what differs between
tree shapes is which paths of ranks are kept:

- auto (default): by the heads' own probabilities this step. A path of ranks (r_1..r_d) scores
  log p_1(r_1) + ... + log p_d(r_d); the best `budget` paths are found best-first (a child never
  outscores its parent, so they form a tree), budget = the step's draft-token budget.
- DEPTH,TOPK,TOTAL: a static tree: the best TOTAL - 1 paths of depth <= DEPTH and rank < TOPK
  under fixed rank priors (P(rank r correct) = 0.55, 0.12, 0.05, 0.03 at every depth), the
  same shape every step (Medusa's sparse trees are built the same way from measured accuracies).
- chain:K: the top-1 of heads 1..K.

Verification is the ordinary lossless tree verification (greedy: exact; sampling: the
point-mass tree rule); there is no "typical acceptance".
"""

from __future__ import annotations

import heapq
import math

import torch
from torch import Tensor

from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.draft import DraftTree, VerifyResult
from eyas.engine.speculative.proposers.eagle3 import TreeShape
from eyas.engine.target import Target
from eyas.errors import EyasError
from eyas.medusa.head import MedusaHeads
from eyas.models.llama import ForwardOutput

PRIOR_RANKS = (0.55, 0.12, 0.05, 0.03)  # static trees: P(head's rank-r token is right)
AUTO_TOP_K = 4  # candidates per head in auto trees


def best_paths(log_scores: Tensor, budget: int) -> list[tuple[int, int, int]]:
    """Best-first tree over rank paths. log_scores [D, R]: score of rank r at depth d + 1.

    Returns nodes (parent node, depth, rank) in pop order: node i + 1 of the tree, parents
    first (parent 0 = the root), at most `budget` of them.
    """
    scores = log_scores.tolist()
    depth_limit, ranks = len(scores), len(scores[0]) if scores else 0
    heap = [(-scores[0][r], 0, 1, r, 0) for r in range(ranks)] if depth_limit else []
    heapq.heapify(heap)
    nodes: list[tuple[int, int, int]] = []
    counter = ranks
    while heap and len(nodes) < budget:
        negative, _, depth, rank, parent = heapq.heappop(heap)
        nodes.append((parent, depth, rank))
        if depth < depth_limit:
            node = len(nodes)
            for child_rank in range(ranks):
                counter += 1  # insertion order breaks ties: parents stay before children
                heapq.heappush(heap, (negative - scores[depth][child_rank], counter, depth + 1,
                                      child_rank, node))
    return nodes


def static_scores(depth: int, top_k: int) -> Tensor:
    """[depth, top_k] log rank priors for static trees."""
    priors = [PRIOR_RANKS[r] if r < len(PRIOR_RANKS) else PRIOR_RANKS[-1] / (r + 1)
              for r in range(top_k)]
    return torch.tensor([[math.log(p) for p in priors]] * depth)


class MedusaProposer:
    name = "medusa"
    tap_layers: tuple[int, ...] = ()

    def __init__(self, heads: MedusaHeads, shape: TreeShape | None = None) -> None:
        self.heads = heads
        self.shape = shape  # None: auto (the heads' probabilities)
        if shape is not None and shape.depth > heads.config.num_heads:
            raise EyasError(f"--tree asks for depth {shape.depth}, but these Medusa heads draft "
                            f"{heads.config.num_heads} tokens ahead at most")
        self.last_hidden: Tensor | None = None  # [H] target hidden state at the last accepted row
        self.coupling = None  # CoupledDraws of a request whose tokens are Gumbel draws (draw_with)
        self.target_ids: Tensor | None = None  # [N] int64: the target id of each draft id

    def begin(self, target: Target, prompt_ids: list[int], params: SamplingParams) -> None:
        config = self.heads.config
        if (target.config.vocab_size, target.config.hidden_size) != (config.vocab_size, config.hidden_size):
            raise EyasError(f"the Medusa heads were trained for a target of hidden size "
                            f"{config.hidden_size} / vocabulary {config.vocab_size}; this one has "
                            f"{target.config.hidden_size} / {target.config.vocab_size}")
        self.last_hidden = None
        self.coupling = None

    def draw_with(self, coupling) -> None:
        """This request's tokens are Gumbel draws with known noise (coupled_draws.py): head k's
        candidates are ranked by its logits / T plus the noise of the position k + 1 ahead."""
        self.coupling = coupling
        if self.target_ids is None:
            ids = torch.arange(self.heads.config.output_size)
            device = next(self.heads.parameters()).device
            self.target_ids = self.heads.draft_to_target(ids.to(device)).long().cpu()

    def stats(self) -> dict:
        shape = self.shape
        tree = "auto" if shape is None else f"{shape.depth},{shape.top_k},{shape.total_tokens}"
        return {"tree": tree, "heads": self.heads.config.num_heads}

    def observe(self, tree: DraftTree, result: VerifyResult | None,
                output: ForwardOutput | None) -> None:
        """Keep the hidden state of the row that predicted the next root."""
        if output is None:
            return
        if result is None:  # a prefill (chunk): its last row
            row = output.hidden.shape[1] - 1
        else:
            row = result.accepted_nodes[-1] if result.accepted_nodes else 0
        self.last_hidden = output.hidden[0, row]

    @torch.inference_mode()
    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        if max_nodes <= 0 or self.last_hidden is None:
            return DraftTree.empty()
        heads = self.heads
        # 1. The K heads' log-probabilities at the last accepted row: [K, N].
        hidden = self.last_hidden.to(next(heads.blocks.parameters()).dtype)
        logits = heads(hidden[None, None])[0, 0].float()  # [K, N]
        if self.coupling is not None:  # head k guesses the token k + 1 positions ahead
            coupling = self.coupling
            logits = torch.stack([coupling.scores(row, self.target_ids, coupling.position(len(token_ids), k + 1))
                                  for k, row in enumerate(logits)])
        log_probs = torch.log_softmax(logits, dim=-1)
        # 2. Rank scores per depth: the heads' own (auto) or fixed priors (static trees).
        if self.shape is None:
            depth, top_k, budget = heads.config.num_heads, AUTO_TOP_K, max_nodes
            top = torch.topk(log_probs, min(top_k, log_probs.shape[-1]), dim=-1)
            scores = top.values
        else:
            depth, top_k = self.shape.depth, self.shape.top_k
            budget = min(max_nodes, self.shape.total_tokens - 1)
            top = torch.topk(log_probs[:depth], min(top_k, log_probs.shape[-1]), dim=-1)
            scores = static_scores(depth, top.indices.shape[-1])
        candidates = heads.draft_to_target(top.indices).tolist()  # [depth][rank] target ids
        # 3. The best paths become the tree.
        nodes = best_paths(scores[:depth], budget)
        tokens = [candidates[d - 1][r] for _, d, r in nodes]
        parents = [p for p, _, _ in nodes]
        return DraftTree(torch.tensor(tokens, dtype=torch.long), torch.tensor(parents, dtype=torch.long))


def build_medusa(target: Target, option: str, tree: str | None) -> MedusaProposer:
    """The proposer of a `medusa:DIR` spec; `tree`: auto, chain:K or DEPTH,TOPK,TOTAL."""
    from eyas.medusa.checkpoint import load_medusa

    if not option:
        raise EyasError("--draft medusa needs a folder of heads: medusa:DIR (OUT/head of "
                        "`eyas train --method medusa`)")
    dtype = torch.float32 if target.precision == "int4" else target.dtype
    heads = load_medusa(option, device=target.device, dtype=dtype)
    config = heads.config
    if config.target_num_hidden_layers not in (None, target.config.num_hidden_layers) or \
            (config.vocab_size, config.hidden_size) != (target.config.vocab_size, target.config.hidden_size):
        raise EyasError(f"the Medusa heads in {option} were trained for another target "
                        f"({config.target_model or 'unnamed'}: hidden {config.hidden_size}, vocabulary "
                        f"{config.vocab_size}, {config.target_num_hidden_layers} layers)")
    if config.shares_target_output:
        heads.set_output_layer(target.model.lm_head)
    shape = TreeShape.parse(tree) if tree and tree != "auto" else None
    return MedusaProposer(heads, shape)
