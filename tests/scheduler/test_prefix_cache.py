"""Prefix cache bookkeeping without a model pass: reuse (adopted and copied), LRU eviction,
the memory bound, samples that wait for a prompt being prefilled, and the counters.

Each "computed" slot i of a request's row holds the marker code * 1000 + i, so that a test can
tell whose keys and values a row holds after rows were adopted, copied, moved and evicted."""

from __future__ import annotations

from eyas.engine.sampling import SamplingParams
from eyas.engine.sequence import Sequence
from eyas.scheduler.config import EngineConfig
from eyas.scheduler.kv_pool import KVPool
from eyas.scheduler.prefix_cache import PrefixCache
from eyas.scheduler.request import Request
from eyas.scheduler.scheduler import Scheduler


def new_scheduler(target, rows=2, chunk=16):
    config = EngineConfig(max_running=rows, max_step_tokens=64, prefill_chunk=chunk,
                          speculation="never")
    pool = KVPool(target, rows, 256, 64)
    return Scheduler(config, pool, False, prefix_cache=PrefixCache(pool))


def request(target, prompt, max_tokens=8):
    params = SamplingParams(max_tokens=max_tokens, ignore_eos=True)
    sequence = Sequence(prompt, params, target.tokenizer, target.eos_token_ids, max_tokens)
    return Request(list(prompt), params, max_tokens, sequence)


def compute(scheduler, item, code, upto):
    """What the executor would do: apply the queued copies, then 'compute' slots up to `upto`
    (marking them with this request's code)."""
    pool = scheduler.pool
    pool.apply_pending()
    start = item.context_length
    for slot in range(start, upto):
        pool.cache.keys[:, item.row, :, slot] = code * 1000 + slot
    item.context_length = max(item.context_length, upto)


def marker(scheduler, row, slot):
    return int(scheduler.pool.cache.keys[0, row, 0, slot, 0])


def finish(scheduler, item, code, output):
    """Prefill the rest, decode `output` (the last token stays the root), release."""
    compute(scheduler, item, code, item.prompt_len)
    item.token_ids = item.prompt_ids + list(output)
    compute(scheduler, item, code, len(item.token_ids) - 1)
    item.token_done = True
    return scheduler.release_done()


def test_a_finished_row_is_adopted_by_the_next_turn_without_a_copy(tiny_target):
    scheduler = new_scheduler(tiny_target)
    cache = scheduler.prefix_cache
    first = request(tiny_target, list(range(100, 120)))
    scheduler.add(first)
    plan = scheduler.schedule()
    assert [(c.start, c.end) for c in plan.prefill] == [(0, 16)] and first.row == 0
    finish(scheduler, first, 1, [7, 8, 9])  # KV holds the prompt + 7, 8 (9 is the root)
    assert scheduler.pool.cached[0].tokens == list(range(100, 120)) + [7, 8]
    second = request(tiny_target, list(range(100, 120)) + [7, 8, 9, 30, 31])
    scheduler.add(second)
    plan = scheduler.schedule()
    assert second.row == 0 and scheduler.pool.cached[0] is None  # adopted: the row is its own
    assert [(c.start, c.end) for c in plan.prefill] == [(22, 25)]  # only what is new
    scheduler.pool.apply_pending()
    assert second.context_length == second.prefix_hit == 22
    assert [marker(scheduler, 0, s) for s in (0, 21)] == [1000, 1021]  # still the first's
    stats = cache.stats()
    assert (stats.queries, stats.hits, stats.rows, stats.evictions) == (20 + 25, 22, 0, 0)


def test_a_partial_match_copies_and_the_cached_prefix_stays(tiny_target):
    scheduler = new_scheduler(tiny_target, rows=3)
    first = request(tiny_target, list(range(100, 130)))
    scheduler.add(first)
    scheduler.schedule()
    finish(scheduler, first, 1, [5, 6])
    branch = request(tiny_target, list(range(100, 110)) + [1, 2, 3])  # shares 10 tokens
    scheduler.add(branch)
    scheduler.schedule()
    # the lowest row (0) was the cached prefix's: it moved to a free row, and 10 slots were copied
    assert branch.row == 0 and scheduler.pool.cached[1].tokens[:3] == [100, 101, 102]
    compute(scheduler, branch, 2, 13)
    assert branch.prefix_hit == 10
    assert [marker(scheduler, 0, s) for s in (0, 9, 10)] == [1000, 1009, 2010]
    assert [marker(scheduler, 1, s) for s in (0, 29, 30)] == [1000, 1029, 1030]
    again = request(tiny_target, list(range(100, 130)) + [5, 42])  # the whole cached row, and more
    scheduler.add(again)
    scheduler.schedule()
    scheduler.pool.apply_pending()
    assert again.row == 1 and again.prefix_hit == 31  # adopted where it was: nothing moved


