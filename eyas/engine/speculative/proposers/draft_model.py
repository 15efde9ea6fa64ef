"""`model`: a separate, smaller draft model with the target's tokenizer; `self`: the target
drafts for itself (for tests: every greedy draft is accepted).

The draft model keeps its own KV cache. It drafts a chain of k tokens autoregressively
(greedy: argmax; sampling: drawn from its own distribution under the same temperature, top-k
and top-p, with those probabilities handed to the verifier). After verification its cache is
rolled back to the longest prefix that is still valid: nothing is recomputed.
"""

from __future__ import annotations

import torch

from eyas.engine.generate import new_cache
from eyas.engine.sampling import SamplingParams, sample_from, target_probs
from eyas.engine.speculative.draft import DraftTree
from eyas.engine.target import Target
from eyas.errors import EyasError


def check_same_tokenizer(target: Target, draft: Target) -> None:
    a, b = target.tokenizer, draft.tokenizer
    probe = "Speculative decoding: 123 tokens, déjà vu! <|im_end|>"
    if len(a) != len(b) or a.get_vocab() != b.get_vocab() or a(probe)["input_ids"] != b(probe)["input_ids"]:
        raise EyasError(
            f"the draft model's tokenizer differs from the target's ({len(b)} vs {len(a)} tokens); "
            "a draft model must share the target's tokenizer"
        )


class DraftModelProposer:
    tap_layers: tuple[int, ...] = ()

    def __init__(self, draft: Target, name: str = "model", slots: int = 4096) -> None:
        self.draft = draft
        self.name = name
        self.slots = slots
        self.cache = None
        self.cached_ids: list[int] = []  # tokens whose keys/values are in the draft cache
        self.params = SamplingParams()
        self.generator: torch.Generator | None = None
        self.checked_targets: set[int] = set()

    def begin(self, target: Target, prompt_ids: list[int], params: SamplingParams) -> None:
        if self.draft is not target and id(target) not in self.checked_targets:
            check_same_tokenizer(target, self.draft)
            self.checked_targets.add(id(target))
        self.params = params
        self.generator = None
        if params.seed is not None:
            self.generator = torch.Generator(device=self.draft.device).manual_seed(params.seed + 7919)
        slots = min(self.slots, self.draft.config.context_length)
        self.cache = new_cache(self.draft, 1, slots)
        self.cached_ids = []

    def _common_prefix(self, token_ids: list[int]) -> int:
        limit = min(len(self.cached_ids), len(token_ids) - 1)  # the root is always fed again
        for index in range(limit):
            if self.cached_ids[index] != token_ids[index]:
                return index
        return limit

    @torch.inference_mode()
    def propose(self, token_ids: list[int], max_nodes: int) -> DraftTree:
        if max_nodes <= 0 or len(token_ids) + max_nodes >= self.cache.max_slots:
            return DraftTree.empty()
        model, device = self.draft.model, self.draft.device
        # 1. Catch up: feed what the cache has not seen (at least the root).
        valid = self._common_prefix(token_ids)
        pending = torch.tensor([token_ids[valid:]], device=device)
        logits = model(pending, cache=self.cache, write_at=valid, logits_at="last").logits[:, -1]
        self.cached_ids = list(token_ids)
        # 2. Draft a chain, feeding each draft token but the last.
        drafts: list[int] = []
        probs_rows: list[torch.Tensor] = []
        for step in range(max_nodes):
            if self.params.greedy:
                token = int(logits.argmax(dim=-1))
            else:
                probs = target_probs(logits, self.params)[0]  # [V]
                token = int(sample_from(probs[None], self.generator))
                probs_rows.append(probs)
            drafts.append(token)
            if step + 1 < max_nodes:
                position = len(self.cached_ids)
                logits = model(torch.tensor([[token]], device=device), cache=self.cache,
                               write_at=position, logits_at="last").logits[:, -1]
                self.cached_ids.append(token)
        probs = torch.stack(probs_rows) if probs_rows else None
        return DraftTree.chain(drafts, probs)

    def observe(self, tree, result, output) -> None:
        pass  # the next propose() finds the valid prefix by comparing token ids
