"""The bridge between the (synchronous, single-threaded) engine and the asyncio server.

One background thread owns `Engine.step()`: it runs steps while there is work and sleeps on an
event otherwise. Each request gets an asyncio queue; the thread hands every step's events to the
event loop in one `call_soon_threadsafe` call, and the loop routes them to the queues. A request
whose consumer goes away (client disconnect, cancellation) is aborted in the engine at once,
which frees its KV-cache slot at the start of the next step. This module is not a scheduler: the
engine decides admission and batching.
"""

from __future__ import annotations

import asyncio
import logging
import threading
import uuid
from concurrent.futures import ThreadPoolExecutor
from typing import AsyncIterator

from ..errors import RequestError, VlmctlError

log = logging.getLogger("vlmctl.serve")

VIDEO_DECODE_WORKERS = 2  # video requests whose videos decode at the same time


class EngineUnavailable(VlmctlError):
    """The engine thread stopped (shutdown) or crashed; the server answers 503."""


class _Failure:
    def __init__(self, exc: BaseException):
        self.exc = exc


def token_appended(ev, eos_ids) -> bool:
    """Whether the event's token became part of the output (an EOS/stop-id finish is not)."""
    if ev.error is not None:
        return False
    p = ev.request.params
    return not (ev.finished and ev.finish_reason == "stop" and not p.ignore_eos
                and (ev.token_id in eos_ids or ev.token_id in p.stop_token_ids))


class AsyncEngine:
    def __init__(self, engine, metrics=None, idle_wait_s: float = 0.5):
        self.engine = engine
        self.metrics = metrics
        self.idle_wait_s = idle_wait_s
        self._queues: dict[str, asyncio.Queue] = {}
        self._wake = threading.Event()
        self._stop = threading.Event()
        self._thread: threading.Thread | None = None
        self._loop: asyncio.AbstractEventLoop | None = None
        # Prompt encoding (tokenizer + image preprocessing) is CPU work kept off the event loop;
        # one worker keeps the tokenizer single-threaded on this side.
        self._encode_pool = ThreadPoolExecutor(1, thread_name_prefix="vlmctl-encode")
        # Video decoding (seconds for a long high-resolution video) has workers of its own, so that it
        # does not hold every other request's prompt encoding (it touches no tokenizer), and two of them, so
        # that one slow video does not hold the next video request either. Each decode's memory is bounded
        # by the video limits; more workers would multiply that and oversubscribe small hosts.
        self._video_pool = ThreadPoolExecutor(VIDEO_DECODE_WORKERS, thread_name_prefix="vlmctl-video")
        self.error: BaseException | None = None

    # ---- lifecycle ---------------------------------------------------------------------------
    def start(self) -> None:
        self._loop = asyncio.get_running_loop()
        self._thread = threading.Thread(target=self._run, name="vlmctl-engine", daemon=True)
        self._thread.start()

    @property
    def alive(self) -> bool:
        return self._thread is not None and self._thread.is_alive() and not self._stop.is_set()

    async def stop(self, timeout_s: float = 10.0) -> None:
        """Abort what is left, stop the step thread, fail any remaining consumers."""
        for rid in list(self._queues):
            self.engine.abort(rid)
        self._wake.set()
        self._stop.set()
        if self._thread is not None:
            await asyncio.to_thread(self._thread.join, timeout_s)
        for rid, q in list(self._queues.items()):
            q.put_nowait(_Failure(EngineUnavailable("the server is shutting down")))
        self._queues.clear()
        self._encode_pool.shutdown(wait=False, cancel_futures=True)
        self._video_pool.shutdown(wait=False, cancel_futures=True)

    def _run(self) -> None:
        eng = self.engine
        while not self._stop.is_set():
            self._wake.clear()
            if not eng.has_work():
                self._wake.wait(self.idle_wait_s)
                continue
            try:
                events = eng.step()
            except Exception as e:  # outside the engine's per-request boundaries: fail what runs, keep serving
                log.exception("engine step failed")
                self._loop.call_soon_threadsafe(self._fail_all, e)
                # Wait until the loop has aborted them, so the next step does not retry the same batch.
                done = threading.Event()
                self._loop.call_soon_threadsafe(done.set)
                done.wait(5)
                continue
            if events:
                if self.metrics is not None:
                    # requests, not events: an externally batched decoder can stream several tokens a step
                    self.metrics.batch.observe(len({ev.request.id for ev in events}))
                self._loop.call_soon_threadsafe(self._dispatch, events)
        log.debug("engine thread stopped")

    # ---- on the event loop -------------------------------------------------------------------
    def _dispatch(self, events) -> None:
        eos = self.engine.eos_ids
        n_tokens = 0
        for ev in events:
            if token_appended(ev, eos):
                n_tokens += 1
            q = self._queues.get(ev.request.id)
            if q is None:  # consumer already gone (abort in flight): counted once, as aborted, in `abort`
                continue
            if ev.finished and self.metrics is not None:
                self.metrics.on_finished(ev.request)
            # A request that failed alone (finish_reason "error") ends its own stream with an error.
            q.put_nowait(ev if ev.error is None else _Failure(RequestError(ev.error)))
            if ev.finished:
                del self._queues[ev.request.id]
        if self.metrics is not None and n_tokens:
            self.metrics.generation_tokens.inc(n_tokens)

    def _fail_all(self, exc: BaseException) -> None:
        for rid, q in list(self._queues.items()):
            self.engine.abort(rid)
            q.put_nowait(_Failure(exc))
        self._queues.clear()

    # ---- API ---------------------------------------------------------------------------------
    async def decode_videos(self, videos: list) -> list:
        """`engine.prepare_videos(videos)` on the video worker, off the event loop and the encode worker."""
        return await asyncio.get_running_loop().run_in_executor(self._video_pool,
                                                                lambda: self.engine.prepare_videos(videos))

    async def encode(self, fn, *args, **kwargs):
        """Run prompt encoding (`engine.encode`, `engine.encode_text`, `engine.compile_grammar`) on the
        encode worker, off the event loop."""
        return await asyncio.get_running_loop().run_in_executor(self._encode_pool, lambda: fn(*args, **kwargs))

    def submit(self, prompt, params, request_id: str | None = None) -> "RequestStream":
        """Queue a request; raises LimitError/InputError at once (before any response is sent)."""
        return self.submit_group([(prompt, params)], [request_id or uuid.uuid4().hex])

    def submit_group(self, jobs: list, request_ids: list[str]) -> "RequestStream":
        """Queue several requests (the choices of one HTTP request: n samples, several prompts) that
        share one stream. Jobs with the same prompt object after the first are its siblings (the
        scheduler admits them once the first one's prompt is in the prefix cache). All or nothing:
        when one is refused, those already queued are aborted and the error is raised."""
        if not self.alive:
            raise EngineUnavailable("the engine is not running (shutting down)")
        q: asyncio.Queue = asyncio.Queue()
        reqs, leaders = [], {}
        try:
            for (prompt, params), rid in zip(jobs, request_ids):
                self._queues[rid] = q
                req = self.engine.submit(prompt, params, rid, leader=leaders.get(id(prompt)))
                leaders.setdefault(id(prompt), req)
                reqs.append(req)
        except BaseException:
            for rid in request_ids:
                if self._queues.pop(rid, None) is not None:
                    self.engine.abort(rid)
            self._wake.set()
            raise
        if self.metrics is not None:
            self.metrics.prompt_tokens.inc(sum({id(r.prompt): r.prompt_len for r in reqs}.values()))
        self._wake.set()
        return RequestStream(self, reqs, q)

    def abort(self, request_id: str) -> None:
        if self._queues.pop(request_id, None) is not None:
            self.engine.abort(request_id)
            self._wake.set()
            if self.metrics is not None:
                self.metrics.aborted.inc()


