"""Log-probabilities of chosen tokens and their most likely alternatives.

Which distribution: the target's raw one, log_softmax of its logits at that position, before
logit_bias, penalties, grammar masks, temperature, top-k and top-p (vLLM's default,
`logprobs_mode="raw_logprobs"`). It is what the model thinks of the token, whatever the
sampling settings, and it is the same with and without speculation: with drafts, an emitted
token's row is the verification pass's row of its parent node (the root for the first), the
same position plain decoding computes in its one-token pass (equal up to float rounding).

Usage:
    from eyas.engine.logprobs import token_logprobs
    entries = token_logprobs(logits[rows], tokens, top=5)   # one TokenLogprob per token
"""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Sequence

import torch
from torch import Tensor


@dataclass
class TokenLogprob:
    token: int
    logprob: float
    top: list[tuple[int, float]] = field(default_factory=list)  # (token, logprob), best first


def token_logprobs(logits: Tensor, tokens: Sequence[int], top: int) -> list[TokenLogprob]:
    """logits [E, V] (raw, any float), tokens [E] chosen at those rows -> one entry each, with
    the `top` most likely tokens of the row."""
    if not len(tokens):
        return []
    logp = torch.log_softmax(logits.float(), dim=-1)  # [E, V]
    index = torch.tensor(list(tokens), dtype=torch.long, device=logp.device)
    chosen = logp.gather(1, index[:, None])[:, 0].tolist()  # [E]
    alternatives: list[list[tuple[int, float]]] = [[] for _ in tokens]
    if top:
        values, ids = logp.topk(top, dim=-1)  # [E, top] each, best first
        alternatives = [list(zip(i, v)) for i, v in zip(ids.tolist(), values.tolist())]
    return [TokenLogprob(token, value, alts)
            for token, value, alts in zip(tokens, chosen, alternatives)]
