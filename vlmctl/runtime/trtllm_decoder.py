"""The TensorRT-LLM decoder backend, parent side: requests as plain data, a worker process.

What it is: the decoder half of `Engine` when build-llm wrote a TensorRT-LLM engine. The engine
still tokenizes, runs the vision model and applies vlmctl's stop rules; this backend turns a
prompt into TensorRT-LLM's prompt-tuning request (ids >= vocab_size index the request's own
embedding table, exactly the embedded decoder's contract) and streams the tokens back.
Continuous batching, the paged KV cache and sampling are TensorRT-LLM's (in-flight batching in
`tensorrt_llm.bindings.executor.Executor`).

What it is not: an in-process binding. TensorRT-LLM 1.2 pins transformers 4.57 while vlmctl needs
5, so the executor lives in a worker process (runtime/trtllm_worker.py, run as a file by the
TensorRT-LLM interpreter, `VLMCTL_TRTLLM_PYTHON`) that imports nothing of vlmctl.

Checked against TensorRT-LLM 1.2's recorded executor bindings (tests/data/trtllm-1.2) through a
strict fake driven as a real subprocess; never run against the real package here.
"""

from __future__ import annotations

import hashlib
import json
import os
import queue
import secrets
import subprocess
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import BackendUnavailableError, EngineError, InputError
from . import trtllm_worker
from .trtllm_worker import read_frame, write_frame  # noqa: F401  (the wire protocol lives with the worker)

# TensorRT-LLM FinishReason names -> vlmctl finish reasons.
FINISH_REASONS = {"END_ID": "stop", "STOP_WORDS": "stop", "LENGTH": "length", "CANCELLED": "abort",
                  "TIMED_OUT": "abort", "NOT_FINISHED": None}
_U64 = (1 << 64) - 1


# ---- request construction (pure) ------------------------------------------------------------
def expand_prompt(token_ids: list[int], placeholder_id: int, features: list[np.ndarray],
                  vocab_size: int) -> tuple[list[int], np.ndarray | None]:
    """(input ids with image positions as fake ids vocab_size + k, prompt table [rows, hidden]).

    Image k's rows follow image k-1's, counted per request, so row `id - vocab_size` of the
    request's table is the feature row of that position (TensorRT-LLM's prompt-tuning lookup)."""
    from ..formats.prompt_table import fake_ids

    if not features:
        return np.asarray(token_ids, dtype=np.int64).tolist(), None
    table = np.concatenate([_host(f) for f in features], 0)
    return fake_ids(token_ids, placeholder_id, vocab_size, table.shape[0]).tolist(), table


def _host(features) -> np.ndarray:
    """Image features as float32 numpy: the vision encoder hands torch tensors on its device."""
    if hasattr(features, "detach"):
        return features.detach().float().cpu().numpy()
    return np.asarray(features, dtype=np.float32)


