"""The engine: loads an engine directory and runs requests with continuous batching.

One `step()` admits waiting requests into free KV-cache slots (their images go through the
vision runner together, with features cached by image content hash), prefills them, then
advances every running request by one token in a single batched decode. Requests join and
leave between steps. `generate()` drives steps for an offline batch; the server runs steps in a
background thread. A single chat is a batch of one.

When build-llm made a TensorRT-LLM engine, the decoder is `TrtllmDecoder`, which batches and
samples itself (`external_batching`): a step then hands admitted prompts to it and turns the
tokens it streams back into the same events. Tokenization, vision, stop rules and text
detokenization (`stopping.TextStream`) stay here for both backends.

One request must never hurt another: every per-request phase of a step (image encoding, prefill,
sampling, detokenization, handing a prompt to TensorRT-LLM) runs inside its own error boundary, so
a failure there finishes only that request, with an event whose `finish_reason` is "error" and whose
`error` says why. Only a failure of the batched decode forward itself, which cannot be attributed
to one request, fails the requests of that batch.
"""

from __future__ import annotations

import itertools
import json
import logging
import threading
import time
from collections import deque
from dataclasses import dataclass, field
from pathlib import Path

import numpy as np
import torch

from ..artifacts import check_engine_files
from ..errors import (BackendUnavailableError, EngineError, InputError, LimitError, OptionError, RequestError,
                      VlmctlError)
from ..host import resolve_device
from ..models.base import EncodedPrompt
from ..models.registry import get_family
from .decoder import TorchDecoder
from .image_limits import ImageLimits
from .sampling import SamplingParams, make_generator, sample
from .stopping import TextStream
from .vision import FeatureCache, load_vision_runner

log = logging.getLogger("vlmctl.engine")
DEFAULT_MAX_STOP_SEQUENCES = 4  # OpenAI's limit


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    logprobs: list[dict] | None = None

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "finish_reason": self.finish_reason}


@dataclass
class StepEvent:
    request: "Request"
    token_id: int
    text_delta: str
    finished: bool
    finish_reason: str | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None  # set when finish_reason is "error": why this request failed


@dataclass
class Request:
    id: str
    prompt: EncodedPrompt
    params: SamplingParams
    generator: torch.Generator | None = None
    slot: int | None = None
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of `text` already handed out
    finished: bool = False
    finish_reason: str | None = None
    rope_delta: int = 0
    cache_len: int = 0
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[dict] = field(default_factory=list)
    detok: TextStream | None = None  # made at the first token
    error: str | None = None

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.token_ids)

    def completion(self) -> Completion:
        return Completion(self.id, self.text, list(self.output_ids), self.prompt_len, len(self.output_ids),
                          self.finish_reason or "abort", self.logprobs if self.params.logprobs is not None else None)


