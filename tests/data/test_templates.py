"""Golden renders and loss masks, token by token, for the chat templates eyas meets most.

Each golden list is the tokenizer's pieces with 1 where the assistant wrote the token (its
answer and the end-of-turn token that stops it), checked by hand. SmolLM2's own template has no
generation markers (prefix-render path); chatml_generation has them (generation-markers path).
"""

from __future__ import annotations

from typing import Any

import pytest

from data_support import tokenizer_with_template
from eyas.data.templates import TemplateConfig, TemplateError, render_conversation, render_prompt, split_per_turn

CONVERSATION = [
    {"role": "system", "content": "Be brief."},
    {"role": "user", "content": "Capital of France?"},
    {"role": "assistant", "content": "Paris."},
    {"role": "user", "content": "And Italy?"},
    {"role": "assistant", "content": "Rome."},
]
THINKING = [
    {"role": "user", "content": "2+2?"},
    {"role": "assistant", "content": "<think>\nAdd them.\n</think>\n\n4."},
    {"role": "user", "content": "3+3?"},
    {"role": "assistant", "content": "<think>\nAgain.\n</think>\n\n6."},
]

CHATML_HEAD = [("<|im_start|>", 0), ("system", 0), ("\n", 0), ("Be", 0), (" brief", 0), (".", 0),
               ("<|im_end|>", 0), ("\n", 0), ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("Capital", 0),
               (" of", 0), (" France", 0), ("?", 0), ("<|im_end|>", 0), ("\n", 0), ("<|im_start|>", 0),
               ("ass", 0), ("istant", 0), ("\n", 0)]
CHATML_MIDDLE = [("\n", 0), ("<|im_start|>", 0), ("user", 0), ("\n", 0), ("And", 0), (" Italy", 0), ("?", 0),
                 ("<|im_end|>", 0), ("\n", 0), ("<|im_start|>", 0), ("ass", 0), ("istant", 0), ("\n", 0)]
CHATML_GOLDEN = CHATML_HEAD + [("Paris", 1), (".", 1), ("<|im_end|>", 1)] + CHATML_MIDDLE + [
    ("Rome", 1), (".", 1), ("<|im_end|>", 1), ("\n", 0)]

LLAMA3_GOLDEN = [
    ("<|begin_of_text|>", 0), ("<|start_header_id|>", 0), ("system", 0), ("<|end_header_id|>", 0), ("\n", 0),
    ("\n", 0), ("Be", 0), (" brief", 0), (".", 0), ("<|eot_id|>", 0), ("<|start_header_id|>", 0), ("user", 0),
    ("<|end_header_id|>", 0), ("\n", 0), ("\n", 0), ("Capital", 0), (" of", 0), (" France", 0), ("?", 0),
    ("<|eot_id|>", 0), ("<|start_header_id|>", 0), ("ass", 0), ("istant", 0), ("<|end_header_id|>", 0),
    ("\n", 0), ("\n", 0), ("Paris", 1), (".", 1), ("<|eot_id|>", 1), ("<|start_header_id|>", 0), ("user", 0),
    ("<|end_header_id|>", 0), ("\n", 0), ("\n", 0), ("And", 0), (" Italy", 0), ("?", 0), ("<|eot_id|>", 0),
    ("<|start_header_id|>", 0), ("ass", 0), ("istant", 0), ("<|end_header_id|>", 0), ("\n", 0), ("\n", 0),
    ("Rome", 1), (".", 1), ("<|eot_id|>", 1),
]
MISTRAL_GOLDEN = [
    ("<s>", 0), ("[INST]", 0), (" Capital", 0), (" of", 0), (" France", 0), ("?", 0), (" ", 0), ("[/INST]", 0),
    ("Paris", 1), (".", 1), ("</s>", 1), ("[INST]", 0), (" And", 0), (" Italy", 0), ("?", 0), (" ", 0),
    ("[/INST]", 0), ("Rome", 1), (".", 1), ("</s>", 1),
]


