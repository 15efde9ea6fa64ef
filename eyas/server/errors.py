"""OpenAI-style errors: every failure is a JSON body that names what was wrong.

    {"error": {"message": "...", "type": "invalid_request_error", "param": "max_tokens",
               "code": "invalid_value"}}

| status | when                                                   | type                  |
|--------|--------------------------------------------------------|-----------------------|
| 400    | malformed JSON (or nested deeper than 32), missing / mistyped / out-of-range field, unknown model, prompt or max_tokens beyond the context, unsupported parameter | invalid_request_error |
| 401    | --api-key set and no matching `Authorization: Bearer` | authentication_error  |
| 404    | unknown route                                          | invalid_request_error |
| 405    | a method the route does not take (with Allow)          | invalid_request_error |
| 413    | body larger than --max-body-bytes                      | invalid_request_error |
| 415    | a Content-Type other than JSON                         | invalid_request_error |
| 503    | waiting queue full (with Retry-After), or shutting down| server_error          |
| 500    | a failure inside eyas (the server keeps serving)       | server_error          |
"""

from __future__ import annotations

import logging
from typing import Any

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from pydantic import ValidationError
from starlette.exceptions import HTTPException as StarletteHTTPException

log = logging.getLogger("eyas.server")

TYPE_NAMES = {"str", "int", "float", "bool", "list", "dict", "none"}


class APIError(Exception):
    def __init__(self, status: int, message: str, param: str | None = None,
                 code: str | None = None, error_type: str | None = None,
                 headers: dict[str, str] | None = None) -> None:
        super().__init__(message)
        self.status = status
        self.message = message
        self.param = param
        self.code = code
        self.error_type = error_type or ("server_error" if status >= 500 else "invalid_request_error")
        self.headers = headers

    def body(self) -> dict[str, Any]:
        return error_body(self.message, self.error_type, self.param, self.code)

    def response(self) -> JSONResponse:
        return JSONResponse(self.body(), status_code=self.status, headers=self.headers)


def error_body(message: str, error_type: str, param: str | None = None,
               code: str | None = None) -> dict[str, Any]:
    return {"error": {"message": message, "type": error_type, "param": param, "code": code}}


def field_path(location: tuple[Any, ...]) -> str:
    """pydantic's error location -> an OpenAI-style param, e.g. 'messages.[0].content'.
    Union-member tags that pydantic inserts ('str', 'list[int]') are dropped."""
    parts: list[str] = []
    for item in location:
        if isinstance(item, int):
            parts.append(f"[{item}]")
        elif isinstance(item, str) and item.isidentifier() and item.lower() not in TYPE_NAMES:
            parts.append(item)
    return ".".join(parts)


def from_validation_error(error: ValidationError) -> APIError:
    first = error.errors()[0]
    param = field_path(tuple(first["loc"]))
    kind = first["type"]
    if kind == "missing":
        message, code = f"missing required field '{param}'", "missing_required_parameter"
    elif kind.endswith("_type") or kind in ("literal_error", "model_type", "list_type"):
        shown = repr(first.get("input"))[:60]
        message, code = f"'{param}' has the wrong type or value: {first['msg']} (got {shown})", "invalid_type"
    else:
        message, code = f"'{param}': {first['msg']}", "invalid_value"
    return APIError(400, message, param=param or None, code=code)


def install_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def api_error(request: Request, error: APIError) -> JSONResponse:
        return error.response()

    @app.exception_handler(ValidationError)
    async def validation_error(request: Request, error: ValidationError) -> JSONResponse:
        return from_validation_error(error).response()

    @app.exception_handler(RequestValidationError)
    async def request_validation_error(request: Request, error: RequestValidationError) -> JSONResponse:
        first = error.errors()[0] if error.errors() else {"loc": (), "msg": "invalid request"}
        return APIError(400, first["msg"], param=field_path(tuple(first["loc"])[1:]) or None,
                        code="invalid_value").response()

    @app.exception_handler(StarletteHTTPException)
    async def http_error(request: Request, error: StarletteHTTPException) -> JSONResponse:
        message = {404: f"no route {request.method} {request.url.path}",
                   405: f"method {request.method} is not allowed on {request.url.path}"}
        headers = dict(error.headers or {})  # 405: Allow, the methods the route takes
        return APIError(error.status_code, message.get(error.status_code, str(error.detail)),
                        code={404: "not_found", 405: "method_not_allowed"}.get(error.status_code),
                        headers=headers or None).response()

    @app.exception_handler(Exception)
    async def internal_error(request: Request, error: Exception) -> JSONResponse:
        log.exception("internal error on %s", request.url.path)
        return APIError(500, f"internal error: {type(error).__name__}", code="internal_error").response()
