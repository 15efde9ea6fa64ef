"""Training data: samples from a feature store (offline) or from tokenized conversations
(online: the trainer runs the target on them), the held-out split, and the batch order.

The order is a pure function of (seed, step): optimizer step s of an epoch of E steps takes
positions [(s mod E) * G, (s mod E + 1) * G) of a permutation seeded with seed + epoch, where G is
the global batch (micro batch x accumulation x ranks). That is what makes a resumed run read
exactly the samples the uninterrupted run would have read, and a DDP run the same samples as
one process.

Usage:
    source = OnlineSource(read_tokenized(path), max_length=2048)      # or OfflineSource(store)
    train, held_out = split_held_out(len(source), 0.05, 200, seed=0)
    plan = BatchPlan(train, global_batch=8, seed=0)
    for indices in plan.micro_batches(step, rank, world_size, micro_batch_size):
        batch = collate([source.get(i) for i in indices])
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Iterator, Protocol

import torch
from torch import Tensor

from eyas.errors import EyasError
from eyas.features.store import FeatureStore
from eyas.features.tokenized import TokenizedSample, prepare_sample


@dataclass
class TrainSample:
    id: str
    input_ids: Tensor  # int64 [T]
    loss_mask: Tensor  # int64 [T]
    taps: Tensor | None = None  # [T, 3*Ht] (offline only)
    hidden: Tensor | None = None  # [T, H] (offline only)


@dataclass
class Batch:
    input_ids: Tensor  # int64 [B, T], right-padded with 0
    loss_mask: Tensor  # int64 [B, T], 0 on padding
    lengths: Tensor  # int64 [B]
    taps: Tensor | None  # [B, T, 3*Ht] or None (online: computed by the trainer)
    hidden: Tensor | None  # [B, T, H] or None

    @property
    def num_tokens(self) -> int:
        return int(self.lengths.sum())


class SampleSource(Protocol):
    def __len__(self) -> int: ...
    def get(self, index: int) -> TrainSample: ...
    def token_arrays(self) -> Iterator[tuple[Tensor, Tensor]]: ...


class OnlineSource:
    """Tokenized conversations, truncated; samples without answer tokens are dropped."""

    def __init__(self, samples: list[TokenizedSample], max_length: int) -> None:
        self.samples: list[TrainSample] = []
        for sample in samples:
            prepared = prepare_sample(sample, max_length)
            if prepared is not None:
                self.samples.append(TrainSample(sample.id, prepared[0], prepared[1]))
        self.skipped = len(samples) - len(self.samples)

    def __len__(self) -> int:
        return len(self.samples)

    def get(self, index: int) -> TrainSample:
        return self.samples[index]

    def token_arrays(self) -> Iterator[tuple[Tensor, Tensor]]:
        for sample in self.samples:
            yield sample.input_ids, sample.loss_mask


class OfflineSource:
    """Samples of a feature store (already truncated and filtered at extraction)."""

    def __init__(self, store: FeatureStore) -> None:
        self.store = store

    def __len__(self) -> int:
        return len(self.store)

    def get(self, index: int) -> TrainSample:
        sample = self.store.sample(index)
        return TrainSample(sample.id, sample.input_ids, sample.loss_mask, sample.taps, sample.hidden)

    def token_arrays(self) -> Iterator[tuple[Tensor, Tensor]]:
        return self.store.iter_token_arrays()


def collate(samples: list[TrainSample], multiple: int = 1) -> Batch:
    """Samples right-padded to the longest, rounded up to `multiple` tokens (on a GPU, few
    distinct shapes: kernels that plan or tune per shape then reuse their plans)."""
    lengths = torch.tensor([s.input_ids.numel() for s in samples], dtype=torch.int64)
    batch, length = len(samples), -(-int(lengths.max()) // multiple) * multiple
    input_ids = torch.zeros(batch, length, dtype=torch.int64)
    loss_mask = torch.zeros(batch, length, dtype=torch.int64)
    offline = samples[0].taps is not None
    taps = hidden = None
    if offline:
        taps = samples[0].taps.new_zeros(batch, length, samples[0].taps.shape[-1])
        hidden = samples[0].hidden.new_zeros(batch, length, samples[0].hidden.shape[-1])
    for row, sample in enumerate(samples):
        n = sample.input_ids.numel()
        input_ids[row, :n] = sample.input_ids
        loss_mask[row, :n] = sample.loss_mask
        if offline:
            taps[row, :n] = sample.taps
            hidden[row, :n] = sample.hidden
    return Batch(input_ids, loss_mask, lengths, taps, hidden)


def split_held_out(count: int, fraction: float, max_samples: int, seed: int) -> tuple[list[int], list[int]]:
    """(train, held-out) sample indices; the held-out set is a seeded random subset."""
    held = min(max_samples, int(round(count * fraction)))
    if fraction > 0 and held == 0 and count > 1:
        held = 1
    if held >= count:
        raise EyasError(f"only {count} samples: too few to hold {held} out for evaluation; "
                        f"add data or lower --eval-fraction")
    order = torch.randperm(count, generator=torch.Generator().manual_seed(seed + 12345)).tolist()
    return sorted(order[held:]), sorted(order[:held])


class BatchPlan:
    """Which samples make each optimizer step (see the module docstring)."""

    def __init__(self, train_indices: list[int], global_batch: int, seed: int) -> None:
        self.train_indices = train_indices
        self.global_batch = global_batch
        self.seed = seed
        self.steps_per_epoch = len(train_indices) // global_batch
        if self.steps_per_epoch == 0:
            raise EyasError(f"{len(train_indices)} training samples are fewer than one global batch "
                            f"({global_batch} = micro batch x accumulation x ranks); lower them")

    def step_indices(self, step: int) -> list[int]:
        epoch, offset = divmod(step, self.steps_per_epoch)
        generator = torch.Generator().manual_seed(self.seed + epoch)
        order = torch.randperm(len(self.train_indices), generator=generator)
        chosen = order[offset * self.global_batch:(offset + 1) * self.global_batch].tolist()
        return [self.train_indices[i] for i in chosen]

    def micro_batches(self, step: int, rank: int, world_size: int, micro_batch_size: int) -> list[list[int]]:
        """This rank's share of step `step`, cut into micro batches."""
        indices = self.step_indices(step)
        per_rank = self.global_batch // world_size
        mine = indices[rank * per_rank:(rank + 1) * per_rank]
        return [mine[i:i + micro_batch_size] for i in range(0, len(mine), micro_batch_size)]