def pieces(tokenizer: Any, input_ids: list[int], loss_mask: list[int]) -> list[tuple[str, int]]:
    return [(tokenizer.decode([token]), learned) for token, learned in zip(input_ids, loss_mask)]


def only_last_turn(golden: list[tuple[str, int]], last_turn_tokens: int) -> list[tuple[str, int]]:
    """The golden list with every answer but the last (its final `last_turn_tokens` ones) unlearned."""
    last_start = max(i for i, (_, learned) in enumerate(golden) if learned) - last_turn_tokens + 1
    return [(piece, learned if i >= last_start else 0) for i, (piece, learned) in enumerate(golden)]


@pytest.fixture(scope="module")
def templates(smollm_tokenizer: Any) -> dict[str, Any]:
    return {
        "smollm2": smollm_tokenizer,
        "qwen2_5": tokenizer_with_template(smollm_tokenizer, "qwen2_5"),
        "llama3": tokenizer_with_template(smollm_tokenizer, "llama3", bos="<|begin_of_text|>",
                                          special=("<|start_header_id|>", "<|end_header_id|>", "<|eot_id|>")),
        "mistral": tokenizer_with_template(smollm_tokenizer, "mistral", bos="<s>", eos="</s>",
                                           special=("[INST]", "[/INST]")),
        "chatml_generation": tokenizer_with_template(smollm_tokenizer, "chatml_generation"),
        "qwen3_think": tokenizer_with_template(smollm_tokenizer, "qwen3_think"),
    }


@pytest.mark.parametrize("name, conversation, golden, method", [
    ("smollm2", CONVERSATION, CHATML_GOLDEN, "prefix-render"),
    ("qwen2_5", CONVERSATION, CHATML_GOLDEN, "prefix-render"),
    ("llama3", CONVERSATION, LLAMA3_GOLDEN, "prefix-render"),
    ("mistral", CONVERSATION[1:], MISTRAL_GOLDEN, "prefix-render"),
    ("chatml_generation", CONVERSATION, CHATML_GOLDEN, "generation-markers"),
])
def test_golden_loss_masks(templates: dict[str, Any], name: str, conversation: list, golden: list, method: str) -> None:
    tokenizer = templates[name]
    rendered = render_conversation(tokenizer, conversation)
    assert rendered.method == method
    assert pieces(tokenizer, rendered.input_ids, rendered.loss_mask) == golden
    # The ids are exactly those of the template's own tokenization.
    assert rendered.input_ids == list(tokenizer.apply_chat_template(conversation, tokenize=True, return_dict=True)["input_ids"])
    last = render_conversation(tokenizer, conversation, TemplateConfig(last_turn_only=True))
    assert pieces(tokenizer, last.input_ids, last.loss_mask) == only_last_turn(golden, 3)


def test_default_system_prompt_is_never_learned(templates: dict[str, Any]) -> None:
    tokenizer = templates["smollm2"]
    rendered = render_conversation(tokenizer, CONVERSATION[1:3])
    learned = [piece for piece, flag in pieces(tokenizer, rendered.input_ids, rendered.loss_mask) if flag]
    assert "SmolLM" in rendered.text and learned == ["Paris", ".", "<|im_end|>"]


def test_thinking_template_that_rewrites_history(templates: dict[str, Any]) -> None:
    tokenizer = templates["qwen3_think"]
    with pytest.raises(TemplateError, match="re-renders history"):
        render_conversation(tokenizer, THINKING)
    last = render_conversation(tokenizer, THINKING, TemplateConfig(last_turn_only=True))
    learned = [piece for piece, flag in pieces(tokenizer, last.input_ids, last.loss_mask) if flag]
    assert learned == ["<", "think", ">", "\n", "Again", ".", "\n", "</", "think", ">", "\n", "\n", "6", ".", "<|im_end|>"]
    assert "Add them" not in last.text  # the earlier turn's reasoning is dropped by the template
    # One sample per turn trains the first turn with its reasoning, as the model wrote it.
    first, second = (render_conversation(tokenizer, part, TemplateConfig(last_turn_only=True))
                     for part in split_per_turn(THINKING))
    assert tokenizer.decode([t for t, m in zip(first.input_ids, first.loss_mask) if m]) == \
        "<think>\nAdd them.\n</think>\n\n4.<|im_end|>"
    assert second.input_ids == last.input_ids


