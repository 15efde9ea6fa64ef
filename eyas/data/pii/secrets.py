"""Detectors for secrets: private keys, credentials in URLs, JWTs, cloud and API keys, passwords.

Prompts full of code carry placeholders (`sk-xxxxxxxx`, `password = "<your password>"`,
`postgres://user:password@host`) far more often than live secrets; every detector here checks
that a value looks like real key material before it reports it.

Usage:
    from eyas.data.pii.secrets import SECRET_DETECTORS
    findings = SECRET_DETECTORS["PASSWORD"]('db_password = "hunter2!"')
"""

from __future__ import annotations

import base64
import binascii
import bisect
import itertools
import json
import re

from eyas.data.pii.detectors import Detector
from eyas.data.pii.types import Finding

_PLACEHOLDER_WORDS = re.compile(
    r"(?i)your|example|placeholder|redacted|dummy|sample|changeme|replace|insert|xxxx|\*\*\*|\.\.\.|<|>|\{\{|\}\}|\$\{|%s|%\("
)


def looks_like_placeholder(value: str) -> bool:
    """`<your-token>`, `sk-xxxxxxxx`, `${PASSWORD}`, `****`, `...`: shapes, not secrets."""
    if _PLACEHOLDER_WORDS.search(value):
        return True
    return len(set(value.lower())) <= 2  # "aaaaaaaa", "00000000", "-----"


def looks_random(token: str, min_distinct: int = 8) -> bool:
    """Key material mixes letters and digits and repeats little."""
    has_digit = any(character.isdigit() for character in token)
    has_letter = any(character.isalpha() for character in token)
    return has_digit and has_letter and len(set(token)) >= min_distinct and not looks_like_placeholder(token)


# ---------------------------------------------------------------------------------------------
# Private-key blocks (PEM of any algorithm, OpenSSH, PGP, encrypted PEM): any length of body.
# A block closed by its END line is a finding whatever its length once its body holds key
# material (base64 that is not a placeholder such as `...` or `YOUR_PRIVATE_KEY_HERE`); a block
# cut off by the end of the text is one when base64 lines follow its BEGIN line.
_PRIVATE_KEY_BEGIN = re.compile(r"-----BEGIN (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")
_PRIVATE_KEY_END = re.compile(r"-----END (?:[A-Z0-9]+ )*PRIVATE KEY(?: BLOCK)?-----")
# Real line breaks, or the `\n` escapes of a key pasted from a JSON string (service accounts).
_KEY_LINE_BREAK = re.compile(r"\r?\n|\\r?\\n")
_PEM_HEADER_LINE = re.compile(r"[A-Za-z][A-Za-z0-9-]*:\s.*")  # Proc-Type: 4,ENCRYPTED / DEK-Info: ...
_BASE64_LINE = re.compile(r"[A-Za-z0-9+/=]+")
_BRACKETED_PLACEHOLDER = re.compile(r"<[^>\n]*>|\$?\{[^}\n]*\}|\[[^\]\n]*\]")
_NOT_BASE64 = re.compile(r"[^A-Za-z0-9+/=]")
MIN_CUT_OFF_KEY_CHARS = 16  # a cut-off block's first line must look like key material, not a word


def _key_lines(body: str) -> list[str]:
    """The body's non-empty lines, without PEM headers (`Proc-Type:`, `DEK-Info:`, `Comment:`)."""
    lines = (line.strip() for line in _KEY_LINE_BREAK.split(body))
    return [line for line in lines if line and not _PEM_HEADER_LINE.fullmatch(line)]


def _has_key_material(body: str) -> bool:
    material = "".join(_NOT_BASE64.sub("", _BRACKETED_PLACEHOLDER.sub("", line)) for line in _key_lines(body))
    return bool(material) and not looks_like_placeholder(material)


def _cut_off_block_end(text: str, start: int) -> int | None:
    """End of the base64 lines that follow a BEGIN line ending at `start`, in a text cut off before END."""
    end, material, cursor = None, "", start
    breaks = itertools.chain((match.span() for match in _KEY_LINE_BREAK.finditer(text, start)),
                             [(len(text), len(text))])
    for line_end, next_line in breaks:
        line = text[cursor:line_end].strip()
        cursor = next_line
        if not line or (not material and _PEM_HEADER_LINE.fullmatch(line)):
            continue
        if not _BASE64_LINE.fullmatch(line):
            break
        material += line
        end = line_end
    if end is None or looks_like_placeholder(material):
        return None
    keylike = len(material) >= MIN_CUT_OFF_KEY_CHARS or any(c.isdigit() or c in "+/" for c in material)
    return end if keylike else None


