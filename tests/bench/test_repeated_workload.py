"""The `repeated` workload: every item asked twice (first asks, then second asks), built from
MT-Bench and the code set, with conversations re-sent with their history and one more turn."""

from __future__ import annotations

from eyas.bench.datasets import load_bench_prompts
from eyas.bench.prompts import CODE_PROMPTS
from eyas.bench.repeated import repeated_prompts


def test_each_item_is_asked_twice_first_asks_first():
    prompts = repeated_prompts(12, answer=lambda messages: "ANSWER " + messages[0]["content"][:10])
    assert len(prompts) == 12
    first, second = prompts[:6], prompts[6:]
    kinds = ["regenerate", "code", "agentic"] * 2
    for kind, one, two in zip(kinds, first, second):
        if kind == "agentic":  # [q1] then [q1, a1, q2]: the history re-sent with one more turn
            assert len(one) == 1 and len(two) == 3 and two[0] == one[0]
            assert two[1] == {"role": "assistant", "content": "ANSWER " + one[0]["content"][:10]}
            assert two[2]["role"] == "user" and two[2]["content"] != one[0]["content"]
        else:  # the same request again
            assert one == two and len(one) == 1
    assert first[1][0]["content"] == CODE_PROMPTS[0] and first[4][0]["content"] == CODE_PROMPTS[1]


def test_the_serving_benchmark_loads_it_with_reference_answers_as_history():
    prompts = load_bench_prompts("repeated", 6)
    assert len(prompts) == 6
    assert prompts[0] == prompts[3] and prompts[1] == prompts[4]
    assert prompts[2].text is not None and prompts[5].text is None  # a re-sent conversation
    assert prompts[5].messages[1]["role"] == "assistant" and len(prompts[5].messages[1]["content"]) > 20
