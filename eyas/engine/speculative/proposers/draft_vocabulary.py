"""A draft model's greedy guesses over part of its vocabulary, for a cheaper draft pass.

A small draft model with a large vocabulary spends much of each pass in its output layer: the
Qwen2.5-Coder-0.5B's int8 screen reads 136 MB of its ~360 MB a token (151,936 x 896). Greedy
drafting needs only a guess, so the draft may look at the first `size` token ids (byte-level
BPE vocabularies number their tokens by merge order, frequent first: ids below 65,536 are
~97% of the MT-Bench and code prompts' tokens) plus the special tokens (end of turn). A target
token outside the subset is never drafted: a chain ends one token earlier there, and the output
is the target's either way. The subset's argmax is exact within the subset (the same screen
and re-check as the full output layer, models/output_layer.py). The subset is padded with the
next ids to a multiple of 16 rows, so that its screen runs in the extension's int8 kernel
(PyTorch's screen over 65,538 rows cost more than the extension's over all 151,936).

The same subset serves a draft that draws with the target's noise (coupled_draws.py): its draw
is the subset's Gumbel draw with each token id's noise (`draw`).

Usage:
    vocabulary = DraftVocabulary.build(draft_target, size=65536)   # None if not worth it
    token = vocabulary.token(int(vocabulary.logits(hidden).argmax()))   # hidden [1, H]
    token = vocabulary.draw(hidden, inverse_temperature(0.7), noise_key(base, position))
"""

from __future__ import annotations

import numpy as np
import torch
from torch import Tensor

from eyas.models.output_layer import ScreenedOutputLayer

MIN_SAVING = 2  # the subset is used only if the vocabulary is at least this many times larger
ROW_MULTIPLE = 16  # the extension's int8 screen takes a vocabulary of a multiple of 16 rows


class SubsetRows:
    """The rows `ids` of an output layer's weight, in the row-source interface that
    ScreenedOutputLayer reads (no float copy held)."""

    has_table = False

    def __init__(self, lm_head: ScreenedOutputLayer, ids: np.ndarray, hidden_size: int) -> None:
        self.lm_head = lm_head
        self.ids = ids  # [N] token ids, ascending
        self.num_embeddings, self.embedding_dim = len(ids), hidden_size

    def rows(self, indices: np.ndarray) -> np.ndarray:  # [n] subset indices -> [n, H] float32
        ids = self.ids[np.asarray(indices)]
        source = getattr(self.lm_head, "row_source", None)
        if source is not None and not source.has_table:
            return source.rows(ids)
        return self.lm_head.full_weight()[torch.from_numpy(ids)].float().numpy()


class DraftVocabulary:
    def __init__(self, ids: np.ndarray, layer: ScreenedOutputLayer) -> None:
        self.ids = torch.from_numpy(ids)  # [N]
        self.layer = layer

    @staticmethod
    def build(draft, size: int = 65536) -> DraftVocabulary | None:
        """The subset for `draft` (a Target), or None where its output layer is no screen or
        its vocabulary is not MIN_SAVING times `size`."""
        lm_head = draft.model.lm_head
        if not isinstance(lm_head, ScreenedOutputLayer) or lm_head.out_features < MIN_SAVING * size:
            return None
        special = [i for i in draft.tokenizer.all_special_ids if size <= i < lm_head.out_features]
        special += [i for i in getattr(draft, "eos_token_ids", ()) if size <= i < lm_head.out_features]
        ids = np.unique(np.concatenate([np.arange(size), np.array(special, dtype=np.int64)]))
        ids = padded(ids, lm_head.out_features)
        return DraftVocabulary(ids, ScreenedOutputLayer(SubsetRows(lm_head, ids, draft.config.hidden_size)))

    @property
    def screened_in_extension(self) -> bool:
        """Whether the subset's screen runs in the extension's int8 kernel (else PyTorch's,
        several times slower per row and slower than the whole vocabulary's extension screen)."""
        return bool(self.layer.int8dot)

    def logits(self, hidden: Tensor) -> Tensor:  # [R, H] after the final norm -> [R, N]
        """The subset's logits, exact at their argmax only."""
        return self.layer.greedy_logits(hidden.float())

    def draw(self, hidden: Tensor, inverse_temperature: float, key: int) -> int:
        """The subset's Gumbel draw for hidden [1, H] after the final norm: the token id of
        argmax over the subset of l * (1/T) + g, g the noise of `key` at each token id (the
        noise the target draws that position with, engine/speculative/coupled_draws.py),
        through the subset's screen (only the ids that can still win are computed exactly)."""
        index = self.layer.sample_tokens(hidden.float().reshape(1, -1),
                                         torch.tensor([inverse_temperature], dtype=torch.float32),
                                         torch.tensor([key], dtype=torch.int64), noise_ids=self.ids)
        return int(self.ids[int(index[0])])

    def token(self, index: int) -> int:
        """The token id of the subset's `index`-th logit."""
        return int(self.ids[index])


def padded(ids: np.ndarray, vocab: int) -> np.ndarray:
    """`ids` (ascending) and the lowest ids not among them, up to a multiple of ROW_MULTIPLE
    rows (where the vocabulary has them), so that the subset's screen is the extension's."""
    missing = -len(ids) % ROW_MULTIPLE
    if missing == 0:
        return ids
    extra = np.setdiff1d(np.arange(min(vocab, int(ids.max()) + 1 + missing)), ids)[:missing]
    return np.unique(np.concatenate([ids, extra]))