def detect_private_keys(text: str) -> list[Finding]:
    """Each BEGIN line pairs with the first END line after it, unless another BEGIN comes first
    (then its block was cut off). One pass over the BEGIN and END lines: linear in the text."""
    begins = list(_PRIVATE_KEY_BEGIN.finditer(text))
    ends = list(_PRIVATE_KEY_END.finditer(text))
    end_starts = [end.start() for end in ends]
    findings, position = [], 0
    for index, begin in enumerate(begins):
        if begin.start() < position:
            continue  # inside the block found before
        following = begins[index + 1].start() if index + 1 < len(begins) else len(text)
        next_end = bisect.bisect_left(end_starts, begin.end())
        end = ends[next_end] if next_end < len(ends) and end_starts[next_end] < following else None
        if end is not None:
            if _has_key_material(text[begin.end() : end.start()]):
                findings.append(Finding("PRIVATE_KEY", begin.start(), end.end()))
            position = end.end()
            continue
        stop = _cut_off_block_end(text, begin.end())
        if stop is not None:
            findings.append(Finding("PRIVATE_KEY", begin.start(), stop))
            position = stop
    return findings


# ---------------------------------------------------------------------------------------------
# Credentials in a URL: scheme://user:password@host (the span is `user:password`)
_URL_CREDENTIALS = re.compile(r"\b[A-Za-z][A-Za-z0-9+.-]{1,15}://(?P<user>[^\s:/@]*):(?P<password>[^\s/@]+)@[\w.-]+")
_PLACEHOLDER_PASSWORDS = frozenset({"password", "pass", "passwd", "pwd", "secret", "pw", "mypassword"})


def detect_url_credentials(text: str) -> list[Finding]:
    findings = []
    for match in _URL_CREDENTIALS.finditer(text):
        password = match.group("password")
        if password.lower() in _PLACEHOLDER_PASSWORDS or looks_like_placeholder(password):
            continue
        if password.startswith(("$", "%", "{")):
            continue  # ${DB_PASSWORD}, %(password)s, {password}
        findings.append(Finding("URL_CREDENTIALS", match.start("user"), match.end("password")))
    return findings


# ---------------------------------------------------------------------------------------------
# JSON Web Tokens: three base64url segments, the first decoding to a header with "alg"
_JWT = re.compile(r"(?<![\w-])eyJ[A-Za-z0-9_-]{8,}\.eyJ[A-Za-z0-9_-]{8,}\.[A-Za-z0-9_-]{16,}(?![\w-])")


def _decodes_to_jwt_header(segment: str) -> bool:
    try:
        header = json.loads(base64.urlsafe_b64decode(segment + "=" * (-len(segment) % 4)))
    except (binascii.Error, ValueError, UnicodeDecodeError):
        return False
    return isinstance(header, dict) and "alg" in header


def detect_jwts(text: str) -> list[Finding]:
    return [
        Finding("JWT", match.start(), match.end())
        for match in _JWT.finditer(text)
        if _decodes_to_jwt_header(match.group(0).split(".", 1)[0])
    ]


# ---------------------------------------------------------------------------------------------
# AWS access key ids (AWS's own documentation examples end in EXAMPLE and are skipped)
_AWS_ACCESS_KEY = re.compile(
    r"(?<![A-Za-z0-9])(?:AKIA|ASIA|ABIA|ACCA|AGPA|AIDA|AROA|AIPA|ANPA|ANVA|APKA)[A-Z0-9]{16}(?![A-Za-z0-9])"
)


def detect_aws_access_keys(text: str) -> list[Finding]:
    return [
        Finding("AWS_ACCESS_KEY", match.start(), match.end())
        for match in _AWS_ACCESS_KEY.finditer(text)
        if not match.group(0).endswith("EXAMPLE") and looks_random(match.group(0)[4:], min_distinct=6)
    ]


# ---------------------------------------------------------------------------------------------
# API keys of common providers, by their published prefixes
_API_KEY_PATTERNS: dict[str, str] = {
    "anthropic": r"\bsk-ant-(?:api|admin)\d{2}-[A-Za-z0-9_-]{20,}",
    "openai": r"\bsk-(?:proj-|svcacct-|admin-)?[A-Za-z0-9_-]{20,}",
    "github": r"\b(?:gh[pousr]_[A-Za-z0-9]{36}|github_pat_[A-Za-z0-9_]{40,})\b",
    "gitlab": r"\bglpat-[A-Za-z0-9_-]{20}\b",
    "slack": r"\bxox[abposr]-(?:\d+-)+[A-Za-z0-9]{10,}\b",
    "google": r"\bAIza[0-9A-Za-z_-]{35}(?![\w-])",
    "stripe": r"\b(?:sk|rk)_(?:live|test)_[0-9A-Za-z]{16,}\b",
    "huggingface": r"\bhf_[A-Za-z0-9]{30,}\b",
    "sendgrid": r"\bSG\.[A-Za-z0-9_-]{22}\.[A-Za-z0-9_-]{43}\b",
    "npm": r"\bnpm_[A-Za-z0-9]{36}\b",
}
_API_KEY = re.compile("|".join(f"(?:{pattern})" for pattern in _API_KEY_PATTERNS.values()))


