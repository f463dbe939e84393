"""`vlmctl serve`: a real uvicorn server on 127.0.0.1 with the tiny LLaVA engine, driven by the official
`openai` client (and raw httpx where the client would hide the HTTP details)."""

from __future__ import annotations

import asyncio
import base64
import http.server
import io
import re
import socket
import threading
import time
from dataclasses import dataclass
from pathlib import Path

import httpx
import pytest

from conftest import cli_json
from tiny_models import make_image

KEY = "sk-test-key"
BODY_CAP = 512 * 1024
MAX_BATCH = 4  # the built limit: serve may lower it, never raise it


@dataclass
class Srv:
    url: str  # http://127.0.0.1:PORT
    app: object
    media_dir: Path
    image_server: str  # http://127.0.0.1:PORT of a local image host (an allowed media domain)

    @property
    def v1(self) -> str:
        return self.url + "/v1"

    def post(self, path: str, timeout: float = 60, **kw) -> httpx.Response:
        headers = {"Authorization": f"Bearer {KEY}", **kw.pop("headers", {})}
        return httpx.post(self.v1 + path, headers=headers, timeout=timeout, **kw)

    def metric(self, name: str) -> float:
        text = httpx.get(self.url + "/metrics", timeout=10).text
        for line in text.splitlines():
            if line.startswith(name) and line[len(name)] in " {":
                return float(line.rsplit(" ", 1)[1])
        raise AssertionError(f"metric {name} not found")


def png_bytes(seed: int, size=(40, 30)) -> bytes:
    buf = io.BytesIO()
    make_image(seed, size).save(buf, "PNG")
    return buf.getvalue()


def data_url(seed: int, size=(40, 30)) -> str:
    return "data:image/png;base64," + base64.b64encode(png_bytes(seed, size)).decode()


def image_message(url: str, text: str = "what is in this image?") -> list[dict]:
    return [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": url}},
                                         {"type": "text", "text": text}]}]


def start_uvicorn(app, timeout_s: float = 120):
    """Serve `app` on a pre-bound 127.0.0.1 socket in a thread; returns (url, stop)."""
    import uvicorn

    sock = socket.socket(socket.AF_INET, socket.SOCK_STREAM)
    sock.setsockopt(socket.SOL_SOCKET, socket.SO_REUSEADDR, 1)
    sock.bind(("127.0.0.1", 0))
    port = sock.getsockname()[1]
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", timeout_graceful_shutdown=5, lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    deadline = time.monotonic() + timeout_s
    while not server.started:
        assert thread.is_alive(), "uvicorn exited during startup"
        assert time.monotonic() < deadline, "server did not start"
        time.sleep(0.05)

    def stop():
        server.should_exit = True
        thread.join(30)
        sock.close()

    return f"http://127.0.0.1:{port}", stop


class _ImageHandler(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        if self.path.startswith("/img.png"):
            data = png_bytes(5)
            self.send_response(200)
            self.send_header("Content-Type", "image/png")
        elif self.path.startswith("/big"):
            data = b"\x89PNG" + b"0" * (300 * 1024)
            self.send_response(200)
        elif self.path.startswith("/redirect-away"):
            self.send_response(302)
            self.send_header("Location", "http://example.invalid/x.png")
            self.send_header("Content-Length", "0")
            self.end_headers()
            return
        else:
            data = b"not found"
            self.send_response(404)
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        self.wfile.write(data)

    def log_message(self, *args):
        pass


@pytest.fixture(scope="module")
def server(tiny_llava_engine, tmp_path_factory):
    from vlmctl.serve import MediaPolicy, ServerConfig, load_app

    media_dir = tmp_path_factory.mktemp("media")
    make_image(3).save(media_dir / "local.png")
    images = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _ImageHandler)
    threading.Thread(target=images.serve_forever, daemon=True).start()
    policy = MediaPolicy(allowed_domains=["127.0.0.1"], allowed_local_path=media_dir, timeout_s=5,
                         max_bytes=256 * 1024, allow_private_addresses=True)  # the image host is on loopback
    app = load_app(tiny_llava_engine, ServerConfig(api_keys=[KEY], max_body_bytes=BODY_CAP, media=policy),
                   max_batch_size=MAX_BATCH)
    url, stop = start_uvicorn(app)
    yield Srv(url, app, media_dir, f"http://127.0.0.1:{images.server_address[1]}")
    stop()
    images.shutdown()


