"""Plain decoding: EOS, max_tokens, stop strings, seeded sampling, batch == single."""

from __future__ import annotations

import torch

from eyas.engine.generate import generate, generate_batch
from eyas.engine.sampling import SamplingParams, argmax_rows, target_probs


def prompts(n=3, seed=0):
    generator = torch.Generator().manual_seed(seed)
    lengths = [5, 11, 8, 3][:n]
    return [torch.randint(3, 2000, (length,), generator=generator).tolist() for length in lengths]


def test_max_tokens_is_honoured(tiny_target):
    result = generate(tiny_target, prompts()[0], SamplingParams(max_tokens=7, ignore_eos=True))
    assert len(result.token_ids) == 7 and result.finish_reason == "length"


def test_eos_stops_and_is_not_emitted(tiny_target):
    prompt = prompts()[1]
    free = generate(tiny_target, prompt, SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
    # Declare the 4th generated token an EOS: decoding must stop right before it.
    tiny_target_eos = tiny_target.config.eos_token_ids
    tiny_target.config.eos_token_ids = [free[3]]
    try:
        result = generate(tiny_target, prompt, SamplingParams(max_tokens=12))
    finally:
        tiny_target.config.eos_token_ids = tiny_target_eos
    first = free.index(free[3])
    assert result.token_ids == free[:first] and result.finish_reason == "stop"


def test_stop_string_cuts_text_and_streams_nothing_past_it(tiny_target):
    prompt = prompts()[2]
    free = generate(tiny_target, prompt, SamplingParams(max_tokens=16, ignore_eos=True))
    stop = free.text[len(free.text) // 2 : len(free.text) // 2 + 3]
    assert stop.strip(), "need a visible stop string"
    streamed: list[str] = []
    result = generate(tiny_target, prompt, SamplingParams(max_tokens=16, stop=[stop], ignore_eos=True),
                      on_text=streamed.append)
    assert result.finish_reason == "stop"
    assert result.text == free.text[: free.text.index(stop)]
    assert "".join(streamed) == result.text


def test_seeded_sampling_is_reproducible_and_seed_dependent(tiny_target):
    prompt = prompts()[0]
    params = dict(max_tokens=20, temperature=1.0, ignore_eos=True)
    a = generate(tiny_target, prompt, SamplingParams(seed=5, **params)).token_ids
    b = generate(tiny_target, prompt, SamplingParams(seed=5, **params)).token_ids
    c = generate(tiny_target, prompt, SamplingParams(seed=6, **params)).token_ids
    assert a == b and a != c


def test_batch_of_different_lengths_equals_each_alone_greedy(tiny_target):
    batch = prompts(4)
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    alone = [generate(tiny_target, p, params).token_ids for p in batch]
    together = [r.token_ids for r in generate_batch(tiny_target, batch, params)]
    assert together == alone


def test_batch_rows_that_finish_early_leave_without_disturbing_others(tiny_target):
    batch = prompts(3)
    short = SamplingParams(max_tokens=12, ignore_eos=True, stop=[])
    alone = [generate(tiny_target, p, short).token_ids for p in batch]
    tiny_target_eos = tiny_target.config.eos_token_ids
    tiny_target.config.eos_token_ids = [alone[0][2]]  # row 0 stops after 2 tokens
    try:
        results = generate_batch(tiny_target, batch, SamplingParams(max_tokens=12))
        expected = [generate(tiny_target, p, SamplingParams(max_tokens=12)).token_ids for p in batch]
    finally:
        tiny_target.config.eos_token_ids = tiny_target_eos
    assert [r.token_ids for r in results] == expected
    assert len(results[0].token_ids) < 12


def test_smollm2_batch_equals_single(smollm_target, mtbench_prompt_ids):
    batch = mtbench_prompt_ids[:3]
    params = SamplingParams(max_tokens=24)
    alone = [generate(smollm_target, p, params).token_ids for p in batch]
    assert [r.token_ids for r in generate_batch(smollm_target, batch, params)] == alone


def test_top_k_and_top_p_shape_the_distribution():
    logits = torch.log(torch.tensor([[0.5, 0.3, 0.15, 0.05]]))
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_k=2))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.8))
    assert torch.allclose(probs, torch.tensor([[0.625, 0.375, 0.0, 0.0]]))
    probs = target_probs(logits, SamplingParams(temperature=1.0, top_p=0.81))
    assert torch.allclose(probs, torch.tensor([[0.5, 0.3, 0.15, 0.0]]) / 0.95)


def test_argmax_rows_is_torch_argmax_first_index_and_nan_included():
    torch.manual_seed(0)
    logits = torch.randn(5, 49152)
    assert torch.equal(argmax_rows(logits), logits.argmax(-1))
    assert argmax_rows(logits).dtype == torch.int64
    ties = torch.tensor([[1.0, 3.0, 3.0, 2.0], [float("nan"), 1.0, float("nan"), 0.0], [0.0, 0.0, 0.0, 0.0]])
    assert argmax_rows(ties).tolist() == [1, 0, 0] == ties.argmax(-1).tolist()
    strided = logits[:, ::3]  # a view, not contiguous
    assert torch.equal(argmax_rows(strided), strided.argmax(-1))
    assert torch.equal(argmax_rows(logits.double()), logits.argmax(-1))  # other dtypes: PyTorch's
