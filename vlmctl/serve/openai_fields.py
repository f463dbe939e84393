"""Every field of OpenAI's chat-completions and completions requests, and what vlmctl does with it.

What it is: the two tables (`CHAT_FIELDS`, `COMPLETION_FIELDS`), keyed by a field's path in the
request as the `openai` package's TypedDicts describe it (tests/test_openai_fields.py walks them,
so a field that a new `openai` release adds fails that test until it is decided here), plus the
vLLM-style extensions vlmctl accepts; and `request_problems` / `check_request`, which hold a raw
JSON body against a table so that an unknown or unsupported field is a 400 naming it, never
silently ignored.

Paths: `a.b` an object's key, `a[]` the items of an array, `a<type=x>` (or `<role=x>`) the variant
of a union that has that `type` (`role`) value. A null value counts as not sent. Actions:
  implemented   vlmctl honours it
  no_effect     accepted, and it cannot change the output here (a hint, an id, OpenAI billing);
                its contents are not checked
  default_only  accepted only with one of `allowed` (its value that changes nothing), else 400
  refused       400 naming it, whatever its value

What it is not: the pydantic request models (serve/schema.py) or the handlers (serve/app.py),
which use these tables.
"""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ..errors import InputError

IMPLEMENTED, NO_EFFECT, DEFAULT_ONLY, REFUSED = "implemented", "no_effect", "default_only", "refused"

# The `openai` release whose request types these tables were checked against, field by field.
OPENAI_VERSION = "3.57.0"


@dataclass(frozen=True)
class FieldRule:
    action: str
    note: str = ""
    allowed: tuple = ()  # default_only: the accepted values
    extension: bool = False  # not in OpenAI's schema (a vLLM-style extension)


def _impl(note: str = "", **kw) -> FieldRule:
    return FieldRule(IMPLEMENTED, note, **kw)


def _no_effect(note: str) -> FieldRule:
    return FieldRule(NO_EFFECT, note)


def _only(allowed: tuple, note: str) -> FieldRule:
    return FieldRule(DEFAULT_ONLY, note, allowed)


def _refused(note: str) -> FieldRule:
    return FieldRule(REFUSED, note)


# ---- shared pieces ---------------------------------------------------------------------------------
_CACHE_HINT = _no_effect("a prompt-caching hint: vlmctl caches prefixes on its own, and caching never changes "
                         "the output")


def _text_part(prefix: str) -> dict[str, FieldRule]:
    p = f"{prefix}<type=text>"
    return {p: _impl("a text part"), f"{p}.text": _impl(), f"{p}.type": _impl(),
            f"{p}.prompt_cache_breakpoint": _CACHE_HINT}


def _plain_role(role: str, note: str) -> dict[str, FieldRule]:
    m = f"messages[]<role={role}>"
    return {m: _impl(note), f"{m}.role": _impl(), f"{m}.content": _impl("a string or text parts"),
            **_text_part(f"{m}.content[]"),
            f"{m}.name": _impl("passed to the chat template with the message (most templates do not show it)")}


_SAMPLING = {
    "model": _impl("must name the served model (404 otherwise); may be omitted"),
    "frequency_penalty": _impl("OpenAI's formula over the output's token counts, -2..2 "
                               "(runtime/logits_processing.py)"),
    "presence_penalty": _impl("OpenAI's formula, -2..2 (runtime/logits_processing.py)"),
    "logit_bias": _impl("token id -> bias in -100..100, ids checked against the vocabulary "
                        "(runtime/logits_processing.py)"),
    "max_tokens": _impl("output tokens; defaults to what fits the engine"),
    "n": _impl("1..128 parallel samples of one prompt; choice i samples with seed + i; they share the prompt's "
               "KV through the prefix cache"),
    "seed": _impl("per-request generator: the same seed gives the same output for the same batch"),
    "stop": _impl("up to the engine's limit of stop strings; the stop string is not returned"),
    "stream": _impl("server-sent events, ending with data: [DONE]"),
    "stream_options": _impl("only with stream: true (400 otherwise, as OpenAI)"),
    "stream_options.include_usage": _impl("a last chunk with usage and no choices"),
    "stream_options.include_obfuscation": _no_effect("OpenAI pads chunks against length side channels; vlmctl "
                                                     "sends no padding, the content is the same"),
    "temperature": _impl("0..2; 0 is greedy"),
    "top_p": _impl("(0, 1]"),
    "user": _no_effect("an end-user id for OpenAI's abuse monitoring"),
}

