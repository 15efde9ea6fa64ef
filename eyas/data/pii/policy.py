"""The PII/DLP filter: scan a conversation, then drop it, redact it, or keep it, per type.

Usage:
    config = PiiConfig(actions=parse_actions("EMAIL=keep,secrets=drop"))
    pii_filter = PiiFilter(config)
    outcome = pii_filter.apply(conversation)   # .conversation (redacted) or .dropped_by (a type)
    pii_filter.report.to_dict()                # counts by type, never the values

Actions: `drop` removes the whole record, `redact` replaces the span with a typed placeholder
(`<EMAIL>`), `keep` leaves it (the finding is still counted). Defaults: secrets that come in
families (private keys, AWS keys, JWTs, provider API keys) drop the record, since the secret
beside them (an AWS secret key, a refresh token) may have no recognisable shape; everything
else is redacted.
"""

from __future__ import annotations

from collections import Counter
from dataclasses import dataclass, field, replace
from typing import Any

from eyas.data.pii.detectors import IP_SCOPES, PHONE_REGIONS, PII_DETECTORS, Detector, detect_ip_addresses, detect_phones
from eyas.data.pii.secrets import SECRET_DETECTORS
from eyas.data.pii.types import ALL_TYPES, NER_TYPES, PII_TYPES, PLACEHOLDERS, SECRET_TYPES, Finding, resolve_overlaps
from eyas.data.records import Conversation, Message

ACTIONS = ("drop", "redact", "keep")
DEFAULT_ACTIONS: dict[str, str] = {
    "PRIVATE_KEY": "drop",
    "URL_CREDENTIALS": "redact",
    "JWT": "drop",
    "AWS_ACCESS_KEY": "drop",
    "API_KEY": "drop",
    "PASSWORD": "redact",
    **{pii_type: "redact" for pii_type in PII_TYPES + NER_TYPES},
}
# Names that set several types at once in `parse_actions`.
TYPE_GROUPS: dict[str, tuple[str, ...]] = {"all": ALL_TYPES, "secrets": SECRET_TYPES, "pii": PII_TYPES, "ner": NER_TYPES}


def parse_actions(spec: str, base: dict[str, str] | None = None) -> dict[str, str]:
    """Parse `EMAIL=keep,secrets=drop` over `base` (the defaults); later items win."""
    actions = dict(DEFAULT_ACTIONS if base is None else base)
    for item in filter(None, (part.strip() for part in spec.split(","))):
        name, _, action = item.partition("=")
        name, action = name.strip(), action.strip().lower()
        types = TYPE_GROUPS.get(name.lower(), (name.upper(),))
        if not all(pii_type in ALL_TYPES for pii_type in types):
            accepted = ", ".join(list(ALL_TYPES) + list(TYPE_GROUPS))
            raise ValueError(f"unknown PII type '{name}' in '{item}' (accepted: {accepted})")
        if action not in ACTIONS:
            raise ValueError(f"unknown PII action '{action}' in '{item}' (accepted: {', '.join(ACTIONS)})")
        actions.update({pii_type: action for pii_type in types})
    return actions


@dataclass
class PiiConfig:
    enabled: bool = True
    actions: dict[str, str] = field(default_factory=lambda: dict(DEFAULT_ACTIONS))
    phone_regions: tuple[str, ...] = PHONE_REGIONS
    ip_scope: str = "public"  # "public": globally routable addresses; "all": private and documentation too
    ner_pipeline: str | None = None  # an installed spaCy pipeline: turns on PERSON and LOCATION
    ner_score_threshold: float = 0.5

    def __post_init__(self) -> None:
        for pii_type, action in self.actions.items():
            if pii_type not in ALL_TYPES:
                raise ValueError(f"unknown PII type '{pii_type}' (accepted: {', '.join(ALL_TYPES)})")
            if action not in ACTIONS:
                raise ValueError(f"unknown PII action '{action}' for {pii_type} (accepted: {', '.join(ACTIONS)})")
        self.actions = {**DEFAULT_ACTIONS, **self.actions}
        import phonenumbers

        unknown = [region for region in self.phone_regions if region not in phonenumbers.SUPPORTED_REGIONS]
        if unknown:
            raise ValueError(f"unknown phone regions {unknown}: use ISO 3166 codes such as US, GB, DE")
        if self.ip_scope not in IP_SCOPES:
            raise ValueError(f"unknown IP scope '{self.ip_scope}' (accepted: {', '.join(IP_SCOPES)})")
        if not 0.0 <= self.ner_score_threshold <= 1.0:
            raise ValueError(f"ner_score_threshold must be in [0, 1], got {self.ner_score_threshold}")


def scanned_types(config: PiiConfig, with_ner: bool | None = None) -> tuple[str, ...]:
    """The types a filter made from `config` looks for (none when it is off)."""
    if not config.enabled:
        return ()
    ner = config.ner_pipeline is not None if with_ner is None else with_ner
    return SECRET_TYPES + PII_TYPES + (NER_TYPES if ner else ())


