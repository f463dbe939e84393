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

`prefetch` encodes ahead of time on a worker thread (and, on CUDA, its own stream), so the images
of waiting requests are encoded while the engine thread runs decode steps; the scheduler admits a
request once its job is done. The worker lives only while jobs are queued.
"""

from __future__ import annotations

import contextlib
import logging
import threading
from collections import OrderedDict
from pathlib import Path

import numpy as np
import torch

from ..errors import BackendUnavailableError, EngineError, InputError
from ..formats.workdir import WorkDir

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
    """The family's vision module in torch. On CUDA, for families whose module is graph-safe
    (`VLMFamily.graph_vision`), a call of up to `MAX_GRAPH_BATCH` images replays a CUDA graph
    captured for its batch bucket (the batch padded to a power of two): the eager module launches
    hundreds of small kernels, so one image costs about as much host time as a batch of them."""

    backend = "torch"
    MAX_GRAPH_BATCH = 8  # larger batches are GPU-bound eagerly; their graphs would pin more memory

    def __init__(self, family, vision_dir: Path, device="cpu", dtype=torch.float32, graphs: bool = False):
        self.device = torch.device(device)
        if self.device.type == "cpu" and dtype != torch.float32:
            dtype = torch.float32  # half-precision conv/attention kernels are slow or missing on the CPU
        self.dtype = dtype
        self.module = family.build_vision_module(vision_dir, dtype).to(self.device).eval()
        self.graphs_enabled = bool(graphs and self.device.type == "cuda" and family.graph_vision)
        self._graphs: dict[tuple, tuple] = {}  # (bucket, input shapes) -> (graph, static inputs, static output)
        self._pool = None
        self._last_use = None  # CUDA event after the last replay's copy-out
        self.graph_replays = 0
        if self.graphs_enabled:
            # capture every bucket now for the images the processor makes (the tower's configured size),
            # so no request pays for a capture; other input shapes are captured when they first come
            import json

            with open(Path(vision_dir) / "config.json") as f:
                example = family.example_vision_inputs(json.load(f), 1, dtype)
            try:
                self.capture_buckets([v.to(self.device) for v in example.values()])
            except Exception as e:  # a module that cannot be captured still runs, eagerly
                log.warning("vision: CUDA graph capture failed (%s: %s); running the tower eagerly",
                            type(e).__name__, e)
                self.graphs_enabled = False
                self._graphs.clear()

    @torch.inference_mode()
    def __call__(self, feed: dict[str, np.ndarray]) -> torch.Tensor:
        args = [torch.from_numpy(v).to(self.device, self.dtype if v.dtype.kind == "f" else None, non_blocking=True)
                for v in feed.values()]
        b = args[0].shape[0] if args and args[0].dim() else 0
        if not self.graphs_enabled or not 0 < b <= self.MAX_GRAPH_BATCH or any(a.shape[0] != b for a in args):
            return self.module(*args)
        bucket = 1 << (b - 1).bit_length()
        key = (bucket,) + tuple((tuple(a.shape[1:]), a.dtype) for a in args)
        entry = self._graphs.get(key) or self._capture(key, args, bucket)
        graph, static_in, static_out = entry
        stream = torch.cuda.current_stream(self.device)
        if self._last_use is not None:
            # the previous call may have run on another stream (the vision worker's or the engine's):
            # its replay and copy-out must be done before this one overwrites the static buffers
            stream.wait_event(self._last_use)
        for s, a in zip(static_in, args):
            s[:b].copy_(a)
        graph.replay()
        self.graph_replays += 1
        # the static output is overwritten by the next replay: hand out a copy of the real rows
        out = static_out[:b].clone()
        self._last_use = torch.cuda.Event()
        self._last_use.record(stream)
        return out

    @torch.inference_mode()
    def capture_buckets(self, args: list[torch.Tensor]) -> None:
        """Capture the graph of every batch bucket for inputs shaped like `args` (largest first: the
        smaller ones reuse its memory pool)."""
        b = self.MAX_GRAPH_BATCH
        while b >= 1:
            key = (b,) + tuple((tuple(a.shape[1:]), a.dtype) for a in args)
            if key not in self._graphs:
                self._capture(key, args, b)
            b //= 2

    def _capture(self, key: tuple, args: list[torch.Tensor], bucket: int) -> tuple:
        static_in = [torch.zeros((bucket,) + tuple(a.shape[1:]), dtype=a.dtype, device=self.device) for a in args]
        side = torch.cuda.Stream(self.device)
        side.wait_stream(torch.cuda.current_stream(self.device))
        with torch.cuda.stream(side):  # warm-up outside the graph: lazy inits, cuBLAS/cuDNN workspaces
            for _ in range(2):
                self.module(*static_in)
        torch.cuda.current_stream(self.device).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: another thread's CUDA calls (the engine's) do not invalidate this capture
        with torch.cuda.graph(graph, pool=self._pool, capture_error_mode="thread_local"):
            static_out = self.module(*static_in)
        if self._pool is None:
            self._pool = graph.pool()
        self._graphs[key] = entry = (graph, static_in, static_out)
        log.debug("vision: captured a CUDA graph for batch bucket %d", bucket)
        return entry


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
                         want: str = "auto", graphs: bool = True):
    """The vision runner for this host (see the module docstring for the order). `graphs`: let the
    torch runner replay CUDA graphs (where the family allows it)."""
    engine = WorkDir(engine_dir)
    if want not in BACKENDS:
        raise InputError(f"unknown vision backend {want!r} (choose from {', '.join(BACKENDS)})")
    onnx = engine.onnx
    cuda = device.type == "cuda"
    if want == "tensorrt" or (want == "auto" and built_backend == "tensorrt" and cuda):
        try:
            return TrtVisionRunner(engine.vision_engine)
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
        return TorchVisionRunner(family, engine.convert.vision, device=device, dtype=dtype, graphs=graphs)
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


class VisionJob:
    """Images queued for the worker; `done` is set once their features are computed (on CUDA, the
    worker's stream has finished them) or `error` says why not."""

    __slots__ = ("items", "done", "error")

    def __init__(self, items: list):
        self.items = items
        self.done = threading.Event()
        self.error: BaseException | None = None

    @property
    def ready(self) -> bool:
        return self.done.is_set()


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
        self._lock = threading.RLock()  # one encode at a time: the worker's and the engine thread's
        self._queue: list[VisionJob] = []
        self._queue_lock = threading.Lock()
        self._worker: threading.Thread | None = None
        self._stream = None  # the worker's CUDA stream, made on first use

    @property
    def backend(self) -> str:
        return self.runner.backend

    # ---- ahead of time, on a worker thread -------------------------------------------------
    def prefetch(self, items: list) -> VisionJob:
        """Queue `items` for encoding on the worker thread; returns their job."""
        job = VisionJob([it for it in items if it.features is None])
        if not job.items:
            job.done.set()
            return job
        with self._queue_lock:
            self._queue.append(job)
            if self._worker is None:
                self._worker = threading.Thread(target=self._drain, name="vlmctl-vision", daemon=True)
                self._worker.start()
        return job

    def _drain(self) -> None:
        """Encode queued jobs (all that are queued, batched together) until the queue is empty, then exit."""
        if self.device.type == "cuda" and self._stream is None:
            self._stream = torch.cuda.Stream(self.device)
        while True:
            with self._queue_lock:
                if not self._queue:
                    self._worker = None
                    return
                jobs, self._queue = self._queue, []
            with torch.cuda.stream(self._stream) if self._stream is not None else contextlib.nullcontext():
                try:
                    self.encode([it for job in jobs for it in job.items])
                except Exception as e:  # one batch failed: retry job by job, so only the faulty one fails
                    log.warning("vision batch failed (%s); retrying request by request", e)
                    for job in jobs:
                        try:
                            self.encode(job.items)
                        except Exception as e2:
                            job.error = e2
                if self._stream is not None:
                    self._stream.synchronize()  # the features are complete before anyone reads them
            for job in jobs:
                job.done.set()

    # ---- now, on the calling thread --------------------------------------------------------
    def encode(self, items: list) -> None:
        """Fill `item.features` ([rows, hidden] on the device) for every item that lacks them."""
        with self._lock:
            self._encode(items)

    def _encode(self, items: list) -> None:
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
        rows = self.processor.run_vision(items, self.runner)
        self.calls += 1
        self.images_encoded += len(items)
        for it, feats in zip(items, rows):
            feats = feats.to(self.device, self.dtype)
            it.features = feats
            self.cache.put(it.content_hash, feats)
