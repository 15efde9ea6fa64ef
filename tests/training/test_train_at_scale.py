"""scripts/train-at-scale.sh, the GPU recipe, run whole on a CPU with a tiny target: answers from
a real `eyas serve` endpoint, online training under torchrun (2 gloo ranks), exports checked;
run again, it resumes and adds nothing."""

from __future__ import annotations

import json
import os
import subprocess
import sys
from pathlib import Path

import pytest
from safetensors.torch import load_file
from tiny_models import build_tiny_model

from eyas.bench.lmeval.compare import free_port, wait_healthy

ROOT = Path(__file__).parents[2]
LIMIT = 4
SOURCE = [("How do I sort a list in Python?", "And in reverse order?"),
          ("What is the capital of France?", "How many people live there?"),
          ("Write a haiku about the sea.", "Now one about the mountains."),
          ("Explain what a hash map is.", "When is a tree map better?"),
          ("Give me three tips for sleeping well.", "Which one matters most?"),
          ("What does HTTP 404 mean?", "And 503?")]


@pytest.mark.slow
def test_the_scale_recipe_runs_end_to_end_on_a_cpu_and_resumes(tmp_path, smollm_tokenizer) -> None:
    # four layers (the taps need three distinct inner layers), a context the conversations fit
    target = build_tiny_model(tmp_path / "target", smollm_tokenizer, num_hidden_layers=4,
                              max_position_embeddings=1024)
    source = tmp_path / "conversations.jsonl"
    with open(source, "w") as handle:
        for i, (question, follow_up) in enumerate(SOURCE):
            turns = [{"from": "human", "value": question}, {"from": "gpt", "value": "..."},
                     {"from": "human", "value": follow_up}, {"from": "gpt", "value": "..."}]
            handle.write(json.dumps({"id": f"c{i}", "conversations": turns}) + "\n")
    port = free_port()
    url = f"http://127.0.0.1:{port}"
    server = subprocess.Popen([sys.executable, "-m", "eyas", "serve", "--model", str(target),
                               "--dtype", "float32", "--draft", "none", "--port", str(port)],
                              stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, cwd=ROOT)
    try:
        wait_healthy(url + "/health", server, timeout=120)
        env = {**os.environ, "ENDPOINTS": url, "TARGET": str(target), "DEVICE": "cpu",
               "NPROC": "2", "LIMIT": str(LIMIT), "SOURCE": str(source), "CONCURRENCY": "4",
               "MAX_TOKENS": "12", "MAX_LENGTH": "256", "DRAFT_VOCAB": "256", "TTT_STEPS": "2",
               "MAX_STEPS": "2", "GRAD_ACCUM": "1", "SAVE_EVERY": "1", "EXPORT_DTYPE": "float32",
               "TARGET_NAME": "example/tiny-llama", "OMP_NUM_THREADS": "1",
               "EYAS": f"{sys.executable} -m eyas",
               "TORCHRUN": f"{sys.executable} -m torch.distributed.run --master_addr 127.0.0.1 "
                           f"--master_port {free_port()}"}
        run = tmp_path / "run"
        command = ["bash", str(ROOT / "scripts" / "train-at-scale.sh"), str(run)]
        done = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert done.returncode == 0, done.stdout[-2000:] + done.stderr[-3000:]
        records = [json.loads(line) for line in (run / "regenerated.jsonl").read_text().splitlines()]
        assert len(records) == LIMIT  # of the train split's conversations, each turn regenerated
        assert all(len(r["conversations"]) == 4 for r in records)
        assert {r["meta"]["regenerated"]["by"].split(":")[0] for r in records} == {"endpoint"}
        head = load_file(str(run / "train" / "head" / "model.safetensors"))
        for form in ("sglang", "vllm", "speculators"):
            exported = load_file(str(run / "export" / form / "model.safetensors"))
            assert exported["fc.weight"].shape == head["fc.weight"].shape, form
        config = json.loads((run / "export" / "speculators" / "config.json").read_text())
        assert config["speculators_config"]["verifier"]["name_or_path"] == "example/tiny-llama"
        # again: every step resumes or finds its work done; nothing is added or rewritten
        before = (run / "regenerated.jsonl").read_bytes()
        weights = (run / "export" / "vllm" / "model.safetensors").read_bytes()
        again = subprocess.run(command, env=env, cwd=ROOT, capture_output=True, text=True, timeout=600)
        assert again.returncode == 0, again.stdout[-2000:] + again.stderr[-3000:]
        assert (run / "regenerated.jsonl").read_bytes() == before
        assert (run / "export" / "vllm" / "model.safetensors").read_bytes() == weights
    finally:
        server.terminate()
        server.wait(timeout=30)
