"""Issue 9, server items: one request must never hurt another (1-4) and lone surrogates / NUL bytes are
400s (9). A real uvicorn server on 127.0.0.1 with the tiny LLaVA engine, driven by the official `openai`
client and raw httpx, while background clients stream; their streams must finish untouched."""

from __future__ import annotations

import base64
import http.server
import io
import json
import threading
import time

import httpx
import pytest

from test_serve import data_url, image_message, png_bytes, start_uvicorn
from tiny_models import make_image

MAX_SIDE = 512


@pytest.fixture(scope="module")
def srv(tiny_llava_engine, tmp_path_factory):
    from vlmctl.runtime.image_limits import ImageLimits
    from vlmctl.serve import MediaPolicy, ServerConfig, load_app

    media = tmp_path_factory.mktemp("media")
    make_image(4).save(media / "ok.png")
    policy = MediaPolicy(allowed_domains=["localhost", "127.0.0.1"], allowed_local_path=media, timeout_s=1.5)
    app = load_app(tiny_llava_engine, ServerConfig(media=policy), image_limits=ImageLimits(max_side=MAX_SIDE))
    url, stop = start_uvicorn(app)
    yield {"url": url, "app": app, "media": media}
    stop()


@pytest.fixture()
def client(srv):
    from openai import OpenAI

    return OpenAI(base_url=srv["url"] + "/v1", api_key="none", max_retries=0, timeout=60)


class Traffic:
    """Clients that keep streaming long answers; every stream must end with finish_reason and [DONE]."""

    def __init__(self, url: str, n: int = 2):
        self.url, self.stop, self.results = url, threading.Event(), []
        self.streaming = threading.Event()
        self.threads = [threading.Thread(target=self._loop, args=(i,), daemon=True) for i in range(n)]

    def _loop(self, i):
        body = {"messages": [{"role": "user", "content": f"tell me a story {i}"}], "max_tokens": 64,
                "temperature": 0, "ignore_eos": True, "stream": True}
        while not self.stop.is_set():
            events, status = [], None
            try:
                with httpx.stream("POST", self.url + "/v1/chat/completions", json=body, timeout=60) as r:
                    status = r.status_code
                    for line in r.iter_lines():
                        if line.startswith("data: "):
                            events.append(line[6:])
                            self.streaming.set()
            except httpx.HTTPError as e:
                events.append(f"transport error {e!r}")
            self.results.append((status, events))

    def __enter__(self):
        for t in self.threads:
            t.start()
        assert self.streaming.wait(60), "background streams did not start"
        return self

    def __exit__(self, *exc):
        self.stop.set()
        for t in self.threads:
            t.join(60)

    def assert_untouched(self):
        assert len(self.results) >= len(self.threads)
        for status, events in self.results:
            assert status == 200, events[-3:]
            assert events[-1] == "[DONE]", events[-3:]
            chunks = [json.loads(e) for e in events[:-1]]
            assert not any("error" in c for c in chunks), events[-3:]
            assert chunks[-1]["choices"][0]["finish_reason"] == "length"
            text = "".join(c["choices"][0]["delta"].get("content") or "" for c in chunks if c["choices"])
            assert text, "an empty answer"


def post(srv, path, body, timeout=60):
    return httpx.post(srv["url"] + "/v1" + path, json=body, timeout=timeout)


def chat(text="hello", **kw):
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 8, **kw}


# ---- item 1 -------------------------------------------------------------------------------------
def test_extreme_sampling_values_are_served_and_hurt_no_other_stream(srv):
    greedy = post(srv, "/chat/completions", chat(temperature=0)).json()["choices"][0]["message"]["content"]
    seeded = post(srv, "/chat/completions", chat(temperature=1.0, seed=7)).json()["choices"][0]["message"]["content"]
    with Traffic(srv["url"]) as traffic:
        r = post(srv, "/chat/completions", chat(temperature=1e-39))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == greedy  # a tiny temperature is greedy
        r = post(srv, "/chat/completions", chat(temperature=1.0, top_p=1e-50))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == greedy  # top_p keeps the top token
        r = post(srv, "/chat/completions", chat(temperature=1.0, seed=7, top_k=2 ** 63))
        assert r.status_code == 200, r.text
        assert r.json()["choices"][0]["message"]["content"] == seeded  # top_k >= vocab is no filter
        r = post(srv, "/completions", {"prompt": "", "max_tokens": 4})
        assert r.status_code == 400, r.text
        assert "empty" in r.json()["error"]["message"]
    traffic.assert_untouched()


