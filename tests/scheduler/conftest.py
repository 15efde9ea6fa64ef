"""Fixtures for scheduler tests: requests built without an engine."""

from __future__ import annotations

import pytest

from eyas.engine.sampling import SamplingParams
from eyas.engine.sequence import Sequence
from eyas.scheduler.request import Request


@pytest.fixture
def make_request(tiny_target):
    def make(prompt_len: int, max_tokens: int = 8) -> Request:
        prompt = [100 + i for i in range(prompt_len)]
        params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
        sequence = Sequence(prompt, params, tiny_target.tokenizer, tiny_target.eos_token_ids, max_tokens)
        return Request(prompt, params, max_tokens, sequence)
    return make
