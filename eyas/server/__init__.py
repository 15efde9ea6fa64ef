"""The OpenAI-compatible HTTP server in front of eyas.scheduler's engine.

app.py       routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics
protocol.py  strict request schemas, unsupported parameters and limits, response and chunk builders
choices.py   the n x prompts engine requests behind one HTTP request, merged into choices
format.py    choices as the client sees them (echo, logprobs), whole or as stream chunks
logprobs.py  logprobs in OpenAI's chat and completions shapes
guards.py    API key and body size checks
errors.py    OpenAI-style error bodies and the status table
metrics.py   Prometheus metrics under vLLM's names (the engine's observer)
runner.py    uvicorn in the foreground (SIGTERM drains) or on a background thread
"""
