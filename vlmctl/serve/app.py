"""The FastAPI application: OpenAI-compatible routes over one engine.

`create_app(engine, ServerConfig(...))` returns an ASGI app; `vlmctl serve` runs it with uvicorn.
Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics.
Every error is OpenAI-shaped: `{"error": {"message", "type", "param", "code"}}`. This module
translates HTTP to engine calls and back; batching lives in the engine, media policy in media.py.
"""

from __future__ import annotations

import asyncio
import hmac
import json
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.exceptions import RequestValidationError
from fastapi.responses import JSONResponse, Response, StreamingResponse
from starlette.background import BackgroundTask
from starlette.exceptions import HTTPException as StarletteHTTPException

from ..errors import InputError, LimitError, OptionError, VlmctlError
from ..runtime.sampling import SamplingParams
from . import schema as S
from .async_engine import AsyncEngine, EngineUnavailable, RequestStream, token_appended
from .media import MediaPolicy, load_image_url, load_video_url
from .metrics import ServerMetrics

log = logging.getLogger("vlmctl.serve")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class ServerConfig:
    model_name: str | None = None  # default: the engine's name
    api_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    media: MediaPolicy = field(default_factory=MediaPolicy)


class APIError(Exception):
    def __init__(self, status: int, message: str, type_: str = "invalid_request_error", param: str | None = None,
                 code: str | None = None):
        super().__init__(message)
        self.status, self.message, self.type, self.param, self.code = status, message, type_, param, code


def error_response(status: int, message: str, type_: str = "invalid_request_error", param=None, code=None):
    return JSONResponse(S.error_body(message, type_, param, code), status_code=status)


# ---- ASGI middleware: API keys and the body cap (before any parsing) ---------------------------
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


