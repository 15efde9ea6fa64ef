"""Which activation arithmetic the int4 kernel can use without losing top-1 agreement with
float32: each candidate emulated in PyTorch on the real SmolLM2 weights, no kernel needed.

    python scripts/activation-arithmetic.py [NUM_PROMPTS] [CANDIDATE ...]
    python scripts/activation-arithmetic.py 40                 # every candidate, 40 MT-Bench prompts
    python scripts/activation-arithmetic.py 40 a14g32 a8g16    # only these

The float32 SmolLM2 target answers each MT-Bench first turn greedily (128 tokens, cached under
/tmp); then the float32 model with every decoder projection replaced by an emulation of the
kernel (csrc/int4_gemm.cpp) reads prompt + answer in one pass (teacher forcing). The emulation
computes what the kernel computes: the int4 codes, float16 scales and minimums of the weights,
each activation group rounded to integers q = round(x / d) with its own scale d, and
y = sum over groups of d * s * (codes . q) + m * sum(x), in float32 as the kernel (in another
order: that changes a logit by ~1e-6, far below the rounding of the activations).

Candidates (the default list: CANDIDATES):
  a{BITS}g{GROUP}      BITS-bit integers, d = max|x| / (2^(BITS-1) - 1) per GROUP inputs
                       (a14g32: the kernel's default; a8g32: its 8-bit option)
  a{BITS}g{GROUP}+mean and each group's mean rounding error added back (with the weights' mean
                       code per group: one float term per group, like the minimum's)
  a8g32+top{K}hi       8 bits, the K groups of a row with the largest max|x| in 14 bits
  a8g32+out{K}         8 bits, the K inputs of a row with the largest |x| multiplied exactly
  a8g32+rows{R}        8 bits, rows whose max|x| exceeds R times their RMS in 14 bits
  a8g32+first{P}       diagnosis: the first P positions in 14 bits
A suffix @PROJECTION[,PROJECTION] applies a candidate to those projections only (qkv_proj,
o_proj, gate_up_proj, down_proj), @L{FIRST}-{LAST} to those decoder layers only; 14 bits
elsewhere (a8g32@down_proj, a8g32@L0-9). Printed per candidate: top-1 agreement with float32,
the positions that differ, and the mean KL(float32 || candidate).
"""

from __future__ import annotations

import os
import re
import sys

import eyas  # noqa: F401  (before torch: the OpenMP spin setting, eyas/openmp_spin.py)
import torch
import torch.nn.functional as F
from torch import Tensor, nn

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.target import load_target
from eyas.models.quant import quantize_groups
from eyas.scheduler.measure import load_prompts

CANDIDATES = ["a14g32", "a12g32", "a10g32", "a8g32", "a8g16", "a8g8", "a8g32+mean", "a8g32+top4hi",
              "a8g32+out16", "a8g32@o_proj"]
ANSWER_TOKENS = 128


def round_groups(x: Tensor, bits: int, group: int) -> Tensor:
    """x [N, I] float32 -> the activations the integer dot products see, q * d, [N, I]."""
    levels = 2.0 ** (bits - 1) - 1
    grouped = x.reshape(x.shape[0], -1, group)  # [N, I/g, g]
    amax = grouped.abs().amax(-1, keepdim=True)
    inverse = torch.where(amax > 0, levels / amax, torch.zeros_like(amax))
    q = torch.round(grouped * inverse)  # round half to even, as the kernel's conversion
    return (q * (amax / levels)).reshape(x.shape)


def emulate(x: Tensor, name: str) -> Tensor:
    """x [N, I] float32 -> what the candidate arithmetic `name` makes of it, [N, I]."""
    plain = re.fullmatch(r"a(\d+)g(\d+)", name)
    if plain:
        return round_groups(x, int(plain.group(1)), int(plain.group(2)))
    centred = re.fullmatch(r"a(\d+)g(\d+)\+mean", name)
    if centred:  # the rounding error's mean per group added back: sum(e) = sum(x) - d sum(q)
        bits, group = int(centred.group(1)), int(centred.group(2))
        rounded = round_groups(x, bits, group)
        error = (x - rounded).reshape(x.shape[0], -1, group).mean(-1, keepdim=True)
        return (rounded.reshape(x.shape[0], -1, group) + error).reshape(x.shape)
    first = re.fullmatch(r"a8g32\+first(\d+)", name)
    if first:  # diagnosis only: the first P rows of the call (positions, at batch 1) in 14 bits
        rows = int(first.group(1))
        return torch.cat([round_groups(x[:rows], 14, 32), round_groups(x[rows:], 8, 32)])
    spiky = re.fullmatch(r"a8g32\+rows(\d+)", name)
    if spiky:  # rows whose max|x| exceeds R times their root mean square in 14 bits
        ratio = x.abs().amax(-1) / x.pow(2).mean(-1).sqrt().clamp(min=1e-30)  # [N]
        fine = (ratio > int(spiky.group(1)))[:, None]
        return torch.where(fine, round_groups(x, 14, 32), round_groups(x, 8, 32))
    high = re.fullmatch(r"a8g32\+top(\d+)hi", name)
    if high:  # the K groups with the largest max|x| in 14 bits, the others in 8
        coarse, fine = round_groups(x, 8, 32), round_groups(x, 14, 32)
        amax = x.reshape(x.shape[0], -1, 32).abs().amax(-1)  # [N, I/32]
        top = amax.topk(int(high.group(1)), dim=-1).indices
        chosen = torch.zeros_like(amax, dtype=torch.bool).scatter_(1, top, True)
        chosen = chosen.repeat_interleave(32, dim=1)
        return torch.where(chosen, fine, coarse)
    outliers = re.fullmatch(r"a8g32\+out(\d+)", name)
    if outliers:  # the K largest |x| exact, the rest (those K zeroed) in 8 bits per 32
        top = x.abs().topk(int(outliers.group(1)), dim=-1).indices
        chosen = torch.zeros_like(x, dtype=torch.bool).scatter_(1, top, True)
        return torch.where(chosen, x, round_groups(torch.where(chosen, 0.0, x), 8, 32))
    raise ValueError(f"unknown candidate {name!r}; accepted: the forms this script's docstring lists, "
                     f"e.g. {', '.join(CANDIDATES)}")


