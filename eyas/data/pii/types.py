"""The PII and secret types eyas detects, and the finding a detector returns."""

from __future__ import annotations

from dataclasses import dataclass

# Every type, in the order overlaps are resolved: when two findings overlap, the one whose type
# comes first wins (a private-key block beats the base64 inside it, a URL with credentials beats
# the e-mail-shaped `user:password@host`).
SECRET_TYPES = ("PRIVATE_KEY", "URL_CREDENTIALS", "JWT", "AWS_ACCESS_KEY", "API_KEY", "PASSWORD")
PII_TYPES = ("CREDIT_CARD", "IBAN", "US_SSN", "EMAIL", "IP_ADDRESS", "PHONE")
NER_TYPES = ("PERSON", "LOCATION")  # only with the optional Presidio + spaCy extra
ALL_TYPES = SECRET_TYPES + PII_TYPES + NER_TYPES

# The placeholder that replaces a redacted finding.
PLACEHOLDERS: dict[str, str] = {pii_type: f"<{pii_type}>" for pii_type in ALL_TYPES}


@dataclass(frozen=True)
class Finding:
    type: str  # one of ALL_TYPES
    start: int  # character span [start, end) in the scanned text
    end: int

    def __post_init__(self) -> None:
        assert self.type in ALL_TYPES, self.type
        assert 0 <= self.start < self.end, (self.start, self.end)

    def overlaps(self, other: Finding) -> bool:
        return self.start < other.end and other.start < self.end


def resolve_overlaps(findings: list[Finding]) -> list[Finding]:
    """Keep, among overlapping findings, the one of the earliest type (then the longest)."""
    rank = {pii_type: index for index, pii_type in enumerate(ALL_TYPES)}
    kept: list[Finding] = []
    for finding in sorted(findings, key=lambda f: (rank[f.type], f.start - f.end, f.start)):
        if not any(finding.overlaps(other) for other in kept):
            kept.append(finding)
    return sorted(kept, key=lambda f: f.start)
