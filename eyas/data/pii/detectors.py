"""Detectors for personal data: e-mail, phone, payment card, IBAN, US SSN, IP address.

Each detector takes a text and returns `Finding`s (type and character span), never the values.
They favour precision where a shape is common in ordinary prompts: a checksum must hold
(Luhn for cards, mod-97 for IBANs), a phone number must be valid for its region (the
`phonenumbers` library) and not sit after words like "order" or "invoice", an IP address must
be globally routable by default (private, loopback and documentation ranges are everywhere in
networking questions and identify no one; `ip_scope="all"` flags them too, for DLP policies
that treat any internal address as sensitive).

Usage:
    from eyas.data.pii.detectors import PII_DETECTORS
    findings = PII_DETECTORS["EMAIL"]("mail me at ada@example.org")
"""

from __future__ import annotations

import ipaddress
import re
from typing import Callable, Iterable

import phonenumbers
from stdnum import iban as stdnum_iban
from stdnum.us import ssn as stdnum_ssn

from eyas.data.pii.types import Finding

Detector = Callable[[str], list[Finding]]

# ---------------------------------------------------------------------------------------------
# E-mail
_EMAIL = re.compile(
    r"(?<![\w.+%-])[A-Za-z0-9](?:[A-Za-z0-9._%+-]{0,62}[A-Za-z0-9_%+-])?"
    r"@(?:[A-Za-z0-9](?:[A-Za-z0-9-]{0,61}[A-Za-z0-9])?\.)+([A-Za-z]{2,24})(?![\w-])"
)
# `icon@2x.png`, `font@1.2.woff`: file names, not addresses.
_FILE_SUFFIXES = frozenset(
    "png jpg jpeg gif svg webp ico bmp tif tiff pdf js mjs ts tsx jsx css scss py json yaml yml "
    "xml html htm md txt csv mp3 mp4 wav mov zip gz tar woff woff2 ttf otf".split()
)


def detect_emails(text: str) -> list[Finding]:
    findings = []
    for match in _EMAIL.finditer(text):
        if match.group(1).lower() in _FILE_SUFFIXES:
            continue
        local = match.group(0).split("@", 1)[0]
        if local == "git" and text.startswith(":", match.end()):  # git@github.com:owner/repo
            continue
        if text.endswith("://", 0, match.start()):  # https://user@host: a URL's user, not a mailbox
            continue
        findings.append(Finding("EMAIL", match.start(), match.end()))
    return findings


# ---------------------------------------------------------------------------------------------
# Phone numbers
PHONE_REGIONS: tuple[str, ...] = ("US",)  # numbers written with +country code are found anyway
_DIGIT = re.compile(r"\d")
_PHONE_CONTEXT = re.compile(
    r"(?i)\b(?:phone|tel|telephone|call|mobile|cell|whats ?app|fax|sms|text me|contact|reach me|dial)\b"
)
_NOT_PHONE_CONTEXT = re.compile(
    r"(?i)(?:\b(?:order|invoice|tracking|account|acct|id|ref|reference|isbn|serial|ticket|"
    r"transaction|case|po|sku|receipt|confirmation|booking|version|build|code)\b|#)\W*(?:\w+\W*)?$"
)
_TIME_FRACTION = re.compile(r"\d[.:]$")  # "11:52:00.205743-0400": a timestamp, not a phone
# Shapes that phonenumbers accepts but people write for other things: dates ("2019-11-18-18",
# "08/2014 - 01/2018"), a citation's "(2014) 749-760", decimals ("2.81297 42.125593").
_NOT_PHONE_SHAPE = re.compile(
    r"(?:19|20)\d\d[-/.](?:0?[1-9]|1[0-2])[-/.]\d\d|[^+]*\d/\d|\((?:19|20)\d\d\)|.*\d\.\d{5,}"
)


