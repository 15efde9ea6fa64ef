"""Build the lean model one decoder layer at a time, within the footprint of the result.

The model is created on the meta device (no memory), then filled layer by layer from a
WeightSource (models/weight_source.py: safetensors or GGUF, one tensor read at a time):

- float32 / bfloat16 / float16: each layer's tensors are read, converted and assigned: peak
  memory is the model plus one layer.
- int4 (and int8, the same way with Int8Linear): each layer's tensors are read as float32,
  quantized at once to Int4Linear (the kernel's packed layout) and the float copies dropped:
  peak memory is the int4 model, its float embedding and output layer, and one float32 layer.
  A GGUF with an untied output layer keeps both in the file instead (rows dequantized when
  read: models/source_embedding.py), and the output layer's int8 screen (models/output_layer.py)
  is built a block of rows at a time and cached with the decoder. The packed layers are then
  written to the quantized-model cache (models/int4_cache.py: one folder per model and
  precision); a later load maps that file and quantizes nothing.

Usage:
    model = load_layerwise(config, open_weights(folder), "int4", torch.device("cpu"), name="smollm2")
"""

from __future__ import annotations

import ctypes
import sys
from pathlib import Path
from typing import Callable

import torch
from torch import Tensor, nn

from eyas.models.config import ModelConfig
from eyas.models.int4_cache import Int4Cache
from eyas.models.llama import Transformer, rope_inverse_frequencies
from eyas.models.output_layer import ScreenedOutputLayer
from eyas.models.quant import Int4Linear, Int8Linear
from eyas.models.source_embedding import SourceEmbedding
from eyas.models.weight_source import WeightSource

GROUP_SIZE = 32  # int4 group: the Q4_1 block, what the int8dot kernel packs
QUANTIZED = ("int4", "int8")  # precisions quantized as each layer is read, and cached


def own_layer_tensors(get: Callable[[str], Tensor], prefix: str, index: int,
                      config: ModelConfig) -> dict[str, Tensor]:
    """The tensors of decoder layer `index` under the lean model's names (relative to the
    layer), q/k/v and gate/up fused, read through `get` (a Hugging Face name -> tensor)."""
    src = f"{prefix}layers.{index}."
    attn = src + "self_attn."
    own = {"self_attn.qkv_proj.weight": torch.cat([get(attn + f"{p}_proj.weight") for p in "qkv"])}
    if config.attention_bias:
        own["self_attn.qkv_proj.bias"] = torch.cat([get(attn + f"{p}_proj.bias") for p in "qkv"])
    own["self_attn.o_proj.weight"] = get(attn + "o_proj.weight")
    if config.qk_norm:
        own["self_attn.q_norm.weight"] = get(attn + "q_norm.weight")
        own["self_attn.k_norm.weight"] = get(attn + "k_norm.weight")
    own["mlp.gate_up_proj.weight"] = torch.cat([get(src + "mlp.gate_proj.weight"),
                                                get(src + "mlp.up_proj.weight")])
    own["mlp.down_proj.weight"] = get(src + "mlp.down_proj.weight")
    for norm in ("input_layernorm", "post_attention_layernorm"):
        own[f"{norm}.weight"] = get(src + f"{norm}.weight")
    return own


def int4_from_packed(packed: Tensor, scales_and_zeros: Tensor, bias: Tensor | None,
                     in_features: int, out_features: int, group_size: int) -> Int4Linear:
    """An Int4Linear around buffers that Int4Linear packed earlier (the int4 cache)."""
    layer = Int4Linear.__new__(Int4Linear)
    nn.Module.__init__(layer)
    # int8dot: uint8 [O/16, I/32, 320] with scales inside; torch: PyTorch's 2-D int4 pack
    layer.layout = "int8dot" if packed.dim() == 3 else "torch"
    layer.register_buffer("packed", packed)
    layer.register_buffer("scales_and_zeros", scales_and_zeros)
    layer.register_buffer("bias", bias)
    layer.group_size = group_size
    layer.in_features, layer.out_features = in_features, out_features
    return layer


