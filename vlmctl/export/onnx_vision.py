"""ONNX export of the vision tower + projector, validated on ONNX Runtime against torch.

The graph takes the family's vision inputs (usually `pixel_values`) with a dynamic batch axis
and returns `image_features`: the projector's output, i.e. the rows that enter the decoder's
prompt-embedding table. Validation runs at a batch size the export never used, so a batch axis
frozen by tracing fails here instead of at serving time. It judges the error relative to the
features' magnitude (real projectors output values in the tens, where float32 rounding alone exceeds
any fixed absolute bound) together with the cosine similarity, and reports both.
"""

from __future__ import annotations

import contextlib
import json
from pathlib import Path

import numpy as np

from ..backends.onnxruntime import ort_session  # noqa: F401  (re-exported: callers import it from here)
from ..errors import RecipeError, StageError
from ..formats.workdir import ONNX_FILE, ONNX_IO_FILE
from ..models.base import read_json
from ..progress import Progress, ensure

EXPORT_BATCH = 2


@contextlib.contextmanager
def _quiet_export():
    """The exporters print a lot to stdout/stderr; keep it out of the CLI output."""
    import io
    import logging
    import warnings

    buf = io.StringIO()
    prev = logging.root.manager.disable
    logging.disable(logging.WARNING)
    try:
        with warnings.catch_warnings(), contextlib.redirect_stdout(buf), contextlib.redirect_stderr(buf):
            warnings.simplefilter("ignore")
            yield buf
    finally:
        logging.disable(prev)


def _torch_dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def max_export_opset() -> int | None:
    """The newest opset this torch's TorchScript ONNX exporter (`dynamo=False`, what export-vision runs) writes."""
    try:
        from torch.onnx import _constants
    except ImportError:
        return None
    top = getattr(_constants, "ONNX_TORCHSCRIPT_EXPORTER_MAX_OPSET", None)
    return top or getattr(_constants, "ONNX_MAX_OPSET", None)


def check_opset(opset: int) -> None:
    """vision.opset above what the exporter writes is the recipe's mistake (exit 2), not an exporter traceback."""
    top = max_export_opset()
    if top is not None and opset > top:
        raise RecipeError(f"vision.opset {opset}: the installed torch exports ONNX opsets up to {top}; "
                          f"set vision.opset between 18 and {top}")


def export_vision_onnx(family, vision_dir: Path, out_dir: Path, *, dtype: str, opset: int = 18,
                       validate_batch_size: int = 3, max_rel_error: float = 1e-4, max_abs_error: float | None = None,
                       min_cosine: float = 0.9999, progress: Progress | None = None) -> dict:
    import torch

    check_opset(opset)
    progress = ensure(progress)
    vision_dir, out_dir = Path(vision_dir), Path(out_dir)
    config = read_json(vision_dir / "config.json")
    # Export in the recipe dtype, but bfloat16 graphs are poorly supported by ONNX Runtime's
    # CPU kernels: bf16 recipes export an fp16 graph (TensorRT builds it strongly typed).
    onnx_dtype = "float16" if dtype == "bfloat16" else dtype
    tdtype = _torch_dtype(onnx_dtype)
    module = family.build_vision_module(vision_dir, tdtype)
    in_names, out_names, dyn = family.onnx_io(config)
    example = family.example_vision_inputs(config, EXPORT_BATCH, tdtype, seed=0)
    out_path = out_dir / ONNX_FILE
    out_dir.mkdir(parents=True, exist_ok=True)

    task = progress.task("export-vision: torch.onnx.export", total=None)
    with _quiet_export(), torch.inference_mode():
        torch.onnx.export(module, tuple(example[n] for n in in_names), str(out_path), input_names=in_names,
                          output_names=out_names, dynamic_axes=dyn, opset_version=opset, dynamo=False,
                          do_constant_folding=True)
    task.done()
    # Large models: keep weights in an external data file next to the graph (2 GiB protobuf limit).
    _maybe_externalize(out_path)

    task = progress.task("export-vision: validating on ONNX Runtime", total=None)
    report = validate_onnx(family, module, out_path, config, dtype=tdtype, batch=validate_batch_size)
    task.done()
    report.update({"opset": opset, "onnx_dtype": onnx_dtype, "export_batch": EXPORT_BATCH,
                   "inputs": in_names, "outputs": out_names, "dynamic_axes": {k: {str(a): n for a, n in v.items()}
                                                                              for k, v in dyn.items()}})
    # Half-precision graphs round to ~1e-3 of the value per op: judge them at 2e-2 of the magnitude.
    tol_rel = max_rel_error if onnx_dtype == "float32" else max(max_rel_error, 2e-2)
    abs_ok = max_abs_error is None or report["max_abs_error"] <= max_abs_error
    if not np.isfinite(report["max_rel_error"]) or report["max_rel_error"] > tol_rel or not abs_ok \
            or not report["cosine"] >= min_cosine:
        abs_limit = f" (limit {max_abs_error:g})" if max_abs_error is not None else ""
        raise StageError(f"export-vision: ONNX Runtime output differs from torch at batch {validate_batch_size}: "
                         f"max error {report['max_rel_error']:.3g} of the features' largest magnitude "
                         f"{report['feature_scale']:.3g} (limit {tol_rel:g}), max abs error "
                         f"{report['max_abs_error']:.3g}{abs_limit}, cosine {report['cosine']:.6f} (limit {min_cosine})")
    (out_dir / ONNX_IO_FILE).write_text(json.dumps({"inputs": in_names, "outputs": out_names, "dtype": onnx_dtype,
                                                 "feature_rows": report["feature_rows"],
                                                 "hidden_size": report["hidden_size"]}, indent=2))
    import onnxruntime

    return {"backend": "onnx", "backend_version": f"onnxruntime {onnxruntime.__version__}", **report}


def _maybe_externalize(path: Path) -> None:
    if path.stat().st_size < (1 << 30):
        return
    import onnx

    model = onnx.load(str(path))
    onnx.save_model(model, str(path), save_as_external_data=True, all_tensors_to_one_file=True,
                    location="model.onnx.data")


def validate_onnx(family, module, onnx_path: Path, config: dict, *, dtype, batch: int, seed: int = 1) -> dict:
    import torch

    inputs = family.example_vision_inputs(config, batch, dtype, seed=seed)
    with torch.inference_mode():
        ref = module(*inputs.values()).float().numpy()
    sess = ort_session(onnx_path, ["CPUExecutionProvider"])
    feed = {k: v.numpy() for k, v in inputs.items()}
    got = sess.run(None, feed)[0].astype(np.float32)
    if got.shape != ref.shape:
        raise StageError(f"export-vision: ONNX output shape {got.shape} != torch {ref.shape} at batch {batch} "
                         "(is the batch axis dynamic?)")
    err = float(np.max(np.abs(got - ref)))
    scale = float(np.max(np.abs(ref)))
    rel = err / scale if scale > 0 else (0.0 if err == 0 else float("inf"))
    a, b = got.reshape(-1).astype(np.float64), ref.reshape(-1).astype(np.float64)
    cos = float(a @ b / max(np.linalg.norm(a) * np.linalg.norm(b), 1e-30))
    return {"validate_batch": batch, "max_abs_error": err, "max_rel_error": rel, "feature_scale": scale,
            "cosine": cos, "feature_rows": int(ref.shape[1]), "hidden_size": int(ref.shape[-1])}
