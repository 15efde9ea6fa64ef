"""Training data for the draft head: prompts -> PII filter -> the target's answers -> loss masks.

The modules follow the data: `sources` and `json_stream` read datasets, `records` normalises
them, `prepare` filters (with `pii`), deduplicates and splits them, `regenerate` (with
`endpoint` and `resume`) lets the target write the answers, and `templates` renders them with
the target's chat template and computes the loss mask. See docs/data.md.
"""
