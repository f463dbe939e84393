"""An operable server: the access log (one line per request, no prompt text unless asked), the periodic
stats line, `--log-format json` for log shippers (checked on a real `vlmctl serve` process), and
`--max-images-per-request` above the built limit on the torch decoder (checked against transformers)."""

from __future__ import annotations

import json
import logging
import signal
import sys
import time

import httpx
import pytest

from test_serve import data_url, start_uvicorn
from conftest import serve_process
from tiny_models import make_image

openai = pytest.importorskip("openai")


class Lines(logging.Handler):
    def __init__(self):
        super().__init__()
        self.records: list[logging.LogRecord] = []

    def emit(self, record):
        self.records.append(record)


@pytest.fixture()
def access_lines():
    h = Lines()
    lg = logging.getLogger("vlmctl.access")
    lg.addHandler(h)
    old = lg.level
    lg.setLevel(logging.INFO)
    yield h.records
    lg.removeHandler(h)
    lg.setLevel(old)


def served(engine_dir, **config):
    from vlmctl.serve import ServerConfig, load_app

    app = load_app(engine_dir, ServerConfig(stats_interval_s=0, **config))
    return app, *start_uvicorn(app)


def wait_for(records, n, timeout=10.0):
    deadline = time.monotonic() + timeout
    while len(records) < n and time.monotonic() < deadline:
        time.sleep(0.02)
    return records


def test_access_log_one_line_per_request(tiny_llava_engine, access_lines):
    app, url, stop = served(tiny_llava_engine)
    try:
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0)
        secret = "my secret prompt text"
        r = client.chat.completions.create(model=app.state.model_name, messages=[{"role": "user", "content": secret}],
                                           max_tokens=5, temperature=0)
        chunks = list(client.completions.create(model=app.state.model_name, prompt=secret, max_tokens=4, n=2,
                                                temperature=1.0, seed=1, stream=True))
        bad = httpx.post(url + "/v1/chat/completions", json={"messages": [], "temprature": 1}, timeout=10)
        wait_for(access_lines, 3)
    finally:
        stop()
    assert bad.status_code == 400
    assert len(access_lines) == 3  # one per request, streamed or not, served or refused
    first, second, third = (rec.fields for rec in access_lines)
    assert first["id"] == r.id and first["status"] == 200 and first["path"] == "/v1/chat/completions"
    assert first["prompt_tokens"] == r.usage.prompt_tokens and first["completion_tokens"] == r.usage.completion_tokens
    assert 0 < first["ttft_s"] <= first["total_s"] and first["finish_reason"] == "length"
    assert second["id"] == chunks[0].id and second["choices"] == 2 and second["completion_tokens"] == 8
    assert third["status"] == 400 and "id" not in third
    for rec in access_lines:
        assert secret not in rec.getMessage() and secret not in json.dumps(rec.fields)
    assert f"id={r.id}" in access_lines[0].getMessage() and " 200 " in access_lines[0].getMessage()


def test_access_log_shows_texts_only_when_asked(tiny_llava_engine, access_lines):
    app, url, stop = served(tiny_llava_engine, log_requests_text=True)
    try:
        r = httpx.post(url + "/v1/completions", json={"prompt": "hello world", "max_tokens": 3, "temperature": 0},
                       timeout=30).json()
        wait_for(access_lines, 1)
    finally:
        stop()
    f = access_lines[0].fields
    assert f["prompt"] == ["<s> hello world"] or f["prompt"] == ["hello world"]
    assert f["output"] == [r["choices"][0]["text"]]


def test_stats_line_reports_work_and_stays_quiet_when_idle(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams
    from vlmctl.serve.logs import StatsReporter

    eng = Engine(tiny_llava_engine)
    rep = StatsReporter(eng, 10)
    assert rep.tick() is None  # nothing happened yet
    prompt = eng.encode([{"role": "user", "content": "a red square on a blue background. " * 4}], [])
    for _ in range(2):  # the second time the prompt's full blocks are in the prefix cache
        eng.generate([prompt], SamplingParams(max_tokens=6, temperature=0, ignore_eos=True))
    f = rep.tick()
    assert f["generation_tokens_per_s"] > 0 and f["prompt_tokens_per_s"] > 0
    assert f["running"] == 0 and f["waiting"] == 0
    assert f["kv_blocks_used"] + f["kv_blocks_free"] == eng.stats()["kv_blocks_total"]
    assert 0 < f["prefix_cache_hit_rate"] < 1  # the second copy of the prompt found the first's blocks
    assert f["feature_cache_hit_rate"] is None  # no image in the interval
    msg = StatsReporter.message(f)
    assert "generation tokens/s" in msg and "prefix cache hit rate" in msg and "KV blocks" in msg
    assert rep.tick() is None


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_json_logs_of_a_real_server(tiny_llava_engine, tmp_path):
    err = open(tmp_path / "serve.err", "w+")
    with serve_process(tiny_llava_engine, tmp_path, "--log-format", "json", "--stats-interval", "0.2",
                       err=err) as (proc, url):
        body = {"messages": [{"role": "user", "content": "tell me a story"}], "max_tokens": 200, "temperature": 0,
                "ignore_eos": True}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120).json()
        time.sleep(0.5)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    lines = [ln for ln in (tmp_path / "serve.err").read_text().splitlines() if ln.strip()]
    objs = [json.loads(ln) for ln in lines]  # every line is one JSON object
    assert all({"time", "level", "logger", "message"} <= set(o) for o in objs)
    access = [o for o in objs if o["logger"] == "vlmctl.access" and o.get("path") == "/v1/chat/completions"]
    assert len(access) == 1 and access[0]["id"] == r["id"] and access[0]["completion_tokens"] == 200
    stats = [o for o in objs if o["logger"] == "vlmctl.stats"]
    assert stats and all("generation_tokens_per_s" in o and "kv_blocks_free" in o for o in stats)
    assert any(o["logger"] == "vlmctl.serve" and "vlmctl serve" in o["message"] for o in objs)
    # where the load went, phase by phase (Engine.load_seconds)
    phases = [o["message"] for o in objs if o["message"].startswith("engine load phases")]
    assert len(phases) == 1, phases
    assert all(f"{name} " in phases[0] for name in ("processor", "decoder weights", "vision", "compile kernels",
                                                     "decode graphs", "prefill kernels", "warm steps")), phases


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("level, uvicorn_lines", [("debug", True), ("info", False)])
def test_uvicorn_access_lines_at_debug_only(tiny_llava_engine, tmp_path, level, uvicorn_lines):
    """docs/serving.md: at `--log-level debug` uvicorn's own access lines come beside vlmctl's; at info only
    vlmctl's. uvicorn removed its access logger's handler when started with access_log off, so at debug
    there were none."""
    err = open(tmp_path / "serve.err", "w+")
    with serve_process(tiny_llava_engine, tmp_path, "--log-level", level, "--stats-interval", "0",
                       err=err) as (proc, url):
        assert httpx.get(url + "/v1/models", timeout=30).status_code == 200
        time.sleep(0.3)
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    text = (tmp_path / "serve.err").read_text()
    assert ('"GET /v1/models HTTP/1.1" 200' in text) == uvicorn_lines, text[-1500:]
    assert "vlmctl.access: GET /v1/models 200" in text  # vlmctl's own line either way