@pytest.fixture()
def client(server):
    from openai import OpenAI

    return OpenAI(base_url=server.v1, api_key=KEY, max_retries=0, timeout=60)


def assert_serving(server: Srv) -> None:
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    r = server.post("/chat/completions", json={"messages": [{"role": "user", "content": "hello"}], "max_tokens": 2,
                                               "temperature": 0})
    assert r.status_code == 200, r.text
    assert r.json()["usage"]["completion_tokens"] >= 1


def wait_running_zero(server: Srv, within_s: float) -> float:
    t0 = time.monotonic()
    while time.monotonic() - t0 < max(within_s * 3, 3):
        if server.metric("vlmctl_num_requests_running") == 0 and server.metric("vlmctl_num_requests_waiting") == 0:
            return time.monotonic() - t0
        time.sleep(0.02)
    raise AssertionError("requests still running")


# ---- the happy paths -------------------------------------------------------------------------
def test_models_list_and_health(server, client):
    models = client.models.list()
    assert [m.id for m in models.data] == ["tiny"]
    h = httpx.get(server.url + "/health", timeout=10)
    assert h.status_code == 200 and h.json()["status"] == "ok"


def test_chat_with_base64_image_stream_equals_nonstream_equals_cli(server, client, tmp_path, capsys):
    prompt = "what is in this image?"
    img_path = tmp_path / "img.png"
    img_path.write_bytes(png_bytes(11))
    url = "data:image/png;base64," + base64.b64encode(img_path.read_bytes()).decode()
    msgs = image_message(url, prompt)

    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0)
    text = full.choices[0].message.content
    assert full.object == "chat.completion" and full.choices[0].message.role == "assistant"
    assert full.usage.total_tokens == full.usage.prompt_tokens + full.usage.completion_tokens

    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=12, temperature=0,
                                                 stream=True, stream_options={"include_usage": True}))
    streamed = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
    finish = [c.choices[0].finish_reason for c in chunks if c.choices and c.choices[0].finish_reason]
    usage = [c.usage for c in chunks if c.usage is not None]
    assert chunks[0].choices[0].delta.role == "assistant"
    assert streamed == text
    assert finish == [full.choices[0].finish_reason]
    assert len(usage) == 1 and not chunks[-1].choices and usage[0] == full.usage

    ref = cli_json("chat", server.app.state.engine.engine_dir, "--image", img_path, "--prompt", prompt,
                   "--temperature", "0", "--max-tokens", "12", "--json", capsys=capsys)
    assert ref["text"] == text
    assert ref["completion_tokens"] == full.usage.completion_tokens
    assert ref["prompt_tokens"] == full.usage.prompt_tokens
    assert ref["finish_reason"] == full.choices[0].finish_reason


def test_image_from_allowed_local_path_and_allowed_domain(server, client):
    a = client.chat.completions.create(model="tiny", messages=image_message(
        f"file://{server.media_dir / 'local.png'}"), max_tokens=6, temperature=0)
    b = client.chat.completions.create(model="tiny", messages=image_message(data_url(3)), max_tokens=6,
                                       temperature=0)
    assert a.choices[0].message.content == b.choices[0].message.content
    c = client.chat.completions.create(model="tiny", messages=image_message(f"{server.image_server}/img.png"),
                                       max_tokens=6, temperature=0)
    d = client.chat.completions.create(model="tiny", messages=image_message(data_url(5)), max_tokens=6,
                                       temperature=0)
    assert c.choices[0].message.content == d.choices[0].message.content


