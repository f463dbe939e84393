"""The stage graph: convert -> quantize -> export-vision -> build-vision -> build-llm.

Each stage is a function of (recipe, work directory) that declares its settings and inputs
(content hashes of upstream outputs) and does its work through `formats.artifacts.run_stage`, which
provides the cache and atomic publication. `build()` runs them in order. The work directory
(formats/workdir.py) also keeps `recipe.json`, the resolved recipe, so stand-alone stage commands
reuse it; a command writes it only once its stages succeeded, so a failed command leaves the recipe
as it was. `run_stage_alone()` is a stage subcommand: it refuses to build on an earlier stage whose
output is out of date for the recipe (the same cache keys `plan` compares). `quantize()` is
`vlmctl quantize` for any source: a work directory's stage, or a stand-alone output published the
same atomic way.
"""

from __future__ import annotations

import json
import shutil
import time
from contextlib import contextmanager
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import (BackendUnavailableError, CheckpointError, InputError, OptionError, RecipeError, StageError,
                     UnsupportedModelError, VlmctlError)
from .formats.artifacts import (StageResult, atomic_dir, cache_status, hash_tree, read_manifest, run_stage,
                                stage_part_hash)
from .formats.workdir import CHECKPOINT, MANIFEST, RECIPE_FILE, STAGES, WorkDir, Workspace, classify
from .models.decoders import is_decoder_config
from .models.registry import detect_family, get_family, read_config
from .progress import Progress, ensure
from .recipe import Recipe, resolve_source


def save_recipe(workdir: Path, recipe: Recipe) -> None:
    """Write `recipe.json` (atomically). Callers write it after their stages succeeded, never before."""
    workdir = Path(workdir)
    workdir.mkdir(parents=True, exist_ok=True)
    data = recipe.public_dict()
    data["base_dir"] = recipe.base_dir
    final = WorkDir(workdir).recipe_file
    tmp = final.with_name(f".{RECIPE_FILE}.tmp")
    tmp.write_text(json.dumps(data, indent=2))
    tmp.replace(final)


def load_workdir_recipe(workdir: Path, overrides: list[str] | None = None) -> Recipe:
    """The recipe a work directory was built with, plus `--set` overrides."""
    from .recipe import _apply_override, _format_validation_error, parse_override
    from pydantic import ValidationError

    path = WorkDir(workdir).recipe_file
    if Path(workdir).exists() and not Path(workdir).is_dir():
        raise StageError(f"{workdir}: is a file, not a work directory; give the directory `vlmctl convert SRC -o DIR` "
                         "or `vlmctl build RECIPE -o DIR` made")
    if not Path(workdir).is_dir():
        raise StageError(f"{workdir}: no such work directory; run `vlmctl convert SRC -o {workdir}` or "
                         f"`vlmctl build RECIPE -o {workdir}` first")
    if not path.exists():
        raise StageError(f"{workdir}: no {RECIPE_FILE}; run `vlmctl convert SRC -o {workdir}` or `vlmctl build` first")
    try:  # a damaged recipe.json is an invalid recipe (exit 2), never a traceback
        data = json.loads(path.read_text(encoding="utf-8"))
    except UnicodeDecodeError as e:
        raise RecipeError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start}); re-run `vlmctl convert` "
                          "or `vlmctl build` to write it again") from None
    except json.JSONDecodeError as e:
        raise RecipeError(f"{path}: invalid JSON ({e.msg} at line {e.lineno} column {e.colno}); re-run "
                          "`vlmctl convert` or `vlmctl build` to write it again") from None
    if not isinstance(data, dict):
        raise RecipeError(f"{path}: a recipe must be a JSON object of keys to values, got {type(data).__name__}")
    for item in overrides or []:
        parts, value = parse_override(item)
        _apply_override(data, parts, value)
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        origin = str(path) + (" (with --set overrides)" if overrides else "")  # as load_recipe says it
        raise RecipeError(_format_validation_error(origin, e)) from None


def _family(workdir: Path):
    return get_family(WorkDir(workdir).family_name())


# ---- backends ------------------------------------------------------------------------------
def resolve_vision_backend(recipe: Recipe) -> str:
    from .backends.tensorrt import tensorrt_available

    want = recipe.vision.backend
    if want == "auto":
        return "tensorrt" if tensorrt_available() else "onnxruntime"
    if want == "tensorrt" and not tensorrt_available():
        raise BackendUnavailableError("vision.backend is tensorrt but the `tensorrt` package is not importable "
                                      "(pip install 'vlmctl[tensorrt]' on a machine with NVIDIA's index)")
    return want


