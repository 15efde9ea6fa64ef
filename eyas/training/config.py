"""`TrainConfig`: every setting of `eyas train`, validated; the CLI and YAML presets map onto it.

Usage:
    config = TrainConfig(model="smollm2-135m", data="train.tokenized.jsonl", output="runs/a")
    config = TrainConfig.from_yaml("preset.yaml", output="runs/b")  # keyword arguments override
"""

from __future__ import annotations

import os
from dataclasses import asdict, dataclass, fields
from pathlib import Path
from typing import Any

import torch

from eyas.errors import EyasError
from eyas.training.schedule import DECAYS as LR_SCHEDULES  # after the linear warmup

PRECISIONS = ("auto", "float32", "bfloat16")
METHODS = ("eagle3", "medusa")  # what `eyas train --method` trains
LABELS = ("soft", "hard")  # soft: the target's distribution over the draft vocabulary; hard: its argmax
NOISES = ("none", "uniform", "gaussian")  # noise added to the fed target features while training

# Settings that change the result: a resumed run must use the same values.
RESULT_SETTINGS = (
    "method", "medusa_heads", "medusa_layers", "share_lm_head",
    "model", "data", "features", "draft_vocab_size", "target_layer_ids", "ttt_steps", "ttt_decay",
    "max_length", "epochs", "max_steps", "learning_rate", "min_lr_ratio", "warmup_ratio",
    "weight_decay", "adam_beta1", "adam_beta2", "max_grad_norm", "precision",
    "init_lm_head_from_target", "init_from", "eval_fraction", "eval_max_samples", "seed",
    "labels", "feature_noise", "feature_noise_std", "lr_schedule", "init_layer_from_target",
    "max_time_s",
)
# The value of each setting added after the first checkpoints were written, as those ran.
SETTINGS_BEFORE_THEY_EXISTED = {"labels": "soft", "feature_noise": "none", "feature_noise_std": 0.2,
                                "lr_schedule": "cosine", "init_layer_from_target": False,
                                "max_time_s": None}


def cpu_has_amx() -> bool:
    """Whether this CPU runs AMX tiles (and the OS grants them), as PyTorch's oneDNN sees it;
    False when EYAS_CPU_BF16=off (`--precision auto` then stays float32 on such a CPU)."""
    if os.environ.get("EYAS_CPU_BF16", "auto") == "off":
        return False
    probe = getattr(torch.cpu, "_is_amx_tile_supported", None)
    try:
        return bool(probe()) if probe is not None else False
    except RuntimeError:
        return False


