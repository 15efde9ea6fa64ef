"""Helpers for scheduler tests (a uniquely named module: test folders share one namespace)."""

from __future__ import annotations

import threading


def run_all(engine, jobs, timeout: float = 60.0):
    """Submit (prompt_ids, params) jobs at once; return each one's (token_ids, text, final)."""
    results = [None] * len(jobs)
    done = [threading.Event() for _ in jobs]

    def collector(index):
        tokens, texts = [], []

        def on_output(output):
            tokens.extend(output.token_ids)
            texts.append(output.text)
            if output.finished:
                results[index] = (tokens, "".join(texts), output)
                done[index].set()
        return on_output

    for index, (prompt, params) in enumerate(jobs):
        engine.submit(prompt, params, collector(index))
    for event in done:
        assert event.wait(timeout), "a request never finished"
    return results
