"""A prompt that continues a cached prefix (the next turn of a chat): time to its first token with a 16-bit and
8-bit KV pools, on `serving_gpu.py`'s LLaVA-1.5-7B-shaped fp16 engine (random weights, the engine's defaults, built
if missing, loaded with `--kv-cache-dtype` each of `--modes`; a mode may carry environment settings for its engine,
e.g. `auto+VLMCTL_STEP_GRAPH_ROWS=512`).

For each context length L: a text prompt of ~L tokens runs to its first token (its full blocks enter the prefix
cache), then that prompt plus `--new-words` more words is submitted alone and timed from `submit` to its first
token. That step prefills the new tokens as a continuation chunk: each layer attends over the whole context, which
on an 8-bit pool is read back dequantized (`ops.gather_context`). `--repeats` continuations of one prefix, each with
other new words, after `--warmup` untimed ones (first calls at a new row count pay cuBLAS's and SDPA's host-side
set-up); the median and the fastest are printed, with the tokens found in the cache.

Before the engines, `--gather` times what such a chunk's attention reads per layer, apart from the engine: a
context's K and V gathered from a pool of the 7B's shape (32 KV heads of 128), 16-bit (`index_select`) and 8-bit
(the torch reference through float32, and the kernel that `ops.gather_context` runs on CUDA): the GPU's time, by
CUDA events behind a ~1 ms sleep kernel so that the launches queue up before the first event runs, and the host's
time to launch them, medians of 50.

    python benchmarks/prefix_hit_gpu.py --work /var/tmp/vb [--contexts 512 1900] [--modes auto fp8 int8] \
        [--gather 2048 8192] [--profile]
    python benchmarks/prefix_hit_gpu.py --smoke --work /tmp/smoke      # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import random
import statistics
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))

from async_scheduling_gpu import words  # noqa: E402
from serving_gpu import SEVEN_B, SMOKE, build_engine, load_engine, make_checkpoint  # noqa: E402


def log(*a):
    print(*a, flush=True)


def first_token(eng, prompt, params) -> tuple[float, object]:
    """Seconds from submit to the request's first token, and the request."""
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    req = eng.submit(prompt, params)
    while not req.output_ids:
        eng.step()
    dt = time.perf_counter() - t0
    while eng.has_work():
        eng.step()
    return dt, req


