"""Issue 14's API against a real `vlmctl serve` app on uvicorn, driven by the official `openai` client:
structured outputs, n > 1, penalties / min_p / logit_bias (against transformers' logits processors on
the same model), and a 400 naming every request field the server does not serve.

The tiny models are random: under a JSON grammar their favourite tokens are whitespace, which JSON
allows between any two tokens, so a document would rarely end within max_tokens. The structured-
output tests therefore send `logit_bias` -100 on the whitespace-only tokens (the API's own way to
steer a model); the grammar still decides everything else, and jsonschema checks the result.
"""

from __future__ import annotations

import json

import httpx
import jsonschema
import pytest
import torch

openai = pytest.importorskip("openai")


@pytest.fixture()
def client(srv):  # srv: conftest's (the tiny engine served for batches of 8)
    return openai.OpenAI(base_url=srv[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def model_of(srv) -> str:
    return srv[1].state.model_name


def no_whitespace(engine) -> dict[str, float]:
    tok = engine.tokenizer
    ids = [i for i in range(len(tok)) if tok.decode([i]) and not tok.decode([i]).strip()]
    assert ids
    return {str(i): -100 for i in ids}


USER = [{"role": "user", "content": "describe the picture in one sentence."}]

SCHEMAS = {
    "nested": {"type": "object", "properties": {
        "name": {"type": "string", "maxLength": 8},
        "size": {"type": "object", "properties": {"w": {"type": "integer", "minimum": 1, "maximum": 99},
                                                  "h": {"type": "integer", "minimum": 1, "maximum": 99}},
                 "required": ["w", "h"]}}, "required": ["name", "size"]},
    "enum": {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "ok": {"type": "boolean"},
                                              "kind": {"type": "string", "enum": ["cat", "dog"]}},
             "required": ["color", "ok", "kind"]},
    "array": {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 4},
                                                        "minItems": 1, "maxItems": 3}}, "required": ["tags"]},
    "bounded-numbers": {"type": "object", "properties": {
        "score": {"type": "number", "minimum": 0, "maximum": 10}, "n": {"type": "integer", "minimum": 3, "maximum": 7},
        "t": {"type": "number", "exclusiveMinimum": -1, "exclusiveMaximum": 1}}, "required": ["score", "n", "t"]},
}


def strictly(schema):
    """What strict mode promises: objects with declared properties have no other keys."""
    from vlmctl.runtime.grammar import close_objects

    return close_objects(schema)


# ---- structured outputs -------------------------------------------------------------------------
@pytest.mark.parametrize("name", list(SCHEMAS))
@pytest.mark.parametrize("sampling", [{"temperature": 0}, {"temperature": 1.0, "seed": 3}], ids=["greedy", "sampled"])
def test_json_schema_outputs_validate(srv, client, name, sampling):
    bias = no_whitespace(srv[1].state.engine)
    # strict closes the objects itself; a loose schema allows undeclared keys unless it says otherwise,
    # and a random model fills open objects with keys without end, so the loose case spells it out
    for strict, schema in ((True, SCHEMAS[name]), (False, strictly(SCHEMAS[name]))):
        rf = {"type": "json_schema",
              "json_schema": {"name": name.replace("-", "_"), "schema": schema, "strict": strict}}
        r = client.chat.completions.create(model=model_of(srv), messages=USER, response_format=rf, max_tokens=120,
                                           logit_bias=bias, **sampling)
        choice = r.choices[0]
        assert choice.finish_reason == "stop", choice
        doc = json.loads(choice.message.content)
        jsonschema.validate(doc, strictly(schema))
        # streamed: the same document, piece by piece
        with client.chat.completions.stream(model=model_of(srv), messages=USER, response_format=rf, max_tokens=120,
                                            logit_bias=bias, **sampling) as s:
            final = s.get_final_completion()
        assert final.choices[0].message.content == choice.message.content
        assert final.choices[0].finish_reason == "stop"


