"""lm-eval-harness against `eyas serve` and transformers on local tasks (see tasks.py, compare.py)."""