def _linears(layer: nn.Module) -> list[tuple[nn.Module, str]]:
    return [(parent, name) for parent in (layer.self_attn, layer.mlp)
            for name in ("qkv_proj", "o_proj", "gate_up_proj", "down_proj") if hasattr(parent, name)]


def _global_tensors(model: Transformer, source: WeightSource, prefix: str, dtype: torch.dtype,
                    device: torch.device, with_norm: bool = True, lean: bool = False) -> None:
    """Embedding, final norm and output layer (tied or not), converted to `dtype`. `lean`
    (int4): an untied embedding in a GGUF stays in the file, rows read when looked up
    (models/source_embedding.py)."""
    config = model.config

    def read(name: str) -> nn.Parameter:
        return nn.Parameter(source.get(name).to(device=device, dtype=dtype), requires_grad=False)

    tied = config.tie_word_embeddings or "lm_head.weight" not in source.names()
    embedding = f"{prefix}embed_tokens.weight"
    if lean and not tied and device.type == "cpu" and hasattr(source, "tensors"):
        model.embed_tokens = SourceEmbedding(source.tensors[embedding])
    else:
        model.embed_tokens.weight = read(embedding)
    if with_norm:
        model.norm.weight = read(f"{prefix}norm.weight")
    if tied:
        model.lm_head.weight = model.embed_tokens.weight
    elif isinstance(model.embed_tokens, SourceEmbedding):  # its rows too, screened (target.py)
        model.lm_head = SourceEmbedding(source.tensors["lm_head.weight"])
    else:
        model.lm_head.weight = read("lm_head.weight")
    model.inv_freq = rope_inverse_frequencies(config).to(device)


def _prefix(source: WeightSource) -> str:
    return "model." if any(name.startswith("model.") for name in source.names()) else ""


def load_layerwise(config: ModelConfig, source: WeightSource, precision: str, device: torch.device,
                   name: str = "model", cache_root: Path | None = None) -> Transformer:
    """The lean model in `precision` (float32, bfloat16, float16, int4 or int8), filled layer by layer."""
    prefix = _prefix(source)
    if precision in QUANTIZED:
        return _load_quantized(config, source, prefix, name, cache_root, precision)
    dtype = {"float32": torch.float32, "bfloat16": torch.bfloat16, "float16": torch.float16}[precision]
    with torch.device("meta"):
        model = Transformer(config)
    _global_tensors(model, source, prefix, dtype, device)
    for index, layer in enumerate(model.layers):
        own = own_layer_tensors(source.get, prefix, index, config)
        layer.load_state_dict({k: v.to(device=device, dtype=dtype) for k, v in own.items()}, assign=True)
    return _finish(model)


def _load_quantized(config: ModelConfig, source: WeightSource, prefix: str, name: str,
                    cache_root: Path | None, precision: str) -> Transformer:
    """Decoder layers in `precision` (int4 or int8) from its cache (memory-mapped), else
    quantized layer by layer from the source and then cached. The embedding and output layer
    come from the source, float32."""
    cache = Int4Cache.for_source(source.files(), name=name, group_size=GROUP_SIZE, root=cache_root,
                                 weights=precision)
    cached = cache.load()
    if cached is not None:
        try:
            return _quantized_from_cache(config, source, prefix, cached, precision)
        except (KeyError, ValueError, RuntimeError) as error:  # a cache of another layout or model
            print(f"[eyas] the {precision} cache {cache.folder} does not fit this model ({error}); "
                  f"rebuilding it from {cache.source}", file=sys.stderr, flush=True)
    model = _quantized_from_source(config, source, prefix, precision)
    skip = {"embed_tokens.weight", "lm_head.weight"}  # read from the source on every load
    cache.save({k: v for k, v in model.state_dict().items() if k not in skip},
               {"format": f"eyas-{precision}", "source": cache.source})
    return model


