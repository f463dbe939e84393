"""The engine: loads an engine directory and runs requests with continuous batching.

Public surface (what `chat`, `serve` and `bench` use): `Engine(engine_dir, EngineOptions)`,
`encode` / `encode_text`, `compile_grammar`, `tool_format`, `submit`, `abort`, `step`, `generate`,
`chat`, and read-only `limits`, `stats()`, `tokenizer`, `eos_ids`, `model_name`, `device`.

With the embedded torch decoder, one `step()` asks the scheduler which requests compute how many
tokens under the step's token budget (decode tokens of running requests, then prompt chunks of
admitted ones), encodes the images those chunks need (batched across requests, cached by content
hash), runs the chunks through the decoder over the paged KV cache, samples on the device and
turns tokens into text events. For a decoder with cross-attention layers, a request's images are
encoded when it is admitted and their cross-attention K/V written once into its blocks of the
cross-attention pool (sized for every running request's images), where they stay until it ends
or is preempted. On CUDA the decode rows replay a captured graph while prompt chunks
run eagerly. When build-llm made a TensorRT-LLM engine, TensorRT-LLM batches and samples itself:
a step then hands newly admitted prompts to it and turns what it streams back into the same
events. Tokenization, vision, stop rules and detokenization (`stopping.TextStream`) stay here for both.

Sampling extras cost only the requests that use them: the rows of requests with penalties or a
logit_bias go through a `LogitsProcessor`, the rows of structured-output requests get their
grammar's token mask (a `GrammarMatcher` per request, advanced by each sampled token, which allows
EOS only once the document is complete), rows with min_p are filtered after those; log-probabilities
are the model's own, from before any of it. A batch where nobody uses them samples as before.

One request must never hurt another: every per-request phase of a step (image encoding, sampling,
detokenization, handing a prompt to TensorRT-LLM) runs inside its own error boundary, so a failure
there finishes only that request, with an event whose `finish_reason` is "error" and whose `error`
says why. Only a failure of a batched forward pass, which cannot be attributed to one request,
fails the requests of that pass.
"""

from __future__ import annotations

import contextlib
import dataclasses
import hashlib
import itertools
import json
import logging
import numbers
import threading
import time
from dataclasses import asdict, dataclass
from pathlib import Path

import numpy as np
import torch

from ..errors import (BackendUnavailableError, EngineError, InputError, LimitError, OptionError, RequestError,
                      VlmctlError)
from ..formats.artifacts import check_engine_files
from ..formats.prompt_table import fake_ids, image_spans
from ..formats.workdir import EngineDir
from ..host import cuda_graphs_allowed, resolve_device
from ..media.images import flatten_to_rgb
from ..media.video import VideoLimits
from ..models.base import EncodedPrompt
from ..models.registry import get_family
from .image_limits import ImageLimits, decode_image
from .kv_cache import BlockPool, image_row_tokens
from .kv_quant import check_kv_cache_dtype
from .request import FINISHED, RUNNING, Completion, Request, StepEvent
from .sampling import SamplingParams, TokensInFlight, make_generator, sample
from .scheduler import Scheduled, Scheduler
from .stopping import TextStream
from .transfers import to_device

log = logging.getLogger("vlmctl.engine")

GiB = 1 << 30
DEFAULT_MAX_STOP_SEQUENCES = 4  # OpenAI's limit


@dataclass
class EngineOptions:
    """Run-time settings of an engine (`chat`, `serve` and `bench` options). Limits can only be lowered
    below what the engine was built for."""

    device: str | None = None  # default: cuda when available
    max_batch_size: int | None = None  # most sequences running at once
    max_input_len: int | None = None
    max_output_len: int | None = None
    max_images_per_request: int | None = None
    max_num_batched_tokens: int | None = None  # tokens one step computes (prompt chunks + decode)
    gpu_memory_utilization: float = 0.9  # share of the GPU's memory this engine may use (weights, KV, rest)
    kv_cache_tokens: int | None = None  # explicit KV pool size, overriding the memory-based sizing
    kv_cache_dtype: str = "auto"  # "auto": the model dtype; "fp8" / "int8": 8 bits and a scale a row (kv_quant.py)
    block_size: int = 16
    enable_prefix_caching: bool = True
    cuda_graphs: bool = True
    vision_backend: str = "auto"
    vision_batch_size: int = 32  # images per vision call
    # encode the images of requests left waiting on a worker thread while steps run (None: on CUDA
    # hosts only; on a CPU the vision runtime and the decoder would share the same cores)
    vision_overlap: bool | None = None
    # launch each decode step before reading the previous step's tokens back, so the host's per-token work
    # (detokenizing, stop checks, scheduling) runs while the GPU computes (None: on CUDA hosts only)
    async_scheduling: bool | None = None
    feature_cache_size: int = 256  # images whose features are kept
    max_stop_sequences: int = DEFAULT_MAX_STOP_SEQUENCES
    image_limits: ImageLimits | None = None  # width, height and aspect-ratio caps before preprocessing
    video_limits: VideoLimits | None = None  # videos per request, frames, pixels, decode bounds

    def validate(self) -> "EngineOptions":
        """The options' own ranges, checked before anything loads: an OptionError (exit 2) names the option."""
        from .vision import BACKENDS

        for name in _INT_OPTIONS:
            v = getattr(self, name)
            if v is not None and (isinstance(v, bool) or not isinstance(v, numbers.Integral)):
                raise OptionError(f"--{name.replace('_', '-')} must be an integer (got {v!r})")
        for name in ("enable_prefix_caching", "cuda_graphs", "vision_overlap", "async_scheduling"):
            v = getattr(self, name)
            if not isinstance(v, bool) and not (v is None and name in ("vision_overlap", "async_scheduling")):
                raise OptionError(f"{name} must be true or false (got {v!r})")
        if self.vision_batch_size is not None and self.vision_batch_size < 1:
            raise OptionError(f"--vision-batch-size must be at least 1 (got {self.vision_batch_size})")
        if self.feature_cache_size is not None and self.feature_cache_size < 0:
            raise OptionError(f"--feature-cache-size must be at least 0 (got {self.feature_cache_size})")
        if self.block_size < 1:
            raise OptionError(f"--block-size must be at least 1 (got {self.block_size})")
        if self.max_num_batched_tokens is not None and self.max_num_batched_tokens < 1:
            raise OptionError(f"--max-num-batched-tokens must be at least 1 (got {self.max_num_batched_tokens})")
        for name, cls in (("image_limits", ImageLimits), ("video_limits", VideoLimits)):
            if getattr(self, name) is not None and not isinstance(getattr(self, name), cls):
                raise OptionError(f"{name} must be a {cls.__name__} (got {type(getattr(self, name)).__name__})")
        if self.vision_backend not in BACKENDS:
            raise OptionError(f"--vision-backend: unknown vision backend {self.vision_backend!r} (choose from "
                              f"{', '.join(BACKENDS)})")
        if self.kv_cache_tokens is not None and self.kv_cache_tokens < self.block_size:
            raise OptionError(f"--kv-cache-tokens must be at least the block size {self.block_size} "
                              f"(got {self.kv_cache_tokens})")
        check_kv_cache_dtype(self.kv_cache_dtype)
        if not 0 < self.gpu_memory_utilization <= 1:
            raise OptionError(f"--gpu-memory-utilization must be in (0, 1] (got {self.gpu_memory_utilization})")
        if self.max_stop_sequences < 0:
            raise OptionError(f"--max-stop-sequences must be >= 0 (got {self.max_stop_sequences})")
        return self


