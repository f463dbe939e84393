"""Benchmarks: an engine offline, or a running OpenAI-compatible server (`--url`).

Both modes send the same synthetic requests: one user message with `images_per_request` random
noise images of `image_size` and a text of `prompt_len` random words, asking for exactly
`output_len` tokens (`ignore_eos`), at most `concurrency` requests in flight. Reported per run:
request throughput, output tokens/s, and mean / median / p99 of time to first token (TTFT), time
per output token after the first (TPOT), inter-token latency (ITL) and end-to-end latency.

Offline, prompts are encoded (tokenizer + image preprocessing) before the clock starts; the vision
model runs inside the clock, in the engine step that admits a request. Against a server the
clock covers everything the client sees, and ITL is the gap between streamed chunks.
This module measures; it does not tune.
"""

from __future__ import annotations

import asyncio
import base64
import io
import json
import re
import time
from collections import deque
from dataclasses import asdict, dataclass, field

import numpy as np

from ..errors import InputError
from ..runtime.image_limits import ImageLimits
from ..progress import Progress, ensure

WORDS = ("the a picture image shows red blue green small large cat dog sky tree house car road person "
         "describe what is in this on of and with near under over left right top bottom color shape").split()


@dataclass
class BenchConfig:
    num_requests: int = 32
    concurrency: int = 8
    images_per_request: int = 1
    image_size: tuple[int, int] = (224, 224)
    prompt_len: int = 32  # words of text besides the images
    output_len: int = 64
    temperature: float = 0.0
    same_image: bool = False  # every request sends the same image(s): exercises the feature cache
    seed: int = 0
    run: int = 0  # mixed into the image seeds: runs against one server or engine don't share cached features
    warmup: int = 1  # requests run (and not counted) before the clock starts

    def validate(self) -> "BenchConfig":
        for name in ("num_requests", "concurrency", "output_len"):
            if getattr(self, name) < 1:
                raise InputError(f"{name.replace('_', '-')} must be at least 1")
        if self.images_per_request < 0 or self.prompt_len < 0 or self.warmup < 0:
            raise InputError("images, prompt length and warmup must be >= 0")
        if min(self.image_size) < 1:
            raise InputError(f"image size {self.image_size} must be positive")
        if not 0 <= self.seed < 2**63:  # numpy's seeds are non-negative; a server's seed is a 64-bit integer
            raise InputError(f"seed must be between 0 and 2**63 - 1 (got {self.seed})")
        # the requests' sampling parameters, checked here as the engine and a vlmctl server would check them
        _sampling_params(self).validate()
        # the images are made in memory before any engine sees them: the default limits, checked first
        ImageLimits().check(self.image_size, "image size")
        return self


@dataclass
class Sample:
    """What one request looked like from the caller's side (seconds, perf_counter clock)."""

    start: float
    token_times: list[float] = field(default_factory=list)
    prompt_tokens: int = 0
    output_tokens: int = 0
    error: str | None = None
    # a server stream: when it finished (finish_reason or [DONE]). A stream may carry no text at all
    # (tokens that decode to "", e.g. special tokens) and still be a completed request.
    end: float | None = None


def _sampling_params(cfg: BenchConfig):
    from ..runtime.sampling import SamplingParams

    return SamplingParams(max_tokens=cfg.output_len, temperature=cfg.temperature, seed=cfg.seed, ignore_eos=True)


# ---- synthetic requests ----------------------------------------------------------------------
def synthetic_requests(cfg: BenchConfig, n: int, offset: int = 0) -> list[tuple[list[dict], list]]:
    """n (messages, PIL images) pairs; deterministic in cfg.seed and the request index."""
    from PIL import Image

    out = []
    w, h = cfg.image_size
    for i in range(offset, offset + n):
        rng = np.random.default_rng([cfg.seed, i])
        images = []
        for k in range(cfg.images_per_request):
            img_rng = np.random.default_rng([cfg.seed, cfg.run, 0 if cfg.same_image else i, k, 7])
            images.append(Image.fromarray(img_rng.integers(0, 256, (h, w, 3), dtype=np.uint8), "RGB"))
        text = " ".join(rng.choice(WORDS, cfg.prompt_len)) if cfg.prompt_len else "describe"
        content = [{"type": "image"}] * len(images) + [{"type": "text", "text": text}]
        out.append(([{"role": "user", "content": content}], images))
    return out


