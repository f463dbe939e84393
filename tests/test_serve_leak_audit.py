"""Leak audit of the server: requests that go away mid-way (client disconnects mid-stream, many streams of
which half are dropped at random points, requests refused part-way through their preparation) must leave
the server exactly as it was: every KV block free again (/metrics and the pool's reference counts), no
request left running or waiting, no per-request state left in the engine or the async bridge, and a
greedy request answered as before the disturbance.

A real uvicorn server on 127.0.0.1 with a tiny LLaVA engine built here (3 images per request, a KV pool
small enough that concurrent requests preempt each other), driven by the official `openai` client and raw
httpx. What the audit tried and found is in the report of the session that wrote it; these are the
strongest scenarios, kept as regression tests with exact counts."""

from __future__ import annotations

import base64
import concurrent.futures as cf
import json
import random
import time

import httpx
import pytest
from conftest import write_recipe
from test_serve import data_url, start_uvicorn

openai = pytest.importorskip("openai")

MAX_INPUT = 256  # lowered at load, so a chat text that fits as a completion prompt can overflow after templating
KV_TOKENS = 512  # 32 blocks of 16: a few long sequences at once fill it (preemptions happen)


@pytest.fixture(scope="module")
def srv(tiny_llava, tmp_path_factory):
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe
    from vlmctl.serve import ServerConfig, load_app

    d = tmp_path_factory.mktemp("leak")
    build(load_recipe(write_recipe(d / "tiny.yaml", tiny_llava,
                                   limits={"max_batch_size": 8, "max_images_per_request": 3})), d / "engine")
    app = load_app(d / "engine", ServerConfig(stats_interval_s=0), max_batch_size=8, max_input_len=MAX_INPUT,
                   kv_cache_tokens=KV_TOKENS)
    url, stop = start_uvicorn(app)
    yield url, app
    stop()


@pytest.fixture()
def client(srv):
    return openai.OpenAI(base_url=srv[0] + "/v1", api_key="none", max_retries=0, timeout=60)


def metrics(url: str) -> dict[str, float]:
    out = {}
    for line in httpx.get(url + "/metrics", timeout=10).text.splitlines():
        if line and not line.startswith("#"):
            name, value = line.rsplit(" ", 1)
            out[name.split("{", 1)[0]] = float(value)
    return out


def engine_state(app) -> dict:
    eng, aeng = app.state.engine, app.state.async_engine
    return {"held_blocks": sum(1 for r in eng.pool.ref if r), "running": len(eng.scheduler.running),
            "waiting": len(eng.scheduler.waiting), "requests": len(eng._requests), "queues": len(aeng._queues),
            "penalty_rows": len(eng.logits_proc) if eng.logits_proc is not None else 0}


IDLE = {"held_blocks": 0, "running": 0, "waiting": 0, "requests": 0, "queues": 0, "penalty_rows": 0}


def assert_idle(srv, within_s: float = 5.0) -> dict:
    """Every block free (the gauges and the pool agree), nothing running, waiting or held for a request."""
    url, app = srv
    deadline = time.monotonic() + within_s
    while True:
        m, st = metrics(url), engine_state(app)
        total = app.state.engine.pool.capacity
        ok = (st == IDLE and m["vlmctl_kv_cache_blocks_used"] == 0 and m["vlmctl_kv_cache_blocks_free"] == total
              and m["vlmctl_kv_cache_blocks_total"] == total and m["vlmctl_num_requests_running"] == 0
              and m["vlmctl_num_requests_waiting"] == 0)
        if ok:
            return m
        assert time.monotonic() < deadline, (st, {k: v for k, v in m.items() if "kv_cache" in k or "num_req" in k})
        time.sleep(0.02)


def chat(text: str = "tell me a story", **kw) -> dict:
    return {"messages": [{"role": "user", "content": text}], "max_tokens": 40, "temperature": 0, **kw}


def greedy(client) -> tuple[str, str]:
    """The greedy chat and completion answers that every disturbance must leave unchanged."""
    a = client.chat.completions.create(model="tiny", **chat())
    b = client.completions.create(model="tiny", prompt="once upon a time", max_tokens=40, temperature=0)
    assert a.choices[0].finish_reason == b.choices[0].finish_reason == "length"
    return a.choices[0].message.content, b.choices[0].text


def stream_texts(url: str, path: str, body: dict, drop_after: int | None = None):
    """Stream `body`; {choice index: text} and {index: finish_reason}, or "dropped" when the connection was
    closed after `drop_after` events."""
    texts, finish, n = {}, {}, 0
    with httpx.Client(timeout=120) as c, c.stream("POST", url + "/v1" + path, json={**body, "stream": True}) as r:
        assert r.status_code == 200, r.read()
        for line in r.iter_lines():
            if not line.startswith("data: "):
                continue
            n += 1
            if drop_after is not None and n >= drop_after:
                return "dropped"  # leaving the block closes the connection mid-stream
            if line == "data: [DONE]":
                break
            obj = json.loads(line[6:])
            assert "error" not in obj, obj
            for ch in obj["choices"]:
                piece = ch["text"] if "text" in ch else (ch.get("delta") or {}).get("content")
                texts[ch["index"]] = texts.get(ch["index"], "") + (piece or "")
                if ch.get("finish_reason"):
                    finish[ch["index"]] = ch["finish_reason"]
    return texts, finish