def test_json_object_on_both_endpoints(srv, client):
    bias = no_whitespace(srv[1].state.engine)
    r = client.chat.completions.create(model=model_of(srv), messages=USER, response_format={"type": "json_object"},
                                       max_tokens=120, temperature=0.7, seed=1, logit_bias=bias)
    assert isinstance(json.loads(r.choices[0].message.content), dict)
    rf = {"type": "json_schema", "json_schema": {"name": "e", "schema": SCHEMAS["enum"]}}
    c = client.completions.create(model=model_of(srv), prompt="a cat, a dog", max_tokens=60, temperature=0.7, seed=2,
                                  extra_body={"response_format": rf, "logit_bias": bias})
    jsonschema.validate(json.loads(c.choices[0].text), SCHEMAS["enum"])
    chunks = list(client.completions.create(model=model_of(srv), prompt="a cat, a dog", max_tokens=60, temperature=0.7,
                                            seed=2, stream=True,
                                            extra_body={"response_format": rf, "logit_bias": bias}))
    assert "".join(ch.choices[0].text for ch in chunks if ch.choices) == c.choices[0].text


def test_max_tokens_cuts_a_document_with_finish_reason_length(srv, client):
    rf = {"type": "json_schema", "json_schema": {"name": "n", "schema": SCHEMAS["nested"]}}
    r = client.chat.completions.create(model=model_of(srv), messages=USER, response_format=rf, max_tokens=3,
                                       temperature=0, logit_bias=no_whitespace(srv[1].state.engine))
    assert r.choices[0].finish_reason == "length" and r.usage.completion_tokens == 3
    with pytest.raises(json.JSONDecodeError):
        json.loads(r.choices[0].message.content)


def test_logprobs_under_a_grammar_are_the_models(srv, client):
    """Log-probabilities come from the model's logits, before the mask: a token the mask forced can
    be unlikely for the model (a masked distribution would give the forced '{' probability 1)."""
    rf = {"type": "json_object"}
    free = client.chat.completions.create(model=model_of(srv), messages=USER, max_tokens=1, temperature=0,
                                          logprobs=True, top_logprobs=3)
    r = client.chat.completions.create(model=model_of(srv), messages=USER, response_format=rf, max_tokens=1,
                                       temperature=0, logprobs=True, top_logprobs=3)
    first = r.choices[0].logprobs.content[0]
    assert first.token == "{" and first.logprob < -1e-3  # not certain for the model
    # the alternatives are the model's own top tokens, the same as without the grammar
    assert [t.token for t in first.top_logprobs] == [t.token for t in free.choices[0].logprobs.content[0].top_logprobs]


@pytest.mark.parametrize("rf, param, words", [
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "string", "pattern": "(["}}},
     "response_format.json_schema.schema", "cannot be used"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": {"type": "array", "uniqueItems": True}}},
     "response_format.json_schema.schema", "uniqueItems"),
    ({"type": "json_schema", "json_schema": {"schema": {"type": "object"}}}, "response_format.json_schema.name",
     "name is required"),
    ({"type": "json_schema", "json_schema": {"name": "x"}}, "response_format.json_schema.schema", "schema is required"),
    ({"type": "json_schema", "json_schema": {"name": "x", "schema": False}}, "response_format.json_schema.schema",
     "false"),
    ({"type": "yaml"}, "response_format.type", "not one this server knows"),
])
def test_bad_response_formats_are_400s_naming_the_field(srv, rf, param, words):
    r = httpx.post(srv[0] + "/v1/chat/completions", json={"messages": USER, "response_format": rf}, timeout=30)
    assert r.status_code == 400, r.text
    assert r.json()["error"]["param"] == param and words in r.json()["error"]["message"]


