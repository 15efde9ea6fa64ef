"""The recipe options of TrainConfig: soft or hard labels, feature noise, the learning-rate decay,
the decoder layer started from the target's last layer; and resuming a run that uses them."""

from __future__ import annotations

import math

import pytest
import torch

from eyas.errors import EyasError
from eyas.training.config import TrainConfig
from eyas.training.noise import add_feature_noise
from eyas.training.schedule import WarmupSchedule
from eyas.training.trainer import Trainer
from eyas.training.ttt import TargetDistribution, hard_labels, score_each_row

STEPS = 3


def config(tmp_path, name: str, features, model, **overrides) -> TrainConfig:
    values = dict(model=str(model), output=str(tmp_path / name), features=str(features),
                  draft_vocab_size=64, ttt_steps=2, micro_batch_size=2, max_steps=2 * STEPS,
                  save_every=STEPS, log_every=1, learning_rate=1e-3, progress=False, eval_fraction=0.0)
    values.update(overrides)
    return TrainConfig(**values)


def weights(trainer: Trainer) -> dict[str, torch.Tensor]:
    return {k: v.detach().clone() for k, v in trainer.head.state_dict().items()}


def test_soft_and_hard_label_losses_on_a_hand_made_row() -> None:
    probs = torch.tensor([[[0.7, 0.2, 0.1], [0.0, 0.0, 0.0]]])  # [B=1, T=2, N=3]
    target = TargetDistribution(probs, in_draft=torch.tensor([[True, False]]),
                                argmax_draft=torch.tensor([[0, 0]]))
    logits = torch.tensor([[1.0, 2.0, 0.0], [3.0, 0.0, 0.0]])  # [M=2, N]
    rows, times = torch.tensor([0, 0]), torch.tensor([0, 1])
    log_q = torch.log_softmax(logits, -1)
    soft, hits = score_each_row(logits, target, rows, times)
    assert soft[0].item() == pytest.approx(-(0.7 * log_q[0, 0] + 0.2 * log_q[0, 1] + 0.1 * log_q[0, 2]).item())
    assert soft[1].item() == 0.0  # the target's argmax is not drafted: no weight
    assert hits.tolist() == [False, False]  # the draft's argmax is 1; the second row is undrafted
    hard, _ = score_each_row(logits, hard_labels(target), rows, times)
    assert hard[0].item() == pytest.approx(-log_q[0, 0].item())  # -log q(argmax of the target)
    assert hard[1].item() == 0.0
    assert hard_labels(target).probs[0, 0].tolist() == [1.0, 0.0, 0.0]


def test_feature_noise_is_bounded_keyed_and_off_when_none() -> None:
    features = torch.randn(2, 5, 12)
    assert add_feature_noise(features, "none", 0.5, seed=0, step=0, micro_batch=0) is features
    uniform = add_feature_noise(features, "uniform", 0.5, seed=0, step=3, micro_batch=1)
    assert (uniform - features).abs().max() <= 0.5 and (uniform - features).abs().max() > 0.3
    again = add_feature_noise(features, "uniform", 0.5, seed=0, step=3, micro_batch=1)
    assert torch.equal(uniform, again)  # a function of (seed, step, micro batch): resumable
    other = add_feature_noise(features, "uniform", 0.5, seed=0, step=4, micro_batch=1)
    assert not torch.equal(uniform, other)
    gaussian = add_feature_noise(torch.zeros(200, 100, 10), "gaussian", 0.3, seed=1, step=0, micro_batch=0)
    assert gaussian.std().item() == pytest.approx(0.3, rel=0.02)
    assert gaussian.mean().item() == pytest.approx(0.0, abs=0.01)


def test_linear_and_constant_decay() -> None:
    linear = WarmupSchedule(base_lr=1.0, total_steps=12, warmup_steps=2, min_lr_ratio=0.1, decay="linear")
    assert linear.lr_at(0) == pytest.approx(0.5)
    assert linear.lr_at(2) == pytest.approx(1.0)
    assert linear.lr_at(7) == pytest.approx(1.0 - 0.9 * 0.5)
    assert linear.lr_at(12) == pytest.approx(0.1)
    constant = WarmupSchedule(base_lr=1.0, total_steps=12, warmup_steps=2, decay="constant")
    assert [constant.lr_at(s) for s in (1, 2, 11)] == [1.0, 1.0, 1.0]
    cosine = WarmupSchedule(base_lr=1.0, total_steps=12, warmup_steps=2)
    assert cosine.lr_at(7) == pytest.approx(0.5 * (1 + math.cos(math.pi * 0.5)))
    # a checkpoint written before the decay was a setting ran the cosine decay
    cosine.check_state({k: v for k, v in cosine.state_dict().items() if k != "decay"})
    with pytest.raises(EyasError, match="differs from this run's"):
        linear.check_state({k: v for k, v in linear.state_dict().items() if k != "decay"})
    with pytest.raises(EyasError, match="accepted: cosine, linear, constant"):
        WarmupSchedule(base_lr=1.0, total_steps=3, decay="step")