def test_a_request_failing_inside_the_step_fails_alone(srv):
    """Fault injection at the vision runner: the request whose image it cannot encode gets an error,
    the requests streaming beside it do not notice."""
    eng = srv["app"].state.engine
    real = eng.vision.runner

    def vision(feed):
        pixels = next(iter(feed.values()))  # [images, channels, height, width]
        if any(bool((img.reshape(img.shape[0], -1).std(-1) < 1e-6).all()) for img in pixels):
            raise RuntimeError("injected vision failure on a flat image")
        return real(feed)

    flat = "data:image/png;base64," + base64.b64encode(_png((64, 64), color=(0, 0, 0))).decode()
    vision.backend = real.backend
    eng.vision.runner = vision
    try:
        with Traffic(srv["url"]) as traffic:
            r = post(srv, "/chat/completions", {"messages": image_message(flat), "max_tokens": 4})
            assert r.status_code == 500, r.text
            assert "image encoding" in r.json()["error"]["message"]
            with httpx.stream("POST", srv["url"] + "/v1/chat/completions", timeout=60,
                              json={"messages": image_message(flat), "max_tokens": 4, "stream": True}) as s:
                events = [line[6:] for line in s.iter_lines() if line.startswith("data: ")]
            assert '"error"' in events[-2] and events[-1] == "[DONE]"
            ok = post(srv, "/chat/completions", {"messages": image_message(data_url(9)), "max_tokens": 4})
            assert ok.status_code == 200, ok.text
    finally:
        eng.vision.runner = real
    traffic.assert_untouched()


# ---- item 2 -------------------------------------------------------------------------------------
def _png(size, color=None) -> bytes:
    from PIL import Image

    buf = io.BytesIO()
    Image.new("RGB", size, color or (200, 10, 10)).save(buf, "PNG")
    return buf.getvalue()


@pytest.mark.parametrize("size,fragment", [((500, 2), "aspect ratio"), ((1, 300), "aspect ratio"),
                                           ((MAX_SIDE + 1, 300), "longest side")])
def test_degenerate_image_shapes_are_refused_before_preprocessing(srv, size, fragment):
    from PIL import Image

    eng = srv["app"].state.engine
    calls = []
    real = eng.processor.encode
    eng.processor.encode = lambda *a, **k: calls.append(1) or real(*a, **k)
    try:
        url = "data:image/png;base64," + base64.b64encode(_png(size)).decode()
        r = post(srv, "/chat/completions", {"messages": image_message(url), "max_tokens": 2})
    finally:
        del eng.processor.encode
    assert r.status_code == 400, r.text
    assert fragment in r.json()["error"]["message"] and r.json()["error"]["code"] == "limit_exceeded"
    assert not calls, "the image reached the family's preprocessing"
    assert Image.open(io.BytesIO(_png(size))).size == size


# ---- item 3 -------------------------------------------------------------------------------------
def test_stop_sequences_are_capped(srv, client):
    from openai import BadRequestError

    r = client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       stop=["a1", "b2", "c3", "d4"])
    assert r.choices[0].finish_reason in ("stop", "length")
    with pytest.raises(BadRequestError, match="at most 4"):
        client.chat.completions.create(model="tiny", messages=[{"role": "user", "content": "hi"}], max_tokens=4,
                                       stop=[f"s{i}" for i in range(5)])
    r = post(srv, "/completions", {"prompt": "hello", "max_tokens": 4, "stop": [f"s{i}" for i in range(8000)]})
    assert r.status_code == 400 and "at most 4" in r.json()["error"]["message"]


def test_stop_strings_stream_exactly_like_the_full_answer(srv, client):
    msgs = [{"role": "user", "content": "tell me a story"}]
    full = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=0,
                                          extra_body={"ignore_eos": True}).choices[0].message.content
    assert len(full) > 12
    stop = full[len(full) // 2: len(full) // 2 + 3]
    want = full[:full.index(stop)]
    r = client.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=0, stop=[stop],
                                       extra_body={"ignore_eos": True})
    assert r.choices[0].message.content == want and r.choices[0].finish_reason == "stop"
    chunks = list(client.chat.completions.create(model="tiny", messages=msgs, max_tokens=40, temperature=0,
                                                 stop=[stop], stream=True, extra_body={"ignore_eos": True}))
    assert "".join(c.choices[0].delta.content or "" for c in chunks if c.choices) == want


def test_the_stop_cap_is_an_option(tiny_llava_engine):
    from openai import BadRequestError, OpenAI

    from vlmctl.serve import ServerConfig, load_app

    app = load_app(tiny_llava_engine, ServerConfig(), max_stop_sequences=6)
    url, stop = start_uvicorn(app)
    try:
        c = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        c.completions.create(model="tiny", prompt="hi", max_tokens=2, stop=[f"q{i}" for i in range(6)])
        with pytest.raises(BadRequestError, match="at most 6"):
            c.completions.create(model="tiny", prompt="hi", max_tokens=2, stop=[f"q{i}" for i in range(7)])
    finally:
        stop()