# vLLM-style extensions (sent by clients as extra_body): what vlmctl adds to OpenAI's fields.
_EXTENSIONS = {
    "top_k": _impl("keep the k most likely tokens; 0 is off", extension=True),
    "min_p": _impl("transformers' MinPLogitsWarper after the temperature (runtime/logits_processing.py)",
                   extension=True),
    "repetition_penalty": _impl("transformers' RepetitionPenaltyLogitsProcessor over prompt + output; 1 is off "
                                "(runtime/logits_processing.py)", extension=True),
    "ignore_eos": _impl("keep generating past EOS up to max_tokens (benchmarks)", extension=True),
    "stop_token_ids": _impl("token ids that end the output like EOS", extension=True),
}

# ---- chat completions ------------------------------------------------------------------------------
_M = "messages[]"
CHAT_FIELDS: dict[str, FieldRule] = {
    "messages": _impl("rendered with the model's own chat template"),
    **_plain_role("developer", "rendered as a system message (templates know no developer role)"),
    **_plain_role("system", "a system message"),
    # user
    f"{_M}<role=user>": _impl("a user message"),
    f"{_M}<role=user>.role": _impl(),
    f"{_M}<role=user>.name": _impl("passed to the chat template with the message (most templates do not show it)"),
    f"{_M}<role=user>.content": _impl("a string, or text, image and video parts"),
    **_text_part(f"{_M}<role=user>.content[]"),
    f"{_M}<role=user>.content[]<type=image_url>": _impl("an image: data: URL, or http(s)/file when the server's "
                                                        "media policy allows; its placeholder goes where it is"),
    f"{_M}<role=user>.content[]<type=image_url>.type": _impl(),
    f"{_M}<role=user>.content[]<type=image_url>.image_url": _impl(),
    f"{_M}<role=user>.content[]<type=image_url>.image_url.url": _impl(),
    f"{_M}<role=user>.content[]<type=image_url>.image_url.detail": _no_effect(
        "a fidelity hint: images are processed at the resolution the engine was built for"),
    f"{_M}<role=user>.content[]<type=image_url>.prompt_cache_breakpoint": _CACHE_HINT,
    # vLLM's extension: video parts (video families only; the handler refuses them for others)
    f"{_M}<role=user>.content[]<type=video_url>": _impl("a video: data: URL, or http(s)/file when the server's "
                                                        "media policy allows (media/video.py samples its frames)",
                                                        extension=True),
    f"{_M}<role=user>.content[]<type=video_url>.type": _impl(extension=True),
    f"{_M}<role=user>.content[]<type=video_url>.video_url": _impl(extension=True),
    f"{_M}<role=user>.content[]<type=video_url>.video_url.url": _impl(extension=True),
    f"{_M}<role=user>.content[]<type=input_audio>": _refused("vlmctl serves vision-language models: no audio input"),
    f"{_M}<role=user>.content[]<type=file>": _refused("file inputs (PDFs) are not supported; send images"),
    # assistant (earlier turns)
    f"{_M}<role=assistant>": _impl("an earlier answer, rendered by the template"),
    f"{_M}<role=assistant>.role": _impl(),
    f"{_M}<role=assistant>.name": _impl("passed to the chat template with the message"),
    f"{_M}<role=assistant>.content": _impl("a string, or text/refusal parts; may be null with tool_calls"),
    **_text_part(f"{_M}<role=assistant>.content[]"),
    f"{_M}<role=assistant>.content[]<type=refusal>": _impl("rendered as text"),
    f"{_M}<role=assistant>.content[]<type=refusal>.type": _impl(),
    f"{_M}<role=assistant>.content[]<type=refusal>.refusal": _impl(),
    f"{_M}<role=assistant>.refusal": _impl("rendered as text after the content"),
    f"{_M}<role=assistant>.tool_calls": _impl("rendered in the template's call format (models/chat.py)"),
    f"{_M}<role=assistant>.tool_calls[]<type=function>": _impl(),
    f"{_M}<role=assistant>.tool_calls[]<type=function>.id": _impl("kept for the template (Hermes does not show it)"),
    f"{_M}<role=assistant>.tool_calls[]<type=function>.type": _impl(),
    f"{_M}<role=assistant>.tool_calls[]<type=function>.function": _impl(),
    f"{_M}<role=assistant>.tool_calls[]<type=function>.function.name": _impl(),
    f"{_M}<role=assistant>.tool_calls[]<type=function>.function.arguments": _impl("JSON text; 400 if not an object"),
    f"{_M}<role=assistant>.tool_calls[]<type=custom>": _refused("custom (free-text) tools are not supported"),
    f"{_M}<role=assistant>.audio": _refused("no audio output"),
    f"{_M}<role=assistant>.function_call": _refused("the deprecated functions API: use tools / tool_calls"),
    # tool results
    f"{_M}<role=tool>": _impl("a tool result, rendered by the template (Hermes: <tool_response>)"),
    f"{_M}<role=tool>.role": _impl(),
    f"{_M}<role=tool>.content": _impl("a string or text parts"),
    **_text_part(f"{_M}<role=tool>.content[]"),
    f"{_M}<role=tool>.tool_call_id": _impl("kept for the template"),
    f"{_M}<role=function>": _refused("the deprecated functions API: use role tool"),
    # sampling and output
    **_SAMPLING,
    "max_completion_tokens": _impl("output tokens (wins over max_tokens)"),
    "logprobs": _impl("the chosen tokens' log-probabilities"),
    "top_logprobs": _impl("0..20 alternatives per token; needs logprobs"),
    "parallel_tool_calls": _impl("false: at most one call (a forced call grammar makes exactly one)"),
    "response_format": _impl("structured output as a token mask (runtime/grammar.py)"),
    "response_format<type=text>": _impl("no constraint"),
    "response_format<type=text>.type": _impl(),
    "response_format<type=json_object>": _impl("any JSON object"),
    "response_format<type=json_object>.type": _impl(),
    "response_format<type=json_schema>": _impl("JSON valid for the schema"),
    "response_format<type=json_schema>.type": _impl(),
    "response_format<type=json_schema>.json_schema": _impl(),
    "response_format<type=json_schema>.json_schema.name": _impl("required, as OpenAI requires it"),
    "response_format<type=json_schema>.json_schema.description": _no_effect(
        "OpenAI shows it to the model; vlmctl enforces the schema itself"),
    "response_format<type=json_schema>.json_schema.schema": _impl("compiled by llguidance; unsupported keywords are "
                                                                  "a 400"),
    "response_format<type=json_schema>.json_schema.strict": _impl("true: objects with declared properties take no "
                                                                  "other keys"),
    "tools": _impl("function tools rendered by the template; 400 when the template has no call format"),
    "tools[]<type=function>": _impl(),
    "tools[]<type=function>.type": _impl(),
    "tools[]<type=function>.function": _impl(),
    "tools[]<type=function>.function.name": _impl(),
    "tools[]<type=function>.function.description": _impl(),
    "tools[]<type=function>.function.parameters": _impl("the arguments' JSON schema (enforced when the call is "
                                                        "forced)"),
    "tools[]<type=function>.function.strict": _impl("accepted; forced calls always follow the schema, auto calls are "
                                                    "parsed as generated"),
    "tools[]<type=custom>": _refused("custom (free-text) tools are not supported"),
    "tool_choice": _impl("none, auto, required, or a named function (models/tool_calls.py)"),
    "tool_choice<type=function>": _impl("force a call to this function"),
    "tool_choice<type=function>.type": _impl(),
    "tool_choice<type=function>.function": _impl(),
    "tool_choice<type=function>.function.name": _impl(),
    "tool_choice<type=allowed_tools>": _refused("allowed_tools subsets are not supported; send only those tools"),
    "tool_choice<type=custom>": _refused("custom (free-text) tools are not supported"),
    "functions": _refused("the deprecated functions API: use tools"),
    "function_call": _refused("the deprecated functions API: use tool_choice"),
    "audio": _refused("no audio output"),
    "modalities": _only((["text"],), "only text output"),
    "metadata": _no_effect("tags for OpenAI's stored completions; vlmctl stores nothing"),
    "store": _only((False,), "vlmctl stores no completions"),
    "moderation": _refused("no moderation service"),
    "prediction": _no_effect("predicted outputs only make OpenAI faster; the output is the same"),
    "prompt_cache_key": _CACHE_HINT,
    "prompt_cache_options": _CACHE_HINT,
    "prompt_cache_retention": _CACHE_HINT,
    "reasoning_effort": _refused("for reasoning models; vlmctl's models do not reason in a hidden channel"),
    "verbosity": _only(("medium",), "OpenAI's verbosity control for reasoning models"),
    "safety_identifier": _no_effect("an end-user id for OpenAI's abuse monitoring"),
    "service_tier": _only(("auto", "default"), "OpenAI's processing tiers"),
    "web_search_options": _refused("no web search"),
    **_EXTENSIONS,
}