def resolve_decoder_backend(recipe: Recipe, family=None) -> str:
    """torch or trtllm. `auto` takes TensorRT-LLM when its interpreter has 1.2.x and the recipe is
    one it builds (float16/bfloat16); a recipe asking for tensor/pipeline parallelism must get it.
    A family TensorRT-LLM's prompt-table engine does not compute correctly (`supports_trtllm` false:
    bidirectional image attention, multimodal rotary positions, images read in cross-attention
    layers) gets the torch decoder."""
    from .backends.trtllm import trtllm_available

    want = recipe.decoder.backend
    parallel = recipe.decoder.tp_size * recipe.decoder.pp_size > 1
    if family is not None and not family.supports_trtllm:
        _refuse_unserved_family(recipe, family)
        return "torch"
    if want == "auto":
        if recipe.dtype == "float32" and not parallel:
            return "torch"  # TensorRT-LLM engines are float16/bfloat16 here
        if parallel:
            trtllm_available(required=True)
            return "trtllm"
        return "trtllm" if trtllm_available() else "torch"
    if want == "trtllm":
        trtllm_available(required=True)
    return want


def _refuse_unserved_family(recipe: Recipe, family) -> None:
    """StageError when the recipe asks for TensorRT-LLM (explicitly, or by tensor/pipeline parallelism) and the
    family is one it does not serve."""
    dec = recipe.decoder
    if not family.supports_trtllm and (dec.backend == "trtllm" or dec.tp_size * dec.pp_size > 1):
        raise StageError(f"decoder.backend trtllm: the {family.name} family is not served by TensorRT-LLM: "
                         f"{family.trtllm_refusal}; use decoder.backend: torch (one GPU)")


def backend_fingerprint(kind: str) -> dict:
    """What a native engine is built for, so a cached stage is not reused under another
    TensorRT / TensorRT-LLM version or GPU architecture (engines are not portable across them)."""
    from .backends.cuda import compute_capability, sm_string

    if kind == "tensorrt":
        from .backends.tensorrt import tensorrt_version

        version = tensorrt_version()
    elif kind == "trtllm":
        from .backends.trtllm import trtllm_version

        version = trtllm_version()
    else:
        return {}
    return {"backend_version": version, "gpu": sm_string(compute_capability())}


# ---- stages --------------------------------------------------------------------------------
# Each stage is a spec (settings, inputs, work) computed from the recipe and the upstream manifests;
# `stage_*` runs it through `artifacts.run_stage`, `plan` only compares its cache key.
@dataclass
class StageSpec:
    name: str
    workdir: Path
    settings: dict
    inputs: dict[str, str]
    work: Callable[[Path], dict]


def _run(spec: "StageSpec | StageResult", force: bool) -> StageResult:
    if isinstance(spec, StageResult):  # skipped
        return spec
    return run_stage(spec.workdir, spec.name, spec.settings, spec.inputs, spec.work, force=force)


def _spec_convert(recipe: Recipe, workdir: Path, progress: Progress | None, dry: bool = False) -> StageSpec:
    from .convert import convert_checkpoint

    src = resolve_source(recipe)
    detect_family(read_config(src), where=str(src / "config.json"))  # fail fast, before hashing
    if not dry:
        workdir.mkdir(parents=True, exist_ok=True)
    # Source hashes are remembered by (size, mtime) so a cache hit does not re-read a 14 GB checkpoint.
    src_hash = hash_tree(src, [p for p in src.rglob("*") if p.is_file() and ".cache" not in p.parts],
                         stat_cache=WorkDir(workdir).source_hashes, save_cache=not dry)
    settings = _convert_settings(recipe)
    image = settings.get("image", {})
    return StageSpec("convert", workdir, settings, {"source": src_hash},
                     lambda out: convert_checkpoint(src, out, recipe.dtype, progress, image_settings=image))


def _convert_settings(recipe: Recipe) -> dict:
    settings: dict = {"dtype": recipe.dtype}
    image = recipe.image.model_dump(exclude_none=True)
    if image:  # only when set, so engines built without it keep their cache key
        settings["image"] = image
    return settings


