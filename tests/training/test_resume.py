"""Resume: N steps + kill + resume N steps equals 2N steps; checkpoints; the settings guard."""

from __future__ import annotations

import csv
import json

import pytest
import torch

from eyas.errors import EyasError
from eyas.training.checkpoints import list_checkpoints
from eyas.training.config import TrainConfig
from eyas.training.trainer import Trainer

STEPS = 4


def config(tmp_path, name: str, features, **overrides) -> TrainConfig:
    values = dict(model=str(overrides.pop("model")), output=str(tmp_path / name), features=str(features),
                  draft_vocab_size=64, ttt_steps=3, micro_batch_size=2, grad_accum=2, max_steps=2 * STEPS,
                  save_every=STEPS, log_every=1, learning_rate=1e-3, progress=False)
    values.update(overrides)
    return TrainConfig(**values)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.head.state_dict().items()}


def test_kill_and_resume_equals_an_uninterrupted_run(tmp_path, tiny_target_dir, feature_store_dir) -> None:
    straight = Trainer(config(tmp_path, "straight", feature_store_dir, model=tiny_target_dir))
    straight.train()
    # a run that dies one step after its checkpoint at STEPS (that step is lost, as in a kill)
    first = Trainer(config(tmp_path, "resumed", feature_store_dir, model=tiny_target_dir))
    first.train(stop_after=STEPS + 1)
    assert [step for step, _ in list_checkpoints(tmp_path / "resumed")] == [STEPS]
    assert not (tmp_path / "resumed" / "head").exists()
    # a fresh process: everything comes from the checkpoint on disk
    second = Trainer(config(tmp_path, "resumed", feature_store_dir, model=tiny_target_dir, resume=True))
    assert second.start_step == STEPS
    second.train()
    for name, tensor in weights(straight).items():
        assert torch.allclose(weights(second)[name], tensor, atol=1e-6, rtol=1e-5), name
    # the optimizer state continued too (AdamW's step counter and moments)
    state_a, state_b = straight.optimizer.state_dict()["state"], second.optimizer.state_dict()["state"]
    assert all(torch.allclose(state_a[i]["exp_avg_sq"], state_b[i]["exp_avg_sq"], rtol=1e-5, atol=1e-12)
               for i in state_a)
    assert int(state_b[0]["step"]) == 2 * STEPS
    # the metrics log holds each step once: rows of the lost step were dropped on resume
    with open(tmp_path / "resumed" / "metrics.csv") as handle:
        train_steps = [int(row["step"]) for row in csv.DictReader(handle) if row["split"] == "train"]
    assert train_steps == list(range(1, 2 * STEPS + 1))
    with open(tmp_path / "straight" / "metrics.csv") as a, open(tmp_path / "resumed" / "metrics.csv") as b:
        losses_a = [float(r["loss"]) for r in csv.DictReader(a) if r["split"] == "train"]
        losses_b = [float(r["loss"]) for r in csv.DictReader(b) if r["split"] == "train"]
    assert losses_a == pytest.approx(losses_b, rel=1e-5)


def test_checkpoint_contents(tmp_path, tiny_target_dir, feature_store_dir) -> None:
    trainer = Trainer(config(tmp_path, "run", feature_store_dir, model=tiny_target_dir, max_steps=STEPS))
    trainer.train()
    folder = list_checkpoints(tmp_path / "run")[-1][1]
    assert {p.name for p in folder.iterdir()} == {"config.json", "model.safetensors", "optimizer.pt",
                                                   "rng.safetensors", "trainer_state.json", "manifest.json"}
    listed = json.loads((folder / "manifest.json").read_text())["files"]
    assert set(listed) == {"config.json", "model.safetensors", "optimizer.pt", "rng.safetensors",
                           "trainer_state.json"}
    assert listed["optimizer.pt"]["bytes"] == (folder / "optimizer.pt").stat().st_size
    state = json.loads((folder / "trainer_state.json").read_text())
    assert state["step"] == STEPS and state["global_batch"] == 4
    assert state["data_position"] == {"epoch": 0, "step_in_epoch": STEPS, "samples_seen": 4 * STEPS}
    assert state["schedule"]["total_steps"] == STEPS
    assert (tmp_path / "run" / "head" / "model.safetensors").is_file()


def test_resume_with_other_settings_is_refused(tmp_path, tiny_target_dir, feature_store_dir) -> None:
    Trainer(config(tmp_path, "run", feature_store_dir, model=tiny_target_dir, max_steps=2, save_every=1)).train()
    with pytest.raises(EyasError, match=r"cannot resume: settings differ .*learning_rate: 0.001 -> 0.002"):
        Trainer(config(tmp_path, "run", feature_store_dir, model=tiny_target_dir, max_steps=2, save_every=1,
                       learning_rate=2e-3, resume=True))
    with pytest.raises(EyasError, match=r"global_batch \(4 -> 2\)"):
        Trainer(config(tmp_path, "run", feature_store_dir, model=tiny_target_dir, max_steps=2, save_every=1,
                       grad_accum=1, resume=True))


