"""Single-stream decoding is the serving engine with one row (scheduler/single.py): what it
gives callers beyond tokens (logprobs, streamed text, timings, the timed policy's stats), its
errors, and the engine config it runs under (tiny model)."""

from __future__ import annotations

import pytest
import torch

from eyas.engine.generate import generate, generate_batch
from eyas.engine.sampling import SamplingParams
from eyas.engine.speculative.decode import speculative_generate
from eyas.engine.speculative.draft import DraftTree
from eyas.engine.speculative.policy import PolicyConfig
from eyas.errors import EyasError
from eyas.scheduler.config import EngineConfig

PROMPT = list(range(100, 112))


class Oracle:
    """Drafts the true continuation (known beforehand), so every step verifies a chain."""

    name = "oracle"
    tap_layers = ()

    def __init__(self, truth: list[int]) -> None:
        self.truth = truth
        self.finished = 0

    def begin(self, target, prompt_ids, params) -> None:
        self.prompt_length = len(prompt_ids)

    def propose(self, token_ids, max_nodes) -> DraftTree:
        done = len(token_ids) - self.prompt_length
        tokens = self.truth[done : done + max_nodes]
        return DraftTree.chain(tokens) if tokens else DraftTree.empty()

    def observe(self, tree, result, output) -> None:
        pass

    def finish(self) -> None:
        self.finished += 1

    def stats(self) -> dict:
        return {"oracle_calls": 1}


def test_greedy_logprobs_with_drafts_equal_plain_and_one_forward(tiny_target) -> None:
    params = SamplingParams(max_tokens=10, ignore_eos=True, logprobs=3, prompt_logprobs=1)
    plain = generate(tiny_target, PROMPT, params)
    oracle = Oracle(plain.token_ids)
    spec = speculative_generate(tiny_target, PROMPT, params, oracle, 4, policy=PolicyConfig(enabled=False))
    assert spec.token_ids == plain.token_ids
    assert spec.stats["speculative"]["accepted_tokens"] > 0
    assert [e.token for e in spec.logprobs] == plain.token_ids == [e.token for e in plain.logprobs]
    for a, b in zip(spec.logprobs, plain.logprobs):
        assert a.logprob == pytest.approx(b.logprob, abs=1e-4)
        assert [t for t, _ in a.top] == [t for t, _ in b.top]
    with torch.inference_mode():  # one forward over prompt + output: row p predicts p + 1
        ids = torch.tensor([PROMPT + plain.token_ids])
        rows = torch.log_softmax(tiny_target.model(ids, logits_at="all").logits[0].float(), -1)
    expected = [float(rows[len(PROMPT) - 1 + i, t]) for i, t in enumerate(plain.token_ids)]
    assert [e.logprob for e in spec.logprobs] == pytest.approx(expected, abs=1e-4)
    assert spec.prompt_logprobs[0] is None and len(spec.prompt_logprobs) == len(PROMPT)
    assert spec.prompt_logprobs[1].logprob == pytest.approx(float(rows[0, PROMPT[1]]), abs=1e-4)


def test_stats_streamed_text_finish_and_proposer_stats(tiny_target) -> None:
    params = SamplingParams(max_tokens=9, ignore_eos=True)
    plain = generate(tiny_target, PROMPT, params)
    oracle = Oracle(plain.token_ids)
    deltas: list[str] = []
    spec = speculative_generate(tiny_target, PROMPT, params, oracle, 4, on_text=deltas.append,
                                policy=PolicyConfig(enabled=False))
    assert "".join(deltas) == spec.text == plain.text
    stats = spec.stats
    assert stats["ttft_s"] > 0 and stats["decode_s"] > 0 and stats["tokens_per_s"] > 0
    speculative = stats["speculative"]
    assert speculative["method"] == "oracle" and speculative["oracle_calls"] == 1
    assert speculative["verification_steps"] == 2  # 8 tokens after the first: 5, then 3
    assert speculative["draft_seconds"] > 0 and speculative["verify_seconds"] > 0
    assert speculative["fallbacks"] == 0 and speculative["plain_steps"] == 0
    assert oracle.finished == 1  # told once that the request ended (suffix decoding's store)


