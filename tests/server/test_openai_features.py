"""The official openai client against eyas for logprobs, echo, n, several prompts, penalties
and logit_bias, streamed and not; with drafts the answers (and logprobs, to float tolerance)
equal those of the server without drafts and of plain decoding."""

from __future__ import annotations

from collections import defaultdict

import pytest
import torch

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.models.tokenizer import chat_prompt_ids

MESSAGES = [{"role": "user", "content": "Count: one two three one two three"}]
PROMPT_IDS = [[5, 6, 7, 8, 9] * 4, [300, 301, 302, 303, 304, 305]]
NO_EOS = {"ignore_eos": True}


def full_logprobs(target, ids: list[int]) -> torch.Tensor:
    """log_softmax of one plain forward over ids: row p predicts ids[p + 1]."""
    with torch.inference_mode():
        return torch.log_softmax(target.model(torch.tensor([ids])).logits[0].float(), dim=-1)


def chat_logprobs(server, stream: bool):
    client = server.client()
    kwargs = dict(model=server.name, messages=MESSAGES, max_tokens=12, temperature=0, logprobs=True,
                  top_logprobs=3, extra_body=NO_EOS)
    if not stream:
        reply = client.chat.completions.create(**kwargs)
        return reply.choices[0].message.content, reply.choices[0].logprobs.content
    text, content = "", []
    for chunk in client.chat.completions.create(stream=True, **kwargs):
        if chunk.choices and chunk.choices[0].logprobs is not None:
            content += chunk.choices[0].logprobs.content
        if chunk.choices:
            text += chunk.choices[0].delta.content or ""
    return text, content


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_logprobs_with_drafts_equal_those_without(tiny_server, tiny_plain_server, tiny_target,
                                                       stream):
    text, drafted = chat_logprobs(tiny_server, stream)
    plain_text, plain = chat_logprobs(tiny_plain_server, stream)
    assert text == plain_text and len(drafted) == len(plain) == 12
    prompt = chat_prompt_ids(tiny_target.tokenizer, MESSAGES)
    tokens = generate(tiny_target, prompt, SamplingParams(max_tokens=12, ignore_eos=True)).token_ids
    reference = full_logprobs(tiny_target, prompt + tokens)
    assert "".join(entry.token for entry in drafted) == text
    for position, (a, b) in enumerate(zip(drafted, plain)):
        assert a.token == b.token and a.bytes == list(a.token.encode())
        expected = float(reference[len(prompt) - 1 + position, tokens[position]])
        assert a.logprob == pytest.approx(expected, abs=1e-4)
        assert b.logprob == pytest.approx(a.logprob, abs=1e-4)
        assert [t.token for t in a.top_logprobs] == [t.token for t in b.top_logprobs]
        assert len(a.top_logprobs) == 3 and a.top_logprobs[0].token == a.token  # greedy
        assert a.top_logprobs[0].logprob >= a.top_logprobs[1].logprob >= a.top_logprobs[2].logprob


def test_completions_echo_returns_the_prompts_logprobs(tiny_server, tiny_target):
    prompt = PROMPT_IDS[0]
    client = tiny_server.client()
    reply = client.completions.create(model=tiny_server.name, prompt=prompt, max_tokens=3, temperature=0,
                                      logprobs=2, echo=True, extra_body=NO_EOS)
    choice = reply.choices[0]
    logprobs = choice.logprobs
    assert len(logprobs.tokens) == len(prompt) + 3 == len(logprobs.token_logprobs)
    assert logprobs.token_logprobs[0] is None and logprobs.top_logprobs[0] is None
    prompt_text = tiny_target.tokenizer.decode(prompt)
    assert choice.text.startswith(prompt_text)
    generated = generate(tiny_target, prompt, SamplingParams(max_tokens=3, ignore_eos=True))
    assert choice.text == prompt_text + generated.text
    reference = full_logprobs(tiny_target, prompt + generated.token_ids)
    everything = prompt + generated.token_ids
    for position in range(1, len(everything)):
        assert logprobs.token_logprobs[position] == pytest.approx(
            float(reference[position - 1, everything[position]]), abs=1e-4)
        top = logprobs.top_logprobs[position]
        assert 2 <= len(top) <= 3  # the two most likely, and the chosen token
    assert logprobs.text_offset[0] == 0 and logprobs.text_offset == sorted(logprobs.text_offset)
    # streamed: the prompt first, then the answer; the same logprobs
    text, token_logprobs = "", []
    for chunk in client.completions.create(model=tiny_server.name, prompt=prompt, max_tokens=3,
                                           temperature=0, logprobs=2, echo=True, stream=True,
                                           extra_body=NO_EOS):
        text += chunk.choices[0].text
        if chunk.choices[0].logprobs is not None:
            token_logprobs += chunk.choices[0].logprobs.token_logprobs
    assert text == choice.text
    assert token_logprobs[0] is None
    assert token_logprobs[1:] == pytest.approx(logprobs.token_logprobs[1:], abs=1e-5)


