"""Tool calls (vlmctl/models/tool_calls.py and the tools side of models/chat.py).

Rendering goes through transformers' apply_chat_template with a Qwen2.5-VL-style template written
here (ChatML, vision parts, Hermes <tool_call> blocks); streamed deltas are accumulated by the
official `openai` client's own stream accumulator; forced calls are generated under the real
grammar engine and checked with the `jsonschema` validator.
"""

from __future__ import annotations

import json
import random

import jsonschema
import pytest
import torch
from tiny_models import QWEN2_VL_CHAT_TEMPLATE, TOOLS_TEMPLATE, make_qwen_tokenizer

from vlmctl.errors import InputError
from vlmctl.models.chat import render_chat
from vlmctl.models.tool_calls import (HERMES, ToolCallStreamParser, ToolChoice, call_schema, detect_format,
                                      forced_call_grammar, normalize_tools, parse_tool_calls, parse_tool_choice,
                                      template_renders_tools)

TOOLS = [
    {"type": "function", "function": {
        "name": "get_weather", "description": "Current weather in a city",
        "parameters": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 12},
                                                        "unit": {"enum": ["celsius", "fahrenheit"]}},
                       "required": ["city", "unit"], "additionalProperties": False}}},
    {"type": "function", "function": {
        "name": "count_objects", "description": "Count objects of a kind in the image",
        "parameters": {"type": "object", "properties": {"label": {"type": "string", "maxLength": 8},
                                                        "max": {"type": "integer", "minimum": 1, "maximum": 9}},
                       "required": ["label"], "additionalProperties": False}}},
]


@pytest.fixture(scope="module")
def tok():
    return make_qwen_tokenizer(tool_tokens=True)


# ---- request validation -----------------------------------------------------------------------
def test_tools_pass_through_normalized():
    tools = normalize_tools(TOOLS)
    assert tools == TOOLS
    bare = normalize_tools([{"type": "function", "function": {"name": "ping"}}])
    assert bare[0]["function"]["parameters"] == {"type": "object", "properties": {}}


@pytest.mark.parametrize("tools, words", [
    ([], "non-empty"), ({"a": 1}, "non-empty"), ([{"type": "retrieval"}], "only function tools"),
    ([{"type": "function", "function": {"name": "has space"}}], "letters, digits"),
    ([{"type": "function", "function": {"name": "x" * 65}}], "1-64"),
    ([{"type": "function", "function": {"name": "a"}}, {"type": "function", "function": {"name": "a"}}],
     "second function"),
    ([{"type": "function", "function": {"name": "a", "parameters": "x"}}], "JSON schema object"),
    ([{"type": "function", "function": {"name": "a", "strict": "yes"}}], "strict"),
    ([{"type": "function", "function": {"name": "a", "extra": 1}}], "unknown field"),
])
def test_bad_tools_are_refused(tools, words):
    with pytest.raises(InputError, match=words) as e:
        normalize_tools(tools)
    assert e.value.param == "tools"


def test_tool_choice():
    assert parse_tool_choice(None, TOOLS) == ToolChoice("auto")
    assert parse_tool_choice(None, None) == ToolChoice("none")
    assert parse_tool_choice("required", TOOLS).forced
    named = parse_tool_choice({"type": "function", "function": {"name": "count_objects"}}, TOOLS)
    assert named == ToolChoice("function", "count_objects") and named.forced
    for bad, words in [("sometimes", "must be"), ({"type": "function", "function": {"name": "nope"}}, "not among"),
                       ({"type": "function"}, "must be")]:
        with pytest.raises(InputError, match=words) as e:
            parse_tool_choice(bad, TOOLS)
        assert e.value.param == "tool_choice"
    with pytest.raises(InputError, match="needs tools"):
        parse_tool_choice("required", None)