def test_recipe_options_are_validated(tmp_path) -> None:
    base = dict(model="m", output=str(tmp_path), features="f")
    with pytest.raises(EyasError, match="labels 'argmax' is not supported; accepted: soft, hard"):
        TrainConfig(**base, labels="argmax")
    with pytest.raises(EyasError, match="feature_noise 'pink' is not supported"):
        TrainConfig(**base, feature_noise="pink")
    with pytest.raises(EyasError, match="feature_noise_std must be >= 0"):
        TrainConfig(**base, feature_noise="uniform", feature_noise_std=-1.0)
    with pytest.raises(EyasError, match="lr_schedule 'step' is not supported"):
        TrainConfig(**base, lr_schedule="step")
    with pytest.raises(EyasError, match="without --init-from"):
        TrainConfig(**base, init_layer_from_target=True, init_from="head")
    with pytest.raises(EyasError, match="--method eagle3"):
        TrainConfig(**base, init_layer_from_target=True, method="medusa")


def test_noise_of_zero_trains_the_same_weights_and_noise_changes_them(
        tmp_path, tiny_target_dir, feature_store_dir) -> None:
    plain = Trainer(config(tmp_path, "plain", feature_store_dir, tiny_target_dir, save_every=0))
    plain.train()
    silent = Trainer(config(tmp_path, "silent", feature_store_dir, tiny_target_dir, save_every=0,
                            feature_noise="gaussian", feature_noise_std=0.0))
    silent.train()
    noisy = Trainer(config(tmp_path, "noisy", feature_store_dir, tiny_target_dir, save_every=0,
                           feature_noise="gaussian", feature_noise_std=0.5))
    noisy.train()
    for name, tensor in weights(plain).items():
        assert torch.equal(weights(silent)[name], tensor), name
    assert not torch.equal(weights(noisy)["fc.weight"], weights(plain)["fc.weight"])


def test_hard_labels_train_other_weights(tmp_path, tiny_target_dir, feature_store_dir) -> None:
    soft = Trainer(config(tmp_path, "soft", feature_store_dir, tiny_target_dir, save_every=0, max_steps=2))
    soft.train()
    hard = Trainer(config(tmp_path, "hard", feature_store_dir, tiny_target_dir, save_every=0, max_steps=2,
                          labels="hard"))
    hard.train()
    assert not torch.allclose(weights(soft)["lm_head.weight"], weights(hard)["lm_head.weight"])


def test_the_decoder_layer_starts_as_the_targets_last_layer(tmp_path, tiny_target_dir,
                                                            feature_store_dir) -> None:
    from safetensors.torch import load_file

    target = load_file(str(tiny_target_dir / "model.safetensors"))
    trainer = Trainer(config(tmp_path, "init", feature_store_dir, tiny_target_dir, init_layer_from_target=True))
    head, hidden = trainer.head, 32
    last = "model.layers.7."
    attention = head.midlayer.self_attn
    assert torch.equal(attention.q_proj.weight[:, hidden:], target[f"{last}self_attn.q_proj.weight"])
    assert torch.equal(attention.v_proj.weight[:, hidden:], target[f"{last}self_attn.v_proj.weight"])
    assert torch.equal(attention.o_proj.weight, target[f"{last}self_attn.o_proj.weight"])
    assert torch.equal(head.midlayer.mlp.down_proj.weight, target[f"{last}mlp.down_proj.weight"])
    assert torch.equal(head.norm.weight, target["model.norm.weight"])
    assert torch.equal(head.fc.weight[:, 2 * hidden:], torch.eye(hidden))
    assert head.fc.weight[:, :2 * hidden].abs().max().item() == 0.0
    random_start = Trainer(config(tmp_path, "random", feature_store_dir, tiny_target_dir))
    # the embedding half of q/k/v keeps the same random start as a head that is not initialised so
    assert torch.equal(attention.q_proj.weight[:, :hidden],
                       random_start.head.midlayer.self_attn.q_proj.weight[:, :hidden])


def test_resume_of_the_new_options_equals_an_uninterrupted_run(tmp_path, tiny_target_dir,
                                                                feature_store_dir) -> None:
    options = dict(labels="hard", feature_noise="uniform", feature_noise_std=0.3, lr_schedule="linear",
                   init_layer_from_target=True)
    straight = Trainer(config(tmp_path, "straight", feature_store_dir, tiny_target_dir, **options))
    straight.train()
    first = Trainer(config(tmp_path, "resumed", feature_store_dir, tiny_target_dir, **options))
    first.train(stop_after=STEPS + 1)  # killed one step after its checkpoint
    second = Trainer(config(tmp_path, "resumed", feature_store_dir, tiny_target_dir, resume=True, **options))
    assert second.start_step == STEPS
    second.train()
    for name, tensor in weights(straight).items():
        assert torch.allclose(weights(second)[name], tensor, atol=1e-6, rtol=1e-5), name
    with pytest.raises(EyasError, match="feature_noise_std: 0.3 -> 0.4"):
        Trainer(config(tmp_path, "resumed", feature_store_dir, tiny_target_dir, resume=True,
                       **{**options, "feature_noise_std": 0.4}))
