"""ASGI middleware of the server: the guard (API keys, body cap) and the access log.

`GuardMiddleware` answers 401 / 413 before any parsing. `AccessLogMiddleware` writes one line per
API request once its response is sent (streams included): method, path, status, and for
completions the request id, prompt and completion tokens, time to first token, total time and
finish reasons, which the route leaves in `request.state.access` (an `AccessInfo`). The prompt and
output texts are logged only when the server was started with --log-requests-text.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
import time
from dataclasses import dataclass, field

from .errors import error_response

access_log = logging.getLogger("vlmctl.access")


class GuardMiddleware:
    """401 for /v1/* without a valid `Authorization: Bearer KEY` (when keys are set); 413 for a
    request body over the cap, checked on Content-Length and on the bytes actually received."""

    DRAIN_S = 2.0

    def __init__(self, app, api_keys: list[str], max_body_bytes: int):
        self.app, self.api_keys, self.max_body = app, [k.encode() for k in api_keys], max_body_bytes

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http":
            return await self.app(scope, receive, send)
        headers = dict(scope.get("headers") or [])
        if self.api_keys and scope["path"].startswith("/v1"):
            auth = headers.get(b"authorization", b"")
            token = auth[7:].strip() if auth[:7].lower() == b"bearer " else b""
            if not any(hmac.compare_digest(token, k) for k in self.api_keys):
                resp = error_response(401, "invalid or missing API key (send Authorization: Bearer KEY)",
                                      "invalid_request_error", None, "invalid_api_key")
                return await resp(scope, receive, send)
        if scope["method"] not in ("POST", "PUT", "PATCH"):
            return await self.app(scope, receive, send)
        declared = headers.get(b"content-length")
        if declared is not None and declared.isdigit() and int(declared) > self.max_body:
            return await self._too_large(scope, receive, send, int(declared))
        # Read the body now (bounded), then replay it to the app.
        chunks, size, more = [], 0, True
        while more:
            msg = await receive()
            if msg["type"] == "http.disconnect":
                return
            chunk = msg.get("body", b"")
            size += len(chunk)
            if size > self.max_body:
                return await self._too_large(scope, receive, send, None)
            chunks.append(chunk)
            more = msg.get("more_body", False)
        body, replayed = b"".join(chunks), False

        async def replay():
            nonlocal replayed
            if not replayed:
                replayed = True
                return {"type": "http.request", "body": body, "more_body": False}
            return await receive()

        return await self.app(scope, replay, send)

    async def _too_large(self, scope, receive, send, size):
        # Read (and drop) what the client is still sending, for a bounded time: closing a socket
        # with unread data resets the connection, and the client would never see the 413.
        async def drain():
            while True:
                msg = await receive()
                if msg["type"] != "http.request" or not msg.get("more_body", False):
                    return

        try:
            await asyncio.wait_for(drain(), self.DRAIN_S)
        except asyncio.TimeoutError:
            pass
        what = f"{size} bytes" if size is not None else f"over {self.max_body} bytes"
        resp = error_response(413, f"request body is {what}; this server accepts at most {self.max_body} bytes",
                              "invalid_request_error", None, "request_too_large")
        resp.headers["connection"] = "close"
        await resp(scope, receive, send)


@dataclass
class AccessInfo:
    """What a completion route tells the access log about its request."""

    id: str
    requests: list = field(default_factory=list)  # the engine Requests of its choices


class AccessLogMiddleware:
    def __init__(self, app, log_text: bool = False):
        self.app, self.log_text = app, log_text

    async def __call__(self, scope, receive, send):
        if scope["type"] != "http" or not scope["path"].startswith("/v1/"):
            return await self.app(scope, receive, send)
        t0 = time.perf_counter()
        status = None

        async def send_status(msg):
            nonlocal status
            if msg["type"] == "http.response.start":
                status = msg["status"]
            await send(msg)

        try:
            await self.app(scope, receive, send_status)
        finally:
            try:
                self._log(scope, status or 500, t0)
            except Exception:  # a log line must never fail a request
                access_log.exception("access log failed")

    def _log(self, scope, status: int, t0: float) -> None:
        now = time.perf_counter()
        fields: dict = {"method": scope["method"], "path": scope["path"], "status": status}
        info = (scope.get("state") or {}).get("access")
        if isinstance(info, AccessInfo):
            reqs = info.requests
            fields["id"] = info.id
            if reqs:
                prompts = {id(r.prompt): r for r in reqs}
                fields["prompt_tokens"] = sum(r.prompt_len for r in prompts.values())
                fields["completion_tokens"] = sum(len(r.output_ids) for r in reqs)
                firsts = [r.first_token_time for r in reqs if r.first_token_time is not None]
                fields["ttft_s"] = round(min(firsts) - t0, 4) if firsts else None
                fields["total_s"] = round(now - t0, 4)
                fields["finish_reason"] = ",".join(dict.fromkeys(r.finish_reason or "abort" for r in reqs))
                if len(reqs) > 1:
                    fields["choices"] = len(reqs)
                if self.log_text:
                    fields["prompt"] = [r.prompt.text for r in prompts.values()]
                    fields["output"] = [r.text for r in reqs]
        fields.setdefault("total_s", round(now - t0, 4))
        msg = " ".join(f"{k}={_show(v)}" for k, v in fields.items() if k not in ("method", "path", "status"))
        access_log.info("%s %s %d %s", fields["method"], fields["path"], status, msg, extra={"fields": fields})


def _show(v) -> str:
    if v is None:
        return "-"
    if isinstance(v, float):
        return f"{v:.3f}s"
    if isinstance(v, (list, dict)):
        return json.dumps(v, ensure_ascii=False)
    return str(v)