# ---- rendering --------------------------------------------------------------------------------
def test_transformers_renders_tools_calls_and_results(tok):
    messages = [
        {"role": "user", "content": [{"type": "image_url", "image_url": {"url": "x"}},
                                     {"type": "text", "text": "How many cats, and the weather in Paris?"}]},
        {"role": "assistant", "content": None, "tool_calls": [
            {"id": "call_1", "type": "function", "function": {"name": "count_objects",
                                                              "arguments": '{"label": "cat"}'}},
            {"id": "call_2", "type": "function", "function": {"name": "get_weather",
                                                              "arguments": '{"city": "Paris", "unit": "celsius"}'}}]},
        {"role": "tool", "tool_call_id": "call_1", "content": "2"},
        {"role": "tool", "tool_call_id": "call_2", "content": [{"type": "text", "text": "18 C, sunny"}]},
    ]
    text = render_chat(tok, TOOLS_TEMPLATE, messages, normalize_tools(TOOLS))
    # transformers' tojson is json.dumps with its default separators, one tool per line
    assert "<tools>\n" + "\n".join(json.dumps(t, ensure_ascii=False) for t in TOOLS) + "\n</tools>" in text
    assert text.startswith("<|im_start|>system\nYou are a helpful assistant.\n\n# Tools\n\n")
    assert ('<|im_start|>assistant\n<tool_call>\n{"name": "count_objects", "arguments": {"label": "cat"}}\n'
            '</tool_call>\n<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}'
            '\n</tool_call><|im_end|>') in text
    assert ("<|im_start|>user\n<tool_response>\n2\n</tool_response>\n<tool_response>\n18 C, sunny\n"
            "</tool_response><|im_end|>\n<|im_start|>assistant\n") in text
    assert text.count("<|image_pad|>") == 1
    # without tools the same template is an ordinary ChatML prompt
    plain = render_chat(tok, TOOLS_TEMPLATE, messages[:1])
    assert "<tools>" not in plain and plain.endswith("<|im_start|>assistant\n")


def test_bad_tool_call_messages_are_input_errors(tok):
    bad = [{"role": "user", "content": "hi"},
           {"role": "assistant", "tool_calls": [{"type": "function", "function": {"name": "f", "arguments": "{x"}}]}]
    with pytest.raises(InputError, match="not valid JSON"):
        render_chat(tok, TOOLS_TEMPLATE, bad)


def test_format_detection_and_probe(tok):
    assert detect_format(TOOLS_TEMPLATE) == HERMES
    assert template_renders_tools(tok, TOOLS_TEMPLATE)
    assert detect_format(QWEN2_VL_CHAT_TEMPLATE) is None  # Qwen2-VL's template knows no tools
    assert not template_renders_tools(tok, QWEN2_VL_CHAT_TEMPLATE)


def test_family_processor_passes_tools_to_the_template(tmp_path, tok):
    from tiny_models import make_qwen2_vl

    from vlmctl.models.registry import detect_family

    ckpt = make_qwen2_vl(tmp_path / "q", version="2.5", text_layers=1, vision_depth=1)
    (ckpt / "chat_template.jinja").write_text(TOOLS_TEMPLATE)
    fam = detect_family(json.loads((ckpt / "config.json").read_text()))
    proc = fam.load_processor(ckpt)
    prompt = proc.encode([{"role": "user", "content": "weather?"}], [], tools=normalize_tools(TOOLS))
    text = proc.tokenizer.decode(prompt.token_ids)
    assert "get_weather" in text and "<tools>" in text
    assert "<tools>" not in proc.tokenizer.decode(proc.encode([{"role": "user", "content": "hi"}], []).token_ids)


# ---- parsing ----------------------------------------------------------------------------------
CALL_W = '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}\n</tool_call>'
CALL_C = '<tool_call>\n{"name": "count_objects", "arguments": {"label": "cat", "max": 3}}\n</tool_call>'
TEXTS = [
    "Just an answer.\n",
    CALL_W,
    "Let me look.\n" + CALL_W + "\n" + CALL_C,
    CALL_C + "\nAnd some words after the call. ",
    '<tool_call>\n{"name": "get_weather", "arguments": "{\\"city\\": \\"Rome\\", \\"unit\\": \\"celsius\\"}"}\n'
    '</tool_call>',  # arguments as a JSON string
    '<tool_call>\n{"arguments": {"label": "dog"}, "name": "count_objects"}\n</tool_call>',  # name last
    '<tool_call>\n{"name": "count_objects", "parameters": {"label": "x"}}\n</tool_call>',  # "parameters"
    '<tool_call>\n{"name": "nope", "arguments": {}}\n</tool_call>',  # not a tool: stays text
    "<tool_call>\n{not json}\n</tool_call> tail",  # malformed before a name: stays text
    'a < b <tool_ca and <tool_call>\n{"name": "count_objects", "arguments": {"label": "a}b\\"{"}}',  # unclosed
    '<tool_call>\n{"name": "get_weather", "arguments": {"city": "Par',  # cut by max_tokens
]