def test_repeated_image_caches_visible_in_metrics(server, client):
    """The same image twice goes through the vision model once; the second request's image rows come
    from the prefix cache (or, when not whole blocks, from the feature cache)."""
    names = ("vlmctl_image_feature_cache_misses_total", "vlmctl_image_feature_cache_hits_total",
             "vlmctl_prefix_cache_hits_total", "vlmctl_prefix_cache_queries_total")
    before = [server.metric(n) for n in names]
    for _ in range(2):
        client.chat.completions.create(model="tiny", messages=image_message(data_url(21)), max_tokens=2,
                                       temperature=0)
    misses, hits, prefix_hits, queries = (server.metric(n) - b for n, b in zip(names, before))
    assert misses == 1 and queries > 0 and (prefix_hits >= 16 or hits >= 1)


def test_logprobs_and_top_logprobs(server, client):
    r = client.chat.completions.create(model="tiny", messages=image_message(data_url(12)), max_tokens=6,
                                       temperature=0, logprobs=True, top_logprobs=3)
    content = r.choices[0].logprobs.content
    assert len(content) == r.usage.completion_tokens
    for tok in content:
        assert len(tok.top_logprobs) == 3
        assert tok.logprob <= 0
        # greedy: the chosen token is the most likely one
        assert tok.logprob == pytest.approx(tok.top_logprobs[0].logprob, abs=1e-5)
        assert tok.top_logprobs[0].logprob >= tok.top_logprobs[1].logprob >= tok.top_logprobs[2].logprob
    chunks = list(client.chat.completions.create(model="tiny", messages=image_message(data_url(12)), max_tokens=6,
                                                 temperature=0, logprobs=True, stream=True))
    streamed = [t for c in chunks if c.choices and c.choices[0].logprobs for t in c.choices[0].logprobs.content]
    assert [t.token for t in streamed] == [t.token for t in content]
    assert [t.logprob for t in streamed] == pytest.approx([t.logprob for t in content], abs=1e-5)


def test_completions_endpoint(server, client):
    r = client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0, logprobs=2)
    ch = r.choices[0]
    assert r.object == "text_completion" and r.usage.completion_tokens >= 1
    assert len(ch.logprobs.tokens) == r.usage.completion_tokens
    # a dict per token: tokens that decode to the same text (partial UTF-8) share one key
    assert all(1 <= len(t) <= 2 for t in ch.logprobs.top_logprobs)
    chunks = list(client.completions.create(model="tiny", prompt="hello world", max_tokens=8, temperature=0,
                                            stream=True, stream_options={"include_usage": True}))
    assert "".join(c.choices[0].text for c in chunks if c.choices) == ch.text
    assert [c.usage for c in chunks if c.usage][0] == r.usage
    eng = server.app.state.engine
    assert r.usage.prompt_tokens == len(eng.encode_text("hello world").token_ids)


def test_seeded_sampling_is_reproducible(server, client):
    kw = dict(model="tiny", messages=[{"role": "user", "content": "tell me a story"}], max_tokens=8,
              temperature=1.0, top_p=0.9, seed=1234)
    a = client.chat.completions.create(**kw).choices[0].message.content
    b = client.chat.completions.create(**kw).choices[0].message.content
    assert a == b


def test_32_concurrent_streaming_clients(server):
    """All finish with the same text and usage as each request alone, and the engine batched them."""
    from openai import AsyncOpenAI

    inputs = [image_message(data_url(40 + k), text) for k, text in
              enumerate(["what is in this image?", "describe the picture", "hello", "a red square"])]
    ref = []
    sync = server.post
    for msgs in inputs:
        r = sync("/chat/completions", json={"messages": msgs, "max_tokens": 16, "temperature": 0}).json()
        ref.append((r["choices"][0]["message"]["content"], r["usage"]))
    n0, s0 = server.metric("vlmctl_batch_size_count"), server.metric("vlmctl_batch_size_sum")

    async def run_all():
        client = AsyncOpenAI(base_url=server.v1, api_key=KEY, max_retries=0, timeout=120)

        async def one(i):
            stream = await client.chat.completions.create(model="tiny", messages=inputs[i % 4], max_tokens=16,
                                                          temperature=0, stream=True,
                                                          stream_options={"include_usage": True})
            text, usage = "", None
            async for c in stream:
                if c.choices:
                    text += c.choices[0].delta.content or ""
                if c.usage:
                    usage = c.usage
            return text, usage

        try:
            return await asyncio.wait_for(asyncio.gather(*(one(i) for i in range(32))), 120)
        finally:
            await client.close()

    results = asyncio.run(run_all())
    assert len(results) == 32
    for i, (text, usage) in enumerate(results):
        want_text, want_usage = ref[i % 4]
        assert text == want_text
        assert usage is not None and usage.model_dump(include={"prompt_tokens", "completion_tokens",
                                                               "total_tokens"}) == want_usage
    n1, s1 = server.metric("vlmctl_batch_size_count"), server.metric("vlmctl_batch_size_sum")
    assert (s1 - s0) / (n1 - n0) > 1.5, "requests were not batched"
    assert server.metric("vlmctl_num_requests_running_max") > 1
    wait_running_zero(server, 1.0)