def detect_phones(text: str, regions: Iterable[str] = PHONE_REGIONS) -> list[Finding]:
    if len(_DIGIT.findall(text)) < 7:
        return []
    findings: dict[tuple[int, int], Finding] = {}
    for region in regions:
        for match in phonenumbers.PhoneNumberMatcher(text, region, leniency=phonenumbers.Leniency.VALID):
            raw = match.raw_string
            before = text[max(0, match.start - 30) : match.start]
            has_context = bool(_PHONE_CONTEXT.search(before))
            if _TIME_FRACTION.search(before) or _NOT_PHONE_SHAPE.match(raw):
                continue
            if raw.isdigit() and not has_context:
                continue  # a bare run of digits is a phone number only where the text says so
            if not has_context and _NOT_PHONE_CONTEXT.search(before):
                continue  # "order 415 555 2671", "invoice #2025550143"
            findings[(match.start, match.end)] = Finding("PHONE", match.start, match.end)
    return list(findings.values())


# ---------------------------------------------------------------------------------------------
# Payment cards: 12-19 digits, single spaces or dashes between them, Luhn, a known issuer prefix
_CARD = re.compile(r"(?<![\d.-])\d(?:[ -]?\d){11,18}(?![\d-]|\.\d)")


def luhn_valid(digits: str) -> bool:
    total = 0
    for index, character in enumerate(reversed(digits)):
        value = int(character)
        if index % 2 == 1:
            value = value * 2 - 9 if value > 4 else value * 2
        total += value
    return total % 10 == 0


def _in_ranges(number: str, ranges: Iterable[tuple[int, int]]) -> bool:
    for low, high in ranges:
        width = len(str(low))
        if low <= int(number[:width]) <= high:
            return True
    return False


# (issuer prefix ranges, allowed lengths), after the published IIN tables.
_CARD_ISSUERS: tuple[tuple[tuple[tuple[int, int], ...], tuple[int, ...]], ...] = (
    (((4, 4),), (13, 16, 19)),  # Visa
    (((51, 55), (2221, 2720)), (16,)),  # Mastercard
    (((34, 34), (37, 37)), (15,)),  # American Express
    (((6011, 6011), (644, 649), (65, 65)), (16, 17, 18, 19)),  # Discover
    (((3528, 3589),), (16, 17, 18, 19)),  # JCB
    (((300, 305), (36, 36), (38, 39)), (14, 15, 16, 17, 18, 19)),  # Diners Club
    (((62, 62),), (16, 17, 18, 19)),  # UnionPay
    (((5018, 5018), (5020, 5020), (5038, 5038), (5893, 5893), (6304, 6304), (6759, 6763)), tuple(range(12, 20))),
)


def card_number_valid(digits: str) -> bool:
    if not luhn_valid(digits):
        return False
    return any(len(digits) in lengths and _in_ranges(digits, ranges) for ranges, lengths in _CARD_ISSUERS)


# How card numbers are grouped when written with separators: fours (the last group shorter),
# or Amex / Diners 4-6-5 and 4-6-4.
_CARD_GROUPING = re.compile(r"\d{4}(?:[ -]\d{4})*(?:[ -]\d{1,4})?|\d{4}[ -]\d{6}[ -]\d{4,5}")


def detect_cards(text: str) -> list[Finding]:
    findings = []
    for match in _CARD.finditer(text):
        raw = match.group(0)
        separators = set(re.findall(r"[ -]", raw))
        if len(separators) > 1:
            continue  # "4111 1111-1111 1111" is no way anyone writes a card number
        if separators and not _CARD_GROUPING.fullmatch(raw):
            continue  # "423-32442-21332" is an order number, whatever its checksum
        if card_number_valid(re.sub(r"[ -]", "", raw)):
            findings.append(Finding("CREDIT_CARD", match.start(), match.end()))
    return findings


# ---------------------------------------------------------------------------------------------
# IBAN: country code, two check digits, up to 30 letters or digits (grouped by spaces or not)
_IBAN = re.compile(r"(?<![A-Za-z0-9])[A-Z]{2}\d{2}(?: ?[A-Z0-9]){11,30}(?![a-z0-9])")


def detect_ibans(text: str) -> list[Finding]:
    findings = []
    for match in _IBAN.finditer(text):
        raw = match.group(0)
        # The pattern may run into a following capitalised word: try the longest valid prefix.
        for end in range(len(raw), 14, -1):
            candidate = raw[:end]
            if candidate.endswith(" ") or (end < len(raw) and raw[end].isalnum() and raw[end - 1] != " "):
                continue  # never cut a group in the middle
            if stdnum_iban.is_valid(candidate):
                findings.append(Finding("IBAN", match.start(), match.start() + end))
                break
    return findings