# ---- 1: client disconnects mid-stream, every kind of choice ----------------------------------------------
LONG = {"max_tokens": 150, "ignore_eos": True}
DROPPED = [
    ("chat", chat(**LONG)),
    ("chat", chat(n=3, **LONG)),
    ("chat", chat(n=2, stop=["\u00e9\u00e9\u00e9\u00e9"], **LONG)),  # stop strings: text is held back
    ("chat", chat(n=2, logprobs=True, top_logprobs=3, **LONG)),
    ("chat", chat(n=2, frequency_penalty=1.0, presence_penalty=0.5, logit_bias={"5": 3}, **LONG)),  # penalty rows
    # structured output (grammar matchers): a string of at least 200 characters, so it runs to max_tokens
    ("chat", chat(n=2, max_tokens=150, temperature=1.0, seed=3, response_format={
        "type": "json_schema", "json_schema": {"name": "long", "schema": {
            "type": "object", "properties": {"s": {"type": "string", "minLength": 200}}, "required": ["s"]}}})),
    ("chat", {"messages": [{"role": "user", "content": [{"type": "text", "text": "these"}] + [
        {"type": "image_url", "image_url": {"url": data_url(s)}} for s in (1, 2)]}], "n": 2, **LONG}),
    ("completions", {"prompt": "once upon", "n": 3, "logprobs": 2, "temperature": 0.8, "seed": 1, **LONG}),
    ("completions", {"prompt": ["once upon", "a b c"], "n": 2, "stop": ["\u00e9\u00e9\u00e9"],
                     "repetition_penalty": 1.3, **LONG}),
]


EXTENSIONS = ("ignore_eos", "repetition_penalty", "response_format")


def test_disconnect_mid_stream_frees_everything_for_every_kind_of_choice(srv, client):
    """Each request is dropped after its first few chunks (official client: closing the stream closes the
    connection). Every choice is aborted (the counter says exactly how many), every block comes back."""
    url, app = srv
    before = greedy(client)
    assert_idle(srv)
    for kind, body in DROPPED:
        for after in (1, 3):
            aborted = metrics(url)["vlmctl_request_aborted_total"]
            sequences = body.get("n", 1) * (len(body["prompt"]) if isinstance(body.get("prompt"), list) else 1)
            create = client.chat.completions.create if kind == "chat" else client.completions.create
            extra = {k: body[k] for k in EXTENSIONS if k in body}  # vlmctl's fields, through extra_body
            stream = create(model="tiny", stream=True, extra_body=extra,
                            **{k: v for k, v in body.items() if k not in EXTENSIONS})
            got = 0
            for _ in stream:
                got += 1
                if got == after:
                    break
            assert got == after
            assert app.state.engine.num_running + app.state.engine.num_waiting > 0  # still generating
            stream.close()
            m = assert_idle(srv)
            assert m["vlmctl_request_aborted_total"] == aborted + sequences, (kind, body)
    # best_of cannot be streamed: a non-streamed best_of request whose client gives up aborts every candidate
    aborted = metrics(url)["vlmctl_request_aborted_total"]
    with pytest.raises(httpx.ReadTimeout):  # 150 steps at least: far beyond the 0.05 s the client waits
        httpx.post(url + "/v1/completions", json={"prompt": "once upon", "n": 2, "best_of": 6, "logprobs": 1, **LONG},
                   timeout=httpx.Timeout(10, read=0.05))
    assert assert_idle(srv)["vlmctl_request_aborted_total"] == aborted + 6
    assert greedy(client) == before


# ---- 2: many concurrent streams, half dropped at random points ------------------------------------------
def test_half_of_many_concurrent_streams_dropped_at_random_points(srv, client):
    """40 concurrent streams (chat and completions, n of 1 to 3) on a KV pool that cannot hold them all (so
    requests are preempted and recomputed while others are dropped); every stream that is not dropped gets
    exactly its answer alone, and afterwards the pool is entirely free."""
    url, app = srv
    before = greedy(client)

    def job(k):
        k %= 10
        body = {"max_tokens": 60 + (k % 4) * 10, "temperature": 0, "ignore_eos": True, "n": 1 + k % 3}
        if k % 2:
            return "/chat/completions", {"messages": [{"role": "user", "content": f"story {k} " * (1 + k % 5)}],
                                         **body}
        return "/completions", {"prompt": f"story {k} " * (2 + k % 5), **body}

    ref = {k: stream_texts(url, *job(k)) for k in range(10)}  # k and k + 10j ask the same
    assert_idle(srv)
    preempted = app.state.engine.scheduler.preemptions
    rng = random.Random(0)
    drops = {k: (rng.randint(1, 30) if k % 4 < 2 else None) for k in range(40)}
    with cf.ThreadPoolExecutor(40) as ex:
        got = dict(zip(range(40), ex.map(lambda k: stream_texts(url, *job(k), drop_after=drops[k]), range(40))))
    for k, res in got.items():
        if drops[k] is None:
            assert res == ref[k % 10], k
            assert set(res[1].values()) == {"length"}
    assert app.state.engine.scheduler.preemptions > preempted, "the pool was never full: no preemption exercised"
    assert_idle(srv)
    assert greedy(client) == before


