"""The FastAPI application: OpenAI-compatible routes over one engine.

`create_app(engine, ServerConfig(...))` returns an ASGI app; `vlmctl serve` runs it with uvicorn.
Routes: POST /v1/chat/completions, POST /v1/completions, GET /v1/models, GET /health, GET /metrics,
GET /version. Every error is OpenAI-shaped: `{"error": {"message", "type", "param", "code"}}`
(errors.py). This module only wires things together: the endpoints live in endpoints.py, the
middleware (API keys, body cap, access log) in middleware.py, logging and the periodic stats line
in logs.py; batching is the engine's, the media policy media.py's.
"""

from __future__ import annotations

import asyncio
import contextlib
import logging
from contextlib import asynccontextmanager
from dataclasses import dataclass, field
from pathlib import Path

from fastapi import FastAPI, Request
from fastapi.responses import Response

from . import schema as S
from .async_engine import AsyncEngine
from .endpoints import ServeContext, chat_completion, completion
from .errors import error_response, install_error_handlers
from .openai_request import check_model
from .logs import StatsReporter
from .media import MediaPolicy
from .metrics import ServerMetrics
from .middleware import AccessLogMiddleware, GuardMiddleware

log = logging.getLogger("vlmctl.serve")

DEFAULT_MAX_BODY_BYTES = 32 * 1024 * 1024


@dataclass
class ServerConfig:
    model_name: str | None = None  # default: the engine's name
    api_keys: list[str] = field(default_factory=list)
    max_body_bytes: int = DEFAULT_MAX_BODY_BYTES
    media: MediaPolicy = field(default_factory=MediaPolicy)
    log_requests_text: bool = False  # the access log shows prompt and output texts
    stats_interval_s: float = 10.0  # the periodic stats line while busy; 0: none


def create_app(engine, config: ServerConfig | None = None) -> FastAPI:
    config = config or ServerConfig()
    model_name = config.model_name or engine.model_name
    metrics = ServerMetrics(engine, model_name)
    aeng = AsyncEngine(engine, metrics)
    ctx = ServeContext(engine, aeng, config, model_name)

    @asynccontextmanager
    async def lifespan(app):
        aeng.start()
        log.info("engine ready: %s (max batch %d)", model_name, engine.limits.max_batch_size)
        if getattr(engine, "load_seconds", None):
            log.info("engine load phases (s): %s", ", ".join(f"{k} {v:.2f}" for k, v in engine.load_seconds.items()))
        stats = None
        if config.stats_interval_s > 0:
            stats = asyncio.ensure_future(StatsReporter(engine, config.stats_interval_s).run())
        try:
            yield
        finally:
            if stats is not None:
                stats.cancel()
                with contextlib.suppress(asyncio.CancelledError):
                    await stats
            await aeng.stop()

    app = FastAPI(title="vlmctl", lifespan=lifespan, docs_url=None, redoc_url=None, openapi_url=None)
    app.state.engine, app.state.async_engine, app.state.metrics = engine, aeng, metrics
    app.state.model_name = model_name
    # the last added runs first: the access log also sees what the guard refuses
    app.add_middleware(GuardMiddleware, api_keys=list(config.api_keys), max_body_bytes=config.max_body_bytes)
    app.add_middleware(AccessLogMiddleware, log_text=config.log_requests_text)
    install_error_handlers(app)

    @app.api_route("/health", methods=["GET", "HEAD"])
    async def health():
        if not aeng.alive:
            return error_response(503, "engine is not running", "service_unavailable", None, "engine_unavailable")
        return {"status": "ok", "model": model_name, "running": engine.num_running, "waiting": engine.num_waiting}

    @app.get("/version")
    async def version():
        from .. import __version__
        from .openai_fields import OPENAI_VERSION

        return S.VersionInfo(version=__version__, model=model_name, decoder_backend=engine.backend,
                             vision_backend=engine.vision.backend,
                             openai_fields_checked_against=OPENAI_VERSION).model_dump()

    @app.get("/metrics")
    async def prometheus():
        from prometheus_client import CONTENT_TYPE_LATEST

        return Response(metrics.render(), media_type=CONTENT_TYPE_LATEST)

    def model_card():  # `root` names the model, not the engine's directory on the server's disk
        return S.ModelCard(id=model_name, root=model_name, max_model_len=engine.limits.max_seq_len)

    @app.get("/v1/models")
    async def models():
        return S.ModelList(data=[model_card()]).model_dump()

    @app.get("/v1/models/{model:path}")
    async def model(model: str):
        check_model(S.ModelRef(model=model), model_name)
        return model_card().model_dump()

    @app.post("/v1/chat/completions")
    async def chat_completions(request: Request):
        return await chat_completion(ctx, request)

    @app.post("/v1/completions")
    async def completions(request: Request):
        return await completion(ctx, request)

    return app


def load_app(engine_dir: Path, config: ServerConfig | None = None, options=None, **option_overrides) -> FastAPI:
    """Load an engine directory and build the app (what `vlmctl serve` runs). `options` is an
    `EngineOptions`; keyword overrides set its fields (e.g. `max_batch_size=4`)."""
    from ..runtime.engine import Engine

    return create_app(Engine(engine_dir, options, **option_overrides), config)
