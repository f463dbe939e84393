"""Tool calls: OpenAI `tools` / `tool_choice` in, the chat template's call format out and back.

What it is: validation of the request's `tools` and `tool_choice`; detection of the call format a
checkpoint's chat template speaks (and whether it renders `tools` at all); parsing generated text
into OpenAI `tool_calls`, whole (`parse_tool_calls`) or as a stream of OpenAI deltas
(`ToolCallStreamParser`); and the grammar (Lark text, for runtime/grammar.py) that forces a call
when `tool_choice` is "required" or names a function. The messages side (assistant `tool_calls`,
`role: tool` results) is rendered by models/chat.py.

The format belongs to the template the model was trained with, not to the vision family:
  hermes  `<tool_call>\\n{"name": ..., "arguments": {...}}\\n</tool_call>` after the text, results
          in `<tool_response>` blocks: Qwen2.5 / Qwen2.5-VL / Qwen3 templates, InternVL 2.5/3 (Qwen2.5
          language models), NousResearch Hermes 2 Pro / 3. The only format vlmctl's families ship.
A template without a format (LLaVA-1.5's Vicuna prompt, Qwen2-VL's and LLaVA-OneVision's vision
templates) cannot take `tools`: the server refuses them with a 400 rather than invent a prompt.

What it is not: the grammar engine (runtime/grammar.py) or the HTTP layer.
"""

from __future__ import annotations

import json
import re
import uuid
from dataclasses import dataclass, field
from typing import Any

from ..errors import InputError

HERMES = "hermes"
FORMATS = (HERMES,)
_OPEN, _CLOSE = "<tool_call>", "</tool_call>"
_NAME_RE = re.compile(r"^[a-zA-Z0-9_-]{1,64}$")  # OpenAI's rule for function names


# ---- the request ------------------------------------------------------------------------------
def normalize_tools(tools: Any) -> list[dict]:
    """OpenAI `tools` -> the list the chat template gets ({"type": "function", "function": {...}}).
    InputError (param "tools") for anything OpenAI would refuse."""
    if not isinstance(tools, list) or not tools:
        raise InputError("tools must be a non-empty array of {\"type\": \"function\", \"function\": {...}}",
                         param="tools")
    out, names = [], set()
    for i, t in enumerate(tools):
        where = f"tools[{i}]"
        if not isinstance(t, dict) or t.get("type") != "function" or not isinstance(t.get("function"), dict):
            raise InputError(f"{where} must be {{\"type\": \"function\", \"function\": {{...}}}} (only function "
                             "tools exist)", param="tools")
        fn = t["function"]
        unknown = set(fn) - {"name", "description", "parameters", "strict"}
        if unknown:
            raise InputError(f"{where}.function has unknown field(s) {', '.join(sorted(unknown))}", param="tools")
        name = fn.get("name")
        if not isinstance(name, str) or not _NAME_RE.match(name):
            raise InputError(f"{where}.function.name must be 1-64 letters, digits, _ or - (got {name!r})",
                             param="tools")
        if name in names:
            raise InputError(f"{where}: a second function named {name!r}", param="tools")
        names.add(name)
        if "description" in fn and not isinstance(fn["description"], str):
            raise InputError(f"{where}.function.description must be a string", param="tools")
        params = fn.get("parameters", {"type": "object", "properties": {}})
        if not isinstance(params, dict):
            raise InputError(f"{where}.function.parameters must be a JSON schema object", param="tools")
        if "strict" in fn and not isinstance(fn["strict"], bool):
            raise InputError(f"{where}.function.strict must be true or false", param="tools")
        clean = {"name": name}
        if fn.get("description") is not None:
            clean["description"] = fn["description"]
        clean["parameters"] = params
        out.append({"type": "function", "function": clean})
    return out


@dataclass(frozen=True)
class ToolChoice:
    """mode: "none" (tools not shown, no call parsed), "auto" (the model decides; calls parsed),
    "required" (at least one call, forced by grammar), "function" (a call to `name`, forced)."""

    mode: str
    name: str | None = None

    @property
    def forced(self) -> bool:
        return self.mode in ("required", "function")