def test_n_samples_are_seeded_seed_plus_index_and_stream_with_their_index(tiny_server):
    client = tiny_server.client()
    kwargs = dict(model=tiny_server.name, messages=MESSAGES, max_tokens=8, temperature=1.0,
                  extra_body=NO_EOS)
    reply = client.chat.completions.create(n=3, seed=11, **kwargs)
    assert [c.index for c in reply.choices] == [0, 1, 2]
    texts = [c.message.content for c in reply.choices]
    alone = [client.chat.completions.create(n=1, seed=11 + i, **kwargs).choices[0].message.content
             for i in range(3)]
    assert texts == alone
    assert len(set(texts)) > 1  # different seeds, different samples
    assert reply.usage.completion_tokens == 3 * 8
    streamed = defaultdict(str)
    finished = set()
    usage = None
    for chunk in client.chat.completions.create(n=3, seed=11, stream=True,
                                                stream_options={"include_usage": True}, **kwargs):
        for choice in chunk.choices:
            streamed[choice.index] += choice.delta.content or ""
            if choice.finish_reason is not None:
                finished.add(choice.index)
        usage = chunk.usage or usage
    assert [streamed[i] for i in range(3)] == texts and finished == {0, 1, 2}
    assert usage.completion_tokens == 24 and usage.prompt_tokens == reply.usage.prompt_tokens


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_several_prompts_give_prompt_index_times_n_plus_sample(tiny_server, stream):
    client = tiny_server.client()
    kwargs = dict(model=tiny_server.name, max_tokens=6, temperature=1.0, seed=3, extra_body=NO_EOS)
    texts: dict[int, str] = defaultdict(str)
    if stream:
        for chunk in client.completions.create(prompt=PROMPT_IDS, n=2, stream=True, **kwargs):
            for choice in chunk.choices:
                texts[choice.index] += choice.text
    else:
        reply = client.completions.create(prompt=PROMPT_IDS, n=2, **kwargs)
        assert reply.usage.prompt_tokens == sum(len(p) for p in PROMPT_IDS)  # once per prompt
        assert reply.usage.completion_tokens == 4 * 6
        texts.update({c.index: c.text for c in reply.choices})
    assert sorted(texts) == [0, 1, 2, 3]
    for prompt_index, prompt in enumerate(PROMPT_IDS):
        for sample in range(2):
            alone = client.completions.create(prompt=prompt, **{**kwargs, "seed": 3 + sample})
            assert texts[prompt_index * 2 + sample] == alone.choices[0].text


def test_penalties_and_logit_bias_with_drafts_equal_plain(tiny_server, tiny_target):
    client = tiny_server.client()
    prompt = PROMPT_IDS[0]
    banned = generate(tiny_target, prompt, SamplingParams(max_tokens=1)).token_ids[0]
    reply = client.completions.create(
        model=tiny_server.name, prompt=prompt, max_tokens=16, temperature=0, frequency_penalty=1.0,
        presence_penalty=0.5, logit_bias={str(banned): -100},
        extra_body={**NO_EOS, "repetition_penalty": 1.2})
    params = SamplingParams(max_tokens=16, ignore_eos=True, frequency_penalty=1.0, presence_penalty=0.5,
                            repetition_penalty=1.2, logit_bias={banned: -100.0})
    expected = generate(tiny_target, prompt, params)
    assert reply.choices[0].text == expected.text
    assert banned not in expected.token_ids
    assert reply.choices[0].text != generate(tiny_target, prompt, SamplingParams(max_tokens=16,
                                                                                 ignore_eos=True)).text
