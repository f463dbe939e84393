"""OpenAI-shaped errors: `APIError`, the `{"error": {...}}` body, and the handlers that give every
failure of a route that shape with the right status (400 bad input, 404 unknown model or route,
503 engine gone, 500 otherwise). What it is not: the checks themselves (openai_request.py)."""

from __future__ import annotations

import logging
import re

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


def _field_path(loc) -> str:
    """pydantic's error location as the request's own path, e.g. `messages[0].content[0].text`: list
    indexes in brackets, without the union branches pydantic adds (`function-after[...]`, `list[...]`)
    or the tag value it adds after a tagged union's member."""
    out, after_tagged = "", False
    for x in loc:
        if x == "body":
            continue
        if isinstance(x, int):
            out += f"[{x}]"
            continue
        if not re.fullmatch(r"[A-Za-z_][A-Za-z0-9_]*", x) or x in _TYPE_NAMES or x[:1].isupper():
            after_tagged = after_tagged or "tagged-union[" in x
            continue
        if after_tagged:  # the member's tag value (e.g. "text"), not a field
            after_tagged = False
            continue
        out += f".{x}" if out else x
    return out


# names pydantic gives union branches of plain types
_TYPE_NAMES = {"str", "int", "float", "bool", "dict", "list", "none", "tuple"}


def validation_error(errs: list[dict]) -> APIError:
    """pydantic's errors -> one 400 naming the field at fault. A union reports one error per branch: the
    deepest path is the branch the value was meant for (a content list, not the string it is not); where
    branches end at the same path, their complaints are joined ("a valid string, or a valid list")."""
    if not errs:
        return APIError(400, "the request body does not match the API's schema")
    if errs[0].get("type") == "json_invalid":
        first = errs[0]
        return APIError(400, f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}")
    paths = [_field_path(e.get("loc", ())) for e in errs]
    depth = [p.count(".") + p.count("[") for p in paths]
    best = max(range(len(errs)), key=lambda i: (depth[i], -i))
    where = paths[best]
    here = [e for p, e in zip(paths, errs) if p == where]
    # a branch whose type fits but whose value does not (a string with a lone surrogate) says more than
    # the branches of other types
    fitting = [e for e in here if not str(e.get("type", "")).endswith("_type")]
    msgs = []
    for e in fitting or here:
        m = str(e.get("msg")).removeprefix("Value error, ")
        if m not in msgs:
            msgs.append(m)
    msg = msgs[0]
    for m in msgs[1:]:
        msg += ", or " + m.removeprefix("Input should be ") if m.startswith("Input should be ") else f"; {m}"
    return APIError(400, f"{where or 'body'}: {msg}", param=where or None)


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
        # OpenAI answers an unknown route as it does an unknown model: invalid_request_error; a 405 keeps
        # starlette's Allow header
        resp = error_response(exc.status_code, str(exc.detail))
        resp.headers.update(exc.headers or {})
        return resp

    @app.exception_handler(Exception)
    async def _internal(request, exc: Exception):
        log.exception("internal error")
        return error_response(500, f"internal server error ({type(exc).__name__})", "internal_server_error")
