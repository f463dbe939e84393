"""The TensorRT-LLM worker process: owns the executor, speaks length-prefixed pickles on stdio.

What it is: the program `TrtllmDecoder` starts with the TensorRT-LLM interpreter. It is run as a
file (`python -c <BOOTSTRAP> this_file ENGINE OPTIONS`), never as `-m vlmctl...`, so nothing of
vlmctl's environment (its site-packages with torch/transformers 5) enters the other interpreter's
import path. Hence this module imports only the standard library at import time and never
imports vlmctl; torch and tensorrt_llm are imported inside `worker_main`.

What it is not: request construction (the parent, runtime/trtllm_decoder.py, builds plain-data
specs) or scheduling (TensorRT-LLM's executor batches in flight).

Frames in: ("submit", rid, spec), ("cancel", rid), ("shutdown",).
Frames out: first ("ready", info) | ("unavailable", msg) | ("fatal", msg); then
("tokens", rid, new token ids, their logprobs, final, finish reason name, error).
"""

from __future__ import annotations

import json
import os
import pickle
import struct
import sys
import threading
from pathlib import Path

# Run with `python -c BOOTSTRAP worker.py ARGS...`: drops the current directory that `-c` puts
# first on sys.path, then runs the file as __main__ (runpy.run_path does not add its directory).
BOOTSTRAP = ("import runpy, sys; sys.path[:] = [p for p in sys.path if p not in ('', '.')]; "
             "sys.argv = sys.argv[1:]; runpy.run_path(sys.argv[0], run_name='__main__')")

# Engine dtypes the prompt table may travel in (the engine's own; float32 engines are refused at build).
WIRE_DTYPES = ("float16", "bfloat16")


# ---- framing ---------------------------------------------------------------------------------
def write_frame(f, obj) -> None:
    # Plain builtins only (dict/list/bytes/str/int/float/None): the two interpreters may have
    # numpy versions whose pickles do not load in each other.
    data = pickle.dumps(obj, protocol=4)
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
    """The next object, or None at end of stream (a torn frame counts as the end)."""
    head = _read_exact(f, 8)
    if head is None:
        return None
    data = _read_exact(f, struct.unpack("<Q", head)[0])
    return None if data is None else pickle.loads(data)


# ---- executor objects from plain data (worker side) -----------------------------------------
def executor_config_kwargs(options: dict, world_size: int, worker_executable: str | None) -> dict:
    """Keyword arguments for ExecutorConfig (nested configs as (class name, kwargs) pairs).

    KV-cache: block reuse on (safe: every request with a prompt table carries extra ids), an
    explicit token budget and the recipe's share of the memory left after the vision model
    loaded (TensorRT-LLM's default is 0.9 of it). With tp*pp > 1 the executor runs in
    orchestrator mode: it spawns one executorWorker per rank over MPI, this process stays the
    only client."""
    kv = {"enable_block_reuse": True, "free_gpu_memory_fraction": float(options["kv_cache_free_gpu_memory_fraction"])}
    if options.get("kv_cache_max_tokens"):
        kv["max_tokens"] = int(options["kv_cache_max_tokens"])
    kw: dict = {"max_beam_width": 1, "kv_cache_config": ("KvCacheConfig", kv)}
    if options.get("max_batch_size"):
        kw["max_batch_size"] = int(options["max_batch_size"])
    if world_size > 1:
        kw["parallel_config"] = ("ParallelConfig", {
            "communication_type": ("CommunicationType", "MPI"),
            "communication_mode": ("CommunicationMode", "ORCHESTRATOR"),
            "device_ids": list(range(world_size)),
            "orchestrator_config": ("OrchestratorConfig", {"is_orchestrator": True,
                                                          "worker_executable_path": worker_executable or ""})})
    return kw


def materialize(tle, value):
    """(class name, kwargs) -> tle.<class>(**kwargs); (enum name, member) -> tle.<enum>.<member>."""
    if isinstance(value, tuple) and len(value) == 2 and isinstance(value[0], str):
        name, arg = value
        if isinstance(arg, dict):
            return getattr(tle, name)(**{k: materialize(tle, v) for k, v in arg.items()})
        return getattr(getattr(tle, name), arg)
    if isinstance(value, list):
        return [materialize(tle, v) for v in value]
    return value


def table_from_wire(torch, wire: dict):
    """A prompt table from the wire ({"shape", "dtype", "data"}) as a torch tensor on the GPU."""
    if wire["dtype"] not in WIRE_DTYPES:
        raise ValueError(f"prompt table dtype {wire['dtype']!r} is not an engine dtype {WIRE_DTYPES}")
    dtype = getattr(torch, wire["dtype"])
    t = torch.frombuffer(bytearray(wire["data"]), dtype=dtype).reshape(wire["shape"])
    return t.cuda() if torch.cuda.is_available() else t


def build_request(tle, torch, spec: dict):
    """(executor.Request, the table tensor to keep alive) from a request spec (see trtllm_decoder)."""
    ptc, table = None, None
    if spec["prompt_table"] is not None:
        table = table_from_wire(torch, spec["prompt_table"])
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


# ---- the worker ------------------------------------------------------------------------------
def worker_main(engine_dir: str, options_json: str = "{}") -> int:
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
        options = json.loads(options_json)
        cfg = json.loads((Path(engine_dir) / "config.json").read_text())
        pretrained = cfg["pretrained_config"]
        mapping = pretrained.get("mapping") or {}
        world = int(mapping.get("world_size", 1))
        worker_exe = None
        if world > 1:
            worker_exe = str(Path(tensorrt_llm.__file__).parent / "bin" / "executorWorker")
            if not Path(worker_exe).exists():
                raise FileNotFoundError(f"{worker_exe} (TensorRT-LLM's executorWorker, needed for tp*pp = {world})")
        exec_cfg = tle.ExecutorConfig(**{k: materialize(tle, v)
                                         for k, v in executor_config_kwargs(options, world, worker_exe).items()})
        executor = tle.Executor(Path(engine_dir), tle.ModelType.DECODER_ONLY, exec_cfg)
    except Exception as e:
        send(("fatal", f"{type(e).__name__}: {e}"))
        return 1
    send(("ready", {"tensorrt_llm": tensorrt_llm.__version__, "python": sys.executable, "world_size": world,
                    "dtype": pretrained.get("dtype"), "vocab_size": pretrained.get("vocab_size"),
                    "sys_path": list(sys.path)}))

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
                    req, table = build_request(tle, torch, spec)
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
    sys.exit(worker_main(*sys.argv[1:3]))