class Engine:
    def __init__(self, engine_dir: Path, *, device: str | None = None, max_batch_size: int | None = None,
                 feature_cache_size: int = 256, max_stop_sequences: int = DEFAULT_MAX_STOP_SEQUENCES,
                 image_limits: ImageLimits | None = None):
        """Load an engine directory. A damaged one (a file missing or of the wrong size, an unreadable
        config, tokenizer, ONNX or weights file) is one EngineError, raised before anything serves."""
        engine_dir = Path(engine_dir)
        check_engine_files(engine_dir)
        if max_stop_sequences < 0:
            raise LimitError(f"max_stop_sequences must be >= 0 (got {max_stop_sequences})")
        self.max_stop_sequences = max_stop_sequences
        self.image_limits = (image_limits or ImageLimits()).validate()
        try:
            self._load(engine_dir, device, max_batch_size, feature_cache_size)
        except (EngineError, InputError, BackendUnavailableError, OptionError):
            raise
        except VlmctlError as e:  # e.g. a CheckpointError from a cut weights file: the engine is what is broken
            raise EngineError(f"{engine_dir}: {e.message}") from e
        except Exception as e:
            first = (str(e).strip().splitlines() or [""])[0][:300]
            raise EngineError(f"{engine_dir}: cannot load the engine ({type(e).__name__}: {first}); "
                              f"`vlmctl verify {engine_dir}` checks every file against its manifest") from e

    def _load(self, engine_dir: Path, device: str | None, max_batch_size: int | None, feature_cache_size: int):
        self.engine_dir = engine_dir
        llm_cfg_path = engine_dir / "build-llm" / "config.json"
        fam_path = engine_dir / "convert" / "family.json"
        if not llm_cfg_path.exists() or not fam_path.exists():
            raise EngineError(f"{engine_dir}: not a vlmctl engine directory (run `vlmctl build RECIPE -o {engine_dir}`)")
        self.config = json.loads(llm_cfg_path.read_text())
        fam = json.loads(fam_path.read_text())
        self.family = get_family(fam["family"])
        self.processor = self.family.load_processor(engine_dir / "convert" / "processor")
        self.tokenizer = self.processor.tokenizer
        limits = self.config["limits"]
        self.limits = dict(limits)
        if max_batch_size is not None:
            # One rule for every decoder backend: the batch can only go down from what the engine was
            # built for (TensorRT-LLM cannot go above it, and the prompt table is sized for it).
            if not 1 <= max_batch_size <= limits["max_batch_size"]:
                raise LimitError(f"max_batch_size {max_batch_size} is outside 1..{limits['max_batch_size']}, the "
                                 "engine's built limit (rebuild with --set limits.max_batch_size=N for more)")
            self.limits["max_batch_size"] = max_batch_size
        self.device = resolve_device(device)
        backend = self.config.get("backend", "torch")
        if backend == "trtllm":
            from .trtllm_decoder import TrtllmDecoder

            self.decoder = TrtllmDecoder.load(engine_dir / "build-llm", max_batch=self.limits["max_batch_size"])
        elif backend == "torch":
            self.decoder = TorchDecoder.load(engine_dir / "build-llm", device=self.device,
                                             max_batch=self.limits["max_batch_size"])
        else:
            raise EngineError(f"{engine_dir}: unknown decoder backend {backend!r} in build-llm/config.json")
        # TensorRT-LLM schedules, batches and samples itself; the torch decoder is stepped from here.
        self._external = bool(getattr(self.decoder, "external_batching", False))
        vision_manifest = json.loads((engine_dir / "build-vision" / "manifest.json").read_text())
        self.vision_backend = vision_manifest.get("backend", "onnxruntime")
        self.vision = load_vision_runner(engine_dir, self.family, self.vision_backend, self.config["dtype"], self.device)
        self.feature_cache = FeatureCache(feature_cache_size)
        self.eos_ids = set(self.config.get("eos_token_ids") or [])
        self.model_name = self.config.get("name", engine_dir.name)
        self.vocab_size = self.decoder.vocab_size

        self._lock = threading.Lock()
        self._waiting: deque[Request] = deque()
        self._running: dict[str, Request] = {}
        self._aborts: set[str] = set()
        self._free_slots = list(range(self.limits["max_batch_size"]))[::-1]
        self._ids = itertools.count()
        self.max_running_seen = 0
        self.steps = 0

    # ---- requests --------------------------------------------------------------------------
    def encode(self, messages: list[dict], images: list) -> EncodedPrompt:
        max_images = self.limits["max_images_per_request"]
        if len(images) > max_images:
            raise LimitError(f"{len(images)} images in one request; this engine accepts at most {max_images}")
        for i, img in enumerate(images):  # before preprocessing: its cost follows the image's shape
            self.image_limits.check(img.size, f"image {i + 1}" if len(images) > 1 else "image")
        return self.processor.encode(messages, images)

    def encode_text(self, text: str) -> EncodedPrompt:
        if not text:  # a BOS alone is not a prompt either (and without one there is nothing to prefill)
            raise InputError("the prompt is empty; give at least one character of text")
        ids = self.tokenizer(text)["input_ids"]
        return EncodedPrompt(token_ids=list(ids), images=[], image_placeholder_id=-1, text=text)

    def check_limits(self, prompt: EncodedPrompt, params: SamplingParams) -> None:
        n, lim = len(prompt.token_ids), self.limits
        if n == 0:
            raise InputError("the prompt is empty (0 tokens); give at least one token of text")
        if len(params.stop) > self.max_stop_sequences:
            raise LimitError(f"{len(params.stop)} stop sequences; at most {self.max_stop_sequences} are accepted "
                             "(vlmctl serve --max-stop-sequences)")
        if n > lim["max_input_len"]:
            raise LimitError(f"the prompt has {n} tokens (images included); this engine's max_input_len is "
                             f"{lim['max_input_len']}")
        if params.max_tokens > lim["max_output_len"]:
            raise LimitError(f"max_tokens {params.max_tokens} exceeds this engine's max_output_len "
                             f"{lim['max_output_len']}")
        if n + params.max_tokens > self.decoder.max_seq:
            raise LimitError(f"the prompt ({n} tokens) plus max_tokens ({params.max_tokens}) is {n + params.max_tokens},"
                             f" beyond this engine's {self.decoder.max_seq} tokens per sequence")

    def submit(self, prompt: EncodedPrompt, params: SamplingParams, request_id: str | None = None) -> Request:
        params.validate()
        if params.top_k >= self.vocab_size:
            params.top_k = 0  # a top-k of the whole vocabulary (or more) keeps every token: no filter
        self.check_limits(prompt, params)
        if self._external:
            self.decoder.check_params(params)
        req = Request(id=request_id or f"req-{next(self._ids)}", prompt=prompt, params=params,
                      generator=None if self._external else make_generator(params.seed, self.device))
        with self._lock:
            self._waiting.append(req)
        return req

    def abort(self, request_id: str) -> None:
        with self._lock:
            self._aborts.add(request_id)

    @property
    def num_running(self) -> int:
        return len(self._running)

    @property
    def num_waiting(self) -> int:
        return len(self._waiting)

    def has_work(self) -> bool:
        return bool(self._waiting or self._running or self._aborts)

    # ---- the step --------------------------------------------------------------------------
    def step(self) -> list[StepEvent]:
        events: list[StepEvent] = []
        with self._lock:
            aborts, self._aborts = self._aborts, set()
            for rid in aborts:
                self._waiting = deque(r for r in self._waiting if r.id != rid)
                req = self._running.get(rid)
                if req is not None:
                    req.finished, req.finish_reason = True, "abort"
                    self._release(req)
            admitted = []
            while self._waiting and self._free_slots:
                req = self._waiting.popleft()
                req.slot = self._free_slots.pop()
                self._running[req.id] = req
                admitted.append(req)
        decoding = [r for r in self._running.values() if r not in admitted and not r.finished]
        self.max_running_seen = max(self.max_running_seen, len(self._running))
        if not admitted and not decoding:
            return events
        self.steps += 1

        if self._external:
            if admitted:
                admitted = self._encode_images_guarded(admitted, events)
            return events + self._step_external(admitted)

        logits_rows, reqs = [], []
        if admitted:
            for req in self._encode_images_guarded(admitted, events):
                try:
                    row = self._prefill(req)[None]
                except Exception as e:
                    events.append(self._fail(req, "prefill", e))
                    continue
                logits_rows.append(row)
                reqs.append(req)
        if decoding:
            try:
                slots = torch.tensor([r.slot for r in decoding])
                tokens = torch.tensor([r.output_ids[-1] for r in decoding])
                lens = torch.tensor([r.cache_len for r in decoding])
                deltas = (torch.tensor([r.rope_delta for r in decoding]) if any(r.rope_delta for r in decoding)
                          else None)
                logits_rows.append(self.decoder.decode(slots, tokens, lens, deltas))
            except Exception as e:  # one batched forward: no single request to blame
                events.extend(self._fail(r, "decode", e) for r in decoding)
            else:
                for r in decoding:
                    r.cache_len += 1
                reqs.extend(decoding)
        if not reqs:
            return events
        logits = torch.cat(logits_rows, 0)
        now = time.perf_counter()
        for req, picked in zip(reqs, self._sample_guarded(logits, reqs)):
            if isinstance(picked, Exception):
                events.append(self._fail(req, "sampling", picked))
                continue
            try:
                events.append(self._append_token(req, *picked, now))
            except Exception as e:
                events.append(self._fail(req, "detokenization", e))
        return events

    # ---- per-request error boundaries --------------------------------------------------------
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
            self._release(req)
        return StepEvent(req, -1, "", True, "error", error=msg)

    def _encode_images_guarded(self, reqs: list[Request], events: list[StepEvent]) -> list[Request]:
        """Encode the images of `reqs` together; if that fails, one request at a time, failing only
        the requests whose images fail. Returns the requests that can go on."""
        try:
            self._encode_images(reqs)
            return reqs
        except Exception as e:
            if len(reqs) == 1:
                events.append(self._fail(reqs[0], "image encoding", e))
                return []
        ok = []
        for req in reqs:
            try:
                self._encode_images([req])
                ok.append(req)
            except Exception as e:
                events.append(self._fail(req, "image encoding", e))
        return ok

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

    @staticmethod
    def _picked(logits: torch.Tensor, reqs: list[Request]) -> list[tuple]:
        toks, chosen, top = sample(logits, [r.params for r in reqs], [r.generator for r in reqs])
        out = []
        for i, (req, tok) in enumerate(zip(reqs, toks.tolist())):
            lp = float(chosen[i]) if chosen is not None else None
            tl = None
            if top is not None and req.params.logprobs:
                k = req.params.logprobs
                tl = list(zip(top.indices[i, :k].tolist(), top.values[i, :k].tolist()))
            out.append((tok, lp, tl))
        return out

    def _step_external(self, admitted: list[Request]) -> list[StepEvent]:
        """Submit the admitted prompts to the decoder, then turn what it streamed back into events."""
        events: list[StepEvent] = []
        submitted = False
        for req in admitted:
            prompt = req.prompt
            try:
                if self.processor.position_ids(prompt.token_ids, prompt) is not None:
                    raise EngineError("this model needs multi-dimensional rotary positions, which the TensorRT-LLM "
                                      "decoder does not take; rebuild with decoder.backend: torch")
                self.decoder.submit(req.id, prompt, req.params)
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

    def _encode_images(self, reqs: list[Request]) -> None:
        """Run the vision model once for every uncached image of the admitted requests."""
        todo, dupes, first = [], [], {}
        for req in reqs:
            for item in req.prompt.images:
                if item.features is not None:
                    continue
                key = item.content_hash
                if key and key in first:  # the same image twice in this step: encode it once
                    dupes.append(item)
                    continue
                cached = self.feature_cache.get(key)
                if cached is not None:
                    item.features = cached
                else:
                    todo.append(item)
                    if key:
                        first[key] = item
        if todo:
            self._run_vision(todo)
        for item in dupes:
            item.features = first[item.content_hash].features
            self.feature_cache.hits += 1

    def _run_vision(self, todo: list) -> None:
        # Images with the same batch key go through the vision model in one call.
        groups: dict[tuple, list] = {}
        for item in todo:
            groups.setdefault(self.processor.batch_key(item), []).append(item)
        for items in groups.values():
            feed, sizes = self.processor.collate(items)
            out = self.vision(feed)
            for it, chunk in zip(items, np.split(out, np.cumsum(sizes)[:-1])):
                feats = self.processor.postprocess_features(chunk, it)
                if feats.shape[0] != it.num_tokens:
                    raise EngineError(f"vision produced {feats.shape[0]} rows for an image expected to give "
                                      f"{it.num_tokens}")
                it.features = feats
                self.feature_cache.put(it.content_hash, feats)

    def _prefill(self, req: Request) -> torch.Tensor:
        prompt = req.prompt
        ids = torch.tensor(prompt.token_ids, dtype=torch.long)
        table = None
        if prompt.images:
            table = torch.from_numpy(np.concatenate([it.features for it in prompt.images], 0))
            mask = ids == prompt.image_placeholder_id
            n = int(mask.sum())
            if n != table.shape[0]:
                raise EngineError(f"prompt has {n} image positions but the images give {table.shape[0]} rows")
            ids[mask] = self.vocab_size + torch.arange(n)
            table = table.to(self.decoder.device)
        positions = self.processor.position_ids(prompt.token_ids, prompt)
        if positions is not None:
            positions = torch.as_tensor(positions)
            req.rope_delta = int(positions.max()) + 1 - len(prompt.token_ids)
        logits = self.decoder.prefill(req.slot, ids, table, positions)
        req.cache_len = len(prompt.token_ids)
        return logits

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
            if lp is not None:
                req.logprobs.append({"token_id": tok, "logprob": lp, "top": top or []})
            # Only text that can no longer change comes out: no half UTF-8 character, no stop-string prefix.
            delta, finish = req.detok.append(tok)
            if finish is None and len(req.output_ids) >= p.max_tokens:
                finish = "length"
            if finish is None and req.cache_len + 1 >= self.decoder.max_seq:
                finish = "length"
        if finish is not None and not req.detok.stopped:
            delta += req.detok.flush()
        req.text = req.detok.text
        req.emitted += len(delta)
        if finish is not None:
            req.finished, req.finish_reason, req.finish_time = True, finish, now
            with self._lock:
                self._release(req)
        return StepEvent(req, tok, delta, finish is not None, finish, lp, top)

    def _release(self, req: Request) -> None:
        if self._running.pop(req.id, None) is not None and req.slot is not None:
            self._free_slots.append(req.slot)
            req.slot = None
            if self._external:
                self.decoder.cancel(req.id)  # no-op once TensorRT-LLM has finished it

    # ---- offline ---------------------------------------------------------------------------
    def generate(self, prompts: list[EncodedPrompt], params: list[SamplingParams] | SamplingParams,
                 on_event=None) -> list[Completion]:
        if isinstance(params, SamplingParams):
            params = [params] * len(prompts)
        reqs = [self.submit(p, sp) for p, sp in zip(prompts, params)]
        while any(not r.finished for r in reqs):
            for ev in self.step():
                if on_event is not None:
                    on_event(ev)
        failed = [r for r in reqs if r.error is not None]
        if failed:
            raise RequestError(failed[0].error)
        return [r.completion() for r in reqs]

    def chat(self, messages: list[dict], images: list, params: SamplingParams, on_event=None) -> Completion:
        return self.generate([self.encode(messages, images)], params, on_event)[0]


def load_image(path: str | Path):
    """Open an image file with a clear error for missing or non-image files."""
    from PIL import Image, UnidentifiedImageError

    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such image file")
    if not p.is_file():
        raise InputError(f"{path}: not a file")
    try:
        img = Image.open(p)
        img.load()
    except (UnidentifiedImageError, OSError, ValueError) as e:
        raise InputError(f"{path}: not a readable image ({type(e).__name__})") from None
    return img.convert("RGB")
