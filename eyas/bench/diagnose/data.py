"""The prompts of the head diagnosis and the corpus its larger draft vocabularies are counted on.

Held-out prompts are never trained on: the eval split of `eyas data prepare` (a hash of each
record's id, `eval_ratio` 0.02, seed 0: the settings of the shipped head's recipe,
scripts/train-smollm2-head.sh step 1). The training slice is the start of the train split, whose
answers the shipped head trained on (its first stage answered the first prompts in file order).
Within each, records are picked by a second fixed hash (sha256 of "eyas-diagnose:" + id), so the
slice is the same on every machine and does not depend on file order.

Usage:
    prepared = prepared_sharegpt()                          # cached `eyas data prepare` output
    held_out = pick(read_conversations(prepared / "eval.jsonl"), 24)
    training = pick(read_conversations(prepared / "train.jsonl", limit=704), 16)
    counts, described = vocabulary_counts("sharegpt-answers", tokenizer, 49152, prepared)
"""

from __future__ import annotations

import hashlib
import json
from pathlib import Path

import torch
from torch import Tensor

from eyas.data.records import Conversation, RecordError, conversation_from_dict
from eyas.errors import EyasError
from eyas.utils.io import cache_dir

HASH_SALT = "eyas-diagnose"
# `eyas data prepare` settings of the shipped head's prompts (scripts/train-smollm2-head.sh, step 1).
RECIPE_PREPARE = {"keep": "user", "max_turns": 1, "min_chars": 16, "max_chars": 1500}
# The default counting corpus of the larger draft vocabularies (see vocabulary_counts).
SHAREGPT_ANSWERS = "sharegpt-answers"


def hash_key(record_id: str) -> str:
    return hashlib.sha256(f"{HASH_SALT}:{record_id}".encode()).hexdigest()


def pick(conversations: list[Conversation], count: int) -> list[Conversation]:
    """The `count` conversations with the smallest hash keys (a fixed, order-free choice)."""
    return sorted(conversations, key=lambda c: hash_key(c.id))[:count]


def read_conversations(path: Path, limit: int | None = None) -> list[Conversation]:
    """The records of a prepared jsonl file (`eyas data prepare` output), the first `limit`."""
    if not path.is_file():
        raise EyasError(f"no such file: {path} (expected the train.jsonl / eval.jsonl that "
                        f"`eyas data prepare` writes)")
    conversations = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if limit is not None and len(conversations) >= limit:
                break
            if not line.strip():
                continue
            try:
                conversation = conversation_from_dict(json.loads(line), path.stem, f"{path.stem}-{number}")
            except (json.JSONDecodeError, RecordError) as error:
                raise EyasError(f"{path}:{number}: not a prepared record ({error})") from None
            if conversation.user_turns:
                conversations.append(conversation)
    return conversations


def prepared_sharegpt(progress: bool = False) -> Path:
    """The embedded ShareGPT prompts prepared as the shipped head's recipe prepared them,
    computed once (~40 s on one core) into the eyas cache."""
    from eyas.data.prepare import PrepareConfig, run_prepare

    folder = cache_dir() / "diagnose" / "sharegpt-{keep}-{max_turns}-{min_chars}-{max_chars}".format(
        **RECIPE_PREPARE)
    if not ((folder / "train.jsonl").is_file() and (folder / "eval.jsonl").is_file()):
        run_prepare(PrepareConfig(sources=["sharegpt"], output_dir=folder, workers=1,
                                  progress=progress, **RECIPE_PREPARE))
    return folder


def first_answers(record_ids: set[str]) -> dict[str, str]:
    """The original first assistant answer of each embedded ShareGPT record in `record_ids`."""
    from eyas.data.sources import RawError, read_raw_records, resolve_source

    answers: dict[str, str] = {}
    for item in read_raw_records(resolve_source("sharegpt")):
        if isinstance(item, RawError):
            continue
        try:
            conversation = conversation_from_dict(item.value, "sharegpt", f"sharegpt-{item.line}")
        except RecordError:
            continue
        if conversation.id not in record_ids:
            continue
        roles = [m.role for m in conversation.messages]
        if "user" in roles:
            after = conversation.messages[roles.index("user") + 1:]
            text = next((m.content for m in after if m.role == "assistant"), "")
            if text.strip():
                answers[conversation.id] = text.strip()
        if len(answers) == len(record_ids):
            break
    return answers


def vocabulary_counts(source: str, tokenizer, vocab_size: int, prepared: Path | None,
                      pool: int = 3680) -> tuple[Tensor, str]:
    """Answer-token frequencies [V] the larger draft vocabularies are built from (by
    eyas.eagle3.vocab's rule), and a line that says what was counted.

    source: a tokenized-conversations .jsonl (`eyas data render` output: the answers a head was
    really trained on), or "sharegpt-answers": the original ShareGPT answers to the first `pool`
    prompts of the prepared train split (the prompts the shipped head's answers were regenerated
    from; the regenerated answers themselves are not packaged)."""
    from eyas.eagle3.vocab import count_answer_tokens

    if source != SHAREGPT_ANSWERS:
        from eyas.features.tokenized import read_tokenized

        samples = read_tokenized(source, vocab_size)
        counts = count_answer_tokens(((s.input_ids, s.loss_mask) for s in samples), vocab_size)
        return counts, f"answer tokens of {len(samples)} conversations in {source}"
    if prepared is None:
        raise EyasError("counting the ShareGPT answers needs the prepared ShareGPT prompts")
    ids = {c.id for c in read_conversations(prepared / "train.jsonl", limit=pool)}
    counts = torch.zeros(vocab_size, dtype=torch.int64)
    answers = first_answers(ids)
    for text in answers.values():
        tokens = torch.tensor(tokenizer(text, add_special_tokens=False)["input_ids"], dtype=torch.int64)
        counts += torch.bincount(tokens[tokens < vocab_size], minlength=vocab_size)
    return counts, (f"original ShareGPT answers to the first {pool} prompts of the train split "
                    f"({len(answers)} answers)")