def test_ignore_eos_with_a_grammar_is_refused(srv):
    r = httpx.post(srv[0] + "/v1/chat/completions", json={"messages": USER, "response_format": {"type": "json_object"},
                                                          "ignore_eos": True}, timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "ignore_eos"


# ---- n > 1 --------------------------------------------------------------------------------------
def test_n_samples_have_their_own_seeds_and_share_the_prompt(srv, client):
    eng = srv[1].state.engine
    msgs = [{"role": "user", "content": "Tell me a story about a robot. " * 6}]  # several full KV blocks
    before = eng.stats()
    r = client.chat.completions.create(model=model_of(srv), messages=msgs, n=3, max_tokens=8, temperature=1.0, seed=11,
                                       logprobs=True)
    after = eng.stats()
    texts = [c.message.content for c in r.choices]
    assert [c.index for c in r.choices] == [0, 1, 2] and len(set(texts)) == 3
    # usage: the prompt once, the completions summed (OpenAI's accounting)
    single = client.chat.completions.create(model=model_of(srv), messages=msgs, max_tokens=8, temperature=1.0,
                                            seed=11)
    assert r.usage.prompt_tokens == single.usage.prompt_tokens
    assert r.usage.completion_tokens == sum(len(c.logprobs.content) for c in r.choices)
    # choice i samples with seed + i: each equals a single request with that seed
    for i in range(3):
        one = client.chat.completions.create(model=model_of(srv), messages=msgs, max_tokens=8, temperature=1.0,
                                             seed=11 + i)
        assert one.choices[0].message.content == texts[i]
    # the two siblings took the prompt's full blocks from the prefix cache (the leader prefilled them)
    bs = eng.limits.block_size
    full = (r.usage.prompt_tokens - 1) // bs * bs
    assert after["prefix_cache_hit_tokens"] - before["prefix_cache_hit_tokens"] >= 2 * full
    # streamed: the same three choices, each with its own finish
    stream = client.chat.completions.create(model=model_of(srv), messages=msgs, n=3, max_tokens=8, temperature=1.0,
                                            seed=11, stream=True, stream_options={"include_usage": True})
    got, finish, usage = {}, {}, None
    for chunk in stream:
        usage = chunk.usage or usage
        for c in chunk.choices:
            got[c.index] = got.get(c.index, "") + (c.delta.content or "")
            finish[c.index] = c.finish_reason or finish.get(c.index)
    assert [got[i] for i in range(3)] == texts
    assert [finish[i] for i in range(3)] == [c.finish_reason for c in r.choices]
    assert usage == r.usage


def test_completions_several_prompts_times_n(srv, client):
    r = client.completions.create(model=model_of(srv), prompt=["hello world", "a red square"], n=2, max_tokens=4,
                                  temperature=0.9, seed=5)
    assert [c.index for c in r.choices] == [0, 1, 2, 3]
    first = client.completions.create(model=model_of(srv), prompt="hello world", max_tokens=4, temperature=0.9, seed=5)
    second = client.completions.create(model=model_of(srv), prompt="a red square", max_tokens=4, temperature=0.9,
                                       seed=6)
    assert r.choices[0].text == first.choices[0].text and r.choices[3].text == second.choices[0].text
    assert r.usage.prompt_tokens == first.usage.prompt_tokens + second.usage.prompt_tokens
    assert r.usage.completion_tokens == 16


def test_best_of_returns_the_most_likely_samples(srv, client):
    """best_of 4, n 2: the two of the four samples (seeds seed..seed+3, the n = 4 choices) with the
    highest mean token log-probability, best first; usage counts all four."""
    kw = dict(model=model_of(srv), prompt="a red square on a blue background", max_tokens=6, temperature=1.3, seed=21)
    four = client.completions.create(n=4, logprobs=0, **kw)
    mean = [sum(c.logprobs.token_logprobs) / len(c.logprobs.token_logprobs) for c in four.choices]
    order = sorted(range(4), key=lambda i: mean[i], reverse=True)
    best = client.completions.create(n=2, extra_body={"best_of": 4}, **kw)
    assert [c.text for c in best.choices] == [four.choices[i].text for i in order[:2]]
    assert [c.index for c in best.choices] == [0, 1] and best.choices[0].logprobs is None
    assert best.usage.completion_tokens == four.usage.completion_tokens
    for body, words in (({"n": 3, "best_of": 2}, "at least n"), ({"best_of": 2, "stream": True}, "cannot be streamed")):
        r = httpx.post(srv[0] + "/v1/completions", json={"prompt": "a", "max_tokens": 2, **body}, timeout=30)
        assert r.status_code == 400 and r.json()["error"]["param"] == "best_of" and words in r.text


# ---- penalties and friends, against transformers on the same model ------------------------------
def hf_greedy(ckpt, messages, max_new_tokens: int, **generate_kwargs) -> str:
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    proc = AutoProcessor.from_pretrained(ckpt)
    model = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    inputs = proc(text=proc.apply_chat_template(messages, add_generation_prompt=True), return_tensors="pt")
    n = inputs["input_ids"].shape[1]
    procs = [p(n) for p in generate_kwargs.pop("processors", [])]
    from transformers import LogitsProcessorList

    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False,
                             logits_processor=LogitsProcessorList(procs), **generate_kwargs)
    ids = out[0, n:].tolist()
    if proc.tokenizer.eos_token_id in ids:
        ids = ids[:ids.index(proc.tokenizer.eos_token_id)]
    return proc.tokenizer.decode(ids, skip_special_tokens=True)