def _spec_quantize(recipe: Recipe, workdir: Path, progress: Progress | None, dry: bool = False):
    q = recipe.quantization
    if q.method == "none":
        return StageResult("quantize", False, 0.0, WorkDir(workdir).quantize.root,
                           skipped="quantization.method is none")
    # `auto` picks per family (a family TensorRT-LLM does not serve gets torch) once convert has run
    family = _family(workdir) if read_manifest(WorkDir(workdir).convert.root) is not None else None
    if recipe.decoder.backend == "auto" and resolve_decoder_backend(recipe, family) == "trtllm":
        from .recipe import check_trtllm_group_size

        try:  # `auto` chose TensorRT-LLM on this machine: its group-size rule holds before quantizing too
            check_trtllm_group_size(recipe)
        except ValueError as e:
            raise RecipeError(f"decoder.backend auto picks TensorRT-LLM here, and {e}") from None
    from .quant.awq_vlm import quantize_workspace

    wd = WorkDir(workdir)
    inputs = {"llm": stage_part_hash(workdir, "convert", wd.convert.llm.name),
              "vision": stage_part_hash(workdir, "convert", wd.convert.vision.name)}
    calib_hash = _calibration_hash(q.calibration.data, Path(recipe.base_dir))
    if calib_hash is not None:
        inputs["calibration"] = calib_hash
    settings = q.model_dump(mode="json")
    if settings["cross_attention"] == "float":  # the default: engines built before the key keep their cache key
        del settings["cross_attention"]
    return StageSpec("quantize", workdir, settings, inputs,
                     lambda out: quantize_workspace(wd.convert, out, q, Path(recipe.base_dir), progress))


def _calibration_hash(spec: str | None, base_dir: Path) -> str | None:
    """Content hash of every file a calibration source reads: the .txt/.jsonl file and, for image-text
    records, each image it names (changing an image must re-run quantize). None for the built-in text
    and dataset names."""
    import os

    from .formats.artifacts import hash_json, sha256_file
    from .quant.vlm_calibration import calibration_files

    files = calibration_files(spec, base_dir)
    if not files:
        return None
    root = files[0].parent
    if all(f.resolve().is_relative_to(root.resolve()) for f in files):
        return hash_tree(root, files)  # the same key as before images were hashed, for text-only data
    return hash_json({os.path.relpath(f, root): sha256_file(f) for f in files})


def _spec_export_vision(recipe: Recipe, workdir: Path, progress: Progress | None, dry: bool = False) -> StageSpec:
    from .export.onnx_vision import export_vision_onnx

    family = _family(workdir)
    wd = WorkDir(workdir)
    v = recipe.vision
    settings = {"dtype": recipe.dtype, "opset": v.opset, "validate_batch_size": v.validate_batch_size,
                "max_rel_error": v.max_rel_error, "min_cosine": v.min_cosine}
    if v.max_abs_error is not None:
        settings["max_abs_error"] = v.max_abs_error
    inputs = {"vision": stage_part_hash(workdir, "convert", wd.convert.vision.name)}
    return StageSpec("export-vision", workdir, settings, inputs,
                     lambda out: export_vision_onnx(family, wd.convert.vision, out, dtype=recipe.dtype,
                                                    opset=v.opset, validate_batch_size=v.validate_batch_size,
                                                    max_rel_error=v.max_rel_error, max_abs_error=v.max_abs_error,
                                                    min_cosine=v.min_cosine,
                                                    progress=progress))


def _spec_build_vision(recipe: Recipe, workdir: Path, progress: Progress | None, dry: bool = False) -> StageSpec:
    from .export.tensorrt import build_vision_engine, vision_profile

    backend = resolve_vision_backend(recipe)
    lim = recipe.limits
    max_images = max(1, lim.max_batch_size * max(lim.max_images_per_request, 1))
    settings = {"backend": backend, "dtype": recipe.dtype, "max_images": max_images,
                "workspace_gib": recipe.vision.workspace_gib, **backend_fingerprint(backend)}
    wd = WorkDir(workdir)
    axis = _family(workdir).vision_axis(wd.convert.read_vision_config(), wd.convert.processor)
    profile = vision_profile(axis, lim.max_batch_size, lim.max_images_per_request) if axis is not None else None
    if profile is not None:
        settings["profile"] = {k: [list(s) for s in v] for k, v in profile.items()}
    inputs = {"onnx": stage_part_hash(workdir, "export-vision")}
    return StageSpec("build-vision", workdir, settings, inputs,
                     lambda out: build_vision_engine(wd.onnx, out, backend=backend, dtype=recipe.dtype,
                                                     max_batch=max_images,
                                                     workspace_gib=recipe.vision.workspace_gib, progress=progress,
                                                     profile=profile))


