"""Running the choices of one response over a RequestStream: whole (non-streamed, aborted when the
client goes away) or as server-sent events, one SSE chunk per chunk choice, ending with `[DONE]`.

One driver serves both endpoints and any number of choices (n samples, several prompts): the
choice objects of render.py decide what each batch of events becomes. A failure after the stream
has started becomes an SSE error event (the status line is already sent). What it is not: request
parsing (openai_request.py) or rendering (render.py).
"""

from __future__ import annotations

import asyncio
import json
import logging

from fastapi import Request
from fastapi.responses import StreamingResponse
from starlette.background import BackgroundTask

from ..errors import VlmctlError
from . import schema as S
from .async_engine import EngineUnavailable, RequestStream
from .errors import APIError

log = logging.getLogger("vlmctl.serve")


def sse(obj) -> str:
    return f"data: {obj.model_dump_json() if hasattr(obj, 'model_dump_json') else json.dumps(obj)}\n\n"


async def collect(request: Request, stream: RequestStream, choices: dict) -> None:
    """Run a non-streamed response to its end, recording each request's events in its choice; abort
    it (499) if the client goes away first."""
    async def events():
        async for batch in stream.batches():
            for ev in batch:
                choices[ev.request.id].record([ev])

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
        work.result()


async def _errors_as_events(gen):
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


def sse_response(stream: RequestStream, choices: dict, chunk, first: list | None = None,
                 usage=None) -> StreamingResponse:
    """Stream `choices` (request id -> render.ChatChoice / CompletionChoice) as SSE. `chunk(parts)`
    wraps chunk choices into a chunk object; `first`: chunks sent before any token; `usage()`: the
    final usage-only chunk (stream_options.include_usage)."""
    async def gen():
        async with stream:
            for c in first or []:
                yield sse(c)
            async for evs in stream.batches():
                by_request: dict[str, list] = {}
                for ev in evs:
                    by_request.setdefault(ev.request.id, []).append(ev)
                for rid, group in by_request.items():
                    for part in choices[rid].delta(group):
                        yield sse(chunk([part]))
            if usage is not None:
                yield sse(usage())
        yield "data: [DONE]\n\n"

    # The background close is a safety net for a client that leaves before the body starts.
    return StreamingResponse(_errors_as_events(gen()), media_type="text/event-stream",
                             background=BackgroundTask(stream.close),
                             headers={"Cache-Control": "no-cache", "X-Accel-Buffering": "no"})
