"""The floor of a target pass on this machine: what it must read and multiply, over the limits.

A pass over T new tokens (after `context` cached ones) must at least
- read every weight once (the int4 decoder, the output layer's int8 screen) and the KV cache:
  bytes / read bandwidth;
- do T rows of integer multiply-adds, once per 8-bit pass of the activation arithmetic the
  kernels ship (14-bit activations = two int8 halves, two dot products, csrc/int8dot.h; the
  output screen's own choice, csrc/int8_screen.cpp, for its multiply-adds):
  multiply-adds / integer peak;
- do attention's float32 multiply-adds, q . k and p * v for every key a row sees (2 x heads x
  head_dim per key and layer): multiply-adds / float peak. The integer and float products run
  on the same vector units (an AMD Zen 4 interleaving vpdpbusd and vfmadd231ps chains took the sum
  of their times, 4.40 against 2.50 + 2.19 ns an iteration), so their times add
  (models/probe.py measures the three limits).
Its floor is the larger of reading and computing; `eyas bench costs` prints it for each T
beside the measured time and the % of the floor reached (floor / measured). Norms, rotary and
the softmax's exponentials are not counted: the floor is what no kernel can beat, not an
estimate.

Usage:
    from eyas.bench.floors import pass_work, prefill_work, floor_seconds
    work = pass_work(target.model, rows=8, context=256)
    seconds, bound_by = floor_seconds(work, machine_limits())
    seconds, bound_by = floor_seconds(prefill_work(target.model, tokens=2048), machine_limits())
"""

from __future__ import annotations

from dataclasses import dataclass

import torch
from torch import nn

from eyas.models.probe import MachineLimits

def activation_passes() -> int:
    """int8 passes per row of the int8dot kernels: two for 14-bit activations (the default),
    one for 8-bit (EYAS_INT4_ACTIVATIONS=8; int8dot.h)."""
    from eyas.models.extension import int4_activation_bits

    return 2 if int4_activation_bits() == 14 else 1


def screen_activation_passes() -> int:
    """int8 passes per row of the output layer's screen: one for 8-bit activations (the
    default), two for 14-bit (EYAS_SCREEN_ACTIVATIONS=14; csrc/int8_screen.cpp)."""
    from eyas.models.extension import screen_activation_bits

    return 2 if screen_activation_bits() == 14 else 1
MULTIPLY_ADD_MIX = {"avx512vnni": "vpdpbusd", "avx2": "vpmaddubsw + vpmaddwd"}


@dataclass(frozen=True)
class PassWork:
    """What one pass over `rows` new tokens must read and compute."""

    rows: int
    weight_bytes: int  # every weight the pass reads once
    cache_bytes: int  # keys and values attention reads
    multiply_adds: int  # integer multiply-adds, every 8-bit pass counted
    float_multiply_adds: int = 0  # attention's float32 multiply-adds

    def __post_init__(self) -> None:
        if self.rows < 1 or min(self.weight_bytes, self.cache_bytes, self.multiply_adds,
                                self.float_multiply_adds) < 0:
            raise ValueError(f"a pass needs rows >= 1 and non-negative sizes, got {self}")

    @property
    def bytes(self) -> int:
        return self.weight_bytes + self.cache_bytes


@dataclass(frozen=True)
class ModelWork:
    """Per-pass bytes and per-row multiply-adds of a model, split by part."""

    decoder_bytes: int  # int4 decoder weights (codes, scales and minimums)
    output_bytes: int  # what the greedy output layer reads (the int8 screen)
    decoder_multiply_adds: int  # per row, one 8-bit pass
    output_multiply_adds: int  # per row, one 8-bit pass
    cache_bytes_per_token: int  # keys and values of one cached token, all layers
    passes: int  # 8-bit passes per row (the decoder)
    output_passes: int = 2  # 8-bit passes per row of the output screen
    attention_multiply_adds_per_key: int = 0  # float32, per row and key it sees, all layers


def _buffer_bytes(module: nn.Module, names: tuple[str, ...]) -> int:
    total = 0
    for name in names:
        tensor = getattr(module, name, None)
        if isinstance(tensor, torch.Tensor):
            total += tensor.numel() * tensor.element_size()
    return total


def model_work(model: nn.Module) -> ModelWork:
    """Sizes of a model's parts: every weight of the decoder layers, what the greedy output
    layer reads (models/output_layer.py ScreenedOutputLayer: its int8 copy), and the integer
    multiply-adds of the int8dot layers (models/quant.py Int4Linear); float layers count their
    bytes and no integer work."""
    from eyas.models.output_layer import ScreenedOutputLayer
    from eyas.models.quant import Int4Linear

    tensors = [*model.layers.parameters(), *model.layers.buffers()]  # every weight of the decoder
    decoder_bytes = sum(tensor.numel() * tensor.element_size() for tensor in tensors)
    decoder_macs = sum(module.in_features * module.out_features for module in model.layers.modules()
                       if isinstance(module, Int4Linear) and module.layout == "int8dot")
    head = model.lm_head
    if isinstance(head, ScreenedOutputLayer):
        names = (("packed", "scale_float", "code_sums", "weight_error", "approx_norm") if head.int8dot
                 else ("codes", "scale", "weight_error", "approx_norm"))
        output_bytes = _buffer_bytes(head, names)
        output_macs = head.out_features * head.in_features if head.int8dot else 0
    else:
        output_bytes = sum(t.numel() * t.element_size() for t in head.buffers()) + sum(
            p.numel() * p.element_size() for p in head.parameters())
        output_macs = 0
    config = model.config
    cache_bytes = (2 * config.num_hidden_layers * config.num_key_value_heads * config.head_dim
                   * torch.empty(0, dtype=model.kv_dtype).element_size())
    attention_macs = 2 * config.num_attention_heads * config.head_dim * config.num_hidden_layers  # q.k, p*v
    return ModelWork(decoder_bytes, output_bytes, decoder_macs, output_macs, cache_bytes, activation_passes(),
                     screen_activation_passes(), attention_macs)