def test_eviction_is_least_recently_used_and_the_pool_never_grows(tiny_target):
    scheduler = new_scheduler(tiny_target, rows=2)
    pool, cache = scheduler.pool, scheduler.prefix_cache
    size = pool.bytes_per_slot() * pool.slots
    prompts = {name: [base + i for i in range(20)] for name, base in
               (("a", 1000), ("b", 2000), ("c", 3000), ("d", 4000))}
    codes = {"a": 1, "b": 2, "c": 3, "d": 4}
    done = {}
    for name in ("a", "b"):
        done[name] = request(tiny_target, prompts[name])
        scheduler.add(done[name])
        scheduler.schedule()
        finish(scheduler, done[name], codes[name], [9])
    assert sorted(e.tokens[0] for e in pool.cached if e) == [1000, 2000]  # both rows cached
    touch = request(tiny_target, prompts["a"][:5] + [77, 78])  # a is used again: b is now the LRU
    scheduler.add(touch)
    scheduler.schedule()
    finish(scheduler, touch, 5, [9])
    assert cache.evictions == 1  # the 2 rows held a, b; "touch" needed one: b (LRU) went
    resident = sorted(e.tokens[0] for e in pool.cached if e)
    assert resident == [1000, 1000]  # a, and touch's own row
    assert cache.tree.longest_match(prompts["b"])[0] == 0
    row_of_a = next(e.row for e in pool.cached if e and e.tokens == prompts["a"])
    assert marker(scheduler, row_of_a, 19) == 1019  # a's keys and values moved with it
    assert pool.bytes_per_slot() * pool.slots == size and cache.stats().rows <= pool.rows


def test_samples_of_one_prompt_wait_for_its_prefill_and_copy_it(tiny_target):
    scheduler = new_scheduler(tiny_target, rows=3)
    prompt = list(range(500, 540))
    first, second = request(tiny_target, prompt), request(tiny_target, prompt)
    other = request(tiny_target, list(range(900, 910)))
    for item in (first, second, other):
        scheduler.add(item)
    plans = []
    for _ in range(3):
        plans.append(scheduler.schedule())
        for chunk in plans[-1].prefill:
            code = {id(first): 1, id(second): 2, id(other): 3}[id(chunk.request)]
            compute(scheduler, chunk.request, code, chunk.end)
    assert second.row is None and list(scheduler.waiting) == [second]  # still waiting
    assert other.row is not None  # passed it
    plan = scheduler.schedule()  # the prompt is computed: the sample copies 39 tokens of it
    assert [(c.request, c.start, c.end) for c in plan.prefill] == [(second, 39, 40)]
    scheduler.pool.apply_pending()
    assert second.prefix_hit == 39
    assert [marker(scheduler, second.row, s) for s in (0, 38)] == [1000, 1038]


def test_a_copy_from_a_prefill_that_failed_reuses_only_what_was_computed(tiny_target):
    scheduler = new_scheduler(tiny_target, rows=3, chunk=16)
    prompt = list(range(500, 540))
    first, second = request(tiny_target, prompt), request(tiny_target, prompt[:30] + [1, 2])
    scheduler.add(first)
    scheduler.schedule()
    compute(scheduler, first, 1, 16)
    scheduler.schedule()  # first's chunk [16, 32) is planned ...
    scheduler.add(second)
    plan = scheduler.schedule()  # ... and counted on: second plans to reuse 30 tokens
    assert second.prefix_length == 30 and (second, 30, 32) in [(c.request, c.start, c.end)
                                                               for c in plan.prefill]
    scheduler.pool.apply_pending()  # but [16, 32) never got computed (its pass failed)
    assert second.prefix_hit == 16 and second.context_length == 16  # prefill resumes at 16


def test_a_request_asking_for_prompt_logprobs_computes_its_whole_prompt(tiny_target):
    scheduler = new_scheduler(tiny_target)
    first = request(tiny_target, list(range(100, 120)))
    scheduler.add(first)
    scheduler.schedule()
    finish(scheduler, first, 1, [7, 8, 9])
    echo = request(tiny_target, list(range(100, 120)) + [7, 8, 9, 30])
    echo.params.prompt_logprobs = 0  # `echo` + `logprobs`: logits at every prompt position
    scheduler.add(echo)
    plan = scheduler.schedule()
    assert [(c.start, c.end) for c in plan.prefill] == [(0, 16)]  # from the start, nothing reused
    assert echo.prefill_scheduled == 16


def test_clear_frees_every_cached_row_and_the_next_request_misses(tiny_target):
    scheduler = new_scheduler(tiny_target)
    cache = scheduler.prefix_cache
    first = request(tiny_target, list(range(100, 120)))
    scheduler.add(first)
    scheduler.schedule()
    finish(scheduler, first, 1, [7, 8, 9])
    assert scheduler.pool.cached[0] is not None
    cache.clear()
    assert scheduler.pool.cached == [None, None] and scheduler.pool.free_row() == 0
    again = request(tiny_target, list(range(100, 120)) + [7, 8, 9])
    scheduler.add(again)  # once raised KeyError: the pool still named a prefix the index lost
    plan = scheduler.schedule()
    assert again.row == 0 and [(c.start, c.end) for c in plan.prefill] == [(0, 16)]
    assert cache.stats().rows == 0
