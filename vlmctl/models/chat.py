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
    """OpenAI-style or HF-style messages -> HF structured content ({"type": "text"|"image"})."""
    out = []
    for m in messages:
        role = m.get("role")
        if role not in ("system", "user", "assistant"):
            raise InputError(f"message role must be system, user or assistant (got {role!r})")
        content = m.get("content")
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
                elif kind in ("image", "image_url"):
                    parts.append({"type": "image"})
                else:
                    raise InputError(f"unsupported content part type {kind!r}")
        out.append({"role": role, "content": parts})
    return out


def render_chat(tokenizer, template: str, messages: list[dict]) -> str:
    try:
        return tokenizer.apply_chat_template(normalize_messages(messages), chat_template=template,
                                             add_generation_prompt=True, tokenize=False)
    except InputError:
        raise
    except Exception as e:  # template errors (raise_exception in jinja) are the user's message shape
        raise InputError(f"the chat template rejected the messages: {e}") from None
