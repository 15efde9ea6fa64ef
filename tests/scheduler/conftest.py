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


@pytest.fixture(scope="module")
def random_head_dir(tiny_target, tmp_path_factory):
    """An untrained EAGLE-3 head for the tiny target, saved as `eagle3:DIR` expects."""
    import torch

    from eyas.eagle3 import Eagle3Config, Eagle3Head, build_draft_vocab, save_head

    torch.manual_seed(0)
    config = Eagle3Config.for_target(tiny_target.config, draft_vocab_size=512, target_layer_ids=[0, 1, 2])
    head = Eagle3Head(config)
    counts = torch.zeros(tiny_target.config.vocab_size)
    counts[torch.randperm(tiny_target.config.vocab_size)[:2000]] = 1.0
    head.set_vocab(build_draft_vocab(counts, 512))
    head.set_embedding(tiny_target.model.embed_tokens.weight)
    folder = tmp_path_factory.mktemp("eagle3-head")
    save_head(head.eval(), folder)
    return folder
