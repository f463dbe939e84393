"""TensorRT engine for the vision ONNX graph (TensorRT 10 and 11): the build-vision stage body.

The network is always built strongly typed: the ONNX graph already carries the precision
(fp16 graphs for fp16/bf16 recipes), which is the only way TensorRT 11 builds fp16 (it removed
weak typing and `BuilderFlag.FP16`) and works the same on TensorRT 10. Without `tensorrt` the
stage records that ONNX Runtime runs the ONNX file, so the engine directory still serves.
The probe and the engine runner live in `backends/tensorrt.py`.
"""

from __future__ import annotations

import json
from pathlib import Path

from ..backends.tensorrt import import_trt, tensorrt_available
from ..errors import StageError
from ..formats.workdir import ONNX_FILE, VISION_ENGINE_FILE, VISION_RUNTIME_FILE
from ..progress import Progress, ensure


def profile_shapes(input_shapes: dict[str, tuple[int, ...]], max_batch: int) -> dict[str, tuple[tuple, tuple, tuple]]:
    """min/opt/max shapes per input: the batch axis (0) ranges 1..max_batch, the rest stays fixed.

    A dynamic non-batch axis (-1) is refused: the vision graphs vlmctl exports fix them."""
    out = {}
    for name, shape in input_shapes.items():
        rest = tuple(shape[1:])
        if any(d < 0 for d in rest):
            raise StageError(f"input {name!r} has a dynamic non-batch axis {shape}; give it explicit profile bounds")
        opt = max(1, (max_batch + 1) // 2)
        out[name] = ((1, *rest), (opt, *rest), (max_batch, *rest))
    return out


def vision_profile(axis, max_batch_size: int, max_images_per_request: int) -> dict[str, tuple[tuple, tuple, tuple]]:
    """min/opt/max shapes per input of a vision graph whose axis 0 counts crops, tiles or patches, from
    the family's per-image `VisionAxis` (models/base.py): one vision call holds at most every image the
    engine admits at once (or, when calls do not batch across requests, one request's images), each at
    its most rows, or one part of a video (`axis.part_rows`), whichever is larger. Inputs whose axis 0
    counts images (`axis.per_image`) get the same range in images."""
    if axis.across_requests:
        images = max(1, max_batch_size * max(max_images_per_request, 1))
    else:
        images = max(1, max_images_per_request)
    hi = max(images * axis.max_rows, axis.part_rows)
    opt = min(axis.opt_rows, hi)
    lo = min(axis.min_rows, opt)
    out = {}
    for name, rest in axis.trailing.items():
        if name in axis.per_image:
            if any(n % axis.max_rows for n in (lo, opt, hi)):
                raise StageError(f"vision input {name!r} counts images, but the profile's rows ({lo}, {opt}, {hi}) "
                                 f"are not whole images of {axis.max_rows} rows")
            out[name] = tuple((n // axis.max_rows, *rest) for n in (lo, opt, hi))
        else:
            out[name] = ((lo, *rest), (opt, *rest), (hi, *rest))
    return out


def build_trt_engine(onnx_path: Path, engine_path: Path, *, max_batch: int, workspace_gib: float,
                     progress: Progress | None = None, shapes_profile: dict | None = None) -> dict:
    """`shapes_profile`: (min, opt, max) shape per input (`vision_profile`, for graphs whose axis 0 is
    crops or patches); by default axis 0 of every input is a batch of 1..max_batch."""
    trt = import_trt()
    progress = ensure(progress)
    logger = trt.Logger(trt.Logger.WARNING)
    builder = trt.Builder(logger)
    flags = 1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED)
    network = builder.create_network(flags)
    parser = trt.OnnxParser(network, logger)
    if not parser.parse_from_file(str(onnx_path)):
        errs = "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors))
        raise StageError(f"build-vision: TensorRT could not parse {onnx_path}: {errs}")
    config = builder.create_builder_config()
    config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(workspace_gib * (1 << 30)))
    shapes = {network.get_input(i).name: tuple(network.get_input(i).shape) for i in range(network.num_inputs)}
    profile = builder.create_optimization_profile()
    for name, (lo, opt, hi) in (shapes_profile or profile_shapes(shapes, max_batch)).items():
        profile.set_shape(name, lo, opt, hi)
    config.add_optimization_profile(profile)
    task = progress.task("build-vision: building TensorRT engine", total=None)
    serialized = builder.build_serialized_network(network, config)
    task.done()
    if serialized is None:
        raise StageError("build-vision: TensorRT failed to build the engine (see the log above)")
    Path(engine_path).write_bytes(bytes(serialized))
    return {"backend": "tensorrt", "backend_version": f"tensorrt {trt.__version__}", "max_batch": max_batch,
            "strongly_typed": True}


def build_vision_engine(onnx_path: Path, out_dir: Path, *, backend: str, dtype: str, max_batch: int,
                        workspace_gib: float, progress: Progress | None = None, profile: dict | None = None) -> dict:
    """The build-vision stage: a TensorRT engine from export-vision's ONNX file when the backend is
    tensorrt, and in every case VISION_RUNTIME_FILE, the record of which runner the runtime starts with."""
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if backend == "tensorrt":
        info = build_trt_engine(onnx_path, out_dir / VISION_ENGINE_FILE, max_batch=max_batch,
                                workspace_gib=workspace_gib, progress=progress, shapes_profile=profile)
        runner = {"runner": "tensorrt", "engine": VISION_ENGINE_FILE}
    else:
        import onnxruntime

        why = "recipe asks for it" if backend in ("onnxruntime", "torch") else "tensorrt is not installed"
        if backend == "onnxruntime" and not tensorrt_available():
            why = "tensorrt is not installed (or vision.backend is onnxruntime)"
        runs = f"ONNX Runtime runs ../export-vision/{ONNX_FILE}" if backend == "onnxruntime" else \
            "torch runs the vision weights"
        info = {"backend": backend, "backend_version": f"onnxruntime {onnxruntime.__version__}"
                if backend == "onnxruntime" else "torch", "note": f"no TensorRT engine built: {why}; {runs}"}
        runner = {"runner": backend, "onnx": f"../export-vision/{ONNX_FILE}"}
    (out_dir / VISION_RUNTIME_FILE).write_text(json.dumps({**runner, "dtype": dtype, "max_batch": max_batch},
                                                          indent=2))
    return info
