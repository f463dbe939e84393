"""OpenAI-shaped errors: `APIError`, the `{"error": {...}}` body, and the handlers that give every
failure of a route that shape with the right status (400 bad input, 404 unknown model or route,
503 engine gone, 500 otherwise). What it is not: the checks themselves (openai_request.py)."""

from __future__ import annotations

import logging

from fastapi import FastAPI
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InputError, LimitError, VlmctlError
from . import schema as S
from .async_engine import EngineUnavailable

log = logging.getLogger("vlmctl.serve")


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
    return JSONResponse(S.error_body(message, type_, param, code), status_code=status)


def validation_error(errs: list[dict]) -> APIError:
    """pydantic's errors -> one 400 naming the first field at fault."""
    first = errs[0] if errs else {}
    loc = [str(x) for x in first.get("loc", ()) if x != "body"]
    if first.get("type") == "json_invalid":
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    parts = []
    for e in errs[:5]:
        where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
        parts.append(f"{where}: {e.get('msg')}")
    return APIError(400, "; ".join(parts), param=".".join(loc) or None)


def install_error_handlers(app: FastAPI) -> None:
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        e = validation_error(exc.errors())
        return error_response(e.status, e.message, e.type, e.param, e.code)

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request, exc):
        return error_response(503, exc.message, "service_unavailable", None, "engine_unavailable")

    @app.exception_handler(VlmctlError)
    async def _vlmctl_error(request, exc: VlmctlError):
        if isinstance(exc, InputError):
            return error_response(400, exc.message, param=exc.param,
                                  code="limit_exceeded" if isinstance(exc, LimitError) else None)
        log.error("engine error: %s", exc.message)
        return error_response(500, exc.message, "internal_server_error")

    @app.exception_handler(StarletteHTTPException)
    async def _http_error(request, exc: StarletteHTTPException):
        return error_response(exc.status_code, str(exc.detail), "not_found" if exc.status_code == 404 else
                              "invalid_request_error")

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("internal error")
        return error_response(500, f"internal server error ({type(exc).__name__})", "internal_server_error")