def _spec_build_llm(recipe: Recipe, workdir: Path, progress: Progress | None, dry: bool = False) -> StageSpec:
    from .export.trtllm import prompt_table_size

    family = _family(workdir)
    wd = WorkDir(workdir)
    backend = resolve_decoder_backend(recipe, family)
    quantized = recipe.quantization.method != "none"
    if quantized:
        if read_manifest(wd.quantize.root) is None:
            raise StageError(f"{workdir}: quantization.method is {recipe.quantization.method} but stage 'quantize' "
                             "has not run; run `vlmctl quantize` first")
        llm_dir, llm_hash = wd.quantize.llm, stage_part_hash(workdir, "quantize", wd.quantize.llm.name)
    else:
        llm_dir, llm_hash = wd.convert.llm, stage_part_hash(workdir, "convert", wd.convert.llm.name)
    vlm_config = wd.convert.read_vision_config()
    lim = recipe.limits
    _check_image_fits(recipe, family, family.min_image_tokens(vlm_config))
    per_image = family.max_image_tokens(vlm_config, wd.convert.processor)
    table_size = prompt_table_size(lim, per_image)
    extra = {"name": recipe.name, "backend": backend, "limits": lim.model_dump(), "prompt_table_size": table_size,
             "image_tokens_per_image": per_image, "eos_token_ids": _eos_ids(wd.convert.processor)}
    settings = {"backend": backend, "dtype": recipe.dtype, "image_attention": family.image_attention, **extra,
                **backend_fingerprint(backend)}
    if backend == "trtllm":
        dec = recipe.decoder
        settings["parallel"] = {"tp_size": dec.tp_size, "pp_size": dec.pp_size}
        settings["kv_cache_free_gpu_memory_fraction"] = dec.kv_cache_free_gpu_memory_fraction
    inputs = {"llm": llm_hash, "processor": stage_part_hash(workdir, "convert", wd.convert.processor.name)}

    def work(out: Path) -> dict:
        if backend == "trtllm":
            from .export.trtllm import build_trtllm_engine

            return build_trtllm_engine(llm_dir, out, recipe=recipe, family=family, extra_config=extra,
                                       progress=progress)
        from .export.torch_decoder import build_torch_decoder

        return build_torch_decoder(llm_dir, out, engine_root=workdir, dtype=recipe.dtype, extra_config=extra,
                                   progress=progress, image_attention=family.image_attention)

    return StageSpec("build-llm", workdir, settings, inputs, work)


def stage_convert(recipe: Recipe, workdir: Path, *, force=False, progress: Progress | None = None) -> StageResult:
    return _run(_spec_convert(recipe, Path(workdir), progress), force)


def stage_quantize(recipe: Recipe, workdir: Path, *, force=False, progress: Progress | None = None) -> StageResult:
    return _run(_spec_quantize(recipe, Path(workdir), progress), force)


def stage_export_vision(recipe: Recipe, workdir: Path, *, force=False, progress: Progress | None = None) -> StageResult:
    return _run(_spec_export_vision(recipe, Path(workdir), progress), force)


def stage_build_vision(recipe: Recipe, workdir: Path, *, force=False, progress: Progress | None = None) -> StageResult:
    return _run(_spec_build_vision(recipe, Path(workdir), progress), force)


def stage_build_llm(recipe: Recipe, workdir: Path, *, force=False, progress: Progress | None = None) -> StageResult:
    return _run(_spec_build_llm(recipe, Path(workdir), progress), force)


def _eos_ids(processor_dir: Path) -> list[int]:
    ids: list[int] = []
    for name in ("generation_config.json", "config.json"):
        p = processor_dir / name
        if p.exists():
            cfg = json.loads(p.read_text())
            for c in (cfg, cfg.get("text_config") or {}):
                e = c.get("eos_token_id")
                if e is not None:
                    ids.extend(e if isinstance(e, list) else [e])
            if ids:
                break
    return sorted(set(int(i) for i in ids))


