"""The TensorRT-LLM decoder backend: a prompt-table engine run by TensorRT-LLM's executor.

What it is: the decoder half of `Engine` when build-llm wrote a TensorRT-LLM engine. The engine
still tokenizes, runs the vision model and applies vlmctl's stop rules; this backend turns a
prompt into TensorRT-LLM's prompt-tuning request (ids >= vocab_size index the request's own
embedding table, exactly the embedded decoder's contract) and streams the tokens back.
Continuous batching, the paged KV cache and sampling are TensorRT-LLM's (in-flight batching in
`tensorrt_llm.bindings.executor.Executor`).

What it is not: an in-process binding. TensorRT-LLM 1.2 pins transformers 4.57 while vlmctl needs
5, so the executor lives in a worker process started with the TensorRT-LLM interpreter
(`VLMCTL_TRTLLM_PYTHON`, default this one) running this same module, which imports only the
standard library, numpy and vlmctl.errors until it imports tensorrt_llm. Parent and worker
exchange length-prefixed pickles over the worker's stdin/stdout.

Written against TensorRT-LLM 1.2's nanobind executor API (Executor, Request, SamplingConfig,
OutputConfig, PromptTuningConfig, await_responses, cancel_request); not run here (no TensorRT-LLM
on these machines). The request construction is pure and tested.
"""

from __future__ import annotations

import hashlib
import json
import os
import pickle
import queue
import secrets
import struct
import subprocess
import sys
import threading
from dataclasses import dataclass
from pathlib import Path

import numpy as np

from ..errors import BackendUnavailableError, EngineError, InputError

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
    ids = np.asarray(token_ids, dtype=np.int64).copy()
    if not features:
        return ids.tolist(), None
    table = np.concatenate([np.asarray(f) for f in features], 0)
    mask = ids == placeholder_id
    n = int(mask.sum())
    if n != table.shape[0]:
        raise EngineError(f"prompt has {n} image positions but the images give {table.shape[0]} rows")
    ids[mask] = vocab_size + np.arange(n)
    return ids.tolist(), table


def image_extra_id(content_hash: str, features: np.ndarray | None = None) -> int:
    """A non-zero 63-bit id naming an image's content (for KV-cache block reuse)."""
    h = hashlib.blake2b(digest_size=8)
    h.update(content_hash.encode() if content_hash else np.ascontiguousarray(features).tobytes())
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
    if params.logprobs:
        raise InputError("top_logprobs is not available with the TensorRT-LLM decoder backend (its executor "
                         "returns the chosen token's logprob only); use logprobs without top_logprobs")


def request_spec(ids: list[int], table: np.ndarray | None, extra_ids: list[int] | None, params, *,
                 end_id: int | None, pad_id: int | None) -> dict:
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
            "prompt_table": None if table is None else table_to_wire(table),
            "input_token_extra_ids": None if table is None else [int(e) for e in extra_ids or []]}


def table_to_wire(table: np.ndarray) -> dict:
    """A prompt table as plain data (shape + float32 bytes): the two interpreters may have numpy
    versions whose pickles do not load in each other."""
    t = np.ascontiguousarray(table, dtype=np.float32)
    return {"shape": [int(s) for s in t.shape], "float32": t.tobytes()}


def table_from_wire(wire: dict) -> np.ndarray:
    return np.frombuffer(wire["float32"], dtype=np.float32).reshape(wire["shape"])


def build_request(tle, torch, spec: dict, dtype):
    """(executor.Request, the table tensor to keep alive) from a `request_spec` (worker side)."""
    ptc, table = None, None
    if spec["prompt_table"] is not None:
        table = torch.from_numpy(table_from_wire(spec["prompt_table"]).copy()).to(dtype).cuda()
        ptc = tle.PromptTuningConfig(embedding_table=table, input_token_extra_ids=spec["input_token_extra_ids"])
    req = tle.Request(input_token_ids=spec["input_token_ids"], max_tokens=spec["max_tokens"],
                      streaming=spec["streaming"], sampling_config=tle.SamplingConfig(**spec["sampling"]),
                      output_config=tle.OutputConfig(return_log_probs=spec["return_log_probs"],
                                                     exclude_input_from_output=True),
                      end_id=spec["end_id"], pad_id=spec["pad_id"], prompt_tuning_config=ptc)
    return req, table


def response_message(resp, request_id: str) -> tuple:
    """An executor Response -> ("tokens", id, new tokens, their logprobs, final, reason, error)."""
    if resp.has_error():
        return ("tokens", request_id, [], None, True, None, str(resp.error_msg))
    r = resp.result
    toks = [int(t) for t in r.output_token_ids[0]]
    lps = None
    if r.log_probs:
        lp = list(r.log_probs[0])
        lps = [float(x) for x in lp[len(lp) - len(toks):]] if toks else []
    reason = r.finish_reasons[0].name if r.is_final and r.finish_reasons else None
    return ("tokens", request_id, toks, lps, bool(r.is_final), reason, None)


# ---- framing ---------------------------------------------------------------------------------
def write_frame(f, obj) -> None:
    data = pickle.dumps(obj, protocol=5)
    f.write(struct.pack("<Q", len(data)))
    f.write(data)
    f.flush()


def _read_exact(f, n: int) -> bytes | None:
    buf = bytearray()
    while len(buf) < n:
        chunk = f.read(n - len(buf))
        if not chunk:
            return None
        buf += chunk
    return bytes(buf)