def parse_tool_choice(tool_choice: Any, tools: list[dict] | None) -> ToolChoice:
    """OpenAI `tool_choice` (absent: "auto" with tools, "none" without). InputError otherwise."""
    names = [t["function"]["name"] for t in tools or []]
    if tool_choice is None:
        return ToolChoice("auto" if names else "none")
    if isinstance(tool_choice, str):
        if tool_choice not in ("none", "auto", "required"):
            raise InputError(f"tool_choice must be none, auto, required or a named function (got {tool_choice!r})",
                             param="tool_choice")
        if tool_choice != "none" and not names:
            raise InputError(f"tool_choice {tool_choice!r} needs tools", param="tool_choice")
        return ToolChoice(tool_choice)
    if isinstance(tool_choice, dict) and tool_choice.get("type") == "function" \
            and isinstance(tool_choice.get("function"), dict):
        name = tool_choice["function"].get("name")
        if name not in names:
            raise InputError(f"tool_choice names the function {name!r}, which is not among the tools",
                             param="tool_choice")
        return ToolChoice("function", name)
    raise InputError("tool_choice must be none, auto, required or {\"type\": \"function\", \"function\": "
                     "{\"name\": ...}}", param="tool_choice")


# ---- the template -----------------------------------------------------------------------------
def detect_format(template: str) -> str | None:
    """The call format a chat template speaks, from the markers it writes; None: no tool calls."""
    if _OPEN in template and _CLOSE in template:
        return HERMES
    return None


def template_renders_tools(tokenizer, template: str) -> bool:
    """Whether the template shows `tools` to the model: render a probe tool and look for it."""
    probe = {"type": "function", "function": {"name": "vlmctl_probe_fn", "description": "probe",
                                              "parameters": {"type": "object", "properties": {}}}}
    try:
        text = tokenizer.apply_chat_template([{"role": "user", "content": "hi"}], tools=[probe],
                                             chat_template=template, tokenize=False, add_generation_prompt=True)
    except Exception:
        return False
    return "vlmctl_probe_fn" in text


# ---- parsing the output ------------------------------------------------------------------------
def new_call_id() -> str:
    return "call_" + uuid.uuid4().hex[:24]


@dataclass
class ToolCall:
    name: str
    arguments: str  # JSON text, as OpenAI returns it
    id: str = field(default_factory=new_call_id)

    def to_openai(self) -> dict:
        return {"id": self.id, "type": "function", "function": {"name": self.name, "arguments": self.arguments}}


def _skip_ws(s: str, i: int) -> int:
    while i < len(s) and s[i] in " \t\r\n":
        i += 1
    return i


def _scan_string(s: str, i: int) -> int | None:
    """s[i] is '"': the index after the closing quote, or None if the string is not finished."""
    j = i + 1
    while j < len(s):
        c = s[j]
        if c == "\\":
            j += 2
            continue
        if c == '"':
            return j + 1
        j += 1
    return None


def _scan_value(s: str, i: int) -> int | None:
    """The end of the JSON value starting at s[i] (not validated), or None if it is not finished."""
    c = s[i]
    if c == '"':
        return _scan_string(s, i)
    if c in "{[":
        depth, j = 0, i
        while j < len(s):
            c = s[j]
            if c == '"':
                e = _scan_string(s, j)
                if e is None:
                    return None
                j = e
                continue
            if c in "{[":
                depth += 1
            elif c in "}]":
                depth -= 1
                if depth == 0:
                    return j + 1
            j += 1
        return None
    j = i
    while j < len(s) and s[j] not in ",}] \t\r\n":
        j += 1
    return j if j < len(s) else None  # a number or literal ends only at a delimiter


@dataclass
class _Body:
    """What a (possibly unfinished) call body says so far."""

    name: str | None = None  # once its string is complete
    args_start: int | None = None
    args_end: int | None = None  # None: not finished (or not started)
    complete: bool = False  # the outer object closed
    invalid: bool = False  # not the shape {"name": ..., "arguments": ...}


def _scan_body(body: str) -> _Body:
    out = _Body()
    i = _skip_ws(body, 0)
    if i >= len(body):
        return out
    if body[i] != "{":
        out.invalid = True
        return out
    i += 1
    while True:
        i = _skip_ws(body, i)
        if i >= len(body):
            return out
        c = body[i]
        if c == "}":
            out.complete = True
            return out
        if c == ",":
            i += 1
            continue
        if c != '"':
            out.invalid = True
            return out
        kend = _scan_string(body, i)
        if kend is None:
            return out
        try:
            key = json.loads(body[i:kend])
        except ValueError:
            out.invalid = True
            return out
        i = _skip_ws(body, kend)
        if i >= len(body):
            return out
        if body[i] != ":":
            out.invalid = True
            return out
        i = _skip_ws(body, i + 1)
        if i >= len(body):
            return out
        vend = _scan_value(body, i)
        if key in ("arguments", "parameters"):
            out.args_start, out.args_end = i, vend
        elif key == "name" and vend is not None:
            try:
                name = json.loads(body[i:vend])
            except ValueError:
                out.invalid = True
                return out
            if not isinstance(name, str):
                out.invalid = True
                return out
            out.name = name
        if vend is None:
            return out
        i = vend