def test_parse_whole_text():
    names = {"get_weather", "count_objects"}
    content, calls = parse_tool_calls(TEXTS[2], tool_names=names)
    assert content == "Let me look."
    assert [(c.name, json.loads(c.arguments)) for c in calls] == [
        ("get_weather", {"city": "Paris", "unit": "celsius"}), ("count_objects", {"label": "cat", "max": 3})]
    assert calls[0].id != calls[1].id and calls[0].id.startswith("call_")
    assert parse_tool_calls(TEXTS[0], tool_names=names) == ("Just an answer.\n", [])
    assert parse_tool_calls(TEXTS[1], tool_names=names)[0] is None
    assert parse_tool_calls(TEXTS[3], tool_names=names)[0] == "\nAnd some words after the call."
    assert json.loads(parse_tool_calls(TEXTS[4], tool_names=names)[1][0].arguments) == {"city": "Rome",
                                                                                          "unit": "celsius"}
    assert parse_tool_calls(TEXTS[5], tool_names=names)[1][0].name == "count_objects"
    assert json.loads(parse_tool_calls(TEXTS[6], tool_names=names)[1][0].arguments) == {"label": "x"}
    assert parse_tool_calls(TEXTS[7], tool_names=names) == (TEXTS[7], [])
    assert parse_tool_calls(TEXTS[8], tool_names=names) == (TEXTS[8], [])
    content, calls = parse_tool_calls(TEXTS[9], tool_names=names)
    assert content == "a < b <tool_ca and" and json.loads(calls[0].arguments) == {"label": 'a}b"{'}
    content, calls = parse_tool_calls(TEXTS[10], tool_names=names)  # cut short: OpenAI keeps the partial call
    assert content is None and (calls[0].name, calls[0].arguments) == ("get_weather", '{"city": "Par')


def accumulate_with_openai_client(deltas, tools=None):
    """Feed the deltas as chat.completion.chunk events to the openai package's own accumulator."""
    from openai.lib.streaming.chat import ChatCompletionStreamState
    from openai.types.chat import ChatCompletionChunk

    state = ChatCompletionStreamState()
    chunks = [{"role": "assistant"}] + list(deltas)
    finish = "tool_calls" if any("tool_calls" in d for d in deltas) else "stop"
    for i, d in enumerate(chunks + [None]):
        choice = {"index": 0, "delta": d or {}, "finish_reason": finish if d is None else None}
        state.handle_chunk(ChatCompletionChunk.model_validate({
            "id": "chatcmpl-1", "object": "chat.completion.chunk", "created": 0, "model": "m", "choices": [choice]}))
    return state.get_final_completion().choices[0]


@pytest.mark.parametrize("text", TEXTS, ids=range(len(TEXTS)))
def test_stream_equals_whole_for_any_chunking(text):
    names = {"get_weather", "count_objects"}
    want_content, want_calls = parse_tool_calls(text, tool_names=names)
    rng = random.Random(len(text))
    splits = [[1] * len(text), [3] * len(text), [len(text)], [rng.randint(1, 9) for _ in range(len(text))]]
    for sizes in splits:
        p = ToolCallStreamParser(tool_names=names)
        deltas, pos = [], 0
        for n in sizes:
            if pos >= len(text):
                break
            deltas += p.feed(text[pos:pos + n])
            pos += n
        deltas += p.finish()
        assert p.malformed == (text is TEXTS[10])
        # the shape OpenAI streams: a header per call (id, type, name, empty arguments), then pieces
        for d in deltas:
            assert set(d) in ({"content"}, {"tool_calls"})
            for tc in d.get("tool_calls", []):
                assert set(tc) in ({"index", "id", "type", "function"}, {"index", "function"})
                assert ("id" in tc) == ("name" in tc["function"])
                if "id" in tc:
                    assert tc["function"]["arguments"] == ""
        choice = accumulate_with_openai_client(deltas)
        got_calls = choice.message.tool_calls or []
        assert [(c.function.name, c.function.arguments) for c in got_calls] == \
            [(c.name, c.arguments) for c in want_calls]
        assert (choice.message.content or None) == (want_content or None)
        assert p.has_calls == bool(want_calls)


