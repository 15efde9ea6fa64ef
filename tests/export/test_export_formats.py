"""Export: names, shapes and config keys per format, layer-id conversion, round trip, --check."""

from __future__ import annotations

import json

import pytest
import torch
from safetensors import safe_open
from safetensors.torch import load_file, save_file

from eyas.eagle3.config import Eagle3Config
from eyas.eagle3.head import Eagle3Head
from eyas.eagle3.vocab import build_draft_vocab
from eyas.errors import EyasError
from eyas.export.check import check_export
from eyas.export.formats import FORMATS, export_head, import_head
from eyas.models.config import ModelConfig

V, N, H, L = 64, 16, 16, 30
LAYER_NAMES = ["input_layernorm.weight", "hidden_norm.weight", "self_attn.q_proj.weight",
               "self_attn.k_proj.weight", "self_attn.v_proj.weight", "self_attn.o_proj.weight",
               "post_attention_layernorm.weight", "mlp.gate_proj.weight", "mlp.up_proj.weight",
               "mlp.down_proj.weight"]


@pytest.fixture(scope="module")
def head() -> Eagle3Head:
    torch.manual_seed(0)
    config = Eagle3Config(hidden_size=H, intermediate_size=24, num_attention_heads=4, num_key_value_heads=2,
                          head_dim=4, vocab_size=V, draft_vocab_size=N, target_hidden_size=H,
                          target_layer_ids=[2, 15, 27], target_num_hidden_layers=L, target_model="tiny",
                          rope_theta=50000.0)
    head = Eagle3Head(config)
    head.set_embedding(torch.randn(V, H))
    head.set_vocab(build_draft_vocab(torch.arange(V) % 5, N))
    for parameter in head.parameters():
        if parameter.requires_grad and parameter.dim() == 1:
            parameter.data.uniform_(0.5, 1.5)
    return head.eval()


def export_as(head: Eagle3Head, folder, fmt: str, **options):
    """float32 (bit-exact round trips) and a named verifier: the head's target "tiny" is neither a
    registered alias nor a folder, so neither could be looked up."""
    options = {"dtype": "float32", "target_name": "HuggingFaceTB/SmolLM2-135M-Instruct", **options}
    return export_head(head, folder, fmt, **options)


def names_of(folder) -> dict[str, tuple[torch.dtype, tuple[int, ...]]]:
    tensors = load_file(str(folder / "model.safetensors"))
    return {name: (t.dtype, tuple(t.shape)) for name, t in tensors.items()}


@pytest.mark.parametrize("fmt,prefix", [("sglang", "midlayer."), ("vllm", "midlayer."), ("speculators", "layers.0.")])
def test_tensor_names_shapes_and_dtypes(tmp_path, head, fmt, prefix) -> None:
    export_as(head, tmp_path / fmt, fmt)
    found = names_of(tmp_path / fmt)
    expected_names = {"fc.weight", "norm.weight", "lm_head.weight", "d2t", "t2d"} | {prefix + n for n in LAYER_NAMES}
    assert set(found) == expected_names
    assert found["fc.weight"] == (torch.float32, (H, 3 * H))
    assert found[prefix + "self_attn.q_proj.weight"] == (torch.float32, (16, 2 * H))
    assert found[prefix + "self_attn.k_proj.weight"] == (torch.float32, (8, 2 * H))
    assert found["lm_head.weight"] == (torch.float32, (N, H))
    assert found["d2t"] == (torch.int64, (N,)) and found["t2d"] == (torch.bool, (V,))
    d2t = load_file(str(tmp_path / fmt / "model.safetensors"))["d2t"]
    assert torch.equal(d2t, head.d2t)  # offsets, not absolute ids


