"""The bfloat16 screen of the first epoch's labels: its bound holds, and the labels it gives are
the float32 path's, row for row, on near-ties built to defeat it and on the real target."""

from __future__ import annotations

import pytest
import torch

from eyas.eagle3.vocab import build_draft_vocab
from eyas.training.label_screen import OtherRowsScreen
from eyas.training.ttt import TargetOutputLayer, target_distribution


def near_tie_layer(seed: int = 0) -> tuple[torch.Tensor, torch.Tensor]:
    """(lm_head [V, H], counts [V]): 60 kept ids; among the others, copies of kept rows scaled by
    1 + eps (eps from -1e-3 to +1e-3, and 0: exact ties, before and after the kept id)."""
    generator = torch.Generator().manual_seed(seed)
    vocab_size, size = 400, 48
    lm_head = torch.randn(vocab_size, size, generator=generator)
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    kept = torch.arange(100, 160)  # the draft vocabulary: ids 100..159
    counts[kept] = 10
    lm_head[kept] *= 1.6  # so that many rows' argmax is drafted
    scales = [1 + 1e-3, 1 + 1e-5, 1 + 1e-7, 1.0, 1.0, 1 - 1e-7, 1 - 1e-5, 1 - 1e-3]
    for i, scale in enumerate(scales * 6):
        # other ids both below 100 and above 159, so that exact ties fall on both sides
        other = i if i % 2 == 0 else 399 - i
        lm_head[other] = lm_head[kept[i % 60]] * scale
    return lm_head, counts


@pytest.mark.parametrize("in_bf16", [False, True])
def test_screened_labels_equal_the_float32_path_on_near_ties(in_bf16: bool) -> None:
    lm_head, counts = near_tie_layer()
    vocab = build_draft_vocab(counts, 60)
    generator = torch.Generator().manual_seed(1)
    hidden = torch.randn(3, 700, lm_head.shape[1], generator=generator) * 4  # [B, T, H]
    hidden[0, :300] = lm_head[100:160].repeat(5, 1)  # rows whose argmax is a kept row with near copies
    if in_bf16:
        hidden = hidden.bfloat16()
    plain = target_distribution(hidden, TargetOutputLayer(lm_head, vocab), vocab, chunk_tokens=256)
    layer = TargetOutputLayer(lm_head, vocab, screen=True)
    screened = target_distribution(hidden, layer, vocab, chunk_tokens=256)
    assert torch.equal(screened.in_draft, plain.in_draft)
    assert torch.equal(screened.argmax_draft, plain.argmax_draft)
    assert torch.equal(screened.probs, plain.probs)
    # the reference: one argmax over all V float32 logits, lowest id on ties
    logits = hidden.float() @ lm_head.T  # [B, T, V]
    best = logits.argmax(-1)
    assert torch.equal(plain.in_draft, vocab.t2d[best])
    assert 0.05 < float((~plain.in_draft).float().mean()) < 0.95  # both answers occur
    # and the screen settled some rows, but not the near ties
    flat = hidden.reshape(-1, hidden.shape[-1]).float()
    value = (flat @ layer.kept.T).amax(-1)
    certain = layer.screen.certain(flat, value, in_bf16)
    assert 0.1 < float(certain.float().mean()) < 1.0
    has_copies = torch.arange(300) % 60 < 48  # kept rows 100..147 have near copies
    assert not bool(certain[:300][has_copies].any())  # a copy within 1e-3 needs the float32 product


@pytest.mark.parametrize("in_bf16", [False, True])
def test_the_screen_never_proves_a_row_whose_maximum_reaches_the_value(in_bf16: bool) -> None:
    """certain(h, value) must be False whenever some other logit >= value, at any distance; and
    True for a value far above (the screen is not vacuous)."""
    generator = torch.Generator().manual_seed(2)
    other = torch.randn(3000, 96, generator=generator) * torch.rand(3000, 1, generator=generator) * 3
    screen = OtherRowsScreen(other)
    assert screen.exact.shape[0] == 60 and screen.low.shape[0] == 2940
    hidden = torch.randn(500, 96, generator=generator) * 10
    if in_bf16:
        hidden = hidden.bfloat16().float()
    reference = (hidden @ other.T).amax(-1)  # [c] the float32 maximum
    for below in (0.0, 1e-7, 1e-5, 1e-3, 1e-1):
        value = reference - below * reference.abs()
        assert not bool(screen.certain(hidden, value, in_bf16).any())
    assert bool(screen.certain(hidden, reference + 1e3, in_bf16).all())
    assert screen.certain(hidden[:0], reference[:0], in_bf16).shape == (0,)


def test_screened_labels_on_the_real_target(smollm_target, mtbench_prompt_ids) -> None:
    """SmolLM2's own last hidden states on MT-Bench prompts: the same labels, most rows proven."""
    from eyas.features.target_io import compute_target_features, describe_target, load_output_weights

    ids = torch.tensor([mtbench_prompt_ids[0] + mtbench_prompt_ids[1]])
    _, hidden = compute_target_features(smollm_target.model, ids, [2, 15, 27])  # [1, T, H]
    _, lm_head = load_output_weights(describe_target("smollm2-135m"))  # [V, H]
    counts = torch.zeros(lm_head.shape[0], dtype=torch.int64)
    counts[0:16384:2] = 1  # the even ids below 16,384 drafted: rows both in and out of it
    vocab = build_draft_vocab(counts, 8192)
    for h in (hidden.float(), hidden.bfloat16()):
        plain = target_distribution(h, TargetOutputLayer(lm_head, vocab), vocab)
        layer = TargetOutputLayer(lm_head, vocab, screen=True)
        screened = target_distribution(h, layer, vocab)
        assert torch.equal(screened.in_draft, plain.in_draft)
        assert torch.equal(screened.argmax_draft, plain.argmax_draft)
        assert 0.2 < float(plain.in_draft.float().mean()) < 0.8
        flat = h.reshape(-1, h.shape[-1]).float()
        value = (flat @ layer.kept.T).amax(-1)
        proven = layer.screen.certain(flat, value, h.dtype == torch.bfloat16)
        assert float(proven.float().mean()) > 0.5 * float(plain.in_draft.float().mean())
        assert not bool((proven & ~plain.in_draft.reshape(-1)).any())


def test_training_with_the_screen_gives_the_same_head(tmp_path, tiny_target_dir, feature_store_dir,
                                                      monkeypatch) -> None:
    """The trainer screens where the CPU has AMX (here forced on any CPU): the same labels, so
    the same losses and weights as the float32 path, step for step."""
    import eyas.training.trainer as trainer_module
    from eyas.training.config import TrainConfig

    heads = {}
    for screen in (False, True):
        monkeypatch.setattr(trainer_module, "cpu_has_amx", lambda screen=screen: screen)
        config = TrainConfig(model=str(tiny_target_dir), output=str(tmp_path / str(screen)),
                             features=str(feature_store_dir), draft_vocab_size=24, ttt_steps=3,
                             micro_batch_size=2, max_steps=4, save_every=0, log_every=1,
                             learning_rate=1e-3, progress=False, precision="float32")
        trainer = trainer_module.Trainer(config)
        assert (trainer.output_layer.screen is not None) == screen
        trainer.train()
        heads[screen] = {k: v.detach().clone() for k, v in trainer.head.state_dict().items()}
        drafted = torch.cat([in_draft for in_draft, _ in trainer.label_cache.values()])
        assert 0 < int(drafted.sum()) < drafted.numel()  # labels of both kinds
    assert heads[True].keys() == heads[False].keys()
    for name in heads[False]:
        assert torch.equal(heads[True][name], heads[False][name]), name
