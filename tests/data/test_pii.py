"""The PII/DLP filter: measured precision/recall on the labelled set, policies, the report."""

from __future__ import annotations


import pytest

from data_support import FIXTURES
from eyas.data.pii.evaluate import evaluate, load_cases
from eyas.data.pii.policy import PiiConfig, PiiFilter, parse_actions, redact
from eyas.data.pii.secrets import is_secret_key
from eyas.data.pii.detectors import card_number_valid, luhn_valid
from eyas.data.pii.types import PII_TYPES, SECRET_TYPES
from eyas.data.records import Conversation, Message

# The table in docs/data.md: (labelled, predicted, precision, recall) per type, on
# tests/data/fixtures/pii_cases.jsonl with the default configuration.
MEASURED = {
    "PRIVATE_KEY": (5, 5, 1.000, 1.000),
    "URL_CREDENTIALS": (7, 7, 1.000, 1.000),
    "JWT": (5, 5, 1.000, 1.000),
    "AWS_ACCESS_KEY": (6, 6, 1.000, 1.000),
    "API_KEY": (12, 12, 1.000, 1.000),
    "PASSWORD": (14, 12, 1.000, 0.857),
    "CREDIT_CARD": (13, 13, 1.000, 1.000),
    "IBAN": (11, 10, 1.000, 0.909),
    "US_SSN": (8, 7, 1.000, 0.875),
    "EMAIL": (18, 16, 1.000, 0.889),
    "IP_ADDRESS": (12, 12, 1.000, 1.000),
    "PHONE": (19, 17, 1.000, 0.895),
}


@pytest.fixture(scope="module")
def cases() -> list:
    return load_cases(FIXTURES / "pii_cases.jsonl")


def test_labelled_set_is_large_and_has_near_misses(cases: list) -> None:
    assert len(cases) >= 200
    near_misses = [case for case in cases if case.group.endswith("near_miss")]
    assert len(near_misses) >= 100 and all(not case.spans for case in near_misses)


def test_measured_precision_and_recall_per_type(cases: list) -> None:
    evaluation = evaluate(cases, PiiFilter(PiiConfig()))
    measured = {
        pii_type: (row["labelled"], row["predicted"], round(row["precision"], 3), round(row["recall"], 3))
        for pii_type, row in evaluation.to_dict()["by_type"].items()
    }
    assert measured == MEASURED


def test_checksums() -> None:
    assert luhn_valid("4111111111111111") and not luhn_valid("4111111111111112")
    assert luhn_valid("0000000000000000") and not card_number_valid("0000000000000000")  # no issuer
    assert card_number_valid("378282246310005")


def test_secret_key_names() -> None:
    for key in ("password", "DB_PASSWORD", "apiKey", "client_secret", "AWS_SECRET_ACCESS_KEY", "accessToken"):
        assert is_secret_key(key), key
    for key in ("secretary", "max_tokens", "token_count", "passenger", "keyboard"):
        assert not is_secret_key(key), key


def conversation(*texts: str) -> Conversation:
    return Conversation("c1", "test", [Message("user", text) for text in texts])


def test_redact_keeps_the_text_around_typed_placeholders() -> None:
    pii_filter = PiiFilter(PiiConfig())
    outcome = pii_filter.apply(conversation(
        "Mail ada@example.org or call (415) 555-2671.",
        'conn = connect(password="hunter2!", host="93.184.216.34")'))
    assert outcome.dropped_by is None and outcome.redacted
    assert [m.content for m in outcome.conversation.messages] == [
        "Mail <EMAIL> or call <PHONE>.",
        'conn = connect(password="<PASSWORD>", host="<IP_ADDRESS>")',
    ]


def test_url_credentials_redact_only_the_userinfo() -> None:
    outcome = PiiFilter(PiiConfig()).apply(conversation("postgres://admin:S3cretPass@db.internal:5432/app"))
    assert outcome.conversation.messages[0].content == "postgres://<URL_CREDENTIALS>@db.internal:5432/app"


