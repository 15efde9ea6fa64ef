"""How closely a model follows a reference on the reference's own answer, by teacher forcing:
the share of answer positions whose argmax agrees, and the mean KL(reference || model).

Usage:
    from eyas.bench.agreement import Agreement
    agreement = Agreement(reference, {"int4": int4_target, "int8": int8_target})
    agreement.add(prompt_ids, answer_ids)      # once per prompt: the reference's greedy answer
    agreement.top1("int4"), agreement.mean_kl("int4")

(scripts/int4-agreement.py and scripts/int8-agreement.py print these per path and precision.)
"""

from __future__ import annotations

import statistics
from typing import Any, Mapping

import torch
import torch.nn.functional as F

from eyas.models.kv_cache import KVCache


class Agreement:
    def __init__(self, reference: Any, models: Mapping[str, Any]) -> None:
        self.reference = reference
        self.models = dict(models)
        self.agree = {name: 0 for name in self.models}
        self.divergence: dict[str, list[float]] = {name: [] for name in self.models}
        self.positions = 0

    @torch.inference_mode()
    def add(self, prompt: list[int], answer: list[int]) -> None:
        """Each model reads prompt + answer in one pass; its logits at the answer positions are
        compared with the reference's."""
        if not answer:
            return
        ids = torch.tensor([list(prompt) + list(answer)])  # [1, P + A]
        start = len(prompt) - 1  # the row that predicts the first answer token
        expected = self.reference.model(ids).logits[0, start:-1].float()  # [A, V]
        for name, target in self.models.items():
            config = target.config
            cache = KVCache(config.num_hidden_layers, 1, config.num_key_value_heads, ids.shape[1],
                            config.head_dim, dtype=target.kv_dtype)
            logits = target.model(ids, cache=cache, write_at=0).logits[0, start:-1].float()  # [A, V]
            self.agree[name] += int((logits.argmax(-1) == expected.argmax(-1)).sum())
            self.divergence[name].append(F.kl_div(logits.log_softmax(-1), expected.log_softmax(-1),
                                                  log_target=True, reduction="batchmean").item())
        self.positions += len(answer)

    def top1(self, name: str) -> float:
        return self.agree[name] / max(self.positions, 1)

    def mean_kl(self, name: str) -> float:
        return statistics.mean(self.divergence[name]) if self.divergence[name] else 0.0
