"""Peers of `eyas bench offline`: transformers assisted generation decodes exactly as plain
greedy `generate`, and `--peers` expands to the peers this machine can run."""

from __future__ import annotations

import json
import re

import pytest

from eyas.bench.offline import OfflineConfig
from eyas.bench.peers import hf_runner, peer_systems
from eyas.cli.bench import offline_systems
from eyas.cli.main import main
from eyas.errors import EyasError
from tiny_models import build_tiny_model

PROMPTS = [[1, 500, 600, 700, 800], [1, 42, 4242, 31337, 9, 17, 17, 17]]


@pytest.fixture(scope="module")
def other_draft_dir(tmp_path_factory, smollm_tokenizer):
    """A second tiny model (other random weights, same tokenizer): a draft that gets rejected."""
    return build_tiny_model(tmp_path_factory.mktemp("tiny-draft"), smollm_tokenizer, seed=1)


def test_assisted_generation_equals_plain_greedy(tiny_model_dir, other_draft_dir):
    plain, plain_name = hf_runner(str(tiny_model_dir), max_tokens=16)
    itself, name = hf_runner(str(tiny_model_dir), max_tokens=16, assistant=str(tiny_model_dir))
    other, _ = hf_runner(str(tiny_model_dir), max_tokens=16, assistant=str(other_draft_dir))
    assert plain_name == "transformers generate (float32)"
    assert name == f"transformers generate + assisted ({tiny_model_dir}) (float32)"
    for ids in PROMPTS:
        expected = plain(ids)
        assert len(expected) == 16  # random weights: no EOS, max_new_tokens each
        assert itself(ids) == expected
        assert other(ids) == expected


def test_peers_expansion():
    assert peer_systems("smollm2-135m", with_llama_cpp=True) == [
        "llama.cpp", "hf-lookup", "hf-assisted:smollm2-135m", "hf"]
    assert peer_systems("smollm2-135m", with_llama_cpp=False) == [
        "hf-lookup", "hf-assisted:smollm2-135m", "hf"]
    # a folder has no GGUF for llama.cpp; `--draft model:M` is the assistant
    assert peer_systems("/models/big", draft="model:/models/small", with_llama_cpp=True) == [
        "hf-lookup", "hf-assisted:/models/small", "hf"]
    assert peer_systems("smollm2-135m", draft="ngram", with_llama_cpp=False)[1] == \
        "hf-assisted:smollm2-135m"


def test_offline_systems_with_peers():
    assert offline_systems("smollm2-135m", peers=True, with_llama_cpp=True) == [
        "eyas:auto", "eyas:float32", "llama.cpp", "hf-lookup", "hf-assisted:smollm2-135m", "hf"]
    assert offline_systems("smollm2-135m", draft="ngram", peers=True, with_llama_cpp=False) == [
        "eyas:auto", "eyas:auto+ngram", "hf-lookup", "hf-assisted:smollm2-135m", "hf"]
    assert offline_systems("smollm2-135m", systems="hf;eyas:int4+ngram:3,1,3", peers=True,
                           with_llama_cpp=False) == [
        "eyas:int4+ngram:3,1,3", "hf-lookup", "hf-assisted:smollm2-135m", "hf"]
    assert offline_systems("smollm2-135m") == ["eyas:auto", "eyas:float32", "hf"]


@pytest.mark.parametrize("system, message", [
    ("hf-assisted", "hf-assisted needs its draft model"),
    ("vllm", "accepted: eyas[:PRECISION[+DRAFT]], hf, hf-lookup, hf-assisted:DRAFT_MODEL"),
])
def test_bad_systems(system, message):
    with pytest.raises(EyasError, match=re.escape(message)):
        OfflineConfig(systems=[system])


def test_offline_cli_with_an_assisted_row(tiny_model_dir, tmp_path, capsys):
    output = tmp_path / "offline.json"
    code = main(["bench", "offline", "--model", str(tiny_model_dir), "--num-prompts", "2",
                 "--max-tokens", "8", "--systems", f"eyas:float32;hf-assisted:{tiny_model_dir};hf",
                 "--output", str(output)])
    assert code == 0
    out = capsys.readouterr().out
    assert f"| transformers generate + assisted ({tiny_model_dir}) (float32) |" in out
    results = json.loads(output.read_text())["results"]
    assert [sum(r["tokens"]) for r in results] == [16, 16, 16]
    assert [r["identical_outputs_to_last"] for r in results] == [2, 2, 2]


def test_llama_cpp_prefills_every_prompt_whole_on_torchs_threads(monkeypatch, tmp_path):
    """llama-cpp-python keeps the previous prompt's KV rows for a common prefix unless reset,
    and prefills on every core unless told: the runner must do neither (eyas's runners don't)."""
    import sys
    import types

    import torch

    from eyas.bench import peers

    calls: list = []

    class FakeLlama:
        def __init__(self, **kwargs) -> None:
            calls.append(("init", kwargs["n_threads"], kwargs["n_threads_batch"]))

        def reset(self) -> None:
            calls.append("reset")

        def token_eos(self) -> int:
            return 0

        def generate(self, ids, **kwargs):
            calls.append(("generate", list(ids)))
            yield from (5, 6, 0)

    monkeypatch.setitem(sys.modules, "llama_cpp", types.SimpleNamespace(Llama=FakeLlama))
    monkeypatch.setattr(peers, "llama_cpp_available", lambda: True)
    monkeypatch.setattr(peers, "gguf_path", lambda model: tmp_path / "model.gguf")
    run, _ = peers.llama_cpp_runner("some-model", max_tokens=8)
    assert run([1, 2, 3]) == [5, 6] and run([1, 2, 4]) == [5, 6]
    threads = torch.get_num_threads()
    assert calls == [("init", threads, threads), "reset", ("generate", [1, 2, 3]), "reset",
                     ("generate", [1, 2, 4])]


def test_bad_trees_are_refused_before_any_model_loads():
    with pytest.raises(EyasError, match=re.escape("--tree: bad tree shape 'chain:x'")):
        OfflineConfig(tree="chain:x")
    with pytest.raises(EyasError, match=re.escape("eyas:int4+eagle3:smollm2-135m~2,2: bad tree shape")):
        OfflineConfig(systems=["eyas:int4+eagle3:smollm2-135m~2,2"])


def test_a_systems_own_tree_reaches_its_proposer(monkeypatch):
    """'~TREE' after a row's draft sizes that row's tree; rows without one get --tree."""
    import types

    from eyas.bench import offline
    from eyas.engine.speculative import methods

    seen = []
    monkeypatch.setattr(methods, "build_proposer", lambda spec, target, tree=None: seen.append((spec, tree)))
    monkeypatch.setitem(offline._TARGETS, ("m", "int4"), types.SimpleNamespace(precision="int4"))
    offline.eyas_runner("m", "int4+eagle3:h~chain:1", 8, 4, [], "auto")
    offline.eyas_runner("m", "int4+eagle3:h+ngram", 8, 4, [], "3,2,6")
    assert seen == [("eagle3:h", "chain:1"), ("eagle3:h+ngram", "3,2,6")]