@dataclass
class TrainConfig:
    model: str  # the target: alias, HF folder or .gguf (offline mode reads only its config,
    #             embedding and lm_head)
    output: str  # run folder: checkpoints/, head/, metrics.csv
    data: str | None = None  # tokenized conversations (.jsonl): online mode
    features: str | None = None  # a feature store folder: offline mode
    method: str = "eagle3"  # eagle3 (one head, TTT) or medusa (K heads on the last hidden state)
    medusa_heads: int = 4  # medusa: K, head k guesses the token k + 1 positions ahead
    medusa_layers: int = 1  # medusa: residual blocks per head
    share_lm_head: bool = False  # medusa: the heads read the target's lm_head (frozen, not
    #                              stored) instead of training one over the draft vocabulary
    draft_vocab_size: int = 32000  # capped at the target vocabulary
    target_layer_ids: list[int] | None = None  # boundary ids; default {2, L//2, L-3}
    ttt_steps: int = 7  # K
    ttt_decay: float = 0.8  # step k weighs decay^k (medusa: head k + 1 weighs decay^k)
    labels: str = "soft"  # soft: cross-entropy against the target's probabilities over the draft
    #                       vocabulary (EAGLE-3's loss); hard: against its argmax (one-hot)
    feature_noise: str = "none"  # none, uniform or gaussian: added to the fed target features
    #                              (eagle3: the taps; medusa: the last hidden state), training only
    feature_noise_std: float = 0.2  # gaussian: standard deviation; uniform: half-width
    max_length: int = 2048  # online mode: tokens per sample
    micro_batch_size: int = 1
    grad_accum: int = 1
    epochs: float = 1.0
    max_steps: int | None = None  # overrides epochs
    max_time_s: float | None = None  # a time budget: no new step once this much training time
    #                                  is spent; the schedule runs by the larger of the steps'
    #                                  and the time's share, so it still decays to its floor
    learning_rate: float = 1e-4
    lr_schedule: str = "cosine"  # after the warmup: cosine, linear (to the floor) or constant
    min_lr_ratio: float = 0.0
    warmup_ratio: float = 0.02
    weight_decay: float = 0.0
    adam_beta1: float = 0.9
    adam_beta2: float = 0.95
    max_grad_norm: float = 0.5
    precision: str = "auto"  # head autocast: auto (bf16 on GPU, fp32 on CPU), float32, bfloat16
    target_dtype: str = "float32"  # online mode: precision of the target forward (load_target's)
    device: str = "cpu"
    init_lm_head_from_target: bool = True  # start lm_head from the target's rows of the kept ids
    init_layer_from_target: bool = False  # eagle3: the decoder layer and norms start as the
    #                                       target's last layer and final norm, fc as the
    #                                       identity on the deepest tap
    init_from: str | None = None  # eagle3: start from this head folder (its weights and draft
    #                               vocabulary): more training of a head on new data
    save_every: int = 500  # checkpoint every N optimizer steps (0: only at the end)
    keep_checkpoints: int = 2
    eval_fraction: float = 0.05  # held-out share of the samples
    eval_max_samples: int = 200
    eval_every: int = 0  # 0: evaluate at each checkpoint and at the end
    log_every: int = 10
    seed: int = 0
    resume: bool = False
    progress: bool = True

    def __post_init__(self) -> None:
        if (self.data is None) == (self.features is None):
            raise EyasError("give exactly one of --data (tokenized conversations, online mode) "
                            "or --features (a feature store, offline mode)")
        if self.method not in METHODS:
            raise EyasError(f"unknown training method '{self.method}'; accepted: {', '.join(METHODS)}")
        if self.init_from is not None and self.method != "eagle3":
            raise EyasError("init_from (--init-from) starts from an EAGLE-3 head: --method eagle3 only")
        if self.init_layer_from_target and (self.method != "eagle3" or self.init_from is not None):
            raise EyasError("init_layer_from_target (--init-layer-from-target) starts a new EAGLE-3 "
                            "head: --method eagle3 without --init-from")
        for name, value, accepted in (("labels", self.labels, LABELS),
                                      ("feature_noise", self.feature_noise, NOISES),
                                      ("lr_schedule", self.lr_schedule, LR_SCHEDULES)):
            if value not in accepted:
                raise EyasError(f"{name} '{value}' is not supported; accepted: {', '.join(accepted)}")
        if self.feature_noise_std < 0:
            raise EyasError(f"feature_noise_std must be >= 0, got {self.feature_noise_std}")
        if self.share_lm_head and self.method != "medusa":
            raise EyasError("share_lm_head (--share-lm-head) applies to --method medusa only")
        if self.precision not in PRECISIONS:
            raise EyasError(f"precision '{self.precision}' is not supported; accepted: {', '.join(PRECISIONS)}")
        for name in ("draft_vocab_size", "ttt_steps", "medusa_heads", "medusa_layers", "max_length",
                     "micro_batch_size",
                     "grad_accum", "keep_checkpoints", "log_every"):
            if int(getattr(self, name)) <= 0:
                raise EyasError(f"{name} must be a positive integer, got {getattr(self, name)}")
        for name in ("save_every", "eval_every"):
            if int(getattr(self, name)) < 0:
                raise EyasError(f"{name} must be >= 0, got {getattr(self, name)}")
        if self.max_steps is not None and self.max_steps <= 0:
            raise EyasError(f"max_steps must be positive, got {self.max_steps}")
        if self.max_time_s is not None and not self.max_time_s > 0:
            raise EyasError(f"max_time_s (--max-time) must be positive seconds, got {self.max_time_s}")
        if self.epochs <= 0:
            raise EyasError(f"epochs must be positive, got {self.epochs}")
        if not 0.0 <= self.eval_fraction < 1.0:
            raise EyasError(f"eval_fraction must be in [0, 1), got {self.eval_fraction}")
        if not 0.0 <= self.warmup_ratio <= 1.0:
            raise EyasError(f"warmup_ratio must be in [0, 1], got {self.warmup_ratio}")
        if not 0.0 < self.ttt_decay <= 1.0:
            raise EyasError(f"ttt_decay must be in (0, 1], got {self.ttt_decay}")
        if self.learning_rate <= 0 or self.max_grad_norm <= 0:
            raise EyasError("learning_rate and max_grad_norm must be positive")

    @property
    def online(self) -> bool:
        return self.data is not None

    @property
    def loss_terms(self) -> int:
        """Loss terms per row, K: TTT steps (eagle3) or heads (medusa); metrics has K columns."""
        return self.medusa_heads if self.method == "medusa" else self.ttt_steps

    def autocast_dtype(self, device: torch.device) -> torch.dtype | None:
        """The autocast dtype of the head's forward, or None for plain float32. auto: bfloat16
        on a GPU that has it and on a CPU with AMX tiles (its bfloat16 products run ~4-7x
        float32's there: a step 1.2-1.4x faster, the same held-out accuracy per token),
        float32 on other CPUs."""
        if self.precision == "bfloat16":
            return torch.bfloat16
        if self.precision == "auto":
            if device.type == "cuda" and torch.cuda.is_bf16_supported():
                return torch.bfloat16
            if device.type == "cpu" and cpu_has_amx():
                return torch.bfloat16
        return None

    def shape_multiple(self, device: torch.device) -> int:
        """Rows of a batch and of each unrolled step are rounded up to this (rows never scored
        fill the rest): 64 where a backend prepares a kernel per new shape (CUDA, whose
        attention plans; bfloat16 on a CPU, whose oneDNN matmuls are built per shape: ~3.5 ms
        each, against 0.13 ms for a product of the head's), else 1."""
        return 64 if device.type == "cuda" or self.autocast_dtype(device) is not None else 1

    def result_settings(self) -> dict[str, Any]:
        return {k: v for k, v in asdict(self).items() if k in RESULT_SETTINGS}

    @classmethod
    def from_yaml(cls, path: str | Path, **overrides: Any) -> TrainConfig:
        """A YAML preset of TrainConfig keys; `overrides` (e.g. from flags) win."""
        return cls.from_dict({**read_preset(path), **overrides})

    @classmethod
    def from_dict(cls, raw: dict[str, Any]) -> TrainConfig:
        missing = [name for name in ("model", "output") if raw.get(name) is None]
        if missing:
            flags = {"model": "--model", "output": "--out"}
            raise EyasError(f"eyas train needs {' and '.join(flags[m] for m in missing)}")
        return cls(**raw)


def read_preset(path: str | Path) -> dict[str, Any]:
    """The TrainConfig keys of a YAML preset, checked against the known ones."""
    import yaml

    path = Path(path)
    if not path.is_file():
        raise EyasError(f"no such preset file: {path}")
    raw = yaml.safe_load(path.read_text()) or {}
    if not isinstance(raw, dict):
        raise EyasError(f"{path}: a preset must be a mapping of TrainConfig keys")
    known = {f.name for f in fields(TrainConfig)}
    unknown = sorted(set(raw) - known)
    if unknown:
        raise EyasError(f"{path}: unknown keys {unknown}; accepted: {', '.join(sorted(known))}")
    return raw
