"""GET /openapi.json: the OpenAPI 3 description of the routes, with the request schemas.

The /v1 routes read their bodies themselves (guards.py: content type, size, depth before
parsing), so FastAPI cannot see their schemas; this adds them from protocol.py's models, so
that clients generated from the document send what the server validates.
"""

from __future__ import annotations

from typing import Any

from fastapi import FastAPI
from fastapi.openapi.utils import get_openapi

from eyas.server import protocol

REQUEST_SCHEMAS = {"/v1/chat/completions": protocol.ChatCompletionRequest,
                   "/v1/completions": protocol.CompletionRequest}


def openapi_document(app: FastAPI, version: str) -> dict[str, Any]:
    """The app's OpenAPI document (built once, then kept by FastAPI)."""
    if app.openapi_schema is not None:
        return app.openapi_schema
    document = get_openapi(title="eyas", version=version, routes=app.routes,
                           description="OpenAI-compatible server with speculative decoding")
    schemas = document.setdefault("components", {}).setdefault("schemas", {})
    for path, model in REQUEST_SCHEMAS.items():
        body = model.model_json_schema(ref_template="#/components/schemas/{model}")
        schemas.update(body.pop("$defs", {}))
        schemas[model.__name__] = body
        operation = document["paths"][path]["post"]
        operation["requestBody"] = {"required": True, "content": {"application/json": {
            "schema": {"$ref": f"#/components/schemas/{model.__name__}"}}}}
    app.openapi_schema = document
    return document
