"""The GPU paths against the CPU on a tiny random target: plain and batched decoding, prompt-lookup
speculation, in-process regeneration, feature extraction and a training step, with resume. Each
runs on CUDA and is compared with the same work on the CPU (float32 on both, so greedy choices
agree; the tiny target's peaked output layer keeps them far from ties)."""

from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch

from eyas.engine.sampling import SamplingParams
from spec_checks import assert_batched_serving_equals_plain

if not torch.cuda.is_available() and os.environ.get("EYAS_CUDA_TESTS_ON_CPU") != "1":
    pytest.skip("no CUDA device (EYAS_CUDA_TESTS_ON_CPU=1 runs these tests on the CPU)", allow_module_level=True)
GPU = "cuda" if torch.cuda.is_available() else "cpu"  # the device under test

NEW_TOKENS = 24


@pytest.fixture(scope="module")
def targets(cuda_target_dir: Path):
    from eyas.engine.target import load_target

    return (load_target(str(cuda_target_dir), dtype="float32", device="cpu"),
            load_target(str(cuda_target_dir), dtype="float32", device=GPU))


def test_the_target_loads_on_the_gpu_and_decodes_as_on_the_cpu(targets, prompts) -> None:
    from eyas.engine.generate import generate

    cpu, gpu = targets
    assert gpu.device.type == next(gpu.model.parameters()).device.type == GPU
    params = SamplingParams(max_tokens=NEW_TOKENS)
    for prompt in prompts:
        expected = generate(cpu, prompt, params).token_ids
        assert len(expected) == NEW_TOKENS
        assert generate(gpu, prompt, params).token_ids == expected


def test_batched_decoding_on_the_gpu_equals_one_prompt_at_a_time(targets, prompts) -> None:
    from eyas.engine.generate import generate, generate_batch

    _, gpu = targets
    params = SamplingParams(max_tokens=NEW_TOKENS)
    alone = [generate(gpu, prompt, params).token_ids for prompt in prompts]
    assert [r.token_ids for r in generate_batch(gpu, prompts, params)] == alone


def test_prompt_lookup_speculation_on_the_gpu_equals_plain(targets, prompts) -> None:
    _, gpu = targets
    assert assert_batched_serving_equals_plain(gpu, "ngram:3,1,3", seed=0, prompts=prompts) > 0


def test_in_process_regeneration_on_the_gpu_writes_the_cpu_answers(tmp_path: Path, cuda_target_dir: Path) -> None:
    from eyas.data.endpoint import SamplingConfig
    from eyas.data.regenerate import RegenerateConfig, run_regenerate

    with open(tmp_path / "in.jsonl", "w") as handle:
        for i in range(5):
            turns = [{"role": "user", "content": " ".join(f"t{(i * 7 + j * 3) % 200 + 4}" for j in range(6 + i))}
                     for _ in range(2)]
            handle.write(json.dumps({"id": f"r{i}", "conversations": turns}) + "\n")
    answers = {}
    for device in ("cpu", GPU):
        config = RegenerateConfig(input=str(tmp_path / "in.jsonl"), output=tmp_path / f"{device}-{len(answers)}.jsonl",
                                  model=str(cuda_target_dir), dtype="float32", device=device, concurrency=3,
                                  progress=False, sampling=SamplingConfig(max_tokens=8), pii=_no_pii())
        report = run_regenerate(config)
        assert report.written == 5 and not report.failed
        records = [json.loads(line) for line in config.output.read_text().splitlines()]
        answers[len(answers)] = {r["id"]: r["conversations"] for r in records}
    assert answers[1] == answers[0]


def _no_pii():
    from eyas.data.pii.policy import PiiConfig

    return PiiConfig(enabled=False)


