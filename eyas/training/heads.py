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
from eyas.errors import EyasError
from eyas.features.target_io import TargetInfo
from eyas.models.weight_source import open_weights
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
    if config.init_layer_from_target:
        init_layer_from_target(head, info)
    head = head.to(device)
    head.set_embedding(embedding.to(device))
    return head, TrainingTimeTest(head, config.ttt_steps, config.shape_multiple(device))


@torch.no_grad()
def init_layer_from_target(head: Eagle3Head, info: TargetInfo) -> None:
    """Start the head's decoder layer as the target's last layer: its q/k/v read the normed
    feature through the second half of their inputs (the embedding half keeps its random start),
    o_proj and the MLP are the target's, `hidden_norm` and `input_layernorm` the target's input
    norm, `norm` the target's final norm; `fc` starts as the identity on the deepest tap."""
    source = open_weights(info.folder, heads=info.config.num_attention_heads,
                          kv_heads=info.config.num_key_value_heads)
    names = set(source.names())
    last = f"model.layers.{info.config.num_hidden_layers - 1}."

    def weight(name: str) -> Tensor:
        if name not in names:
            raise EyasError(f"--init-layer-from-target: no tensor {name} in the weights of "
                            f"{info.folder}")
        return source.get(name).float()

    layer, hidden = head.midlayer, info.config.hidden_size
    if layer.self_attn.q_proj.weight.shape[1] != 2 * hidden:
        raise EyasError("--init-layer-from-target needs a head as wide as its target")
    for name in ("q_proj", "k_proj", "v_proj"):
        getattr(layer.self_attn, name).weight[:, hidden:].copy_(weight(f"{last}self_attn.{name}.weight"))
    layer.self_attn.o_proj.weight.copy_(weight(f"{last}self_attn.o_proj.weight"))
    for name in ("gate_proj", "up_proj", "down_proj"):
        getattr(layer.mlp, name).weight.copy_(weight(f"{last}mlp.{name}.weight"))
    layer.hidden_norm.weight.copy_(weight(f"{last}input_layernorm.weight"))
    layer.input_layernorm.weight.copy_(weight(f"{last}input_layernorm.weight"))
    layer.post_attention_layernorm.weight.copy_(weight(f"{last}post_attention_layernorm.weight"))
    head.norm.weight.copy_(weight("model.norm.weight"))
    head.fc.weight.zero_()  # [H, 3H]: the taps are concatenated shallow to deep
    head.fc.weight[:, 2 * hidden:].copy_(torch.eye(hidden))


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
