"""Benchmarks: offline single-stream decoding (`offline.py`) and serving sweeps against any
OpenAI-compatible server (`serve_client.py`, `serve_bench.py`, `report.py`, `compare.py`);
see docs/benchmarks.md."""
