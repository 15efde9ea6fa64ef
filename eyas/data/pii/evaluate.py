"""Measure the PII filter's precision and recall per type on a labelled set of texts.

Usage:
    eyas data pii-eval --cases tests/data/fixtures/pii_cases.jsonl [--ner-pipeline en_core_web_sm]

A case is one JSON line: `{"group": "phone_near_miss", "text": "...", "spans": [["PHONE", "(415) 555-2671"]]}`
where `spans` lists every finding the text holds (an empty list for a near miss: a text that
looks like PII and is not). A predicted finding counts as a true positive when it overlaps an
unmatched labelled span of the same type. Names and locations (PERSON, LOCATION) are labelled
only in the `ner` group, so they are scored on that group only, and only with a spaCy pipeline.
"""

from __future__ import annotations

import json
from collections import Counter
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any

from eyas.data.pii.policy import PiiFilter
from eyas.data.pii.types import ALL_TYPES, NER_TYPES, Finding


@dataclass(frozen=True)
class LabelledCase:
    group: str
    text: str
    spans: tuple[tuple[str, str], ...]  # (type, exact value) in order of appearance


@dataclass
class TypeScore:
    true_positives: int = 0
    false_positives: int = 0
    false_negatives: int = 0

    @property
    def precision(self) -> float:
        predicted = self.true_positives + self.false_positives
        return self.true_positives / predicted if predicted else 1.0

    @property
    def recall(self) -> float:
        labelled = self.true_positives + self.false_negatives
        return self.true_positives / labelled if labelled else 1.0


@dataclass
class Evaluation:
    scores: dict[str, TypeScore] = field(default_factory=dict)
    cases: int = 0
    # (group, text, missed or spurious type) for the cases that were wrong, to read and improve
    errors: list[tuple[str, str, str]] = field(default_factory=list)

    def to_dict(self) -> dict[str, Any]:
        return {
            "cases": self.cases,
            "by_type": {
                pii_type: {
                    "labelled": score.true_positives + score.false_negatives,
                    "predicted": score.true_positives + score.false_positives,
                    "precision": round(score.precision, 4),
                    "recall": round(score.recall, 4),
                }
                for pii_type, score in self.scores.items()
            },
        }

    def table(self) -> str:
        lines = ["| type | labelled | predicted | precision | recall |", "|---|---:|---:|---:|---:|"]
        for pii_type, score in self.scores.items():
            labelled = score.true_positives + score.false_negatives
            predicted = score.true_positives + score.false_positives
            lines.append(f"| {pii_type} | {labelled} | {predicted} | {score.precision:.3f} | {score.recall:.3f} |")
        return "\n".join(lines)


def load_cases(path: str | Path) -> list[LabelledCase]:
    cases = []
    with open(path, encoding="utf-8") as handle:
        for line_number, line in enumerate(handle, start=1):
            if not line.strip():
                continue
            raw = json.loads(line)
            spans = tuple((str(pii_type), str(value)) for pii_type, value in raw.get("spans", []))
            for pii_type, value in spans:
                if pii_type not in ALL_TYPES or value not in raw["text"]:
                    raise ValueError(f"{path}:{line_number}: bad span ({pii_type}, {value!r})")
            cases.append(LabelledCase(str(raw.get("group", "")), raw["text"], spans))
    return cases


def _labelled_findings(case: LabelledCase) -> list[Finding]:
    findings, cursor = [], 0
    for pii_type, value in case.spans:
        start = case.text.find(value, cursor)
        if start < 0:
            start = case.text.find(value)
        findings.append(Finding(pii_type, start, start + len(value)))
        cursor = start + len(value)
    return findings


def evaluate(cases: list[LabelledCase], pii_filter: PiiFilter) -> Evaluation:
    scored_types = [t for t in ALL_TYPES if t not in NER_TYPES or pii_filter.ner_detector is not None]
    evaluation = Evaluation(scores={pii_type: TypeScore() for pii_type in scored_types})
    for case in cases:
        evaluation.cases += 1
        labelled = _labelled_findings(case)
        predicted = pii_filter.scan(case.text)
        if case.group != "ner":  # names are labelled in the ner group only
            labelled = [f for f in labelled if f.type not in NER_TYPES]
            predicted = [f for f in predicted if f.type not in NER_TYPES]
        labelled = [f for f in labelled if f.type in evaluation.scores]
        outcome: Counter[tuple[str, str]] = Counter()
        unmatched = list(labelled)
        for finding in predicted:
            match = next((f for f in unmatched if f.type == finding.type and f.overlaps(finding)), None)
            if match is not None:
                unmatched.remove(match)
                outcome[(finding.type, "tp")] += 1
            else:
                outcome[(finding.type, "fp")] += 1
                evaluation.errors.append((case.group, case.text, f"spurious {finding.type}"))
        for finding in unmatched:
            outcome[(finding.type, "fn")] += 1
            evaluation.errors.append((case.group, case.text, f"missed {finding.type}"))
        for (pii_type, kind), count in outcome.items():
            if pii_type not in evaluation.scores:
                continue
            score = evaluation.scores[pii_type]
            if kind == "tp":
                score.true_positives += count
            elif kind == "fp":
                score.false_positives += count
            else:
                score.false_negatives += count
    return evaluation
