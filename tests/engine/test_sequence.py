"""Sequence: the incremental text equals one decode of the whole output, token by token."""

from __future__ import annotations

import random

from eyas.engine.sampling import SamplingParams
from eyas.engine.sequence import Sequence, window_decoder


class WrapperOnly:
    """A tokenizer seen only through decode(): the decoder must fall back to it."""

    def __init__(self, tokenizer) -> None:
        self.inner = tokenizer

    def decode(self, ids, skip_special_tokens=False):
        return self.inner.decode(ids, skip_special_tokens=skip_special_tokens)


def test_window_decoder_matches_the_tokenizer_and_falls_back(smollm_tokenizer):
    rng = random.Random(0)
    fast, plain = window_decoder(smollm_tokenizer), window_decoder(WrapperOnly(smollm_tokenizer))
    for _ in range(200):
        ids = [rng.randrange(smollm_tokenizer.vocab_size) for _ in range(rng.randrange(0, 12))]
        expected = smollm_tokenizer.decode(ids, skip_special_tokens=True)
        assert fast(ids) == expected and plain(ids) == expected


def test_incremental_text_equals_a_whole_decode(smollm_tokenizer):
    rng = random.Random(1)
    text = "Caf\u00e9 \u4f60\u597d, \U0001f600 world: x = [1, 2]; \u00fc\u00df\n  indented"
    natural = smollm_tokenizer(text, add_special_tokens=False)["input_ids"]
    # byte-level pieces of multi-byte characters (incomplete UTF-8 in the window) and random ids
    cases = [natural * 3] + [[rng.randrange(smollm_tokenizer.vocab_size) for _ in range(40)]
                             for _ in range(5)]
    for ids in cases:
        sequence = Sequence([1], SamplingParams(max_tokens=len(ids)), smollm_tokenizer, set())
        pieces = []
        for token in ids:
            sequence.append([token])
            pieces.append(sequence.take_new_text())
        whole = smollm_tokenizer.decode(ids, skip_special_tokens=True)
        assert "".join(pieces) == sequence.text
        assert sequence.text.rstrip("\ufffd") == whole.rstrip("\ufffd")
