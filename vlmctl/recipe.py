"""Recipes: the YAML that says how to build one model.

A recipe names a source checkpoint and the build settings. It may list `profiles`: names of
shared YAML files in `configs/` merged underneath it in order (later wins, the recipe wins over
all). `--set dotted.key=value` overrides apply last. Every validation error names the file and
the key path.
"""

from __future__ import annotations

import os
import re
import types
import typing
from pathlib import Path
from typing import Any, Literal

import yaml
from pydantic import BaseModel, ConfigDict, Field, ValidationError, field_validator, model_validator

from .errors import CheckpointError, OptionError, RecipeError

REPO_ROOT = Path(__file__).resolve().parent.parent


def _bundled(name: str) -> Path:
    """recipes/ or configs/: inside the package when installed from a wheel (setup.py ships them as
    vlmctl/recipes and vlmctl/configs), at the repository top in a checkout or editable install."""
    installed = Path(__file__).resolve().parent / name
    return installed if installed.is_dir() else REPO_ROOT / name


RECIPES_DIR = Path(os.environ.get("VLMCTL_RECIPES_DIR") or _bundled("recipes"))
CONFIGS_DIR = Path(os.environ.get("VLMCTL_CONFIGS_DIR") or _bundled("configs"))


def _settings_dir(path: Path, variable: str, what: str) -> Path:
    """RECIPES_DIR or CONFIGS_DIR where it is used: one that is not a directory (a typo in the VLMCTL_* variable
    that names it) is said as such (exit 2), not taken for an empty directory."""
    if not path.is_dir():
        if os.environ.get(variable):
            raise OptionError(f"{variable}={str(path)!r}: not a directory (it names the directory of {what}, in "
                              "place of the bundled one)")
        raise OptionError(f"the bundled {what} are missing ({path} is not a directory): this copy of vlmctl was "
                          f"installed without them; reinstall it, or name a directory of {what} in {variable}")
    return path


def _types_of(annotation) -> tuple:
    """The plain types an annotation allows (`int | None` -> (int, NoneType))."""
    if typing.get_origin(annotation) in (typing.Union, types.UnionType):
        return tuple(t for a in typing.get_args(annotation) for t in _types_of(a))
    return (typing.get_origin(annotation) or annotation,)


class _Strict(BaseModel):
    model_config = ConfigDict(extra="forbid", validate_assignment=True)

    @field_validator("*", mode="before")
    @classmethod
    def _no_boolean_for_a_number(cls, value, info):
        # YAML reads yes/no/true/on as booleans, which pydantic would take for 1 and 0
        kinds = _types_of(cls.model_fields[info.field_name].annotation)
        if isinstance(value, bool) and bool not in kinds:
            what = "a number" if int in kinds or float in kinds else "text"
            raise ValueError(f"expected {what}, got the boolean {str(value).lower()}")
        return value


class CalibrationSettings(_Strict):
    data: str | None = Field(None, description=".txt / .jsonl file (relative to the recipe) or a datasets name; default: built-in text")
    samples: int = Field(128, ge=1)
    seq_len: int = Field(512, ge=16)


class QuantizationSettings(_Strict):
    method: Literal["none", "awq"] = "none"
    bits: Literal[4] = 4
    group_size: int = Field(128, ge=8)
    zero_point: bool = True
    duo_scaling: bool = True  # AutoAWQ's default: scale formula with a weight term
    impl: Literal["vlmctl", "autoawq"] = "vlmctl"
    # Decoders with cross-attention layers (Llama 3.2 Vision): keep them float, or quantize them too,
    # which needs image-text calibration (only image states reach them)
    cross_attention: Literal["float", "quantize"] = "float"
    calibration: CalibrationSettings = CalibrationSettings()


class VisionSettings(_Strict):
    backend: Literal["auto", "tensorrt", "onnxruntime", "torch"] = "auto"
    opset: int = Field(18, ge=18)
    # Validation runs at a batch size the export never used, so a frozen batch axis fails. Capped: the images go
    # through torch and ONNX Runtime at once, and any size but the trace's 2 shows a frozen axis.
    validate_batch_size: int = Field(3, ge=1, le=64)
    # ONNX Runtime vs torch, judged relative to the features' magnitude (projectors output values in the
    # tens): max |onnx - torch| / max |torch|. An absolute bound is optional (off by default).
    max_rel_error: float = Field(1e-4, gt=0)
    max_abs_error: float | None = Field(None, gt=0)
    min_cosine: float = Field(0.9999, gt=0, le=1)
    workspace_gib: float = Field(4.0, gt=0)