def _tokenized(path: Path, count: int = 16) -> Path:
    from eyas.features.tokenized import TokenizedSample, write_tokenized

    generator = torch.Generator().manual_seed(1)
    samples = []
    for i in range(count):
        length = int(torch.randint(16, 48, (1,), generator=generator))
        ids = torch.randint(4, 128, (length,), generator=generator)
        mask = torch.zeros(length, dtype=torch.int64)
        mask[length // 3:] = 1
        samples.append(TokenizedSample(f"s{i}", ids, mask))
    write_tokenized(path, samples)
    return path


def test_features_on_the_gpu_match_the_cpu(tmp_path: Path, cuda_target_dir: Path) -> None:
    from eyas.features.extract import FeatureConfig, extract_features
    from eyas.features.store import FeatureStore

    data = _tokenized(tmp_path / "train.jsonl")
    stores = {}
    for device in ("cpu", GPU):
        extract_features(FeatureConfig(model=str(cuda_target_dir), data=str(data), output=str(tmp_path / f"{device}-{len(stores)}"),
                                       dtype="float32", device=device))
        stores[len(stores)] = FeatureStore(tmp_path / f"{device}-{len(stores)}")
    cpu, gpu = stores[0], stores[1]
    assert len(cpu) == len(gpu) == 16
    for index in range(len(cpu)):
        a, b = cpu.sample(index), gpu.sample(index)
        assert torch.equal(a.input_ids, b.input_ids)
        assert torch.allclose(a.taps.float(), b.taps.float(), rtol=1e-3, atol=1e-3)


def _trainer(tmp_path: Path, name: str, target_dir: Path, data: Path, device: str, **more):
    from eyas.training.config import TrainConfig
    from eyas.training.trainer import Trainer

    settings = dict(draft_vocab_size=64, ttt_steps=3, micro_batch_size=4, max_steps=4, learning_rate=1e-3,
                    warmup_ratio=0.0, precision="float32", save_every=2, eval_fraction=0.0, progress=False)
    config = TrainConfig(model=str(target_dir), data=str(data), output=str(tmp_path / name), device=device,
                         **{**settings, **more})
    return Trainer(config)


def test_a_training_step_on_the_gpu_matches_the_cpu(tmp_path: Path, cuda_target_dir: Path) -> None:
    data = _tokenized(tmp_path / "train.jsonl")
    cpu = _trainer(tmp_path, "cpu", cuda_target_dir, data, "cpu")
    gpu = _trainer(tmp_path, "gpu", cuda_target_dir, data, GPU)
    assert next(gpu.head.parameters()).device.type == GPU
    first_cpu, first_gpu = cpu.train_step(0), gpu.train_step(0)
    assert first_gpu.tokens == first_cpu.tokens > 0
    assert abs(first_gpu.loss - first_cpu.loss) < 1e-4 * first_cpu.loss
    for (name, a), (_, b) in zip(cpu.head.named_parameters(), gpu.head.named_parameters()):
        assert torch.allclose(a, b.cpu(), atol=1e-5, rtol=1e-3), name


def test_training_on_the_gpu_resumes_to_the_same_weights(tmp_path: Path, cuda_target_dir: Path) -> None:
    data = _tokenized(tmp_path / "train.jsonl")
    whole = _trainer(tmp_path, "whole", cuda_target_dir, data, GPU)
    whole.train()
    interrupted = _trainer(tmp_path, "parts", cuda_target_dir, data, GPU)
    interrupted.train(stop_after=2)
    resumed = _trainer(tmp_path, "parts", cuda_target_dir, data, GPU, resume=True)
    assert resumed.start_step == 2
    resumed.train()
    for (name, a), (_, b) in zip(whole.head.named_parameters(), resumed.head.named_parameters()):
        assert torch.allclose(a, b, atol=1e-6, rtol=1e-5), name


def test_bfloat16_attention_on_the_gpu_builds_no_cudnn_plans(tmp_path: Path, cuda_target_dir: Path) -> None:
    """cuDNN's attention plans every new shape (~80 ms of host time each on an H200): the head's
    and the target's attention keep to the kernels that need no plan (eyas/models/sdpa.py)."""
    from torch.profiler import ProfilerActivity, profile

    if GPU != "cuda":
        pytest.skip("the backend choice is the GPU's")
    trainer = _trainer(tmp_path, "bf16", cuda_target_dir, _tokenized(tmp_path / "train.jsonl"), GPU,
                       precision="bfloat16", target_dtype="bfloat16")
    with profile(activities=[ProfilerActivity.CPU]) as profiler:
        stats = trainer.train_step(0)
    names = {event.key for event in profiler.key_averages()}
    assert stats.loss > 0 and any("scaled_dot_product" in name for name in names)
    assert not any("cudnn_attention" in name for name in names), sorted(n for n in names if "attention" in n)
