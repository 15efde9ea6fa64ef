"""What a request must pass before it reaches the engine: the API key, the content type, the
body size and the body's nesting depth.

The key is compared in constant time. /health, /metrics and /openapi.json stay open (probes,
scrapers, client generators); every /v1 route needs `Authorization: Bearer KEY` when the
server has one. A body is read up to `--max-body-bytes` (413 beyond) and its nesting depth is
counted before it is parsed (400 beyond MAX_JSON_DEPTH), so that no body reaches the
recursive JSON decoder deeper than a request can need.
"""

from __future__ import annotations

import hmac
import json
import re
from typing import Any

from fastapi import Request

from eyas.server.errors import APIError

MAX_JSON_DEPTH = 32  # an OpenAI request nests 5 levels deep at most (messages -> content parts)
JSON_STRING = re.compile(rb'"(?:[^"\\]|\\.)*"')  # a JSON string literal, escapes included
BRACKETS = re.compile(rb"[\[\]{}]")


def check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", error_type="authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})


def check_content_type(request: Request) -> None:
    """415 unless the body is declared JSON (application/json or any +json type); a request
    that declares no type is read as JSON."""
    declared = request.headers.get("content-type")
    if declared is None:
        return
    media_type = declared.split(";", 1)[0].strip().lower()
    if media_type != "application/json" and not media_type.endswith("+json"):
        raise APIError(415, f"the body must be JSON (Content-Type: application/json), not "
                            f"'{media_type or declared}'", code="unsupported_media_type")


def json_depth(body: bytes) -> int:
    """The deepest nesting of arrays and objects in `body`, brackets inside strings not
    counted (for a body that is not JSON: a bound of what parsing it would reach)."""
    if body.count(b"[") + body.count(b"{") <= MAX_JSON_DEPTH:
        return 0  # cannot nest deeper than that: no need to look
    depth = deepest = 0
    for match in BRACKETS.finditer(JSON_STRING.sub(b'""', body)):
        if match.group() in (b"[", b"{"):
            depth += 1
            deepest = max(deepest, depth)
        else:
            depth -= 1
    return deepest


def refuse_constant(name: str) -> float:
    raise ValueError(f"{name} is not a JSON number")


async def read_json_body(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object: 415 when declared otherwise, 413 beyond `limit`
    bytes, 400 when deeper than MAX_JSON_DEPTH or not JSON."""
    check_content_type(request)
    declared = request.headers.get("content-length")
    too_large = APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    depth = json_depth(bytes(body))
    if depth > MAX_JSON_DEPTH:
        raise APIError(400, f"the body nests {depth} levels deep; at most {MAX_JSON_DEPTH} are "
                            "accepted", code="invalid_json")
    try:
        value = json.loads(body, parse_constant=refuse_constant)
    except (ValueError, UnicodeDecodeError) as error:
        raise APIError(400, f"the body is not valid JSON: {error}", code="invalid_json") from error
    if not isinstance(value, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return value
