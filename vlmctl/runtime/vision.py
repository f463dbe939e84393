"""The vision encoder: runs the vision tower + projector for the images the scheduler is about to
prefill, batched across requests, with features cached by image content hash. A video is one item
whose work the family may split into parts (`FamilyProcessor.vision_parts`: chunks of frames, each
call the size of an image's); its rows are the parts' rows in order, cached under the video's hash.

Backends, chosen automatically and overridable (`--vision-backend`):
- `tensorrt`: the engine build-vision made, when one was built and TensorRT imports;
- `onnxruntime-gpu`: the exported ONNX file on ONNX Runtime's CUDA / TensorRT execution provider,
  when onnxruntime-gpu is installed;
- `torch`: the family's vision module in the engine's dtype on the decoder's device (the default
  on a CUDA host without those two);
- `onnxruntime`: the ONNX file on ONNX Runtime's CPU provider (the default on a CPU host).
Features come back as torch tensors on the decoder's device in its dtype, ready for the
prompt-embedding table; with the torch backend they never leave the GPU.
"""

from __future__ import annotations

import logging
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from ..errors import BackendUnavailableError, EngineError, InputError

log = logging.getLogger("vlmctl.runtime")

BACKENDS = ("auto", "tensorrt", "onnxruntime-gpu", "onnxruntime", "torch")


class OrtVisionRunner:
    def __init__(self, onnx_path: Path, providers: list[str] | None = None):
        from ..backends.onnxruntime import ort_session

        if not Path(onnx_path).exists():
            raise EngineError(f"{onnx_path}: ONNX vision model is missing")
        self.session = ort_session(onnx_path, providers or ["CPUExecutionProvider"])
        self.backend = "onnxruntime-gpu" if providers and providers[0] != "CPUExecutionProvider" else "onnxruntime"
        self.input_types = {i.name: i.type for i in self.session.get_inputs()}

    def __call__(self, feed: dict[str, np.ndarray]) -> torch.Tensor:
        cast = {k: (v.astype(np.float16) if self.input_types.get(k) == "tensor(float16)" else v) for k, v in feed.items()}
        return torch.from_numpy(np.ascontiguousarray(self.session.run(None, cast)[0]))


class TorchVisionRunner:
    backend = "torch"

    def __init__(self, family, vision_dir: Path, device="cpu", dtype=torch.float32):
        self.device = torch.device(device)
        if self.device.type == "cpu" and dtype != torch.float32:
            dtype = torch.float32  # half-precision conv/attention kernels are slow or missing on the CPU
        self.dtype = dtype
        self.module = family.build_vision_module(vision_dir, torch.float32).to(self.device, dtype).eval()

    @torch.inference_mode()
    def __call__(self, feed: dict[str, np.ndarray]) -> torch.Tensor:
        args = [torch.from_numpy(v).to(self.device, self.dtype if v.dtype.kind == "f" else None, non_blocking=True)
                for v in feed.values()]
        return self.module(*args)


class TrtVisionRunner:
    backend = "tensorrt"

    def __init__(self, engine_path: Path):
        from ..backends.tensorrt import TrtEngineRunner

        self.runner = TrtEngineRunner(engine_path)

    def __call__(self, feed: dict[str, np.ndarray]) -> torch.Tensor:
        return torch.from_numpy(np.ascontiguousarray(self.runner.run(feed)))


def ort_gpu_providers() -> list[str]:
    try:
        import onnxruntime as ort
    except ImportError:
        return []
    avail = ort.get_available_providers()
    return [p for p in ("TensorrtExecutionProvider", "CUDAExecutionProvider") if p in avail]