class DecoderSettings(_Strict):
    backend: Literal["auto", "trtllm", "torch"] = "auto"
    # TensorRT-LLM only: ranks = tp_size * pp_size GPUs of one host (the vision model runs on GPU 0).
    tp_size: int = Field(1, ge=1, le=64, description="tensor-parallel ranks (TensorRT-LLM decoder)")
    pp_size: int = Field(1, ge=1, le=64, description="pipeline-parallel ranks (TensorRT-LLM decoder)")
    # Share of the GPU memory left after the weights and the vision model load that TensorRT-LLM
    # may take for its KV cache (its own default, 0.9, leaves the vision encoder too little).
    kv_cache_free_gpu_memory_fraction: float = Field(0.8, gt=0, lt=1)


class ImageSettings(_Strict):
    """Image-processor settings of dynamic-resolution families; unset keeps the checkpoint's."""

    min_pixels: int | None = Field(None, ge=1, description="smallest image area after resizing, in pixels")
    max_pixels: int | None = Field(None, ge=1, description="largest image area after resizing, in pixels "
                                                         "(bounds the tokens an image becomes)")

    @model_validator(mode="after")
    def _check(self) -> "ImageSettings":
        if self.min_pixels and self.max_pixels and self.min_pixels > self.max_pixels:
            raise ValueError(f"min_pixels {self.min_pixels} is larger than max_pixels {self.max_pixels}")
        return self


class EngineLimits(_Strict):
    max_batch_size: int = Field(8, ge=1)
    max_input_len: int = Field(2048, ge=1)
    max_output_len: int = Field(512, ge=1)
    max_images_per_request: int = Field(1, ge=0)


class Recipe(_Strict):
    name: str = "model"
    description: str = ""
    profiles: list[str] = Field(default_factory=list)
    source: str = Field(..., description="local HF checkpoint directory, or a hub id found in the local HF cache")
    dtype: Literal["float32", "float16", "bfloat16"] = "float16"
    quantization: QuantizationSettings = QuantizationSettings()
    vision: VisionSettings = VisionSettings()
    decoder: DecoderSettings = DecoderSettings()
    image: ImageSettings = ImageSettings()
    limits: EngineLimits = EngineLimits()

    # Where the recipe came from: relative paths in it are resolved against this directory.
    base_dir: str = Field(".", exclude=True)

    @field_validator("name")
    @classmethod
    def _plain_name(cls, name: str) -> str:
        # it names the default output directory (engines/NAME): a path in it would put the engine elsewhere
        if not re.fullmatch(r"[A-Za-z0-9][A-Za-z0-9._-]*", name):
            raise ValueError(f"{name!r} is not a plain name: use letters, digits, '.', '_' and '-', starting with a "
                             "letter or digit")
        return name

    @model_validator(mode="after")
    def _check(self) -> "Recipe":
        if self.limits.max_input_len + self.limits.max_output_len > 1 << 20:
            raise ValueError("limits.max_input_len + limits.max_output_len is unreasonably large")
        parallel = self.decoder.tp_size * self.decoder.pp_size > 1
        if parallel and self.decoder.backend == "torch":
            raise ValueError("decoder.tp_size/pp_size > 1 needs decoder.backend: trtllm (the torch decoder runs on "
                             "one device)")
        if self.decoder.backend == "trtllm" and self.dtype == "float32":
            raise ValueError("decoder.backend trtllm needs dtype float16 or bfloat16 (a float32 TensorRT-LLM engine "
                             "has no paged context FMHA, so KV-cache reuse would be off)")
        if self.decoder.backend == "trtllm":
            check_trtllm_group_size(self)  # before quantization runs, not after
        return self

    def resolve_path(self, value: str) -> Path:
        p = Path(os.path.expanduser(value))
        return p if p.is_absolute() else (Path(self.base_dir) / p).resolve()

    def public_dict(self) -> dict[str, Any]:
        return self.model_dump(mode="json", exclude={"base_dir"})


