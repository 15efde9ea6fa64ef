"""Tokenized conversations: the input of `eyas features` and of online `eyas train`.

A jsonl file, one conversation per line, already rendered with the target's chat template and
tokenized with its tokenizer:

    {"id": "sharegpt-42", "input_ids": [1, 9690, 198, ...], "loss_mask": [0, 0, 0, ..., 1, 1]}

`loss_mask[j] == 1` marks token j as an answer (assistant) token: a token the head learns to
draft. Both lists have the same length.

Usage:
    samples = read_tokenized("data/train.tokenized.jsonl", vocab_size=49152)
    write_tokenized("data/small.jsonl", samples[:100])
    ids, mask = prepare_sample(samples[0], max_length=2048)   # or None when nothing to train on
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path
from typing import Iterable

import torch
from torch import Tensor

from eyas.errors import EyasError
from eyas.utils.io import atomic_path

# Row t of the head predicts token t + 2 (it reads the feature of t and the token t + 1), so a
# sample needs at least this many tokens to hold one trainable position.
MIN_TOKENS = 3


@dataclass
class TokenizedSample:
    id: str
    input_ids: Tensor  # int64 [T]
    loss_mask: Tensor  # int64 [T], 0/1

    def __len__(self) -> int:
        return self.input_ids.numel()


def _parse_line(raw: str, where: str, vocab_size: int | None) -> TokenizedSample:
    try:
        record = json.loads(raw)
    except json.JSONDecodeError as error:
        raise EyasError(f"{where}: not valid JSON ({error})") from None
    if not isinstance(record, dict) or not {"input_ids", "loss_mask"} <= set(record):
        raise EyasError(f"{where}: expected an object with keys id, input_ids, loss_mask "
                        f"(the tokenized conversations format, see docs/training.md)")
    ids, mask = record["input_ids"], record["loss_mask"]
    if not isinstance(ids, list) or not isinstance(mask, list) or len(ids) != len(mask):
        raise EyasError(f"{where}: input_ids and loss_mask must be lists of the same length")
    if not all(isinstance(i, int) and not isinstance(i, bool) for i in ids):
        raise EyasError(f"{where}: input_ids must be integers")
    if any(m not in (0, 1) for m in mask):
        raise EyasError(f"{where}: loss_mask values must be 0 or 1")
    input_ids = torch.tensor(ids, dtype=torch.int64)
    outside = input_ids < 0  # [T] bool
    if vocab_size is not None:
        outside |= input_ids >= vocab_size
    if bool(outside.any()):
        position = int(outside.nonzero()[0, 0])  # the first offending token, named as it was given
        accepted = f"the target vocabulary 0..{vocab_size - 1}" if vocab_size is not None else "ids >= 0"
        raise EyasError(f"{where}: token id {ids[position]} at position {position} is outside {accepted}: "
                        f"tokenize with the target's own tokenizer")
    return TokenizedSample(id=str(record.get("id", where)), input_ids=input_ids,
                           loss_mask=torch.tensor(mask, dtype=torch.int64))


def read_tokenized(path: str | Path, vocab_size: int | None = None) -> list[TokenizedSample]:
    """All samples of a tokenized-conversations jsonl, validated (line numbers in errors)."""
    path = Path(path)
    if not path.is_file():
        raise EyasError(f"no such data file: {path} (expected a tokenized-conversations .jsonl)")
    samples = []
    with open(path, encoding="utf-8") as handle:
        for number, line in enumerate(handle, start=1):
            if line.strip():
                samples.append(_parse_line(line, f"{path}:{number}", vocab_size))
    if not samples:
        raise EyasError(f"{path} holds no samples")
    return samples


def write_tokenized(path: str | Path, samples: Iterable[TokenizedSample]) -> None:
    with atomic_path(path) as tmp, open(tmp, "w", encoding="utf-8") as handle:
        for sample in samples:
            handle.write(json.dumps({"id": sample.id, "input_ids": sample.input_ids.tolist(),
                                     "loss_mask": sample.loss_mask.tolist()}) + "\n")


def prepare_sample(sample: TokenizedSample, max_length: int) -> tuple[Tensor, Tensor] | None:
    """Truncate to `max_length`; None when no answer token is left to predict."""
    input_ids = sample.input_ids[:max_length]
    loss_mask = sample.loss_mask[:max_length]
    if input_ids.numel() < MIN_TOKENS or not bool(loss_mask[2:].any()):
        return None
    return input_ids, loss_mask