def test_more_images_than_built_with_the_torch_decoder(tiny_llava, tiny_llava_engine):
    """The engine was built for 1 image a request; the torch decoder's prompt table is per request,
    so serving 2 works, and gives what transformers gives for the same two images."""
    from parity import strip_eos
    from test_llava_parity import hf_greedy

    from vlmctl.errors import LimitError
    from vlmctl.runtime.engine import Engine, EngineOptions
    from vlmctl.serve import ServerConfig, load_app

    assert json.loads((tiny_llava_engine / "build-llm" / "config.json").read_text())["limits"][
        "max_images_per_request"] == 1
    with pytest.raises(LimitError, match="max_input_len"):
        Engine(tiny_llava_engine, EngineOptions(max_images_per_request=5000))
    app = load_app(tiny_llava_engine, ServerConfig(stats_interval_s=0), max_images_per_request=2)
    url, stop = start_uvicorn(app)
    try:
        content = [{"type": "image_url", "image_url": {"url": data_url(s)}} for s in (1, 2)] + \
            [{"type": "text", "text": "what is in this image?"}]
        r = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": content}],
                                                           "max_tokens": 10, "temperature": 0, "logprobs": True},
                       timeout=60)
        three = httpx.post(url + "/v1/chat/completions", json={"messages": [{"role": "user", "content": [
            content[0], content[0], content[0], content[2]]}], "max_tokens": 2}, timeout=60)
    finally:
        stop()
    assert r.status_code == 200, r.text
    assert three.status_code == 400 and "at most 2" in three.json()["error"]["message"]
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "image"}, {"type": "text",
                                                                               "text": "what is in this image?"}]}]
    ref = strip_eos(hf_greedy(tiny_llava, msgs, [make_image(1), make_image(2)], 10), eos=2)
    tok = app.state.engine.tokenizer
    assert r.json()["choices"][0]["message"]["content"] == tok.decode(ref, skip_special_tokens=True)


def test_the_built_image_cap_stays_for_tensorrt_backends():
    from vlmctl.errors import LimitError
    from vlmctl.runtime.engine import _max_images

    assert _max_images(None, 1, "torch", "onnxruntime", 1024) == 1
    assert _max_images(3, 1, "torch", "onnxruntime", 1024) == 3
    assert _max_images(0, 1, "trtllm", "onnxruntime", 1024) == 0
    with pytest.raises(LimitError, match="TensorRT-LLM decoder's prompt table"):
        _max_images(2, 1, "trtllm", "onnxruntime", 1024)
    with pytest.raises(LimitError, match="TensorRT vision engine"):
        _max_images(2, 1, "torch", "tensorrt", 1024)


def test_log_lines_follow_stderr_when_it_is_swapped(monkeypatch):
    """The default handler writes to the stderr of the moment: swapping it (a redirect, a test harness)
    leaves no handler writing to a closed stream, and no line is lost."""
    import io

    from vlmctl.serve.logs import configure_logging

    first = io.StringIO()
    monkeypatch.setattr(sys, "stderr", first)
    handler = configure_logging("info", "text")
    try:
        logging.getLogger("vlmctl.serve").info("one")
        first.close()
        second = io.StringIO()
        monkeypatch.setattr(sys, "stderr", second)
        logging.getLogger("vlmctl.serve").info("two")
        assert second.getvalue().rstrip().endswith("two")
    finally:
        for name in ("vlmctl", "vlmctl.serve", "uvicorn", "uvicorn.error", "py.warnings", "transformers"):
            logging.getLogger(name).removeHandler(handler)
