"""One training step online (target run on the fly) and offline (stored features) on the same
data gives the same loss and the same weights."""

from __future__ import annotations

from dataclasses import replace

import pytest
import torch

from eyas.training.config import TrainConfig
from eyas.training.data import collate
from eyas.training.trainer import Trainer


def make_trainer(tmp_path, name: str, tiny_target_dir, tiny_target=None, **mode) -> Trainer:
    config = TrainConfig(model=str(tiny_target_dir), output=str(tmp_path / name), draft_vocab_size=64,
                         micro_batch_size=2, grad_accum=2, max_steps=3, progress=False, **mode)
    return Trainer(config, target=tiny_target)


def test_one_step_online_equals_offline(tmp_path, tiny_target_dir, tiny_target, tokenized_file,
                                        feature_store_dir) -> None:
    online = make_trainer(tmp_path, "online", tiny_target_dir, tiny_target, data=str(tokenized_file))
    offline = make_trainer(tmp_path, "offline", tiny_target_dir, features=str(feature_store_dir))
    assert online.train_indices == offline.train_indices
    assert torch.equal(online.vocab.d2t, offline.vocab.d2t)
    first_online, first_offline = online.train_step(0), offline.train_step(0)
    assert first_online.tokens == first_offline.tokens > 0
    assert first_online.loss > 0
    assert abs(first_online.loss - first_offline.loss) < 1e-6 * first_online.loss
    assert first_online.accuracies == first_offline.accuracies
    for (name, a), (_, b) in zip(online.head.named_parameters(), offline.head.named_parameters()):
        assert torch.allclose(a, b, atol=1e-7, rtol=1e-5), name
    # both modes count the same answer tokens: per-step losses agree too
    assert all(abs(x - y) < 1e-5 for x, y in zip(first_online.step_losses, first_offline.step_losses))


def test_training_lowers_the_loss(tmp_path, tiny_target_dir, feature_store_dir) -> None:
    config = TrainConfig(model=str(tiny_target_dir), output=str(tmp_path / "run"), features=str(feature_store_dir),
                         draft_vocab_size=64, ttt_steps=2, micro_batch_size=4, max_steps=40, learning_rate=3e-3,
                         warmup_ratio=0.0, eval_fraction=0.0, save_every=0, progress=False)
    trainer = Trainer(config)
    batch = collate([trainer.source.get(i) for i in trainer.train_indices[:8]])

    def fixed_loss() -> float:
        with torch.no_grad():
            return trainer._micro_batch(batch, trainer.train_indices[:8])[0].item()

    before = fixed_loss()
    for step in range(40):
        trainer.train_step(step)
    assert fixed_loss() < 0.7 * before


def test_bfloat16_autocast_step_is_close_to_float32(tmp_path, tiny_target_dir, feature_store_dir) -> None:
    losses = {}
    for precision in ("float32", "bfloat16"):
        trainer = make_trainer(tmp_path, precision, tiny_target_dir, features=str(feature_store_dir),
                               precision=precision)
        assert (trainer.config.autocast_dtype(trainer.device) is None) == (precision == "float32")
        losses[precision] = trainer.train_step(0).loss
        assert all(p.dtype == torch.float32 for p in trainer.head.parameters())  # fp32 master weights
    assert losses["bfloat16"] == pytest.approx(losses["float32"], rel=0.02)


def test_second_epoch_reads_the_target_argmax_from_the_cache(tmp_path, tiny_target_dir, feature_store_dir) -> None:
    """From a sample's second pass on, the target's argmax comes from the label cache and only the
    draft vocabulary's rows of its output layer run: the same loss and hits as the first pass."""
    trainer = make_trainer(tmp_path, "cache", tiny_target_dir, features=str(feature_store_dir), ttt_steps=3)
    indices = trainer.train_indices[:2]
    batch = collate([trainer.source.get(i) for i in indices])
    with torch.no_grad():
        first = trainer._micro_batch(batch, indices)
        assert sorted(trainer.label_cache) == sorted(indices)
        drafted = sum(int(trainer.label_cache[i][0].sum()) for i in indices)
        assert drafted > 0  # some target argmax lies in the draft vocabulary
        # the other rows of the output layer are not read any more: NaN there would change the argmax
        trainer.output_layer.other = torch.full_like(trainer.output_layer.other, float("nan"))
        second = trainer._micro_batch(batch, indices)
    assert torch.equal(first[1], second[1]) and torch.equal(first[2], second[2])
    assert float(first[1].sum()) > 0  # drafted target rows weigh in the loss


def test_padding_a_batch_to_a_multiple_changes_nothing_that_is_scored(tmp_path, tiny_target_dir, tiny_target,
                                                                      tokenized_file) -> None:
    """What a GPU, or bfloat16 on a CPU, does (batch lengths and each unrolled step's rows
    rounded up to 64) gives the loss, accuracies and gradients of the unpadded batch: padding
    rows are never scored and, causal, never read."""
    from eyas.training.data import collate

    plain = make_trainer(tmp_path, "plain", tiny_target_dir, tiny_target, data=str(tokenized_file))
    padded = make_trainer(tmp_path, "padded", tiny_target_dir, tiny_target, data=str(tokenized_file))
    padded.pad_multiple = padded.model.row_multiple = 64
    assert plain.pad_multiple == plain.model.row_multiple == 1  # float32 on a CPU pads nothing
    cpu = torch.device("cpu")
    assert replace(plain.config, precision="bfloat16").shape_multiple(cpu) == 64
    assert replace(plain.config, precision="float32").shape_multiple(torch.device("cuda")) == 64
    assert collate([plain.source.get(0), plain.source.get(1)], 64).input_ids.shape[1] == 64
    a, b = plain.train_step(0), padded.train_step(0)
    assert a.tokens == b.tokens > 0 and a.accuracies == b.accuracies
    assert abs(a.loss - b.loss) < 1e-5 * a.loss
    for (name, x), (_, y) in zip(plain.head.named_parameters(), padded.head.named_parameters()):
        assert torch.allclose(x, y, atol=1e-6, rtol=1e-4), name


def test_precision_auto_is_bfloat16_on_a_cpu_with_amx_unless_turned_off(monkeypatch) -> None:
    from eyas.training import config as config_module

    config = TrainConfig(model="m", output="o", features="f")
    cpu = torch.device("cpu")
    monkeypatch.setattr(config_module.torch.cpu, "_is_amx_tile_supported", lambda: True, raising=False)
    monkeypatch.setenv("EYAS_CPU_BF16", "auto")
    assert config.autocast_dtype(cpu) == torch.bfloat16 and config.shape_multiple(cpu) == 64
    monkeypatch.setenv("EYAS_CPU_BF16", "off")
    assert config.autocast_dtype(cpu) is None and config.shape_multiple(cpu) == 1
    monkeypatch.setenv("EYAS_CPU_BF16", "auto")
    monkeypatch.setattr(config_module.torch.cpu, "_is_amx_tile_supported", lambda: False, raising=False)
    assert config.autocast_dtype(cpu) is None
    assert TrainConfig(model="m", output="o", features="f", precision="bfloat16").autocast_dtype(cpu) == torch.bfloat16
