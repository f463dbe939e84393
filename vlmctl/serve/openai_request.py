"""From an OpenAI request body to what the engine runs: parsing and checking the body, the
sampling parameters of each choice, the structured-output grammar of `response_format`, and the
tool plan of `tools` / `tool_choice`.

What it is not: the field tables (openai_fields.py), the request/response models (schema.py), the
tool-call format itself (models/tool_calls.py) or the grammar engine (runtime/grammar.py).

Decisions (docs/serving.md has the user's view):
- n > 1: choice i samples with seed `seed + i` (vLLM's rule), so choice 0 equals the n = 1 answer
  with the same seed; without a seed every choice draws from its own unseeded generator.
- `response_format` json_object / json_schema: the output is constrained by a token mask. Stop
  strings and stop_token_ids still end the output where they match (a document cut there is not
  complete); max_tokens cuts it too (finish_reason "length"); ignore_eos is refused (the grammar ends
  the document with EOS). Logprobs are the model's, from before the mask and the penalties.
- `tools`: rendered only when tool_choice is not "none"; refused (400 naming `tools`) when the
  model's chat template does not show tools; `required` / a named function force the call with a
  grammar; response_format other than text cannot be combined with tools that may be called.
"""

from __future__ import annotations

import json
import re
from dataclasses import dataclass
from typing import Any

from pydantic import ValidationError

from ..errors import BackendUnavailableError, InputError
from ..runtime.grammar import GrammarSpec
from ..runtime.logits_processing import LogitsParams
from ..runtime.sampling import SamplingParams
from . import schema as S
from .errors import APIError, validation_error
from .openai_fields import check_request

_SCHEMA_NAME = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for a json_schema's name


# Deeper bodies are refused before anything walks them recursively (the field checks, pydantic, the grammar
# compiler would each hit Python's recursion limit); a JSON schema this deep is far beyond real ones.
MAX_JSON_DEPTH = 100


def _nested_deeper(value, limit: int) -> bool:
    stack = [(value, 1)]
    while stack:
        node, depth = stack.pop()
        children = node.values() if isinstance(node, dict) else node if isinstance(node, list) else None
        if children is None:
            continue
        if depth > limit:
            return True
        stack.extend((c, depth + 1) for c in children if isinstance(c, (dict, list)))
    return False


async def parse_body(request, model_cls, endpoint: str):
    """The raw JSON body checked field by field against OpenAI's schema (openai_fields.py), then
    validated by `model_cls`: an APIError 400 naming the first field at fault otherwise."""
    raw = await request.body()
    try:
        body = json.loads(raw)
        too_deep = _nested_deeper(body, MAX_JSON_DEPTH)
    except (ValueError, UnicodeDecodeError) as e:
        raise APIError(400, f"malformed JSON body: {e}") from None
    except RecursionError:  # too deep for the parser itself
        too_deep = True
    if too_deep:
        raise APIError(400, f"the JSON body nests arrays and objects more than {MAX_JSON_DEPTH} deep")
    try:
        check_request(body, endpoint)
    except InputError as e:
        raise APIError(400, e.message, param=e.param) from None
    try:
        return model_cls.model_validate(body)
    except ValidationError as e:
        raise validation_error(e.errors()) from None


def check_model(body, model_name: str) -> None:
    if body.model is not None and body.model != model_name:
        raise APIError(404, f"the model {body.model!r} does not exist; this server serves {model_name!r}",
                       "invalid_request_error", "model", "model_not_found")


def check_stream_options(body) -> None:
    if body.stream_options is not None and not body.stream:
        raise APIError(400, "stream_options is only allowed when stream is true", param="stream_options")


def choice_seed(seed: int | None, i: int) -> int | None:
    return None if seed is None else seed + i


def sampling_params(engine, body, prompt_len: int, max_tokens: int | None, logprobs: int | None,
                    grammar: GrammarSpec | None = None) -> SamplingParams:
    """The parameters of choice 0 (see `choice_seed` for the others)."""
    if max_tokens is None:  # as much as fits: the sequence limit, and the whole KV pool where it is smaller
        room = min(engine.limits.max_seq_len, engine.limits.kv_cache_tokens or engine.limits.max_seq_len) - prompt_len
        max_tokens = max(1, min(engine.limits.max_output_len, room))
    lp = LogitsParams.from_request(presence_penalty=body.presence_penalty, frequency_penalty=body.frequency_penalty,
                                   repetition_penalty=body.repetition_penalty, min_p=body.min_p,
                                   logit_bias=body.logit_bias, vocab_size=engine.vocab_size)
    return SamplingParams(
        max_tokens=max_tokens, temperature=1.0 if body.temperature is None else body.temperature,
        top_p=1.0 if body.top_p is None else body.top_p, top_k=body.top_k or 0, seed=body.seed,
        stop=body.stop_list(), stop_token_ids=list(body.stop_token_ids or []), ignore_eos=bool(body.ignore_eos),
        logprobs=logprobs, presence_penalty=lp.presence_penalty, frequency_penalty=lp.frequency_penalty,
        repetition_penalty=lp.repetition_penalty, min_p=lp.min_p, logit_bias=dict(lp.logit_bias),
        grammar=grammar).validate()