def openai_penalties(presence: float, frequency: float):
    """OpenAI's documented formula as a transformers LogitsProcessor: counts over the output only."""
    from transformers import LogitsProcessor

    class Penalties(LogitsProcessor):
        def __init__(self, prompt_len):
            self.prompt_len = prompt_len

        def __call__(self, input_ids, scores):
            out = input_ids[:, self.prompt_len:]
            counts = torch.zeros_like(scores).scatter_add_(1, out, torch.ones_like(out, dtype=scores.dtype))
            return scores - frequency * counts - presence * (counts > 0).to(scores.dtype)

    return Penalties


CHAT = [{"role": "user", "content": [{"type": "text", "text": "hello world! how are you?"}]}]


@pytest.mark.parametrize("fields, hf", [
    ({"extra_body": {"repetition_penalty": 1.8}}, {"repetition_penalty": 1.8}),
    ({"extra_body": {"repetition_penalty": 0.6}}, {"repetition_penalty": 0.6}),
    ({"presence_penalty": 1.5, "frequency_penalty": 0.8}, {"processors": [openai_penalties(1.5, 0.8)]}),
    ({"frequency_penalty": 2.0}, {"processors": [openai_penalties(0.0, 2.0)]}),
], ids=["repetition", "repetition-below-1", "presence+frequency", "frequency"])
def test_penalties_equal_transformers_processors(srv, client, tiny_llava, fields, hf):
    n = 24
    plain = client.chat.completions.create(model=model_of(srv), messages=CHAT, max_tokens=n, temperature=0)
    got = client.chat.completions.create(model=model_of(srv), messages=CHAT, max_tokens=n, temperature=0, **fields)
    assert got.choices[0].message.content == hf_greedy(tiny_llava, CHAT, n, **hf)
    assert got.choices[0].message.content != plain.choices[0].message.content  # the penalty mattered here
    assert plain.choices[0].message.content == hf_greedy(tiny_llava, CHAT, n)


def test_logit_bias_equals_transformers_sequence_bias(srv, client, tiny_llava):
    tok = srv[1].state.engine.tokenizer
    plain = client.chat.completions.create(model=model_of(srv), messages=CHAT, max_tokens=12, temperature=0)
    # push down the tokens greedy decoding picks first, push up one it did not
    first = tok(plain.choices[0].message.content, add_special_tokens=False)["input_ids"][:3]
    bias = {**{t: -8.0 for t in first}, 60: 6.0}
    got = client.chat.completions.create(model=model_of(srv), messages=CHAT, max_tokens=12, temperature=0,
                                         logit_bias={str(k): v for k, v in bias.items()})
    ref = hf_greedy(tiny_llava, CHAT, 12, sequence_bias={(t,): b for t, b in bias.items()})
    assert got.choices[0].message.content == ref != plain.choices[0].message.content