# ---- (legacy) completions --------------------------------------------------------------------------
COMPLETION_FIELDS: dict[str, FieldRule] = {
    "prompt": _impl("a string; a list of strings gives n choices each, in order; token-id prompts are a 400"),
    **_SAMPLING,
    "logprobs": _impl("0..5 alternatives per token"),
    "echo": _only((False,), "echoing the prompt (with its logprobs) is not supported"),
    "suffix": _only(("",), "insertion needs a fill-in-the-middle model"),
    "best_of": _impl("best_of samples per prompt (seed + i), the n with the highest mean token log-probability "
                     "returned; not with stream"),
    # vLLM's extension: structured output for completions too
    **{k: FieldRule(r.action, r.note, r.allowed, extension=True) for k, r in CHAT_FIELDS.items()
       if k.startswith("response_format")},
    **_EXTENSIONS,
}

TABLES = {"chat": CHAT_FIELDS, "completions": COMPLETION_FIELDS}


# ---- checking a request ----------------------------------------------------------------------------
def _show(v: Any) -> str:
    s = repr(v)
    return s if len(s) <= 40 else s[:37] + "..."


def request_problems(body: dict, endpoint: str) -> list[tuple[str, str]]:
    """(path, message) for every field of `body` (the raw JSON object) that is unknown, refused or
    outside its accepted values; [] for a request vlmctl serves as asked."""
    table = TABLES[endpoint]
    out: list[tuple[str, str]] = []
    if not isinstance(body, dict):
        return [("body", "the request body must be a JSON object")]
    _check_object(body, "", "", table, out)
    return out