def _quantize(linear: nn.Linear, precision: str) -> nn.Module:
    return Int4Linear(linear, GROUP_SIZE) if precision == "int4" else Int8Linear(linear)


def _quantized_from_source(config: ModelConfig, source: WeightSource, prefix: str,
                           precision: str) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    _global_tensors(model, source, prefix, torch.float32, torch.device("cpu"), lean=True)
    if isinstance(model.lm_head, SourceEmbedding):  # screened first, while memory holds nothing
        model.lm_head = ScreenedOutputLayer(model.lm_head)  # else (its int8 codes go once packed)
        release_freed_memory()
    for index, layer in enumerate(model.layers):
        # 1. The layer's float32 tensors, as the lean model names them.
        own = own_layer_tensors(lambda n: source.get(n).float(), prefix, index, config)
        layer.load_state_dict(own, assign=True)
        del own
        # 2. Each matrix quantized at once; its float32 copy goes with the nn.Linear.
        for parent, attr in _linears(layer):
            setattr(parent, attr, _quantize(getattr(parent, attr), precision))
        # what quantize_model sets (models/quant.py): a row's attention output the same in a
        # one-token and a many-token pass, before the activations are rounded again
        layer.self_attn.float64_attention = True
        release_freed_memory()
    return _finish(model)


def _quantized_from_cache(config: ModelConfig, source: WeightSource, prefix: str,
                          cached: dict[str, Tensor], precision: str) -> Transformer:
    with torch.device("meta"):
        model = Transformer(config)
    _global_tensors(model, source, prefix, torch.float32, torch.device("cpu"), with_norm=False, lean=True)
    model.norm.weight = nn.Parameter(cached.pop("norm.weight"), requires_grad=False)
    screen = {k[len("lm_head."):]: cached.pop(k) for k in list(cached) if k.startswith("lm_head.")}
    if isinstance(model.lm_head, SourceEmbedding):
        if not screen:
            raise ValueError("no output screen in the cache")
        model.lm_head = ScreenedOutputLayer(model.lm_head, screen=screen)
    for index, layer in enumerate(model.layers):
        head = f"layers.{index}."
        state = {k[len(head):]: v for k, v in cached.items() if k.startswith(head)}
        for parent, attr in _linears(layer):
            path = f"{'self_attn' if parent is layer.self_attn else 'mlp'}.{attr}."
            linear = getattr(parent, attr)
            if precision == "int8":
                setattr(parent, attr, Int8Linear.from_packed(
                    state.pop(path + "packed"), state.pop(path + "bias", None), linear.in_features,
                    linear.out_features))
                continue
            setattr(parent, attr, int4_from_packed(
                state.pop(path + "packed"), state.pop(path + "scales_and_zeros"),
                state.pop(path + "bias", None), linear.in_features, linear.out_features, GROUP_SIZE))
        unexpected = layer.load_state_dict(state, assign=True, strict=False).unexpected_keys
        if unexpected:
            raise ValueError(f"unexpected tensors {unexpected[:5]}")
        layer.self_attn.float64_attention = True
    return _finish(model)


def release_freed_memory() -> None:
    """Give the float32 temporaries of a layer back to the system (glibc keeps freed chunks in
    per-thread arenas, where the next layer's threads may not reuse them: the resident size
    would grow by a layer's temporaries every few layers). No-op off glibc."""
    global _libc
    if _libc is None:
        try:
            _libc = ctypes.CDLL("libc.so.6")
            _libc.malloc_trim.argtypes = [ctypes.c_size_t]
        except (OSError, AttributeError):
            _libc = False
    if _libc:
        _libc.malloc_trim(0)


_libc: ctypes.CDLL | bool | None = None


def _finish(model: Transformer) -> Transformer:
    left = [n for n, t in [*model.named_parameters(), *model.named_buffers()] if t.is_meta]
    if left:
        raise ValueError(f"tensors never loaded: {left[:5]}")
    model.fused_plan = None
    model._rope_cache = None
    return model.eval().requires_grad_(False)