_INT_OPTIONS = ("max_batch_size", "max_input_len", "max_output_len", "max_images_per_request", "max_num_batched_tokens",
                "kv_cache_tokens", "block_size", "vision_batch_size", "feature_cache_size", "max_stop_sequences")


@dataclass(frozen=True)
class EngineLimits:
    max_batch_size: int
    max_input_len: int
    max_output_len: int
    max_images_per_request: int
    max_seq_len: int  # prompt + output of one sequence
    max_num_batched_tokens: int
    kv_cache_tokens: int
    block_size: int

    def __getitem__(self, key: str):  # read-only mapping access, as in `engine.limits["max_batch_size"]`
        return getattr(self, key)

    def to_json(self) -> dict:
        return asdict(self)


def _lower(name: str, value: int | None, built: int) -> int:
    if value is None:
        return built
    least = 0 if name == "max_images_per_request" else 1  # 0 images: a text-only server
    if value < least:
        raise OptionError(f"--{name.replace('_', '-')} {value}: must be at least {least}")
    if value > built:
        # limits only go down from what the engine was built for (max_images_per_request: _max_images)
        raise LimitError(f"--{name.replace('_', '-')} {value} is above the engine's built limit {built} (limits only "
                         f"go down at run time; rebuild with --set limits.{name}=N for more)")
    return value


def _max_images(value: int | None, built: int, backend: str, vision_backend: str, max_input_len: int) -> int:
    """Images per request at run time. The torch decoder takes each request's prompt table as it
    comes, so more images than the build's are fine up to max_input_len (an image is at least one
    prompt row; every prompt is still held to max_input_len). The TensorRT-LLM decoder sized its
    prompt table at build time, and a TensorRT vision engine its input profile: both keep the
    built cap."""
    if value is None or value <= built or backend != "torch" or vision_backend == "tensorrt":
        if value is not None and value > built:
            what = ("the TensorRT-LLM decoder's prompt table" if backend != "torch"
                    else "the TensorRT vision engine's profile")
            raise LimitError(f"--max-images-per-request {value} is above the engine's built limit {built}, which "
                             f"{what} was built for (rebuild with --set limits.max_images_per_request=N)")
        return _lower("max_images_per_request", value, built)
    if value > max_input_len:
        raise LimitError(f"--max-images-per-request {value} is above max_input_len {max_input_len} (every image takes "
                         "at least one prompt row)")
    return value


