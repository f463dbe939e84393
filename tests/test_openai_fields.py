"""The OpenAI request-field tables (vlmctl/serve/openai_fields.py) against the `openai` package.

The test walks the package's own TypedDicts for chat-completions and completions requests, so a
field that a new `openai` release adds fails here until vlmctl decides what to do with it; and it
checks request bodies that the official client itself serializes.
"""

from __future__ import annotations

import collections.abc
import json
import typing
from typing import Literal, Union, get_args, get_origin, get_type_hints

import httpx
import pytest

from vlmctl.errors import InputError
from vlmctl.serve.openai_fields import (CHAT_FIELDS, COMPLETION_FIELDS, DEFAULT_ONLY, IMPLEMENTED, NO_EFFECT,
                                        OPENAI_VERSION, REFUSED, check_request, request_problems)

openai = pytest.importorskip("openai", reason="the dev extra's openai package describes the requests")


def _strip(t):
    """Required[X], NotRequired[X], ReadOnly[X], Annotated[X, ...] -> X."""
    while True:
        o = get_origin(t)
        if o is not None and getattr(o, "_name", None) in ("Required", "NotRequired", "ReadOnly") or \
                o in (typing.Required, typing.NotRequired) or o is typing.Annotated:
            t = get_args(t)[0]
            continue
        return t


def _is_typeddict(t) -> bool:
    return isinstance(t, type) and hasattr(t, "__required_keys__") and hasattr(t, "__annotations__")


def _discriminator(td) -> str | None:
    hints = get_type_hints(td, include_extras=True)
    for k in ("type", "role"):
        t = _strip(hints.get(k)) if k in hints else None
        if t is not None and get_origin(t) is Literal and len(get_args(t)) == 1:
            return f"{k}={get_args(t)[0]}"
    return None


def openai_paths(root) -> list[str]:
    """Every field path of a request TypedDict, in the tables' notation, not descending below a field
    that the table does not mark implemented (its insides are never looked at)."""
    out: list[str] = []

    def walk(t, path, table):
        t = _strip(t)
        o = get_origin(t)
        if o is Union or str(o) == "<class 'types.UnionType'>":
            for a in get_args(t):
                walk(a, path, table)
            return
        if o in (list, collections.abc.Iterable, collections.abc.Sequence):
            walk(get_args(t)[0], path + "[]", table)
            return
        if not _is_typeddict(t):
            return
        d = _discriminator(t)
        p = path + (f"<{d}>" if d and path else "")
        if d and path:
            out.append(p)
            rule = table.get(p)
            if rule is None or rule.action != IMPLEMENTED:
                return
        for k, v in get_type_hints(t, include_extras=True).items():
            kp = f"{p}.{k}" if p else k
            out.append(kp)
            rule = table.get(kp)
            if rule is not None and rule.action == IMPLEMENTED:
                walk(v, kp, table)

    walk(root, "", TABLE_OF[root])
    return list(dict.fromkeys(out))


from openai.types import completion_create_params as _cp  # noqa: E402
from openai.types.chat import completion_create_params as _ccp  # noqa: E402

TABLE_OF = {_ccp.CompletionCreateParamsStreaming: CHAT_FIELDS, _cp.CompletionCreateParamsStreaming: COMPLETION_FIELDS}


@pytest.mark.parametrize("root", list(TABLE_OF), ids=["chat", "completions"])
def test_every_openai_field_has_a_decision(root):
    table = TABLE_OF[root]
    paths = openai_paths(root)
    assert len(paths) > 15
    missing = [p for p in paths if p not in table]
    assert not missing, (f"openai {openai.__version__} has request fields vlmctl has not decided on: {missing}; "
                         "add them to vlmctl/serve/openai_fields.py")
    from packaging.version import Version

    if Version(openai.__version__) >= Version(OPENAI_VERSION):  # an older client lacks newer fields
        stale = [k for k, r in table.items() if not r.extension and k not in paths]
        assert not stale, f"fields in the table that openai {openai.__version__} does not have: {stale}"


def test_rules_are_well_formed():
    for table in (CHAT_FIELDS, COMPLETION_FIELDS):
        for path, rule in table.items():
            assert rule.action in (IMPLEMENTED, NO_EFFECT, DEFAULT_ONLY, REFUSED), path
            assert (rule.action == DEFAULT_ONLY) == bool(rule.allowed), path
            if rule.action != IMPLEMENTED:
                assert rule.note, f"{path}: a field vlmctl does not implement needs its reason"
    # what issue 14 asks for is implemented, not refused
    for name in ("presence_penalty", "frequency_penalty", "logit_bias", "n", "response_format", "tools",
                 "tool_choice", "min_p", "repetition_penalty"):
        assert CHAT_FIELDS[name].action == IMPLEMENTED


# ---- checking bodies -----------------------------------------------------------------------------
IMG = "data:image/png;base64,iVBORw0KGgo="


def full_chat_body():
    return {
        "model": "m", "stream": True, "stream_options": {"include_usage": True},
        "messages": [
            {"role": "developer", "content": "be brief", "name": "ops"},
            {"role": "user", "content": [{"type": "text", "text": "what?"},
                                         {"type": "image_url", "image_url": {"url": IMG, "detail": "high"}}]},
            {"role": "assistant", "content": None, "tool_calls": [
                {"id": "c1", "type": "function", "function": {"name": "f", "arguments": "{}"}}]},
            {"role": "tool", "tool_call_id": "c1", "content": [{"type": "text", "text": "42"}]},
        ],
        "tools": [{"type": "function", "function": {"name": "f", "parameters": {"type": "object"}, "strict": True}}],
        "tool_choice": {"type": "function", "function": {"name": "f"}}, "parallel_tool_calls": False,
        "response_format": {"type": "json_schema", "json_schema": {"name": "x", "strict": True, "schema": {
            "type": "object", "properties": {"type": {"type": "string"}}}}},
        "temperature": 0.7, "top_p": 0.9, "n": 2, "seed": 1, "stop": ["\n"], "max_completion_tokens": 9,
        "presence_penalty": 0.5, "frequency_penalty": 0.5, "logit_bias": {"5": 1}, "logprobs": True,
        "top_logprobs": 2, "user": "u", "metadata": {"k": "v"}, "store": False, "service_tier": "auto",
        "top_k": 5, "min_p": 0.1, "repetition_penalty": 1.1, "prompt_cache_key": "k", "audio": None,
    }


