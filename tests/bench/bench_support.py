"""Constants of the synthetic sweep shared by the benchmark tests (see conftest.py)."""

from __future__ import annotations

TTFT_MS = 50.0
ITL_MS = 20.0
TOKENS = 12
PROMPT_WORDS = 4  # each prompt of the `prompts_file` fixture has 4 words (the server's prompt_tokens)
NUM_PROMPTS = 8
LEVELS = [1, 4]


def words(text: str) -> int:
    """A token counter for the synthetic server, whose token i is the text ' w{i}'."""
    return len(text.split())
