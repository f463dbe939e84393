"""Tool calls through a real `vlmctl serve` app with the official `openai` client, on a tiny Qwen2.5-VL
whose chat template renders tools the Hermes way (tiny_models.TOOLS_TEMPLATE, with <tool_call> as an
added token, as in Qwen2.5's vocabulary).

The model is random, so it calls a tool only when tool_choice forces it (the grammar then also makes
the arguments valid for the function's schema); whitespace-only tokens get logit_bias -100 so a
call ends within max_tokens (see test_serve_api.py). Prompts are checked against transformers'
own rendering of the same messages and tools.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest

from conftest import write_recipe
from test_serve import start_uvicorn
from test_serve_api import no_whitespace
from test_tool_calls import TOOLS
from tiny_models import TOOLS_TEMPLATE, make_qwen2_vl

openai = pytest.importorskip("openai")

PARAMS = {t["function"]["name"]: t["function"]["parameters"] for t in TOOLS}
ASK = [{"role": "user", "content": "what is the weather in Paris?"}]


@pytest.fixture(scope="module")
def tsrv(tmp_path_factory):
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe
    from vlmctl.serve import ServerConfig, load_app

    d = tmp_path_factory.mktemp("tools")
    ckpt = make_qwen2_vl(d / "ckpt", version="2.5", seed=7, chat_template=TOOLS_TEMPLATE, tool_tokens=True)
    build(load_recipe(write_recipe(d / "r.yaml", ckpt, limits={"max_batch_size": 4, "max_input_len": 2048})),
          d / "eng")
    app = load_app(d / "eng", ServerConfig(stats_interval_s=0))
    url, stop = start_uvicorn(app)
    yield url, app, ckpt
    stop()


@pytest.fixture()
def client(tsrv):
    return openai.OpenAI(base_url=tsrv[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def create(tsrv, client, **kw):
    kw.setdefault("logit_bias", no_whitespace(tsrv[1].state.engine))
    return client.chat.completions.create(model=tsrv[1].state.model_name, **kw)


def hf_prompt_tokens(ckpt, messages, tools=None) -> int:
    """Tokens of the prompt as transformers renders it (arguments as objects, as templates take them)."""
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    msgs = []
    for m in messages:
        m = dict(m)
        if m.get("tool_calls"):
            m["tool_calls"] = [{"type": "function", "id": c["id"], "function": {
                "name": c["function"]["name"], "arguments": json.loads(c["function"]["arguments"])}}
                for c in m["tool_calls"]]
        msgs.append(m)
    text = tok.apply_chat_template(msgs, tools=tools, chat_template=TOOLS_TEMPLATE, add_generation_prompt=True,
                                   tokenize=False)
    return len(tok(text)["input_ids"])


def check_calls(message, names):
    assert message.content is None and message.tool_calls
    for c in message.tool_calls:
        assert c.type == "function" and c.id.startswith("call_") and c.function.name in names
        jsonschema.validate(json.loads(c.function.arguments), PARAMS[c.function.name])


@pytest.mark.parametrize("seed", [1, 2, 3])
def test_required_gives_valid_calls(tsrv, client, seed):
    r = create(tsrv, client, messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=150, temperature=0.9,
               seed=seed)
    assert r.choices[0].finish_reason == "tool_calls"
    check_calls(r.choices[0].message, set(PARAMS))
    assert r.usage.prompt_tokens == hf_prompt_tokens(tsrv[2], ASK, TOOLS)


def test_named_function_and_parallel_false_give_one_call(tsrv, client):
    named = {"type": "function", "function": {"name": "get_weather"}}
    for seed in (1, 2):
        r = create(tsrv, client, messages=ASK, tools=TOOLS, tool_choice=named, max_tokens=150, temperature=0.9,
                   seed=seed)
        check_calls(r.choices[0].message, {"get_weather"})
        assert len(r.choices[0].message.tool_calls) == 1
        r = create(tsrv, client, messages=ASK, tools=TOOLS, tool_choice="required", parallel_tool_calls=False,
                   max_tokens=150, temperature=0.9, seed=seed)
        assert len(r.choices[0].message.tool_calls) == 1


def test_streamed_calls_equal_the_whole_response(tsrv, client):
    kw = dict(messages=ASK, tools=TOOLS, tool_choice="required", max_tokens=150, temperature=0.9, seed=4,
              logit_bias=no_whitespace(tsrv[1].state.engine))
    whole = create(tsrv, client, **kw)
    chunks = list(client.chat.completions.create(model=tsrv[1].state.model_name, stream=True, **kw))
    first_calls = [tc for ch in chunks for c in ch.choices for tc in (c.delta.tool_calls or []) if tc.id]
    assert first_calls and all(tc.function.name and tc.function.arguments == "" and tc.type == "function"
                               for tc in first_calls)
    with client.chat.completions.stream(model=tsrv[1].state.model_name, **kw) as s:
        final = s.get_final_completion()
    got, want = final.choices[0], whole.choices[0]
    assert got.finish_reason == want.finish_reason == "tool_calls"
    assert not got.message.content
    assert [(c.function.name, c.function.arguments) for c in got.message.tool_calls] == \
        [(c.function.name, c.function.arguments) for c in want.message.tool_calls]


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_round_trip_call_result_answer(tsrv, client, stream):
    r = create(tsrv, client, messages=ASK, tools=TOOLS, tool_choice={"type": "function", "function": {
        "name": "get_weather"}}, max_tokens=150, temperature=0.5, seed=9)
    call = r.choices[0].message.tool_calls[0]
    history = ASK + [r.choices[0].message.model_dump(exclude_none=True),
                     {"role": "tool", "tool_call_id": call.id, "content": "18 C, sunny"}]
    kw = dict(messages=history, tools=TOOLS, max_tokens=6, temperature=0, logit_bias={})
    if stream:
        from openai.lib.streaming.chat import ChatCompletionStreamState

        state = ChatCompletionStreamState()  # the client's own accumulator (its .stream() helper refuses "length")
        for chunk in client.chat.completions.create(model=tsrv[1].state.model_name, stream=True,
                                                    stream_options={"include_usage": True}, **kw):
            state.handle_chunk(chunk)
        answer = state.current_completion_snapshot
    else:
        answer = create(tsrv, client, **kw)
    # the call and its result were rendered by the template, as transformers renders them
    assert answer.usage.prompt_tokens == hf_prompt_tokens(tsrv[2], history, TOOLS)
    assert answer.choices[0].finish_reason in ("stop", "length") and not answer.choices[0].message.tool_calls
    assert answer.choices[0].message.content


def test_auto_and_none(tsrv, client):
    auto = create(tsrv, client, messages=ASK, tools=TOOLS, max_tokens=5, temperature=0, logit_bias={})
    assert auto.usage.prompt_tokens == hf_prompt_tokens(tsrv[2], ASK, TOOLS)
    assert auto.choices[0].message.content and auto.choices[0].finish_reason in ("stop", "length")
    none = create(tsrv, client, messages=ASK, tools=TOOLS, tool_choice="none", max_tokens=5, temperature=0,
                  logit_bias={})
    plain = create(tsrv, client, messages=ASK, max_tokens=5, temperature=0, logit_bias={})
    assert none.usage.prompt_tokens == plain.usage.prompt_tokens == hf_prompt_tokens(tsrv[2], ASK)
    assert none.choices[0].message.content == plain.choices[0].message.content


@pytest.mark.parametrize("body, param, words", [
    ({"tool_choice": "required"}, "tool_choice", "needs tools"),
    ({"tools": TOOLS, "tool_choice": {"type": "function", "function": {"name": "nope"}}}, "tool_choice", "nope"),
    ({"tools": TOOLS, "response_format": {"type": "json_object"}}, "response_format", "cannot be combined"),
    ({"tools": [{"type": "function", "function": {"name": "bad name!"}}]}, "tools", "letters"),
    ({"messages": [{"role": "assistant", "content": None, "tool_calls": [
        {"id": "c", "type": "function", "function": {"name": "get_weather", "arguments": "{not json"}}]}]},
     None, "not valid JSON"),
])
def test_bad_tool_requests_are_400s(tsrv, body, param, words):
    r = httpx.post(tsrv[0] + "/v1/chat/completions", json={"messages": ASK, "max_tokens": 2, **body}, timeout=30)
    assert r.status_code == 400, r.text
    err = r.json()["error"]
    assert words in err["message"] and (param is None or err["param"] == param), err
