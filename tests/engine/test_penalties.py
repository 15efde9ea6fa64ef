"""Penalties and logit_bias at draft-tree positions equal a sequential reference (vLLM's
formulas, written out over the whole vocabulary) applied to the history of each position."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.logits_process import node_paths, process_tree_rows
from eyas.engine.penalties import LogitBias, Penalties, sampling_processors
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.draft import DraftTree
from eyas.errors import EyasError

VOCAB = 50


def reference(logits, prompt, output, presence, frequency, repetition, bias):
    """vLLM's sampler, one position: logit_bias, then repetition over prompt + output, then
    frequency and presence over the output."""
    logits = logits.clone()
    for token, value in bias.items():
        logits[token] += value
    counts = torch.bincount(torch.tensor(output, dtype=torch.long), minlength=VOCAB).float()
    seen = torch.zeros(VOCAB, dtype=torch.bool)
    seen[prompt] = True
    seen |= counts > 0
    factor = torch.where(seen, torch.tensor(repetition), torch.tensor(1.0))
    logits = torch.where(logits > 0, logits / factor, logits * factor)
    logits -= frequency * counts
    logits -= presence * (counts > 0).float()
    return logits


@pytest.mark.parametrize("presence,frequency,repetition", [
    (0.5, 0.0, 1.0), (0.0, 0.7, 1.0), (0.0, 0.0, 1.3), (0.4, -0.3, 0.8), (-1.0, 2.0, 1.7)])
def test_penalties_at_tree_positions_equal_the_sequential_reference(presence, frequency, repetition):
    generator = torch.Generator().manual_seed(0)
    logits = torch.randn(6, VOCAB, generator=generator) * 3  # root + 5 nodes, both signs
    # a tree with two branches, a repeated token on a path and tokens also in the output
    tree = DraftTree(torch.tensor([7, 9, 7, 3, 7]), torch.tensor([0, 0, 1, 3, 2]))
    prompt = [1, 2, 3, 40]
    output = [5, 7, 5, 11]  # the completion so far, the root (11) last
    bias = {9: -100.0, 12: 4.5}
    params = SamplingParams(presence_penalty=presence, frequency_penalty=frequency,
                            repetition_penalty=repetition, logit_bias=bias)
    processors = sampling_processors(params, prompt)
    processed = process_tree_rows(logits, processors, output, tree)
    for row, path in enumerate(node_paths(tree)):
        expected = reference(logits[row], prompt, output + path, presence, frequency, repetition, bias)
        torch.testing.assert_close(processed[row], expected, rtol=0, atol=1e-6)
    assert not torch.equal(processed, logits)


def test_no_penalty_asked_means_no_processor():
    assert sampling_processors(SamplingParams(), [1, 2]) == []


def test_logit_bias_adds_to_its_tokens_only():
    row = torch.zeros(VOCAB)
    out = LogitBias({3: 2.0, 4: -100.0})([1, 2], row.clone())
    assert out[3] == 2.0 and out[4] == -100.0 and float(out.abs().sum()) == 102.0


def test_presence_and_frequency_count_the_completion_not_the_prompt():
    row = torch.zeros(VOCAB)
    out = Penalties([8, 8, 9], presence=1.0, frequency=0.5)([2, 2, 2, 3], row.clone())
    assert out[2] == pytest.approx(-1.0 - 1.5) and out[3] == pytest.approx(-1.5)
    assert out[8] == 0.0 and out[9] == 0.0


@pytest.mark.parametrize("fields", [{"presence_penalty": 2.5}, {"frequency_penalty": -3.0},
                                    {"repetition_penalty": 0.0}, {"logit_bias": {3: 101.0}},
                                    {"logit_bias": {-1: 1.0}}, {"logprobs": 21},
                                    {"prompt_logprobs": -1}])
def test_out_of_range_parameters_are_refused(fields):
    with pytest.raises(EyasError):
        SamplingParams(**fields)


def test_sample_seeds_follow_the_request_seed():
    params = SamplingParams(seed=7, temperature=1.0)
    assert [params.for_sample(i).seed for i in range(3)] == [7, 8, 9]
    assert SamplingParams().for_sample(2).seed is None