def _finish_call(body: str, tool_names) -> ToolCall | None:
    """A closed call body -> ToolCall, or None when it is not a well-formed call to a known tool."""
    try:
        obj = json.loads(body)
    except ValueError:
        return None
    if not isinstance(obj, dict) or not isinstance(obj.get("name"), str):
        return None
    if tool_names is not None and obj["name"] not in tool_names:
        return None
    scan = _scan_body(body)
    args = obj.get("arguments", obj.get("parameters", {}))
    if isinstance(args, str):  # some models write the arguments as a JSON string
        try:
            if not isinstance(json.loads(args), dict):
                return None
        except ValueError:
            return None
        text = args
    elif isinstance(args, dict):
        # the model's own text (its spacing kept), the same characters the stream sent
        text = body[scan.args_start:scan.args_end] if scan.args_start is not None else "{}"
    else:
        return None
    return ToolCall(obj["name"], text)


def parse_tool_calls(text: str, fmt: str = HERMES, tool_names=None) -> tuple[str | None, list[ToolCall]]:
    """Generated text -> (content, tool calls), as OpenAI's message has them: the stream parser run
    over the whole text, so a response is the same streamed or not. A block that is not a call to
    one of `tool_names` (None: any name) stays in the content; a call cut short (max_tokens) keeps
    the arguments it has, as OpenAI's do (the finish_reason says "length")."""
    p = ToolCallStreamParser(fmt, tool_names)
    deltas = p.feed(text) + p.finish()
    content = "".join(d["content"] for d in deltas if "content" in d)
    if p.calls:
        return content or None, p.calls
    return content, []


class ToolCallStreamParser:
    """Turns streamed text into OpenAI chat-completion deltas, as OpenAI streams tool calls:

        {"content": "..."}                                   text outside calls
        {"tool_calls": [{"index": i, "id": ..., "type": "function",
                         "function": {"name": ..., "arguments": ""}}]}   once a call's name is known
        {"tool_calls": [{"index": i, "function": {"arguments": "..."}}]} its arguments, piece by piece

    `feed(text_delta)` returns the deltas the new text allows; `finish()` the rest. Concatenated,
    they equal `parse_tool_calls` on the whole text (same content, names and argument text).
    Text that could still become `<tool_call>` and whitespace after the last visible character are
    held back until the next text decides (trailing whitespace is dropped when calls were made).
    A call whose JSON turns out malformed after its name was sent cannot be taken back: its
    arguments stop where they were, and `malformed` counts it.
    """

    def __init__(self, fmt: str = HERMES, tool_names=None):
        if fmt != HERMES:
            raise ValueError(f"unknown tool-call format {fmt!r}")
        self.tool_names = None if tool_names is None else set(tool_names)
        self.text = ""
        self.calls: list[ToolCall] = []  # announced calls, in index order
        self.malformed = 0
        self._pos = 0  # text[:_pos] is handled
        self._in_call = False
        self._ws_held = ""  # whitespace not sent yet
        self._current: ToolCall | None = None  # the open call, once announced

    @property
    def has_calls(self) -> bool:
        return bool(self.calls)

    def feed(self, delta: str) -> list[dict]:
        self.text += delta
        return self._step(final=False)

    def finish(self) -> list[dict]:
        out = self._step(final=True)
        if self._ws_held and not self.calls:
            out.append({"content": self._ws_held})
        self._ws_held = ""
        return out

    def _step(self, final: bool) -> list[dict]:
        out: list[dict] = []
        text = self.text
        while True:
            if not self._in_call:
                k = text.find(_OPEN, self._pos)
                if k >= 0:
                    self._emit_text(text[self._pos:k], out)
                    self._pos, self._in_call, self._current = k + len(_OPEN), True, None
                    continue
                safe = len(text)
                if not final:  # hold back what may still become "<tool_call>"
                    for n in range(min(len(_OPEN) - 1, len(text) - self._pos), 0, -1):
                        if _OPEN.startswith(text[len(text) - n:]):
                            safe -= n
                            break
                self._emit_text(text[self._pos:safe], out)
                self._pos = safe
                return out
            e = text.find(_CLOSE, self._pos)
            if e >= 0:
                self._call_progress(text[self._pos:e], True, True, out)
                self._pos, self._in_call = e + len(_CLOSE), False
                continue
            self._call_progress(text[self._pos:], final, False, out)
            if final:
                self._pos, self._in_call = len(text), False
            return out

    def _emit_text(self, s: str, out: list) -> None:
        """Send visible text, holding back trailing whitespace until more text decides."""
        if not s:
            return
        stripped = s.rstrip(" \t\r\n")
        if stripped:
            out.append({"content": self._ws_held + stripped})
            self._ws_held = s[len(stripped):]
        else:
            self._ws_held += s

    def _announce(self, call: ToolCall, out: list) -> None:
        self.calls.append(call)
        out.append({"tool_calls": [{"index": len(self.calls) - 1, "id": call.id, "type": "function",
                                    "function": {"name": call.name, "arguments": ""}}]})

    def _send_args(self, piece: str, out: list) -> None:
        self._current.arguments += piece
        out.append({"tool_calls": [{"index": len(self.calls) - 1, "function": {"arguments": piece}}]})

    def _call_progress(self, body: str, done: bool, closed: bool, out: list) -> None:
        scan = _scan_body(body)
        if self._current is None and scan.name is not None and not scan.invalid \
                and (self.tool_names is None or scan.name in self.tool_names):
            self._current = ToolCall(scan.name, "")
            self._announce(self._current, out)
        if self._current is not None and scan.args_start is not None and body[scan.args_start] == "{":
            end = scan.args_end if scan.args_end is not None else len(body)
            piece = body[scan.args_start + len(self._current.arguments):end]
            if piece:
                self._send_args(piece, out)
        if not done:
            return
        final = _finish_call(body, self.tool_names)
        if self._current is None:
            if final is None:  # never a call: the block is text after all
                self._emit_text(_OPEN + body + (_CLOSE if closed else ""), out)
            else:  # known only now (e.g. the arguments came before the name)
                self._current = ToolCall(final.name, "", id=final.id)
                self._announce(self._current, out)
                self._send_args(final.arguments, out)
        elif final is None or final.name != self._current.name \
                or not final.arguments.startswith(self._current.arguments):
            self.malformed += 1
        elif len(final.arguments) > len(self._current.arguments):
            self._send_args(final.arguments[len(self._current.arguments):], out)
        self._current = None


