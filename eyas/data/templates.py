"""Render a conversation with the target's own chat template and mark the tokens to learn.

The loss mask is 1 on every token the assistant wrote (its answer and the end-of-turn token that
stops generation) and 0 on everything else (system prompt, user turns, role headers). It is
computed exactly, from the template itself, never from guessed token offsets:

1. `generation-markers`: a template that wraps answers in `{% generation %}...{% endgeneration %}`
   says which characters the assistant wrote; those spans are used as they are.
2. `prefix-render`: otherwise, for each assistant turn i, the template renders the prompt
   `messages[:i]` with the generation prompt, and `messages[:i+1]`; the answer is what the
   second adds to the first (template whitespace after the end-of-turn token is not generated,
   so it is left out). The renders must be prefixes of each other and of the whole
   conversation: a template that re-renders history (e.g. one that strips `<think>` blocks from
   earlier turns) fails this check loudly, and `last_turn_only=True` trains on the turn that
   the template renders as the model wrote it.
3. `plain`: no template at all (`plain_text=True`, an explicit choice that warns): `User: ...`
   and `Assistant: ...` blocks, the answer followed by the EOS token.

Characters become tokens through the tokenizer's offsets: a token is learned if it overlaps an
answer span.

Usage:
    rendered = render_conversation(tokenizer, messages, TemplateConfig(last_turn_only=False))
    rendered.input_ids, rendered.loss_mask            # same length
    prompt_ids = render_prompt(tokenizer, messages)   # for regeneration: ends with the header
"""

from __future__ import annotations

import re
import warnings
from dataclasses import dataclass, field
from typing import Any, Sequence

from eyas.data.records import Message

_GENERATION_TAG = re.compile(r"\{%-?\s*generation\s*-?%\}")
# Longest message `eyas data render` accepts by default (about 8k tokens): longer than any usual
# training length, so such a message would be cut anyway, and a multi-megabyte paste would
# cost minutes of tokenizing for nothing.
MAX_MESSAGE_CHARS = 32_000
PLAIN_ROLE_NAMES = {"system": "System", "user": "User", "assistant": "Assistant"}


class TemplateError(ValueError):
    """The template cannot render this conversation, or its renders are inconsistent."""


@dataclass(frozen=True)
class TemplateConfig:
    last_turn_only: bool = False  # learn only the last assistant turn
    plain_text: bool = False  # no chat template: "User: ...\n\nAssistant: ..." (warns)
    max_length: int | None = None  # truncate the tokens (and the mask) to this many
    template_kwargs: dict[str, Any] = field(default_factory=dict)  # e.g. {"enable_thinking": True}

    def __post_init__(self) -> None:
        if self.max_length is not None and self.max_length < 1:
            raise ValueError(f"max_length must be >= 1, got {self.max_length}")


@dataclass(frozen=True)
class RenderedConversation:
    text: str
    input_ids: list[int]  # [T]
    loss_mask: list[int]  # [T], 1 where the assistant wrote the token
    answer_spans: list[tuple[int, int]]  # character spans of the learned answers in `text`
    method: str  # "generation-markers", "prefix-render" or "plain"
    # Learned turns whose prompt, tokenized alone (as at serving time), is not a prefix of these
    # ids: the tokenizer merges across the prompt/answer boundary (prefix-render only).
    boundary_mismatches: int = 0


def has_generation_markers(template: str | None) -> bool:
    return bool(template) and bool(_GENERATION_TAG.search(template))


def _as_dicts(messages: Sequence[Message | dict[str, str]]) -> list[dict[str, str]]:
    return [m.to_dict() if isinstance(m, Message) else {"role": m["role"], "content": m["content"]} for m in messages]


def _chat_template(tokenizer: Any) -> str:
    template = getattr(tokenizer, "chat_template", None)
    if isinstance(template, dict):
        template = template.get("default")
    if not template:
        raise TemplateError(
            "the tokenizer has no chat template; pass a tokenizer with one, or choose plain text "
            "explicitly (--plain-text), which trains on a format the target was not tuned on"
        )
    return template


def _render(tokenizer: Any, messages: list[dict[str, str]], add_generation_prompt: bool, config: TemplateConfig) -> str:
    try:
        return tokenizer.apply_chat_template(
            messages, tokenize=False, add_generation_prompt=add_generation_prompt, **config.template_kwargs
        )
    except Exception as error:  # jinja's TemplateError, raise_exception() in the template, ...
        raise TemplateError(f"the chat template rejected the conversation: {error}") from error


def render_prompt(tokenizer: Any, messages: Sequence[Message | dict[str, str]], config: TemplateConfig | None = None) -> list[int]:
    """Token ids of `messages` followed by the assistant header: the prompt to answer."""
    config = config or TemplateConfig()
    dicts = _as_dicts(messages)
    if config.plain_text:
        text = _plain_text(dicts)[0] + f"{PLAIN_ROLE_NAMES['assistant']}: "
    else:
        _chat_template(tokenizer)
        text = _render(tokenizer, dicts, True, config)
    return list(tokenizer(text, add_special_tokens=False)["input_ids"])


def _spans_from_markers(tokenizer: Any, messages: list[dict[str, str]], config: TemplateConfig) -> tuple[str, list[tuple[int, int]]]:
    from transformers.utils.chat_template_utils import render_jinja_template

    try:
        rendered, indices = render_jinja_template(
            conversations=[messages],
            chat_template=_chat_template(tokenizer),
            return_assistant_tokens_mask=True,
            add_generation_prompt=False,
            **{**tokenizer.special_tokens_map, **config.template_kwargs},
        )
    except Exception as error:
        raise TemplateError(f"the chat template rejected the conversation: {error}") from error
    return rendered[0], [(start, end) for start, end in indices[0] if end > start]