# ---------------------------------------------------------------------------------------------
# US Social Security numbers: AAA-GG-SSSS (or spaces); nine bare digits only after "SSN"
_SSN = re.compile(r"(?<![\d-])(\d{3})([- ])(\d{2})\2(\d{4})(?![\d-])")
_SSN_BARE = re.compile(r"(?i)\b(?:ssn|social security(?: number| no\.?)?)\W{1,5}(\d{9})\b")
_EXAMPLE_SSNS = frozenset({"123456789"})  # the SSN of every form's example


def _ssn_valid(digits: str) -> bool:
    return digits not in _EXAMPLE_SSNS and stdnum_ssn.is_valid(digits)


def detect_ssns(text: str) -> list[Finding]:
    findings = []
    for match in _SSN.finditer(text):
        if _ssn_valid(match.group(1) + match.group(3) + match.group(4)):
            findings.append(Finding("US_SSN", match.start(), match.end()))
    for match in _SSN_BARE.finditer(text):
        if _ssn_valid(match.group(1)):
            findings.append(Finding("US_SSN", match.start(1), match.end(1)))
    return findings


# ---------------------------------------------------------------------------------------------
# IP addresses (v4 and v6). Scope "public" (the default): globally routable hosts only, the ones
# that can point at a person's machine; private, loopback, link-local and documentation ranges
# are left alone. Scope "all": every valid address, for DLP. Left alone in both: networks in CIDR notation
# (`22.1.11.0/24`); all-single-digit quads (section numbers like 1.1.2.1, and public resolvers
# such as 8.8.8.8 or 1.1.1.1, which identify no one); versions (`Chrome/110.0.0.0`, `v1.2.3.4`).
_IPV4 = re.compile(r"(?<![\w.-])(?:\d{1,3}\.){3}\d{1,3}(?![\w]|\.\d|-\w|/\d)")
_IPV6 = re.compile(
    r"(?<![\w:.])(?:[0-9A-Fa-f]{0,4}:){2,7}(?:[0-9A-Fa-f]{1,4}|(?:\d{1,3}\.){3}\d{1,3})?(?![\w:]|/\d)"
)
_VERSION_CONTEXT = re.compile(
    r"(?i)(?:\b(?:version|ver|v|release|build|firmware|driver)(?:\.|:|\s+is)?\s*|[a-z]/)$"
)


IP_SCOPES = ("public", "all")


def _address_in_scope(candidate: str, scope: str) -> bool:
    try:
        address = ipaddress.ip_address(candidate)
    except ValueError:
        return False
    return scope == "all" or address.is_global


def _looks_like_an_address(candidate: str) -> bool:
    if ":" in candidate:  # IPv6: at least two written groups ("1::" is an AutoHotkey hotkey)
        return sum(bool(group) for group in re.split(r"[:.]", candidate)) >= 2
    return not all(len(octet) == 1 for octet in candidate.split("."))


def detect_ip_addresses(text: str, scope: str = "public") -> list[Finding]:
    """Addresses in `scope` (IP_SCOPES): "public" = globally routable only, "all" = any valid one."""
    assert scope in IP_SCOPES, scope
    findings = []
    for pattern in (_IPV4, _IPV6):
        for match in pattern.finditer(text):
            if _VERSION_CONTEXT.search(text[max(0, match.start() - 16) : match.start()]):
                continue
            if _looks_like_an_address(match.group(0)) and _address_in_scope(match.group(0), scope):
                findings.append(Finding("IP_ADDRESS", match.start(), match.end()))
    return findings


PII_DETECTORS: dict[str, Detector] = {
    "CREDIT_CARD": detect_cards,
    "IBAN": detect_ibans,
    "US_SSN": detect_ssns,
    "EMAIL": detect_emails,
    "IP_ADDRESS": detect_ip_addresses,
    "PHONE": detect_phones,
}