# ---- forcing a call ---------------------------------------------------------------------------
def call_schema(tools: list[dict], name: str | None = None) -> dict:
    """JSON schema of one call object {"name": ..., "arguments": {...}}: to the named function, or
    to any of the tools."""
    def one(fn):
        return {"type": "object", "properties": {"name": {"const": fn["name"]}, "arguments": fn["parameters"]},
                "required": ["name", "arguments"], "additionalProperties": False}

    fns = [t["function"] for t in tools]
    if name is not None:
        fns = [f for f in fns if f["name"] == name]
        if not fns:
            raise InputError(f"no tool named {name!r}", param="tool_choice")
    return one(fns[0]) if len(fns) == 1 else {"anyOf": [one(f) for f in fns]}


def _marker(tokenizer, text: str) -> str:
    """The Lark for a marker: its own token when the vocabulary has one (what the model was trained
    to emit; llguidance counts every added token as special, so only this syntax allows it), else
    the literal text."""
    tid = tokenizer.convert_tokens_to_ids(text)
    if isinstance(tid, int) and tid != tokenizer.unk_token_id and tokenizer.convert_ids_to_tokens(tid) == text:
        return f"<[{tid}]>"
    return json.dumps(text)


def forced_call_grammar(tools: list[dict], choice: ToolChoice, tokenizer, *, parallel: bool = True,
                        fmt: str = HERMES) -> str:
    """Lark grammar (llguidance's dialect) for tool_choice "required" / a named function: one call
    (or several when `parallel`) in the template's format, each call's arguments valid for its
    function's parameters schema, then the end of the turn."""
    if fmt != HERMES:
        raise ValueError(f"unknown tool-call format {fmt!r}")
    if not choice.forced:
        raise ValueError(f"tool_choice {choice.mode!r} does not force a call")
    schema = dict(call_schema(tools, choice.name if choice.mode == "function" else None))
    # JSON whitespace as the model likes it; \u escapes allowed (see runtime/grammar.py)
    schema["x-guidance"] = {"whitespace_flexible": True, "json_allow_general_unicode_escapes": True}
    repeat = ' ("\\n" call)*' if parallel and choice.mode == "required" else ""
    return (f"start: call{repeat}\n"
            f"call: {_marker(tokenizer, _OPEN)} \"\\n\" %json {json.dumps(schema)} \"\\n\" "
            f"{_marker(tokenizer, _CLOSE)}\n")