def test_a_request_using_everything_vlmctl_implements_passes():
    assert request_problems(full_chat_body(), "chat") == []
    assert request_problems({"prompt": ["a", "b"], "max_tokens": 3, "echo": False, "best_of": 1, "suffix": "",
                             "logprobs": 2, "stream": False, "top_k": 3}, "completions") == []


@pytest.mark.parametrize("change, path, words", [
    ({"foo": 1}, "foo", "not a field"),
    ({"audio": {"voice": "alloy", "format": "mp3"}}, "audio", "no audio output"),
    ({"modalities": ["text", "audio"]}, "modalities", "only ['text']"),
    ({"store": True}, "store", "stores no completions"),
    ({"service_tier": "flex"}, "service_tier", "processing tiers"),
    ({"web_search_options": {}}, "web_search_options", "no web search"),
    ({"functions": [{"name": "f"}]}, "functions", "deprecated"),
    ({"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
     "tool_choice.type", "allowed_tools"),
    ({"tools": [{"type": "custom", "custom": {"name": "g"}}]}, "tools[0].type", "custom"),
    ({"response_format": {"type": "yaml"}}, "response_format.type", "not one this server knows"),
    ({"stream_options": {"include_usage": True, "extra": 1}}, "stream_options.extra", "not a field"),
    ({"reasoning_effort": "high"}, "reasoning_effort", "reasoning"),
])
def test_unknown_and_unsupported_fields_are_named(change, path, words):
    body = {**full_chat_body(), **change}
    problems = request_problems(body, "chat")
    assert [p for p, _ in problems] == [path]
    assert words in problems[0][1]
    with pytest.raises(InputError) as e:
        check_request(body, "chat")
    assert e.value.param == path


@pytest.mark.parametrize("mutate, path", [
    (lambda b: b["messages"][1]["content"].append({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}}),
     "messages[1].content[2].type"),
    (lambda b: b["messages"][1]["content"][1]["image_url"].update(color="red"), "messages[1].content[1].image_url.color"),
    (lambda b: b["messages"].append({"role": "function", "name": "f", "content": "x"}), "messages[4].role"),
    (lambda b: b["messages"][2].update(audio={"id": "a"}), "messages[2].audio"),
    (lambda b: b["messages"][3].update(extra=1), "messages[3].extra"),
    (lambda b: b["messages"].append({"content": "no role"}), "messages[4].role"),
])
def test_nested_problems_carry_their_full_path(mutate, path):
    body = full_chat_body()
    mutate(body)
    assert [p for p, _ in request_problems(body, "chat")] == [path]


def test_completions_table():
    assert [p for p, _ in request_problems({"prompt": "a", "echo": True}, "completions")] == ["echo"]
    assert request_problems({"prompt": "a", "best_of": 3}, "completions") == []  # served (serve/endpoints.py)
    assert [p for p, _ in request_problems({"prompt": "a", "suffix": "b"}, "completions")] == ["suffix"]
    assert [p for p, _ in request_problems({"prompt": "a", "messages": []}, "completions")] == ["messages"]
    assert request_problems({"prompt": "a", "suffix": None, "echo": None}, "completions") == []


def test_bodies_serialized_by_the_openai_client():
    """What the official client actually sends (captured at the HTTP transport) passes the check, and
    the parameters it sends that vlmctl refuses are named."""
    bodies = []

    def handler(request: httpx.Request) -> httpx.Response:
        bodies.append(json.loads(request.content))
        return httpx.Response(400, json={"error": {"message": "captured", "type": "invalid_request_error"}})

    client = openai.OpenAI(api_key="x", base_url="http://vlmctl.invalid/v1", max_retries=0,
                           http_client=httpx.Client(transport=httpx.MockTransport(handler)))
    ok = dict(model="m", messages=[{"role": "user", "content": [
        {"type": "text", "text": "hi"}, {"type": "image_url", "image_url": {"url": IMG}}]}],
        temperature=0.2, top_p=0.9, max_completion_tokens=5, seed=3, stop=["x"], n=2, presence_penalty=0.1,
        frequency_penalty=0.1, logit_bias={"3": -1}, logprobs=True, top_logprobs=1, user="u",
        response_format={"type": "json_object"}, stream_options=None,
        extra_body={"top_k": 4, "min_p": 0.05, "repetition_penalty": 1.2})
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**ok)
    assert request_problems(bodies[-1], "chat") == []
    with pytest.raises(openai.BadRequestError):
        client.chat.completions.create(**ok, modalities=["text", "audio"], audio={"voice": "alloy", "format": "wav"},
                                       reasoning_effort="low")
    assert sorted(p for p, _ in request_problems(bodies[-1], "chat")) == ["audio", "modalities", "reasoning_effort"]
    with pytest.raises(openai.BadRequestError):
        client.completions.create(model="m", prompt="a", max_tokens=3, best_of=2, echo=True, suffix="x")
    assert sorted(p for p, _ in request_problems(bodies[-1], "completions")) == ["echo", "suffix"]
