"""`eyas bench profile`: where the time of one target pass goes, part by part, next to each
part's own floor.

One greedy pass over T new tokens after `context` cached ones (what `eyas bench costs` times,
the tree mask included for T > 1) is timed whole while timers around its parts add up where the
time went:
- the decoder layers: each layer's call (one C++ call per layer where the fused int4 layers
  run, models/fused_cpu.py; else the Python layer);
- the output layer (for greedy passes, the int8 screen with its exact re-check of candidates);
- the final norm and the embedding lookup;
- the rest: Python around them (positions, rotary tables, mask, reshapes).
A layer's C++ call is one piece, so it is split by timing its parts alone, on the same weights
and row counts:
- the decoder matmuls: every linear layer of every decoder layer called alone, in order (the
  int4 x int8 kernel, csrc/int4_gemm.cpp);
- the rest of the layers, by difference: attention over the KV cache with the mask, norms,
  rotary, SiLU, residuals and cache writes, with the thread synchronisation between them;
- the screen alone (int8 products and the bound), and the re-check by difference.
Each part's floor: its bytes / read bandwidth or its multiply-adds / integer peak, whichever is
larger (bench/floors.py; attention's floor is reading the KV cache). Parts that need neither
show "-". Times are medians of `repeats` passes.

Usage:
    eyas bench profile --model smollm2-135m --tokens 1,8,32
    from eyas.bench.profile import ProfileConfig, run_profile, format_profile
"""

from __future__ import annotations

import contextlib
import time
from collections import defaultdict
from dataclasses import dataclass, field
from typing import Callable, Iterator

import torch
from torch import nn

from eyas.bench.floors import ModelWork, describe_limits, floor_seconds, model_work, pass_work
from eyas.models.probe import MachineLimits

PARTS = (  # (key, label) in table order; "step" is the whole pass
    ("step", "whole pass"),
    ("layers", "decoder layers (per-layer calls)"),
    ("matmuls", "  decoder matmuls (int4, timed alone)"),
    ("layer_rest", "  attention + norms + rotary + SiLU + residuals + sync (rest of layers)"),
    ("output", "output layer (greedy)"),
    ("screen", "  int8 screen: products + bound (timed alone)"),
    ("recheck", "  exact re-check of candidates (rest of output)"),
    ("norm_embed", "final norm + embedding lookup"),
    ("python", "Python and small ops (positions, rotary tables, mask)"),
)


@dataclass
class ProfileConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    tokens: tuple[int, ...] = (1, 8, 32)
    context: int = 256  # cached tokens before the pass
    repeats: int = 9  # timed passes per T (median)

    def __post_init__(self) -> None:
        self.tokens = tuple(self.tokens)
        if not self.tokens or min(self.tokens) < 1 or max(self.tokens) > 256:
            raise ValueError(f"tokens must be between 1 and 256, got {self.tokens}")
        if self.context < 1 or self.repeats < 1:
            raise ValueError(f"context and repeats must be >= 1, got {self.context}, {self.repeats}")


@dataclass
class PassProfile:
    rows: int
    seconds: dict[str, float]  # part key -> median seconds
    floors: dict[str, float] = field(default_factory=dict)  # part key -> floor seconds


class _PartTimers:
    """Adds the wall time of wrapped calls to a part, one pass at a time."""

    def __init__(self) -> None:
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, call: Callable) -> Callable:
        def timed(*args, **kwargs):
            started = time.perf_counter()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[part] += time.perf_counter() - started
        return timed


@contextlib.contextmanager
def _timed_parts(model: nn.Module, timers: _PartTimers) -> Iterator[None]:
    """Timers around the decoder layers, the output layer, the final norm and the embedding."""
    from eyas.models import fused_cpu

    saved_run_layer = fused_cpu.run_layer
    patched = [model.norm, model.embed_tokens, *model.layers]
    fused_cpu.run_layer = timers.wrap("layers", saved_run_layer)
    for layer in model.layers:  # the Python layers, where the fused ones do not run
        layer.forward = timers.wrap("layers", type(layer).forward.__get__(layer))
    model.norm.forward = timers.wrap("norm_embed", type(model.norm).forward.__get__(model.norm))
    model.embed_tokens.forward = timers.wrap("norm_embed", type(model.embed_tokens).forward.__get__(model.embed_tokens))
    head = model.lm_head
    has_greedy = hasattr(head, "greedy_logits")
    if has_greedy:
        head.greedy_logits = timers.wrap("output", type(head).greedy_logits.__get__(head))
    head.forward = timers.wrap("output", type(head).forward.__get__(head))
    try:
        yield
    finally:
        fused_cpu.run_layer = saved_run_layer
        for module in patched + [head]:
            module.__dict__.pop("forward", None)
        head.__dict__.pop("greedy_logits", None)


