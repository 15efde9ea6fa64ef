"""PII and secret detection (DLP) for prompt data: detectors, per-type policy, report, evaluation.

`detectors` (personal data) and `secrets` find spans, `ner` adds optional names and locations
through Presidio, `policy` drops / redacts / keeps per type and counts findings, `evaluate`
measures precision and recall on a labelled set.
"""
