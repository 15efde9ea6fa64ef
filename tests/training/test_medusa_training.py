"""Medusa training on the tiny target: the loss's alignment against a row-by-row reference, one
optimizer step, kill-and-resume, the head folder and the command line."""

from __future__ import annotations

import torch
import torch.nn.functional as F

from eyas.cli import train as train_cli
from eyas.medusa import MedusaHeads, load_medusa
from eyas.training.config import TrainConfig
from eyas.training.data import collate
from eyas.training.trainer import Trainer

HEADS = 3


def medusa_config(tmp_path, name, model, features, **overrides) -> TrainConfig:
    values = dict(model=str(model), output=str(tmp_path / name), features=str(features),
                  method="medusa", medusa_heads=HEADS, draft_vocab_size=64, micro_batch_size=2,
                  max_steps=4, save_every=2, log_every=1, learning_rate=1e-2, warmup_ratio=0.0,
                  eval_fraction=0.0, progress=False)
    values.update(overrides)
    return TrainConfig(**values)


def reference_loss_sums(trainer: Trainer, batch) -> torch.Tensor:
    """sum_rows weight * CE of head k at row t against the target's softmax at row t + k,
    written row by row from the docstring of training/medusa.py."""
    heads: MedusaHeads = trainer.head
    lm_head, kept = trainer.lm_head_weight, trainer.vocab.kept_ids
    sums = torch.zeros(HEADS)
    for b in range(batch.input_ids.shape[0]):
        length = int(batch.lengths[b])
        hidden, mask = batch.hidden[b, :length].float(), batch.loss_mask[b, :length]
        for k in range(1, HEADS + 1):
            for t in range(length - k - 1):
                if not mask[t + 1 + k]:
                    continue
                target_logits = hidden[t + k] @ lm_head.T  # the target's row t + k -> x_{t+1+k}
                if not trainer.vocab.t2d[target_logits.argmax()]:
                    continue  # the target's token cannot be drafted: weight 0
                p = torch.softmax(target_logits[kept], -1)
                log_q = F.log_softmax(heads(hidden[t][None, None])[0, 0, k - 1], -1)
                sums[k - 1] -= (p * log_q).sum()
    return sums


def test_loss_alignment_and_one_step(tmp_path, tiny_target_dir, feature_store_dir) -> None:
    trainer = Trainer(medusa_config(tmp_path, "one", tiny_target_dir, feature_store_dir))
    heads = trainer.head
    assert isinstance(heads, MedusaHeads) and heads.config.num_heads == HEADS
    with torch.no_grad():  # random blocks: at init (W = 0) every head would give the same answer
        for block in heads.blocks:
            block[0].linear.weight.normal_(0, 0.2)
    indices = trainer.plan.micro_batches(0, 0, 1, 2)[0]
    batch = collate([trainer.source.get(i) for i in indices])
    with torch.no_grad():
        _, loss_sums, _, counted, _ = trainer._micro_batch(batch, indices)
        expected = reference_loss_sums(trainer, batch)
    assert torch.allclose(loss_sums, expected, rtol=1e-4), (loss_sums, expected)
    # head k counts the rows whose token t + 1 + k is an answer token
    for k in range(1, HEADS + 1):
        assert int(counted[k - 1]) == int(batch.loss_mask[:, k + 1:].sum())
    before = {k: v.clone() for k, v in heads.state_dict().items()}
    first = trainer.train_step(0)
    after = heads.state_dict()
    changed = {name for name in before if not torch.equal(before[name], after[name])}
    assert changed == {f"blocks.{k}.0.linear.{p}" for k in range(HEADS) for p in ("weight", "bias")} \
        | {"lm_head.weight"}  # d2t and t2d never change
    # the same batch again: the step lowered its loss
    with torch.no_grad():
        _, loss_sums_after, _, _, _ = trainer._micro_batch(batch, indices)
    assert float(loss_sums_after.sum()) < float(loss_sums.sum())
    assert len(first.step_losses) == HEADS and 0.0 <= first.accuracies[0] <= 1.0


def test_shared_output_layer_stays_frozen_and_is_not_saved(tmp_path, tiny_target_dir,
                                                           feature_store_dir) -> None:
    trainer = Trainer(medusa_config(tmp_path, "shared", tiny_target_dir, feature_store_dir,
                                    share_lm_head=True, max_steps=1, save_every=0))
    output_before = trainer.head.lm_head.weight.clone()
    summary = trainer.train()
    assert torch.equal(trainer.head.lm_head.weight, output_before)
    assert torch.equal(trainer.head.lm_head.weight, trainer.lm_head_weight)
    heads = load_medusa(summary.head_dir)
    assert heads.config.shares_target_output and heads.lm_head is None
    heads.set_output_layer(torch.nn.Linear(32, 256, bias=False).requires_grad_(False))
    heads.lm_head.weight.copy_(trainer.lm_head_weight)
    hidden = torch.randn(1, 5, 32)
    assert torch.allclose(heads(hidden), trainer.head(hidden), atol=1e-6)


def test_kill_and_resume_equals_an_uninterrupted_run(tmp_path, tiny_target_dir, feature_store_dir) -> None:
    straight = Trainer(medusa_config(tmp_path, "straight", tiny_target_dir, feature_store_dir))
    straight.train()
    first = Trainer(medusa_config(tmp_path, "resumed", tiny_target_dir, feature_store_dir))
    first.train(stop_after=3)  # checkpoint at step 2, step 3 lost
    second = Trainer(medusa_config(tmp_path, "resumed", tiny_target_dir, feature_store_dir, resume=True))
    assert second.start_step == 2
    second.train()
    for name, tensor in straight.head.state_dict().items():
        assert torch.allclose(second.head.state_dict()[name], tensor, atol=1e-6, rtol=1e-5), name
    saved = load_medusa(tmp_path / "resumed" / "head")
    for name, tensor in saved.state_dict().items():
        assert torch.equal(tensor, second.head.state_dict()[name]), name


def test_command_line(tmp_path, tiny_target_dir, feature_store_dir, capsys) -> None:
    out = tmp_path / "cli"
    assert train_cli.main(["--method", "medusa", "--model", str(tiny_target_dir), "--features",
                           str(feature_store_dir), "--out", str(out), "--medusa-heads", "2",
                           "--draft-vocab-size", "32", "--max-steps", "1", "--eval-fraction", "0",
                           "--no-progress"]) == 0
    assert "2 Medusa heads" in capsys.readouterr().out
    heads = load_medusa(out / "head")
    assert (heads.config.num_heads, heads.config.draft_vocab_size) == (2, 32)
    assert train_cli.main(["--method", "eagle3", "--share-lm-head", "--model", "m", "--data", "d",
                           "--out", str(out)]) == 2
    assert "--method medusa only" in capsys.readouterr().err
