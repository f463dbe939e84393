"""Lazy registry of the VLM families: a checkpoint's HF architecture names its family, and looking it
up imports that one family module and no other.

Adding a family is one line per architecture in ARCHITECTURES and one in FAMILIES (tests/test_registry.py
checks both against the family classes' own `architectures`).
"""

from __future__ import annotations

import importlib
from pathlib import Path

from ..errors import UnsupportedModelError
from .base import VLMFamily

# family name -> "module:Class". The module holds all of the family's knowledge.
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

# HF architecture (config.json's `architectures`) -> family name.
ARCHITECTURES: dict[str, str] = {
    "LlavaForConditionalGeneration": "llava",
    "Qwen2VLForConditionalGeneration": "qwen2_vl",
    "Qwen2_5_VLForConditionalGeneration": "qwen2_5_vl",
    "LlavaNextForConditionalGeneration": "llava_next",
    "LlavaOnevisionForConditionalGeneration": "llava_onevision",
    "InternVLForConditionalGeneration": "internvl",
    "Idefics3ForConditionalGeneration": "idefics3",
    "SmolVLMForConditionalGeneration": "smolvlm",
    "Gemma3ForConditionalGeneration": "gemma3",
    "MllamaForConditionalGeneration": "mllama",
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
    """A checkpoint's config.json (checkpoint.read_config_json: the one reader, with its errors)."""
    from ..checkpoint import read_config_json

    return read_config_json(checkpoint_dir)


def detect_family(config: dict, where: str = "config.json") -> VLMFamily:
    """The family of a checkpoint's config.json, by its first supported architecture."""
    for arch in config.get("architectures") or []:
        if arch in ARCHITECTURES:
            return get_family(ARCHITECTURES[arch])
    archs = ", ".join(config.get("architectures") or []) or f"model_type {config.get('model_type')!r}"
    raise UnsupportedModelError(f"{where}: unsupported architecture {archs} (supported: {', '.join(ARCHITECTURES)})")
