"""Requests that could hurt the server or that OpenAI refuses, against a real `vlmctl serve` app on uvicorn
(the official `openai` client where it can send the request): fan-out, nesting, oversized text, JSON types,
error paths, seed range, the model routes. And the engine-side pieces under them, on the real engine."""

from __future__ import annotations

import json

import httpx
import pytest

from conftest import serve_engine

openai = pytest.importorskip("openai")


@pytest.fixture(scope="module")
def srv(tiny_llava_engine):
    yield from serve_engine(tiny_llava_engine, max_batch_size=4)  # conftest's srv, for batches of 4


def post(srv, path: str, body, **kw) -> httpx.Response:
    content = body if isinstance(body, (str, bytes)) else json.dumps(body)
    return httpx.post(srv[0] + "/v1" + path, content=content, headers={"Content-Type": "application/json"},
                      timeout=60, **kw)


def error_of(r: httpx.Response, status: int = 400) -> dict:
    assert r.status_code == status, r.text
    err = r.json()["error"]
    assert set(err) == {"message", "type", "param", "code"}
    return err


def still_serving(srv) -> None:
    r = post(srv, "/completions", {"prompt": "hello", "max_tokens": 2})
    assert r.status_code == 200, r.text


def test_completions_fan_out_is_capped(srv):
    from vlmctl.serve.schema import MAX_SEQUENCES

    prompts = 1 + MAX_SEQUENCES // 128
    err = error_of(post(srv, "/completions", {"prompt": ["hi"] * prompts, "n": 128, "max_tokens": 1}))
    assert err["param"] == "prompt" and str(MAX_SEQUENCES) in err["message"], err
    err = error_of(post(srv, "/completions", {"prompt": ["hi"] * (MAX_SEQUENCES + 1), "max_tokens": 1}))
    assert err["param"] == "prompt"
    still_serving(srv)


@pytest.mark.parametrize("depth", [150, 5000])
def test_deeply_nested_json_is_a_400(srv, depth):
    body = ('{"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2, "metadata": '
            + "[" * depth + "]" * depth + "}")
    err = error_of(post(srv, "/chat/completions", body))
    assert "deep" in err["message"], err
    k = depth // 3  # each level of this schema is three of JSON's
    schema = '{"type": "object", "properties": {"a": ' * k + "{}" + "}}" * k
    body = ('{"prompt": "hi", "max_tokens": 2, "response_format": {"type": "json_schema", "json_schema": '
            '{"name": "deep", "schema": ' + schema + "}}}")
    err = error_of(post(srv, "/completions", body))
    assert "deep" in err["message"], err
    still_serving(srv)


@pytest.mark.parametrize("endpoint,change,param", [
    ("/completions", {"max_tokens": "5"}, "max_tokens"),
    ("/completions", {"max_tokens": 5.0}, "max_tokens"),
    ("/completions", {"logprobs": True}, "logprobs"),
    ("/completions", {"stream": "yes"}, "stream"),
    ("/chat/completions", {"temperature": "0.5"}, "temperature"),
    ("/chat/completions", {"n": True}, "n"),
    ("/chat/completions", {"stream": True, "stream_options": {"include_usage": "yes"}}, "stream_options.include_usage"),
])
def test_wrong_json_types_are_refused_not_coerced(srv, endpoint, change, param):
    base = {"prompt": "hi"} if endpoint == "/completions" else {"messages": [{"role": "user", "content": "hi"}]}
    err = error_of(post(srv, endpoint, {**base, "max_tokens": 2, **change}))
    assert err["param"] == param and err["message"].startswith(param + ":"), err


@pytest.mark.parametrize("body,param,words", [
    ({"messages": [{"role": "user", "content": [{"type": "text"}]}]}, "messages[0].content[0].text", "required"),
    ({"messages": [{"role": "user", "content": [{"type": "image_url", "image_url": {"url": 5}}]}]},
     "messages[0].content[0].image_url.url", "valid string"),
    ({"messages": [{"role": "user", "content": "hi"}], "stop": 5}, "stop", "valid string, or a valid list"),
    ({"messages": [{"role": "user", "content": "hi"},
                   {"role": "assistant", "tool_calls": [{"id": "a", "type": "function", "function": {"name": "f"}}]}]},
     "messages[1].tool_calls[0].function.arguments", "required"),
])
def test_schema_errors_name_the_field_by_its_request_path(srv, body, param, words):
    err = error_of(post(srv, "/chat/completions", {**body, "max_tokens": 2}))
    assert err["param"] == param and words in err["message"] and "function-after" not in err["message"], err


def test_seed_must_fit_64_bits_and_is_not_wrapped(srv):
    client = openai.OpenAI(base_url=srv[0] + "/v1", api_key="none", max_retries=0, timeout=60)
    for seed in (2**63, -(2**63) - 1, 2**64):
        with pytest.raises(openai.BadRequestError) as e:
            client.completions.create(model="x", prompt="hi", max_tokens=2, seed=seed)
        assert e.value.body["param"] == "seed"
    model = client.models.list().data[0].id
    kw = dict(model=model, prompt="once upon", max_tokens=8, temperature=1.0)
    edge = [client.completions.create(seed=s, **kw).choices[0].text for s in (-1, 2**63 - 1, -(2**63))]
    assert all(isinstance(t, str) for t in edge)