def check_trtllm_group_size(recipe: "Recipe") -> None:
    """TensorRT-LLM's int4 kernels take only some AWQ group sizes: a recipe that builds a TensorRT-LLM
    decoder from AWQ weights with another group size must fail before the quantize stage runs."""
    q = recipe.quantization
    if q.method != "awq":
        return
    from .export.trtllm import AWQ_GROUP_SIZES  # the backend's own list (a light module: no TensorRT import)

    if q.group_size not in AWQ_GROUP_SIZES:
        raise ValueError(f"quantization.group_size {q.group_size} has no TensorRT-LLM weight-only kernel (it takes "
                         f"{' or '.join(map(str, AWQ_GROUP_SIZES))}); change the group size or use "
                         "decoder.backend: torch")


def _deep_merge(base: dict, top: dict) -> dict:
    out = dict(base)
    for key, value in top.items():
        if isinstance(value, dict) and isinstance(out.get(key), dict):
            out[key] = _deep_merge(out[key], value)
        else:
            out[key] = value
    return out


def _read_yaml(path: Path) -> dict:
    try:
        text = path.read_text(encoding="utf-8")
    except FileNotFoundError:
        raise RecipeError(f"{path}: file not found") from None
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); recipes are UTF-8 YAML") from None
    except OSError as e:
        raise RecipeError(f"{path}: cannot read ({e.strerror})") from None
    try:
        data = yaml.safe_load(text)
    except yaml.YAMLError as e:
        mark = getattr(e, "problem_mark", None)
        where = f" line {mark.line + 1}" if mark is not None else ""
        raise RecipeError(f"{path}:{where} invalid YAML ({getattr(e, 'problem', e)})") from None
    if data is None:
        data = {}
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a mapping of keys to values, got {type(data).__name__}")
    return data


def _is_text_key(parts: list[str]) -> bool:
    """Whether the recipe key `parts` holds text (`name`, `source`, `quantization.calibration.data`)."""
    model: Any = Recipe
    for i, p in enumerate(parts):
        field = getattr(model, "model_fields", {}).get(p)
        if field is None:
            return False
        kinds = _types_of(field.annotation)
        if i == len(parts) - 1:
            return str in kinds
        model = next((k for k in kinds if isinstance(k, type) and issubclass(k, BaseModel)), None)
    return False


def parse_override(item: str) -> tuple[list[str], Any]:
    """`a.b.c=value` -> (["a", "b", "c"], value parsed as a YAML scalar; for a key that holds text, the
    text as typed: `--set name=123` names the model "123")."""
    if "=" not in item:
        raise RecipeError(f"--set {item!r}: expected dotted.key=value")
    key, raw = item.split("=", 1)
    parts = [p for p in key.strip().split(".")]
    if not key.strip() or any(not p for p in parts):
        raise RecipeError(f"--set {item!r}: empty key")
    if parts == ["base_dir"]:
        raise RecipeError("--set base_dir: unknown key")
    if _is_text_key(parts) and raw.strip() not in ("null", "~"):  # null still unsets an optional one
        return parts, raw.strip()
    try:
        value = yaml.safe_load(raw) if raw.strip() else ""
    except yaml.YAMLError:
        value = raw
    return parts, value


def _apply_override(data: dict, parts: list[str], value: Any) -> None:
    node = data
    for p in parts[:-1]:
        nxt = node.get(p)
        if nxt is None:
            nxt = node[p] = {}
        if not isinstance(nxt, dict):
            raise RecipeError(f"--set {'.'.join(parts)}: {p} is not a mapping")
        node = nxt
    node[parts[-1]] = value


def _format_validation_error(origin: str, err: ValidationError) -> str:
    msgs = []
    for e in err.errors():
        loc = ".".join(str(x) for x in e["loc"]) or "(top level)"
        if e["type"] == "extra_forbidden":
            msgs.append(f"{loc}: unknown key")
        elif e["type"] == "missing":
            msgs.append(f"{loc}: required key is missing")
        else:
            msg = e["msg"].removeprefix("Value error, ")
            if "input" in e and e["type"] not in ("value_error",) and not isinstance(e["input"], (dict, list)):
                msg += f" (got {e['input']!r})"
            msgs.append(f"{loc}: {msg}")
    return f"{origin}: " + "; ".join(msgs)