class EmulatedInt4Linear(nn.Module):
    """A decoder projection as the int4 kernel computes it, with activations per `arithmetic`."""

    def __init__(self, weight: Tensor, arithmetic: dict, projection: str, layer: int) -> None:  # [O, I]
        super().__init__()
        self.projection = projection  # qkv_proj, o_proj, gate_up_proj or down_proj
        self.layer = layer
        codes, scale, minimum = quantize_groups(weight, 32)
        scale, minimum = scale.half().float(), minimum.half().float()  # [O, I/32], as packed
        self.scaled_codes = (codes.float().reshape(*scale.shape, 32) * scale[..., None]).reshape(weight.shape)
        self.minimum = minimum
        self.arithmetic = arithmetic  # {"name": candidate}, shared by every projection

    def forward(self, x: Tensor) -> Tensor:  # [..., I] -> [..., O]
        flat = x.reshape(-1, x.shape[-1]).float()
        name, _, where = self.arithmetic["name"].partition("@")  # "a8g32@down_proj,o_proj", "a8g32@L0-14"
        rounded = emulate(flat, name if not where or self.applies(where) else "a14g32")
        sums = flat.reshape(flat.shape[0], -1, 32).sum(-1)  # [N, I/32]: the kernel's exact sums
        y = rounded @ self.scaled_codes.T + sums @ self.minimum.T
        return y.reshape(*x.shape[:-1], -1)

    def applies(self, where: str) -> bool:
        """Whether the candidate's scope `where` covers this projection: names, or layers L<a>-<b>."""
        layers = re.fullmatch(r"L(\d+)-(\d+)", where)
        if layers:
            return int(layers.group(1)) <= self.layer <= int(layers.group(2))
        return self.projection in where.split(",")


def emulated_model(target, arithmetic: dict) -> nn.Module:
    """The float32 target with its decoder projections emulated."""
    model = target.model
    for index, layer in enumerate(model.layers):
        for parent in (layer.self_attn, layer.mlp):
            for name, child in list(parent.named_children()):
                if hasattr(child, "weight_t"):
                    weight = child.weight_t.t().contiguous()  # [O, I]
                    setattr(parent, name, EmulatedInt4Linear(weight, arithmetic, name, index))
    return model


def answers(reference, prompts: list[list[int]]) -> list[list[int]]:
    """The float32 target's greedy answers to `prompts` (cached under /tmp: generating is slow)."""
    path = f"/tmp/eyas-answers-{len(prompts)}x{ANSWER_TOKENS}.pt"
    if os.path.exists(path):
        return torch.load(path)
    result = [generate(reference, p, SamplingParams(max_tokens=ANSWER_TOKENS)).token_ids for p in prompts]
    torch.save(result, path)
    return result


def main(num_prompts: int = 40, names: list[str] | None = None) -> None:
    reference = load_target("smollm2-135m", dtype="float32")
    prompts = load_prompts(reference, "mtbench", num_prompts)
    continuations = answers(reference, prompts)
    sequences = [torch.tensor([list(p) + list(a)]) for p, a in zip(prompts, continuations)]
    starts = [len(p) - 1 for p in prompts]  # the row that predicts the first answer token
    with torch.inference_mode():
        expected = [reference.model(s).logits[0, b:-1].float() for s, b in zip(sequences, starts)]
    arithmetic = {"name": "a14g32"}
    model = emulated_model(load_target("smollm2-135m", dtype="float32"), arithmetic)
    positions = sum(len(e) for e in expected)
    print(f"{num_prompts} MT-Bench prompts, {positions} answer positions of the float32 model", flush=True)
    for name in names or CANDIDATES:
        arithmetic["name"] = name
        agree, divergence = 0, 0.0
        with torch.inference_mode():
            for sequence, start, want in zip(sequences, starts, expected):
                got = model(sequence).logits[0, start:-1].float()
                agree += int((got.argmax(-1) == want.argmax(-1)).sum())
                divergence += F.kl_div(got.log_softmax(-1), want.log_softmax(-1), log_target=True,
                                       reduction="sum").item()
        print(f"{name:14s} top-1 agreement {agree / positions:.4f} ({positions - agree} differ), "
              f"mean KL {divergence / positions:.3e}", flush=True)


if __name__ == "__main__":
    torch.set_num_threads(1)
    main(int(sys.argv[1]) if len(sys.argv) > 1 else 40, sys.argv[2:] or None)
