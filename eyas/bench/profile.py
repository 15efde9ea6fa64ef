"""`eyas bench profile`: where the time of one target pass goes, part by part, next to each
part's own floor.

One greedy pass over T new tokens after `context` cached ones is timed twice over (with
`sequences` = N > 1, one continuous-batching pass as the serving engine's decode step runs it:
N requests, each its own KV cache row with `context` cached tokens and T new ones, N x T rows,
the rows as many slots apart as the server's KV pool keeps them):
- whole, exactly as `eyas bench costs` times it (engine/speculative/sizing.py verify_pass),
  with no timer anywhere: the "whole pass" row;
- again with timers around its parts, whose medians fill the other rows:
  - the decoder stack: its C++ call (models/fused_cpu.py FusedStack, one call for every layer)
    split inside C++ by per-phase timers (csrc/phase_timer.h, off in normal passes): the four
    int4 matmuls (q/k/v, o, gate/up, down), the rounding of their activations, attention over
    the KV cache with the tree mask, the norms, rotary and cache writes, SiLU * up, the
    residuals, the time threads wait at the end of parallel regions, and the rest of the call;
    where the Python layers run instead, each layer's call, split as matmuls timed alone and
    the rest;
  - the output layer (for greedy passes, the int8 screen with its exact re-check of
    candidates; the screen is also timed alone on the same rows);
  - the final norm and the embedding lookup;
  - the rest: Python around them (positions, rotary tables, mask, reshapes).
The parts of an instrumented pass add up to its wall time; the table also shows the matmuls
timed alone, outside the stack, as a reference. Each part's floor: its bytes / read bandwidth or
its multiply-adds / peak, whichever is larger (bench/floors.py; attention's: reading the KV
cache, or its float32 multiply-adds over the keys each row sees / the float peak). Parts that
need neither show "-". Times are medians of `repeats` passes, on the wall clock, or with
clock="cpu" (`--clock cpu`, one thread: OMP_NUM_THREADS=1) on the thread's CPU time, which
other processes on a loaded machine do not inflate.

Usage:
    eyas bench profile --model smollm2-135m --tokens 1,8,32
    eyas bench profile --sequences 16 --tokens 1 --context 200   # a serving step, 16 requests
    OMP_NUM_THREADS=1 eyas bench profile --clock cpu     # on a busy machine
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
from eyas.models.fused_cpu import KV_DTYPE_CHOICES
from eyas.models.probe import MachineLimits

PARTS = (  # (key, label) in table order; "step" is the whole pass
    ("step", "whole pass (as `bench costs` times it)"),
    ("timed", "the same pass with timers (the parts below add up to it)"),
    ("layers", "decoder layers"),
    ("qkv", "  q/k/v matmul (int4)"),
    ("o", "  o matmul (int4)"),
    ("gate_up", "  gate/up matmul (int4)"),
    ("down", "  down matmul (int4)"),
    ("quantize", "  activation rounding for the matmuls"),
    ("attention", "  attention over the KV cache (tree mask)"),
    ("norms", "  RMSNorms (in a region: charged to the rounding)"),
    ("rotary", "  rotary + KV cache writes"),
    ("silu_mul", "  SiLU(gate) * up (in a region: charged to the rounding)"),
    ("residuals", "  residual adds (in a region: charged to o and down)"),
    ("sync", "  threads waiting at the end of parallel regions"),
    ("stack_other", "  call, checks, visible slots, allocations"),
    ("layer_rest", "  attention + norms + rotary + SiLU + residuals + sync (rest of the Python layers)"),
    ("matmuls", "  (reference: the int4 matmuls timed alone, outside the stack)"),
    ("output", "output layer (greedy)"),
    ("screen", "  int8 screen: products + bound (timed alone)"),
    ("recheck", "  exact re-check of candidates (rest of output)"),
    ("norm_embed", "final norm + embedding lookup"),
    ("python", "Python and small ops (positions, rotary tables, mask)"),
)
STACK_PHASES = ("qkv", "o", "gate_up", "down", "quantize", "attention", "norms", "rotary", "silu_mul",
                "residuals", "sync")  # the C++ stack's phases (csrc/phase_timer.h), less its rest
TOP_PARTS = ("layers", "output", "norm_embed", "python")  # what a timed pass adds up to
CLOCKS = {"wall": time.perf_counter, "cpu": time.thread_time}
MAX_CACHED_ENTRIES = 262_144  # KV cache slots over every request of a pass (SmolLM2: ~6 GB)
PROJECTIONS = {"qkv": "qkv_proj", "o": "o_proj", "gate_up": "gate_up_proj", "down": "down_proj"}


@dataclass
class ProfileConfig:
    model: str = "smollm2-135m"
    dtype: str = "auto"
    tokens: tuple[int, ...] = (1, 8, 32)
    context: int = 256  # cached tokens before the pass
    repeats: int = 9  # timed passes per T (median)
    clock: str = "wall"  # "wall", or "cpu": the thread's CPU time (one thread only)
    kv_dtype: str = "auto"  # the fused layers' KV cache: auto, float32, float16 (load_target)
    sequences: int = 1  # requests in the pass, each with `context` cached and T new tokens

    def __post_init__(self) -> None:
        if self.kv_dtype not in KV_DTYPE_CHOICES:
            raise ValueError(f"kv_dtype must be one of {', '.join(KV_DTYPE_CHOICES)}, got {self.kv_dtype!r}")
        if self.clock not in CLOCKS:
            raise ValueError(f"clock must be one of {', '.join(CLOCKS)}, got {self.clock!r}")
        if self.clock == "cpu" and torch.get_num_threads() != 1:
            raise ValueError("--clock cpu times one thread: run with OMP_NUM_THREADS=1 "
                             f"(this process uses {torch.get_num_threads()} threads)")
        self.tokens = tuple(self.tokens)
        if not self.tokens or min(self.tokens) < 1 or max(self.tokens) > 256:
            raise ValueError(f"tokens must be between 1 and 256, got {self.tokens}")
        if not 1 <= self.sequences <= 256:
            raise ValueError(f"sequences must be between 1 and 256, got {self.sequences}")
        if self.sequences * max(self.tokens) > 1024:
            raise ValueError(f"sequences x tokens must be at most 1024 rows, got {self.sequences} x {max(self.tokens)}")
        if self.sequences * (self.context + max(self.tokens)) > MAX_CACHED_ENTRIES:
            raise ValueError(f"sequences x (context + tokens) must be at most {MAX_CACHED_ENTRIES:,} KV cache "
                             f"entries (each request holds its own), got {self.sequences} x "
                             f"({self.context} + {max(self.tokens)})")
        if self.context < 1 or self.repeats < 1:
            raise ValueError(f"context and repeats must be >= 1, got {self.context}, {self.repeats}")


@dataclass
class PassProfile:
    rows: int  # new tokens of each sequence (T)
    seconds: dict[str, float]  # part key -> median seconds
    floors: dict[str, float] = field(default_factory=dict)  # part key -> floor seconds
    sequences: int = 1  # requests in the pass (rows * sequences rows in all)


class _PartTimers:
    """Adds the time of wrapped calls to a part, one pass at a time, on `clock` (CLOCKS)."""

    def __init__(self, clock: str = "wall") -> None:
        self.clock = clock
        self.now = CLOCKS[clock]
        self.seconds: dict[str, float] = defaultdict(float)

    def wrap(self, part: str, call: Callable) -> Callable:
        def timed(*args, **kwargs):
            started = self.now()
            try:
                return call(*args, **kwargs)
            finally:
                self.seconds[part] += self.now() - started
        return timed

    def median(self, call: Callable[[], None], repeats: int) -> float:
        """Median seconds of `repeats` calls of `call`, after one warm-up call."""
        call()
        times = []
        for _ in range(repeats):
            started = self.now()
            call()
            times.append(self.now() - started)
        return _median(times)


@contextlib.contextmanager
def _timed_parts(model: nn.Module, timers: _PartTimers) -> Iterator[None]:
    """Timers around the decoder layers (the fused stack's calls, or each Python layer), the
    output layer, the final norm and the embedding, and the stack's own per-phase timers."""
    from eyas.models import extension

    stack = model.fused_layers()
    native = extension.module() if stack is not None else None
    patched = [model.norm, model.embed_tokens, *model.layers]
    if stack is not None:
        stack.run = timers.wrap("layers", type(stack).run.__get__(stack))
        native.phase_seconds(reset=True)
        native.set_phase_timing(True, timers.clock)
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
        if stack is not None:
            native.set_phase_timing(False)
            stack.__dict__.pop("run", None)
        for module in patched + [head]:
            module.__dict__.pop("forward", None)
        head.__dict__.pop("greedy_logits", None)


def stack_phases() -> dict[str, float]:
    """Seconds charged to each phase of the fused stack since the last call (then reset)."""
    from eyas.models import extension

    return dict(extension.module().phase_seconds(reset=True))


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


def batch_pass(target, cache, context: int, size: int) -> Callable[[], None]:
    """One greedy continuous-batching pass, as the serving engine runs a decode step: every row
    of `cache` is a request with `context` cached tokens and `size` new ones (its root and a
    chain of size - 1 drafted tokens), all in one ragged pass (cache.batch_size x size rows);
    profile_pass splits it."""
    from eyas.engine.speculative.draft import DraftTree
    from eyas.engine.speculative.sizing import sample_tokens
    from eyas.scheduler.batch import RowInput, build_ragged_batch

    ids = sample_tokens(target, context + size)[0, context:].tolist()  # the text goes on
    tree = DraftTree.chain(ids[1:]) if size > 1 else None
    batch = build_ragged_batch([RowInput(row, context, ids[0], tree) for row in range(cache.batch_size)],
                               target.device)

    def step() -> None:
        out = target.model(batch.input_ids, batch.positions, cache=cache, kv_len=batch.kv_len,
                           **batch.pass_arguments(), logits_at=None)
        target.model.output_logits(out.hidden[0], greedy=True)
    return step


@torch.inference_mode()
def profile_pass(target, rows: int, context: int, repeats: int, clock: str = "wall",
                 sequences: int = 1) -> PassProfile:
    """Median seconds of each part of a greedy pass over `rows` tokens after `context` cached,
    on `clock` ("wall", or "cpu": this thread's CPU time); with `sequences` > 1, a ragged pass
    over that many requests, `rows` tokens each (batch_pass)."""
    from eyas.engine.generate import new_cache
    from eyas.engine.speculative.sizing import prefill_context, verify_pass
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.kv_pool import grown_slots

    model = target.model
    slots = context + rows + 1
    if sequences > 1:  # the requests' rows as far apart as the server's KV pool keeps them
        slots = grown_slots(slots, EngineConfig.initial_kv_slots)
    cache = new_cache(target, sequences, slots)
    prefill_context(target, cache, context)
    pass_of = batch_pass if sequences > 1 else verify_pass  # a continuous batch, or one request
    step = pass_of(target, cache, context, rows)
    fused = model.fused_layers() is not None
    # 1. The whole pass, as `bench costs` times it: no timer anywhere.
    timers = _PartTimers(clock)
    samples: dict[str, list[float]] = defaultdict(list)
    samples["step"].append(timers.median(step, repeats))
    # 2. The same pass with timers around its parts and inside the stack; its parts add up.
    with _timed_parts(model, timers):
        step()  # warm-up
        if fused:
            stack_phases()
        for _ in range(repeats):
            timers.seconds.clear()
            started = timers.now()
            step()
            total = timers.now() - started
            samples["timed"].append(total)
            for part in ("layers", "output", "norm_embed"):
                samples[part].append(timers.seconds[part])
            samples["python"].append(total - sum(timers.seconds.values()))
            if fused:
                phases = stack_phases()
                for part in STACK_PHASES:
                    samples[part].append(phases[part])
                samples["stack_other"].append(timers.seconds["layers"] - sum(phases[p] for p in STACK_PHASES))
    # 3. The parts inside single calls, each timed alone.
    matmuls = _matmul_calls(model, rows * sequences)
    hidden = torch.randn(rows * sequences, model.config.hidden_size)
    head = model.lm_head
    screen = (lambda: head.screen(hidden)) if hasattr(head, "screen") else None
    samples["matmuls"].append(timers.median(matmuls, repeats))
    if screen is not None:
        samples["screen"].append(timers.median(screen, repeats))
    seconds = {part: _median(values) for part, values in samples.items()}
    if not fused:
        seconds["layer_rest"] = max(0.0, seconds["layers"] - seconds["matmuls"])
    if "screen" in seconds:
        seconds["recheck"] = max(0.0, seconds["output"] - seconds["screen"])
    return PassProfile(rows, seconds, sequences=sequences)


def _projection_work(model: nn.Module) -> dict[str, tuple[int, int]]:
    """Per projection kind (qkv, o, gate_up, down): (bytes of its weights, multiply-adds per row
    and 8-bit pass), summed over the decoder layers."""
    work = {}
    for part, name in PROJECTIONS.items():
        total_bytes = total_macs = 0
        for layer in model.layers:
            linear = getattr(layer.self_attn, name, None) or getattr(layer.mlp, name, None)
            if linear is None:
                continue
            total_bytes += sum(t.numel() * t.element_size() for t in (*linear.buffers(), *linear.parameters()))
            total_macs += linear.in_features * linear.out_features if hasattr(linear, "in_features") else 0
        work[part] = (total_bytes, total_macs)
    return work


def part_floors(work: ModelWork, limits: MachineLimits, rows: int, context: int,
                projections: dict[str, tuple[int, int]] | None = None, sequences: int = 1) -> dict[str, float]:
    """Each part's floor: max(bytes / bandwidth, multiply-adds / peak); `sequences` requests of
    `rows` tokens each, each reading its own `context` cached tokens. Attention's multiply-adds
    are float32 ones, for the keys each row sees: one request's rows see the context and every
    new token (the mask of `bench costs`), several requests' rows a chain (the new token i sees
    context + i + 1)."""
    bandwidth, peak, float_peak = limits.bandwidth(), limits.peak(), limits.float_peak()
    visible = None if sequences == 1 else sequences * sum(context + i + 1 for i in range(rows))
    rows, cached = sequences * rows, sequences * context  # the pass's rows; cached entries they read
    whole_work = pass_work(work, rows, cached, visible)
    decoder_compute = rows * work.decoder_multiply_adds * work.passes / peak
    attention_compute = whole_work.float_multiply_adds / float_peak
    cache_reading = whole_work.cache_bytes / bandwidth
    decoder = max(work.decoder_bytes / bandwidth, decoder_compute)
    output = max(work.output_bytes / bandwidth, rows * work.output_multiply_adds * work.output_passes / peak)
    attention = max(cache_reading, attention_compute)
    layers = max(work.decoder_bytes / bandwidth + cache_reading, decoder_compute + attention_compute)
    whole, _ = floor_seconds(whole_work, limits)
    floors = {"step": whole, "layers": layers, "matmuls": decoder, "layer_rest": attention,
              "attention": attention, "output": output, "screen": output}
    for part, (size, macs) in (projections or {}).items():
        floors[part] = max(size / bandwidth, rows * macs * work.passes / peak)
    return floors


def run_profile(config: ProfileConfig, refresh_limits: bool = False) -> tuple[list[PassProfile], list[str]]:
    """Profiles of each T and the header lines (machine, limits, model sizes); `refresh_limits`
    probes the machine again instead of reading its cached limits."""
    from eyas.bench.floors import describe_work
    from eyas.engine.target import load_target
    from eyas.models.probe import machine_limits

    target = load_target(config.model, dtype=config.dtype, kv_dtype=config.kv_dtype)
    limits = machine_limits(refresh=refresh_limits)
    header = describe_limits(limits)
    work = model_work(target.model) if limits is not None else None
    if work is not None:
        header.append(describe_work(work))
    over = (f"greedy pass over T tokens after {config.context} cached" if config.sequences == 1 else
            f"greedy continuous-batching pass over {config.sequences} requests, each with {config.context} "
            f"cached tokens and T new ones")
    header.append(f"{config.model} ({target.precision}, KV cache {str(target.kv_dtype).removeprefix('torch.')}), "
                  f"{over}, {torch.get_num_threads()} thread(s), median of {config.repeats} "
                  f"on the {'CPU-time' if config.clock == 'cpu' else 'wall'} clock; "
                  "the indented parts add up to the part above them (but the reference row)")
    profiles = []
    for rows in config.tokens:
        profile = profile_pass(target, rows, config.context, config.repeats, config.clock, config.sequences)
        if work is not None:
            profile.floors = part_floors(work, limits, rows, config.context, _projection_work(target.model),
                                         config.sequences)
        profiles.append(profile)
    return profiles, header


def format_profile(profiles: list[PassProfile]) -> list[str]:
    """One markdown table: per part and T, ms, % of the pass and the part's floor."""
    def title(p: PassProfile) -> str:
        return f"T={p.rows}" if p.sequences == 1 else f"{p.sequences}x T={p.rows}"
    head = "| part |" + "".join(f" {title(p)} ms | % | floor ms |" for p in profiles)
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
