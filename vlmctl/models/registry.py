"""Lazy registry: family name -> module path. Importing a family happens only when it is needed."""

from __future__ import annotations

import importlib
import json
from pathlib import Path

from ..errors import CheckpointError, UnsupportedModelError
from .base import VLMFamily

# family name -> "module:Class". One line per family; the module holds all of its knowledge.
FAMILIES: dict[str, str] = {
    "llava": "vlmctl.models.llava:LlavaFamily",
    "qwen2_vl": "vlmctl.models.qwen2_vl:Qwen2VLFamily",
    "qwen2_5_vl": "vlmctl.models.qwen2_vl:Qwen2_5_VLFamily",
    "llava_next": "vlmctl.models.llava_next:LlavaNextFamily",
    "llava_onevision": "vlmctl.models.llava_onevision:LlavaOnevisionFamily",
    "internvl": "vlmctl.models.internvl:InternVLFamily",
    "idefics3": "vlmctl.models.idefics3:Idefics3Family",
    "smolvlm": "vlmctl.models.idefics3:SmolVLMFamily",
    "gemma3": "vlmctl.models.gemma3:Gemma3Family",
    "mllama": "vlmctl.models.mllama:MllamaFamily",
}


def family_class(name: str) -> type[VLMFamily]:
    mod, _, cls = FAMILIES[name].partition(":")
    return getattr(importlib.import_module(mod), cls)


def all_families() -> dict[str, type[VLMFamily]]:
    return {name: family_class(name) for name in FAMILIES}


def get_family(name: str) -> VLMFamily:
    if name not in FAMILIES:
        raise UnsupportedModelError(f"unknown model family {name!r} (known: {', '.join(FAMILIES)})")
    return family_class(name)()


def read_config(checkpoint_dir: Path) -> dict:
    path = Path(checkpoint_dir) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{checkpoint_dir}: no config.json (not a Hugging Face checkpoint directory)")
    try:
        return json.loads(path.read_text())
    except (json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({e})") from None


def detect_family(config: dict, where: str = "config.json") -> VLMFamily:
    for name in FAMILIES:
        cls = family_class(name)
        if cls.matches(config):
            return cls()
    archs = ", ".join(config.get("architectures") or []) or f"model_type {config.get('model_type')!r}"
    supported = ", ".join(a for n in FAMILIES for a in family_class(n).architectures)
    raise UnsupportedModelError(f"{where}: unsupported architecture {archs} (supported: {supported})")
