"""The Qwen2.5-Coder pair that `make qwen` fetches (1.5B target, 0.5B draft, both int4): greedy
output equals plain, with the policy on (chains priced, plain steps where they do not pay) and
with every step drafting; the draft's vocabulary subset is screened by the extension's kernel
and drafts its own exact argmax. Skipped where the pair is not fetched."""

from __future__ import annotations

import pytest

from eyas.engine.generate import generate
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.errors import EyasError

pytestmark = [pytest.mark.slow, pytest.mark.usefixtures("one_thread")]
TOKENS = 32


@pytest.fixture(scope="module")
def qwen_pair():
    from eyas.engine.speculative.methods import build_proposer
    from eyas.engine.target import load_target
    from eyas.models.registry import resolve_model

    try:
        resolve_model("qwen2.5-coder-1.5b"), resolve_model("qwen2.5-coder-0.5b")
    except EyasError as error:
        pytest.skip(f"the Qwen pair is not fetched ({error})")
    target = load_target("qwen2.5-coder-1.5b", dtype="int4")
    return target, build_proposer("model:qwen2.5-coder-0.5b", target)


def test_the_qwen_draft_screens_a_subset_in_the_extension_and_drafts_its_argmax(qwen_pair):
    import torch

    _, proposer = qwen_pair
    vocabulary, draft = proposer.vocabulary, proposer.draft
    assert proposer.draft.precision == "int4" and vocabulary is not None
    assert vocabulary.screened_in_extension == bool(draft.model.lm_head.int8dot)
    hidden = torch.randn(4, draft.config.hidden_size, generator=torch.Generator().manual_seed(0))
    with torch.inference_mode():
        full = draft.model.lm_head(hidden)  # [4, V] float32
        chosen = vocabulary.logits(hidden).argmax(dim=-1)  # [4] subset indices
    ids = vocabulary.ids
    assert [vocabulary.token(int(i)) for i in chosen] == ids[full[:, ids].argmax(dim=-1)].tolist()


def test_the_qwen_pair_equals_plain_priced_and_drafting_every_step(qwen_pair):
    from eyas.scheduler.measure import load_prompts
    from spec_checks import assert_greedy_equals_plain

    target, proposer = qwen_pair
    prompts = load_prompts(target, "code", 2)
    params = SamplingParams(max_tokens=TOKENS)
    expected = [generate(target, prompt, params).token_ids for prompt in prompts]
    for prompt, plain in zip(prompts, expected):  # priced, the fallback on
        assert speculative_generate(target, prompt, params, proposer, 4).token_ids == plain
    totals = assert_greedy_equals_plain(target, prompts, proposer, 4, TOKENS, expected)
    assert totals["accepted_tokens"] > totals["verification_steps"] > 0  # tau above 2 on code