def test_stream_options_include_usage_null_counts_as_not_sent(srv):
    r = post(srv, "/completions", {"prompt": "hi", "max_tokens": 2, "stream": True,
                                   "stream_options": {"include_usage": None}})
    assert r.status_code == 200, r.text
    chunks = [json.loads(line[6:]) for line in r.text.splitlines() if line.startswith("data: {")]
    assert chunks and all(c.get("usage") is None for c in chunks)


def test_model_routes(srv):
    client = openai.OpenAI(base_url=srv[0] + "/v1", api_key="none", max_retries=0, timeout=60)
    name = srv[1].state.model_name
    listed = client.models.list().data
    assert [m.id for m in listed] == [name]
    assert "/" not in (listed[0].model_extra or {}).get("root", ""), "the engine's path on the server's disk"
    assert client.models.retrieve(name).id == name
    with pytest.raises(openai.NotFoundError) as e:
        client.models.retrieve("no-such-model")
    assert e.value.body["code"] == "model_not_found" and e.value.body["type"] == "invalid_request_error"
    r = httpx.get(srv[0] + "/v1/no/such/route", timeout=30)
    assert error_of(r, 404)["type"] == "invalid_request_error"


def test_health_answers_head_and_405_says_what_is_allowed(srv):
    r = httpx.head(srv[0] + "/health", timeout=30)
    assert r.status_code == 200
    r = httpx.get(srv[0] + "/v1/chat/completions", timeout=30)
    error_of(r, 405)
    assert "POST" in r.headers.get("allow", ""), r.headers


def test_oversized_text_is_refused_before_tokenizing(srv):
    from vlmctl.errors import LimitError

    engine = srv[1].state.engine
    text = "x" * (8 * 1024 * 1024)
    with pytest.raises(LimitError) as e:
        engine.encode_text(text)
    assert "characters" in e.value.message  # the refusal counts characters: the tokenizer never ran
    n = len(engine.tokenizer(text[:200_000])["input_ids"])
    assert n > engine.limits.max_input_len  # what the refusal stands for: it cannot fit
    with pytest.raises(LimitError):
        engine.encode([{"role": "user", "content": [{"type": "text", "text": text}]}], [])
    err = error_of(post(srv, "/chat/completions", {"messages": [{"role": "user", "content": text}], "max_tokens": 2}))
    assert err["code"] == "limit_exceeded"
    # text that fits is still tokenized and served
    assert len(engine.encode_text("hello " * 50).token_ids) > 50


def test_the_bound_never_refuses_text_that_fits(srv):
    """The character bound is conservative: text right at the bound tokenizes to more than max_input_len."""
    engine = srv[1].state.engine
    engine._check_text_size(0)  # computes the vocabulary's longest entry
    longest = max(engine.tokenizer.get_vocab(), key=len)
    most = 2 * engine._longest_token * engine.limits.max_input_len
    text = (engine.tokenizer.convert_tokens_to_string([longest]) * (most // len(longest) + 1))[:most]
    assert len(engine.tokenizer(text)["input_ids"]) > engine.limits.max_input_len
    engine._check_text_size(most)  # not refused at the bound itself


def test_default_max_tokens_fits_the_kv_pool(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine
    from vlmctl.serve import schema as S
    from vlmctl.serve.openai_request import sampling_params

    engine = Engine(tiny_llava_engine, kv_cache_tokens=96)
    assert engine.limits.kv_cache_tokens < engine.limits.max_seq_len
    body = S.CompletionRequest.model_validate({"prompt": "hi"})
    params = sampling_params(engine, body, 40, None, None)
    assert params.max_tokens == engine.limits.kv_cache_tokens - 40
    prompt = engine.encode_text("a b c d e f g")
    engine.check_limits(prompt, sampling_params(engine, body, len(prompt.token_ids), None, None))


def test_scheduler_finish_many_takes_requests_out_of_both_queues(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.request import FINISHED, RUNNING, WAITING
    from vlmctl.runtime.sampling import SamplingParams

    engine = Engine(tiny_llava_engine, max_batch_size=2)
    reqs = [engine.submit(engine.encode_text(f"prompt {i}"), SamplingParams(max_tokens=4, temperature=0))
            for i in range(6)]
    engine.step()
    sched = engine.scheduler
    running, waiting = list(sched.running), list(sched.waiting)
    assert len(running) == 2 and len(waiting) == 4 and all(r.status == RUNNING for r in running)
    blocks_before = sched.pool.num_free()
    gone = [running[0], waiting[1], waiting[3]]
    sched.finish_many(gone)
    assert sched.running == [running[1]] and list(sched.waiting) == [waiting[0], waiting[2]]
    assert all(r.status == FINISHED and not r.block_ids for r in gone)
    assert sched.pool.num_free() > blocks_before  # the running one's blocks came back
    assert all(r.status == WAITING for r in sched.waiting)
    for _ in range(50):
        if not engine.has_work():
            break
        engine.step()
    assert not engine.has_work() and all(len(r.output_ids) == 4 for r in (running[1], waiting[0], waiting[2]))
    assert {r.id for r in reqs} >= {r.id for r in gone}
