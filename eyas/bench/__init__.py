"""Benchmarks: offline single-stream decoding now; serving sweeps and plots later."""