def test_detokenization_work_per_token_is_bounded(tiny_llava_engine):
    """Engine level: 250 tokens decode O(tokens) ids in all, not O(tokens^2) (the old path decoded the
    whole output again on every token, on the engine thread every stream shares)."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    eng = Engine(tiny_llava_engine)

    class Counting:
        def __init__(self, inner):
            self.inner, self.ids_decoded = inner, 0

        def decode(self, ids, **kw):
            self.ids_decoded += len(ids)
            return self.inner.decode(ids, **kw)

        def __getattr__(self, name):
            return getattr(self.inner, name)

    prompt = eng.encode_text("tell me a story")
    eng.tokenizer = counting = Counting(eng.tokenizer)
    res = eng.generate([prompt], SamplingParams(max_tokens=250, temperature=0,
                                                                           ignore_eos=True))[0]
    assert res.completion_tokens == 250
    assert res.text == counting.inner.decode(res.token_ids, skip_special_tokens=True)
    assert counting.ids_decoded < 10 * 250, counting.ids_decoded


# ---- item 4 -------------------------------------------------------------------------------------
class _Drip(http.server.BaseHTTPRequestHandler):
    def do_GET(self):
        data = png_bytes(5)
        self.send_response(200)
        self.send_header("Content-Type", "image/png")
        self.send_header("Content-Length", str(len(data)))
        self.end_headers()
        for i in range(0, len(data), 16):  # every read is quick; the whole body takes ~5 s
            self.wfile.write(data[i:i + 16])
            self.wfile.flush()
            time.sleep(5 / (len(data) / 16))

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def drip_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


def test_media_timeout_bounds_the_whole_fetch(drip_host):
    import asyncio

    from vlmctl.errors import InputError
    from vlmctl.serve.media import MediaPolicy, load_image_url

    policy = MediaPolicy(allowed_domains=["127.0.0.1"], timeout_s=1.0, allow_private_addresses=True)
    t0 = time.monotonic()
    with pytest.raises(InputError, match="longer than 1s"):
        asyncio.run(load_image_url(drip_host + "/img.png", policy))
    assert time.monotonic() - t0 < 2.5
    slow_ok = MediaPolicy(allowed_domains=["127.0.0.1"], timeout_s=20, allow_private_addresses=True)
    assert asyncio.run(load_image_url(drip_host + "/img.png", slow_ok)).size == (40, 30)


def test_allowed_hosts_resolving_to_private_addresses_are_refused(srv):
    """`localhost` is an allowed domain of this server, but it resolves to loopback: refused (400)."""
    import asyncio

    from vlmctl.errors import InputError
    from vlmctl.serve.media import MediaPolicy, load_image_url

    image_host = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _Drip)
    threading.Thread(target=image_host.serve_forever, daemon=True).start()
    port = image_host.server_address[1]
    try:
        for host in ("localhost", "127.0.0.1"):
            r = post(srv, "/chat/completions", {"messages": image_message(f"http://{host}:{port}/x.png"),
                                               "max_tokens": 2})
            assert r.status_code == 400, r.text
            assert "loopback, private" in r.json()["error"]["message"]
        for addr in ("10.1.2.3", "169.254.169.254", "192.168.0.1", "::1", "fe80::1", "0.0.0.0"):
            policy = MediaPolicy(allowed_domains=[addr], timeout_s=1.0)
            host = f"[{addr}]" if ":" in addr else addr
            with pytest.raises(InputError, match="loopback, private"):
                asyncio.run(load_image_url(f"http://{host}/x.png", policy))
    finally:
        image_host.shutdown()


# ---- item 9 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("path,body,param", [
    ("/chat/completions", '{"messages": [{"role": "user", "content": "hi \\ud800 there"}], "max_tokens": 2}',
     "messages[0].content"),
    ("/chat/completions", '{"messages": [{"role": "user", "content": [{"type": "text", "text": "\\udfff"}]}]}',
     "messages[0].content"),
    ("/completions", '{"prompt": "a\\ud83d", "max_tokens": 2}', "prompt"),
    ("/completions", '{"prompt": "a", "stop": ["\\ud800"], "max_tokens": 2}', "stop"),
])
def test_lone_surrogates_are_a_400(srv, path, body, param):
    r = httpx.post(srv["url"] + "/v1" + path, content=body.encode(), timeout=30,
                   headers={"Content-Type": "application/json"})
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert "surrogate" in err["message"] and (err["param"] or "").startswith(param)


def test_nul_in_a_file_url_is_a_400(srv):
    for url in (f"file://{srv['media']}/ok.png%00.jpg", f"file://{srv['media']}/%00"):
        r = post(srv, "/chat/completions", {"messages": image_message(url), "max_tokens": 2})
        assert r.status_code == 400, r.text
        assert "NUL" in r.json()["error"]["message"]
    ok = post(srv, "/chat/completions", {"messages": image_message(f"file://{srv['media']}/ok.png"),
                                         "max_tokens": 2})
    assert ok.status_code == 200, ok.text
