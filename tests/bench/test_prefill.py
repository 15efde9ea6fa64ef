"""bench costs --prefill: the three prefill timings of one prompt."""

from __future__ import annotations

import pytest

from eyas.bench.prefill import PrefillTiming, measure_prefill


def test_prefill_timings_cover_the_chunks_and_the_engine(tiny_target):
    timing = measure_prefill(tiny_target, tokens=40, chunk=16, repeats=1)
    assert (timing.tokens, timing.chunk, timing.chunks) == (40, 16, 3)
    assert timing.one_pass_s > 0 and timing.chunked_s > 0 and timing.engine_s > 0
    assert len(timing.cpu_s) == 3
    lines = timing.describe()
    assert lines[0] == "prefill of 40 tokens (empty cache):"
    assert "3 x 16-token chunks" in lines[2] and "per chunk" in lines[3]


def test_a_timing_needs_tokens_and_a_chunk():
    with pytest.raises(ValueError, match="must be >= 1"):
        PrefillTiming(tokens=0, chunk=256, one_pass_s=1.0, chunked_s=1.0, engine_s=1.0)
