"""`eyas features`: run the target over tokenized conversations and store what the head reads.

For every sample: input ids, loss mask, the three taps (residual entering the tap layers,
boundary ids, default {2, L//2, L-3}) and the last hidden state (after the final norm: the
target's logits at training time are `lm_head(hidden)`), in bf16/fp16 shards (see store.py).

- The storage is estimated before the target is even loaded; the run refuses, with the figures,
  when the disk lacks room.
- Resumable: completed shards (shard file + entry) are kept; a re-run with the same settings
  computes only the missing ones. A shard already on disk is re-verified first (size, sha256,
  readable header with the recorded shapes); a bad one (truncated, corrupted, entry unreadable)
  is reported on stderr and rebuilt. Different settings on the same folder are refused.
- Distributable: under `torchrun --nproc_per_node N`, rank r computes shards r, r+N, ...; rank 0
  writes index.json when all are done.

Usage:
    config = FeatureConfig(model="smollm2-135m", data="train.tokenized.jsonl", output="features/")
    summary = extract_features(config)
"""

from __future__ import annotations

import math
import shutil
import sys
import time
from dataclasses import asdict, dataclass, field
from pathlib import Path

import torch
from tqdm import tqdm

from eyas.eagle3.config import check_target_layer_ids
from eyas.engine.target import Target, load_target
from eyas.errors import EyasError
from eyas.features.config import FeatureConfig
from eyas.features.store import (
    STORE_DTYPES,
    STORE_VERSION,
    SampleFeatures,
    StoreMeta,
    bytes_per_token,
    check_completed_shard,
    entry_path,
    file_sha256,
    read_shard_entry,
    shard_name,
    write_index,
    write_shard,
)
from eyas.features.target_io import compute_target_features, describe_target
from eyas.features.tokenized import prepare_sample, read_tokenized
from eyas.training.distributed import DistributedContext
from eyas.utils.io import read_json, write_json_atomic

SETTINGS_NAME = "extraction.json"
SHARD_OVERHEAD_BYTES = 4096  # safetensors header and entry file, generously
SPACE_MARGIN = 1.02  # ask for 2% more than the estimate


@dataclass
class StoragePlan:
    num_samples: int
    num_skipped: int
    num_tokens: int
    bytes_per_token: int
    total_bytes: int
    remaining_bytes: int
    free_bytes: int

    def describe(self) -> str:
        per_sample = self.total_bytes / max(self.num_samples, 1)
        return (f"{self.num_samples} samples ({self.num_skipped} without answer tokens skipped), "
                f"{self.num_tokens} tokens x {self.bytes_per_token} B = {gib(self.total_bytes)} "
                f"({per_sample / 2**20:.2f} MiB per sample); still to write "
                f"{gib(self.remaining_bytes)}, free on disk {gib(self.free_bytes)}")


@dataclass
class ExtractionSummary:
    output: str
    num_samples: int
    num_tokens: int
    bytes: int
    seconds: float
    tokens_computed: int  # by this rank in this run (0 when everything was already there)
    rebuilt: list[str] = field(default_factory=list)  # this rank's shards found bad and rebuilt

    @property
    def tokens_per_second(self) -> float:
        return self.tokens_computed / self.seconds if self.seconds > 0 else 0.0


def gib(size: float) -> str:
    return f"{size / 2**30:.2f} GiB" if size >= 2**30 else f"{size / 2**20:.1f} MiB"


def free_bytes(folder: Path) -> int:
    probe = folder
    while not probe.exists():
        probe = probe.parent
    return shutil.disk_usage(probe).free


def _check_settings(output: Path, settings: dict) -> None:
    path = output / SETTINGS_NAME
    if not path.is_file():
        return
    previous = read_json(path)
    changed = sorted(k for k in settings if previous.get(k) != settings[k])
    if changed:
        details = ", ".join(f"{k}: {previous.get(k)!r} -> {settings[k]!r}" for k in changed)
        raise EyasError(f"{output} holds features made with other settings ({details}); resume with "
                        f"the same settings or choose a new --out folder")


def extract_features(config: FeatureConfig, target: Target | None = None,
                     progress: bool = True) -> ExtractionSummary:
    context = DistributedContext.start(config.device)
    try:
        return _extract(config, context, target, progress)
    finally:
        context.stop()