# ---- the app ---------------------------------------------------------------------------------
def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    model_name = config.model_name or engine.model_name
    metrics = ServerMetrics(engine, model_name)
    aeng = AsyncEngine(engine, metrics)

    @asynccontextmanager
    async def lifespan(app):
        aeng.start()
        log.info("engine ready: %s (max batch %d)", model_name, engine.limits["max_batch_size"])
        try:
            yield
        finally:
            await aeng.stop()

    app = FastAPI(title="vlmctl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.async_engine, app.state.metrics = engine, aeng, metrics
    app.state.model_name = model_name
    app.add_middleware(GuardMiddleware, api_keys=list(config.api_keys), max_body_bytes=config.max_body_bytes)

    # ---- errors --------------------------------------------------------------------------
    @app.exception_handler(APIError)
    async def _api_error(request, exc: APIError):
        return error_response(exc.status, exc.message, exc.type, exc.param, exc.code)

    @app.exception_handler(RequestValidationError)
    async def _validation_error(request, exc: RequestValidationError):
        errs = exc.errors()
        first = errs[0] if errs else {}
        loc = [str(x) for x in first.get("loc", ()) if x != "body"]
        if first.get("type") == "json_invalid":
            msg = f"malformed JSON body: {first.get('ctx', {}).get('error', first.get('msg'))}"
            return error_response(400, msg)
        parts = []
        for e in errs[:5]:
            where = ".".join(str(x) for x in e.get("loc", ()) if x != "body") or "body"
            parts.append(f"{where}: {e.get('msg')}")
        return error_response(400, "; ".join(parts), param=".".join(loc) or None)

    @app.exception_handler(EngineUnavailable)
    async def _unavailable(request, exc):
        return error_response(503, exc.message, "service_unavailable", None, "engine_unavailable")

    @app.exception_handler(VlmctlError)
    async def _vlmctl_error(request, exc: VlmctlError):
        if isinstance(exc, InputError):
            return error_response(400, exc.message, code="limit_exceeded" if isinstance(exc, LimitError) else None)
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

    # ---- helpers -------------------------------------------------------------------------
    def check_common(body: S.SamplingFields) -> None:
        if body.model is not None and body.model != model_name:
            raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                           "not_found_error", "model", "model_not_found")
        if body.n not in (None, 1):
            raise APIError(400, f"n={body.n} is not supported; only n=1 (send several requests instead)",
                           param="n")
        for name in ("presence_penalty", "frequency_penalty"):
            if getattr(body, name):
                raise APIError(400, f"{name} is not supported by this server (only 0)", param=name)
        if body.logit_bias:
            raise APIError(400, "logit_bias is not supported by this server", param="logit_bias")
        if body.tools:
            raise APIError(400, "tools (function calling) are not supported by this server", param="tools")
        if body.response_format and body.response_format.get("type", "text") != "text":
            raise APIError(400, f"response_format {body.response_format.get('type')!r} is not supported (only "
                                "'text')", param="response_format")
        if body.best_of not in (None, 1):
            raise APIError(400, "best_of is not supported by this server (only 1)", param="best_of")

    def sampling(body: S.SamplingFields, prompt_len: int, max_tokens: int | None, logprobs: int | None):
        if max_tokens is None:
            room = engine.limits.max_seq_len - prompt_len
            max_tokens = max(1, min(engine.limits["max_output_len"], room))
        return SamplingParams(
            max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
            top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed,
            stop=body.stop_list(), stop_token_ids=list(body.stop_token_ids or []), ignore_eos=body.ignore_eos,
            logprobs=logprobs).validate()

    def token_str(tid: int) -> str:
        return engine.tokenizer.decode([tid])

    def chat_logprob(ev) -> S.TokenLogprob:
        tok = token_str(ev.token_id)
        tops = [S.TopLogprob(token=(t := token_str(i)), logprob=lp, bytes=list(t.encode()))
                for i, lp in (ev.top_logprobs or [])]
        return S.TokenLogprob(token=tok, logprob=ev.logprob, bytes=list(tok.encode()), top_logprobs=tops)

    def usage_of(req) -> S.Usage:
        n = len(req.output_ids)
        return S.Usage(prompt_tokens=req.prompt_len, completion_tokens=n, total_tokens=req.prompt_len + n)

    async def collect(request: Request, stream: RequestStream) -> list:
        """All events of a non-streamed request; abort it if the client goes away first."""
        async def events():
            return [ev async for ev in stream]

        async def disconnected():
            while True:
                msg = await request.receive()
                if msg["type"] == "http.disconnect":
                    return

        async with stream:
            work = asyncio.ensure_future(events())
            watch = asyncio.ensure_future(disconnected())
            try:
                done, _ = await asyncio.wait({work, watch}, return_when=asyncio.FIRST_COMPLETED)
            finally:
                watch.cancel()
                if not work.done():
                    work.cancel()
            if work not in done:
                raise APIError(499, "client disconnected")
            return work.result()

    def sse(obj) -> str:
        return f"data: {obj.model_dump_json() if hasattr(obj, 'model_dump_json') else json.dumps(obj)}\n\n"

    def sse_response(gen, stream: RequestStream) -> StreamingResponse:
        # The background close is a safety net for a client that leaves before the body starts.
        return StreamingResponse(gen, media_type="text/event-stream", background=BackgroundTask(stream.close),
                                 headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})

    async def stream_errors(gen):
        """Turn a failure after the response started into an SSE error event."""
        try:
            async for item in gen:
                yield item
        except VlmctlError as e:
            yield sse(S.error_body(e.message, "service_unavailable" if isinstance(e, EngineUnavailable)
                                   else "internal_server_error"))
            yield "data: [DONE]\n\n"
        except Exception as e:
            log.exception("stream failed")
            yield sse(S.error_body(f"internal server error ({type(e).__name__})", "internal_server_error"))
            yield "data: [DONE]\n\n"

    # ---- routes --------------------------------------------------------------------------
    @app.get("/health")
    async def health():
        if not aeng.alive:
            return error_response(503, "engine is not running", "service_unavailable", None, "engine_unavailable")
        return {"status": "ok", "model": model_name, "running": engine.num_running, "waiting": engine.num_waiting}

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    @app.get("/v1/models")
    async def models():
        card = S.ModelCard(id=model_name, root=str(engine.engine_dir), max_model_len=engine.limits.max_seq_len)
        return S.ModelList(data=[card]).model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(body: S.ChatCompletionRequest, request: Request):
        check_common(body)
        if body.top_logprobs is not None and not body.logprobs:
            raise APIError(400, "top_logprobs needs logprobs=true", param="top_logprobs")
        messages, urls, video_urls = [], [], []
        for m in body.messages:
            role = "system" if m.role == "developer" else m.role
            if m.content is None or isinstance(m.content, str):
                messages.append({"role": role, "content": m.content or ""})
                continue
            parts = []
            for p in m.content:
                if isinstance(p, S.ImageURLPart):
                    urls.append(p.image_url.url)
                    parts.append({"type": "image"})
                elif isinstance(p, S.VideoURLPart):
                    video_urls.append(p.video_url.url)
                    parts.append({"type": "video"})
                else:
                    parts.append({"type": "text", "text": p.text})
            messages.append({"role": role, "content": parts})
        limit = engine.limits["max_images_per_request"]
        if len(urls) > limit:
            raise APIError(400, f"{len(urls)} images in one request; this engine accepts at most {limit}",
                           param="messages", code="limit_exceeded")
        if video_urls:  # refused before anything is fetched
            if not engine.family.video:
                raise APIError(400, f"this model ({engine.family.name}) takes no video input", param="messages")
            vlimit = engine.video_limits.max_videos_per_request
            if len(video_urls) > vlimit:
                raise APIError(400, f"{len(video_urls)} videos in one request; this engine accepts at most {vlimit}",
                               param="messages", code="limit_exceeded")
        images = await asyncio.gather(*(load_image_url(u, config.media, f"image {i + 1}")
                                        for i, u in enumerate(urls)))
        videos = await asyncio.gather(*(load_video_url(u, config.media, f"video {i + 1}")
                                        for i, u in enumerate(video_urls)))
        prompt = await aeng.encode(engine.encode, messages, list(images), list(videos))
        lp = (body.top_logprobs or 0) if body.logprobs else None
        params = sampling(body, len(prompt.token_ids), body.max_completion_tokens or body.max_tokens, lp)
        rid = S.new_id("chatcmpl")
        stream = aeng.submit(prompt, params, rid)

        if not body.stream:
            events = await collect(request, stream)
            req = stream.request
            logprobs = None
            if body.logprobs:
                logprobs = S.ChoiceLogprobs(content=[chat_logprob(ev) for ev in events
                                                     if token_appended(ev, engine.eos_ids)])
            choice = S.ChatChoice(message=S.AssistantMessage(content=req.text), logprobs=logprobs,
                                  finish_reason=req.finish_reason)
            return JSONResponse(S.ChatCompletionResponse(id=rid, model=model_name, choices=[choice],
                                                         usage=usage_of(req)).model_dump())

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def gen():
            async with stream:
                yield sse(S.ChatCompletionChunk(id=rid, model=model_name, choices=[
                    S.ChatChunkChoice(delta=S.DeltaMessage(role="assistant", content=""))]))
                async for evs in stream.batches():
                    last, delta = evs[-1], "".join(ev.text_delta for ev in evs)
                    lps = None
                    if body.logprobs:
                        entries = [chat_logprob(ev) for ev in evs if token_appended(ev, engine.eos_ids)]
                        lps = S.ChoiceLogprobs(content=entries) if entries else None
                    if not delta and lps is None and not last.finished:
                        continue  # held-back tokens (partial UTF-8 or stop-string prefix)
                    choice = S.ChatChunkChoice(delta=S.DeltaMessage(content=delta or None), logprobs=lps,
                                               finish_reason=last.finish_reason if last.finished else None)
                    yield sse(S.ChatCompletionChunk(id=rid, model=model_name, choices=[choice]))
                if include_usage:
                    yield sse(S.ChatCompletionChunk(id=rid, model=model_name, choices=[],
                                                    usage=usage_of(stream.request)))
            yield "data: [DONE]\n\n"

        return sse_response(stream_errors(gen()), stream)

    @app.post("/v1/completions")
    async def completions(body: S.CompletionRequest, request: Request):
        check_common(body)
        if body.echo:
            raise APIError(400, "echo is not supported by this server", param="echo")
        if body.suffix:
            raise APIError(400, "suffix is not supported by this server", param="suffix")
        prompts = [body.prompt] if isinstance(body.prompt, str) else body.prompt
        if len(prompts) != 1:
            raise APIError(400, f"{len(prompts)} prompts in one request; send one prompt per request (the server "
                                "batches concurrent requests itself)", param="prompt")
        prompt = await aeng.encode(engine.encode_text, prompts[0])
        params = sampling(body, len(prompt.token_ids), body.max_tokens, body.logprobs)
        rid = S.new_id("cmpl")
        stream = aeng.submit(prompt, params, rid)

        def add_logprobs(lp: S.CompletionLogprobs, ev, offset: int) -> None:
            lp.tokens.append(token_str(ev.token_id))
            lp.token_logprobs.append(ev.logprob)
            lp.text_offset.append(offset)
            if body.logprobs:
                lp.top_logprobs = lp.top_logprobs or []
                lp.top_logprobs.append({token_str(i): v for i, v in (ev.top_logprobs or [])})

        if not body.stream:
            events = await collect(request, stream)
            req = stream.request
            logprobs = None
            if body.logprobs is not None:
                logprobs, offset = S.CompletionLogprobs(), 0
                for ev in events:
                    if token_appended(ev, engine.eos_ids):
                        add_logprobs(logprobs, ev, offset)
                        offset += len(logprobs.tokens[-1])
            choice = S.CompletionChoice(text=req.text, logprobs=logprobs, finish_reason=req.finish_reason)
            return JSONResponse(S.CompletionResponse(id=rid, model=model_name, choices=[choice],
                                                     usage=usage_of(req)).model_dump())

        include_usage = bool(body.stream_options and body.stream_options.include_usage)

        async def gen():
            offset = 0
            async with stream:
                async for evs in stream.batches():
                    last, lp = evs[-1], None
                    if body.logprobs is not None:
                        lp = S.CompletionLogprobs()
                        for ev in evs:
                            if token_appended(ev, engine.eos_ids):
                                add_logprobs(lp, ev, offset)
                            offset += len(ev.text_delta)
                        lp = lp if lp.tokens else None
                    delta = "".join(ev.text_delta for ev in evs)
                    if not delta and lp is None and not last.finished:
                        continue
                    choice = S.CompletionChoice(text=delta, logprobs=lp,
                                                finish_reason=last.finish_reason if last.finished else None)
                    yield sse(S.CompletionResponse(id=rid, model=model_name, choices=[choice]))
                if include_usage:
                    yield sse(S.CompletionResponse(id=rid, model=model_name, choices=[],
                                                   usage=usage_of(stream.request)))
            yield "data: [DONE]\n\n"

        return sse_response(stream_errors(gen()), stream)

    return app


def load_app(engine_dir: Path, config: ServerConfig | None = None, options=None, **option_overrides) -> FastAPI:
    """Load an engine directory and build the app (what `vlmctl serve` runs). `options` is an
    `EngineOptions`; keyword overrides set its fields (e.g. `max_batch_size=4`)."""
    from ..runtime.engine import Engine

    return create_app(Engine(engine_dir, options, **option_overrides), config)