def test_min_p_one_keeps_only_the_top_token(srv, client):
    """min_p 1 removes every token less likely than the best: sampling at any temperature is greedy
    (transformers' MinPLogitsWarper semantics; the unit tests compare the filter itself)."""
    greedy = client.chat.completions.create(model=model_of(srv), messages=CHAT, max_tokens=16, temperature=0)
    for seed in (1, 2):
        r = client.chat.completions.create(model=model_of(srv), messages=CHAT, max_tokens=16, temperature=1.5,
                                           seed=seed, extra_body={"min_p": 1.0})
        assert r.choices[0].message.content == greedy.choices[0].message.content
    free = client.chat.completions.create(model=model_of(srv), messages=CHAT, max_tokens=16, temperature=1.5, seed=1)
    assert free.choices[0].message.content != greedy.choices[0].message.content


def test_penalized_and_plain_requests_share_a_batch(srv):
    """Only the rows that use an extra are adjusted: plain requests running beside penalized and
    constrained ones give exactly their solo answers."""
    import concurrent.futures as cf

    url = srv[0] + "/v1/chat/completions"

    def post(body):
        return httpx.post(url, json={"messages": CHAT, "max_tokens": 12, "temperature": 0, **body}, timeout=60).json()

    solo = post({})["choices"][0]["message"]["content"]
    bodies = [{}, {"repetition_penalty": 1.8}, {}, {"response_format": {"type": "json_object"}},
              {"frequency_penalty": 2.0}, {}]
    with cf.ThreadPoolExecutor(len(bodies)) as ex:
        outs = list(ex.map(post, bodies))
    for body, out in zip(bodies, outs):
        if not body:
            assert out["choices"][0]["message"]["content"] == solo
    assert srv[1].state.engine.max_running_seen > 1


# ---- every field vlmctl does not serve is a 400 that names it -----------------------------------
def _user_with(part):
    return [{"role": "user", "content": [part]}]


def _assistant(**kw):
    return [{"role": "user", "content": "hi"}, {"role": "assistant", "content": "ok", **kw}]


