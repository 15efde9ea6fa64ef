"""Medusa heads: config validation, the zero-initialised blocks, checkpoint round trips (with
a draft vocabulary and with the target's shared output layer), and errors for bad folders."""

from __future__ import annotations

import json

import pytest
import torch

from eyas.eagle3.vocab import build_draft_vocab
from eyas.errors import EyasError
from eyas.medusa import MedusaConfig, MedusaHeads, load_medusa, read_medusa_config, save_medusa

HIDDEN, VOCAB = 16, 96


def random_heads(draft_vocab_size: int | None, seed: int = 0) -> MedusaHeads:
    torch.manual_seed(seed)
    heads = MedusaHeads(MedusaConfig(HIDDEN, VOCAB, num_heads=3, num_layers=2,
                                     draft_vocab_size=draft_vocab_size))
    with torch.no_grad():
        for parameter in heads.parameters():
            parameter.normal_(0, 0.3)
    if draft_vocab_size is not None:
        counts = torch.arange(VOCAB, dtype=torch.int64) % 7  # a fixed, uneven vocabulary
        heads.set_vocab(build_draft_vocab(counts, draft_vocab_size))
    return heads.eval()


def test_config_validation_and_round_trip() -> None:
    config = MedusaConfig(HIDDEN, VOCAB, num_heads=4, draft_vocab_size=32)
    assert MedusaConfig.from_dict(json.loads(json.dumps(config.to_dict()))) == config
    assert config.output_size == 32 and not config.shares_target_output
    assert MedusaConfig(HIDDEN, VOCAB).output_size == VOCAB
    with pytest.raises(EyasError, match="num_heads must be a positive integer"):
        MedusaConfig(HIDDEN, VOCAB, num_heads=0)
    with pytest.raises(EyasError, match="draft_vocab_size must be in 1..96"):
        MedusaConfig(HIDDEN, VOCAB, draft_vocab_size=97)
    with pytest.raises(EyasError, match="not an eyas Medusa config"):
        MedusaConfig.from_dict({"format": "eyas-eagle3"})


def test_new_heads_repeat_the_blocks_input() -> None:
    """W = 0 at init: each block is x + SiLU(b), so with b = 0 a head starts as the identity."""
    heads = MedusaHeads(MedusaConfig(HIDDEN, VOCAB, num_heads=2, draft_vocab_size=VOCAB))
    for block in heads.blocks:
        torch.nn.init.zeros_(block[0].linear.bias)
    hidden = torch.randn(2, 5, HIDDEN)
    states = heads.head_states(hidden)
    assert states.shape == (2, 5, 2, HIDDEN)
    assert torch.equal(states[:, :, 0], hidden) and torch.equal(states[:, :, 1], hidden)
    assert heads(hidden).shape == (2, 5, 2, VOCAB)


@pytest.mark.parametrize("draft_vocab_size", [24, None], ids=["draft-vocabulary", "shared-output"])
def test_checkpoint_round_trip(tmp_path, draft_vocab_size) -> None:
    heads = random_heads(draft_vocab_size)
    output = torch.nn.Linear(HIDDEN, VOCAB, bias=False)
    if draft_vocab_size is None:
        heads.set_output_layer(output)
    save_medusa(heads, tmp_path / "heads")
    names = set(json.loads((tmp_path / "heads" / "config.json").read_text()))
    assert {"format", "num_heads", "num_layers", "draft_vocab_size"} <= names
    loaded = load_medusa(tmp_path / "heads")
    assert loaded.config == heads.config
    if draft_vocab_size is None:
        assert loaded.lm_head is None  # the target's output layer is not in the checkpoint
        with pytest.raises(RuntimeError, match="set_output_layer"):
            loaded(torch.zeros(1, 1, HIDDEN))
        loaded.set_output_layer(output)
    else:
        assert torch.equal(loaded.d2t, heads.d2t) and torch.equal(loaded.t2d, heads.t2d)
        kept = build_draft_vocab(torch.arange(VOCAB, dtype=torch.int64) % 7, draft_vocab_size).kept_ids
        assert torch.equal(loaded.draft_to_target(torch.arange(draft_vocab_size)), kept)
    hidden = torch.randn(1, 4, HIDDEN)
    assert torch.equal(loaded(hidden), heads(hidden))


def test_bad_folders_are_user_errors(tmp_path) -> None:
    with pytest.raises(EyasError, match="no such folder"):
        read_medusa_config(tmp_path / "missing")
    (tmp_path / "empty").mkdir()
    with pytest.raises(EyasError, match="no config.json"):
        load_medusa(tmp_path / "empty")
    save_medusa(random_heads(24), tmp_path / "small")
    config = json.loads((tmp_path / "small" / "config.json").read_text())
    config["num_heads"] = 5  # the weights hold 3 heads
    (tmp_path / "small" / "config.json").write_text(json.dumps(config))
    with pytest.raises(EyasError, match="config.json is truncated or was changed"):
        load_medusa(tmp_path / "small")  # the manifest notices the edit first
    (tmp_path / "small" / "manifest.json").unlink()  # as in heads written before manifests
    with pytest.raises(EyasError, match="missing \\['blocks.3"):
        load_medusa(tmp_path / "small")


def test_a_shared_output_layer_in_the_weights_is_rejected_and_shapes_are_checked() -> None:
    from eyas.medusa.checkpoint import load_medusa_state, medusa_state_dict

    shared = random_heads(None)
    state = medusa_state_dict(shared)
    assert not any(name.startswith("lm_head.") for name in state)  # shared: never saved
    with pytest.raises(EyasError, match=r"unexpected \['lm_head.weight'\]"):
        load_medusa_state(shared, {**state, "lm_head.weight": torch.zeros(VOCAB, HIDDEN)}, "f")
    name = next(iter(state))
    with pytest.raises(EyasError, match=f"f: {name} has shape"):
        load_medusa_state(shared, {**state, name: state[name][:1]}, "f")
    copy = random_heads(None, seed=1)
    load_medusa_state(copy, state, "f")
    assert all(torch.equal(copy.state_dict()[k], v) for k, v in state.items())