def test_drop_keep_and_groups() -> None:
    text = "key AKIAZ3MPLK7Q2XR4B6TN and ada@example.org"
    dropped = PiiFilter(PiiConfig()).apply(conversation(text))
    assert dropped.dropped_by == "AWS_ACCESS_KEY"
    kept = PiiFilter(PiiConfig(actions=parse_actions("all=keep"))).apply(conversation(text))
    assert kept.dropped_by is None and kept.conversation.messages[0].content == text
    assert sorted(f.type for f in kept.findings) == ["AWS_ACCESS_KEY", "EMAIL"]
    assert parse_actions("secrets=keep,API_KEY=drop")["API_KEY"] == "drop"
    with pytest.raises(ValueError, match="unknown PII type 'EMAILS'"):
        parse_actions("EMAILS=drop")


def test_report_counts_types_and_never_holds_values() -> None:
    pii_filter = PiiFilter(PiiConfig())
    pii_filter.apply(conversation("a@b.io and c@d.io", "nothing here"))
    pii_filter.apply(conversation("-----BEGIN RSA PRIVATE KEY-----\n" + "MIIEowIBAAKCAQEA7x9Zq3" * 4 + "\n"
                                  "-----END RSA PRIVATE KEY-----"))
    report = pii_filter.report.to_dict()
    zero = {"findings": 0, "records": 0, "records_dropped": 0}
    found = {"PRIVATE_KEY": {"findings": 1, "records": 1, "records_dropped": 1},
             "EMAIL": {"findings": 2, "records": 1, "records_dropped": 0}}
    # Every type scanned for is listed (zeros too), in the order of types.ALL_TYPES; no NER without a pipeline.
    assert report == {
        "enabled": True, "records_scanned": 2, "records_redacted": 1, "records_dropped": 1,
        "by_type": {pii_type: found.get(pii_type, zero) for pii_type in SECRET_TYPES + PII_TYPES},
    }
    assert "a@b.io" not in repr(report)


def test_overlapping_findings_keep_the_stronger_type() -> None:
    findings = PiiFilter(PiiConfig()).scan("https://bob:hunter22@mail.example.com")
    assert [f.type for f in findings] == ["URL_CREDENTIALS"]
    assert redact("x", [], PiiConfig().actions) == "x"


def test_phone_regions_option_finds_national_numbers() -> None:
    text = "Mobile: 07911 123456"
    assert PiiFilter(PiiConfig()).scan(text) == []
    assert [f.type for f in PiiFilter(PiiConfig(phone_regions=("US", "GB"))).scan(text)] == ["PHONE"]
    with pytest.raises(ValueError, match="unknown phone regions"):
        PiiConfig(phone_regions=("XX",))


def test_names_and_locations_through_presidio_with_a_local_pipeline() -> None:
    spacy = pytest.importorskip("spacy")
    pytest.importorskip("presidio_analyzer")
    from eyas.data.pii.ner import build_ner_detector

    nlp = spacy.blank("en")  # an offline pipeline: an entity ruler, nothing downloaded
    ruler = nlp.add_pipe("entity_ruler")
    ruler.add_patterns([{"label": "PERSON", "pattern": "Ada Lovelace"}, {"label": "GPE", "pattern": "London"}])
    pii_filter = PiiFilter(PiiConfig(), ner_detector=build_ner_detector(nlp))
    outcome = pii_filter.apply(conversation("Ada Lovelace lives in London; mail ada@example.org"))
    assert outcome.conversation.messages[0].content == "<PERSON> lives in <LOCATION>; mail <EMAIL>"


def test_missing_spacy_pipeline_is_never_downloaded() -> None:
    pytest.importorskip("spacy")
    pytest.importorskip("presidio_analyzer")
    from eyas.data.pii.ner import build_ner_detector
    from eyas.errors import EyasError

    with pytest.raises(EyasError, match="never downloads"):
        build_ner_detector("xx_no_such_pipeline_sm")