def _extract(config: FeatureConfig, context: DistributedContext, target: Target | None,
             progress: bool) -> ExtractionSummary:
    started = time.perf_counter()
    output = Path(config.output)
    # 1. The target's shape and the tap layers (no weights loaded yet).
    info = describe_target(config.model)
    num_layers = info.config.num_hidden_layers
    layer_ids = check_target_layer_ids(config.target_layer_ids or info.default_layer_ids, num_layers)
    # 2. The samples, cut into fixed shards of the input order (shard s = lines s*n .. s*n+n-1).
    samples = read_tokenized(config.data, vocab_size=info.config.vocab_size)
    per_shard = config.samples_per_shard
    num_shards = math.ceil(len(samples) / per_shard)
    shards = [samples[s * per_shard:(s + 1) * per_shard] for s in range(num_shards)]
    prepared = [[prepare_sample(x, config.max_length) for x in shard] for shard in shards]
    # 3. The settings of this store: a resumed run must use the same ones.
    settings = {"model": config.model, "data_sha256": file_sha256(Path(config.data)),
                "target_layer_ids": layer_ids, "dtype": config.dtype,
                "max_length": config.max_length, "samples_per_shard": per_shard,
                "store_version": STORE_VERSION}
    _check_settings(output, settings)
    # 4. The shards already done, re-verified (each rank checks its own), and the storage estimate.
    per_token = bytes_per_token(info.config.hidden_size, len(layer_ids), config.dtype)
    on_disk = _verified_shards(output, num_shards, context)
    done = {s for s, problem in on_disk.items() if problem is None}
    rebuilt: list[str] = []
    for s, problem in sorted(on_disk.items()):
        if problem is not None:
            rebuilt.append(shard_name(s))
            print(f"[eyas] features: {output / shard_name(s)} {problem}: "
                  f"{'it would be rebuilt' if config.dry_run else 'rebuilding it'}", file=sys.stderr, flush=True)
    shard_bytes = [sum(len(p[0]) for p in shard if p is not None) * per_token + SHARD_OVERHEAD_BYTES
                   for shard in prepared]
    plan = StoragePlan(
        num_samples=sum(p is not None for shard in prepared for p in shard),
        num_skipped=sum(p is None for shard in prepared for p in shard),
        num_tokens=sum(len(p[0]) for shard in prepared for p in shard if p is not None),
        bytes_per_token=per_token,
        total_bytes=sum(shard_bytes),
        remaining_bytes=sum(b for s, b in enumerate(shard_bytes) if s not in done),
        free_bytes=free_bytes(output),
    )
    if context.is_main:
        print(f"[eyas] features: {plan.describe()}", flush=True)
    fits = plan.remaining_bytes * SPACE_MARGIN <= plan.free_bytes
    if config.dry_run:
        if context.is_main and not fits:
            print(f"[eyas] features: this would not fit in {output} ({gib(plan.free_bytes)} free)")
        return ExtractionSummary(str(output), plan.num_samples, plan.num_tokens, plan.total_bytes,
                                 0.0, 0, rebuilt)
    if config.check_space and not fits:
        smaller = "store --dtype bfloat16 (half the size), " if config.dtype == "float32" else ""
        raise EyasError(
            f"not enough disk space in {output}: the features need {gib(plan.remaining_bytes)} more "
            f"but {gib(plan.free_bytes)} are free. Free space, choose another --out, {smaller}lower "
            f"--max-length, use fewer samples, or train online (`eyas train --data`), which stores "
            f"nothing"
        )
    output.mkdir(parents=True, exist_ok=True)
    if context.is_main:
        write_json_atomic(output / SETTINGS_NAME, settings)
    # 5. This rank's missing shards.
    mine = [s for s in range(num_shards) if s % context.world_size == context.rank and s not in done]
    if target is None and mine:
        target = load_target(config.model, dtype=config.target_dtype, device=str(context.device))
    store_dtype = STORE_DTYPES[config.dtype]
    my_tokens = sum(len(p[0]) for s in mine for p in prepared[s] if p is not None)
    bar = tqdm(total=my_tokens, unit="tok", desc=f"features rank {context.rank}/{context.world_size}",
               disable=not (progress and context.is_main), dynamic_ncols=True)
    for s in mine:
        kept = [(x, p) for x, p in zip(shards[s], prepared[s]) if p is not None]
        skipped = [x.id for x, p in zip(shards[s], prepared[s]) if p is None]
        features: list[SampleFeatures] = []
        for start in range(0, len(kept), config.batch_size):
            batch = kept[start:start + config.batch_size]
            lengths = [len(p[0]) for _, p in batch]
            input_ids = torch.zeros(len(batch), max(lengths), dtype=torch.int64)
            for row, (_, (ids, _)) in enumerate(batch):
                input_ids[row, :len(ids)] = ids
            assert target is not None
            taps, hidden = compute_target_features(target.model, input_ids.to(target.device), layer_ids)
            for row, ((sample, (ids, mask)), length) in enumerate(zip(batch, lengths)):
                features.append(SampleFeatures(
                    id=sample.id, input_ids=ids, loss_mask=mask,
                    taps=taps[row, :length].to("cpu", store_dtype),
                    hidden=hidden[row, :length].to("cpu", store_dtype),
                ))
            bar.update(sum(lengths))
        write_shard(output, s, features, store_dtype, skipped=skipped)
    bar.close()
    computed_seconds = time.perf_counter() - started
    # 6. Rank 0 writes the index once every rank has finished its shards.
    context.barrier()
    entries = [read_shard_entry(output, s) for s in range(num_shards)]
    missing = [s for s, e in enumerate(entries) if e is None]
    if missing:  # every rank sees the same files: all stop here together
        raise EyasError(f"shards {missing} are missing after the run; re-run to complete them")
    if context.is_main:
        meta = StoreMeta(target_model=config.model, target_layer_ids=layer_ids,
                         target_num_hidden_layers=num_layers, hidden_size=info.config.hidden_size,
                         vocab_size=info.config.vocab_size, dtype=config.dtype,
                         max_length=config.max_length)
        write_index(output, meta, [e for e in entries if e is not None])
    context.barrier()
    total_bytes = sum(e.bytes for e in entries if e is not None)
    return ExtractionSummary(str(output), plan.num_samples, plan.num_tokens, total_bytes,
                             computed_seconds, my_tokens, rebuilt)


def _verified_shards(output: Path, num_shards: int, context: DistributedContext) -> dict[int, str | None]:
    """Shards on disk -> None when it verifies, else what is wrong with it (to rebuild).

    A rank verifies the shards it computes (s % world_size == rank) and trusts the entries of
    the others, so that a store is read once, not once per rank.
    """
    found: dict[int, str | None] = {}
    for s in range(num_shards):
        if s % context.world_size != context.rank:
            if entry_path(output, s).is_file() and (output / shard_name(s)).is_file():
                found[s] = None
            continue
        entry, problem = check_completed_shard(output, s)
        if entry is not None or problem is not None:
            found[s] = problem
    return found


def summary_dict(summary: ExtractionSummary) -> dict:
    return {**asdict(summary), "tokens_per_second": summary.tokens_per_second}
