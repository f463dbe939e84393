"""TensorRT (10.x, 11.x): the availability probe and the runner of a serialized engine.

What it is: `tensorrt_available()` / `import_trt()` / `tensorrt_version()` for the stage graph, and
`TrtEngineRunner`, which runs a vision engine with torch CUDA tensors as I/O buffers, splitting a
feed that is larger than the engine's optimization profile into profile-sized chunks.

What it is not: the engine build (that is a stage body, `export/tensorrt.py`). Every TensorRT
call here is checked against the API surfaces recorded from NVIDIA's `tensorrt-cu12-bindings`
wheels (tests/data/tensorrt-*); none of it has run on vlmctl's machines (no TensorRT libraries).
"""

from __future__ import annotations

from pathlib import Path

import numpy as np

from ..errors import BackendUnavailableError, EngineError

SUPPORTED_MAJOR = (10, 11)


def trt_major(version: str) -> int:
    try:
        return int(version.split(".")[0])
    except ValueError:
        return -1


def tensorrt_version() -> str | None:
    """The importable tensorrt's version, or None (absent, or its libraries fail to load)."""
    try:
        import tensorrt
    except Exception:
        return None
    return getattr(tensorrt, "__version__", None)


def tensorrt_available() -> bool:
    version = tensorrt_version()
    return version is not None and trt_major(version) in SUPPORTED_MAJOR


def import_trt():
    try:
        import tensorrt as trt
    except Exception as e:
        raise BackendUnavailableError(f"TensorRT is not importable ({type(e).__name__}: {e}); "
                                      "install vlmctl[tensorrt] from NVIDIA's index") from None
    if trt_major(trt.__version__) not in SUPPORTED_MAJOR:
        raise BackendUnavailableError(f"TensorRT {trt.__version__} is not supported (need 10.x or 11.x)")
    return trt


def feed_chunks(feed: dict[str, np.ndarray], max_rows: int) -> list[dict[str, np.ndarray]]:
    """`feed` split along axis 0 into pieces of at most `max_rows` (the profile's batch maximum).

    Only a feed whose inputs share one leading length (images or crops) can be split; one whose
    leading axes differ (patches beside grid sizes) must fit the profile whole."""
    lengths = {v.shape[0] for v in feed.values()}
    n = lengths.pop() if len(lengths) == 1 else None
    if n is None:
        over = {k: v.shape for k, v in feed.items() if v.shape[0] > max_rows}
        if over:
            raise EngineError(f"the vision feed {over} exceeds the TensorRT engine's profile (at most {max_rows} "
                              "along axis 0) and cannot be split; rebuild with larger limits")
        return [feed]
    if n <= max_rows:
        return [feed]
    return [{k: v[i:i + max_rows] for k, v in feed.items()} for i in range(0, n, max_rows)]


class TrtEngineRunner:
    """Runs a serialized TensorRT engine with torch CUDA tensors as I/O buffers."""

    def __init__(self, engine_path: Path):
        trt = import_trt()
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
        # Profile 0's (min, opt, max) shapes; the smallest max along axis 0 bounds one call.
        self.profile = {n: [tuple(s) for s in self.engine.get_tensor_profile_shape(n, 0)] for n in self.inputs}
        self.max_rows = min(shape[2][0] for shape in self.profile.values()) if self.profile else 1
        self.stream = torch.cuda.Stream()

    def _torch_dtype(self, name):
        trt, torch = self.trt, self.torch
        return {trt.float32: torch.float32, trt.float16: torch.float16, trt.bfloat16: torch.bfloat16,
                trt.int32: torch.int32, trt.int64: torch.int64}[self.engine.get_tensor_dtype(name)]

    def run(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        outs = [self._run_one(chunk) for chunk in feed_chunks(feed, self.max_rows)]
        return outs[0] if len(outs) == 1 else np.concatenate(outs, 0)

    def _run_one(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        torch = self.torch
        keep = []
        with torch.cuda.stream(self.stream):
            for name in self.inputs:
                t = torch.from_numpy(np.ascontiguousarray(feed[name])).to("cuda", self._torch_dtype(name))
                keep.append(t)
                # set_input_shape returns False (no exception) for a shape outside the profile.
                if not self.context.set_input_shape(name, tuple(t.shape)):
                    lo, _, hi = self.profile[name]
                    raise EngineError(f"TensorRT refused input {name!r} of shape {tuple(t.shape)} "
                                      f"(its profile allows {lo} .. {hi})")
                self.context.set_tensor_address(name, t.data_ptr())
            outs = {}
            for name in self.outputs:
                shape = tuple(self.context.get_tensor_shape(name))
                outs[name] = torch.empty(shape, dtype=self._torch_dtype(name), device="cuda")
                self.context.set_tensor_address(name, outs[name].data_ptr())
            if not self.context.execute_async_v3(self.stream.cuda_stream):
                raise EngineError("TensorRT execution failed")
        self.stream.synchronize()
        return outs[self.outputs[0]].float().cpu().numpy()