def pass_work(model: nn.Module | ModelWork, rows: int, context: int, visible_keys: int | None = None) -> PassWork:
    """A greedy pass over `rows` new tokens after `context` cached ones (every row's logits).
    visible_keys: the keys attention scores over the pass, summed over its rows; by default each
    row sees the context and every new token (the mask `eyas bench costs` times)."""
    work = model if isinstance(model, ModelWork) else model_work(model)
    macs = rows * (work.decoder_multiply_adds * work.passes + work.output_multiply_adds * work.output_passes)
    visible = rows * (context + rows) if visible_keys is None else visible_keys
    return PassWork(rows, work.decoder_bytes + work.output_bytes,
                    (context + rows) * work.cache_bytes_per_token, macs,
                    visible * work.attention_multiply_adds_per_key)


def prefill_work(model: nn.Module | ModelWork, tokens: int) -> PassWork:
    """The prefill of a `tokens`-token prompt into an empty cache: every row through the decoder,
    the output screen for the last row only (its first token), row i attending to the i + 1
    keys up to itself."""
    work = model if isinstance(model, ModelWork) else model_work(model)
    macs = tokens * work.decoder_multiply_adds * work.passes + work.output_multiply_adds * work.output_passes
    return PassWork(tokens, work.decoder_bytes + work.output_bytes, tokens * work.cache_bytes_per_token, macs,
                    tokens * (tokens + 1) // 2 * work.attention_multiply_adds_per_key)


def floor_seconds(work: PassWork, limits: MachineLimits, threads: int | None = None) -> tuple[float, str]:
    """(seconds, "bandwidth" or "compute"): the larger of bytes / bandwidth and multiply-adds /
    peak (integer and float times added: the same vector units), with `threads` threads (default:
    the count in use)."""
    reading = work.bytes / limits.bandwidth(threads)
    computing = (work.multiply_adds / limits.peak(threads)
                 + work.float_multiply_adds / limits.float_peak(threads))
    return (reading, "bandwidth") if reading >= computing else (computing, "compute")


def describe_limits(limits: MachineLimits | None, threads: int | None = None) -> list[str]:
    """Header lines: CPU, instruction set in use, measured bandwidth and integer and float peaks."""
    threads = torch.get_num_threads() if threads is None else threads
    using = f"{threads} thread{'s' if threads > 1 else ''}"
    if limits is None:
        from eyas.models.probe import cpu_model

        return [f"CPU: {cpu_model()}, {using}; no int8 dot-product kernel in use "
                "(no C++ extension, EYAS_FUSED=0 or EYAS_INT4_KERNEL=torch): no floors"]
    by_threads = ", ".join(
        f"{count} thread{'s' if count > 1 else ''}: {limits.read_bytes_per_second[count] / 1e9:.1f} GB/s, "
        f"{limits.int8_multiply_adds_per_second[count] / 1e9:.0f} G multiply-adds/s, "
        f"{limits.float_multiply_adds_per_second[count] / 1e9:.0f} G float"
        for count in sorted(limits.read_bytes_per_second))
    from eyas.models.extension import int4_amx, int4_prefetch

    amx = ("; AMX tiles for passes of 16+ rows (EYAS_INT4_AMX; the compute floors below are the "
           "probe's, vpdpbusd's)" if int4_amx() else "")
    return [f"CPU: {limits.cpu}, {using}; int8 kernels: {limits.kernel} "
            f"({MULTIPLY_ADD_MIX.get(limits.kernel, limits.kernel)}), weights prefetched by "
            f"{int4_prefetch()} (EYAS_INT4_PREFETCH){amx}",
            f"measured (models/probe.py, {limits.buffer_megabytes} MB read): {by_threads}"]


def describe_work(work: ModelWork) -> str:
    return (f"a pass reads {(work.decoder_bytes + work.output_bytes) / 1e6:.1f} MB of weights (decoder "
            f"{work.decoder_bytes / 1e6:.1f}, output screen {work.output_bytes / 1e6:.1f}) + "
            f"{work.cache_bytes_per_token / 1e3:.1f} KB of KV cache per token; a row is "
            f"{(work.decoder_multiply_adds + work.output_multiply_adds) / 1e6:.1f} M multiply-adds "
            f"x {work.passes} int8 passes (14-bit activations; the output screen {work.output_passes}), "
            f"and {work.attention_multiply_adds_per_key / 1e3:.1f} K float multiply-adds per key it sees")


def costs_table(verify_seconds: dict[int, float], work: ModelWork | None, limits: MachineLimits | None,
                context: int = 256) -> list[str]:
    """The markdown table of `eyas bench costs`: each T's time, relative cost, floor and the %
    of the floor reached (no floors without `work` and `limits`)."""
    one = verify_seconds[min(verify_seconds)]
    work = work if limits is not None else None
    lines = ["| T | ms | x single-token step | floor ms | bound by | % of floor |", "|---|---|---|---|---|---|"]
    for tokens, seconds in sorted(verify_seconds.items()):
        row = f"| {tokens} | {seconds * 1000:.2f} | {seconds / one:.2f} |"
        if work is None:
            lines.append(row + " - | - | - |")
            continue
        floor, bound_by = floor_seconds(pass_work(work, tokens, context), limits)
        lines.append(row + f" {floor * 1000:.2f} | {bound_by} | {100 * floor / seconds:.0f}% |")
    return lines
