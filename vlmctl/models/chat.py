"""Chat-template helpers shared by family modules: finding the checkpoint's template and rendering it."""

from __future__ import annotations

import json
from pathlib import Path

from ..errors import CheckpointError, InputError


def load_chat_template(processor_dir: Path, tokenizer) -> str:
    """The processor's chat template if the checkpoint has one, else the tokenizer's."""
    jinja = processor_dir / "chat_template.jinja"
    if jinja.exists():
        return jinja.read_text()
    js = processor_dir / "chat_template.json"
    if js.exists():
        return json.loads(js.read_text())["chat_template"]
    proc_cfg = processor_dir / "processor_config.json"
    if proc_cfg.exists():
        tpl = json.loads(proc_cfg.read_text()).get("chat_template")
        if tpl:
            return tpl
    if getattr(tokenizer, "chat_template", None):
        return tokenizer.chat_template
    raise CheckpointError(f"{processor_dir}: the checkpoint has no chat template")


def normalize_messages(messages: list[dict]) -> list[dict]:
    """OpenAI-style or HF-style messages -> HF structured content ({"type": "text"|"image"|"video"}).

    Tool use: an assistant message's OpenAI `tool_calls` become HF's ({"type": "function",
    "function": {"name", "arguments": <object>}}, arguments parsed from their JSON text), and a
    `role: tool` message keeps its result as plain text (templates print it as it is)."""
    out = []
    for i, m in enumerate(messages):
        role = m.get("role")
        if role not in ("system", "user", "assistant", "tool"):
            raise InputError(f"message role must be system, user, assistant or tool (got {role!r})")
        content = m.get("content")
        if role == "tool":
            if isinstance(content, list):
                content = "".join(p.get("text", "") for p in content if p.get("type") == "text")
            msg = {"role": "tool", "content": content or ""}  # plain text: templates print it as it is
            if m.get("tool_call_id") is not None:
                msg["tool_call_id"] = m["tool_call_id"]
            out.append(msg)
            continue
        if content is None:
            content = []
        if isinstance(content, str):
            parts = [{"type": "text", "text": content}]
        else:
            parts = []
            for p in content:
                kind = p.get("type")
                if kind == "text":
                    parts.append({"type": "text", "text": p.get("text", "")})
                elif kind == "refusal" and role == "assistant":  # an earlier refusal, shown as what was said
                    parts.append({"type": "text", "text": p.get("refusal", "")})
                elif kind in ("image", "image_url"):
                    parts.append({"type": "image"})
                elif kind in ("video", "video_url"):
                    parts.append({"type": "video"})
                else:
                    raise InputError(f"unsupported content part type {kind!r}")
        if role == "assistant" and m.get("refusal"):
            parts.append({"type": "text", "text": m["refusal"]})
        msg = {"role": role, "content": parts}
        if m.get("name") is not None:  # templates that know names show it; the others ignore the key
            msg["name"] = m["name"]
        if role == "assistant" and m.get("tool_calls"):
            msg["tool_calls"] = [_hf_tool_call(tc, f"messages[{i}].tool_calls[{j}]")
                                 for j, tc in enumerate(m["tool_calls"])]
        out.append(msg)
    return out


def _hf_tool_call(tc: dict, where: str) -> dict:
    fn = tc.get("function") if isinstance(tc, dict) else None
    if not isinstance(fn, dict) or not isinstance(fn.get("name"), str):
        raise InputError(f"{where} must be {{\"type\": \"function\", \"function\": {{\"name\", \"arguments\"}}}}")
    args = fn.get("arguments", {})
    if isinstance(args, str):
        try:
            args = json.loads(args) if args.strip() else {}
        except ValueError:
            raise InputError(f"{where}.function.arguments is not valid JSON") from None
    if not isinstance(args, dict):
        raise InputError(f"{where}.function.arguments must be a JSON object")
    out = {"type": "function", "function": {"name": fn["name"], "arguments": args}}
    if tc.get("id") is not None:
        out["id"] = tc["id"]
    return out


def render_chat(tokenizer, template: str, messages: list[dict], tools: list[dict] | None = None) -> str:
    """The prompt text: the template applied to the messages (and, when given, the `tools`, in
    the OpenAI form models/tool_calls.normalize_tools returns)."""
    try:
        return tokenizer.apply_chat_template(normalize_messages(messages), chat_template=template,
                                             add_generation_prompt=True, tokenize=False, tools=tools or None)
    except InputError:
        raise
    except Exception as e:  # template errors (raise_exception in jinja) are the user's message shape
        raise InputError(f"the chat template rejected the messages: {e}") from None
