"""The head each training method starts from, and the module whose forward gives its K loss
terms (the trainer drives either the same way: micro batches, normalizer, AdamW, checkpoints).

    eagle3: Eagle3Head sharing the target's embedding; lm_head from the target's rows of the
            draft vocabulary; loss module TrainingTimeTest (ttt.py)
    medusa: MedusaHeads; their output layer is the target's lm_head (frozen, `share_lm_head`)
            or starts from its rows of the draft vocabulary; loss module MedusaLoss (medusa.py)
"""

from __future__ import annotations

import torch
from torch import Tensor, nn

from eyas.eagle3.config import Eagle3Config
from eyas.eagle3.head import Eagle3Head
from eyas.eagle3.vocab import DraftVocab
from eyas.features.target_io import TargetInfo
from eyas.medusa.config import MedusaConfig
from eyas.medusa.head import MedusaHeads
from eyas.training.config import TrainConfig
from eyas.training.medusa import MedusaLoss
from eyas.training.ttt import TrainingTimeTest


def build_eagle3(config: TrainConfig, info: TargetInfo, layer_ids: list[int], vocab: DraftVocab,
                 embedding: Tensor, lm_head_weight: Tensor, device: torch.device
                 ) -> tuple[Eagle3Head, nn.Module]:
    """embedding, lm_head_weight: the target's, [V, H] float32."""
    head_config = Eagle3Config.for_target(info.config, vocab.size, layer_ids,
                                          target_model=config.model,
                                          target_architectures=info.architectures)
    head = Eagle3Head(head_config)
    head.set_vocab(vocab)
    if config.init_lm_head_from_target:
        with torch.no_grad():
            head.lm_head.weight.copy_(lm_head_weight.cpu()[vocab.kept_ids])
    head = head.to(device)
    head.set_embedding(embedding.to(device))
    return head, TrainingTimeTest(head, config.ttt_steps)


def build_medusa(config: TrainConfig, info: TargetInfo, layer_ids: list[int], vocab: DraftVocab,
                 embedding: Tensor, lm_head_weight: Tensor, device: torch.device
                 ) -> tuple[MedusaHeads, nn.Module]:
    """Same arguments as build_eagle3 (layer_ids and embedding are not used by Medusa)."""
    heads_config = MedusaConfig.for_target(info.config, config.medusa_heads, config.medusa_layers,
                                           None if config.share_lm_head else vocab.size,
                                           target_model=config.model)
    heads = MedusaHeads(heads_config)
    heads.set_vocab(vocab)
    if config.share_lm_head:
        output = nn.Linear(heads_config.hidden_size, heads_config.vocab_size, bias=False)
        output.weight = nn.Parameter(lm_head_weight.cpu(), requires_grad=False)
        heads.set_output_layer(output)
    elif config.init_lm_head_from_target:
        with torch.no_grad():
            heads.lm_head.weight.copy_(lm_head_weight.cpu()[vocab.kept_ids])
    heads = heads.to(device)
    return heads, MedusaLoss(heads)
