"""`vlmctl serve` as a real process: SIGTERM stops accepting, lets the open stream finish, exits 0."""

from __future__ import annotations

import json
import signal
import sys
import threading
import time

import httpx
import pytest
from conftest import serve_process


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_sigterm_drains_open_stream_and_exits_zero(tiny_llava_engine, tmp_path):
    log = open(tmp_path / "serve.log", "w+")
    with serve_process(tiny_llava_engine, tmp_path, "--shutdown-timeout", "20", "--max-batch-size", "1",
                       "--log-level", "warning", log=log) as (proc, url):
        # One KV slot and three streams: two of them wait in the queue when SIGTERM arrives.
        first_chunk = threading.Event()
        results = [dict() for _ in range(3)]

        def stream(result):
            body = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 250,
                    "temperature": 0, "ignore_eos": True, "stream": True, "stream_options": {"include_usage": True}}
            chunks = []
            try:
                with httpx.stream("POST", url + "/v1/chat/completions", json=body, timeout=60) as r:
                    for line in r.iter_lines():
                        if line == "data: [DONE]":
                            result["done"] = True
                        elif line.startswith("data: "):
                            chunks.append((time.monotonic(), json.loads(line[6:])))
                            first_chunk.set()
            except Exception as e:  # reported below
                result["error"] = repr(e)
            finally:
                result["chunks"] = chunks

        threads = [threading.Thread(target=stream, args=(r,)) for r in results]
        for t in threads:
            t.start()
        assert first_chunk.wait(60)
        time.sleep(0.05)  # let the other two connect
        sigterm_at = time.monotonic()
        proc.send_signal(signal.SIGTERM)

        refused_while_streaming = False
        while time.monotonic() - sigterm_at < 10:
            try:
                httpx.get(url + "/health", timeout=1)
            except httpx.ConnectError:
                refused_while_streaming = any(t.is_alive() for t in threads)
                break
            except httpx.HTTPError:
                pass
            time.sleep(0.02)
        for t in threads:
            t.join(60)
            assert not t.is_alive()
        assert proc.wait(60) == 0, (tmp_path / "serve.log").read_text()[-2000:]
        assert refused_while_streaming, "new connections were still accepted during the drain"

        for result in results:
            assert "error" not in result, result.get("error")
            assert result.get("done"), "a stream was cut before [DONE]"
            chunks = result["chunks"]
            usage = [c["usage"] for _, c in chunks if c.get("usage")]
            finish = [c["choices"][0]["finish_reason"] for _, c in chunks if c["choices"] and
                      c["choices"][0]["finish_reason"]]
            assert usage and usage[0]["completion_tokens"] == 250 and finish == ["length"]
        assert sum(ts > sigterm_at for r in results for ts, _ in r["chunks"]) > 250, "little streamed after SIGTERM"
    log.close()