def choose_vision_runner(engine_dir: Path, family, built_backend: str, dtype, device: torch.device,
                         want: str = "auto"):
    """The vision runner for this host (see the module docstring for the order)."""
    engine_dir = Path(engine_dir)
    if want not in BACKENDS:
        raise InputError(f"unknown vision backend {want!r} (choose from {', '.join(BACKENDS)})")
    onnx = engine_dir / "export-vision" / "model.onnx"
    cuda = device.type == "cuda"
    if want == "tensorrt" or (want == "auto" and built_backend == "tensorrt" and cuda):
        try:
            return TrtVisionRunner(engine_dir / "build-vision" / "model.engine")
        except BackendUnavailableError:
            if want == "tensorrt":
                raise
            log.warning("the TensorRT vision engine cannot run here; falling back")
    if want == "onnxruntime-gpu" or (want == "auto" and cuda and ort_gpu_providers()):
        providers = ort_gpu_providers()
        if not providers:
            raise BackendUnavailableError("--vision-backend onnxruntime-gpu: ONNX Runtime has no CUDA or TensorRT "
                                          "execution provider here (pip install onnxruntime-gpu)")
        return OrtVisionRunner(onnx, providers + ["CPUExecutionProvider"])
    if want == "torch" or (want == "auto" and cuda):
        return TorchVisionRunner(family, engine_dir / "convert" / "vision", device=device, dtype=dtype)
    return OrtVisionRunner(onnx)


class FeatureCache:
    """LRU cache of per-image features (tensors on the decoder's device) keyed by image content hash."""

    def __init__(self, capacity: int = 256):
        self.capacity = capacity
        self.data: OrderedDict[str, torch.Tensor] = OrderedDict()
        self.hits = 0
        self.misses = 0

    def get(self, key: str):
        if key and key in self.data:
            self.data.move_to_end(key)
            self.hits += 1
            return self.data[key]
        self.misses += 1
        return None

    def put(self, key: str, value) -> None:
        if not key or self.capacity <= 0:
            return
        self.data[key] = value
        self.data.move_to_end(key)
        while len(self.data) > self.capacity:
            self.data.popitem(last=False)


class VisionEncoder:
    """Encodes ImageItems (from `family.load_processor(...).encode`) into feature rows."""

    def __init__(self, runner, processor, device: torch.device, dtype, *, max_batch: int = 32,
                 cache_size: int = 256):
        self.runner, self.processor = runner, processor
        self.device, self.dtype = device, dtype
        self.max_batch = max(1, max_batch)
        self.cache = FeatureCache(cache_size)
        self.images_encoded = 0
        self.calls = 0

    @property
    def backend(self) -> str:
        return self.runner.backend

    def encode(self, items: list) -> None:
        """Fill `item.features` ([rows, hidden] on the device) for every item that lacks them."""
        todo, dupes, first = [], [], {}
        for item in items:
            if item.features is not None:
                continue
            key = item.content_hash
            if key and key in first:  # the same image twice in this batch: encode it once
                dupes.append(item)
                continue
            cached = self.cache.get(key)
            if cached is not None:
                item.features = cached
            else:
                todo.append(item)
                if key:
                    first[key] = item
        groups: dict[tuple, list] = {}
        split: list[tuple] = []  # (item, its parts): a video's frames encoded in image-sized calls
        for item in todo:
            parts = self.processor.vision_parts(item)
            if parts:
                split.append((item, parts))
            for unit in parts or [item]:
                groups.setdefault(self.processor.batch_key(unit), []).append(unit)
        for group in groups.values():
            for i in range(0, len(group), self.max_batch):
                self._run(group[i:i + self.max_batch])
        for item, parts in split:
            feats = torch.cat([p.features for p in parts])
            if feats.shape[0] != item.num_tokens:
                raise EngineError(f"vision produced {feats.shape[0]} rows for a video expected to give "
                                  f"{item.num_tokens}")
            item.features = feats
            self.cache.put(item.content_hash, feats)
            for part in parts:  # a video's pixels and per-chunk rows are large; the item's rows are what stays
                part.inputs, part.features = {}, None
        for item in dupes:
            item.features = first[item.content_hash].features
            self.cache.hits += 1

    def _run(self, items: list) -> None:
        feed, sizes = self.processor.collate(items)
        out = self.runner(feed)
        self.calls += 1
        self.images_encoded += len(items)
        for it, chunk in zip(items, torch.split(out, sizes)):
            feats = self.processor.postprocess_features(chunk, it)
            if not isinstance(feats, torch.Tensor):
                feats = torch.from_numpy(np.ascontiguousarray(feats))
            feats = feats.reshape(-1, feats.shape[-1]).to(self.device, self.dtype)
            if feats.shape[0] != it.feature_rows:
                raise EngineError(f"vision produced {feats.shape[0]} rows for an image expected to give "
                                  f"{it.feature_rows}")
            it.features = feats
            self.cache.put(it.content_hash, feats)