STAGE_FUNCS: dict[str, Callable[..., StageResult]] = {
    "convert": stage_convert,
    "quantize": stage_quantize,
    "export-vision": stage_export_vision,
    "build-vision": stage_build_vision,
    "build-llm": stage_build_llm,
}
_SPECS = {"convert": _spec_convert, "quantize": _spec_quantize, "export-vision": _spec_export_vision,
          "build-vision": _spec_build_vision, "build-llm": _spec_build_llm}
# The upstream stages whose outputs feed each stage's cache key.
_UPSTREAM = {"convert": (), "quantize": ("convert",), "export-vision": ("convert",),
             "build-vision": ("convert", "export-vision"), "build-llm": ("convert", "quantize")}
assert tuple(STAGE_FUNCS) == STAGES == tuple(_SPECS) == tuple(_UPSTREAM)


@dataclass
class PlanItem:
    stage: str
    will_run: bool
    reason: str


def _stage_status(recipe: Recipe, workdir: Path, stage: str) -> "tuple[StageSpec, bool, str] | None":
    """(spec, cache hit?, why) of one stage for this recipe, as `build` would decide it; None for a stage the
    recipe skips. Writes nothing. StageError when an output the stage reads is not there."""
    spec = _SPECS[stage](recipe, workdir, None, dry=True)
    if isinstance(spec, StageResult):
        return None
    cached, reason = cache_status(workdir, stage, spec.settings, spec.inputs)
    return spec, cached, reason


def plan(recipe: Recipe, workdir: Path, until: str | None = None, force: bool = False) -> list[PlanItem]:
    """What `build` would do, without doing it: per stage, whether it runs and why. Reads the source
    (its stat-cached hashes) and the manifests; writes nothing. A missing source, or TensorRT-LLM asked for a
    family it does not serve, is the same error `build` gives."""
    workdir = Path(workdir)
    stages = STAGES[: STAGES.index(until) + 1] if until else STAGES
    resolve_source(recipe)  # a missing source fails the dry run as it would fail the build
    _check_build_llm_settings(recipe, until)  # and so does what build-llm would refuse
    items: list[PlanItem] = []
    runs: set[str] = set()
    for s in stages:
        if s == "quantize" and recipe.quantization.method == "none":
            items.append(PlanItem(s, False, "quantization.method is none"))
            continue
        upstream = [u for u in _UPSTREAM[s] if u in runs]
        if force:
            item = PlanItem(s, True, "--force")
        elif upstream:
            item = PlanItem(s, True, f"its input {upstream[0]} runs first")
        else:
            try:
                _, cached, reason = _stage_status(recipe, workdir, s)
            except StageError:  # an upstream output it reads is not there
                item = PlanItem(s, True, "no output yet")
            else:
                item = PlanItem(s, not cached, reason)
        if item.will_run:
            runs.add(s)
        items.append(item)
    return items


# ---- a stage on its own (the stage subcommands) ----------------------------------------------
_UNSET = object()
# Where a stage's recorded settings live in a recipe (for messages): export-vision's opset is vision.opset.
_SETTING_PREFIX = {"quantize": "quantization.", "export-vision": "vision."}


def _first_difference(old, new, key: str = ""):
    """(dotted key, old value, new value) of the first setting that differs, or None."""
    if isinstance(old, dict) and isinstance(new, dict):
        for k in list(new) + [k for k in old if k not in new]:
            d = _first_difference(old.get(k, _UNSET), new.get(k, _UNSET), f"{key}{k}.")
            if d is not None:
                return d
        return None
    return None if old == new else (key[:-1], old, new)


def _show(value) -> str:
    if value is _UNSET or value is None:
        return "unset"
    return value if isinstance(value, str) else json.dumps(value)


def _stale_reason(stage: str, manifest: dict, settings: dict, inputs: dict | None, reason: str) -> str:
    """Why `stage`'s output (its manifest) is not what this recipe would make, in the recipe's words."""
    from . import __version__

    diff = _first_difference(manifest.get("settings") or {}, settings)
    if diff is not None:
        key, old, new = diff
        name = key if key == "dtype" else _SETTING_PREFIX.get(stage, "") + key
        return f"{stage}'s output was made with {name} {_show(old)}; this recipe asks for {_show(new)}"
    old_inputs = manifest.get("inputs") or {}
    for k, v in (inputs or {}).items():
        if old_inputs.get(k) != v:
            what = "the source checkpoint" if (stage, k) == ("convert", "source") else f"its input {k}"
            return f"{stage}'s output is out of date: {what} changed since it ran"
    if manifest.get("tool_version") != __version__:
        return f"{stage}'s output was made by vlmctl {manifest.get('tool_version')} (this is {__version__})"
    return f"{stage}'s output is out of date ({reason})"


