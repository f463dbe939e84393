"""TensorRT engine for the vision ONNX graph (TensorRT 10 and 11), and its runner.

The network is always built strongly typed: the ONNX graph already carries the precision
(fp16 graphs for fp16/bf16 recipes), which is the only way TensorRT 11 builds fp16 (it removed
weak typing and `BuilderFlag.FP16`) and works the same on TensorRT 10. Without `tensorrt` the
stage records that ONNX Runtime runs the ONNX file, so the engine directory still serves.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np

from ..errors import BackendUnavailableError, StageError
from ..progress import Progress, ensure

SUPPORTED_MAJOR = (10, 11)


def tensorrt_available() -> bool:
    try:
        import tensorrt  # noqa: F401
    except Exception:
        return False
    return trt_major(tensorrt.__version__) in SUPPORTED_MAJOR


def trt_major(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return -1


def _import_trt():
    try:
        import tensorrt as trt
    except Exception as e:
        raise BackendUnavailableError(f"TensorRT is not importable ({type(e).__name__}: {e}); "
                                      "install vlmctl[tensorrt] from NVIDIA's index") from None
    if trt_major(trt.__version__) not in SUPPORTED_MAJOR:
        raise BackendUnavailableError(f"TensorRT {trt.__version__} is not supported (need 10.x or 11.x)")
    return trt


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


def build_trt_engine(onnx_path: Path, engine_path: Path, *, max_batch: int, workspace_gib: float,
                     progress: Progress | None = None, shapes_profile: dict | None = None) -> dict:
    """`shapes_profile`: the family's (min, opt, max) shape per input (dynamic non-batch axes, e.g.
    patches); by default axis 0 of every input is a batch of 1..max_batch."""
    trt = _import_trt()
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


def build_vision_engine(export_dir: Path, out_dir: Path, *, backend: str, dtype: str, max_batch: int,
                        workspace_gib: float, progress: Progress | None = None, profile: dict | None = None) -> dict:
    onnx_path = Path(export_dir) / "model.onnx"
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    if backend == "tensorrt":
        info = build_trt_engine(onnx_path, out_dir / "model.engine", max_batch=max_batch,
                                workspace_gib=workspace_gib, progress=progress, shapes_profile=profile)
        runner = {"runner": "tensorrt", "engine": "model.engine"}
    else:
        import onnxruntime

        why = "recipe asks for it" if backend in ("onnxruntime", "torch") else "tensorrt is not installed"
        if backend == "onnxruntime" and not tensorrt_available():
            why = "tensorrt is not installed (or vision.backend is onnxruntime)"
        info = {"backend": backend, "backend_version": f"onnxruntime {onnxruntime.__version__}"
                if backend == "onnxruntime" else "torch", "note": f"no TensorRT engine built: {why}; "
                f"{'ONNX Runtime runs ../export-vision/model.onnx' if backend == 'onnxruntime' else 'torch runs the vision weights'}"}
        runner = {"runner": backend, "onnx": "../export-vision/model.onnx"}
    (out_dir / "runtime.json").write_text(json.dumps({**runner, "dtype": dtype, "max_batch": max_batch}, indent=2))
    return info


class TrtEngineRunner:
    """Runs a serialized TensorRT engine with torch CUDA tensors as I/O buffers."""

    def __init__(self, engine_path: Path):
        trt = _import_trt()
        import torch

        if not torch.cuda.is_available():
            raise BackendUnavailableError("a TensorRT engine needs a CUDA device")
        self.trt, self.torch = trt, torch
        self.logger = trt.Logger(trt.Logger.WARNING)
        self.engine = trt.Runtime(self.logger).deserialize_cuda_engine(Path(engine_path).read_bytes())
        if self.engine is None:
            raise BackendUnavailableError(f"{engine_path}: TensorRT could not load the engine "
                                          "(built by another TensorRT version or GPU?)")
        self.context = self.engine.create_execution_context()
        names = [self.engine.get_tensor_name(i) for i in range(self.engine.num_io_tensors)]
        self.inputs = [n for n in names if self.engine.get_tensor_mode(n) == trt.TensorIOMode.INPUT]
        self.outputs = [n for n in names if n not in self.inputs]
        self.stream = torch.cuda.Stream()

    def _torch_dtype(self, name):
        trt, torch = self.trt, self.torch
        return {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                trt.int32: torch.int32, trt.int64: torch.int64}[self.engine.get_tensor_dtype(name)]

    def run(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        torch = self.torch
        keep = []
        with torch.cuda.stream(self.stream):
            for name in self.inputs:
                t = torch.from_numpy(np.ascontiguousarray(feed[name])).to("cuda", self._torch_dtype(name))
                keep.append(t)
                self.context.set_input_shape(name, tuple(t.shape))
                self.context.set_tensor_address(name, t.data_ptr())
            outs = {}
            for name in self.outputs:
                shape = tuple(self.context.get_tensor_shape(name))
                outs[name] = torch.empty(shape, dtype=self._torch_dtype(name), device="cuda")
                self.context.set_tensor_address(name, outs[name].data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise StageError("TensorRT execution failed")
        self.stream.synchronize()
        return outs[self.outputs[0]].float().cpu().numpy()