def detect_api_keys(text: str) -> list[Finding]:
    return [
        Finding("API_KEY", match.start(), match.end())
        for match in _API_KEY.finditer(text)
        if looks_random(match.group(0))
    ]


# ---------------------------------------------------------------------------------------------
# `password = "..."`-style assignments (the span is the value; the key stays readable)
_ASSIGNMENT = re.compile(
    r"(?P<key>[A-Za-z_][\w.-]{0,60})[\"']?\s*(?:=|:=|=>|:)\s*"
    r"(?:\"(?P<double>[^\"\n]{1,200})\"|'(?P<single>[^'\n]{1,200})'|(?P<bare>[^\s\"',;)}\]]{1,200}))"
)
_KEY_PARTS = re.compile(r"[A-Z]?[a-z]+|[A-Z]+(?![a-z])|\d+")
_SECRET_WORDS = frozenset({"password", "passwd", "pwd", "passphrase", "secret", "apikey", "passcode"})
_SECRET_PAIRS = frozenset(
    {("api", "key"), ("private", "key"), ("access", "token"), ("auth", "token"), ("refresh", "token"),
     ("api", "token"), ("bot", "token"), ("session", "token"), ("bearer", "token"), ("client", "secret")}
)
_NAMES_A_SECRET = re.compile(r"(?i)password|passwd|secret|token")
_NOT_VALUES = frozenset({"none", "null", "nil", "true", "false", "undefined", "required", "string", "str", "optional"})


def is_secret_key(key: str) -> bool:
    """`password`, `DB_PASSWORD`, `apiKey`, `client_secret`; not `secretary` or `max_tokens`."""
    parts = [part.lower() for part in _KEY_PARTS.findall(key)]
    if any(part in _SECRET_WORDS for part in parts):
        return True
    return any(pair in _SECRET_PAIRS for pair in zip(parts, parts[1:]))


def _is_literal_secret(value: str, quoted: bool) -> bool:
    if len(value) < 4 or value.lower() in _NOT_VALUES or value.lower() in _PLACEHOLDER_PASSWORDS:
        return False
    if looks_like_placeholder(value) or value.count(" ") >= 3:
        return False  # a template or a sentence ("Password must be at least 8 characters")
    if _NAMES_A_SECRET.search(value):
        return False  # the name of a secret, not its value (`my_database_password`, `app-secrets-7c4b`)
    if any(character in value for character in "\"'`(){}[]") or " + " in value:
        return False  # code: a call, an index, a concatenation
    if not quoted:
        # Unquoted, code is a name, a type or an expression (`password: str`, `pwd=user_pass`,
        # `token = res?.accessToken`); a literal has a digit or a symbol (`PASSWORD=hunter2`).
        if not any(character.isdigit() or character in "!@#%^&*~+=" for character in value):
            return False
        if value.startswith(("$", "%", "@", "\\")):
            return False
    return True


_SECRET_HINT = re.compile(r"(?i)pass|pwd|secret|key|token|credential")


def detect_passwords(text: str) -> list[Finding]:
    if not _SECRET_HINT.search(text):
        return []
    findings = []
    position = 0
    while (match := _ASSIGNMENT.search(text, position)) is not None:
        # Matches may nest (`conn = connect(password="x")`): go on right after a non-secret key.
        position = match.end("key")
        if not is_secret_key(match.group("key")):
            continue
        for group, quoted in (("double", True), ("single", True), ("bare", False)):
            value = match.group(group)
            if value is not None:
                if _is_literal_secret(value, quoted):
                    findings.append(Finding("PASSWORD", match.start(group), match.end(group)))
                    position = match.end(group)
                break
    return findings


SECRET_DETECTORS: dict[str, Detector] = {
    "PRIVATE_KEY": detect_private_keys,
    "URL_CREDENTIALS": detect_url_credentials,
    "JWT": detect_jwts,
    "AWS_ACCESS_KEY": detect_aws_access_keys,
    "API_KEY": detect_api_keys,
    "PASSWORD": detect_passwords,
}