def _inputs_of(stage: str, recipe: Recipe) -> list[str]:
    """Every earlier stage whose output `stage` reads, directly or through another, in stage order."""
    need: set[str] = set()
    todo = list(_UPSTREAM[stage])
    while todo:
        u = todo.pop()
        if u not in need:
            need.add(u)
            todo.extend(_UPSTREAM[u])
    if recipe.quantization.method == "none":
        need.discard("quantize")
    return [s for s in STAGES if s in need]


def check_inputs(recipe: Recipe, workdir: Path, stage: str) -> None:
    """Refuse (StageError, exit 7) to run `stage` on its own when an earlier stage it reads has not run, or
    made its output for other settings or inputs than this recipe gives: the stages `build` would re-run
    first (the same cache keys). A convert whose source checkpoint is gone (an engine copied without it)
    is judged by its settings alone."""
    workdir = Path(workdir)
    for u in _inputs_of(stage, recipe):
        manifest = read_manifest(workdir / u)
        if manifest is None:
            what = (f"quantization.method is {recipe.quantization.method} but stage 'quantize' has not run here"
                    if u == "quantize" else f"stage {u!r} has not run here")
            raise StageError(f"{workdir}: {what}: run `vlmctl {u}` (or `vlmctl build`) first")
        try:
            status = _stage_status(recipe, workdir, u)
        except (CheckpointError, UnsupportedModelError):
            if u != "convert":
                raise
            settings = _convert_settings(recipe)  # the source cannot be read here: compare what can be
            status = (None, manifest.get("settings") == settings, "its settings changed")
            inputs = None
        else:
            settings, inputs = status[0].settings, status[0].inputs
        if not status[1]:
            raise StageError(f"{workdir}: {_stale_reason(u, manifest, settings, inputs, status[2])}: "
                             f"run `vlmctl {u}` (or `vlmctl build`) first")


def run_stage_alone(stage: str, workdir: Path, overrides: list[str] | None = None, *, force: bool = False,
                    progress: Progress | None = None) -> StageResult:
    """A stage subcommand (`vlmctl build-llm WORKDIR --set ...`): the work directory's recipe plus `overrides`;
    refuses when an earlier stage's output is out of date for that recipe (`check_inputs`), after the stage's
    own settings were checked (a backend or family refusal stays one even once the inputs are rebuilt); the
    recipe with the overrides is saved only after the stage succeeded."""
    workdir = Path(workdir)
    recipe = load_workdir_recipe(workdir, overrides)
    try:
        spec = _SPECS[stage](recipe, workdir, progress)
    except (CheckpointError, UnsupportedModelError):  # an earlier stage's files it reads are damaged or gone:
        check_inputs(recipe, workdir, stage)  # say which stage to re-run (exit 7), when that is the cause
        raise
    check_inputs(recipe, workdir, stage)
    res = _run(spec, force)
    if overrides:
        save_recipe(workdir, recipe)
    return res


@contextmanager
def _new_directory_undone_on_failure(workdir: Path):
    """A work directory this command creates is removed again when the command fails before any stage
    published an output there (what it would leave is the source-hash cache and an empty directory)."""
    workdir = Path(workdir)
    existed = workdir.exists()
    try:
        yield
    except BaseException:
        if not existed and workdir.is_dir() and not any((workdir / s / MANIFEST).is_file() for s in STAGES):
            shutil.rmtree(workdir, ignore_errors=True)
        raise


def _check_workdir_is_a_directory(workdir: Path) -> None:
    """The work directory, or the nearest of its parents that exists, must be a directory (a file there would
    otherwise surface as a bare FileExistsError / NotADirectoryError from the first stage)."""
    p = Path(workdir)
    while not p.exists() and p != p.parent:
        p = p.parent
    if p.exists() and not p.is_dir():
        where = "is" if p == Path(workdir) else f"is inside {p}, which is"
        raise OptionError(f"-o {workdir}: the output {where} a file, not a directory")