# ---- cancellation ----------------------------------------------------------------------------
def test_client_cancel_mid_stream_frees_the_slot(server):
    aborted = server.metric("vlmctl_request_aborted_total")
    body = {"messages": image_message(data_url(60)), "max_tokens": 250, "temperature": 0, "ignore_eos": True,
            "stream": True}
    with httpx.Client(timeout=60, headers={"Authorization": f"Bearer {KEY}"}) as c:
        with c.stream("POST", server.v1 + "/chat/completions", json=body) as r:
            assert r.status_code == 200
            lines = r.iter_lines()  # kept alive: closing this iterator closes the connection
            n = 0
            while n < 3:
                n += next(lines).startswith("data: ")
            assert server.metric("vlmctl_num_requests_running") == 1
        # leaving the block closes the connection mid-stream
    assert wait_running_zero(server, 1.0) < 1.0
    assert server.metric("vlmctl_request_aborted_total") == aborted + 1
    assert_serving(server)


def test_client_timeout_on_nonstreamed_request_aborts_it(server):
    aborted = server.metric("vlmctl_request_aborted_total")
    body = {"messages": image_message(data_url(61)), "max_tokens": 250, "temperature": 0, "ignore_eos": True}
    # 250 tokens of the tiny model take ~0.25 s on a free 2-core CPU (detokenization is incremental):
    # the client gives up well before that.
    with pytest.raises(httpx.ReadTimeout):
        server.post("/chat/completions", json=body, timeout=httpx.Timeout(10, read=0.03))
    assert wait_running_zero(server, 1.0) < 1.0
    assert server.metric("vlmctl_request_aborted_total") == aborted + 1


# ---- errors ----------------------------------------------------------------------------------
def chat_body(**kw) -> dict:
    return {"model": "tiny", "messages": [{"role": "user", "content": "hi"}], "max_tokens": 4, **kw}


def img_body(url: str, **kw) -> dict:
    return {"model": "tiny", "messages": image_message(url), "max_tokens": 4, **kw}


