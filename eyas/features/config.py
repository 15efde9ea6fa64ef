"""`FeatureConfig`: the settings of `eyas features` (no heavy imports: the CLI reads its defaults)."""

from __future__ import annotations

from dataclasses import dataclass

from eyas.errors import EyasError

STORE_DTYPE_NAMES = ("bfloat16", "float16", "float32")  # eyas.features.store.STORE_DTYPES keys


@dataclass
class FeatureConfig:
    model: str  # what load_target accepts: alias, HF folder or .gguf
    data: str  # tokenized conversations (.jsonl)
    output: str  # store folder
    target_layer_ids: list[int] | None = None  # boundary ids; default {2, L//2, L-3}
    dtype: str = "bfloat16"  # storage precision of taps and hidden: bfloat16, float16, float32
    max_length: int = 2048  # tokens per sample (longer samples are truncated)
    batch_size: int = 1  # samples per target forward (1 is fastest on a CPU)
    samples_per_shard: int = 256
    device: str = "cpu"
    target_dtype: str = "float32"  # precision of the target forward: auto, float32, bfloat16
    check_space: bool = True
    dry_run: bool = False  # print the storage estimate and stop

    def __post_init__(self) -> None:
        if self.dtype not in STORE_DTYPE_NAMES:
            raise EyasError(f"--dtype {self.dtype} is not supported; accepted: {', '.join(STORE_DTYPE_NAMES)}")
        for name in ("max_length", "batch_size", "samples_per_shard"):
            if int(getattr(self, name)) <= 0:
                raise EyasError(f"{name} must be a positive integer, got {getattr(self, name)}")