def data_url(image) -> str:
    buf = io.BytesIO()
    image.save(buf, "PNG")
    return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()


# ---- statistics ------------------------------------------------------------------------------
def _stats(values: list[float]) -> dict:
    if not values:
        return {"mean": None, "median": None, "p99": None}
    a = np.asarray(values, dtype=np.float64) * 1000.0
    return {"mean": round(float(a.mean()), 3), "median": round(float(np.median(a)), 3),
            "p99": round(float(np.percentile(a, 99)), 3)}


def summarize(samples: list[Sample], duration: float) -> dict:
    ok = [s for s in samples if s.error is None and (s.token_times or s.end is not None)]
    # without text, the first sign of output is the end of the stream
    ttft = [(s.token_times[0] if s.token_times else s.end) - s.start for s in ok]
    e2e = [(s.end if s.end is not None else s.token_times[-1]) - s.start for s in ok]
    tpot = [(s.token_times[-1] - s.token_times[0]) / (s.output_tokens - 1) for s in ok
            if s.output_tokens > 1 and len(s.token_times) > 1]
    itl = [b - a for s in ok for a, b in zip(s.token_times, s.token_times[1:])]
    out_tokens = sum(s.output_tokens for s in ok)
    errors = [s.error for s in samples if s.error is not None]
    return {
        "completed": len(ok), "failed": len(samples) - len(ok), "errors": errors[:5],
        "duration_s": round(duration, 4),
        "request_throughput": round(len(ok) / duration, 4) if duration > 0 else None,
        "output_throughput": round(out_tokens / duration, 3) if duration > 0 else None,
        "total_output_tokens": out_tokens,
        "total_prompt_tokens": sum(s.prompt_tokens for s in ok),
        "mean_prompt_tokens": round(sum(s.prompt_tokens for s in ok) / len(ok), 2) if ok else None,
        "ttft_ms": _stats(ttft), "tpot_ms": _stats(tpot), "itl_ms": _stats(itl), "e2e_ms": _stats(e2e),
    }


# ---- offline ---------------------------------------------------------------------------------
def bench_engine(engine, cfg: BenchConfig, progress: Progress | None = None) -> dict:
    """Run cfg against an `Engine` in this thread (no other user of the engine at the same time)."""
    cfg.validate()
    progress = ensure(progress)
    params = _sampling_params(cfg).validate()
    if cfg.warmup:
        warm = [engine.encode(m, imgs) for m, imgs in synthetic_requests(cfg, cfg.warmup, offset=10**6)]
        engine.generate(warm, params)
    prompts = [engine.encode(m, imgs) for m, imgs in synthetic_requests(cfg, cfg.num_requests)]
    for p in prompts:
        engine.check_limits(p, params)

    task = progress.task(f"engine bench, concurrency {cfg.concurrency}", total=cfg.num_requests)
    pending = deque(range(cfg.num_requests))
    inflight: dict[str, int] = {}
    samples: list[Sample | None] = [None] * cfg.num_requests
    steps = batch_total = max_running = 0
    scheduler = getattr(engine, "scheduler", None)  # None for a TensorRT-LLM decoder (its own batching)
    preempted0 = scheduler.preemptions if scheduler is not None else 0
    t0 = time.perf_counter()
    while pending or inflight:
        while pending and len(inflight) < cfg.concurrency:
            i = pending.popleft()
            samples[i] = Sample(start=time.perf_counter(), prompt_tokens=len(prompts[i].token_ids))
            req = engine.submit(prompts[i], params, f"bench-{i}-{t0}")
            inflight[req.id] = i
        events = engine.step()
        now = time.perf_counter()
        if not events and not engine.has_work():
            raise RuntimeError("engine has requests in flight but no work")  # an engine bug, not input
        if events:
            n_req = len({ev.request.id for ev in events})
            steps += 1
            batch_total += n_req
            max_running = max(max_running, n_req)
        for ev in events:
            i = inflight[ev.request.id]
            if ev.error:
                samples[i].error = ev.error
            else:
                samples[i].token_times.append(now)
            if ev.finished:
                samples[i].output_tokens = len(ev.request.output_ids)
                del inflight[ev.request.id]
                task.advance()
    duration = time.perf_counter() - t0
    task.done()
    res = {"mode": "engine", "target": str(engine.engine_dir), "model": engine.model_name, "device": str(engine.device),
           "max_batch_size": engine.limits["max_batch_size"], "kv_cache_dtype": engine.kv_cache_dtype,
           "kv_cache_tokens": engine.limits["kv_cache_tokens"], "config": _cfg_json(cfg)}
    res.update(summarize(samples, duration))
    res.update({"max_running": max_running, "mean_batch_size": round(batch_total / steps, 3) if steps else None,
                "steps": steps,
                # requests whose KV blocks were taken back for others, to be recomputed (a full KV pool)
                "preemptions": scheduler.preemptions - preempted0 if scheduler is not None else None})
    return res


