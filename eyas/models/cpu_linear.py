"""`TransposedLinear`: a linear layer whose weight is stored as [in, out] for `x @ w`.

On this project's CPUs, one-token (and few-token) matmuls run faster with the weight laid out
[in, out] than with nn.Linear's [out, in]: 16% for SmolLM2's 49152-wide output layer at one
token, 38% at eight (measured in old BENCHMARKS.md). The engine therefore converts its float
linear layers on the CPU once, after loading. The output layer of a tied model gets its own
transposed copy (the embedding keeps its row layout for lookups).
"""

from __future__ import annotations

from torch import Tensor, nn


class TransposedLinear(nn.Module):
    def __init__(self, linear: nn.Linear) -> None:
        super().__init__()
        self.register_buffer("weight_t", linear.weight.detach().t().contiguous())  # [I, O]
        bias = linear.bias.detach().clone() if linear.bias is not None else None
        self.register_buffer("bias", bias)
        self.out_features = self.weight_t.shape[1]

    def forward(self, x: Tensor) -> Tensor:  # [..., I] -> [..., O]
        y = x @ self.weight_t
        return y if self.bias is None else y + self.bias


def transpose_linears(model: nn.Module, output_layer_only: bool = False) -> nn.Module:
    """Replace the model's nn.Linear layers (or only its lm_head) by TransposedLinear."""
    if isinstance(model.lm_head, nn.Linear):
        model.lm_head = TransposedLinear(model.lm_head)
    if output_layer_only:
        return model
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if isinstance(child, nn.Linear):
                    setattr(parent, name, TransposedLinear(child))
    return model
