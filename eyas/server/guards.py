"""What a request must pass before it reaches the engine: the API key and the body size.

The key is compared in constant time. /health and /metrics stay open (probes and scrapers);
every /v1 route needs `Authorization: Bearer KEY` when the server has one.
"""

from __future__ import annotations

import hmac
import json
from typing import Any

from fastapi import Request

from eyas.server.errors import APIError


def check_api_key(request: Request, api_key: str | None) -> None:
    if api_key is None:
        return
    header = request.headers.get("authorization", "")
    scheme, _, given = header.partition(" ")
    if scheme.lower() != "bearer" or not hmac.compare_digest(given.strip().encode(), api_key.encode()):
        raise APIError(401, "missing or invalid API key: send 'Authorization: Bearer <key>'",
                       code="invalid_api_key", error_type="authentication_error",
                       headers={"WWW-Authenticate": "Bearer"})


async def read_json_body(request: Request, limit: int) -> dict[str, Any]:
    """The request body as a JSON object; 413 beyond `limit` bytes, 400 when not JSON."""
    declared = request.headers.get("content-length")
    too_large = APIError(413, f"the request body exceeds {limit} bytes", code="request_too_large")
    if declared is not None and declared.isdigit() and int(declared) > limit:
        raise too_large
    body = bytearray()
    async for chunk in request.stream():
        body += chunk
        if len(body) > limit:
            raise too_large
    try:
        value = json.loads(body)
    except (ValueError, UnicodeDecodeError) as error:
        raise APIError(400, f"the body is not valid JSON: {error}", code="invalid_json") from error
    if not isinstance(value, dict):
        raise APIError(400, "the body must be a JSON object", code="invalid_json")
    return value