def test_stream_sends_arguments_before_the_call_ends():
    p = ToolCallStreamParser(tool_names={"get_weather"})
    early = p.feed('<tool_call>\n{"name": "get_weather", "arguments": {"city": "Pa')
    assert early[0]["tool_calls"][0]["function"] == {"name": "get_weather", "arguments": ""}
    assert early[1]["tool_calls"][0]["function"]["arguments"] == '{"city": "Pa'
    assert p.feed('ris"')[0]["tool_calls"][0]["function"]["arguments"] == 'ris"'


# ---- forcing a call with the grammar engine --------------------------------------------------------
def test_call_schema_validates_calls():
    s = call_schema(normalize_tools(TOOLS))
    jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, s)
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"label": "x"}}, s)
    named = call_schema(normalize_tools(TOOLS), "count_objects")
    with pytest.raises(jsonschema.ValidationError):
        jsonschema.validate({"name": "get_weather", "arguments": {"city": "Oslo", "unit": "celsius"}}, named)


@pytest.mark.parametrize("choice, marker_tokens", [
    (ToolChoice("required"), True), (ToolChoice("function", "count_objects"), True),
    (ToolChoice("function", "get_weather"), True),
    (ToolChoice("required"), False),  # a vocabulary without the marker tokens: the markers are spelled out
], ids=["required", "named1", "named2", "required-spelled"])
def test_forced_call_grammar_generates_valid_calls(tok, choice, marker_tokens):
    from vlmctl.runtime.grammar import GrammarCompiler, GrammarSpec, apply_masks

    if not marker_tokens:
        tok = make_qwen_tokenizer()
        assert "<[" not in forced_call_grammar(normalize_tools(TOOLS), choice, tok)
    tools = normalize_tools(TOOLS)
    eos = tok.convert_tokens_to_ids("<|im_end|>")
    comp = GrammarCompiler(tok, stop_token_ids=[eos])
    spec = GrammarSpec.lark(forced_call_grammar(tools, choice, tok))
    open_id = tok.convert_tokens_to_ids("<tool_call>")
    pieces = tok.convert_ids_to_tokens(list(range(len(tok))))
    lean = torch.tensor([4.0 * any(c in (p or "") for c in '"}],') for p in pieces])
    lean[eos] = 6.0
    by_name = {t["function"]["name"]: t["function"]["parameters"] for t in tools}
    for seed in range(4):
        g = torch.Generator().manual_seed(seed)
        m = comp.matcher(spec)
        out = []
        for _ in range(300):
            logits = torch.randn(1, comp.vocab_size, generator=g) + lean
            apply_masks(logits, [m])
            t = int((logits - torch.empty_like(logits).exponential_(generator=g).log()).argmax())
            assert m.accept(t)
            if t == eos:
                break
            out.append(t)
        else:
            pytest.fail("no end of turn")
        if marker_tokens:
            assert out[0] == open_id, "the call opens with the <tool_call> token itself, as the model was trained"
        text = tok.decode(out, skip_special_tokens=True)  # the engine's detokenization keeps the markers
        content, calls = parse_tool_calls(text, tool_names=set(by_name))
        assert content is None and calls
        for c in calls:
            if choice.mode == "function":
                assert c.name == choice.name
            jsonschema.validate(json.loads(c.arguments), by_name[c.name])


def test_forced_grammar_needs_a_forcing_choice(tok):
    with pytest.raises(ValueError):
        forced_call_grammar(normalize_tools(TOOLS), ToolChoice("auto"), tok)