# ---- structured output --------------------------------------------------------------------------
def response_format_spec(rf: dict[str, Any] | None) -> GrammarSpec | None:
    """OpenAI `response_format` -> the grammar its output must match (None: free text)."""
    if rf is None:
        return None
    kind = rf.get("type")
    if kind == "text":
        return None
    if kind == "json_object":
        return GrammarSpec.json_object()
    if kind != "json_schema":  # openai_fields refuses other types before this
        raise InputError(f"response_format.type {kind!r} is not one this server knows", param="response_format.type")
    js = rf.get("json_schema")
    if not isinstance(js, dict):
        raise InputError("response_format json_schema needs a json_schema object {name, schema, strict}",
                         param="response_format.json_schema")
    name = js.get("name")
    if not isinstance(name, str) or not _SCHEMA_NAME.match(name):
        raise InputError("response_format.json_schema.name is required: 1-64 letters, digits, _ or -",
                         param="response_format.json_schema.name")
    if "schema" not in js or js["schema"] is None:
        raise InputError("response_format.json_schema.schema is required (the JSON schema the output must match)",
                         param="response_format.json_schema.schema")
    strict = js.get("strict")
    if strict is not None and not isinstance(strict, bool):
        raise InputError("response_format.json_schema.strict must be true or false",
                         param="response_format.json_schema.strict")
    try:
        return GrammarSpec.json_schema(js["schema"], strict=bool(strict))
    except InputError as e:
        raise InputError(e.message, param="response_format.json_schema.schema") from None


async def compile_grammar(aeng, engine, spec: GrammarSpec | None, param: str) -> None:
    """Compile on the encode worker before the request is queued: a schema the grammar engine
    cannot use is a 400 naming `param`, never a failure inside a step."""
    if spec is None:
        return
    if engine.backend != "torch":
        raise InputError(f"{param} is not available with the TensorRT-LLM decoder backend (it samples inside its "
                         "executor, where vlmctl cannot mask the logits); rebuild with decoder.backend: torch",
                         param=param)
    schema_param = "response_format.json_schema.schema" if param == "response_format" and spec.kind == "json_schema" \
        else param
    try:
        await aeng.encode(engine.compile_grammar, spec)
    except InputError as e:
        raise InputError(e.message, param=schema_param) from None
    except BackendUnavailableError as e:
        raise InputError(e.message, param=param) from None


# ---- tools --------------------------------------------------------------------------------------
@dataclass(frozen=True)
class ToolPlan:
    """How one chat request uses tools: what the template shows, how calls are parsed, and the
    grammar that forces a call (None unless tool_choice is required or names a function)."""

    tools: list[dict]
    fmt: str
    names: frozenset
    parallel: bool  # parallel_tool_calls (default true); false: at most one call
    grammar: GrammarSpec | None


def plan_tools(engine, body: S.ChatCompletionRequest) -> ToolPlan | None:
    """None when no tool can be called (no tools, or tool_choice none): the template shows no tools
    then, and no call is parsed."""
    from ..models.tool_calls import forced_call_grammar, normalize_tools, parse_tool_choice

    tools = normalize_tools(body.tools) if body.tools is not None else None
    choice = parse_tool_choice(body.tool_choice, tools)
    if choice.mode == "none":
        return None
    fmt = engine.tool_format()
    if fmt is None:
        raise InputError("tools are not supported by this model: its chat template does not show tools to the model "
                         "(no tool-call format such as Hermes <tool_call> in it); send tool_choice none or no tools",
                         param="tools")
    if response_format_spec(body.response_format) is not None:
        raise InputError("response_format cannot be combined with tools the model may call (both would decide the "
                         "output's format); send tool_choice none, or response_format text", param="response_format")
    parallel = body.parallel_tool_calls is not False
    grammar = None
    if choice.forced:
        if engine.backend != "torch":
            raise InputError(f"tool_choice {choice.name or choice.mode!r} is forced with a grammar, which the "
                             "TensorRT-LLM decoder backend cannot apply (it samples inside its executor); use "
                             "tool_choice auto, or rebuild with decoder.backend: torch", param="tool_choice")
        grammar = GrammarSpec.lark(forced_call_grammar(tools, choice, engine.tokenizer, parallel=parallel, fmt=fmt))
    return ToolPlan(tools, fmt, frozenset(t["function"]["name"] for t in tools), parallel, grammar)