def check_request(body: dict, endpoint: str) -> None:
    """InputError (its `param` the field's path, e.g. `messages[1].content[0].type`) for the first
    problem `request_problems` finds."""
    problems = request_problems(body, endpoint)
    if problems:
        path, msg = problems[0]
        raise InputError(msg, param=path)


def _check_object(node: dict, gpath: str, cpath: str, table, out) -> None:
    for key, val in node.items():
        g = f"{gpath}.{key}" if gpath else key
        c = f"{cpath}.{key}" if cpath else key
        rule = table.get(g)
        if rule is None:
            out.append((c, f"{c} is not a field of this request that vlmctl knows"))
            continue
        if val is None or rule.action == NO_EFFECT:
            continue
        if rule.action == REFUSED:
            out.append((c, f"{c} is not supported by this server: {rule.note}"))
            continue
        if rule.action == DEFAULT_ONLY:
            if not any(val == a and type(val) is type(a) for a in rule.allowed):
                allowed = " or ".join(_show(a) for a in rule.allowed)
                out.append((c, f"{c}={_show(val)} is not supported by this server (only {allowed}): {rule.note}"))
            continue
        _check_value(val, g, c, table, out)


def _check_value(val: Any, g: str, c: str, table, out) -> None:
    if isinstance(val, list):
        item = g + "[]"
        if any(k.startswith(item) for k in table):
            for i, v in enumerate(val):
                _check_value(v, item, f"{c}[{i}]", table, out)
        return
    if not isinstance(val, dict):
        return
    discs = [d for d in ("role", "type") if any(k.startswith(f"{g}<{d}=") for k in table)]
    if discs and not any(isinstance(val.get(d), str) for d in discs):
        out.append((f"{c}.{discs[0]}", f"{c} needs a {discs[0]}"))
        return
    for disc in discs:
        tag = val.get(disc)
        if not isinstance(tag, str):
            continue
        variant = f"{g}<{disc}={tag}>"
        rule = table.get(variant)
        if rule is None:
            out.append((f"{c}.{disc}", f"{c}.{disc} {tag!r} is not one this server knows"))
        elif rule.action == REFUSED:
            out.append((f"{c}.{disc}", f"{c}.{disc} {tag!r} is not supported by this server: {rule.note}"))
        else:
            _check_object(val, variant, c, table, out)
        return
    if any(k.startswith(g + ".") for k in table):
        _check_object(val, g, c, table, out)
    # else a free-form object (a JSON schema, logit_bias, metadata): not this table's business