# ---- against a server ------------------------------------------------------------------------
def check_url(url: str) -> str:
    """`url` if it names an http(s) server; InputError otherwise (httpx would fail on it later, some ways
    with a traceback: a port above 65535 is an OverflowError inside the connect)."""
    from urllib.parse import urlsplit

    try:
        parts = urlsplit(url)
        parts.port  # noqa: B018 - raises ValueError when out of range
    except ValueError as e:
        raise InputError(f"--url {url!r}: {e}") from None
    if parts.scheme not in ("http", "https") or not parts.hostname:
        raise InputError(f"--url {url!r}: expected http://HOST:PORT or https://HOST:PORT")
    return url


def _base_url(url: str) -> str:
    url = url.rstrip("/")
    return url if url.endswith("/v1") else url + "/v1"


def _scrape(text: str, name: str) -> float | None:
    for line in text.splitlines():
        if line.startswith(name) and (len(line) == len(name) or line[len(name)] in " {"):
            try:
                return float(line.rsplit(" ", 1)[1])
            except ValueError:
                return None
    return None


def _buckets(text: str, name: str) -> dict[float, float]:
    """A Prometheus histogram's cumulative bucket counts: {le: count}."""
    out = {}
    for line in text.splitlines():
        if line.startswith(name + "_bucket{"):
            m = re.search(r'le="([^"]+)"', line)
            try:
                out[float(m.group(1))] = float(line.rsplit(" ", 1)[1])
            except (AttributeError, ValueError):
                continue
    return out


def _run_max_batch(before: str, after: str, concurrency: int) -> int | None:
    """The largest batch of this run, from a vlmctl server's /metrics before and after it. The gauge
    `vlmctl_num_requests_running_max` is the server's all-time maximum, so it is this run's only when the run
    raised it; otherwise the run's largest batch is at most that gauge, the concurrency, and the upper bound of
    the `vlmctl_batch_size` bucket (1, 2, 4, 8, ...) that holds all of this run's steps: the least of them
    (exact where the bounds leave one value, as at concurrency 3 or less; an upper bound elsewhere)."""
    gauge = "vlmctl_num_requests_running_max"
    g0, g1 = _scrape(before, gauge), _scrape(after, gauge)
    if g1 is None:
        return None  # not a vlmctl server
    if g0 is None or g1 > g0:
        return int(g1)
    hi = min(concurrency, g1)
    b0, b1 = _buckets(before, "vlmctl_batch_size"), _buckets(after, "vlmctl_batch_size")
    total = b1.get(float("inf"), 0) - b0.get(float("inf"), 0)
    if b1 and total <= 0:
        return None  # no step in this run (every request failed)
    for le in sorted(b1):
        if b1[le] - b0.get(le, 0) >= total:
            return int(min(hi, le))
    return int(hi)


