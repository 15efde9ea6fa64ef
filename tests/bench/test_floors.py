"""Floors of a pass (bench/floors.py): the arithmetic on a hand-made example."""

import pytest
import torch

from eyas.bench.floors import ModelWork, PassWork, costs_table, floor_seconds, pass_work, prefill_work
from eyas.models.probe import MachineLimits

LIMITS = MachineLimits("test cpu", "avx512vnni", 1024, {1: 20e9, 2: 32e9}, {1: 200e9, 2: 400e9},
                       {1: 50e9, 2: 100e9})
# SmolLM2-135M's sizes, rounded: 60 MB of int4 decoder, 28 MB of int8 screen, 106 M + 28 M
# multiply-adds a row, 46,080 bytes of float32 KV cache per token, 14-bit activations.
WORK = ModelWork(60_000_000, 28_000_000, 106_000_000, 28_000_000, 46_080, 2)


def test_a_one_token_step_is_bound_by_bandwidth():
    work = pass_work(WORK, rows=1, context=256)
    assert work.bytes == 88_000_000 + 257 * 46_080
    assert work.multiply_adds == 134_000_000 * 2
    seconds, bound_by = floor_seconds(work, LIMITS, threads=2)
    assert bound_by == "bandwidth"
    assert seconds == pytest.approx(99_842_560 / 32e9)  # 3.12 ms
    assert floor_seconds(work, LIMITS, threads=1)[0] == pytest.approx(99_842_560 / 20e9)


def test_many_rows_are_bound_by_compute():
    work = pass_work(WORK, rows=32, context=256)
    seconds, bound_by = floor_seconds(work, LIMITS, threads=2)
    assert bound_by == "compute"
    assert seconds == pytest.approx(32 * 268_000_000 / 400e9)  # 21.44 ms
    # where the two meet: rows * 268e6 / 400e9 = bytes / 32e9 -> about 4.7 rows
    assert floor_seconds(pass_work(WORK, 4, 256), LIMITS, 2)[1] == "bandwidth"
    assert floor_seconds(pass_work(WORK, 5, 256), LIMITS, 2)[1] == "compute"


def test_the_costs_table_shows_the_percent_of_the_floor_reached():
    lines = costs_table({1: 6.24e-3, 32: 42.88e-3}, WORK, LIMITS, context=256)
    assert lines[0] == "| T | ms | x single-token step | floor ms | bound by | % of floor |"
    # floor 3.12 ms of 6.24 measured: 50%; 21.44 of 42.88: 50%
    assert lines[2] == "| 1 | 6.24 | 1.00 | 3.12 | bandwidth | 50% |"
    assert lines[3] == "| 32 | 42.88 | 6.87 | 21.44 | compute | 50% |"
    assert costs_table({1: 6e-3}, WORK, None)[2] == "| 1 | 6.00 | 1.00 | - | - | - |"


# the same with attention's float32 multiply-adds: 9 heads x 64 dims x 30 layers, q.k and p*v
ATTENDING = ModelWork(60_000_000, 28_000_000, 106_000_000, 28_000_000, 46_080, 2, 2, 2 * 9 * 64 * 30)


def test_attention_adds_its_float_multiply_adds_to_the_compute_floor():
    work = pass_work(ATTENDING, rows=256, context=1792)  # every row sees the context and the new rows
    assert work.float_multiply_adds == 256 * 2048 * 34_560
    seconds, bound_by = floor_seconds(work, LIMITS, threads=2)
    assert bound_by == "compute"  # 171.52 ms of integer and 181.19 ms of float work, added
    assert seconds == pytest.approx(256 * 268e6 / 400e9 + 256 * 2048 * 34_560 / 100e9)
    chain = pass_work(ATTENDING, rows=4, context=10, visible_keys=11 + 12 + 13 + 14)
    assert chain.float_multiply_adds == 50 * 34_560 and chain.cache_bytes == 14 * 46_080
    assert pass_work(WORK, rows=256, context=1792).float_multiply_adds == 0  # a model without the count


def test_a_prefill_reads_the_weights_once_and_attends_causally():
    work = prefill_work(ATTENDING, tokens=2048)
    assert work.rows == 2048 and work.bytes == 88_000_000 + 2048 * 46_080
    assert work.multiply_adds == 2048 * 106_000_000 * 2 + 28_000_000 * 2  # the screen for the last row only
    assert work.float_multiply_adds == 2048 * 2049 // 2 * 34_560  # row i sees the i + 1 keys up to itself
    seconds, bound_by = floor_seconds(work, LIMITS, threads=2)
    assert bound_by == "compute"
    assert seconds == pytest.approx((2048 * 212e6 + 56e6) / 400e9 + 2048 * 2049 / 2 * 34_560 / 100e9)  # 1.81 s


def test_a_pass_needs_rows():
    with pytest.raises(ValueError, match="rows >= 1"):
        PassWork(0, 1, 1, 1)