def _check_image_fits(recipe: Recipe, family, rows: int) -> None:
    """RecipeError when images are allowed but limits.max_input_len leaves no room beside one, of `rows` prompt rows
    (`min_image_tokens`): an engine that would refuse every request with an image."""
    lim = recipe.limits
    if lim.max_images_per_request >= 1 and 0 < rows and lim.max_input_len <= rows:
        raise RecipeError(f"limits.max_input_len {lim.max_input_len} leaves no room for text beside one image, which "
                          f"takes {rows} prompt rows in this {family.name} model; raise it, or set "
                          "limits.max_images_per_request: 0 for a text-only engine")


def _check_build_llm_settings(recipe: Recipe, until: str | None) -> None:
    """What build-llm would refuse, said before any stage runs: TensorRT-LLM for a family it does not serve (no
    install can lift it) and a max_input_len too small for an image. Otherwise convert and quantize (an hour of AWQ on
    a large model) would run first and a dry run would not say. TensorRT-LLM missing on this host is left to
    build-llm (docs/tensorrt-llm.md: the stages before it are kept, for build-llm to run once it is installed)."""
    if until is not None and until != "build-llm":
        return
    try:
        src = resolve_source(recipe)
        config = read_config(src)
        family = detect_family(config, where=str(src / "config.json"))
    except VlmctlError:
        return  # convert says what is wrong with the source
    _refuse_unserved_family(recipe, family)
    try:
        rows = family.min_image_tokens(config)
    except Exception:  # a config convert refuses, with its own message
        return
    _check_image_fits(recipe, family, rows)


def _check_output_outside_source(recipe: Recipe, workdir: Path) -> None:
    """The work directory may not be the source checkpoint or lie inside it: its stages would be written
    among the checkpoint's files, and the source's hash (the convert cache key) would take them in. Nor may the
    source be one of its stage directories or lie inside one (`vlmctl convert ./convert -o .`): publishing
    that stage replaces the directory, which would delete the checkpoint."""
    try:
        src = resolve_source(recipe).resolve()
    except (CheckpointError, RecipeError):
        return  # the convert stage says what is wrong with the source
    out = Path(workdir).resolve()
    if out == src or out.is_relative_to(src):
        raise OptionError(f"-o {workdir}: the output directory is the source checkpoint {src} or inside it; "
                          "give a directory of its own")
    for stage in STAGES:
        if src.is_relative_to(out / stage):
            raise OptionError(f"-o {workdir}: the source checkpoint {src} is (or is inside) {out / stage}, the "
                              f"work directory's {stage} stage, which publishing that stage replaces; give another "
                              "output directory")


def convert(recipe: Recipe, workdir: Path, *, force: bool = False, progress: Progress | None = None) -> StageResult:
    """`vlmctl convert`: the convert stage, then the recipe saved (only when it succeeded)."""
    workdir = Path(workdir)
    _check_output_outside_source(recipe, workdir)
    with _new_directory_undone_on_failure(workdir):
        res = stage_convert(recipe, workdir, force=force, progress=progress)
    save_recipe(workdir, recipe)
    return res


def build(recipe: Recipe, workdir: Path, *, until: str | None = None, force: bool = False,
          progress: Progress | None = None, on_stage: Callable[[StageResult], None] | None = None) -> list[StageResult]:
    """Run every stage in order (up to `until`); each is skipped when its cache key matches. The recipe is
    saved once every stage succeeded: a failed build leaves the work directory's recipe as it was (the
    stages it finished stay, as cache). In a directory without a recipe yet, one whose stages got as far as
    a finished one saves it on failure too: it is the recipe those stages were built with, and the stage
    commands resume from it (`vlmctl build-llm DIR --set ...` after a failed build-llm)."""
    if until is not None and until not in STAGES:
        raise RecipeError(f"--until {until!r}: unknown stage (stages: {', '.join(STAGES)})")
    progress = ensure(progress)
    workdir = Path(workdir)
    _check_workdir_is_a_directory(workdir)
    _check_output_outside_source(recipe, workdir)
    _check_build_llm_settings(recipe, until)
    results = []
    stages = STAGES[: STAGES.index(until) + 1] if until else STAGES
    had_recipe = WorkDir(workdir).recipe_file.is_file()
    with _new_directory_undone_on_failure(workdir):
        try:
            for stage in stages:
                t0 = time.perf_counter()
                res = STAGE_FUNCS[stage](recipe, workdir, force=force, progress=progress)
                if not res.cached and not res.skipped:
                    res.seconds = time.perf_counter() - t0
                results.append(res)
                if on_stage:
                    on_stage(res)
        except BaseException:
            if results and not had_recipe:
                save_recipe(workdir, recipe)
            raise
    save_recipe(workdir, recipe)
    return results