@dataclass
class PiiReport:
    """What the filter found: counts by type, never the values.

    Every scanned type is listed, with zeros where nothing was found, so that a report also
    says what was looked for; a report with no types is that of a run with the filter off.
    """

    types: tuple[str, ...] = ()  # the types scanned for (scanned_types)
    records_scanned: int = 0
    findings: Counter[str] = field(default_factory=Counter)  # spans found, by type
    records_with: Counter[str] = field(default_factory=Counter)  # records with >= 1 span, by type
    records_dropped_by: Counter[str] = field(default_factory=Counter)  # the type that dropped it
    records_redacted: int = 0

    def add(self, outcome: PiiOutcome) -> None:
        self.records_scanned += 1
        self.findings.update(finding.type for finding in outcome.findings)
        self.records_with.update({finding.type for finding in outcome.findings})
        if outcome.dropped_by is not None:
            self.records_dropped_by[outcome.dropped_by] += 1
        elif outcome.redacted:
            self.records_redacted += 1

    def merge(self, other: PiiReport) -> None:
        self.types = self.types or other.types
        self.records_scanned += other.records_scanned
        self.findings.update(other.findings)
        self.records_with.update(other.records_with)
        self.records_dropped_by.update(other.records_dropped_by)
        self.records_redacted += other.records_redacted

    def to_dict(self) -> dict[str, Any]:
        order = {pii_type: index for index, pii_type in enumerate(ALL_TYPES)}
        by_type = {
            pii_type: {
                "findings": self.findings[pii_type],
                "records": self.records_with[pii_type],
                "records_dropped": self.records_dropped_by[pii_type],
            }
            for pii_type in sorted(set(self.types) | set(self.findings), key=order.__getitem__)
        }
        return {
            "enabled": bool(self.types),
            "records_scanned": self.records_scanned,
            "records_redacted": self.records_redacted,
            "records_dropped": sum(self.records_dropped_by.values()),
            "by_type": by_type,
        }


@dataclass(frozen=True)
class PiiOutcome:
    conversation: Conversation  # redacted where the policy says so
    findings: tuple[Finding, ...]
    dropped_by: str | None  # the type whose policy dropped the record, else None
    redacted: bool = False

    @property
    def drop_reason(self) -> str | None:
        """The reason a dropped record is counted under (`pii:PRIVATE_KEY`), else None."""
        return None if self.dropped_by is None else f"pii:{self.dropped_by}"


def redact(text: str, findings: list[Finding], actions: dict[str, str]) -> str:
    """Replace each finding whose action is `redact` by its placeholder (findings must not overlap)."""
    pieces, cursor = [], 0
    for finding in sorted(findings, key=lambda f: f.start):
        if actions[finding.type] != "redact":
            continue
        pieces.append(text[cursor : finding.start])
        pieces.append(PLACEHOLDERS[finding.type])
        cursor = finding.end
    pieces.append(text[cursor:])
    return "".join(pieces)


class PiiFilter:
    """Scans texts with every detector and applies the per-type policy (`report` counts it all)."""

    def __init__(self, config: PiiConfig, ner_detector: Detector | None = None) -> None:
        self.config = config
        self.detectors: dict[str, Detector] = {**SECRET_DETECTORS, **PII_DETECTORS}
        self.detectors["PHONE"] = lambda text: detect_phones(text, config.phone_regions)
        self.detectors["IP_ADDRESS"] = lambda text: detect_ip_addresses(text, config.ip_scope)
        if ner_detector is None and config.ner_pipeline is not None:
            from eyas.data.pii.ner import build_ner_detector

            ner_detector = build_ner_detector(config.ner_pipeline, config.ner_score_threshold)
        self.ner_detector = ner_detector
        self.report = PiiReport(types=scanned_types(config, with_ner=ner_detector is not None))

    def scan(self, text: str) -> list[Finding]:
        """Every finding in `text`, overlaps resolved (see `resolve_overlaps`)."""
        findings: list[Finding] = []
        for detector in self.detectors.values():
            findings.extend(detector(text))
        if self.ner_detector is not None:
            findings.extend(self.ner_detector(text))
        return resolve_overlaps(findings)

    def apply(self, conversation: Conversation) -> PiiOutcome:
        outcome = self._apply(conversation)
        self.report.add(outcome)
        return outcome

    def _apply(self, conversation: Conversation) -> PiiOutcome:
        # 1. Scan every message.
        scanned = [(message, self.scan(message.content)) for message in conversation.messages]
        findings = tuple(finding for _, message_findings in scanned for finding in message_findings)
        # 2. A type whose action is `drop` drops the record (the earliest type in ALL_TYPES names it).
        dropping = sorted({f.type for f in findings if self.config.actions[f.type] == "drop"}, key=ALL_TYPES.index)
        if dropping:
            return PiiOutcome(conversation, findings, dropping[0])
        # 3. Otherwise redact what the policy says to redact.
        if not any(self.config.actions[f.type] == "redact" for f in findings):
            return PiiOutcome(conversation, findings, None)
        messages = [
            Message(message.role, redact(message.content, message_findings, self.config.actions))
            for message, message_findings in scanned
        ]
        return PiiOutcome(replace(conversation, messages=messages), findings, None, redacted=True)
