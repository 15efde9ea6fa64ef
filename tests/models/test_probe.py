"""The limits probe (models/probe.py, csrc/probe.cpp): plausible positive numbers, measured once
per machine and then read from the cache."""

import json

import pytest

from eyas.models import extension, probe
from eyas.models.probe import MachineLimits


@pytest.fixture
def kernel():
    name = extension.int8dot_kernel()
    if name is None:
        pytest.skip("no int8 dot-product kernel here (no AVX2, or EYAS_FUSED=0 / EYAS_INT4_KERNEL=torch)")
    return name


def test_the_probe_returns_plausible_positive_numbers(kernel):
    limits = probe.measure_limits(threads=(1, 2), megabytes=64)
    assert limits.kernel == kernel and limits.cpu
    for threads in (1, 2):
        assert 0.5e9 < limits.bandwidth(threads) < 5e12  # bytes/s: DRAM to a large cache
        assert 2e9 < limits.peak(threads) < 1e13  # int8 multiply-adds/s of one or two cores
        assert 1e9 < limits.float_peak(threads) < 1e13  # float32 multiply-adds/s


def test_every_kernel_built_can_be_probed(kernel):
    for name in extension.module().int8dot_kernels():
        assert probe.measure_limits(threads=(1,), megabytes=16, kernel=name).peak(1) > 1e9
    with pytest.raises(RuntimeError, match="no int8 dot-product kernel named 'sse2'"):
        probe.measure_limits(threads=(1,), megabytes=16, kernel="sse2")


def test_the_limits_are_measured_once_and_cached(kernel, tmp_path, monkeypatch):
    monkeypatch.setenv("EYAS_CACHE", str(tmp_path))
    monkeypatch.setattr(probe, "cache_dir", lambda: tmp_path)
    calls = []
    real = probe.measure_limits

    def counted(*args, **kwargs):  # the real probe's identity, figures of an idle machine
        calls.append(1)
        measured = real(threads=(1,), megabytes=16)
        return MachineLimits(measured.cpu, measured.kernel, 16, {1: 10e9, 2: 18e9}, {1: 50e9, 2: 100e9},
                             {1: 20e9, 2: 40e9})

    monkeypatch.setattr(probe, "measure_limits", counted)
    first = probe.machine_limits()
    second = probe.machine_limits()
    assert len(calls) == 1  # the second call read the cache
    probe.machine_limits(refresh=True)
    assert len(calls) == 2
    assert first == second and isinstance(second, MachineLimits)
    saved = json.loads(probe.limits_cache_path().read_text())
    assert saved["kernel"] == kernel and saved["buffer_megabytes"] == 16
    assert probe.limits_cache_path().parent == tmp_path / "limits"


def test_limits_need_positive_values():
    with pytest.raises(ValueError, match="read_bytes_per_second needs positive values"):
        MachineLimits("cpu", "avx2", 64, {1: 0.0}, {1: 1e9}, {1: 1e9})
    with pytest.raises(ValueError, match="float_multiply_adds_per_second needs positive values"):
        MachineLimits("cpu", "avx2", 64, {1: 1e9}, {1: 1e9}, {})
    limits = MachineLimits("cpu", "avx2", 64, {1: 10e9, 2: 18e9}, {1: 50e9, 2: 100e9}, {1: 20e9, 2: 40e9})
    assert limits.bandwidth(1) == 10e9 and limits.peak(2) == 100e9 and limits.float_peak(1) == 20e9
    assert limits.bandwidth(8) == 18e9  # the nearest thread count measured
    assert MachineLimits.from_json(json.loads(json.dumps(limits.to_json()))) == limits


def test_limits_measured_while_busy_are_used_once_and_not_cached(tmp_path, monkeypatch, capsys):
    monkeypatch.setattr(probe, "cache_dir", lambda: tmp_path)
    monkeypatch.setattr(extension, "int8dot_kernel", lambda: "avx2")
    busy = MachineLimits("cpu", "avx2", 64, {1: 14e9, 2: 0.7e9}, {1: 128e9, 2: 226e9}, {1: 30e9, 2: 60e9})
    assert busy.busy_reason() == "2 threads measured a read rate of 0.7 GB/s against 14.0 GB/s on 1"
    assert MachineLimits("cpu", "avx2", 64, {1: 14e9, 2: 26e9}, {1: 128e9, 2: 100e9}, {1: 30e9, 2: 60e9}
                         ).busy_reason() == "2 threads measured a multiply-add rate of 100.0 G/s against 128.0 G/s on 1"
    assert MachineLimits("cpu", "avx2", 64, {1: 14e9, 2: 26e9}, {1: 128e9, 2: 226e9}, {1: 30e9, 2: 20e9}
                         ).busy_reason() == "2 threads measured a float multiply-add rate of 20.0 G/s against 30.0 G/s on 1"
    monkeypatch.setattr(probe, "measure_limits", lambda: busy)
    assert probe.machine_limits() == busy
    assert "looked busy while probing" in capsys.readouterr().err
    assert not probe.limits_cache_path().exists()