# ---- 3: requests refused part-way while others run -------------------------------------------------------
def test_requests_refused_part_way_leave_the_others_and_the_pool_untouched(srv, client):
    """While streams run: an undecodable image among several, a chat text that fits max_input_len as text but
    not after templating, a completions prompt list whose second prompt is too long (refused at submit,
    after the first prompt's choices were queued), too many images. Each is a 400; the streams beside them
    answer exactly as alone; nothing is left behind."""
    url, app = srv
    before = greedy(client)
    bg = chat("background", max_tokens=60, ignore_eos=True)
    ref = stream_texts(url, "/chat/completions", bg)
    bad = "data:image/png;base64," + base64.b64encode(b"\x89PNG\r\n\x1a\nnot a png at all").decode()

    def images(urls, text="describe"):
        return [{"role": "user", "content": [{"type": "text", "text": text}]
                 + [{"type": "image_url", "image_url": {"url": u}} for u in urls]}]

    text = "a" * (MAX_INPUT - 6)  # one token a character: fits as a completion prompt, not in the chat template
    assert len(app.state.engine.encode_text(text).token_ids) <= MAX_INPUT
    refused = [
        ("/chat/completions", {"messages": images([data_url(3), bad, data_url(4)]), "max_tokens": 20}, "decodable"),
        ("/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 20}, "max_input_len"),
        ("/completions", {"prompt": ["hello", "b" * (MAX_INPUT + 40)], "n": 3, "max_tokens": 100,
                          "ignore_eos": True}, "max_input_len"),
        ("/chat/completions", {"messages": images([data_url(i) for i in range(4)]), "max_tokens": 20}, "at most 3"),
    ]
    generated = metrics(url)["vlmctl_generation_tokens_total"]
    with cf.ThreadPoolExecutor(12) as ex:
        streams = [ex.submit(stream_texts, url, "/chat/completions", bg) for _ in range(6)]
        time.sleep(0.05)
        answers = [ex.submit(httpx.post, url + "/v1" + path, json=body, timeout=60)
                   for path, body, _ in refused for _ in range(2)]
        for (path, body, words), r in zip([x for x in refused for _ in range(2)], (a.result() for a in answers)):
            assert r.status_code == 400, (path, r.text)
            assert words in r.json()["error"]["message"], r.text
        assert all(s.result() == ref for s in streams)
    m = assert_idle(srv)
    # the choices of "hello" queued before its sibling prompt was refused were aborted at once (a token or
    # so each at most), not left to generate their 100 tokens for nobody
    assert m["vlmctl_generation_tokens_total"] - generated < 6 * 60 + 2 * 3 * 20
    assert greedy(client) == before


def test_a_stream_closed_while_its_last_event_is_on_the_way_is_counted_once(tiny_llava_engine):
    """The engine thread hands a request's final event to the event loop while the loop is busy; the client
    goes away before the loop runs it. The request was counted aborted (by the close) and also finished (by
    the late event): each metric line said one request more than there was."""
    import asyncio

    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams
    from vlmctl.serve.async_engine import AsyncEngine
    from vlmctl.serve.metrics import ServerMetrics

    engine = Engine(tiny_llava_engine)
    metrics = ServerMetrics(engine, "tiny")

    def count(name: str) -> float:
        return sum(s.value for m in metrics.registry.collect() for s in m.samples if s.name == name)

    async def main():
        bridge = AsyncEngine(engine, metrics)
        bridge.start()
        try:
            prompt = engine.encode([{"role": "user", "content": "hi"}], [])
            stream = bridge.submit(prompt, SamplingParams(max_tokens=1, temperature=0.0))
            deadline = time.monotonic() + 30
            while engine.has_work() and time.monotonic() < deadline:  # the loop is held here, not awaiting:
                time.sleep(0.01)  # the engine finishes and its final event waits in the loop's queue
            time.sleep(0.05)
            assert not engine.has_work()
            stream.close()  # the client is gone before the loop hands the event over
            await asyncio.sleep(0.2)  # now the loop runs the late dispatch
        finally:
            await bridge.stop()

    asyncio.run(main())
    assert count("vlmctl_request_aborted_total") == 1
    assert count("vlmctl_request_success_total") == 0