async def _bench_url(url: str, cfg: BenchConfig, model: str | None, api_key: str | None, timeout_s: float,
                     progress: Progress) -> dict:
    import httpx

    base = _base_url(url)
    root = base[: -len("/v1")]
    headers = {"Authorization": f"Bearer {api_key}"} if api_key else {}
    limits = httpx.Limits(max_connections=cfg.concurrency + 4, max_keepalive_connections=cfg.concurrency + 4)
    async with httpx.AsyncClient(timeout=timeout_s, limits=limits, headers=headers) as client:
        try:
            if model is None:
                r = await client.get(f"{base}/models")
                r.raise_for_status()
                model = r.json()["data"][0]["id"]
        except (httpx.HTTPError, KeyError, IndexError, TypeError, ValueError) as e:  # TypeError: not a JSON object
            raise InputError(f"{base}/models: cannot list the server's models ({type(e).__name__}: {e})") from None

        def body(messages, images) -> dict:
            urls = iter(data_url(im) for im in images)
            content = [{"type": "image_url", "image_url": {"url": next(urls)}} if p["type"] == "image" else p
                       for p in messages[0]["content"]]
            return {"model": model, "messages": [{"role": "user", "content": content}], "stream": True,
                    "stream_options": {"include_usage": True}, "max_tokens": cfg.output_len,
                    "temperature": cfg.temperature, "seed": cfg.seed, "ignore_eos": True}

        async def one(b: dict) -> Sample:
            s = Sample(start=time.perf_counter())
            try:
                async with client.stream("POST", f"{base}/chat/completions", json=b) as r:
                    if r.status_code != 200:
                        s.error = f"HTTP {r.status_code}: {(await r.aread()).decode(errors='replace')[:300]}"
                        return s
                    async for line in r.aiter_lines():
                        if not line.startswith("data: "):
                            continue
                        data = line[6:]
                        if data == "[DONE]":
                            s.end = s.end or time.perf_counter()
                            break
                        obj = json.loads(data)
                        if "error" in obj:  # OpenAI's {"message": ...}; some servers send a bare string
                            err = obj["error"]
                            s.error = str(err.get("message", err) if isinstance(err, dict) else err)
                            return s
                        if obj.get("usage"):
                            s.prompt_tokens = obj["usage"]["prompt_tokens"]
                            s.output_tokens = obj["usage"]["completion_tokens"]
                        for ch in obj.get("choices") or []:
                            if (ch.get("delta") or {}).get("content"):
                                s.token_times.append(time.perf_counter())
                            if ch.get("finish_reason"):
                                s.end = time.perf_counter()
            except httpx.HTTPError as e:
                s.error = f"{type(e).__name__}: {e}"
            except (ValueError, KeyError, TypeError, AttributeError) as e:  # an event that is not OpenAI's shape
                s.error = f"malformed stream event ({type(e).__name__}: {e})"
            if s.error is None and s.end is None:
                s.error = "the stream ended without a finish_reason or [DONE]"
            if s.error is None and not s.output_tokens:
                s.output_tokens = len(s.token_times)  # server without include_usage
            return s

        warm = [body(m, imgs) for m, imgs in synthetic_requests(cfg, cfg.warmup, offset=10**6)]
        for b in warm:
            w = await one(b)
            if w.error:
                raise InputError(f"warm-up request failed: {w.error}")
        bodies = [body(m, imgs) for m, imgs in synthetic_requests(cfg, cfg.num_requests)]

        async def metrics_text() -> str:
            try:
                r = await client.get(f"{root}/metrics")
                return r.text if r.status_code == 200 else ""
            except httpx.HTTPError:
                return ""

        before = await metrics_text()
        task = progress.task(f"server bench, concurrency {cfg.concurrency}", total=cfg.num_requests)
        sem = asyncio.Semaphore(cfg.concurrency)

        async def limited(b):
            async with sem:
                s = await one(b)
                task.advance()
                return s

        t0 = time.perf_counter()
        samples = await asyncio.gather(*(limited(b) for b in bodies))
        duration = time.perf_counter() - t0
        task.done()
        after = await metrics_text()

    res = {"mode": "url", "target": base, "model": model, "config": _cfg_json(cfg)}
    res.update(summarize(list(samples), duration))
    # The server's own view of batching (vlmctl servers; absent elsewhere).
    n0, n1 = _scrape(before, "vlmctl_batch_size_count"), _scrape(after, "vlmctl_batch_size_count")
    s0, s1 = _scrape(before, "vlmctl_batch_size_sum"), _scrape(after, "vlmctl_batch_size_sum")
    res["max_running"] = _run_max_batch(before, after, cfg.concurrency)
    res["mean_batch_size"] = (round((s1 - s0) / (n1 - n0), 3) if None not in (n0, n1, s0, s1) and n1 > n0
                              else None)
    return res


def bench_url(url: str, cfg: BenchConfig, *, model: str | None = None, api_key: str | None = None,
              timeout_s: float = 600.0, progress: Progress | None = None) -> dict:
    """Run cfg against a server's /v1/chat/completions (streamed), from this process."""
    cfg.validate()
    return asyncio.run(_bench_url(url, cfg, model, api_key, timeout_s, ensure(progress)))


def _cfg_json(cfg: BenchConfig) -> dict:
    d = asdict(cfg)
    d["image_size"] = f"{cfg.image_size[0]}x{cfg.image_size[1]}"
    return d