def test_init_from_starts_from_a_trained_head_with_its_vocabulary(tmp_path, tiny_target_dir,
                                                                   feature_store_dir) -> None:
    first = Trainer(config(tmp_path, "first", feature_store_dir, model=tiny_target_dir, max_steps=STEPS))
    first.train()
    trained = weights(first)
    more = Trainer(config(tmp_path, "more", feature_store_dir, model=tiny_target_dir, max_steps=2,
                          draft_vocab_size=32, init_from=str(tmp_path / "first" / "head")))
    assert more.vocab.size == 64  # the head's vocabulary, not --draft-vocab-size
    start = weights(more)
    assert set(start) == set(trained)
    for name, tensor in trained.items():
        assert torch.equal(start[name], tensor), name
    more.train()
    assert not torch.equal(weights(more)["fc.weight"], trained["fc.weight"])
    with pytest.raises(EyasError, match="--method eagle3 only"):
        config(tmp_path, "medusa", feature_store_dir, model=tiny_target_dir, method="medusa",
               init_from=str(tmp_path / "first" / "head"))
    with pytest.raises(EyasError, match="is not an eyas head"):
        Trainer(config(tmp_path, "bad", feature_store_dir, model=tiny_target_dir, init_from=str(tmp_path)))


class FakeClock:
    """A clock that moves one second each time it is read."""

    def __init__(self) -> None:
        self.now = 100.0

    def __call__(self) -> float:
        self.now += 1.0
        return self.now


def lrs(folder) -> list[float]:
    with open(folder / "metrics.csv") as handle:
        return [float(row["lr"]) for row in csv.DictReader(handle) if row["split"] == "train"]


def test_a_time_budget_stops_the_run_and_drives_the_schedule(tmp_path, tiny_target_dir, feature_store_dir) -> None:
    # Each step reads the clock once: after step n, n seconds are spent. A budget of 3.5 s
    # stops after step 4 of at most 40; the rate follows the time's share (40 * n / 3.5 > n).
    run = config(tmp_path, "budget", feature_store_dir, model=tiny_target_dir, max_steps=40, save_every=2,
                 max_time_s=3.5, warmup_ratio=0.0, min_lr_ratio=0.1)
    trainer = Trainer(run)
    trainer.clock = FakeClock()
    summary = trainer.train()
    assert summary.steps == 4
    schedule = trainer.schedule
    expected = [schedule.lr_at(max(n, 40 * n / 3.5)) for n in range(4)]
    assert lrs(tmp_path / "budget") == pytest.approx(expected, rel=1e-6)
    assert expected[0] == pytest.approx(1e-3) and expected[3] < 0.5e-3  # decayed by time, not steps
    assert (tmp_path / "budget" / "head" / "model.safetensors").is_file()
    assert [step for step, _ in list_checkpoints(tmp_path / "budget")] == [2, 4]
    state = json.loads((list_checkpoints(tmp_path / "budget")[-1][1] / "trainer_state.json").read_text())
    assert state["time_spent_s"] == pytest.approx(4.0) and state["schedule"]["max_time_s"] == 3.5
    # Killed after step 3, resumed from step 2: the budget continues from the 2 s spent
    first = Trainer(config(tmp_path, "killed", feature_store_dir, model=tiny_target_dir, max_steps=40,
                           save_every=2, max_time_s=3.5, warmup_ratio=0.0, min_lr_ratio=0.1))
    first.clock = FakeClock()
    first.train(stop_after=3)
    assert not (tmp_path / "killed" / "head").exists()
    second = Trainer(config(tmp_path, "killed", feature_store_dir, model=tiny_target_dir, max_steps=40,
                            save_every=2, max_time_s=3.5, warmup_ratio=0.0, min_lr_ratio=0.1, resume=True))
    second.clock = FakeClock()
    assert second.start_step == 2 and second.time_spent == pytest.approx(2.0)
    assert second.train().steps == 4
    assert lrs(tmp_path / "killed") == pytest.approx(expected, rel=1e-6)
    for name, tensor in weights(trainer).items():
        assert torch.allclose(weights(second)[name], tensor, atol=1e-6, rtol=1e-5), name
    # another budget is another schedule: refused
    with pytest.raises(EyasError, match=r"max_time_s: 3.5 -> 7.0"):
        Trainer(config(tmp_path, "killed", feature_store_dir, model=tiny_target_dir, max_steps=40, save_every=2,
                       max_time_s=7.0, warmup_ratio=0.0, min_lr_ratio=0.1, resume=True))
