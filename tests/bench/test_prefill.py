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


def test_costs_prints_the_prefill_floor(tiny_model_dir, capsys):
    """`eyas bench costs --prefill N`: the cost curve, the prefill timings and the prefill's floor
    (its integer work and its causal attention's float work over the measured peaks)."""
    import re

    from eyas.cli.main import main
    from eyas.models import extension

    assert main(["bench", "costs", "--model", str(tiny_model_dir), "--dtype", "float32", "--repeats", "1",
                 "--prefill", "40", "--prefill-chunk", "16"]) == 0
    out = capsys.readouterr().out
    assert "| T | ms | x single-token step | floor ms | bound by | % of floor |" in out
    assert "prefill of 40 tokens (empty cache):" in out and "3 x 16-token chunks" in out
    if extension.int8dot_kernel() is None:
        assert "  floor " not in out  # no probe, no floors
        return
    floor = re.search(r"^  floor ([0-9.]+) ms \((bandwidth|compute): ([0-9]+) tokens/s; causal attention "
                      r"counted\); the chunked passes at ([0-9]+)% of it$", out, re.MULTILINE)
    assert floor is not None, out
    assert float(floor.group(1)) > 0 and int(floor.group(3)) > 0