def test_profile_parts_of_a_tiny_model(tiny_target):
    from eyas.bench.profile import PARTS, format_profile, profile_pass

    profile = profile_pass(tiny_target, rows=4, context=16, repeats=3)
    for part in ("step", "layers", "matmuls", "layer_rest", "output", "norm_embed", "python"):
        assert profile.seconds[part] >= 0.0
    assert profile.seconds["layers"] > 0 and profile.seconds["matmuls"] > 0 and profile.seconds["output"] > 0
    assert profile.seconds["layers"] + profile.seconds["output"] < 1.5 * profile.seconds["timed"]  # parts of that pass
    table = format_profile([profile])
    assert table[0] == "| part | T=4 ms | % | floor ms |"
    assert table[2].startswith("| whole pass (as `bench costs` times it) |") and table[2].endswith("| 100% | - |")
    assert len(table) == 2 + sum(part in profile.seconds for part, _ in PARTS)
    # the timers are gone afterwards: the model's modules run their own methods again
    model = tiny_target.model
    assert "forward" not in model.norm.__dict__ and all("forward" not in layer.__dict__ for layer in model.layers)


def test_bench_profile_cli(tiny_model_dir, capsys):
    from eyas.cli.main import main

    assert main(["bench", "profile", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--tokens", "1,2", "--context", "8", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "| part | T=1 ms | % | floor ms | T=2 ms | % | floor ms |" in out
    assert "| decoder layers |" in out and "CPU: " in out
    assert main(["bench", "profile", "--model", str(tiny_model_dir), "--dtype", "float32",
                 "--tokens", "1", "--sequences", "3", "--context", "8", "--repeats", "2"]) == 0
    out = capsys.readouterr().out
    assert "| part | 3x T=1 ms | % | floor ms |" in out
    assert "continuous-batching pass over 3 requests, each with 8 cached tokens and T new ones" in out


def test_bench_profile_refuses_bad_token_counts(tiny_model_dir, capsys):
    from eyas.cli.main import main

    assert main(["bench", "profile", "--model", str(tiny_model_dir), "--tokens", "0,8"]) != 0
    assert "tokens must be between 1 and 256, got (0, 8)" in capsys.readouterr().err


def test_the_floors_of_a_continuous_batching_pass_count_every_request():
    from eyas.bench.profile import part_floors

    one = part_floors(WORK, LIMITS, rows=1, context=256)
    batch = part_floors(WORK, LIMITS, rows=1, context=256, sequences=16)
    bandwidth, peak = LIMITS.bandwidth(), LIMITS.peak()
    # each request reads its own 256 cached entries and its new one; the weights are read once
    assert one["attention"] == pytest.approx(257 * 46_080 / bandwidth)
    assert batch["attention"] == pytest.approx(16 * 257 * 46_080 / bandwidth)
    assert batch["matmuls"] == pytest.approx(max(60e6 / bandwidth, 16 * 106e6 * 2 / peak))
    assert batch["step"] == pytest.approx(floor_seconds(pass_work(WORK, 16, 16 * 256), LIMITS)[0])
    # attention's float work: 16 requests x 1 new token each seeing 257 keys; a prefill chunk of
    # 256 rows after 1,792 cached, each row seeing all 2,048 (the mask `bench costs` times)
    float_peak = LIMITS.float_peak()
    batch = part_floors(ATTENDING, LIMITS, rows=1, context=256, sequences=16)
    assert batch["attention"] == pytest.approx(max(16 * 257 * 46_080 / bandwidth, 16 * 257 * 34_560 / float_peak))
    prefill = part_floors(ATTENDING, LIMITS, rows=256, context=1792)
    assert prefill["attention"] == pytest.approx(256 * 2048 * 34_560 / float_peak)  # compute, not reading
    assert prefill["layers"] == pytest.approx(256 * 106e6 * 2 / peak + 256 * 2048 * 34_560 / float_peak)
    two = part_floors(ATTENDING, LIMITS, rows=2, context=10, sequences=3)  # chains: 11 and 12 keys
    assert two["attention"] == pytest.approx(max(3 * 12 * 46_080 / bandwidth, 3 * 23 * 34_560 / float_peak))


def test_profile_of_a_continuous_batching_pass(tiny_target, monkeypatch):
    """--sequences N: one ragged pass over N requests, each its own KV row with the same
    context and T new tokens; each request's rows are what a pass over it alone computes."""
    from eyas.bench.profile import ProfileConfig, batch_pass, format_profile, profile_pass
    from eyas.engine.generate import new_cache
    from eyas.engine.speculative.sizing import prefill_context, sample_tokens

    model = tiny_target.model
    seen = []  # the hidden states each pass hands to the output layer
    output_logits = type(model).output_logits.__get__(model)

    def recorded(hidden, greedy=False):
        seen.append(hidden.clone())
        return output_logits(hidden, greedy)
    monkeypatch.setattr(model, "output_logits", recorded)
    alone = new_cache(tiny_target, 1, 16)
    prefill_context(tiny_target, alone, 8)
    batch = new_cache(tiny_target, 3, 16)
    prefill_context(tiny_target, batch, 8)
    assert torch.equal(batch.keys[:, 1:, :, :8], batch.keys[:, :1, :, :8].expand(-1, 2, -1, -1, -1))
    assert torch.allclose(batch.keys[:, 0, :, :8], alone.keys[:, 0, :, :8], atol=1e-6)
    batch_pass(tiny_target, batch, 8, 2)()
    hidden = seen[-1]  # [3 x 2, H]: request after request
    assert hidden.shape[0] == 6
    for request in (1, 2):
        assert torch.allclose(hidden[2 * request: 2 * request + 2], hidden[:2], atol=1e-5)
    # the same two tokens over the request alone, the second seeing the first
    mask = torch.ones(1, 2, 10, dtype=torch.bool)
    mask[0, 0, 9] = False
    ids = sample_tokens(tiny_target, 10)[:, 8:]  # [1, 2]
    model(ids, cache=alone, write_at=8, attn_mask=mask, kv_len=10, logits_at=None)
    for request in range(3):  # what the pass wrote to each row: the entries of the pass alone
        assert torch.allclose(batch.keys[:, request, :, 8:10], alone.keys[:, 0, :, 8:10], atol=1e-5)
    monkeypatch.undo()
    profile = profile_pass(tiny_target, rows=2, context=8, repeats=2, sequences=3)
    assert profile.sequences == 3 and profile.seconds["step"] > 0
    assert format_profile([profile])[0] == "| part | 3x T=2 ms | % | floor ms |"
    with pytest.raises(ValueError, match="sequences must be between 1 and 256, got 0"):
        ProfileConfig(sequences=0)
    with pytest.raises(ValueError, match="at most 1024 rows, got 64 x 32"):
        ProfileConfig(sequences=64, tokens=(1, 32))
    with pytest.raises(ValueError, match=r"at most 262,144 KV cache entries .* got 256 x \(4096 \+ 1\)"):
        ProfileConfig(sequences=256, tokens=(1,), context=4096)


def test_profile_splits_the_fused_stack_of_the_int4_target(smollm_int4_target):
    """Inside the one C++ call of the int4 stack, every phase is charged, and the parts of a
    timed pass add up to it (bench/profile.py, csrc/phase_timer.h)."""
    from eyas.bench.profile import STACK_PHASES, TOP_PARTS, format_profile, profile_pass

    if smollm_int4_target.model.fused_layers() is None:
        pytest.skip("no fused int4 stack here (no C++ extension)")
    threads = torch.get_num_threads()
    torch.set_num_threads(1)  # one thread on its CPU time: what other processes do cannot skew the sums
    try:
        profile = profile_pass(smollm_int4_target, rows=4, context=32, repeats=5, clock="cpu")
    finally:
        torch.set_num_threads(threads)
    seconds = profile.seconds
    assert seconds["sync"] == 0.0  # one thread never waits for another
    for part in STACK_PHASES + ("stack_other",):
        assert seconds[part] >= 0.0, part
    for part in ("qkv", "o", "gate_up", "down", "quantize", "attention", "norms", "rotary", "silu_mul",
                 "residuals"):
        assert seconds[part] > 0.0, part
    matmuls = seconds["qkv"] + seconds["o"] + seconds["gate_up"] + seconds["down"]
    assert matmuls > 0.3 * (seconds["layers"] - seconds["sync"])  # waits aside (a loaded machine)
    assert seconds["stack_other"] < 0.2 * seconds["layers"]  # the phases cover the call
    assert sum(seconds[part] for part in STACK_PHASES + ("stack_other",)) == pytest.approx(seconds["layers"], rel=0.15)
    assert sum(seconds[part] for part in TOP_PARTS) == pytest.approx(seconds["timed"], rel=0.15)
    assert 0.33 < seconds["timed"] / seconds["step"] < 3.0  # the pass `bench costs` times, timers aside
    assert "layer_rest" not in seconds
    table = format_profile([profile])
    labels = [line.split(" |")[0].strip("| ") for line in table[2:]]
    assert labels[:3] == ["whole pass (as `bench costs` times it)",
                          "the same pass with timers (the parts below add up to it)", "decoder layers"]
    assert "q/k/v matmul (int4)" in labels and "threads waiting at the end of parallel regions" in labels


def test_model_work_reads_the_screen_not_the_float_output_rows(tiny_target):
    from eyas.bench.floors import model_work
    from eyas.models.output_layer import ScreenedOutputLayer

    head = tiny_target.model.lm_head
    assert isinstance(head, ScreenedOutputLayer)
    work = model_work(tiny_target.model)
    weight = head.weight
    try:
        head.weight = None  # as a large untied output layer holds it: rows read when needed
        assert model_work(tiny_target.model) == work
    finally:
        head.weight = weight
    assert work.output_multiply_adds == (head.out_features * head.in_features if head.int8dot else 0)