def test_config_keys_and_layer_ids_per_engine(tmp_path, head) -> None:
    configs = {}
    for fmt in FORMATS:
        export_as(head, tmp_path / fmt, fmt, dtype="bfloat16", speculative_tokens=5,
                    target_name="HuggingFaceTB/SmolLM2-135M-Instruct")
        configs[fmt] = json.loads((tmp_path / fmt / "config.json").read_text())
    sglang, vllm, spec = configs["sglang"], configs["vllm"], configs["speculators"]
    for config in (sglang, vllm):
        assert config["model_type"] == "llama" and config["num_hidden_layers"] == 1
        assert (config["hidden_size"], config["intermediate_size"], config["num_attention_heads"],
                config["num_key_value_heads"], config["head_dim"]) == (H, 24, 4, 2, 4)
        assert (config["vocab_size"], config["draft_vocab_size"], config["target_hidden_size"]) == (V, N, H)
        assert config["tie_word_embeddings"] is False and config["rope_theta"] == 50000.0
        assert config["torch_dtype"] == "bfloat16"
    assert sglang["architectures"] == ["LlamaForCausalLMEagle3"]
    assert sglang["eagle_config"] == {"eagle_aux_hidden_state_layer_ids": [1, 14, 26], "use_aux_hidden_state": True}
    assert "eagle_aux_hidden_state_layer_ids" not in sglang  # SGLang reads the nested ids and adds 1
    assert vllm["architectures"] == ["Eagle3LlamaForCausalLM"]
    assert vllm["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]  # boundary ids, as vLLM reads them
    assert "eagle_aux_hidden_state_layer_ids" not in vllm["eagle_config"]
    assert spec["architectures"] == ["Eagle3Speculator"] and spec["speculators_model_type"] == "eagle3"
    assert spec["eagle_aux_hidden_state_layer_ids"] == [2, 15, 27]
    assert spec["norm_before_residual"] is False and spec["draft_vocab_size"] == N
    assert spec["transformer_layer_config"]["num_hidden_layers"] == 1
    assert spec["transformer_layer_config"]["vocab_size"] == V
    proposal = spec["speculators_config"]["proposal_methods"][0]
    assert (proposal["proposal_type"], proposal["speculative_tokens"]) == ("greedy", 5)
    assert spec["speculators_config"]["verifier"] == {"name_or_path": "HuggingFaceTB/SmolLM2-135M-Instruct",
                                                      "architectures": ["LlamaForCausalLM"]}
    for fmt, config in configs.items():
        assert config["eyas_export"]["format"] == fmt
        assert config["eyas_export"]["target_layer_ids"] == [2, 15, 27]


@pytest.mark.parametrize("fmt", FORMATS)
def test_round_trip_gives_identical_outputs(tmp_path, head, fmt) -> None:
    export_as(head, tmp_path / fmt, fmt)
    back = import_head(tmp_path / fmt, embedding=head.embed_tokens.weight)
    assert back.config.target_layer_ids == [2, 15, 27]
    taps, ids, positions = torch.randn(2, 5, 3 * H), torch.randint(0, V, (2, 5)), torch.arange(5).expand(2, 5)
    with torch.no_grad():
        a, b = head(taps, ids, positions), back(taps, ids, positions)
        assert torch.equal(a.logits, b.logits) and torch.equal(a.hidden, b.hidden)
        a2, b2 = head(a.hidden, ids, positions + 1), back(b.hidden, ids, positions + 1)
        assert torch.equal(a2.logits, b2.logits)
    assert torch.equal(back.d2t, head.d2t) and torch.equal(back.t2d, head.t2d)


def test_bfloat16_round_trip_and_embedding(tmp_path, head) -> None:
    export_as(head, tmp_path / "x", "vllm", dtype="bfloat16", include_embedding=True)
    assert names_of(tmp_path / "x")["embed_tokens.weight"] == (torch.bfloat16, (V, H))
    back = import_head(tmp_path / "x")  # the embedding comes from the file
    taps, ids, positions = torch.randn(1, 4, 3 * H), torch.randint(0, V, (1, 4)), torch.arange(4)[None]
    with torch.no_grad():
        assert torch.allclose(back(taps, ids, positions).logits, head(taps, ids, positions).logits, atol=0.1)


def test_check_passes_and_reports(tmp_path, head) -> None:
    export_as(head, tmp_path / "s", "sglang")
    target = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=24, num_hidden_layers=L,
                         num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    report = check_export(tmp_path / "s", target_config=target)
    assert report.ok, report.render()
    assert "target layers (boundary ids): [2, 15, 27]" in report.render()
    small_target = ModelConfig(vocab_size=V, hidden_size=H, intermediate_size=24, num_hidden_layers=20,
                               num_attention_heads=4, num_key_value_heads=2, head_dim=4)
    errors = " ".join(check_export(tmp_path / "s", target_config=small_target).errors)
    assert "trained for a target of 30 layers, the target has 20" in errors
    assert "target layer id 27 is out of range: boundary ids are 1..19 for a target of 20 layers" in errors


def rewrite(folder, tensors=None, config=None) -> None:
    if tensors is not None:
        save_file(tensors, str(folder / "model.safetensors"))
    if config is not None:
        (folder / "config.json").write_text(json.dumps(config))


def test_check_finds_each_kind_of_mistake(tmp_path, head) -> None:
    export_as(head, tmp_path / "base", "speculators")
    tensors = load_file(str(tmp_path / "base" / "model.safetensors"))
    config = json.loads((tmp_path / "base" / "config.json").read_text())

    def errors_of(name, new_tensors=None, new_config=None) -> str:
        folder = tmp_path / name
        export_as(head, folder, "speculators")
        rewrite(folder, new_tensors, new_config)
        report = check_export(folder)
        assert not report.ok
        return " ".join(report.errors)

    missing = {k: v for k, v in tensors.items() if k != "layers.0.hidden_norm.weight"}
    assert "missing tensor layers.0.hidden_norm.weight" in errors_of("missing", missing)
    midlayer = {k.replace("layers.0.", "midlayer."): v for k, v in tensors.items()}
    assert "unexpected tensor midlayer.mlp.up_proj.weight" in errors_of("names", midlayer)
    assert "lm_head.weight has shape (15, 16)" in errors_of("shape", {**tensors, "lm_head.weight": tensors["lm_head.weight"][:15]})
    assert "d2t is torch.int32" in errors_of("dtype", {**tensors, "d2t": tensors["d2t"].int()})
    absolute = tensors["d2t"] + torch.arange(N)  # absolute target ids instead of offsets
    assert "outside the target vocabulary" in errors_of("absolute", {**tensors, "d2t": absolute})
    t2d = tensors["t2d"].clone()
    t2d[0] = ~t2d[0]
    assert "t2d does not mark exactly" in errors_of("t2d", {**tensors, "t2d": t2d})
    shifted = {**config, "eagle_aux_hidden_state_layer_ids": [1, 14, 26]}  # SGLang's ids in a vLLM file
    assert "off-by-one" in errors_of("ids", new_config=shifted)
    assert "config.json lacks ['speculators_config']" in errors_of(
        "keys", new_config={k: v for k, v in config.items() if k != "speculators_config"})


def test_foreign_sglang_head_without_our_marker(tmp_path, head) -> None:
    export_as(head, tmp_path / "s", "sglang")
    config = json.loads((tmp_path / "s" / "config.json").read_text())
    del config["eyas_export"]
    (tmp_path / "s" / "config.json").write_text(json.dumps(config))
    (tmp_path / "s" / "manifest.json").unlink()  # a foreign head has no eyas manifest either
    back = import_head(tmp_path / "s", embedding=head.embed_tokens.weight)  # detected from the architecture
    assert back.config.target_layer_ids == [2, 15, 27]
    report = check_export(tmp_path / "s")
    assert report.ok and report.format == "sglang"


def test_export_refuses_bad_requests(tmp_path, head) -> None:
    with pytest.raises(EyasError, match="accepted: sglang, vllm, speculators"):
        export_as(head, tmp_path / "x", "tensorrt")
    export_as(head, tmp_path / "y", "vllm")
    with pytest.raises(EyasError, match="not empty"):
        export_as(head, tmp_path / "y", "vllm")
    with safe_open(str(tmp_path / "y" / "model.safetensors"), framework="pt") as handle:
        assert "embed_tokens.weight" not in handle.keys()
