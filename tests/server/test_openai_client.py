"""The official openai client against eyas: outputs equal plain greedy decoding, streamed or
not, with and without a draft, alone or 16 at a time; on a tiny model and on SmolLM2."""

from __future__ import annotations

from concurrent.futures import ThreadPoolExecutor

import pytest

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.models.tokenizer import chat_prompt_ids, raw_prompt_ids

from server_support import start_server

QUESTIONS = ["Say hello.", "Count: one two three one two three", "What is a KV cache?",
             "Repeat: a b c a b c a b c", "Name three colors.", "2 + 2 = ?",
             "Write a haiku about CPUs.", "Spell 'eyas'.", "Why is the sky blue?", "List 5 primes.",
             "Translate 'cat' to French.", "Summarize: the cat sat on the mat.", "Hi!",
             "What is speculative decoding?", "Give me a number.", "Describe a tree."]


def plain_chat(target, question: str, max_tokens: int):
    ids = chat_prompt_ids(target.tokenizer, [{"role": "user", "content": question}])
    return generate(target, ids, SamplingParams(max_tokens=max_tokens))


def chat(client, name, question, max_tokens, stream=False):
    messages = [{"role": "user", "content": question}]
    if not stream:
        return client.chat.completions.create(model=name, messages=messages, max_tokens=max_tokens,
                                              temperature=0)
    chunks = list(client.chat.completions.create(
        model=name, messages=messages, max_tokens=max_tokens, temperature=0, stream=True,
        stream_options={"include_usage": True}))
    return chunks


def streamed_text(chunks) -> str:
    return "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)


@pytest.fixture(params=["ngram", "none"])
def served(request, tiny_server, tiny_plain_server):
    return tiny_server if request.param == "ngram" else tiny_plain_server


def test_chat_streaming_and_not_equal_plain_greedy(served, tiny_target):
    client = served.client()
    for question in QUESTIONS[:3]:
        expected = plain_chat(tiny_target, question, 20)
        response = chat(client, served.name, question, 20)
        assert response.choices[0].message.content == expected.text
        assert response.choices[0].finish_reason == expected.finish_reason
        assert response.usage.prompt_tokens == len(chat_prompt_ids(
            tiny_target.tokenizer, [{"role": "user", "content": question}]))
        assert response.usage.completion_tokens == len(expected.token_ids)
        chunks = chat(client, served.name, question, 20, stream=True)
        assert streamed_text(chunks) == expected.text
        assert chunks[0].choices[0].delta.role == "assistant"
        assert chunks[-1].choices == [] and chunks[-1].usage.total_tokens == response.usage.total_tokens
        assert [c.choices[0].finish_reason for c in chunks if c.choices][-1] == "length"
    if served.engine.proposers.enabled:
        assert response.model_extra["speculative_decoding"]["method"] == "ngram"


def test_completions_streaming_and_not_equal_plain_greedy(served, tiny_target):
    client = served.client()
    prompt = "a b c a b c a b c"
    expected = generate(tiny_target, raw_prompt_ids(tiny_target.tokenizer, prompt),
                        SamplingParams(max_tokens=16))
    response = client.completions.create(model=served.name, prompt=prompt, max_tokens=16, temperature=0)
    assert response.choices[0].text == expected.text
    stream = client.completions.create(model=served.name, prompt=prompt, max_tokens=16,
                                       temperature=0, stream=True)
    assert "".join(c.choices[0].text for c in stream) == expected.text
    by_ids = client.completions.create(model=served.name, prompt=raw_prompt_ids(tiny_target.tokenizer, prompt),
                                       max_tokens=16, temperature=0)
    assert by_ids.choices[0].text == expected.text


def test_stop_strings_cut_like_plain_decoding(tiny_server, tiny_target):
    expected = plain_chat(tiny_target, QUESTIONS[0], 30).text
    stop = expected[10:13]
    params = SamplingParams(max_tokens=30, stop=[stop])
    alone = generate(tiny_target, chat_prompt_ids(tiny_target.tokenizer, [{"role": "user", "content": QUESTIONS[0]}]), params)
    client = tiny_server.client()
    response = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": QUESTIONS[0]}],
                                              max_tokens=30, temperature=0, stop=stop)
    assert response.choices[0].message.content == alone.text
    assert response.choices[0].finish_reason == "stop"


def test_sixteen_concurrent_requests_complete_with_correct_outputs(tiny_server, tiny_target):
    expected = [plain_chat(tiny_target, q, 24).text for q in QUESTIONS]
    client = tiny_server.client()

    def ask(index):
        if index % 2:
            return streamed_text(chat(client, "tiny", QUESTIONS[index], 24, stream=True))
        return chat(client, "tiny", QUESTIONS[index], 24).choices[0].message.content

    with ThreadPoolExecutor(16) as pool:
        answers = list(pool.map(ask, range(16)))
    assert answers == expected


def test_models_lists_the_served_model(tiny_server):
    models = tiny_server.client().models.list()
    assert [m.id for m in models.data] == ["tiny"]


@pytest.mark.parametrize("draft", ["ngram:3,1,3", "none"])
def test_smollm2_outputs_equal_plain_greedy(smollm_int4_target, draft):
    """The central invariant through the whole server, on the real model (int4, as served by
    default), batched."""
    from eyas.bench.prompts import CODE_PROMPTS, mtbench_first_turns

    target = smollm_int4_target
    questions = mtbench_first_turns(2) + CODE_PROMPTS[:1]
    expected = [plain_chat(target, q, 24).text for q in questions]
    served = start_server(target, "smollm2", draft=draft, max_running=4)
    try:
        client = served.client()
        with ThreadPoolExecutor(6) as pool:
            plain = pool.map(lambda q: chat(client, "smollm2", q, 24).choices[0].message.content, questions)
            streamed = pool.map(lambda q: streamed_text(chat(client, "smollm2", q, 24, stream=True)), questions)
            assert list(plain) == expected
            assert list(streamed) == expected
    finally:
        served.server.stop()