def next_stage(recipe: Recipe, until: str | None) -> str | None:
    """The stage after `until` that this recipe's engine still needs (None when `until` completes it)."""
    if until is None:
        return None
    rest = [s for s in STAGES[STAGES.index(until) + 1:] if s != "quantize" or recipe.quantization.method != "none"]
    return rest[0] if rest else None


# ---- quantize outside the stage graph ------------------------------------------------------
def quantize(source: Path, output: Path | None, overrides: list[str] | None = None, *, force: bool = False,
             progress: Progress | None = None) -> "StageResult | dict":
    """`vlmctl quantize SOURCE [-o OUTPUT]`, with `overrides` as `--set` items.

    A work directory (it has recipe.json) runs its quantize stage: cached, with a manifest; returns the
    StageResult. Any other source (a conversion workspace, a VLM checkpoint, a plain causal LM) is
    quantized into `output` (see `quant.awq_vlm.quantize_path`); returns the quantizer's summary."""
    source = Path(source)
    wd = WorkDir(source)
    if wd.recipe_file.exists():
        if output is not None:  # the command line's mistake: the directory is a fine source without -o
            raise OptionError(f"{source} is a work directory: its output goes to {wd.quantize.root} (drop -o), "
                              f"or give its conversion workspace {wd.convert.root} to quantize into {output}")
        return run_stage_alone("quantize", source, overrides, force=force, progress=progress)
    if not source.exists():
        raise CheckpointError(f"{source}: no such directory")
    if not source.is_dir():
        raise CheckpointError(f"{source} is a file; expected a checkpoint, workspace or work directory")
    if output is None:
        raise OptionError("-o/--output is required unless SOURCE is a work directory")
    from .recipe import recipe_from_source

    recipe = recipe_from_source(str(source), overrides)
    return quantize_into(source, output, recipe, force=force, progress=progress)


def quantize_into(source: Path, output: Path, recipe: Recipe, *, force: bool = False,
                  progress: Progress | None = None) -> dict:
    """Quantize `source` into `output` with the recipe's quantization settings, published as a stage is:
    written into a temporary sibling and renamed into place only on success."""
    from .quant.awq_vlm import quantize_path

    output, source = Path(output), Path(source)
    src, out = source.resolve(), output.resolve()
    if out == src:
        raise InputError("the output directory must differ from the source")
    if src.is_relative_to(out):  # with --force, replacing OUTPUT would delete the source
        raise InputError(f"-o {output}: the output directory holds the source {source}; give a directory of its own")
    if out.is_relative_to(src):  # the quantized files would be written among the checkpoint's
        raise InputError(f"-o {output}: the output directory is inside the source {source}; "
                         "give a directory of its own")
    if output.exists() and not output.is_dir():  # --force would replace a file with a directory
        raise InputError(f"-o {output}: is a file; expected a directory to write the quantized checkpoint into")
    if output.exists() and not force:
        raise InputError(f"{output} already exists (use --force to replace it)")
    settings, base_dir = recipe.quantization, Path(recipe.base_dir)
    with atomic_dir(output) as tmp:
        if classify(source) == CHECKPOINT and not is_decoder_config(read_config(source)):
            # a whole VLM: converted (in the recipe's dtype) into a workspace inside the output, then dropped
            from .convert import convert_checkpoint
            from .quant.awq import check_group_size_for_config
            from .quant.awq_vlm import quantize_workspace

            config = read_config(source)
            family = detect_family(config, where=str(source / "config.json"))  # a clear error when unsupported
            # the language model's sizes are in the config: a group size that cannot work fails here, before
            # minutes of converting (the per-layer check, with the same message, runs again on the weights)
            check_group_size_for_config(family.text_config_dict(config), settings)
            ws = Workspace(tmp / ".convert")
            try:
                convert_checkpoint(source, ws.root, recipe.dtype, progress)
                summary = quantize_workspace(ws, tmp, settings, base_dir, progress)
            finally:
                shutil.rmtree(ws.root, ignore_errors=True)
        else:
            summary = quantize_path(source, tmp, settings, base_dir, progress)
    summary["output"] = str(output)
    return summary