ERROR_CASES = [
    # (id, request kwargs for Srv.post, status, param, message fragment)
    ("malformed-json", dict(content=b'{"messages": [', headers={"Content-Type": "application/json"}), 400, None,
     "malformed JSON"),
    ("no-messages", dict(json={"model": "tiny"}), 400, "messages", "messages"),
    ("empty-messages", dict(json={"model": "tiny", "messages": []}), 400, "messages", "messages"),
    ("bad-type", dict(json=chat_body(temperature="hot")), 400, "temperature", "temperature"),
    ("bad-role", dict(json={"messages": [{"role": "robot", "content": "x"}]}), 400, None, "role"),
    ("bad-part", dict(json={"messages": [{"role": "user", "content": [{"type": "input_audio"}]}]}), 400, None,
     "content"),
    ("max-tokens-zero", dict(json=chat_body(max_tokens=0)), 400, "max_tokens", "max_tokens"),
    ("n-over-128", dict(json=chat_body(n=129)), 400, "n", "128"),
    ("bad-base64", dict(json=img_body("data:image/png;base64,!!!not-base64")), 400, None, "base64"),
    ("undecodable", dict(json=img_body("data:image/png;base64," + base64.b64encode(b"not an image").decode())),
     400, None, "not a decodable image"),
    ("not-image-mime", dict(json=img_body("data:text/plain;base64,aGVsbG8=")), 400, None, "not an image"),
    ("two-images", dict(json={"messages": [{"role": "user", "content": [
        {"type": "image_url", "image_url": {"url": data_url(1)}},
        {"type": "image_url", "image_url": {"url": data_url(2)}}, {"type": "text", "text": "x"}]}]}), 400, None,
     "at most 1"),
    ("max-tokens-over", dict(json=chat_body(max_tokens=100000)), 400, None, "100000"),
    ("prompt-too-long", dict(json={"messages": [{"role": "user", "content": "hello world " * 1000}],
                                   "max_tokens": 4}), 400, None, "max_input_len is 1024"),
    ("top-logprobs-without-logprobs", dict(json=chat_body(top_logprobs=2)), 400, "top_logprobs", "logprobs"),
    ("local-outside", dict(json=img_body("file:///etc/passwd")), 400, None, "outside the allowed"),
    ("local-traversal", dict(json=img_body("file://{media}/../../etc/hosts")), 400, None, "outside the allowed"),
    ("domain-not-allowed", dict(json=img_body("http://example.com/cat.png")), 400, None, "not allowed"),
    ("remote-404", dict(json=img_body("{images}/missing.png")), 400, None, "HTTP 404"),
    ("remote-over-cap", dict(json=img_body("{images}/big")), 400, None, "media cap"),
    ("redirect-away", dict(json=img_body("{images}/redirect-away")), 400, None, "not allowed"),
    ("unknown-model", dict(json=chat_body(model="gpt-4o")), 404, "model", "gpt-4o"),
    ("body-over-cap", dict(json=chat_body(pad="x" * (BODY_CAP + 10))), 413, None, "at most"),
    ("chunked-body-over-cap", dict(content=iter([b'{"pad": "' + b"x" * BODY_CAP, b'"}']),
                                   headers={"Content-Type": "application/json"}), 413, None, "at most"),
    ("bad-schema", dict(json=chat_body(response_format={"type": "json_schema", "json_schema": {
        "name": "x", "schema": {"type": "object", "properties": {"a": {"type": "string", "pattern": "("}}}}})), 400,
     "response_format.json_schema.schema", "cannot be used"),
    ("tools-without-a-tools-template", dict(json=chat_body(tools=[{"type": "function", "function": {"name": "f"}}])),
     400, "tools", "chat template"),
    ("penalty-out-of-range", dict(json=chat_body(presence_penalty=2.5)), 400, "presence_penalty", "between -2 and 2"),
    ("unknown-field", dict(json=chat_body(temprature=0.5)), 400, "temprature", "not a field"),
    ("completions-token-ids", dict(json={"model": "tiny", "prompt": [1, 2, 3]}, path="/completions"), 400, "prompt",
     "token-id prompts"),
    ("completions-echo", dict(json={"model": "tiny", "prompt": "a", "echo": True}, path="/completions"), 400,
     "echo", "echo"),
]


def _fill(obj, server):
    if isinstance(obj, str):
        return obj.replace("{media}", str(server.media_dir)).replace("{images}", server.image_server)
    if isinstance(obj, dict):
        return {k: _fill(v, server) for k, v in obj.items()}
    if isinstance(obj, list):
        return [_fill(v, server) for v in obj]
    return obj


@pytest.mark.parametrize("case", ERROR_CASES, ids=[c[0] for c in ERROR_CASES])
def test_bad_input_gets_status_and_openai_error(server, case):
    _, kwargs, status, param, fragment = case
    kwargs = dict(kwargs)
    path = kwargs.pop("path", "/chat/completions")
    if "json" in kwargs:
        kwargs["json"] = _fill(kwargs["json"], server)
    r = server.post(path, **kwargs)
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    assert fragment in err["message"]
    if param is not None:
        assert err["param"] == param


def test_errors_leave_the_server_serving(server):
    r = server.post("/chat/completions", json={"messages": [{"role": "user", "content": "hello world " * 1000}]})
    assert r.status_code == 400
    msg = r.json()["error"]["message"]
    assert re.search(r"the prompt has \d+ tokens", msg) and "max_input_len is 1024" in msg  # both numbers
    assert_serving(server)
    wait_running_zero(server, 1.0)


