"""Target models: resolving a spec to a folder, the lean Llama-family model, the KV cache."""
