"""The EAGLE-3 head: module names and shapes, the engine API (external KV state, masks), config
validation, and the eyas checkpoint round trip."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open

from eyas.eagle3.checkpoint import load_head, save_head
from eyas.eagle3.config import Eagle3Config, default_target_layer_ids
from eyas.eagle3.head import Eagle3Head
from eyas.eagle3.vocab import build_draft_vocab
from eyas.errors import EyasError

V, N, H = 50, 12, 16


def make_config(**overrides) -> Eagle3Config:
    values = dict(hidden_size=H, intermediate_size=40, num_attention_heads=4, num_key_value_heads=2,
                  head_dim=4, vocab_size=V, draft_vocab_size=N, target_hidden_size=H,
                  target_layer_ids=[2, 15, 27], target_num_hidden_layers=30)
    values.update(overrides)
    return Eagle3Config(**values)


def make_head(seed: int = 0) -> Eagle3Head:
    torch.manual_seed(seed)
    head = Eagle3Head(make_config())
    head.set_embedding(torch.randn(V, H))
    head.set_vocab(build_draft_vocab(torch.arange(V) % 7, N))
    for parameter in head.parameters():  # norms away from 1 so the round trip tests them too
        if parameter.requires_grad and parameter.dim() == 1:
            parameter.data.uniform_(0.5, 1.5)
    return head.eval()


def test_module_names_and_shapes_are_the_engines() -> None:
    shapes = {name: tuple(t.shape) for name, t in make_head().state_dict().items()}
    assert shapes == {
        "embed_tokens.weight": (V, H), "fc.weight": (H, 3 * H),
        "midlayer.input_layernorm.weight": (H,), "midlayer.hidden_norm.weight": (H,),
        "midlayer.self_attn.q_proj.weight": (16, 2 * H), "midlayer.self_attn.k_proj.weight": (8, 2 * H),
        "midlayer.self_attn.v_proj.weight": (8, 2 * H), "midlayer.self_attn.o_proj.weight": (H, 16),
        "midlayer.post_attention_layernorm.weight": (H,), "midlayer.mlp.gate_proj.weight": (40, H),
        "midlayer.mlp.up_proj.weight": (40, H), "midlayer.mlp.down_proj.weight": (H, 40),
        "norm.weight": (H,), "lm_head.weight": (N, H), "d2t": (N,), "t2d": (V,),
    }
    head = make_head()
    assert not head.embed_tokens.weight.requires_grad


def test_step_outputs_and_hidden_widths() -> None:
    head = make_head()
    ids, positions = torch.randint(0, V, (2, 5)), torch.arange(5).expand(2, 5)
    out = head(torch.randn(2, 5, 3 * H), ids, positions)
    assert out.logits.shape == (2, 5, N) and out.hidden.shape == (2, 5, H)
    assert out.past_kv[0].shape == (2, 2, 5, 4)
    again = head(out.hidden, ids, positions + 1)  # own output: no fc
    assert again.logits.shape == (2, 5, N)
    with pytest.raises(ValueError, match="expected 48 .* or 16"):
        head(torch.randn(2, 5, 20), ids, positions)
    assert torch.equal(head.draft_to_target(torch.arange(N)), head.draft_vocab.kept_ids)


def test_chunked_prefill_with_past_kv_equals_one_pass() -> None:
    head = make_head()
    taps, ids, positions = torch.randn(1, 9, 3 * H), torch.randint(0, V, (1, 9)), torch.arange(9)[None]
    with torch.no_grad():
        whole = head(taps, ids, positions)
        first = head(taps[:, :4], ids[:, :4], positions[:, :4])
        second = head(taps[:, 4:], ids[:, 4:], positions[:, 4:], past_kv=first.past_kv)
        masked = head(taps[:, 4:], ids[:, 4:], positions[:, 4:], past_kv=first.past_kv,
                      attn_mask=torch.ones(5, 9, dtype=torch.bool).tril(4))
    assert torch.allclose(torch.cat([first.logits, second.logits], 1), whole.logits, atol=1e-5)
    assert torch.equal(second.logits, masked.logits)
    assert torch.allclose(second.past_kv[0], whole.past_kv[0], atol=1e-6)


def test_missing_embedding_is_a_clear_error() -> None:
    head = Eagle3Head(make_config())
    with pytest.raises(RuntimeError, match="set_embedding"):
        head(torch.randn(1, 2, 3 * H), torch.zeros(1, 2, dtype=torch.long), torch.arange(2)[None])


def test_config_validation() -> None:
    assert default_target_layer_ids(30) == [2, 15, 27]
    # shallow targets (the tiny test models) still get three distinct ids in 1..L-1
    assert [default_target_layer_ids(n) for n in (4, 5, 6, 7)] == [[1, 2, 3], [1, 2, 4], [1, 3, 5], [2, 3, 4]]
    with pytest.raises(EyasError, match="out of range"):
        make_config(target_layer_ids=[2, 15, 31])
    with pytest.raises(EyasError, match="3 boundary ids"):
        make_config(target_layer_ids=[2, 15])
    with pytest.raises(EyasError, match="cannot exceed"):
        make_config(draft_vocab_size=V + 1)
    with pytest.raises(EyasError, match="multiple of"):
        make_config(num_key_value_heads=3)
    config = make_config()
    assert Eagle3Config.from_dict(config.to_dict()) == config
    with pytest.raises(EyasError, match="missing keys: hidden_size"):
        Eagle3Config.from_dict({k: v for k, v in config.to_dict().items() if k != "hidden_size"})
    with pytest.raises(EyasError, match="not an eyas EAGLE-3 head"):
        Eagle3Config.from_dict({"architectures": ["LlamaForCausalLMEagle3"]})


def test_checkpoint_round_trip_gives_identical_outputs(tmp_path) -> None:
    head = make_head()
    embedding = head.embed_tokens.weight.detach().clone()
    save_head(head, tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    assert config["format"] == "eyas-eagle3" and config["target_layer_ids"] == [2, 15, 27]
    assert config["draft_vocab_size"] == N
    with safe_open(str(tmp_path / "head" / "model.safetensors"), framework="pt") as handle:
        names = set(handle.keys())
        assert handle.get_tensor("d2t").dtype == torch.int64
        assert handle.get_tensor("t2d").dtype == torch.bool
    assert "embed_tokens.weight" not in names and {"d2t", "t2d", "fc.weight"} <= names
    loaded = load_head(tmp_path / "head", embedding=embedding)
    taps, ids, positions = torch.randn(2, 6, 3 * H), torch.randint(0, V, (2, 6)), torch.arange(6).expand(2, 6)
    with torch.no_grad():
        assert torch.equal(loaded(taps, ids, positions).logits, head(taps, ids, positions).logits)
    assert torch.equal(loaded.d2t, head.d2t) and torch.equal(loaded.t2d, head.t2d)


def test_loading_a_mismatched_checkpoint_names_the_problem(tmp_path) -> None:
    save_head(make_head(), tmp_path / "head")
    config = json.loads((tmp_path / "head" / "config.json").read_text())
    config["intermediate_size"] = 41
    (tmp_path / "head" / "config.json").write_text(json.dumps(config))
    with pytest.raises(EyasError, match=r"config.json is truncated or was changed"):
        load_head(tmp_path / "head")  # the manifest notices the edit first
    (tmp_path / "head" / "manifest.json").unlink()  # as in a head written before manifests
    with pytest.raises(EyasError, match=r"mlp.down_proj.weight has shape \(16, 40\), the config implies \(16, 41\)"):
        load_head(tmp_path / "head")
    with pytest.raises(EyasError, match="no config.json"):
        load_head(tmp_path / "nowhere")