def find_recipe(name_or_path: str) -> Path:
    """A path, or the name of a bundled recipe (`NAME` -> recipes/NAME.yaml)."""
    p = Path(name_or_path)
    if p.is_file():
        return p
    named = _settings_dir(RECIPES_DIR, "VLMCTL_RECIPES_DIR", "recipes")
    for cand in (named / name_or_path, named / f"{name_or_path}.yaml"):
        if cand.is_file():  # a bundled recipe, also where a directory here has its name
            return cand
    if p.is_dir():
        raise RecipeError(f"{name_or_path}: a directory, not a recipe file (and no bundled recipe of that name; see "
                          "`vlmctl recipes`)")
    raise RecipeError(f"{name_or_path}: no such recipe file (and no bundled recipe of that name; see `vlmctl recipes`)")


def load_recipe(name_or_path: str | Path, overrides: list[str] | None = None) -> Recipe:
    if isinstance(overrides, str):  # one `--set` item, not a list of its characters
        overrides = [overrides]
    path = find_recipe(str(name_or_path))
    data = _read_yaml(path)
    if "base_dir" in data:  # a field of the loaded recipe (where it came from), not a key a recipe sets
        raise RecipeError(f"{path}: base_dir: unknown key")
    parsed = [parse_override(item) for item in overrides or []]
    for parts, value in parsed:
        if parts == ["profiles"]:  # profiles are merged underneath the recipe: the override decides which
            data = {**data, "profiles": value}
    profiles = data.get("profiles", []) or []
    if isinstance(profiles, str):
        profiles = [profiles]
    if not isinstance(profiles, list) or not all(isinstance(p, str) for p in profiles):
        raise RecipeError(f"{path}: profiles: expected a list of profile names from configs/")
    merged: dict = {}
    configs = _settings_dir(CONFIGS_DIR, "VLMCTL_CONFIGS_DIR", "profiles") if profiles else CONFIGS_DIR
    for prof in profiles:
        prof_path = configs / (prof if prof.endswith(".yaml") else f"{prof}.yaml")
        if not prof_path.exists():
            known = ", ".join(sorted(q.stem for q in configs.glob("*.yaml"))) or "none"
            raise RecipeError(f"{path}: profiles: unknown profile {prof!r} (known: {known})")
        merged = _deep_merge(merged, _read_yaml(prof_path))
    merged = _deep_merge(merged, data)
    merged["profiles"] = profiles
    for parts, value in parsed:
        _apply_override(merged, parts, value)
    merged["base_dir"] = str(path.resolve().parent)
    origin = str(path) + (" (with --set overrides)" if overrides else "")
    try:
        return Recipe.model_validate(merged)
    except ValidationError as e:
        raise RecipeError(_format_validation_error(origin, e)) from None


def recipe_from_source(source: str, overrides: list[str] | None = None, **fields: Any) -> Recipe:
    """A recipe for commands given a checkpoint directly (`vlmctl convert SRC`)."""
    data: dict = {"source": source, **fields}
    for item in overrides or []:
        parts, value = parse_override(item)
        _apply_override(data, parts, value)
    data["base_dir"] = os.getcwd()
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_validation_error("settings", e)) from None


def list_recipes() -> list[dict[str, str]]:
    out = []
    for p in sorted(_settings_dir(RECIPES_DIR, "VLMCTL_RECIPES_DIR", "recipes").glob("*.yaml")):
        try:
            data = _read_yaml(p)
        except RecipeError:
            continue
        out.append({"name": p.stem, "source": str(data.get("source", "")), "description": str(data.get("description", "")),
                    "path": str(p)})
    return out


def resolve_source(recipe: Recipe) -> Path:
    """A local directory, or a hub id looked up in the local HF cache (never downloads)."""
    src = recipe.source
    local = recipe.resolve_path(src)
    if local.is_dir():
        return local
    if local.exists():
        raise CheckpointError(f"source: {src} is a file; expected a Hugging Face checkpoint directory")
    if src.count("/") == 1 and not src.startswith((".", "/", "~")):
        try:
            from huggingface_hub import snapshot_download

            return Path(snapshot_download(src, local_files_only=True))
        except Exception:
            if not local.parent.is_dir():  # `dir/name` where dir exists is a path, not a hub id
                raise CheckpointError(
                    f"source: {src} is neither a local directory nor in the local Hugging Face cache "
                    f"(vlmctl never downloads; fetch it first with `hf download {src}`)"
                ) from None
    raise CheckpointError(f"source: no such directory: {local}")