# table path -> (body changes, the param the 400 names)
NOT_SERVED = {
    "chat": {
        "audio": ({"audio": {"voice": "alloy", "format": "wav"}}, "audio"),
        "functions": ({"functions": [{"name": "f"}]}, "functions"),
        "function_call": ({"function_call": "auto"}, "function_call"),
        "moderation": ({"moderation": {"model": "x"}}, "moderation"),
        "reasoning_effort": ({"reasoning_effort": "low"}, "reasoning_effort"),
        "web_search_options": ({"web_search_options": {}}, "web_search_options"),
        "modalities": ({"modalities": ["text", "audio"]}, "modalities"),
        "store": ({"store": True}, "store"),
        "verbosity": ({"verbosity": "high"}, "verbosity"),
        "service_tier": ({"service_tier": "flex"}, "service_tier"),
        "messages[]<role=user>.content[]<type=input_audio>": (
            {"messages": _user_with({"type": "input_audio", "input_audio": {"data": "", "format": "wav"}})},
            "messages[0].content[0].type"),
        "messages[]<role=user>.content[]<type=file>": (
            {"messages": _user_with({"type": "file", "file": {"file_id": "f"}})}, "messages[0].content[0].type"),
        "messages[]<role=assistant>.tool_calls[]<type=custom>": (
            {"messages": _assistant(tool_calls=[{"id": "c", "type": "custom", "custom": {"name": "g", "input": ""}}])},
            "messages[1].tool_calls[0].type"),
        "messages[]<role=assistant>.audio": ({"messages": _assistant(audio={"id": "a"})}, "messages[1].audio"),
        "messages[]<role=assistant>.function_call": (
            {"messages": _assistant(function_call={"name": "f", "arguments": "{}"})}, "messages[1].function_call"),
        "messages[]<role=function>": ({"messages": [{"role": "function", "name": "f", "content": "x"}]},
                                      "messages[0].role"),
        "tools[]<type=custom>": ({"tools": [{"type": "custom", "custom": {"name": "g"}}]}, "tools[0].type"),
        "tool_choice<type=allowed_tools>": (
            {"tool_choice": {"type": "allowed_tools", "allowed_tools": {"mode": "auto", "tools": []}}},
            "tool_choice.type"),
        "tool_choice<type=custom>": ({"tool_choice": {"type": "custom", "custom": {"name": "g"}}}, "tool_choice.type"),
    },
    "completions": {
        "echo": ({"echo": True}, "echo"),
        "suffix": ({"suffix": "x"}, "suffix"),
    },
}
UNKNOWN = {
    "chat": [({"temprature": 1}, "temprature"), ({"messages": [{"role": "user", "content": "x", "nme": "a"}]},
                                                 "messages[0].nme"),
             ({"stream": True, "stream_options": {"include_usage": True, "x": 1}}, "stream_options.x"),
             ({"response_format": {"type": "json_schema", "json_schema": {"name": "a", "schema": {}, "extra": 1}}},
              "response_format.json_schema.extra"),
             ({"messages": _user_with({"type": "image_url", "image_url": {"url": "data:,", "colour": 1}})},
              "messages[0].content[0].image_url.colour")],
    "completions": [({"max_token": 3}, "max_token"), ({"logprob": 1}, "logprob")],
}


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_every_field_not_served_is_a_400_naming_it(srv, endpoint):
    from vlmctl.serve.openai_fields import DEFAULT_ONLY, REFUSED, TABLES

    table = TABLES[endpoint]
    not_served = {k for k, r in table.items() if r.action in (REFUSED, DEFAULT_ONLY)}
    assert set(NOT_SERVED[endpoint]) == not_served, "a refused or default-only field without a case here"
    base = ({"messages": [{"role": "user", "content": "hi"}]} if endpoint == "chat" else {"prompt": "hi"})
    path = "/v1/chat/completions" if endpoint == "chat" else "/v1/completions"
    for change, param in list(NOT_SERVED[endpoint].values()) + UNKNOWN[endpoint]:
        r = httpx.post(srv[0] + path, json={**base, "max_tokens": 2, **change}, timeout=30)
        assert r.status_code == 400, (change, r.text)
        err = r.json()["error"]
        assert err["param"] == param and param in err["message"], (change, err)
    # the values these fields may have are served
    allowed = {k: r.allowed[0] for k, r in table.items() if r.action == DEFAULT_ONLY}
    r = httpx.post(srv[0] + path, json={**base, "max_tokens": 2, **allowed}, timeout=30)
    assert r.status_code == 200, r.text


def test_fields_without_effect_are_accepted(srv, client):
    r = client.chat.completions.create(
        model=model_of(srv), messages=[{"role": "developer", "content": "be brief", "name": "ops"}] + USER,
        max_completion_tokens=3, user="u", metadata={"k": "v"}, store=False, service_tier="auto", verbosity="medium",
        safety_identifier="s", prompt_cache_key="k", prediction={"type": "content", "content": "x"},
        modalities=["text"], temperature=0)
    assert r.choices[0].finish_reason == "length"


def test_stream_options_without_stream_is_a_400(srv):
    r = httpx.post(srv[0] + "/v1/chat/completions", json={"messages": USER, "stream_options": {"include_usage": True}},
                   timeout=30)
    assert r.status_code == 400 and r.json()["error"]["param"] == "stream_options"


def test_version_route(srv):
    import vlmctl

    v = httpx.get(srv[0] + "/version", timeout=10).json()
    assert v["version"] == vlmctl.__version__ and v["model"] == model_of(srv)
    assert v["decoder_backend"] == "torch" and v["vision_backend"]
