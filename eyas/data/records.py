"""The normalised conversation record that every data step reads and writes.

A record on disk is one JSON object per line (SpecForge style):

    {"id": "QWJhYvA_0", "source": "sharegpt",
     "conversations": [{"role": "user", "content": "..."}, {"role": "assistant", "content": "..."}]}

Roles are normalised to `system`, `user` and `assistant` whatever the input spelled them
(`human`/`gpt` in ShareGPT, `model` in Gemini exports, ...).
"""

from __future__ import annotations

import hashlib
import json
from dataclasses import dataclass, field
from typing import Any

ROLES = ("system", "user", "assistant")

# Every spelling of a role seen in public chat datasets, mapped to the normalised role.
ROLE_ALIASES: dict[str, str] = {
    "system": "system",
    "user": "user",
    "human": "user",
    "prompter": "user",
    "assistant": "assistant",
    "gpt": "assistant",
    "chatgpt": "assistant",
    "bing": "assistant",
    "bard": "assistant",
    "model": "assistant",
}


class RecordError(ValueError):
    """A record whose shape cannot be read; the message says what was wrong."""


class EmptyTurnError(RecordError):
    """A user turn with no text: `reason` is "null_turn" (content null) or "empty_turn" (blank)."""

    def __init__(self, reason: str, turn: int) -> None:
        what = "has content null" if reason == "null_turn" else "is empty"
        super().__init__(f"{reason}: user turn {turn} {what}")
        self.reason = reason


@dataclass(frozen=True)
class Message:
    role: str  # one of ROLES
    content: str

    def __post_init__(self) -> None:
        if self.role not in ROLES:
            raise RecordError(f"role '{self.role}' is not one of {', '.join(ROLES)}")

    def to_dict(self) -> dict[str, str]:
        return {"role": self.role, "content": self.content}


@dataclass
class Conversation:
    """One conversation: an id, the source it came from, its messages and free-form metadata."""

    id: str
    source: str
    messages: list[Message]
    meta: dict[str, Any] = field(default_factory=dict)

    @property
    def user_turns(self) -> list[str]:
        return [message.content for message in self.messages if message.role == "user"]

    @property
    def system_prompt(self) -> str | None:
        if self.messages and self.messages[0].role == "system":
            return self.messages[0].content
        return None

    def text_chars(self) -> int:
        return sum(len(message.content) for message in self.messages)

    def content_key(self) -> str:
        """A digest of the roles and contents, for deduplication (ignores id and source)."""
        digest = hashlib.sha256()
        for message in self.messages:
            digest.update(message.role.encode())
            digest.update(b"\x00")
            digest.update(message.content.strip().encode())
            digest.update(b"\x01")
        return digest.hexdigest()

    def to_dict(self) -> dict[str, Any]:
        record: dict[str, Any] = {
            "id": self.id,
            "source": self.source,
            "conversations": [message.to_dict() for message in self.messages],
        }
        if self.meta:
            record["meta"] = self.meta
        return record

    def to_json_line(self) -> str:
        return json.dumps(self.to_dict(), ensure_ascii=False) + "\n"


def normalise_role(role: Any) -> str:
    if not isinstance(role, str):
        raise RecordError(f"role must be a string, got {type(role).__name__}")
    normalised = ROLE_ALIASES.get(role.strip().lower())
    if normalised is None:
        accepted = ", ".join(sorted(ROLE_ALIASES))
        raise RecordError(f"unknown role '{role}' (accepted: {accepted})")
    return normalised


def _text_content(content: Any) -> str:
    """A message's text: a string, or an OpenAI list of parts whose text parts are joined."""
    if isinstance(content, str):
        return content
    if isinstance(content, list):
        texts = []
        for part in content:
            if not isinstance(part, dict) or part.get("type") != "text":
                kind = part.get("type") if isinstance(part, dict) else type(part).__name__
                raise RecordError(f"non-text content part '{kind}' (only text is supported)")
            texts.append(str(part.get("text", "")))
        return "".join(texts)
    raise RecordError(f"message content must be a string or a list of text parts, got {type(content).__name__}")


def _message_from_dict(raw: Any, reject_empty: bool = False, user_turn: int = 0) -> Message:
    if not isinstance(raw, dict):
        raise RecordError(f"a message must be an object, got {type(raw).__name__}")
    if "role" in raw:
        role, content = raw["role"], raw.get("content")
    elif "from" in raw:
        role, content = raw["from"], raw.get("value")
    else:
        raise RecordError("a message needs 'role'/'content' or 'from'/'value'")
    role = normalise_role(role)
    if content is None:
        if reject_empty and role == "user":
            raise EmptyTurnError("null_turn", user_turn)
        content = ""
    message = Message(role, _text_content(content))
    if reject_empty and role == "user" and not message.content.strip():
        raise EmptyTurnError("empty_turn", user_turn)
    return message


def raw_record_id(raw: Any, fallback_id: str) -> str:
    """The id a record is known by: `id`, `question_id` or `conversation_id`, else `fallback_id`."""
    if not isinstance(raw, dict):
        return fallback_id
    record_id = raw.get("id", raw.get("question_id", raw.get("conversation_id")))
    return fallback_id if record_id is None or record_id == "" else str(record_id)


def conversation_from_dict(raw: Any, source: str, fallback_id: str, reject_empty_turns: bool = False) -> Conversation:
    """Read any supported record shape into a Conversation.

    Accepted shapes: ShareGPT (`conversations: [{from, value}]`), SpecForge
    (`conversations: [{role, content}]`), OpenAI (`messages: [{role, content}]`), MT-Bench
    (`question_id`, `turns: [str]`). A record without an id gets `fallback_id`. A null content
    reads as "", unless `reject_empty_turns`: then a user turn that is null or blank raises
    `EmptyTurnError` (a prompt to answer must hold text).
    """
    if not isinstance(raw, dict):
        raise RecordError(f"a record must be a JSON object, got {type(raw).__name__}")
    meta: dict[str, Any] = {}
    if "turns" in raw and "conversations" not in raw and "messages" not in raw:
        turns = raw["turns"]
        if not isinstance(turns, list) or not all(isinstance(turn, str) for turn in turns):
            raise RecordError("'turns' must be a list of strings")
        messages = [Message("user", turn) for turn in turns]
        blank = next((index for index, turn in enumerate(turns, start=1) if not turn.strip()), None)
        if reject_empty_turns and blank is not None:
            raise EmptyTurnError("empty_turn", blank)
        if "category" in raw:
            meta["category"] = raw["category"]
    else:
        raw_messages = raw.get("conversations", raw.get("messages"))
        if raw_messages is None:
            raise RecordError("no 'conversations', 'messages' or 'turns' field")
        if not isinstance(raw_messages, list):
            raise RecordError("'conversations'/'messages' must be a list")
        messages = []
        for message in raw_messages:
            user_turn = sum(m.role == "user" for m in messages) + 1
            messages.append(_message_from_dict(message, reject_empty_turns, user_turn))
    record_id = raw_record_id(raw, fallback_id)
    if isinstance(raw.get("meta"), dict):
        meta.update(raw["meta"])
    record_source = raw.get("source") if isinstance(raw.get("source"), str) else source
    return Conversation(id=record_id, source=record_source, messages=messages, meta=meta)
