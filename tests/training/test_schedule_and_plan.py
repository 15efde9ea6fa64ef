"""The learning-rate schedule, the batch order, the held-out split, the acceptance estimate,
and the validation of TrainConfig."""

from __future__ import annotations

import math

import pytest

from eyas.errors import EyasError
from eyas.training.config import TrainConfig
from eyas.training.data import BatchPlan, split_held_out
from eyas.training.metrics import acceptance_length
from eyas.training.schedule import WarmupSchedule


def test_warmup_then_cosine() -> None:
    schedule = WarmupSchedule(base_lr=1.0, total_steps=10, warmup_steps=2, min_lr_ratio=0.1)
    assert schedule.lr_at(0) == pytest.approx(0.5)
    assert schedule.lr_at(1) == pytest.approx(1.0)
    assert schedule.lr_at(2) == pytest.approx(1.0)  # start of the cosine
    assert schedule.lr_at(6) == pytest.approx(0.1 + 0.9 * 0.5 * (1 + math.cos(math.pi * 0.5)))
    assert schedule.lr_at(10) == pytest.approx(0.1)
    with pytest.raises(EyasError, match="warmup_steps must be in 0..10"):
        WarmupSchedule(base_lr=1.0, total_steps=10, warmup_steps=11)


def test_the_batch_order_is_a_function_of_the_step() -> None:
    plan = BatchPlan(list(range(10, 30)), global_batch=4, seed=3)
    assert plan.steps_per_epoch == 5
    epoch = [i for step in range(5) for i in plan.step_indices(step)]
    assert sorted(epoch) == list(range(10, 30))  # an epoch sees every sample once
    assert plan.step_indices(2) == BatchPlan(list(range(10, 30)), 4, 3).step_indices(2)
    assert plan.step_indices(5) != plan.step_indices(0)  # a new permutation per epoch
    # ranks split a step's global batch; together they cover it exactly
    ranks = [plan.micro_batches(7, rank, 2, micro_batch_size=1) for rank in range(2)]
    assert [i for rank in ranks for micro in rank for i in micro] == plan.step_indices(7)
    assert all(len(rank) == 2 for rank in ranks)
    with pytest.raises(EyasError, match="fewer than one global batch"):
        BatchPlan([1, 2], global_batch=4, seed=0)


def test_held_out_split() -> None:
    train, held = split_held_out(100, 0.05, 3, seed=0)
    assert len(held) == 3 and len(train) == 97 and not set(train) & set(held)
    assert split_held_out(100, 0.05, 3, seed=0) == (train, held)
    assert split_held_out(10, 0.0, 5, seed=0)[1] == []
    with pytest.raises(EyasError, match="too few"):
        split_held_out(2, 0.9, 5, seed=0)


def test_acceptance_length_includes_the_bonus_token() -> None:
    assert acceptance_length([]) == 1.0
    assert acceptance_length([0.5, 0.5]) == pytest.approx(1 + 0.5 + 0.25)
    assert acceptance_length([1.0] * 7) == 8.0


def test_config_is_validated() -> None:
    with pytest.raises(EyasError, match="exactly one of --data"):
        TrainConfig(model="m", output="o")
    with pytest.raises(EyasError, match="exactly one of --data"):
        TrainConfig(model="m", output="o", data="d", features="f")
    with pytest.raises(EyasError, match="accepted: auto, float32, bfloat16"):
        TrainConfig(model="m", output="o", data="d", precision="fp8")
    with pytest.raises(EyasError, match="micro_batch_size must be a positive integer"):
        TrainConfig(model="m", output="o", data="d", micro_batch_size=0)
    with pytest.raises(EyasError, match="needs --model and --out"):
        TrainConfig.from_dict({"data": "d"})


def test_a_time_budget_moves_the_schedule_by_the_larger_share() -> None:
    schedule = WarmupSchedule(base_lr=1.0, total_steps=100, warmup_steps=10, max_time_s=50.0)
    assert schedule.position(5, 0.0) == 5.0
    assert schedule.position(5, 25.0) == 50.0  # half the time spent: half-way
    assert schedule.position(80, 25.0) == 80.0  # steps ahead of the clock: the steps
    assert schedule.lr_at(schedule.position(5, 25.0)) == pytest.approx(0.5 * (1 + math.cos(math.pi * 40 / 90)))
    assert not schedule.out_of_time(49.9) and schedule.out_of_time(50.0)
    plain = WarmupSchedule(base_lr=1.0, total_steps=100, warmup_steps=10)
    assert plain.position(5, 1e9) == 5.0 and not plain.out_of_time(1e9)
    with pytest.raises(EyasError, match="time budget must be positive"):
        WarmupSchedule(base_lr=1.0, total_steps=100, max_time_s=0.0)
    with pytest.raises(EyasError, match="max_time_s"):
        TrainConfig(model="m", output="o", data="d", max_time_s=-1.0)