def image_extra_id(content_hash: str, features: np.ndarray | None = None) -> int:
    """A non-zero 63-bit id naming an image's content (for KV-cache block reuse)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(content_hash.encode() if content_hash else np.ascontiguousarray(_host(features)).tobytes())
    return (int.from_bytes(h.digest(), "big") >> 1) | 1


def token_extra_ids(ids: list[int], vocab_size: int, images) -> list[int]:
    """Per-token extra ids: 0 for ordinary tokens, the image's content id for its fake ids.

    With KV-cache block reuse on, TensorRT-LLM requires these whenever a request has a prompt
    table: two requests share cached blocks only where (token id, extra id) agree, so the same
    fake ids from different images never alias."""
    rows: list[int] = []
    for item in images:
        rows.extend([image_extra_id(item.content_hash, item.features)] * int(item.num_tokens))
    return [rows[t - vocab_size] if t >= vocab_size else 0 for t in ids]


def sampling_config_kwargs(params) -> dict:
    """vlmctl SamplingParams -> keyword arguments of `executor.SamplingConfig`.

    Greedy is top_k=1 (argmax, whatever the runtime's defaults for unset fields). Otherwise
    top_p is always set, since the executor requires it in (0, 1] and 1.0 keeps the whole
    distribution; top_k 0 (off) leaves it unset. A request without a seed gets a random one, as
    the embedded decoder draws from an unseeded generator."""
    if params.temperature == 0:
        return {"beam_width": 1, "top_k": 1}
    kw = {"beam_width": 1, "temperature": float(params.temperature), "top_p": float(params.top_p),
          "seed": (int(params.seed) & _U64) if params.seed is not None else secrets.randbits(63)}
    if params.top_k > 0:
        kw["top_k"] = int(params.top_k)
    return kw


def check_params(params) -> None:
    # TensorRT-LLM samples inside its executor: what vlmctl applies to the logits cannot reach it
    names = (["response_format"] if getattr(params, "grammar", None) is not None else []) + \
        list(getattr(params, "extras", []))
    if names:
        raise InputError(f"{names[0]} is not available with the TensorRT-LLM decoder backend (it samples inside its "
                         "executor, where vlmctl cannot adjust or mask the logits); rebuild with decoder.backend: "
                         "torch", param=names[0])
    if params.logprobs:
        raise InputError("top_logprobs is not available with the TensorRT-LLM decoder backend (its executor "
                         "returns the chosen token's logprob only); use logprobs without top_logprobs")


def request_spec(ids: list[int], table: np.ndarray | None, extra_ids: list[int] | None, params, *,
                 end_id: int | None, pad_id: int | None, dtype: str = "float16") -> dict:
    """Everything `executor.Request` needs, as plain data (built into the Request by the worker).

    end_id -1 never stops (ignore_eos, as TensorRT-LLM's own LLM API does). vlmctl's other EOS ids,
    stop ids and stop strings are checked by the engine on the streamed tokens, which then
    cancels the request, so no stop words are sent."""
    check_params(params)
    end = -1 if params.ignore_eos or end_id is None else int(end_id)
    pad = int(pad_id) if pad_id is not None else max(end, 0)
    return {"input_token_ids": [int(i) for i in ids], "max_tokens": int(params.max_tokens), "streaming": True,
            "sampling": sampling_config_kwargs(params), "end_id": end, "pad_id": pad,
            "return_log_probs": params.logprobs is not None,
            "prompt_table": None if table is None else table_to_wire(table, dtype),
            "input_token_extra_ids": None if table is None else [int(e) for e in extra_ids or []]}


def to_bfloat16_bits(x: np.ndarray) -> np.ndarray:
    """float32 -> bfloat16 bit patterns (uint16), rounded to nearest even as torch rounds."""
    u = np.ascontiguousarray(x, dtype=np.float32).view(np.uint32)
    return ((u + (0x7FFF + ((u >> 16) & 1))) >> 16).astype(np.uint16)


def table_to_wire(table: np.ndarray, dtype: str) -> dict:
    """A prompt table in the engine's dtype as plain data (shape, dtype name, raw bytes): half the
    bytes of float32 and no numpy pickles between two interpreters' numpy versions."""
    if dtype == "float16":
        data = np.ascontiguousarray(table, dtype=np.float16).tobytes()
    elif dtype == "bfloat16":
        data = to_bfloat16_bits(table).tobytes()
    else:
        raise EngineError(f"the TensorRT-LLM engine dtype {dtype!r} is not one a prompt table travels in "
                          f"({', '.join(trtllm_worker.WIRE_DTYPES)})")
    return {"shape": [int(s) for s in table.shape], "dtype": dtype, "data": data}


def table_from_wire(wire: dict) -> np.ndarray:
    """The wire table back as float32 numpy (for checks; the worker decodes it with torch)."""
    raw = np.frombuffer(wire["data"], dtype=np.uint16 if wire["dtype"] == "bfloat16" else np.float16)
    if wire["dtype"] == "bfloat16":
        return (raw.astype(np.uint32) << 16).view(np.float32).reshape(wire["shape"])
    return raw.astype(np.float32).reshape(wire["shape"])


# ---- the parent side -------------------------------------------------------------------------
@dataclass
class DecoderOutput:
    request_id: str
    tokens: list[int]
    logprobs: list[float] | None
    final: bool
    reason: str | None  # vlmctl finish reason when final
    error: str | None


class TrtllmDecoder:
    """What `Engine` drives when build-llm's backend is trtllm (a worker process runs the executor)."""

    external_batching = True  # the engine submits and polls; TensorRT-LLM batches and samples

    def __init__(self, config: dict, proc: subprocess.Popen, inbox: queue.Queue, info: dict, max_seq: int):
        self.config = config
        self.vocab_size = int(config["vocab_size"])
        self.max_seq = max_seq
        self.end_id, self.pad_id = config.get("end_id"), config.get("pad_id")
        self.dtype = config.get("dtype", "float16")
        self.info = info
        self._proc, self._inbox = proc, inbox
        self._active: set[str] = set()
        self._send_lock = threading.Lock()

    @classmethod
    def load(cls, layout_dir: Path, *, max_batch: int | None = None, startup_timeout_s: float = 1800.0) -> "TrtllmDecoder":
        from ..backends.trtllm import trtllm_available, trtllm_python
        from ..formats.trtllm_engine import engine_path, is_trtllm_engine

        layout_dir = Path(layout_dir)
        try:
            config = json.loads((layout_dir / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EngineError(f"{layout_dir}: no readable decoder config.json ({e})") from None
        if not is_trtllm_engine(config):
            raise EngineError(f"{layout_dir}: not a TensorRT-LLM decoder (format {config.get('format')!r})")
        engine = engine_path(layout_dir, config)
        if not (engine / "config.json").exists():
            raise EngineError(f"{engine}: no TensorRT-LLM engine (config.json missing); rerun `vlmctl build-llm`")
        lim = config.get("limits", {})
        if max_batch and max_batch > lim.get("max_batch_size", max_batch):
            raise EngineError(f"max_batch_size {max_batch} exceeds the engine's {lim.get('max_batch_size')}")
        trtllm_available(required=True)
        python = trtllm_python()
        max_seq = lim.get("max_input_len", 2048) + lim.get("max_output_len", 512)
        proc = start_worker(python, engine, worker_options(config, max_batch or lim.get("max_batch_size"), max_seq))
        inbox: queue.Queue = queue.Queue()
        threading.Thread(target=_pump, args=(proc, inbox), name="vlmctl-trtllm-reader", daemon=True).start()
        try:
            first = inbox.get(timeout=startup_timeout_s)
        except queue.Empty:
            proc.kill()
            raise EngineError(f"the TensorRT-LLM worker did not load {engine} within {startup_timeout_s:.0f} s") from None
        if first[0] != "ready":
            proc.wait(timeout=30)
            if first[0] == "unavailable":
                raise BackendUnavailableError(first[1])
            raise EngineError(f"the TensorRT-LLM worker failed to load {engine}: {first[1]}")
        return cls(config, proc, inbox, first[1], max_seq)

    # ---- requests --------------------------------------------------------------------------
    def check_params(self, params) -> None:
        check_params(params)

    def submit(self, request_id: str, prompt, params) -> None:
        """Queue one prompt whose images already carry features."""
        ids, table = expand_prompt(prompt.token_ids, prompt.image_placeholder_id,
                                   [it.features for it in prompt.images], self.vocab_size)
        extra = token_extra_ids(ids, self.vocab_size, prompt.images) if table is not None else None
        spec = request_spec(ids, table, extra, params, end_id=self.end_id, pad_id=self.pad_id, dtype=self.dtype)
        self._send(("submit", request_id, spec))
        self._active.add(request_id)

    def cancel(self, request_id: str) -> None:
        if request_id in self._active:
            self._active.discard(request_id)
            self._send(("cancel", request_id))

    def poll(self, timeout: float) -> list[DecoderOutput]:
        """Outputs that arrived: waits up to `timeout` seconds for the first, then takes what is there."""
        out: list[DecoderOutput] = []
        try:
            msg = self._inbox.get(timeout=timeout) if timeout > 0 else self._inbox.get_nowait()
        except queue.Empty:
            return out
        while True:
            if msg[0] != "tokens":
                raise EngineError(f"the TensorRT-LLM worker stopped: {msg[1]}")
            _, rid, toks, lps, final, reason, error = msg
            if final:
                self._active.discard(rid)
            out.append(DecoderOutput(rid, toks, lps, final, FINISH_REASONS.get(reason) if reason else None, error))
            try:
                msg = self._inbox.get_nowait()
            except queue.Empty:
                return out

    def close(self) -> None:
        if self._proc.poll() is None:
            try:
                self._send(("shutdown",))
                self._proc.wait(timeout=30)
            except (EngineError, subprocess.TimeoutExpired):
                self._proc.kill()

    def __del__(self):
        try:
            self.close()
        except Exception:
            pass

    def _send(self, msg) -> None:
        with self._send_lock:
            try:
                write_frame(self._proc.stdin, msg)
            except (BrokenPipeError, OSError, ValueError):
                raise EngineError(f"the TensorRT-LLM worker is gone (exit code {self._proc.poll()})") from None


def worker_options(config: dict, max_batch: int | None, max_seq: int) -> dict:
    """What the worker's ExecutorConfig needs from build-llm/config.json (see trtllm_worker).

    The KV token budget is explicit (every admitted sequence at full length) so TensorRT-LLM does
    not size the cache from the free-memory fraction alone; that fraction is the recipe's
    (decoder.kv_cache_free_gpu_memory_fraction), taken after the vision model has loaded."""
    return {"max_batch_size": max_batch, "kv_cache_max_tokens": (max_batch or 1) * max_seq,
            "kv_cache_free_gpu_memory_fraction": float(config.get("kv_cache_free_gpu_memory_fraction", 0.8))}


def worker_command(python: str, engine_dir: Path, options: dict) -> list[str]:
    """The worker runs as a file under the TensorRT-LLM interpreter (see trtllm_worker.BOOTSTRAP)."""
    return [python, "-c", trtllm_worker.BOOTSTRAP, str(Path(trtllm_worker.__file__).resolve()), str(engine_dir),
            json.dumps(options)]


def start_worker(python: str, engine_dir: Path, options: dict) -> subprocess.Popen:
    # The environment is passed on unchanged: in particular nothing is added to PYTHONPATH, which
    # for an installed vlmctl would put its whole site-packages (torch, transformers 5) in front of
    # TensorRT-LLM's own.
    try:
        return subprocess.Popen(worker_command(python, engine_dir, options), stdin=subprocess.PIPE,
                                stdout=subprocess.PIPE, env=dict(os.environ))
    except OSError as e:
        raise BackendUnavailableError(f"cannot start the TensorRT-LLM worker with {python} ({e})") from None


def _pump(proc: subprocess.Popen, inbox: queue.Queue) -> None:
    while True:
        try:
            msg = read_frame(proc.stdout)
        except Exception as e:  # a torn frame: the worker died mid-write
            msg = None
            err = f"{type(e).__name__}: {e}"
        else:
            err = None
        if msg is None:
            code = proc.wait()
            inbox.put(("exited", err or f"the worker process exited with code {code}"))
            return
        inbox.put(msg)