def test_timed_policy_starts_with_plain_steps(tiny_target) -> None:
    params = SamplingParams(max_tokens=12, ignore_eos=True)
    plain = generate(tiny_target, PROMPT, params)
    spec = speculative_generate(tiny_target, PROMPT, params, Oracle(plain.token_ids), 2)
    assert spec.token_ids == plain.token_ids
    assert spec.stats["speculative"]["plain_steps"] == PolicyConfig().warmup_plain_steps


def test_errors_of_the_request_reach_the_caller(tiny_target) -> None:
    class Broken(Oracle):
        def begin(self, target, prompt_ids, params) -> None:
            raise EyasError("this proposer cannot serve that target")

    with pytest.raises(EyasError, match="cannot serve that target"):
        speculative_generate(tiny_target, PROMPT, SamplingParams(max_tokens=4), Broken([]), 2)
    with pytest.raises(EyasError, match="the prompt is empty"):
        generate(tiny_target, [], SamplingParams(max_tokens=4))


def test_max_tokens_is_cut_to_the_context(tiny_target) -> None:
    context = tiny_target.config.context_length
    result = generate(tiny_target, PROMPT, SamplingParams(max_tokens=10 * context, ignore_eos=True))
    assert len(result.token_ids) == context - len(PROMPT) and result.finish_reason == "length"


def test_seeded_batch_rows_follow_seed_plus_row(tiny_target) -> None:
    params = SamplingParams(max_tokens=8, temperature=1.0, seed=11, ignore_eos=True)
    together = generate_batch(tiny_target, [PROMPT, PROMPT[:7]], params)
    assert together[0].token_ids == generate(tiny_target, PROMPT, params).token_ids
    second = SamplingParams(max_tokens=8, temperature=1.0, seed=12, ignore_eos=True)
    assert together[1].token_ids == generate(tiny_target, PROMPT[:7], second).token_ids


def test_timed_speculation_is_one_request_at_a_time() -> None:
    with pytest.raises(EyasError, match="max_running 1"):
        EngineConfig(max_running=2, speculation="timed")


def test_timed_policy_spans_the_requests_of_one_proposer() -> None:
    from eyas.engine.speculative.policy import policy_for

    class Drafter:  # any proposer object: the policy is keyed on its identity
        pass

    first, other = Drafter(), Drafter()
    config = PolicyConfig()
    policy = policy_for(first, config)
    for _ in range(config.warmup_plain_steps):
        policy.record_plain(0.010)  # 10 ms a plain token
    for _ in range(config.window):
        policy.record_speculative(0.030, 1)  # 30 ms a token while drafting: does not pay
    assert policy.fallbacks == 1 and not policy.speculate_now()
    again = policy_for(first, config)  # the proposer's next request
    assert again is policy and again.plain_left == config.backoff
    assert policy_for(other, config).plain_left == config.warmup_plain_steps  # its own stream
    assert policy_for(first, PolicyConfig(backoff=4)) is not policy  # another rule starts afresh


def test_a_window_judged_against_an_old_plain_time_measures_plain_again_first() -> None:
    from eyas.engine.speculative.policy import SpeculationPolicy

    config = PolicyConfig()

    def slow_window_after_a_long_run() -> SpeculationPolicy:
        policy = SpeculationPolicy(config)
        for _ in range(config.warmup_plain_steps):
            policy.record_plain(0.010)  # 10 ms a plain token, at the start
        for _ in range(3 * config.window):
            policy.record_speculative(0.024, 4)  # 6 ms a token: pays
        assert policy.speculate_now() and policy.fallbacks == 0
        for _ in range(config.window):
            policy.record_speculative(0.060, 4)  # 15 ms a token: slower than the old plain time
        assert not policy.speculate_now() and policy.fallbacks == 0  # plain steps first
        assert policy.plain_left == config.refresh_steps
        return policy

    busier = slow_window_after_a_long_run()
    for _ in range(config.refresh_steps):
        busier.record_plain(0.030)  # the machine is busier: plain takes 30 ms a token now
    assert busier.speculate_now() and busier.fallbacks == 0
    assert busier.plain_seconds_per_token == pytest.approx(0.030)

    slower = slow_window_after_a_long_run()
    for _ in range(config.refresh_steps):
        slower.record_plain(0.010)  # plain is still 10 ms: speculation really is slower now
    assert not slower.speculate_now() and slower.fallbacks == 1
    assert slower.plain_left == config.backoff