def _median(values: list[float]) -> float:
    return sorted(values)[len(values) // 2]


def _linears(model: nn.Module) -> list[nn.Module]:
    """Every linear layer of the decoder, in the order a pass runs them."""
    names = ("qkv_proj", "o_proj", "gate_up_proj", "down_proj")
    found = []
    for layer in model.layers:
        for parent in (layer.self_attn, layer.mlp):
            found += [getattr(parent, name) for name in names if hasattr(parent, name)]
    return found


def _matmul_calls(model: nn.Module, rows: int) -> Callable[[], None]:
    """All decoder matmuls of a pass over `rows` rows, each alone, on random activations."""
    from eyas.models import extension
    from eyas.models.quant import Int4Linear

    calls = []
    for linear in _linears(model):
        width = linear.in_features if hasattr(linear, "in_features") else linear.weight_t.shape[0]
        x = torch.randn(rows, width)
        if isinstance(linear, Int4Linear) and linear.layout == "int8dot":
            calls.append(lambda x=x, packed=linear.packed: extension.module().int4_linear(x, packed))
        else:  # PyTorch's kernels, on the model's activations
            x = x.to(model.embed_tokens.weight.dtype)
            calls.append(lambda x=x, linear=linear: linear(x))

    def run() -> None:
        for call in calls:
            call()
    return run


@torch.inference_mode()
def profile_pass(target, rows: int, context: int, repeats: int) -> PassProfile:
    """Median seconds of each part of a greedy pass over `rows` tokens after `context` cached."""
    from eyas.engine.generate import new_cache

    model = target.model
    cache = new_cache(target, 1, context + rows + 1)
    model(torch.zeros(1, context, dtype=torch.long), cache=cache, write_at=0, logits_at=None)
    ids = torch.zeros(1, rows, dtype=torch.long)
    mask = torch.ones(1, rows, context + rows, dtype=torch.bool)

    def step() -> None:
        model(ids, cache=cache, write_at=context, attn_mask=mask if rows > 1 else None,
              kv_len=context + rows, greedy=True)

    # 1. The whole pass, with timers around its parts.
    step()  # warm-up
    samples: dict[str, list[float]] = defaultdict(list)
    timers = _PartTimers()
    with _timed_parts(model, timers):
        for _ in range(repeats):
            timers.seconds.clear()
            started = time.perf_counter()
            step()
            total = time.perf_counter() - started
            samples["step"].append(total)
            for part in ("layers", "output", "norm_embed"):
                samples[part].append(timers.seconds[part])
            samples["python"].append(total - sum(timers.seconds.values()))
    # 2. The parts inside single calls, each timed alone.
    matmuls = _matmul_calls(model, rows)
    hidden = torch.randn(rows, model.config.hidden_size)
    head = model.lm_head
    screen = (lambda: head.screen(hidden)) if hasattr(head, "screen") else None
    matmuls()
    for _ in range(repeats):
        started = time.perf_counter()
        matmuls()
        samples["matmuls"].append(time.perf_counter() - started)
        if screen is not None:
            started = time.perf_counter()
            screen()
            samples["screen"].append(time.perf_counter() - started)
    seconds = {part: _median(values) for part, values in samples.items()}
    seconds["layer_rest"] = max(0.0, seconds["layers"] - seconds["matmuls"])
    if "screen" in seconds:
        seconds["recheck"] = max(0.0, seconds["output"] - seconds["screen"])
    return PassProfile(rows, seconds)


def part_floors(work: ModelWork, limits: MachineLimits, rows: int, context: int) -> dict[str, float]:
    """Each part's floor: max(bytes / bandwidth, multiply-adds / peak)."""
    bandwidth, peak = limits.bandwidth(), limits.peak()
    decoder = max(work.decoder_bytes / bandwidth, rows * work.decoder_multiply_adds * work.passes / peak)
    output = max(work.output_bytes / bandwidth, rows * work.output_multiply_adds * work.output_passes / peak)
    attention = (context + rows) * work.cache_bytes_per_token / bandwidth
    whole, _ = floor_seconds(pass_work(work, rows, context), limits)
    return {"step": whole, "layers": max(decoder, attention), "matmuls": decoder, "layer_rest": attention,
            "output": output, "screen": output}


def run_profile(config: ProfileConfig, refresh_limits: bool = False) -> tuple[list[PassProfile], list[str]]:
    """Profiles of each T and the header lines (machine, limits, model sizes); `refresh_limits`
    probes the machine again instead of reading its cached limits."""
    from eyas.bench.floors import describe_work
    from eyas.engine.target import load_target
    from eyas.models.probe import machine_limits

    target = load_target(config.model, dtype=config.dtype)
    limits = machine_limits(refresh=refresh_limits)
    header = describe_limits(limits)
    work = model_work(target.model) if limits is not None else None
    if work is not None:
        header.append(describe_work(work))
    header.append(f"{config.model} ({target.precision}), greedy pass over T tokens after "
                  f"{config.context} cached, median of {config.repeats}")
    profiles = []
    for rows in config.tokens:
        profile = profile_pass(target, rows, config.context, config.repeats)
        if work is not None:
            profile.floors = part_floors(work, limits, rows, config.context)
        profiles.append(profile)
    return profiles, header


def format_profile(profiles: list[PassProfile]) -> list[str]:
    """One markdown table: per part and T, ms, % of the pass and the part's floor."""
    head = "| part |" + "".join(f" T={p.rows} ms | % | floor ms |" for p in profiles)
    lines = [head, "|---|" + "---|---|---|" * len(profiles)]
    for key, label in PARTS:
        if all(key not in p.seconds for p in profiles):
            continue
        row = f"| {label} |"
        for p in profiles:
            if key not in p.seconds:
                row += " - | - | - |"
                continue
            ms = p.seconds[key] * 1000
            floor = f"{p.floors[key] * 1000:.2f}" if key in p.floors else "-"
            row += f" {ms:.2f} | {100 * p.seconds[key] / p.seconds['step']:.0f}% | {floor} |"
        lines.append(row)
    return lines