class Engine:
    _longest_token: int | None = None  # characters of the vocabulary's longest entry (computed at first use)
    _vision_ahead = 0  # images the vision worker may encode ahead of admission (0: no worker)
    async_scheduling = False  # decode steps launched before the last step's tokens are read (the torch decoder)

    def __init__(self, engine_dir: Path, options: EngineOptions | None = None, **overrides):
        # a copy: the keyword overrides must not change the caller's EngineOptions (reused for another engine)
        opts = dataclasses.replace(options) if options is not None else EngineOptions()
        for k, v in overrides.items():
            if not hasattr(opts, k):
                raise TypeError(f"unknown engine option {k!r}")
            setattr(opts, k, v)
        self.options = opts.validate()
        engine_dir = Path(engine_dir)
        check_engine_files(engine_dir)
        self.max_stop_sequences = opts.max_stop_sequences
        self.image_limits = (opts.image_limits or ImageLimits()).validate()
        self.video_limits = (opts.video_limits or VideoLimits()).validate()
        try:
            self._load(engine_dir, opts)
        except (EngineError, InputError, BackendUnavailableError, OptionError):
            raise
        except VlmctlError as e:  # e.g. a CheckpointError from a cut weights file: the engine is what is broken
            raise EngineError(f"{engine_dir}: {e.message}") from e
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise EngineError(f"{engine_dir}: cannot load the engine ({type(e).__name__}: {first}); "
                              f"`vlmctl verify {engine_dir}` checks every file against its manifest") from e

    def _load(self, engine_dir: Path, opts: EngineOptions) -> None:
        """Load an engine directory. A damaged one (a file missing or of the wrong size, an unreadable
        config, tokenizer, ONNX or weights file) is one EngineError, raised before anything serves."""
        self.engine_dir = engine_dir
        self.load_seconds: dict[str, float] = {}  # time of each load phase (the torch decoder's), in order
        ed = EngineDir.open(engine_dir)
        try:
            self.config = json.loads(ed.llm_config.read_text())
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise EngineError(f"{engine_dir}: engine files are unreadable ({type(e).__name__}: {e})") from None
        family_name = ed.family_name()
        vision_runner = ed.vision_runner()
        self.family = get_family(family_name)
        self.device = torch.device(resolve_device(opts.device))
        with self._load_phase("processor"):  # the tokenizer and image processor (transformers' imports)
            self.processor = self.family.load_processor(ed.convert.processor, ed.convert.vision)
        self.tokenizer = self.processor.tokenizer
        self.eos_ids = set(self.config.get("eos_token_ids") or [])
        self.model_name = self.config.get("name", engine_dir.name)
        built = self.config["limits"]
        backend = self.config.get("backend", "torch")
        self.backend = backend
        max_seq = built["max_input_len"] + built["max_output_len"]
        lim = dict(max_batch_size=_lower("max_batch_size", opts.max_batch_size, built["max_batch_size"]),
                   max_input_len=_lower("max_input_len", opts.max_input_len, built["max_input_len"]),
                   max_output_len=_lower("max_output_len", opts.max_output_len, built["max_output_len"]))
        self.limits = None  # set below, once the vision runner is known
        self._grammar_compiler = None
        self._grammar_lock = threading.Lock()
        self._tool_format: tuple | None = None
        self.logits_proc = None  # runtime/logits_processing.LogitsProcessor, made at the first request using it
        self._mask_buffer = None

        self._lock = threading.Lock()
        # one step at a time: two threads stepping at once would schedule (and compute) the same chunks twice
        self._step_lock = threading.RLock()
        self._aborts: set[str] = set()
        self._ids = itertools.count()
        self._requests: dict[str, Request] = {}
        self.max_running_seen = 0
        self.steps = 0
        self.steps_ahead = 0  # steps launched before the previous step's tokens were read (async scheduling)
        self._in_flight: tuple[list[Scheduled], TokensInFlight] | None = None
        self.tokens_generated = 0
        self.prompt_tokens_computed = 0  # prompt tokens prefilled (prefix-cache hits not counted)

        self.kv_cache_dtype = opts.kv_cache_dtype
        if backend == "trtllm":
            from .trtllm_decoder import TrtllmDecoder

            if opts.kv_cache_dtype != "auto":
                raise OptionError("--kv-cache-dtype applies to the torch decoder; a TensorRT-LLM engine's KV cache "
                                  "type is fixed when it is built")

            self.vision = self._load_vision(vision_runner, opts)
            lim["max_images_per_request"] = _max_images(opts.max_images_per_request, built["max_images_per_request"],
                                                        backend, self.vision.backend, lim["max_input_len"])
            self.decoder = TrtllmDecoder.load(ed.build_llm, max_batch=lim["max_batch_size"])
            self.vocab_size = self.decoder.vocab_size
            self.limits = EngineLimits(**lim, max_seq_len=self.decoder.max_seq, max_num_batched_tokens=0,
                                       kv_cache_tokens=0, block_size=0)
            self.scheduler = None
            self._waiting: list[Request] = []
            self._running: dict[str, Request] = {}
            return
        if backend != "torch":
            raise EngineError(f"{engine_dir}: unknown decoder backend {backend!r} in build-llm/config.json")

        from .decoder import TorchDecoder

        phase = self._load_phase
        with phase("decoder weights"):
            self.decoder = TorchDecoder.load(ed.build_llm, device=self.device, max_seq=max_seq)
        self.decoder.use_graphs = self.decoder.use_graphs and opts.cuda_graphs
        self.decoder.kv_cache_dtype = opts.kv_cache_dtype  # before the pool is sized and allocated
        self.vocab_size = self.decoder.vocab_size
        with phase("vision"):
            self.vision = self._load_vision(vision_runner, opts)
        lim["max_images_per_request"] = _max_images(opts.max_images_per_request, built["max_images_per_request"],
                                                    backend, self.vision.backend, lim["max_input_len"])
        budget = opts.max_num_batched_tokens or (2048 if self.device.type == "cuda" else 512)
        budget = max(budget, lim["max_batch_size"])
        # a decoder whose image rows see each other computes an image in one chunk, which may pass the
        # budget by up to one image (scheduler.py)
        whole_images = self.decoder.spec.image_attention == "bidirectional"
        overshoot = int(self.config.get("image_tokens_per_image") or 0) if whole_images else 0
        cross_blocks, cross_rows = self._cross_blocks(opts.block_size, lim)
        num_blocks = self._kv_blocks(opts, lim["max_batch_size"], max_seq, budget + overshoot,
                                     cross_blocks * opts.block_size * self.decoder.cross_kv_bytes_per_row())
        self.decoder.allocate_cache(num_blocks, opts.block_size)
        self.pool = BlockPool(num_blocks, opts.block_size, opts.enable_prefix_caching)
        self.cross_pool = None
        if cross_blocks:
            self.decoder.allocate_cross_cache(cross_blocks, cross_rows)
            self.cross_pool = BlockPool(cross_blocks, opts.block_size, enable_prefix_caching=False)
        overlap = opts.vision_overlap if opts.vision_overlap is not None else self.device.type == "cuda"
        self._vision_ahead = 2 * self.vision.max_batch if overlap else 0  # images encoded ahead of admission
        self.async_scheduling = (opts.async_scheduling if opts.async_scheduling is not None
                                 else self.device.type == "cuda")
        self.scheduler = Scheduler(self.pool, max_num_seqs=lim["max_batch_size"], max_num_batched_tokens=budget,
                                   keep_images_whole=whole_images, cross_pool=self.cross_pool)
        self.limits = EngineLimits(**lim, max_seq_len=max_seq, max_num_batched_tokens=budget,
                                   kv_cache_tokens=self.pool.capacity * opts.block_size, block_size=opts.block_size)
        with phase("compile kernels"):  # what the three phases below would compile one by one, several at a time
            self.decoder.compile_kernels(lim["max_batch_size"], budget + overshoot)
        with phase("decode graphs"):  # with an AWQ decoder's kernels for the decode batches
            self.decoder.capture_graphs(lim["max_batch_size"])
        with phase("prefill kernels"):
            self.decoder.warm_prefill(budget + overshoot)
        with phase("warm steps"):
            self.decoder.warm_forward(lim["max_batch_size"])
        if self.decoder.use_graphs:
            with phase("step graphs"):  # steps with prompt rows, where VLMCTL_STEP_GRAPH_ROWS asks for them
                self.decoder.capture_step_graphs(lim["max_batch_size"], budget + overshoot)

    # ---- loading -------------------------------------------------------------------------------
    @contextlib.contextmanager
    def _load_phase(self, name: str):
        """Time one phase of loading into `load_seconds` (GPU work included: synchronized at its end)."""
        t = time.perf_counter()
        yield
        if self.device.type == "cuda" and torch.cuda.is_initialized():
            torch.cuda.synchronize(self.device)
        self.load_seconds[name] = round(time.perf_counter() - t, 3)

    def _load_vision(self, built_runner: str, opts: EngineOptions):
        from ..formats.torch_layout import torch_dtype
        from .vision import VisionEncoder, choose_vision_runner

        dtype = torch_dtype(self.config.get("dtype", "float16"))
        graphs = opts.cuda_graphs and cuda_graphs_allowed()
        runner = choose_vision_runner(self.engine_dir, self.family, built_runner, dtype, self.device,
                                      opts.vision_backend, graphs=graphs)
        return VisionEncoder(runner, self.processor, self.device, dtype, max_batch=opts.vision_batch_size,
                             cache_size=opts.feature_cache_size)

    def _cross_blocks(self, block_size: int, lim: dict) -> tuple[int, int]:
        """(blocks, most rows per sequence) of the cross-attention pool: room for the images of every
        running request (so admission never waits for it); (0, 0) without cross-attention layers."""
        if not self.decoder.n_cross_layers:
            return 0, 0
        per_image = int(self.config.get("image_tokens_per_image") or 0)
        rows = per_image * lim["max_images_per_request"]
        if rows == 0:  # a text-only engine: cross-attention layers are skipped for every request
            return 2, 0
        return lim["max_batch_size"] * -(-rows // block_size) + 1, rows

    def _kv_blocks(self, opts: EngineOptions, max_batch: int, max_seq: int, budget: int, reserved: int = 0) -> int:
        """Blocks of the KV pool: explicit tokens; on a GPU what the memory share leaves after weights,
        vision, activations and `reserved` bytes (the cross-attention pool); on a CPU enough for
        max_batch full-length sequences."""
        bs = opts.block_size
        per_token = self.decoder.kv_bytes_per_token()
        if opts.kv_cache_tokens is not None:
            return -(-opts.kv_cache_tokens // bs) + 1
        if self.device.type != "cuda":
            return -(-max_batch * max_seq // bs) + 1
        free, total = torch.cuda.mem_get_info(self.device)
        spec = self.decoder.spec
        # activations of the largest step (hidden, qkv, gate|up rows) and logits, plus vision and slack
        act = budget * (4 * spec.hidden_size + 2 * spec.intermediate_size + spec.q_size + 2 * spec.kv_size) * 4
        logits = max(max_batch, 64) * spec.vocab_size * 8
        reserve = act + logits + 2 * GiB + reserved
        avail = int(total * opts.gpu_memory_utilization) - (total - free) - reserve
        blocks = avail // (bs * per_token)
        if blocks < 2:
            raise EngineError(f"no GPU memory is left for the KV cache (free {free / GiB:.1f} GiB of {total / GiB:.1f};"
                              f" --gpu-memory-utilization {opts.gpu_memory_utilization}); raise it or use a smaller "
                              "--max-num-batched-tokens")
        return int(blocks) + 1

    # ---- requests --------------------------------------------------------------------------
    def encode(self, messages: list[dict], images: list, videos: list | None = None,
               tools: list[dict] | None = None, video_items: list | None = None) -> EncodedPrompt:
        """`videos`: media.video.Video objects, in the order of the messages' video parts; `video_items`:
        `prepare_videos(videos)` when the caller ran it already (else it runs here).
        `tools`: OpenAI function tools (models/tool_calls.normalize_tools) for the chat template
        to show; only for an engine whose `tool_format()` is not None."""
        images = [] if images is None else images
        self.check_inputs(messages, images)
        images = [flatten_to_rgb(img) for img in images]  # transparency onto white, as transformers does
        if not videos:
            return self.processor.encode(messages, images, tools=tools or None)
        if video_items is None:
            video_items = self.prepare_videos(videos)
        return self.processor.encode(messages, images, tools=tools or None, videos=videos,
                                     video_limits=self.video_limits, video_items=video_items)

    def check_inputs(self, messages: list[dict], images: list) -> None:
        """A request's cheap limits, before any tokenizing or media decoding: its text's size, its image count
        and each image's size (what preprocessing an image costs follows its shape)."""
        from PIL import Image

        if not isinstance(messages, (list, tuple)) or not all(isinstance(m, dict) for m in messages):
            raise InputError("messages must be a list of message dicts ({'role': ..., 'content': ...}), got "
                             f"{_type_name(messages)}")
        if not isinstance(images, (list, tuple)):
            raise InputError(f"images must be a list of PIL images, got {_type_name(images)}")
        for i, img in enumerate(images):
            if not isinstance(img, Image.Image):
                raise InputError(f"image {i + 1}: a {_type_name(img)}, not a PIL image (open an image file with "
                                 "vlmctl.runtime.engine.load_image)")
        self._check_text_size(sum(_text_chars(m.get("content")) for m in messages))
        max_images = self.limits.max_images_per_request
        if len(images) > max_images:
            raise LimitError(f"{len(images)} images in one request; this engine accepts at most {max_images}")
        for i, img in enumerate(images):
            self.image_limits.check(img.size, f"image {i + 1}" if len(images) > 1 else "image")

    def prepare_videos(self, videos: list) -> list:
        """One request's videos checked against this engine and its video limits (header first), then
        decoded and preprocessed as the family samples them: the items `encode(..., video_items=)` takes.
        The server runs this on a worker of its own, so that a slow decode does not hold other requests'
        prompt encoding."""
        if not self.family.video:
            raise InputError(f"the {self.family.name} family takes no video input")
        if self.backend != "torch":  # TensorRT-LLM's prompt table was sized for images
            raise InputError("video input runs on the embedded decoder only (this engine was built with "
                             f"decoder.backend: {self.backend})")
        lim = self.video_limits
        if len(videos) > lim.max_videos_per_request:
            raise LimitError(f"{len(videos)} videos in one request; this engine accepts at most "
                             f"{lim.max_videos_per_request}")
        for v in videos:  # the header's limits, before anything is decoded
            v.check(lim)
        if self.processor.video_token_id < 0:
            raise InputError(f"this {self.family.name} checkpoint has no video token, so it takes no videos")
        return self.processor.video_items(list(videos), lim)

    def tool_format(self) -> str | None:
        """The tool-call format of this engine's chat template (models/tool_calls.py), or None when
        the template does not show `tools` to the model (then tools cannot be served)."""
        if self._tool_format is None:
            from ..models.tool_calls import detect_format, template_renders_tools

            tpl = getattr(self.processor, "chat_template", None)
            fmt = detect_format(tpl) if isinstance(tpl, str) else None
            if fmt is not None and not template_renders_tools(self.tokenizer, tpl):
                fmt = None
            self._tool_format = (fmt,)
        return self._tool_format[0]

    @property
    def grammar_compiler(self):
        """The structured-output compiler for this engine's tokenizer (made at first use: setting up
        the tokenizer takes a few hundred milliseconds). Thread-safe."""
        with self._grammar_lock:
            if self._grammar_compiler is None:
                from .grammar import GrammarCompiler

                stops = sorted(self.eos_ids) or None
                self._grammar_compiler = GrammarCompiler(self.tokenizer, vocab_size=self.vocab_size,
                                                         stop_token_ids=stops)
            return self._grammar_compiler

    def compile_grammar(self, spec) -> None:
        """Compile (and cache) a GrammarSpec now: InputError for a schema that cannot be used. The
        server calls this off the event loop before it queues a request; `submit` then only copies
        the compiled matcher."""
        self._check_extras_backend(grammar=True)
        self.grammar_compiler.compile(spec)

    def _check_extras_backend(self, params: SamplingParams | None = None, grammar: bool = False) -> None:
        if self.scheduler is not None:
            return
        # TensorRT-LLM samples inside its executor: vlmctl cannot mask or adjust its logits
        names = (["response_format"] if grammar or (params is not None and params.grammar is not None) else []) + \
            (params.extras if params is not None else [])
        if names:
            raise InputError(f"{names[0]} is not available with the TensorRT-LLM decoder backend (it samples inside "
                             "its executor, where vlmctl cannot adjust or mask the logits); rebuild with "
                             "decoder.backend: torch", param=names[0])

    def encode_text(self, text: str) -> EncodedPrompt:
        if text is not None and not isinstance(text, str):
            raise InputError(f"the prompt must be a string, got {_type_name(text)}")
        if not text:  # a BOS alone is not a prompt either (and without one there is nothing to prefill)
            raise InputError("the prompt is empty; give at least one character of text")
        self._check_text_size(len(text))
        ids = self.tokenizer(text)["input_ids"]
        return EncodedPrompt(token_ids=list(ids), images=[], image_placeholder_id=-1, text=text)

    def _check_text_size(self, chars: int) -> None:
        """Refuse text that cannot fit in max_input_len tokens before tokenizing it (tens of MB take the
        tokenizer seconds, while other requests wait): no token stands for more characters than the
        vocabulary's longest entry (twice that, for normalizers that drop characters)."""
        if self._longest_token is None:
            self._longest_token = max((len(t) for t in self.tokenizer.get_vocab()), default=1)
        most = 2 * self._longest_token * self.limits.max_input_len
        if chars > most:
            raise LimitError(f"the prompt's text has {chars} characters, more than {self.limits.max_input_len} tokens "
                             f"(this engine's max_input_len) can hold")

    def check_limits(self, prompt: EncodedPrompt, params: SamplingParams) -> None:
        n, lim = len(prompt.token_ids), self.limits
        if n == 0:
            raise InputError("the prompt is empty (0 tokens); give at least one token of text")
        if len(params.stop) > self.max_stop_sequences:
            raise LimitError(f"{len(params.stop)} stop sequences; at most {self.max_stop_sequences} are accepted "
                             "(vlmctl serve --max-stop-sequences)")
        if n > lim.max_input_len:
            raise LimitError(f"the prompt has {n} tokens (images included); this engine's max_input_len is "
                             f"{lim.max_input_len}")
        if params.max_tokens > lim.max_output_len:
            raise LimitError(f"max_tokens {params.max_tokens} exceeds this engine's max_output_len "
                             f"{lim.max_output_len}")
        if n + params.max_tokens > lim.max_seq_len:
            raise LimitError(f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is {n + params.max_tokens},"
                             f" beyond this engine's {lim.max_seq_len} tokens per sequence")
        if self.scheduler is not None and n + params.max_tokens > lim.kv_cache_tokens:
            raise LimitError(f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) does not fit in this "
                             f"engine's whole KV cache ({lim.kv_cache_tokens} tokens)")

    def submit(self, prompt: EncodedPrompt, params: SamplingParams, request_id: str | None = None,
               leader: Request | None = None) -> Request:
        """Queue a request. `leader`: an earlier request with the same prompt (n > 1 samples); this
        one is admitted once the leader's prompt is in the prefix cache (runtime/scheduler.py)."""
        params.validate()
        if params.top_k >= self.vocab_size:  # a top-k of the whole vocabulary (or more) keeps every token: no
            params = params.replace(top_k=0)  # filter (a copy: the caller's parameters may serve other prompts)
        self.check_limits(prompt, params)
        self._check_extras_backend(params)
        bad = [t for t in params.logit_bias if t >= self.vocab_size]
        if bad:
            raise InputError(f"logit_bias: token id {bad[0]} is outside this model's vocabulary "
                             f"(0..{self.vocab_size - 1})", param="logit_bias")
        if self.scheduler is None:
            self.decoder.check_params(params)
        matcher = self.grammar_compiler.matcher(params.grammar) if params.grammar is not None else None
        req = Request(id=request_id or f"req-{next(self._ids)}", prompt=prompt, params=params,
                      generator=None if self.scheduler is None else make_generator(params.seed, self.device),
                      grammar=matcher, leader=leader if self.scheduler is not None else None)
        if self.scheduler is not None:
            self._prepare(req)
        with self._lock:
            self._requests[req.id] = req
            if self.scheduler is not None:
                self.scheduler.add(req)
            else:
                self._waiting.append(req)
        return req

    def _prepare(self, req: Request) -> None:
        """Decoder-side ids (fake ids for image rows), prefix-cache keys and rotary positions; for images
        read by cross-attention layers, where their rows sit in the request's cross K/V."""
        prompt = req.prompt
        if prompt.cross is not None and prompt.images:
            from .cross_kv import plan

            if not self.decoder.n_cross_layers:
                raise EngineError("the prompt's images go to cross-attention layers, which this decoder lacks")
            req.all_ids = list(prompt.token_ids)
            req.hash_tokens = list(prompt.token_ids)
            req.cross = plan(prompt.cross)
            # every token's K/V depends on every image (tokens before the first image attend to them all)
            req.hash_seed = hashlib.blake2b(b"".join((it.content_hash or f"{req.id}:{k}").encode() + b"\0"
                                                     for k, it in enumerate(prompt.images)), digest_size=16).digest()
            return
        rows = [int(it.num_tokens) for it in prompt.images]
        base = self.decoder.table_base
        ids = fake_ids(prompt.token_ids, prompt.placeholder_ids, base, sum(rows)) if rows \
            else np.asarray(prompt.token_ids, dtype=np.int64)
        req.all_ids = ids.tolist()
        keys = ids.copy()
        req.image_spans = image_spans(ids, base, rows) if rows else []
        for item, (start, n) in zip(prompt.images, req.image_spans):
            keys[start:start + n] = image_row_tokens(item.content_hash or f"{req.id}:{start}", n)
        req.hash_tokens = keys.tolist()
        positions = self.processor.position_ids(prompt.token_ids, prompt)
        if positions is not None:
            req.prompt_positions = np.asarray(positions, dtype=np.int64)
            req.rope_delta = int(req.prompt_positions.max()) + 1 - len(prompt.token_ids)

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    @property
    def num_running(self) -> int:
        return len(self.scheduler.running) if self.scheduler is not None else len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self.scheduler.waiting) if self.scheduler is not None else len(self._waiting)

    def has_work(self) -> bool:
        if self.scheduler is not None:
            return bool(self.scheduler.has_work() or self._aborts)
        return bool(self._waiting or self._running or self._aborts)

    def stats(self) -> dict:
        """Counters and gauges for /metrics and logs."""
        out = {"running": self.num_running, "waiting": self.num_waiting, "max_running_seen": self.max_running_seen,
               "steps": self.steps, "vision_backend": self.vision.backend, "tokens_generated": self.tokens_generated,
               "prompt_tokens_computed": self.prompt_tokens_computed,
               "feature_cache_hits": self.vision.cache.hits, "feature_cache_misses": self.vision.cache.misses,
               "vision_overlap": bool(self._vision_ahead),
               "async_scheduling": self.async_scheduling, "steps_ahead": self.steps_ahead,
               "vision_graph_replays": getattr(self.vision.runner, "graph_replays", 0)}
        if self.scheduler is not None:
            out.update(kv_cache_dtype=self.kv_cache_dtype, kv_block_size=self.pool.block_size,
                       kv_blocks_total=self.pool.capacity, kv_blocks_used=self.pool.num_used(),
                       kv_blocks_free=self.pool.num_free(), prefix_cache_queried_tokens=self.pool.queried_tokens,
                       prefix_cache_hit_tokens=self.pool.hit_tokens, preemptions=self.scheduler.preemptions)
            if self.cross_pool is not None:
                out.update(cross_kv_blocks_total=self.cross_pool.capacity,
                           cross_kv_blocks_used=self.cross_pool.num_used())
        return out

    @property
    def feature_cache(self):
        return self.vision.cache

    @property
    def vision_summary(self) -> str:
        """The vision backend and how it runs, for start-up lines: e.g. "torch, CUDA graphs, encoded ahead"."""
        parts = [self.vision.backend]
        if getattr(self.vision.runner, "graphs_enabled", False):
            parts.append("CUDA graphs")
        if self._vision_ahead:
            parts.append("encoded ahead")
        return ", ".join(parts)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        """Run one step. Thread-safe: steps from several threads run one after the other."""
        with self._step_lock:
            return self._step()

    def _step(self) -> list[StepEvent]:
        if self.scheduler is None:
            return self._step_streaming()
        events: list[StepEvent] = []
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            aborted = []
            for rid in aborts:
                req = self._requests.pop(rid, None)
                if req is not None and req.status != FINISHED:
                    req.finished, req.finish_reason = True, "abort"
                    self._release_extras(req)
                    aborted.append(req)
            if aborted:
                self.scheduler.finish_many(aborted)
            if self._in_flight is None:
                scheduled, _ = self.scheduler.schedule()
            if self._vision_ahead:
                self._encode_ahead()  # for the requests this step leaves waiting
        if self._in_flight is not None:
            return self._step_ahead(events)
        self.max_running_seen = max(self.max_running_seen, len(self.scheduler.running))
        if not scheduled:
            return events
        self.steps += 1
        self.prompt_tokens_computed += sum(max(0, min(s.start + s.n, s.request.prompt_len) - s.start)
                                           for s in scheduled)
        scheduled = self._prepare_images(scheduled, events)
        if not scheduled:
            return events
        try:
            logits, sampled = self._run(scheduled)
        except Exception as e:  # one batched forward: no single request to blame
            events.extend(self._fail(s.request, "forward", e) for s in scheduled)
            return events
        self.scheduler.advance(scheduled)
        if not sampled:
            return events
        return self._sample(events, logits, sampled)

    def _sample(self, events: list[StepEvent], logits: torch.Tensor, sampled: list[Scheduled]) -> list[StepEvent]:
        """Sample the step's rows: with async scheduling (every request may run ahead) leave the tokens in
        flight, to be read at the next step after it has launched its forward; else read and hand them out."""
        reqs = [s.request for s in sampled]
        if self.async_scheduling and all(self._may_run_ahead(r) for r in reqs):
            try:
                self._in_flight = (sampled, self._sample_on_device(logits, reqs))
                return events
            except Exception:
                self._in_flight = None  # sampled again below, row by row where it fails
        self._accept(events, reqs, self._sample_guarded(logits, reqs))
        return events

    # ---- async scheduling: a step launched before the previous step's tokens are read -------------------
    def _may_run_ahead(self, req: Request) -> bool:
        """Whether the next token of `req` can be computed before the host has seen its last one: by the
        decode step, so not with cross-attention images its generated tokens do not attend (those run as
        chunks). A grammar may: its mask is needed only to sample, and `_step_ahead` samples after the
        grammar has accepted the token read. Logits extras may: their token counts are updated on the device,
        by the sampling that precedes the next one on the stream."""
        return req.cross is None or req.cross.decode_mlp

    def _ends_at_next_token(self, req: Request) -> bool:
        """The token in flight is the request's last whatever it is (max_tokens or the sequence limit)."""
        n = len(req.output_ids) + 1
        return n >= req.params.max_tokens or req.prompt_len + n >= self.limits.max_seq_len

    def _plan_ahead(self, rows: list[Scheduled]) -> tuple[list[Scheduled], list[Scheduled]] | None:
        """The next step, planned before the tokens of `rows` (the step in flight) are read: (decode rows
        that take those tokens as input ids on the device, the other chunks: prompts being prefilled or
        admitted now), or None when the scheduler needs the tokens first. Called under `_lock`."""
        in_flight = {}
        for s in rows:
            req = s.request
            if req.status == RUNNING:
                if not self._may_run_ahead(req):
                    return None
                in_flight[id(req)] = not self._ends_at_next_token(req)
        if not in_flight:
            return None
        plan = self.scheduler.schedule_ahead(in_flight)
        if not plan:
            return None
        decode = [s for s in plan if id(s.request) in in_flight]
        return decode, [s for s in plan if id(s.request) not in in_flight]

    def _step_ahead(self, events: list[StepEvent]) -> list[StepEvent]:
        """Launch the next step (decode rows from the in-flight step's tokens, still on the device, and any
        prompt chunks), then read those tokens and hand them out while the GPU computes, then sample the new
        step without waiting."""
        rows, tokens = self._in_flight
        self._in_flight = None
        with self._lock:
            plan = self._plan_ahead(rows)
        decode, chunks = plan or ([], [])
        logits, chunk_sampled, launch_error = None, [], None
        if plan:
            self.steps += 1
            self.steps_ahead += 1
            self.max_running_seen = max(self.max_running_seen, len(self.scheduler.running))
            self.prompt_tokens_computed += sum(max(0, min(s.start + s.n, s.request.prompt_len) - s.start)
                                               for s in chunks)
            try:
                ids = self._ids_in_flight(rows, tokens, decode) if decode else None
                if chunks:
                    chunks = self._prepare_images(chunks, events)
                if decode or chunks:
                    logits, ran = self._run(chunks, decode, ids)
                    chunk_sampled = ran[len(decode):]
            except Exception as e:
                launch_error = e
        self._accept(events, [s.request for s in rows], self._unpack(tokens.read(), [s.request for s in rows]))
        if launch_error is not None:  # one batched forward: no single request to blame
            events.extend(self._fail(s.request, "forward", launch_error) for s in decode + chunks
                          if s.request.status == RUNNING)
            return events
        if logits is None:
            return events
        # the decode rows whose request the tokens just read did not finish
        live = [i for i, s in enumerate(decode) if s.request.status == RUNNING]
        done = [decode[i] for i in live] + chunks
        self.scheduler.advance(done)
        sampled = [decode[i] for i in live] + [s for s in chunk_sampled if s.request.status == RUNNING]
        if not sampled:
            return events
        keep = live + [len(decode) + i for i, s in enumerate(chunk_sampled) if s.request.status == RUNNING]
        if keep != list(range(logits.shape[0])):
            logits = logits[to_device(keep, torch.long, logits.device)]
        return self._sample(events, logits, sampled)

    @staticmethod
    def _ids_in_flight(rows: list[Scheduled], tokens: TokensInFlight, decode: list[Scheduled]) -> torch.Tensor:
        """The tokens in flight (on the device) of `decode`'s requests, in its order."""
        index = {id(s.request): i for i, s in enumerate(rows)}
        picks = [index[id(s.request)] for s in decode]
        ids = tokens.tokens
        if picks != list(range(len(ids))):
            ids = ids[to_device(picks, torch.long, ids.device)]
        return ids

    def _accept(self, events: list[StepEvent], reqs: list[Request], picked: list) -> None:
        """Hand out each request's sampled token (or its sampling failure) as events."""
        now = time.perf_counter()
        for req, pick in zip(reqs, picked):
            if req.finished:  # aborted while its token was in flight
                continue
            if isinstance(pick, Exception):
                events.append(self._fail(req, "sampling", pick))
                continue
            if req.grammar is not None and not req.grammar.accept(pick[0]):
                # cannot happen for a token drawn under the mask; if it does, the output is not the document
                events.append(self._fail(req, "structured output", EngineError(
                    f"the grammar refused sampled token {pick[0]}; the output would not match the requested format")))
                continue
            try:
                events.append(self._append_token(req, *pick, now))
            except Exception as e:
                events.append(self._fail(req, "detokenization", e))

    def _sample_guarded(self, logits: torch.Tensor, reqs: list[Request]) -> list:
        """(token, logprob, top logprobs) per request, or the exception that request's sampling raised.
        The batch is sampled at once; only when that fails is it redone row by row, to find the
        request at fault (rows drawn before the failure then draw again from their seeded generators)."""
        try:
            return self._picked(logits, reqs)
        except Exception:
            out = []
            for i, req in enumerate(reqs):
                try:
                    out.extend(self._picked(logits[i:i + 1], [req]))
                except Exception as e:
                    out.append(e)
            return out

    def _picked(self, logits: torch.Tensor, reqs: list[Request]) -> list[tuple]:
        return self._unpack(self._sample_on_device(logits, reqs).read(), reqs)

    def _sample_on_device(self, logits: torch.Tensor, reqs: list[Request]) -> TokensInFlight:
        """Sample the rows and start copying the tokens to the host; nothing here waits for the GPU
        (unless a request's extras or grammar need the host)."""
        params = [r.params for r in reqs]
        adjusted, raw = logits, None
        if any(r.params.extras or r.grammar is not None for r in reqs):
            # adjusted on a copy: `logits` stay the model's, for log-probabilities and for a row-by-row retry
            adjusted = self._apply_extras(logits.clone(), reqs)
            raw = logits if any(p.logprobs is not None for p in params) else None
        toks, chosen, top = sample(adjusted, params, [r.generator for r in reqs], logprob_logits=raw)
        if self.logits_proc is not None and any(r.extras_registered for r in reqs):
            self.logits_proc.update([r.id if r.extras_registered else None for r in reqs], toks)
        return TokensInFlight(toks, chosen, top)

    @staticmethod
    def _unpack(read: tuple, reqs: list[Request]) -> list[tuple]:
        """(token, logprob, top logprobs) per request from `TokensInFlight.read`."""
        toks, chosen, top = read
        out = []
        for i, (req, tok) in enumerate(zip(reqs, toks)):
            # only for a request that asked: the batch computes them when any of its requests did
            lp = float(chosen[i]) if chosen is not None and req.params.logprobs is not None else None
            tl = None
            if top is not None and req.params.logprobs:
                k = req.params.logprobs
                tl = list(zip(top[1][i][:k], top[0][i][:k]))
            out.append((tok, lp, tl))
        return out

    def _apply_extras(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        """Penalties and logit_bias, then the grammar masks, then min_p, each on the rows that use it.
        The mask comes before min_p, so min_p measures against the best token the grammar allows."""
        from .logits_processing import LogitsProcessor, apply_min_p

        counted = [r for r in reqs if r.params.logits_params().uses_counts]
        if counted:
            if self.logits_proc is None:
                self.logits_proc = LogitsProcessor(self.vocab_size, logits.device)
            for r in counted:
                if not r.extras_registered:  # registered on the engine thread, at the request's first sample
                    self.logits_proc.add(r.id, r.params.logits_params(), r.prompt.token_ids)
                    r.extras_registered = True
            logits = self.logits_proc.apply(logits, [r.id if r.extras_registered else None for r in reqs])
        logits = self._apply_grammar(logits, reqs)
        if any(r.params.min_p > 0 for r in reqs):
            from .sampling import GREEDY_BELOW

            apply_min_p(logits, [r.params.min_p for r in reqs],
                        [r.params.temperature if r.params.temperature >= GREEDY_BELOW else 0.0 for r in reqs])
        return logits

    def _apply_grammar(self, logits: torch.Tensor, reqs: list[Request]) -> torch.Tensor:
        if not any(r.grammar is not None for r in reqs):
            return logits
        from .grammar import MaskBuffer, apply_masks

        if self._mask_buffer is None:
            self._mask_buffer = MaskBuffer(self.grammar_compiler.mask_size)
        return apply_masks(logits, [r.grammar for r in reqs], self._mask_buffer)

    def _release_extras(self, req: Request) -> None:
        if req.extras_registered and self.logits_proc is not None:
            self.logits_proc.remove(req.id)
            req.extras_registered = False

    def _encode_ahead(self) -> None:
        """Queue the images of the requests at the head of the waiting queue (those the scheduler could not
        admit yet) for the vision worker, up to `_vision_ahead` images encoded or being encoded but not
        yet admitted: while they wait, the worker encodes them alongside the steps."""
        ahead = 0
        for looked, req in enumerate(self.scheduler.waiting):
            if ahead >= self._vision_ahead or looked >= 4 * self._vision_ahead:  # a bounded look per step
                break
            items = req.prompt.images
            if not items or all(it.features is not None for it in items):
                continue
            if req.vision_job is None:
                req.vision_job = self.vision.prefetch(items)
            ahead += len(items)

    def _prepare_images(self, scheduled: list[Scheduled], events: list[StepEvent]) -> list[Scheduled]:
        """Encode the images whose rows the scheduled chunks compute (all of a request's images when its
        cross-attention K/V are not written yet, and then write them); a request whose image fails to
        encode fails alone."""
        need: dict[str, tuple[Request, list]] = {}
        for s in scheduled:
            req = s.request
            if req.vision_job is not None and not req.vision_job.ready:
                # admitted while the worker still encodes its images (they were queued while it waited):
                # they are on their way, so wait for them rather than encode them twice; a failed job
                # leaves them without features, and they are encoded (and fail) again below, alone
                req.vision_job.done.wait()
            if req.cross is not None:
                if not req.cross_ready:
                    need.setdefault(req.id, (req, []))[1].extend(it for it in req.prompt.images
                                                                 if it.features is None)
                continue
            for item, (first, rows) in zip(req.prompt.images, req.image_spans):
                if first < s.start + s.n and first + rows > s.start and item.features is None:
                    need.setdefault(req.id, (req, []))[1].append(item)
        if need:
            try:
                self.vision.encode([it for _, items in need.values() for it in items])
            except Exception as e:  # one batch failed: retry per request, so only the faulty one fails
                log.warning("vision batch failed (%s); retrying request by request", e)
                for rid, (req, items) in need.items():
                    try:
                        self.vision.encode(items)
                    except Exception as e2:
                        events.append(self._fail(req, "image encoding", e2))
            for rid, (req, _) in need.items():
                if req.status != RUNNING:
                    continue
                if req.cross is not None:
                    try:
                        self._write_cross(req)
                    except Exception as e:
                        events.append(self._fail(req, "cross-attention states", e))
                else:
                    req.table = None  # rebuilt below with the new features
        # (a request can find its images encoded already: n > 1 siblings share their leader's prompt;
        # a cross-attention one is in `need` all the same, to write its own cross-attention K/V)
        out = []
        for s in scheduled:
            req = s.request
            if req.status != RUNNING:
                continue
            if req.prompt.images and req.table is None and req.cross is None:
                if self._vision_ahead and self.device.type == "cuda":
                    # made on the vision worker's stream, read on this one
                    for it in req.prompt.images:
                        if it.features is not None and it.features.is_cuda:
                            it.features.record_stream(torch.cuda.current_stream(self.device))
                dim = self.decoder.spec.hidden_size
                req.table = torch.cat([it.features if it.features is not None else
                                       torch.zeros((int(it.num_tokens), dim), dtype=self.decoder.dtype,
                                                   device=self.device) for it in req.prompt.images])
            out.append(s)
        return out

    def _write_cross(self, req: Request) -> None:
        """The request's cross-attention K/V from its image features, in its plan's row order."""
        items = req.prompt.images
        if any(it.features is None for it in items):
            raise EngineError("an image of the request has no features")
        states = torch.cat([it.features for it in items]) if len(items) > 1 else items[0].features
        if states.shape[0] != len(req.cross.order):
            raise EngineError(f"the images gave {states.shape[0]} rows, the prompt expects {len(req.cross.order)}")
        order = torch.from_numpy(req.cross.order).to(states.device)
        self.decoder.write_cross_kv(states.index_select(0, order), req.cross_blocks)
        req.cross_ready = True

    def _fail(self, req: Request, phase: str, exc: BaseException) -> StepEvent:
        """Finish `req` alone with finish_reason "error"; the other requests of the step go on."""
        if isinstance(exc, VlmctlError):
            msg = exc.message
            log.error("request %s failed in %s: %s", req.id, phase, msg)
        else:
            first = (str(exc).strip().splitlines() or [""])[0][:300]
            msg = f"internal error in {phase} ({type(exc).__name__}: {first})"
            log.error("request %s failed in %s", req.id, phase, exc_info=exc)
        req.error = msg
        req.finished, req.finish_reason, req.finish_time = True, "error", time.perf_counter()
        with self._lock:
            self._requests.pop(req.id, None)
            if self.scheduler is not None:
                self._release_extras(req)
                self.scheduler.finish(req)
            else:
                self._release_streaming(req)
        return StepEvent(req, -1, "", True, "error", error=msg)

    def _run(self, scheduled: list[Scheduled], ahead: list[Scheduled] | None = None,
             ahead_ids: torch.Tensor | None = None):
        """Run the chunks; (logits [k, V], the k chunks that end their request's known tokens). `ahead`: decode
        rows of a step launched ahead (`_step_ahead`), whose input ids `ahead_ids` are still on the device; their
        logits come first. A step of decode rows alone replays a captured graph; a step with a prompt chunk runs
        every row in one forward, so the weights are read once for the decode rows and the chunks."""
        from .decoder import Chunk, CrossRows

        dec = self.decoder
        ahead = ahead or []
        graph_rows, chunks, chunk_sched = [], [], []
        for s in scheduled:
            req = s.request
            graphable = (dec.use_graphs and s.n == 1 and s.start > 0 and s.completes
                         and (req.prompt_positions is None or s.start >= req.prompt_len)
                         and req.all_ids[s.start] < self.vocab_size
                         and (req.cross is None or (s.start >= req.prompt_len and req.cross.decode_mlp)))
            (graph_rows if graphable else chunk_sched).append(s)
        if chunk_sched or (ahead and graph_rows):  # one forward for all: decode rows join the chunks
            chunk_sched, graph_rows = graph_rows + chunk_sched, []
        if not chunk_sched:
            if ahead:
                return self._decode_rows(ahead, ahead_ids), list(ahead)
            rows = graph_rows
            ids = np.array([s.request.all_ids[s.start] for s in rows], dtype=np.int64)
            return self._decode_rows(rows, ids), rows
        for s in ahead:  # their ids are on the device; the forward takes them in place of these zeros
            req = s.request
            cross = None if req.cross is None else CrossRows(req.cross_blocks, *req.cross.rows_for(s.start, 1))
            chunks.append(Chunk(np.zeros(1, dtype=np.int64), req.position_of(s.start, 1), s.start, req.block_ids,
                                None, True, cross))
        base = dec.table_base
        for s in chunk_sched:
            req = s.request
            ids = np.asarray(req.all_ids[s.start:s.start + s.n], dtype=np.int64)
            cross = None if req.cross is None else CrossRows(req.cross_blocks, *req.cross.rows_for(s.start, s.n))
            chunks.append(Chunk(ids, req.position_of(s.start, s.n), s.start, req.block_ids,
                                req.table if (ids >= base).any() else None, s.completes, cross))
        logits = dec.forward(chunks, ahead_ids if ahead else None)
        return logits, list(ahead) + [s for s in chunk_sched if s.completes]

    def _decode_rows(self, rows: list[Scheduled], ids) -> torch.Tensor:
        """The captured decode step of `rows` (one token each, at position `start`); `ids` a numpy array, or a
        tensor on the device (a step launched ahead)."""
        dec = self.decoder
        bs = dec.block_size
        reqs = [s.request for s in rows]
        pos = np.array([s.start + r.rope_delta for s, r in zip(rows, reqs)], dtype=np.int64)
        slots = np.array([r.block_ids[s.start // bs] * bs + s.start % bs for s, r in zip(rows, reqs)], np.int64)
        lens = np.array([s.start + 1 for s in rows], dtype=np.int64)
        xtabs = xlens = None
        if any(r.cross is not None for r in reqs):
            xtabs = [r.cross_blocks if r.cross is not None else [] for r in reqs]
            xlens = np.array([r.cross.decode_hi if r.cross is not None else 0 for r in reqs], dtype=np.int64)
        return dec.decode(ids, pos, slots, [r.block_ids for r in reqs], lens, xtabs, xlens)

    def _step_streaming(self) -> list[StepEvent]:
        """A step with an externally batched decoder (TensorRT-LLM): submit new prompts, collect outputs."""
        events: list[StepEvent] = []
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            for rid in aborts:
                self._waiting = [r for r in self._waiting if r.id != rid]
                req = self._running.get(rid)
                if req is not None:
                    req.finished, req.finish_reason = True, "abort"
                    self._release_streaming(req)
            admitted = []
            while self._waiting and len(self._running) < self.limits.max_batch_size:
                req = self._waiting.pop(0)
                self._running[req.id] = req
                admitted.append(req)
        self.max_running_seen = max(self.max_running_seen, len(self._running))
        if not admitted and not self._running:
            return events
        self.steps += 1
        submitted = False
        for req in admitted:
            prompt = req.prompt
            try:
                self.vision.encode(prompt.images)
                if self.processor.position_ids(prompt.token_ids, prompt) is not None:
                    raise EngineError("this model needs multi-dimensional rotary positions, which the TensorRT-LLM "
                                      "decoder does not take; rebuild with decoder.backend: torch")
                self.decoder.submit(req.id, prompt, req.params)
                self.prompt_tokens_computed += req.prompt_len
                submitted = True
            except Exception as e:
                events.append(self._fail(req, "submission to TensorRT-LLM", e))
        # Block briefly only when nothing new was submitted, so a step never spins empty.
        for out in self.decoder.poll(timeout=0.0 if submitted else 0.05):
            req = self._running.get(out.request_id)
            if req is None or req.finished:
                continue
            now = time.perf_counter()
            lps = out.logprobs or []
            try:
                for i, tok in enumerate(out.tokens):
                    lp = lps[i] if i < len(lps) else None
                    events.append(self._append_token(req, tok, lp, None, now))
                    if req.finished:
                        break
                if not out.final or req.finished:
                    continue
                if out.error is None and out.reason == "stop" and self.decoder.end_id is not None:
                    # TensorRT-LLM stopped at end_id without streaming it: the step that sampled EOS.
                    events.append(self._append_token(req, int(self.decoder.end_id), None, None, now))
                    continue
            except Exception as e:
                events.append(self._fail(req, "detokenization", e))
                continue
            events.append(self._fail(req, "TensorRT-LLM", EngineError(
                f"TensorRT-LLM ended request {req.id} early ({out.error or out.reason}) before vlmctl's stop "
                "rules did")))
        return events

    def _release_streaming(self, req: Request) -> None:
        if self._running.pop(req.id, None) is not None:
            self.decoder.cancel(req.id)  # no-op once TensorRT-LLM has finished it
        self._requests.pop(req.id, None)

    def _append_token(self, req: Request, tok: int, lp, top, now) -> StepEvent:
        if req.first_token_time is None:
            req.first_token_time = now
        p = req.params
        if req.detok is None:
            req.detok = TextStream(self.tokenizer, p.stop)
        finish, delta = None, ""
        if not p.ignore_eos and (tok in self.eos_ids or tok in p.stop_token_ids):
            finish = "stop"
        else:
            req.output_ids.append(tok)
            req.all_ids.append(tok)
            req.hash_tokens.append(tok)
            self.tokens_generated += 1
            if lp is not None:
                req.logprobs.append({"token_id": tok, "logprob": lp, "top": top or []})
            # Only text that can no longer change comes out: no half UTF-8 character, no stop-string prefix.
            delta, finish = req.detok.append(tok)
            if finish is None and len(req.output_ids) >= p.max_tokens:
                finish = "length"
            if finish is None and req.prompt_len + len(req.output_ids) >= self.limits.max_seq_len:
                finish = "length"
        if finish is not None and not req.detok.stopped:
            delta += req.detok.flush()
        req.text = req.detok.text
        req.emitted += len(delta)
        if finish is not None:
            req.finished, req.finish_reason, req.finish_time = True, finish, now
            with self._lock:
                if self.scheduler is not None:
                    self._requests.pop(req.id, None)
                    self._release_extras(req)
                    self.scheduler.finish(req)
                else:
                    self._release_streaming(req)
        return StepEvent(req, tok, delta, finish is not None, finish, lp, top)

    # ---- offline ---------------------------------------------------------------------------
    def generate(self, prompts: list[EncodedPrompt], params: list[SamplingParams] | SamplingParams,
                 on_event=None) -> list[Completion]:
        """Run `prompts` to the end, batched together. Calls from several threads run one after the other
        (each holds the engine's steps until its own requests finish, so `on_event` sees its own events)."""
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        if len(params) != len(prompts):
            raise InputError(f"{len(prompts)} prompts but {len(params)} sampling parameters")
        with self._step_lock:
            reqs = [self.submit(p, sp) for p, sp in zip(prompts, params)]
            while any(not r.finished for r in reqs):
                for ev in self.step():
                    if on_event is not None:
                        on_event(ev)
        failed = [r for r in reqs if r.error is not None]
        if failed:
            raise RequestError(failed[0].error)
        return [r.completion() for r in reqs]

    def chat(self, messages: list[dict], images: list, params: SamplingParams, on_event=None,
             videos: list | None = None) -> Completion:
        return self.generate([self.encode(messages, images, videos=videos)], params, on_event)[0]


def _type_name(value) -> str:
    t = type(value)
    return t.__name__ if t.__module__ == "builtins" else f"{t.__module__}.{t.__qualname__}"


def _text_chars(content) -> int:
    """Characters of a chat message's text (string content or text parts)."""
    if isinstance(content, str):
        return len(content)
    if isinstance(content, list):
        return sum(len(p.get("text") or "") for p in content if isinstance(p, dict) and isinstance(p.get("text"), str))
    return 0


def load_image(path: str | Path, limits: ImageLimits | None = None):
    """Open an image file with a clear error for missing, non-image or oversized files (`limits`,
    default ImageLimits(), checked on the header before the pixels are decoded)."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such image file")
    if not p.is_file():
        raise InputError(f"{path}: not a file")
    return decode_image(p, str(path), limits)