def test_fallbacks_are_counted_per_request(tiny_target) -> None:
    params = SamplingParams(max_tokens=6, ignore_eos=True)
    plain = generate(tiny_target, PROMPT, params)
    oracle = Oracle(plain.token_ids)
    from eyas.engine.speculative.policy import policy_for

    policy_for(oracle, PolicyConfig()).fallbacks = 5  # as if earlier prompts had fallen back
    spec = speculative_generate(tiny_target, PROMPT, params, oracle, 2)
    assert spec.token_ids == plain.token_ids
    assert spec.stats["speculative"]["fallbacks"] == 0


def test_plain_next_holds_while_the_fallback_keeps_two_more_steps_plain() -> None:
    """What lets a plain step skip the taps (executor._taps_read): the next step is plain
    whatever this one measures."""
    from eyas.engine.speculative.policy import SpeculationPolicy

    config = PolicyConfig(warmup_plain_steps=3)
    policy = SpeculationPolicy(config)
    seen = []
    for _ in range(config.warmup_plain_steps):
        seen.append((policy.plain_next(), policy.speculate_now()))
        policy.record_plain(0.010)
    assert seen == [(True, False), (True, False), (False, False)]  # the last one feeds a draft
    assert policy.speculate_now() and not policy.plain_next()
    assert not SpeculationPolicy(PolicyConfig(enabled=False)).plain_next()


