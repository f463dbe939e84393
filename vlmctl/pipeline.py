"""The stage graph: convert -> quantize -> export-vision -> build-vision -> build-llm.

Each stage is a function of (recipe, work directory) that declares its settings and inputs
(content hashes of upstream outputs) and does its work through `formats.artifacts.run_stage`, which
provides the cache and atomic publication. `build()` runs them in order. The work directory
(formats/workdir.py) also keeps `recipe.json`, the resolved recipe, so stand-alone stage commands
reuse it. `quantize()` is `vlmctl quantize` for any source: a work directory's stage, or a
stand-alone output published the same atomic way.
"""

from __future__ import annotations

import json
import shutil
import time
from dataclasses import dataclass
from pathlib import Path
from typing import Callable

from .errors import BackendUnavailableError, InputError, RecipeError, StageError
from .formats.artifacts import (StageResult, atomic_dir, cache_status, hash_tree, read_manifest, run_stage,
                                stage_part_hash)
from .formats.workdir import CHECKPOINT, RECIPE_FILE, STAGES, WorkDir, Workspace, classify
from .models.decoders import is_decoder_config
from .models.registry import detect_family, get_family, read_config
from .progress import Progress, ensure
from .recipe import Recipe, resolve_source


def save_recipe(workdir: Path, recipe: Recipe) -> None:
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
    if not path.exists():
        raise StageError(f"{workdir}: no {RECIPE_FILE}; run `vlmctl convert SRC -o {workdir}` or `vlmctl build` first")
    data = json.loads(path.read_text())
    for item in overrides or []:
        parts, value = parse_override(item)
        _apply_override(data, parts, value)
    try:
        return Recipe.model_validate(data)
    except ValidationError as e:
        raise RecipeError(_format_validation_error(str(path), e)) from None


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
        if want == "trtllm" or parallel:
            raise StageError(f"decoder.backend trtllm: the {family.name} family is not served by TensorRT-LLM: "
                             f"{family.trtllm_refusal}; use decoder.backend: torch (one GPU)")
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
    settings: dict = {"dtype": recipe.dtype}
    image = recipe.image.model_dump(exclude_none=True)
    if image:  # only when set, so engines built without it keep their cache key
        settings["image"] = image
    return StageSpec("convert", workdir, settings, {"source": src_hash},
                     lambda out: convert_checkpoint(src, out, recipe.dtype, progress, image_settings=image))


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


def plan(recipe: Recipe, workdir: Path, until: str | None = None, force: bool = False) -> list[PlanItem]:
    """What `build` would do, without doing it: per stage, whether it runs and why. Reads the source
    (its stat-cached hashes) and the manifests; writes nothing. A missing source is the same error
    `build` gives."""
    workdir = Path(workdir)
    stages = STAGES[: STAGES.index(until) + 1] if until else STAGES
    resolve_source(recipe)  # a missing source fails the dry run as it would fail the build
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
                spec = _SPECS[s](recipe, workdir, None, dry=True)
            except StageError:  # an upstream output it reads is not there
                item = PlanItem(s, True, "no output yet")
            else:
                cached, reason = cache_status(workdir, s, spec.settings, spec.inputs)
                item = PlanItem(s, not cached, reason)
        if item.will_run:
            runs.add(s)
        items.append(item)
    return items


def build(recipe: Recipe, workdir: Path, *, until: str | None = None, force: bool = False,
          progress: Progress | None = None, on_stage: Callable[[StageResult], None] | None = None) -> list[StageResult]:
    """Run every stage in order (up to `until`); each is skipped when its cache key matches."""
    if until is not None and until not in STAGES:
        raise RecipeError(f"--until {until!r}: unknown stage (stages: {', '.join(STAGES)})")
    progress = ensure(progress)
    workdir = Path(workdir)
    save_recipe(workdir, recipe)
    results = []
    stages = STAGES[: STAGES.index(until) + 1] if until else STAGES
    for stage in stages:
        t0 = time.perf_counter()
        res = STAGE_FUNCS[stage](recipe, workdir, force=force, progress=progress)
        if not res.cached and not res.skipped:
            res.seconds = time.perf_counter() - t0
        results.append(res)
        if on_stage:
            on_stage(res)
    return results


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
        if output is not None:
            raise InputError(f"{source} is a work directory: its output goes to {wd.quantize.root} (drop -o)")
        recipe = load_workdir_recipe(source, overrides)
        save_recipe(source, recipe)
        return stage_quantize(recipe, source, force=force, progress=progress)
    if output is None:
        raise InputError("-o/--output is required unless SOURCE is a work directory")
    from .recipe import recipe_from_source

    recipe = recipe_from_source(str(source), overrides)
    return quantize_into(source, output, recipe, force=force, progress=progress)


def quantize_into(source: Path, output: Path, recipe: Recipe, *, force: bool = False,
                  progress: Progress | None = None) -> dict:
    """Quantize `source` into `output` with the recipe's quantization settings, published as a stage is:
    written into a temporary sibling and renamed into place only on success."""
    from .quant.awq_vlm import quantize_path

    output = Path(output)
    if output.exists() and not force:
        raise InputError(f"{output} already exists (use --force to replace it)")
    if output.resolve() == Path(source).resolve():
        raise InputError("the output directory must differ from the source")
    source = Path(source)
    settings, base_dir = recipe.quantization, Path(recipe.base_dir)
    with atomic_dir(output) as tmp:
        if classify(source) == CHECKPOINT and not is_decoder_config(read_config(source)):
            # a whole VLM: converted (in the recipe's dtype) into a workspace inside the output, then dropped
            from .convert import convert_checkpoint
            from .quant.awq_vlm import quantize_workspace

            detect_family(read_config(source), where=str(source / "config.json"))  # a clear error when unsupported
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
