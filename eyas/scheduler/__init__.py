"""Continuous batching with speculative decoding across the batch: the one engine that decodes
every request (`eyas serve`, and with one row `eyas generate`, `eval`, `bench offline`).

A request walks through these files in order:

config.py       EngineConfig: rows, queue length, token budget, prefill chunk, draft tokens
request.py      Request (token-level and text-level state) and the RequestOutput it streams
proposers.py    --draft spec -> one proposer per request (ngram, model:M, self, eagle3:DIR)
kv_pool.py      KVPool: one KV cache row per running request, grown on demand, compacted
scheduler.py    waiting and running queues, admission, chunked prefill -> StepPlan
speculation.py  measured step costs + per-request acceptance -> draft tokens per step (0 = plain)
batch.py        one target pass over every row's root + draft tree: ids, positions, masks, slots
executor.py     runs a StepPlan: drafts, the forward, per-row acceptance and KV compaction
output.py       detokenization, stop strings, text deltas, finishing (RequestOutput events)
loop.py         StepLoop: schedule -> run -> postprocess; overlapped with a helper thread or not
engine.py       Engine: submit / abort / generate from any thread; runs the loop
single.py       one request (or a fixed batch) decoded on the caller's thread: generate_one
measure.py      python -m eyas.scheduler.measure: tokens/s against concurrency, per configuration
"""