def test_engine_failure_fails_the_request_not_the_server(server):
    eng = server.app.state.engine
    real_step = eng.step
    armed = threading.Event()

    def failing_step():
        if armed.is_set() and eng.num_waiting:  # fail the step that would admit the next request
            armed.clear()
            raise RuntimeError("injected engine failure")
        return real_step()

    eng.step = failing_step
    try:
        armed.set()
        r = server.post("/chat/completions", json=chat_body())
        assert r.status_code == 500 and r.json()["error"]["type"] == "internal_server_error"
        wait_running_zero(server, 1.0)  # the failed request has left the queue
        armed.set()
        with httpx.stream("POST", server.v1 + "/chat/completions", json=chat_body(stream=True), timeout=60,
                          headers={"Authorization": f"Bearer {KEY}"}) as s:
            events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
        assert s.status_code == 200  # the stream had started; the failure arrives as an SSE error event
        assert '"error"' in events[-2] and events[-1] == "[DONE]"
    finally:
        del eng.step
    wait_running_zero(server, 1.0)
    assert_serving(server)


def test_api_key_required(server, client):
    from openai import AuthenticationError, OpenAI

    for headers in ({}, {"Authorization": "Bearer wrong"}, {"Authorization": KEY}):
        r = httpx.post(server.v1 + "/chat/completions", json=chat_body(), headers=headers, timeout=10)
        assert r.status_code == 401
        assert r.json()["error"]["code"] == "invalid_api_key"
    assert httpx.get(server.v1 + "/models", timeout=10).status_code == 401
    with pytest.raises(AuthenticationError):
        OpenAI(base_url=server.v1, api_key="nope", max_retries=0).models.list()
    # health and metrics stay open (probes, scrapers)
    assert httpx.get(server.url + "/health", timeout=10).status_code == 200
    assert httpx.get(server.url + "/metrics", timeout=10).status_code == 200
    assert client.models.list().data


def test_unknown_route_and_method_are_openai_shaped(server):
    r = httpx.get(server.v1 + "/nope", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 404 and "error" in r.json()
    r = httpx.get(server.v1 + "/chat/completions", headers={"Authorization": f"Bearer {KEY}"}, timeout=10)
    assert r.status_code == 405 and "error" in r.json()


def test_metrics_exposes_the_documented_series(server, client):
    client.chat.completions.create(model="tiny", messages=image_message(data_url(70)), max_tokens=4,
                                   temperature=0)
    text = httpx.get(server.url + "/metrics", timeout=10).text
    for name in ("vlmctl_num_requests_running", "vlmctl_num_requests_waiting", "vlmctl_num_requests_running_max",
                 "vlmctl_time_to_first_token_seconds_bucket", "vlmctl_time_per_output_token_seconds_bucket",
                 "vlmctl_e2e_request_latency_seconds_bucket", "vlmctl_prompt_tokens_total",
                 "vlmctl_generation_tokens_total", "vlmctl_image_feature_cache_hits_total",
                 "vlmctl_request_success_total", "vlmctl_batch_size_bucket"):
        assert name in text, name
    assert server.metric("vlmctl_prompt_tokens_total") > 0
    assert server.metric("vlmctl_generation_tokens_total") > 0
    assert 'vlmctl_kv_cache_config_info{block_size="16",dtype="auto",model_name="tiny"} 1.0' in text


def test_bench_against_the_server(server, tmp_path, capsys):
    out = tmp_path / "bench.json"
    res = cli_json("bench", "--url", server.url, "--api-key", KEY, "-n", "8", "-c", "4", "--output-len", "6",
                   "--image-size", "32x32", "--prompt-len", "4", "--out", out, "--json", capsys=capsys)
    run = res["runs"][0]
    assert run["mode"] == "url" and run["completed"] == 8 and run["failed"] == 0
    assert run["total_output_tokens"] == 8 * 6
    for key in ("ttft_ms", "tpot_ms", "itl_ms", "e2e_ms"):
        assert set(run[key]) == {"mean", "median", "p99"} and run[key]["mean"] > 0
    assert run["request_throughput"] > 0 and run["output_throughput"] > 0
    assert run["max_running"] > 1
    import json

    assert json.loads(out.read_text()) == res