def test_prompt_render_ends_with_the_generation_header(templates: dict[str, Any]) -> None:
    tokenizer = templates["smollm2"]
    prompt = render_prompt(tokenizer, CONVERSATION[:2])
    assert tokenizer.decode(prompt).endswith("France?<|im_end|>\n<|im_start|>assistant\n")
    full = render_conversation(tokenizer, CONVERSATION[:3])
    assert full.input_ids[: len(prompt)] == prompt and full.loss_mask[: len(prompt)] == [0] * len(prompt)
    assert full.boundary_mismatches == 0


def test_tokenizer_merging_across_the_answer_boundary_is_reported(templates: dict[str, Any]) -> None:
    # With SmolLM2's BPE, Llama-3's "<|end_header_id|>\n\n" ends a prompt as one "\n\n" token, but
    # "\n\nParis" in the whole conversation splits as "\n", "\n", "Paris": serving-time prompts differ.
    tokenizer = templates["llama3"]
    prompt = render_prompt(tokenizer, CONVERSATION[:2])
    assert tokenizer.decode(prompt[-1:]) == "\n\n"
    assert render_conversation(tokenizer, CONVERSATION).boundary_mismatches == 2


def test_plain_text_needs_the_flag_and_warns(templates: dict[str, Any]) -> None:
    tokenizer = tokenizer_with_template(templates["smollm2"], None)
    tokenizer.chat_template = None
    with pytest.raises(TemplateError, match="no chat template"):
        render_conversation(tokenizer, CONVERSATION[1:3])
    with pytest.warns(UserWarning, match="without a chat template"):
        rendered = render_conversation(tokenizer, CONVERSATION[1:3], TemplateConfig(plain_text=True))
    assert rendered.text == "User: Capital of France?\n\nAssistant: Paris.<|im_end|>\n\n"
    learned = [piece for piece, flag in pieces(tokenizer, rendered.input_ids, rendered.loss_mask) if flag]
    assert learned == [" Paris", ".", "<|im_end|>"]  # " Paris" straddles the header's space: it is learned


def test_template_errors_are_clear(templates: dict[str, Any]) -> None:
    with pytest.raises(TemplateError, match="roles must alternate"):
        render_conversation(templates["mistral"], [CONVERSATION[1], CONVERSATION[3], CONVERSATION[2]])
    with pytest.raises(TemplateError, match="no assistant turn"):
        render_conversation(templates["smollm2"], CONVERSATION[:2])


def test_max_length_truncates_tokens_and_mask_together(templates: dict[str, Any]) -> None:
    rendered = render_conversation(templates["smollm2"], CONVERSATION, TemplateConfig(max_length=23))
    assert len(rendered.input_ids) == len(rendered.loss_mask) == 23 and rendered.loss_mask[-2:] == [1, 1]


@pytest.mark.parametrize("name", ["smollm2", "chatml_generation"])
def test_answer_cut_at_max_tokens_does_not_learn_the_end_of_turn(templates: dict[str, Any], name: str) -> None:
    tokenizer = templates[name]
    rendered = render_conversation(tokenizer, CONVERSATION, unfinished=frozenset({2}))
    learned = [piece for piece, flag in pieces(tokenizer, rendered.input_ids, rendered.loss_mask) if flag]
    assert learned == ["Paris", ".", "Rome", ".", "<|im_end|>"]
