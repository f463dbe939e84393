"""Vision runners: ONNX Runtime (default), TensorRT (when built and installed), torch (fallback).

All take a feed of numpy arrays whose first axis is the batch (images or crops, possibly from
several requests) and return the image features as float32 numpy [batch, rows, hidden].
"""

from __future__ import annotations

from collections import OrderedDict
from pathlib import Path

import numpy as np

from ..errors import BackendUnavailableError, EngineError


class OrtVisionRunner:
    backend = "onnxruntime"

    def __init__(self, onnx_path: Path):
        from ..backends.onnxruntime import ort_session

        if not Path(onnx_path).exists():
            raise EngineError(f"{onnx_path}: ONNX vision model is missing")
        self.session = ort_session(onnx_path)
        self.input_types = {i.name: i.type for i in self.session.get_inputs()}

    def __call__(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        cast = {k: (v.astype(np.float16) if self.input_types.get(k) == "tensor(float16)" else v) for k, v in feed.items()}
        return self.session.run(None, cast)[0].astype(np.float32)


class TorchVisionRunner:
    backend = "torch"

    def __init__(self, family, vision_dir: Path, device="cpu", dtype="float32"):
        import torch

        self.torch = torch
        self.device = device
        self.module = family.build_vision_module(vision_dir, torch.float32).to(device)
        self.dtype = {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[dtype]
        if device == "cpu" and self.dtype != torch.float32:
            self.dtype = torch.float32  # half precision conv/attention kernels are slow or missing on CPU
        self.module = self.module.to(self.dtype)

    def __call__(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        torch = self.torch
        with torch.inference_mode():
            args = [torch.from_numpy(v).to(self.device, self.dtype if v.dtype.kind == "f" else None) for v in feed.values()]
            return self.module(*args).float().cpu().numpy()


class TrtVisionRunner:
    backend = "tensorrt"

    def __init__(self, engine_path: Path):
        from ..backends.tensorrt import TrtEngineRunner

        self.runner = TrtEngineRunner(engine_path)

    def __call__(self, feed: dict[str, np.ndarray]) -> np.ndarray:
        return self.runner.run(feed)


def load_vision_runner(engine_dir: Path, family, backend: str, dtype: str, device: str = "cpu"):
    engine_dir = Path(engine_dir)
    if backend == "tensorrt":
        try:
            return TrtVisionRunner(engine_dir / "build-vision" / "model.engine")
        except BackendUnavailableError:
            raise
    if backend == "torch":
        return TorchVisionRunner(family, engine_dir / "convert" / "vision", device=device, dtype=dtype)
    return OrtVisionRunner(engine_dir / "export-vision" / "model.onnx")


class FeatureCache:
    """LRU cache of per-image features keyed by image content hash."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self.data: OrderedDict[str, np.ndarray] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str):
        if key and key in self.data:
            self.data.move_to_end(key)
            self.hits += 1
            return self.data[key]
        self.misses += 1
        return None

    def put(self, key: str, value: np.ndarray) -> None:
        if not key or self.capacity <= 0:
            return
        self.data[key] = value
        self.data.move_to_end(key)
        while len(self.data) > self.capacity:
            self.data.popitem(last=False)
