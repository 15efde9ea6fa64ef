"""Verification on a real (tiny) model: KV cache after acceptance, max_tokens and EOS cuts."""

from __future__ import annotations

import torch

from eyas.engine.generate import generate, new_cache
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.policy import PolicyConfig

NO_FALLBACK = PolicyConfig(enabled=False)


class ScriptedProposer:
    """Proposes a fixed continuation (or the true one), for forced verifier cases."""

    name = "scripted"
    tap_layers = ()

    def __init__(self, script):
        self.script = script  # function(token_ids, max_nodes) -> list of tokens

    def begin(self, target, prompt_ids, params):
        pass

    def propose(self, token_ids, max_nodes):
        tokens = self.script(token_ids, max_nodes)
        return DraftTree.chain(tokens) if tokens else DraftTree.empty()

    def observe(self, tree, result, output):
        pass


def plain(target, prompt, n):
    return generate(target, prompt, SamplingParams(max_tokens=n, ignore_eos=True)).token_ids


PROMPT = list(range(100, 112))


@torch.inference_mode()
def test_cache_after_acceptance_equals_plain_cache(tiny_target):
    from eyas.scheduler.config import EngineConfig
    from eyas.scheduler.engine import Engine

    truth = plain(tiny_target, PROMPT, 6)
    model = tiny_target.model
    # Plain cache: prompt + the first 4 generated tokens.
    reference = new_cache(tiny_target, 1, 40)
    model(torch.tensor([PROMPT + truth[:4]]), cache=reference, write_at=0)
    # Speculative: prompt, then root = truth[0] with a tree where the true path is the
    # second branch: [wrong, truth1 -> truth2 -> truth3(wrong last)].
    wrong = (truth[1] + 1) % 1000 + 3
    draft = DraftTree(torch.tensor([wrong, truth[1], truth[2], wrong]), torch.tensor([0, 0, 2, 3]))

    class OneTree(ScriptedProposer):
        def propose(self, token_ids, max_nodes):
            return draft

    config = EngineConfig(max_running=1, speculation="timed", policy=NO_FALLBACK, num_draft_tokens=4)
    engine = Engine(tiny_target, config, draft=OneTree(None))
    request = engine.submit(PROMPT, SamplingParams(max_tokens=6, ignore_eos=True))
    engine.scheduler.add(engine._incoming.popleft())
    engine.loop.step()  # the prefill: root = truth[0]
    engine.loop.step()  # the tree above, verified in one pass
    assert request.token_ids[len(PROMPT):] == truth[:4]  # root + accepted nodes 2, 3
    assert request.spec_metrics.accepted_per_position == [1, 1, 0]
    length = len(PROMPT) + 3  # context + root + 2 accepted (truth[3] is the next root)
    assert request.context_length == length
    cache = engine.pool.cache
    row = request.row
    assert torch.allclose(cache.keys[:, row, :, :length], reference.keys[:, 0, :, :length], atol=1e-5)
    assert torch.allclose(cache.values[:, row, :, :length], reference.values[:, 0, :, :length], atol=1e-5)


def test_all_drafts_right_equals_plain_and_counts_every_acceptance(tiny_target):
    truth = plain(tiny_target, PROMPT, 20)

    def oracle(ids, k):
        done = len(ids) - len(PROMPT)
        return truth[done : done + k]

    result = speculative_generate(tiny_target, PROMPT, SamplingParams(max_tokens=20, ignore_eos=True),
                                  ScriptedProposer(oracle), 4, policy=NO_FALLBACK)
    spec = result.stats["speculative"]
    assert result.token_ids == truth
    assert spec["accepted_tokens"] == spec["draft_tokens"]
    # 19 tokens after the first: steps emit 5, 5, 5, then 4 (3 drafts fit): tau = 1 + 15/4
    assert spec["verification_steps"] == 4 and spec["acceptance_length"] == 4.75


def test_all_drafts_wrong_still_equals_plain(tiny_target):
    truth = plain(tiny_target, PROMPT, 12)

    def wrong(ids, k):
        done = len(ids) - len(PROMPT)
        return [(t + 1) % 40000 + 3 for t in truth[done : done + k]]

    result = speculative_generate(tiny_target, PROMPT, SamplingParams(max_tokens=12, ignore_eos=True),
                                  ScriptedProposer(wrong), 3, policy=NO_FALLBACK)
    assert result.token_ids == truth
    assert result.stats["speculative"]["accepted_tokens"] == 0
    assert result.stats["speculative"]["acceptance_length"] == 1.0


def test_draft_longer_than_remaining_tokens_is_cut_to_max_tokens(tiny_target):
    truth = plain(tiny_target, PROMPT, 30)

    def greedy_long(ids, k):
        done = len(ids) - len(PROMPT)
        return truth[done : done + 10]  # ignores k: the loop must truncate

    result = speculative_generate(tiny_target, PROMPT, SamplingParams(max_tokens=7, ignore_eos=True),
                                  ScriptedProposer(greedy_long), 10, policy=NO_FALLBACK)
    assert result.token_ids == truth[:7] and result.finish_reason == "length"


def test_eos_inside_the_accepted_path_ends_the_output_there(tiny_target):
    truth = plain(tiny_target, PROMPT, 12)
    saved = tiny_target.config.eos_token_ids
    tiny_target.config.eos_token_ids = [truth[5]]
    try:
        cut = truth.index(truth[5])

        def oracle(ids, k):
            done = len(ids) - len(PROMPT)
            return truth[done : done + k]

        result = speculative_generate(tiny_target, PROMPT, SamplingParams(max_tokens=12),
                                      ScriptedProposer(oracle), 8, policy=NO_FALLBACK)
    finally:
        tiny_target.config.eos_token_ids = saved
    assert result.token_ids == truth[:cut] and result.finish_reason == "stop"


def test_draft_model_with_a_different_tokenizer_is_refused(tiny_target, tmp_path):
    import pytest
    from transformers import AutoTokenizer

    from eyas.engine.speculative.proposers.draft_model import DraftModelProposer
    from eyas.errors import EyasError

    class Other:
        tokenizer = AutoTokenizer.from_pretrained(tiny_target.folder)

    Other.tokenizer.add_tokens(["<brand-new-token>"])
    proposer = DraftModelProposer(Other())  # only the tokenizer is looked at before use
    with pytest.raises(EyasError, match="tokenizer differs"):
        proposer.begin(tiny_target, PROMPT, SamplingParams())
