"""Export of a trained head to the layouts SGLang, vLLM and speculators load, and its check."""
