"""The request lm-eval-harness's `local-completions` sends for loglikelihood tasks, read the way
it reads the reply: several token-id prompts in one body, `echo`, `logprobs: 1`,
`max_tokens: 1`; the continuation's score is the sum of `token_logprobs[ctxlen:-1]`, and it is
greedy when each of those equals the largest value of its `top_logprobs` dict."""

from __future__ import annotations

import httpx
import pytest
import torch

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams

CONTEXT = [5, 6, 7, 8, 9] * 3


def full_logprobs(target, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward over ids [S] -> [S, V]: row p predicts ids[p + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(target.model(torch.tensor([ids])).logits[0].float(), dim=-1)


def lm_eval_parse(choice: dict, ctxlen: int) -> tuple[float, bool]:
    """lm_eval.models.openai_completions.LocalCompletionsAPI.parse_logprobs, for one choice."""
    token_logprobs = choice["logprobs"]["token_logprobs"][ctxlen:-1]
    tops = choice["logprobs"]["top_logprobs"][ctxlen:-1]
    return sum(token_logprobs), all(value == max(top.values()) for value, top in zip(token_logprobs, tops))


@pytest.mark.parametrize("server_name", ["tiny_plain_server", "tiny_server"])
def test_a_batch_of_loglikelihood_requests_scores_like_a_plain_forward(server_name, tiny_target, request):
    server = request.getfixturevalue(server_name)
    greedy = generate(tiny_target, CONTEXT, SamplingParams(max_tokens=3, ignore_eos=True)).token_ids
    not_greedy = [greedy[0], (greedy[1] + 1) % 200 + 10, greedy[2]]
    continuations = [greedy, not_greedy, greedy[:1]]
    prompts = [CONTEXT + continuation for continuation in continuations]
    body = {"model": server.name, "prompt": prompts, "temperature": 0, "max_tokens": 1, "logprobs": 1,
            "seed": 1234, "echo": True}
    reply = httpx.post(f"{server.url}/v1/completions", json=body, timeout=60)
    assert reply.status_code == 200, reply.text
    choices = sorted(reply.json()["choices"], key=lambda choice: choice["index"])
    assert len(choices) == len(prompts)
    for choice, prompt, continuation in zip(choices, prompts, continuations):
        assert len(choice["logprobs"]["token_logprobs"]) == len(prompt) + 1  # the prompt, then one token
        score, is_greedy = lm_eval_parse(choice, len(CONTEXT))
        reference = full_logprobs(tiny_target, prompt)
        expected = sum(float(reference[len(CONTEXT) - 1 + i, token]) for i, token in enumerate(continuation))
        assert score == pytest.approx(expected, abs=1e-4)
        assert is_greedy == (continuation != not_greedy)