def read_frame(f):
    """The next object, or None at end of stream."""
    head = _read_exact(f, 8)
    if head is None:
        return None
    data = _read_exact(f, struct.unpack("<Q", head)[0])
    return None if data is None else pickle.loads(data)


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
        self.info = info
        self._proc, self._inbox = proc, inbox
        self._active: set[str] = set()
        self._send_lock = threading.Lock()

    @classmethod
    def load(cls, layout_dir: Path, *, max_batch: int | None = None, startup_timeout_s: float = 1800.0) -> "TrtllmDecoder":
        from ..export.trtllm import ENGINE_FORMAT, trtllm_available, trtllm_python

        layout_dir = Path(layout_dir)
        try:
            config = json.loads((layout_dir / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EngineError(f"{layout_dir}: no readable decoder config.json ({e})") from None
        if config.get("format") != ENGINE_FORMAT:
            raise EngineError(f"{layout_dir}: not a TensorRT-LLM decoder (format {config.get('format')!r})")
        engine = layout_dir / config.get("engine", "engine")
        if not (engine / "config.json").exists():
            raise EngineError(f"{engine}: no TensorRT-LLM engine (config.json missing); rerun `vlmctl build-llm`")
        lim = config.get("limits", {})
        if max_batch and max_batch > lim.get("max_batch_size", max_batch):
            raise EngineError(f"max_batch_size {max_batch} exceeds the engine's {lim.get('max_batch_size')}")
        trtllm_available(required=True)
        python = trtllm_python()
        env = dict(os.environ)
        env["PYTHONPATH"] = os.pathsep.join([str(Path(__file__).resolve().parents[2])] +
                                            ([env["PYTHONPATH"]] if env.get("PYTHONPATH") else []))
        try:
            proc = subprocess.Popen([python, "-m", "vlmctl.runtime.trtllm_decoder", str(engine)],
                                    stdin=subprocess.PIPE, stdout=subprocess.PIPE, env=env)
        except OSError as e:
            raise BackendUnavailableError(f"cannot start the TensorRT-LLM worker with {python} ({e})") from None
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
        return cls(config, proc, inbox, first[1], lim.get("max_input_len", 2048) + lim.get("max_output_len", 512))

    # ---- requests --------------------------------------------------------------------------
    def check_params(self, params) -> None:
        check_params(params)

    def submit(self, request_id: str, prompt, params) -> None:
        """Queue one prompt whose images already carry features."""
        ids, table = expand_prompt(prompt.token_ids, prompt.image_placeholder_id,
                                   [it.features for it in prompt.images], self.vocab_size)
        extra = token_extra_ids(ids, self.vocab_size, prompt.images) if table is not None else None
        spec = request_spec(ids, table, extra, params, end_id=self.end_id, pad_id=self.pad_id)
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


# ---- the worker side (runs in the TensorRT-LLM interpreter) ---------------------------------
def worker_main(engine_dir: str) -> int:
    import datetime

    # The protocol owns the real stdout; everything TensorRT-LLM prints goes to stderr.
    chan_out = os.fdopen(os.dup(1), "wb")
    os.dup2(2, 1)
    sys.stdout = sys.stderr
    chan_in = sys.stdin.buffer
    send_lock = threading.Lock()

    def send(msg) -> None:
        with send_lock:
            write_frame(chan_out, msg)

    try:
        import torch
        import tensorrt_llm
        import tensorrt_llm.bindings.executor as tle
    except Exception as e:
        send(("unavailable", f"cannot import tensorrt_llm in {sys.executable}: {type(e).__name__}: {e}"))
        return 1
    try:
        cfg = json.loads((Path(engine_dir) / "config.json").read_text())
        pretrained = cfg["pretrained_config"]
        dtype = getattr(torch, pretrained["dtype"])
        # Block reuse is safe with prompt tables because every request with a table sends extra ids.
        exec_cfg = tle.ExecutorConfig(max_beam_width=1, kv_cache_config=tle.KvCacheConfig(enable_block_reuse=True))
        executor = tle.Executor(Path(engine_dir), tle.ModelType.DECODER_ONLY, exec_cfg)
    except Exception as e:
        send(("fatal", f"{type(e).__name__}: {e}"))
        return 1
    send(("ready", {"tensorrt_llm": tensorrt_llm.__version__, "vocab_size": pretrained.get("vocab_size")}))

    lock = threading.Lock()
    by_exec: dict[int, str] = {}
    by_rid: dict[str, int] = {}
    tables: dict[int, object] = {}
    stop = threading.Event()

    def reader() -> None:
        while True:
            try:
                msg = read_frame(chan_in)
            except Exception:
                msg = None
            if msg is None or msg[0] == "shutdown":
                stop.set()
                return
            if msg[0] == "submit":
                _, rid, spec = msg
                try:
                    req, table = build_request(tle, torch, spec, dtype)
                    with lock:  # the response loop looks ids up under the same lock
                        eid = executor.enqueue_request(req)
                        by_exec[eid], by_rid[rid], tables[eid] = rid, eid, table
                except Exception as e:
                    send(("tokens", rid, [], None, True, None, f"{type(e).__name__}: {e}"))
            elif msg[0] == "cancel":
                with lock:
                    eid = by_rid.get(msg[1])
                if eid is not None:
                    executor.cancel_request(eid)

    threading.Thread(target=reader, name="trtllm-worker-reader", daemon=True).start()
    while not stop.is_set():
        for resp in executor.await_responses(timeout=datetime.timedelta(milliseconds=20)):
            with lock:
                rid = by_exec.get(resp.request_id)
            if rid is None:
                continue
            msg = response_message(resp, rid)
            if msg[4]:
                with lock:
                    by_exec.pop(resp.request_id, None)
                    by_rid.pop(rid, None)
                    tables.pop(resp.request_id, None)
            send(msg)
    executor.shutdown()
    return 0


if __name__ == "__main__":
    sys.exit(worker_main(sys.argv[1]))