def prompt_of(eng, rng: random.Random, tokens: int) -> str:
    """Random words whose encoding is ~`tokens` long (at most that)."""
    text = words(rng, max(1, tokens // 4))
    while len(eng.encode_text(text).token_ids) < tokens - 8:
        text += " " + words(rng, 8)
    while len(eng.encode_text(text).token_ids) > tokens:
        text = text.rsplit(" ", 1)[0]
    return text


def gather_times(contexts: list[int], reps: int = 50) -> list[dict]:
    """µs to gather one layer's K and V for each context length, per pool kind (see the module's docstring)."""
    from vlmctl.runtime import kv_quant, ops
    from vlmctl.runtime.kernels.kv_rows import gather_dequantized

    H, d, bs, rows = 32, 128, 16, []
    for L in contexts:
        nb = -(-L // bs)
        table = torch.randperm(2 * nb, device="cuda")[:nb]
        pools = {"fp16": (torch.randn(2 * nb, bs, H, d, device="cuda", dtype=torch.float16), None)}
        for name in ("fp8", "int8"):
            q, s = kv_quant.quantize(pools["fp16"][0], kv_quant.STORAGE[name])
            pools[name] = (q, s)
        cases = {"fp16": lambda: (ops.gather_context(pools["fp16"][0], table, L),
                                  ops.gather_context(pools["fp16"][0], table, L))}
        for name in ("fp8", "int8"):
            cache, sc = pools[name]
            cases[f"{name} reference"] = lambda c=cache, s=sc: (ops.gather_context(c, table, L, s, torch.float16),
                                                                ops.gather_context(c, table, L, s, torch.float16))
            cases[f"{name} kernel"] = lambda c=cache, s=sc: gather_dequantized(c, c, s, s, table, L, torch.float16)
        for name, fn in cases.items():
            fn()
            gpu, host = [], []
            for _ in range(reps):
                a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
                torch.cuda._sleep(2_000_000)  # ~1 ms of GPU work ahead, so that the events time the GPU, not launches
                a.record()
                t0 = time.perf_counter()
                fn()  # K and V
                host.append(1e6 * (time.perf_counter() - t0))
                b.record()
                b.synchronize()
                gpu.append(1000 * a.elapsed_time(b))
            rows.append({"context": L, "pool": name, "gpu_us_per_layer": statistics.median(gpu),
                         "host_us_per_layer": statistics.median(host)})
            log(json.dumps(rows[-1]))
    return rows


def profiled(eng, prompt, params) -> dict:
    """One continuation under torch.profiler (CPU and, where there is one, CUDA activity)."""
    from serving_gpu import kernel_profile

    acts = [torch.profiler.ProfilerActivity.CPU]
    if torch.cuda.is_available():
        acts.append(torch.profiler.ProfilerActivity.CUDA)
    with torch.profiler.profile(activities=acts) as prof:
        dt, req = first_token(eng, prompt, params)
    return kernel_profile(prof, dt, len(req.prompt.token_ids) - req.num_cached_tokens)


def main() -> None:
    from vlmctl.runtime.sampling import SamplingParams

    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/vlmctl-bench"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--contexts", type=int, nargs="+", default=[512, 1900])
    ap.add_argument("--new-words", type=int, default=12, help="words a continuation adds (~6.5 tokens each)")
    ap.add_argument("--repeats", type=int, default=10)
    ap.add_argument("--warmup", type=int, default=2, help="untimed continuations before the timed ones")
    ap.add_argument("--gather", type=int, nargs="*", default=[2048, 8192], help="context lengths (GPU only)")
    ap.add_argument("--modes", nargs="+", default=["auto", "fp8", "int8"],
                    help="--kv-cache-dtype values, each optionally with +NAME=VALUE environment settings")
    ap.add_argument("--profile", action="store_true",
                    help="also one continuation per mode and context under torch.profiler: its wall time against "
                         "its GPU kernels' sum, the costliest kernels and host ops (is the step the GPU's or the host's?)")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.contexts, args.repeats, args.new_words = [20 * (i + 1) for i in range(len(args.contexts))], 2, 3
    engine_dir = args.work / "engine"
    if not (engine_dir / "build-llm").is_dir():
        ckpt = make_checkpoint(args.work / "ckpt", SMOKE if args.smoke else SEVEN_B, dev)
        engine_dir, _ = build_engine(ckpt, args.work, "float16" if dev == "cuda" else "float32")
    params = SamplingParams(max_tokens=1, temperature=0, ignore_eos=True)
    gathered = gather_times(args.gather) if dev == "cuda" and args.gather else []
    rows = []
    for mode in args.modes:
        pool, *settings = mode.split("+")  # e.g. auto+VLMCTL_STEP_GRAPH_ROWS=512: set while this engine loads and runs
        for kv in settings:
            os.environ[kv.split("=")[0]] = kv.split("=", 1)[1]
        eng, load_s, _ = load_engine(engine_dir, device=dev, kv_cache_dtype=pool)
        log(f"{mode}: loaded in {load_s:.1f} s")
        for L in args.contexts:
            rng = random.Random(L)
            base = prompt_of(eng, rng, L)
            cold, _ = first_token(eng, eng.encode_text(base), params)
            for _ in range(args.warmup):
                first_token(eng, eng.encode_text(base + " " + words(rng, args.new_words)), params)
            times, cached, total = [], [], []
            for _ in range(args.repeats):
                dt, req = first_token(eng, eng.encode_text(base + " " + words(rng, args.new_words)), params)
                times.append(dt)
                cached.append(req.num_cached_tokens)
                total.append(len(req.prompt.token_ids))
            r = {"mode": mode, "load_s": round(load_s, 2), "context": total[0], "cached_tokens": min(cached), "cold_prompt_ms": 1000 * cold,
                 "continuation_ms": [round(1000 * t, 3) for t in times],
                 "continuation_ms_median": 1000 * statistics.median(times), "continuation_ms_min": 1000 * min(times)}
            if args.profile:
                r["profile"] = profiled(eng, eng.encode_text(base + " " + words(rng, args.new_words)), params)
            rows.append(r)
            log(json.dumps(r))
        del eng
        for kv in settings:
            os.environ.pop(kv.split("=")[0])
        if dev == "cuda":
            torch.cuda.empty_cache()
    log(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}")
    if gathered:
        log("| context | pool | K and V gathered: GPU µs a layer | host µs to launch them |")
        log("| ---: | --- | ---: | ---: |")
        for r in gathered:
            log(f"| {r['context']} | {r['pool']} | {r['gpu_us_per_layer']:.1f} | {r['host_us_per_layer']:.1f} |")
    log("| mode | prompt tokens | from the cache | first token, ms (median / fastest) | the whole prompt cold, ms | "
        "engine load, s |")
    log("| --- | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        log(f"| {r['mode']} | {r['context']} | {r['cached_tokens']} | {r['continuation_ms_median']:.2f} / "
            f"{r['continuation_ms_min']:.2f} | {r['cold_prompt_ms']:.1f} | {r['load_s']:.1f} |")
    profiled_rows = [r for r in rows if "profile" in r]
    if profiled_rows:
        log("| KV pool | prompt tokens | profiled continuation: wall ms | its kernels' sum, ms | kernels |")
        log("| --- | ---: | ---: | ---: | ---: |")
        for r in profiled_rows:
            p = r["profile"]
            log(f"| {r['mode']} | {r['context']} | {p['wall_ms']:.2f} | {p['kernels_ms']:.2f} | {p['kernel_count']} |")
    if args.out:
        args.out.write_text(json.dumps({"gather": gathered, "continuations": rows}, indent=1))


if __name__ == "__main__":
    main()