def _spans_from_prefixes(
    tokenizer: Any, messages: list[dict[str, str]], config: TemplateConfig
) -> tuple[str, list[tuple[int, int]], list[str], list[int]]:
    full = _render(tokenizer, messages, False, config)
    turns = [index for index, message in enumerate(messages) if message["role"] == "assistant"]
    if config.last_turn_only:
        turns = turns[-1:]
    spans, prompts, kept_turns = [], [], []
    for index in turns:
        if not any(message["role"] == "user" for message in messages[:index]):
            raise TemplateError(f"message {index} is an assistant turn with no user turn before it")
        prompt = _render(tokenizer, messages[:index], True, config)
        through = _render(tokenizer, messages[: index + 1], False, config)
        if not through.startswith(prompt):
            raise TemplateError(
                f"the template renders the prompt of assistant turn {index} differently once the answer "
                "follows it, so the answer's tokens cannot be located exactly"
            )
        if not full.startswith(through):
            raise TemplateError(
                f"the template renders assistant turn {index} differently when later turns follow "
                "(it re-renders history, e.g. strips <think> blocks from earlier turns); "
                "use last_turn_only (--last-turn-only) or split the conversation into one sample per turn"
            )
        answer = through[len(prompt) :]
        if answer.rstrip():
            spans.append((len(prompt), len(prompt) + len(answer.rstrip())))
            prompts.append(prompt)
            kept_turns.append(index)
    return full, spans, prompts, kept_turns


def _plain_text(messages: list[dict[str, str]], eos: str = "") -> tuple[str, list[tuple[int, int]]]:
    pieces, spans, cursor = [], [], 0
    for message in messages:
        header = f"{PLAIN_ROLE_NAMES[message['role']]}: "
        body = message["content"] + (eos if message["role"] == "assistant" else "")
        if message["role"] == "assistant":
            spans.append((cursor + len(header), cursor + len(header) + len(body)))
        block = header + body + "\n\n"
        pieces.append(block)
        cursor += len(block)
    return "".join(pieces), spans


def _cut_after_content(text: str, span: tuple[int, int], content: str) -> tuple[int, int]:
    """An answer cut off by max_tokens: learn its text, not the end-of-turn token the template adds."""
    start, end = span
    position = text.find(content.strip(), start, end) if content.strip() else -1
    return (start, position + len(content.strip())) if position >= 0 else span


def render_conversation(
    tokenizer: Any,
    messages: Sequence[Message | dict[str, str]],
    config: TemplateConfig | None = None,
    unfinished: frozenset[int] = frozenset(),
) -> RenderedConversation:
    """Render `messages` with the tokenizer's template; see the module docstring for the mask.

    `unfinished` holds the indices (in `messages`) of answers that stopped at max_tokens: the
    template still closes them with an end-of-turn token, which the target never wrote there, so
    that token is not learned.
    """
    config = config or TemplateConfig()
    dicts = _as_dicts(messages)
    prompts: list[str] = []
    assistant_turns = [index for index, message in enumerate(dicts) if message["role"] == "assistant"]
    if not assistant_turns:
        raise TemplateError("the conversation has no assistant turn to learn from")
    # 1. Text and the character spans the assistant wrote (one per assistant turn, in order).
    if config.plain_text:
        warnings.warn(
            "rendering without a chat template: the draft head learns a format the target was not tuned on",
            stacklevel=2,
        )
        text, spans = _plain_text(dicts, tokenizer.eos_token or "")
        turns, method = assistant_turns, "plain"
    elif has_generation_markers(_chat_template(tokenizer)):
        text, spans = _spans_from_markers(tokenizer, dicts, config)
        turns, method = assistant_turns[-len(spans) :] if spans else [], "generation-markers"
    else:
        text, spans, prompts, turns = _spans_from_prefixes(tokenizer, dicts, config)
        method = "prefix-render"
    if unfinished and len(turns) == len(spans):
        spans = [
            _cut_after_content(text, span, dicts[turn]["content"]) if turn in unfinished else span
            for span, turn in zip(spans, turns)
        ]
    if config.last_turn_only:
        spans, prompts = spans[-1:], prompts[-1:]
    # 2. Tokens, and the mask from their character offsets.
    encoding = tokenizer(text, add_special_tokens=False, return_offsets_mapping=True)
    input_ids = list(encoding["input_ids"])
    loss_mask = [
        int(any(token_start < span_end and token_end > span_start for span_start, span_end in spans))
        for token_start, token_end in encoding["offset_mapping"]
    ]
    mismatches = 0
    for prompt in prompts:
        prompt_ids = tokenizer(prompt, add_special_tokens=False)["input_ids"]
        mismatches += input_ids[: len(prompt_ids)] != list(prompt_ids)
    if config.max_length is not None:
        input_ids, loss_mask = input_ids[: config.max_length], loss_mask[: config.max_length]
    return RenderedConversation(text, input_ids, loss_mask, spans, method, mismatches)


def split_per_turn(messages: Sequence[Message | dict[str, str]]) -> list[list[dict[str, str]]]:
    """One sample per assistant turn (`messages[:i+1]`), each to be rendered with last_turn_only.

    For templates that re-render history (Qwen3 drops earlier `<think>` blocks), this trains every
    turn exactly as the model saw its context when it wrote that turn.
    """
    dicts = _as_dicts(messages)
    return [dicts[: index + 1] for index, message in enumerate(dicts) if message["role"] == "assistant"]