class RequestStream:
    """Async iterator over the StepEvents of one or more requests (the choices of one HTTP request).
    Always close it (`async with`): a stream closed before every request's final event aborts the
    unfinished ones in the engine."""

    def __init__(self, owner: AsyncEngine, requests, queue: asyncio.Queue):
        self.owner, self.queue = owner, queue
        self.requests = list(requests)
        self._open = {r.id for r in self.requests}
        self.finished = False

    @property
    def request(self):
        """The first request (the only one of a single-choice stream)."""
        return self.requests[0]

    @property
    def id(self) -> str:
        return self.request.id

    async def __aenter__(self) -> "RequestStream":
        return self

    async def __aexit__(self, *exc) -> None:
        self.close()

    def close(self) -> None:
        if not self.finished:
            self.finished = True
            for rid in list(self._open):
                self.owner.abort(rid)
            self._open.clear()

    def __aiter__(self) -> AsyncIterator:
        return self._iter()

    async def _iter(self):
        async for batch in self.batches():
            for ev in batch:
                yield ev

    async def batches(self):
        """Yield lists of the events that are ready: one event when the consumer keeps up, several
        when it fell behind the engine (so a slow client costs fewer, larger stream chunks). Ends
        after every request's final event; a failed request raises its error."""
        while not self.finished:
            items = [await self.queue.get()]
            while not self.queue.empty():
                items.append(self.queue.get_nowait())
            batch = []
            for item in items:
                if isinstance(item, _Failure):
                    self.finished = True
                    if batch:
                        yield batch
                    for rid in list(self._open):  # the other choices of a failed request are aborted
                        self.owner.abort(rid)
                    self._open.clear()
                    raise item.exc
                batch.append(item)
                if item.finished:
                    self._open.discard(item.request.id)
                    if not self._open:
                        self.finished = True
                        break
            yield batch
