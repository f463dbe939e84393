"""Logging of `vlmctl serve`: one handler for vlmctl's and uvicorn's loggers, writing text lines or
(`--log-format json`) one JSON object per line for log shippers; and the periodic stats line.

A JSON line has `time` (UTC, ISO 8601), `level`, `logger`, `message`, and the record's structured
`fields` when it has them (the access log's: method, path, status, id, tokens, timings; the stats
line's: throughputs, queue, KV cache and hit rates), so a shipper need not parse the message.
What it is not: the access-log middleware (middleware.py) or the Prometheus metrics (metrics.py).
"""

from __future__ import annotations

import asyncio
import json
import logging
import sys
import time
from datetime import datetime, timezone

LEVELS = {"critical": logging.CRITICAL, "error": logging.ERROR, "warning": logging.WARNING, "info": logging.INFO,
          "debug": logging.DEBUG, "trace": 5}  # uvicorn's TRACE
FORMATS = ("text", "json")
TEXT_FORMAT = "%(asctime)s %(levelname)s %(name)s: %(message)s"
# uvicorn.access is replaced by vlmctl's access log (one line per request with tokens and timings)
LOGGERS = ("vlmctl", "uvicorn", "uvicorn.error")

stats_log = logging.getLogger("vlmctl.stats")


class JsonFormatter(logging.Formatter):
    def format(self, record: logging.LogRecord) -> str:
        out = {"time": datetime.fromtimestamp(record.created, timezone.utc).isoformat(timespec="milliseconds"),
               "level": record.levelname, "logger": record.name, "message": record.getMessage()}
        fields = getattr(record, "fields", None)
        if isinstance(fields, dict):
            out.update({k: v for k, v in fields.items() if k not in out})
        if record.exc_info:
            out["exception"] = self.formatException(record.exc_info)
        return json.dumps(out, ensure_ascii=False, default=str)


_handler: logging.Handler | None = None


class _StderrHandler(logging.StreamHandler):
    """Writes to whatever `sys.stderr` is when a record is emitted, not the object it was at
    configuration time: a harness or a caller that swaps stderr (pytest's capture, a redirect) would
    otherwise leave the handler writing to a closed stream, and the lines would be lost."""

    def __init__(self):
        super().__init__(sys.stderr)

    @property
    def stream(self):
        return sys.stderr

    @stream.setter
    def stream(self, value):  # StreamHandler.__init__ and setStream assign it; stderr is read at emit
        pass


def configure_logging(level: str = "info", fmt: str = "text", stream=None) -> logging.Handler:
    """Route vlmctl's and uvicorn's loggers to one stderr handler in `fmt`; idempotent (a second
    call replaces the first one's handler)."""
    global _handler
    if fmt not in FORMATS:
        raise ValueError(f"log format {fmt!r}: expected one of {', '.join(FORMATS)}")
    handler = logging.StreamHandler(stream) if stream is not None else _StderrHandler()
    handler.setFormatter(JsonFormatter() if fmt == "json" else logging.Formatter(TEXT_FORMAT))
    lvl = LEVELS[level.lower()]
    names = LOGGERS + (("uvicorn.access",) if lvl <= logging.DEBUG else ())
    for name in LOGGERS + ("uvicorn.access",):
        lg = logging.getLogger(name)
        if _handler is not None and _handler in lg.handlers:
            lg.removeHandler(_handler)
        lg.disabled = name not in names
        if name in names:
            lg.addHandler(handler)
            lg.setLevel(lvl)
            lg.propagate = False
    # what libraries print through their own loggers (transformers' warnings) or `warnings` joins the
    # same stream in the same format, so a JSON log stays one object per line
    logging.captureWarnings(True)
    for name in ("py.warnings", "transformers"):
        lg = logging.getLogger(name)
        for h in list(lg.handlers):
            lg.removeHandler(h)
        lg.addHandler(handler)
        lg.propagate = False
    _handler = handler
    return handler


def _rate(hits: float, total: float) -> float | None:
    return round(hits / total, 4) if total > 0 else None


class StatsReporter:
    """Every `interval_s` seconds while the engine is busy (or was since the last line), one line:
    prompt and generation tokens/s over the interval, running and waiting requests, KV blocks used
    and free, and the interval's prefix-cache and image-feature-cache hit rates."""

    def __init__(self, engine, interval_s: float = 10.0):
        self.engine, self.interval_s = engine, interval_s
        self._last = self._snapshot()

    def _snapshot(self) -> tuple[float, dict]:
        return time.perf_counter(), dict(self.engine.stats())

    def tick(self) -> dict | None:
        """The fields of the line for the time since the last tick, or None when there was nothing to say."""
        (t0, a), (t1, b) = self._last, self._snapshot()
        self._last = (t1, b)
        dt = max(t1 - t0, 1e-9)

        def d(key: str) -> float:
            return float(b.get(key, 0) - a.get(key, 0))

        busy = b["running"] or b["waiting"] or d("tokens_generated") or d("prompt_tokens_computed")
        if not busy:
            return None
        out = {"prompt_tokens_per_s": round(d("prompt_tokens_computed") / dt, 2),
               "generation_tokens_per_s": round(d("tokens_generated") / dt, 2),
               "running": b["running"], "waiting": b["waiting"]}
        if "kv_blocks_total" in b:
            out.update(kv_blocks_used=b["kv_blocks_used"], kv_blocks_free=b["kv_blocks_free"],
                       prefix_cache_hit_rate=_rate(d("prefix_cache_hit_tokens"), d("prefix_cache_queried_tokens")))
        out["feature_cache_hit_rate"] = _rate(d("feature_cache_hits"),
                                              d("feature_cache_hits") + d("feature_cache_misses"))
        return out

    @staticmethod
    def message(f: dict) -> str:
        def pct(v):
            return "n/a" if v is None else f"{100 * v:.1f}%"

        parts = [f"{f['prompt_tokens_per_s']:.1f} prompt tokens/s, {f['generation_tokens_per_s']:.1f} generation "
                 f"tokens/s", f"running {f['running']}, waiting {f['waiting']}"]
        if "kv_blocks_used" in f:
            total = f["kv_blocks_used"] + f["kv_blocks_free"]
            parts.append(f"KV blocks {f['kv_blocks_used']} used / {f['kv_blocks_free']} free "
                         f"({100 * f['kv_blocks_used'] / max(total, 1):.1f}% used)")
            parts.append(f"prefix cache hit rate {pct(f['prefix_cache_hit_rate'])}")
        parts.append(f"image feature cache hit rate {pct(f['feature_cache_hit_rate'])}")
        return "; ".join(parts)

    async def run(self) -> None:
        while True:
            await asyncio.sleep(self.interval_s)
            try:
                f = self.tick()
                if f is not None:
                    stats_log.info("%s", self.message(f), extra={"fields": f})
            except Exception:  # a stats line must never stop the server
                stats_log.exception("stats line failed")