def test_a_plain_step_slowed_by_a_burst_does_not_let_a_losing_window_pass() -> None:
    """The plain time is the median of recent plain steps: two 40 ms plain steps among 10 ms
    ones (a neighbour's burst) leave it at 10 ms, so a window at 12 ms a token falls back (a
    running mean of plain steps stood at 21 ms after them and let the window pass)."""
    from eyas.engine.speculative.policy import SpeculationPolicy

    config = PolicyConfig(warmup_plain_steps=16)
    policy = SpeculationPolicy(config)
    for seconds in [0.010] * 14 + [0.040] * 2:
        policy.record_plain(seconds)
    assert policy.plain_seconds_per_token == pytest.approx(0.010)
    for _ in range(config.window // 2):
        policy.record_speculative(0.018, 1)  # 18 ms a step, 1.5 tokens a step: 12 ms a token
        policy.record_speculative(0.018, 2)
    assert policy.fallbacks == 1 and not policy.speculate_now()
    assert policy.plain_left == config.backoff


def test_one_slow_speculative_step_does_not_fail_a_window_that_pays() -> None:
    """A window's slowest step is left out where it took over twice the window's median: one
    step slowed 100 ms by a burst does not turn six 6 ms steps of 2 tokens (3 ms a token) into a
    fallback against 10 ms plain steps (summed, the window came to 10.8 ms a token)."""
    from eyas.engine.speculative.policy import SpeculationPolicy

    config = PolicyConfig()
    policy = SpeculationPolicy(config)
    for _ in range(config.warmup_plain_steps):
        policy.record_plain(0.010)
    for seconds in [0.006] * (config.window - 1) + [0.100]:
        policy.record_speculative(seconds, 2)
    assert policy.fallbacks == 0 and policy.speculate_now()


def test_a_window_of_big_and_small_trees_is_priced_by_its_mean_step() -> None:
    """Steps differ by tree size: four 27 ms steps of 3 tokens and two 18 ms steps of 1 token
    cost 144 ms for 14 tokens, 10.3 ms a token, slower than 10 ms plain steps; none is an
    outlier, so the window is priced at its mean step (its median step, 27 ms, would say
    11.6 ms a token: a median misprices a window whose steps differ by tree size)."""
    from eyas.engine.speculative.policy import window_seconds_per_token

    assert window_seconds_per_token([0.027] * 4 + [0.018] * 2, [3] * 4 + [1] * 2) == pytest.approx(0.144 / 14)
    assert window_seconds_per_token([0.006] * 5 + [0.100], [2] * 6) == pytest.approx(0.003)
    assert window_seconds_per_token([0.010, 0.030], [1, 1]) == pytest.approx(0.020)  # too few to judge


def test_a_window_of_unlucky_drafts_is_priced_with_the_recent_acceptance() -> None:
    """Six 5.2 ms steps of one draft each, accepted 55% of the time, pay against 3.9 ms plain
    steps (1.55 tokens a step: 3.4 ms a token); a window whose drafts were accepted once (7
    tokens: 4.5 ms a token) is chance, and the mean of the last steps keeps it from a fallback.
    When acceptance really drops, the mean follows within `history` steps and it falls back."""
    from eyas.engine.speculative.policy import SpeculationPolicy

    config = PolicyConfig()
    policy = SpeculationPolicy(config)
    for _ in range(config.warmup_plain_steps):
        policy.record_plain(0.0039)
    lucky = [2, 1, 2, 2, 1, 2, 1, 2, 2, 1, 2, 1]  # 19 tokens in 12 steps: 1.58 a step
    for emitted in lucky * 3:
        policy.record_speculative(0.0052, emitted)
    assert policy.fallbacks == 0
    for emitted in [1, 1, 1, 2, 1, 1]:  # 7 tokens: judged alone, 4.5 ms a token, a fallback
        policy.record_speculative(0.0052, emitted)
    assert policy.fallbacks == 0 and policy.speculate_now()
    steps = 0
    while policy.speculate_now():  # the drafts stop being accepted
        policy.record_speculative(0.0052, 1)
        steps += 1
    assert steps <= config.history and policy.plain_left == config.refresh_steps  # plain is old:
    for _ in range(config.refresh_steps):  # measured again first
        policy.record_plain(0.0039)
    assert policy.fallbacks == 1 and policy.plain_left == config.backoff


def test_the_policy_history_holds_at_least_a_window() -> None:
    from eyas.errors import EyasError

    with pytest.raises(EyasError, match="history"):
        PolicyConfig(window=6, history=4)


def test_each_request_starts_its_acceptance_history_afresh() -> None:
    """A question asked again is drafted whole (3 tokens a step), the next new question hardly
    (1): its windows are judged on its own steps, not on the last request's acceptance."""
    from eyas.engine.speculative.policy import SpeculationPolicy

    config = PolicyConfig()
    policy = SpeculationPolicy(config)
    for _ in range(config.warmup_plain_steps):
        policy.record_plain(0.0039)
    for _ in range(config.history):
        policy.record_speculative(0.0052, 3)
    policy.begin_request()
    for _ in range(config.window):
        policy.record_speculative(0.0052, 1)  # 5.2 ms a token against 3.9 (with the last
    for _ in range(config.refresh_steps):  # request's history: 1.9 ms a token, no fallback)
        policy.record_plain(0.0039)
    assert policy.fallbacks == 1 and not policy.speculate_now()


def test_a_window_that_spans_two_requests_is_judged_on_its_own_tokens() -> None:
    """Three steps of the last request (3 tokens each) and three of the new one (1 each): the
    new request's history is shorter than a window, so the window's own 12 tokens price it
    (2.6 ms a token, no fallback), not the new request's three steps alone (5.2 ms a token)."""
    from eyas.engine.speculative.policy import SpeculationPolicy

    config = PolicyConfig()
    policy = SpeculationPolicy(config)
    for _ in range(config.warmup_plain_steps):
        policy.record_plain(0.0039)
    for _ in range(config.window // 2):
        policy.record_speculative(0.0052, 3)
    policy.begin_request()
    for _ in range(config.window - config.window // 2):
        policy.record_speculative(0.0052, 1)
    assert policy.fallbacks == 0 and policy.speculate_now()


def test_a_request_starts_drafting_where_the_stream_pays() -> None:
    """One question of low acceptance falls back; the next request starts drafting again when
    the stream's recent speculative steps pay (2 tokens a 5.2 ms step against 3.9 ms plain
    steps), with the backoff reset, instead of inheriting the fallback's plain tokens."""
    from eyas.engine.speculative.policy import SpeculationPolicy

    config = PolicyConfig()
    policy = SpeculationPolicy(config)
    for _ in range(config.warmup_plain_steps):
        policy.record_plain(0.0039)
    for _ in range(3 * config.window):
        policy.record_speculative(0.0052, 2)  # 2.6 ms a token: pays
    policy.begin_request()  # a question the drafts hardly hit
    for _ in range(config.window):
        policy.record_speculative(0.0052, 1)  # 5.2 ms a token: slower (plain measured again first)
    for _ in range(config.refresh_steps + 1):
        policy.record_plain(0.0039)
    assert policy.fallbacks == 1 and policy.plain_left == config.backoff - 1
    policy.begin_request()  # the next question: the stream pays (24 steps, 42 tokens: 3.0 ms a token)
    assert policy.stream_pays() and policy.speculate_now()
    assert policy.current_backoff == config.backoff


def test_a_request_inherits_the_backoff_where_the_stream_does_not_pay() -> None:
    """A method that loses on the whole stream (1 token a 5.2 ms step against 3.9 ms plain)
    starts the next request in plain decoding, its backoff carried over and doubled."""
    from eyas.engine.speculative.policy import SpeculationPolicy

    config = PolicyConfig()
    policy = SpeculationPolicy(config)
    for _ in range(config.warmup_plain_steps):
        policy.record_plain(0.0039)
    for _ in range(config.window):
        policy.record_speculative(0.0052, 1)
    for _ in range(config.backoff):
        policy.record_plain(0.0039)
    for _ in range(config.window):
        policy.record_speculative(0.0052, 1)
    assert policy.fallbacks == 2 and policy.plain_left == 2 * config.backoff
    policy.begin_request()
    assert not policy.stream_pays() and not policy.speculate_now()
    assert policy.plain_left == 2 * config.backoff and policy.current_backoff == 4 * config.backoff


def test_the_stream_holds_at_least_two_windows() -> None:
    from eyas.errors import EyasError

    with pytest.raises(EyasError, match="stream_steps"):
        PolicyConfig(window=6, stream_steps=8)


def test_single_stream_steps_skip_the_batch_with_the_general_path_s_output(smollm_int4_target,
                                                                           monkeypatch) -> None:
    """A lone request's plain steps go through `decode_one` and its drafted steps through
    `decode_rows` (no batch built in PyTorch), greedy or drawn at temperature 0.8, and give the
    tokens the general path gives with them turned off: plain decoding, and n-gram drafts on a
    prompt that repeats itself."""
    from eyas.engine.speculative.decode import speculative_generate
    from eyas.engine.speculative.methods import build_proposer
    from eyas.scheduler.executor import StepExecutor

    params = SamplingParams(max_tokens=24, ignore_eos=True)
    model_type = type(smollm_int4_target.model)
    prompt = smollm_int4_target.tokenizer.encode("The capital of France is")
    calls = []
    original = model_type.decode_rows

    def counted(self, tokens, positions, *args, **kwargs):
        calls.append((len(tokens), positions[0]))
        return original(self, tokens, positions, *args, **kwargs)

    monkeypatch.setattr(model_type, "decode_rows", counted)
    fast = generate(smollm_int4_target, prompt, params).token_ids
    assert calls == [(1, position) for position in range(len(prompt), len(prompt) + len(fast) - 1)]
    repeated = smollm_int4_target.tokenizer.encode("one two three four five six. one two three four five six. one two")
    calls.clear()
    drafted = speculative_generate(smollm_int4_target, repeated, params, build_proposer("ngram", smollm_int4_target), 4)
    assert any(rows > 1 for rows, _ in calls)  # drafted steps took decode_rows too
    sampled = SamplingParams(max_tokens=24, ignore_eos=True, temperature=0.8, seed=3)  # Gumbel draws
    calls.clear()
    drawn = generate(smollm_int4_target, prompt, sampled).token_ids
    drawn_drafted = speculative_generate(smollm_int4_target, repeated, sampled,
                                         build_proposer("ngram", smollm_int4_target), 4).token_ids
    assert len(calls) >= len(drawn) - 1 and any(rows > 1 for rows, _ in calls)
    monkeypatch.setattr(StepExecutor, "_verify_one", lambda *args: False)
    assert generate(smollm_int4_target, prompt, params).token_ids == fast
    assert speculative_generate(smollm_int4_target, repeated, params, build_proposer("ngram", smollm_int4_target),
                                4).token_ids == drafted.token_ids == generate(smollm_int4_target, repeated,
                                                                               params).token_ids
    assert generate(smollm_int4_target, prompt, sampled).token_ids == drawn
    assert speculative_generate(smollm_int4_target, repeated, sampled, build_proposer("ngram", smollm_int4_target),
                                4).token_ids == drawn_drafted
