"""The OpenAI-compatible HTTP server in front of eyas.scheduler's engine.

app.py       routes: /v1/chat/completions, /v1/completions, /v1/models, /health, /metrics
protocol.py  strict request schemas, unsupported parameters, response and chunk builders
guards.py    API key and body size checks
errors.py    OpenAI-style error bodies and the status table
metrics.py   Prometheus metrics under vLLM's names (the engine's observer)
runner.py    uvicorn in the foreground (SIGTERM drains) or on a background thread
"""
