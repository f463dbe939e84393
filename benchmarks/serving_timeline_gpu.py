"""Where a serving step's time goes: `vlmctl bench`'s engine run (-n 256 -c 64, one image a request, 128 output
tokens) with torch.profiler over a window of its steady state, and the GPU's idle time in that window charged
to what the engine thread was doing when the GPU ran dry.

The engine is `serving_gpu.py`'s LLaVA-1.5-7B-shaped fp16 one (random weights, `vlmctl build` defaults,
max_batch_size 64), loaded with its defaults (async scheduling on with a GPU; `--no-async-scheduling` for the
synchronous engine). The engine's phases are marked with `record_function` (names `vlmctl.*`), from outside the
engine: the step, the planning of a step launched ahead, the images (encoded or awaited), the launch of the step's
forward (and, within it, of a captured decode step), the read of the tokens in flight, their hand-out, the
sampling's launch. Printed:
- the window's wall time, the GPU's busy time (the union of its kernels and copies) and its share;
- the GPU's idle time, by the innermost engine phase active on the engine thread when each gap began ("bench
  loop": between steps, in `bench_engine`'s own code);
- each phase's host time a step, and the costliest kernels in the window.

    python benchmarks/serving_timeline_gpu.py --work /var/tmp/vb [--no-async-scheduling] [--out timeline.json]
    python benchmarks/serving_timeline_gpu.py --smoke --work /tmp/smoke      # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import json
import sys
import tempfile
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))

from serving_gpu import SEVEN_B, SMOKE, build_engine, make_checkpoint  # noqa: E402

# engine methods marked as phases (instance attributes shadow them; the engine calls them through self)
PHASES = ("_step_ahead", "_plan_ahead", "_prepare_images", "_run", "_decode_rows", "_accept", "_sample_on_device",
          "_sample_guarded")
GPU_CATS = {"kernel", "gpu_memcpy", "gpu_memset"}


def log(*a):
    print(*a, flush=True)


def mark(eng, window: dict):
    """Wrap the engine's phases in record_function; start and stop the profiler on the window's steps."""
    from vlmctl.runtime.sampling import TokensInFlight

    def wrapped(name, fn):
        def run(*a, **k):
            with torch.profiler.record_function("vlmctl." + name.lstrip("_")):
                return fn(*a, **k)
        return run

    for name in PHASES:
        setattr(eng, name, wrapped(name, getattr(eng, name)))
    TokensInFlight.read = wrapped("tokens_read", TokensInFlight.read)
    step = eng.step

    def counted_step():
        i = window["seen"]
        window["seen"] += 1
        if i == window["start"]:
            window["prof"].start()
        with torch.profiler.record_function("vlmctl.step"):
            out = step()
        if i == window["start"] + window["steps"] - 1:
            window["prof"].stop()
        return out

    eng.step = counted_step


def merge(intervals: list[tuple[float, float]]) -> list[tuple[float, float]]:
    out: list[list[float]] = []
    for a, b in sorted(intervals):
        if out and a <= out[-1][1]:
            out[-1][1] = max(out[-1][1], b)
        else:
            out.append([a, b])
    return [(a, b) for a, b in out]


def analyse(trace: dict, gap_us: float = 50.0) -> dict:
    events = [e for e in trace.get("traceEvents", []) if e.get("ph") == "X" and "dur" in e]
    steps = [e for e in events if e.get("name") == "vlmctl.step"]
    if not steps:
        return {"error": "no step in the window"}
    tid = steps[0]["tid"]
    t0 = min(e["ts"] for e in steps)
    t1 = max(e["ts"] + e["dur"] for e in steps)
    gpu = merge([(e["ts"], e["ts"] + e["dur"]) for e in events if e.get("cat") in GPU_CATS
                 and e["ts"] + e["dur"] > t0 and e["ts"] < t1])
    gpu = [(max(a, t0), min(b, t1)) for a, b in gpu]
    busy = sum(b - a for a, b in gpu)
    marks = sorted((e for e in events if e.get("tid") == tid and str(e.get("name", "")).startswith("vlmctl.")),
                   key=lambda e: (e["ts"], -e["dur"]))
    phase_us: dict[str, float] = {}
    for e in marks:
        phase_us[e["name"]] = phase_us.get(e["name"], 0.0) + e["dur"]

    def active(t: float) -> str:
        inner = "bench loop"
        for e in marks:  # sorted by start, outer before inner at equal starts
            if e["ts"] > t:
                break
            if e["ts"] <= t < e["ts"] + e["dur"]:
                inner = e["name"]
        return inner

    idle: dict[str, list[float]] = {}
    edges = [t0] + [x for a, b in gpu for x in (a, b)] + [t1]
    for a, b in zip(edges[0::2], edges[1::2]):  # the gaps between busy intervals
        if b - a >= gap_us:
            idle.setdefault(active(a), []).append(b - a)
    kernels: dict[str, list[float]] = {}
    streams: dict[str, float] = {}
    for e in events:
        if e.get("cat") in GPU_CATS and t0 <= e["ts"] < t1:
            sid = str(e.get("args", {}).get("stream", "?"))
            streams[sid] = streams.get(sid, 0.0) + e["dur"]
        if e.get("cat") == "kernel" and t0 <= e["ts"] < t1:
            k = kernels.setdefault(e["name"][:80], [0.0, 0])
            k[0] += e["dur"]
            k[1] += 1
    n = len(steps)
    return {"steps": n, "wall_ms": round((t1 - t0) / 1e3, 2), "gpu_busy_ms": round(busy / 1e3, 2),
            "gpu_busy_share": round(busy / (t1 - t0), 3),
            "gpu_idle_ms_by_phase": {k: [round(sum(v) / 1e3, 2), len(v)] for k, v in
                                     sorted(idle.items(), key=lambda kv: -sum(kv[1]))},
            "host_ms_a_step_by_phase": {k: round(v / 1e3 / n, 3) for k, v in
                                        sorted(phase_us.items(), key=lambda kv: -kv[1])},
            "gpu_ms_by_stream": {k: round(v / 1e3, 2) for k, v in sorted(streams.items(), key=lambda kv: -kv[1])},
            "top_kernels_ms_count": [(k, round(v[0] / 1e3, 2), v[1]) for k, v in
                                     sorted(kernels.items(), key=lambda kv: -kv[1][0])[:15]]}


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/vlmctl-bench"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--no-async-scheduling", action="store_true")
    ap.add_argument("--num-requests", type=int, default=256)
    ap.add_argument("--window-start", type=int, default=200, help="first profiled step of the bench")
    ap.add_argument("--window", type=int, default=40, help="profiled steps")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    from vlmctl.measure.bench import BenchConfig, bench_engine
    from vlmctl.runtime.engine import Engine

    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt = make_checkpoint(args.work / "ckpt", SMOKE if args.smoke else SEVEN_B, dev)
    engine = args.work / "engine"
    if not (engine / "build-llm").exists():
        engine, _ = build_engine(ckpt, args.work, "float16" if dev == "cuda" else "float32")
    opts = {"async_scheduling": False} if args.no_async_scheduling else {}
    if args.smoke:
        opts["async_scheduling"] = not args.no_async_scheduling
        args.num_requests, args.window_start, args.window = 12, 10, 8
    eng = Engine(engine, device=dev, **opts)
    cfg = BenchConfig(num_requests=args.num_requests, concurrency=64 if not args.smoke else 4, output_len=128
                      if not args.smoke else 8)
    acts = [torch.profiler.ProfilerActivity.CPU] + ([torch.profiler.ProfilerActivity.CUDA] if dev == "cuda" else [])
    window = {"seen": 0, "start": args.window_start, "steps": args.window,
              "prof": torch.profiler.profile(activities=acts)}
    bench_engine(eng, BenchConfig(num_requests=16 if not args.smoke else 4, concurrency=cfg.concurrency,
                                  output_len=16, run=7))  # a warm run: kernels, graphs, allocator
    mark(eng, window)
    r = bench_engine(eng, cfg)
    log(f"bench: {r['output_throughput']:.0f} output tok/s, {r['steps']} steps, TTFT p50 {r['ttft_ms']['median']} ms,"
        f" TPOT p50 {r['tpot_ms']['median']} ms (async scheduling {eng.async_scheduling}; profiled steps"
        f" {args.window_start}-{args.window_start + args.window - 1}: the profiler slows them)")
    with tempfile.TemporaryDirectory() as d:
        path = Path(d) / "trace.json"
        window["prof"].export_chrome_trace(str(path))
        res = analyse(json.loads(path.read_text()))
    res["bench"] = {k: r[k] for k in ("output_throughput", "ttft_ms", "tpot_ms", "itl_ms", "steps")}
    res["async_scheduling"] = eng.async_scheduling
    res["device"] = torch.cuda.get_device_name() if dev == "cuda" else "cpu"
    log(json.dumps(res, indent=1))
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
