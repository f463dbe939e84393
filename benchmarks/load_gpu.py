"""Engine load time, fp16 against AWQ, each engine alone in a fresh process, on cold and warm kernel caches.

The engines are `serving_gpu.py`'s: a LLaVA-1.5-7B-shaped checkpoint with random weights, built by `vlmctl
build` with the engine's defaults (`limits.max_batch_size: 64`), and the same engine with its decoder
round-to-nearest int4 (AutoAWQ GEMM layout, group 128). Each load runs `Engine(path)` in a new Python
process, so neither engine finds kernels the other compiled:
- cold: a new, empty Triton cache (`TRITON_CACHE_DIR`) and NVRTC cubin cache (`VLMCTL_CACHE_DIR`);
- warm: the same process again with the caches that cold load filled.
Reported per load: `Engine.load_seconds` (decoder weights, vision, decode graphs with an AWQ decoder's
decode-batch kernels, prefill kernels, warm steps), the whole `Engine(...)` time, and the Triton kernels
compiled (or loaded from the disk cache) and the C extensions Triton built with gcc (kernel launchers) in each
phase. Engines alternate (fp16, AWQ, AWQ, fp16, ...) so that
neither always goes first on a machine.

    python benchmarks/load_gpu.py --work /var/tmp/vb [--rounds 2] [--env-cases "" "VLMCTL_COMPILE_WORKERS=1"]
    python benchmarks/load_gpu.py --work /var/tmp/vb --env-cases "" "PYTHONPATH=/path/to/older/checkout"
    python benchmarks/load_gpu.py --smoke --work /tmp/smoke       # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import shlex
import subprocess
import sys
import tempfile
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]


def child(engine: str, kv_cache_tokens: int | None = None) -> None:
    """Load one engine in this process and print one JSON line."""
    t_import = time.perf_counter()
    import torch

    from vlmctl.runtime import engine as engine_mod  # from PYTHONPATH: a case may point it at other code
    from vlmctl.runtime.kernels import triton_watch

    t_import = time.perf_counter() - t_import
    compiles: dict[str, int] = {}
    builds: dict[str, int] = {}
    nvrtc: dict[str, int] = {}
    phase = ["(outside a phase)"]
    original = engine_mod.Engine._load_phase

    @contextlib.contextmanager
    def named_phase(self, name):  # note which phase each Triton compile falls in
        phase[0] = name
        with original(self, name):
            yield
        phase[0] = "(outside a phase)"

    engine_mod.Engine._load_phase = named_phase
    watch = triton_watch.triton_compiles() if triton_watch.available() else contextlib.nullcontext([])
    t0 = time.perf_counter()
    with watch as seen:
        hook_runtime = None
        if triton_watch.available():  # count per phase: wrap the watch's hook
            import triton

            hook_runtime = triton.knobs.runtime
            inner = hook_runtime.jit_cache_hook

            keys = set()

            def per_phase(*a, **k):
                key = (str(k.get("repr")), str(k.get("key")))  # once per specialization (see triton_watch)
                if key not in keys:
                    keys.add(key)
                    compiles[phase[0]] = compiles.get(phase[0], 0) + 1
                return inner(*a, **k)

            hook_runtime.jit_cache_hook = per_phase
            count_c_builds(builds, phase)
        count_nvrtc_compiles(nvrtc, phase)
        try:
            opts = {"kv_cache_tokens": kv_cache_tokens} if kv_cache_tokens else {}
            eng = engine_mod.Engine(Path(engine), **opts)
        finally:
            if hook_runtime is not None:
                hook_runtime.jit_cache_hook = inner
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    total = time.perf_counter() - t0
    other = total - sum(eng.load_seconds.values())  # outside the phases: engine files, config, KV pool
    import vlmctl

    print(json.dumps({"code": str(Path(vlmctl.__file__).parent), "engine_s": round(total, 3), "import_s": round(t_import, 3), "phases_s": eng.load_seconds,
                      "other_s": round(other, 3), "triton_compiles": len(seen), "triton_compiles_per_phase": compiles,
                      "c_builds_per_phase": builds, "nvrtc_compiles_per_phase": nvrtc,
                      "triton_kernels": sorted({k.split("[")[0][:200] for k in seen})}), flush=True)


def count_calls_per_phase(owner, attr: str, counts: dict, phase: list) -> None:
    """Wrap `owner.attr` so that each call (from any thread) counts under the phase running at the time
    (`phase[0]`)."""
    import threading

    inner = getattr(owner, attr)
    lock = threading.Lock()

    def counted(*a, **k):
        with lock:
            counts[phase[0]] = counts.get(phase[0], 0) + 1
        return inner(*a, **k)

    setattr(owner, attr, counted)


def count_c_builds(builds: dict, phase: list) -> None:
    """Count each C extension Triton builds with gcc (a kernel's launcher, its driver's utilities) per phase:
    `triton.runtime.build._build` is where Triton 3.x calls the C compiler; a Triton without it is not counted."""
    from triton.runtime import build

    if getattr(build, "_build", None) is not None:
        count_calls_per_phase(build, "_build", builds, phase)


def count_nvrtc_compiles(compiles: dict, phase: list) -> None:
    """Count each CUDA kernel NVRTC compiles (a miss of vlmctl's on-disk kernel cache, which then calls
    `cuda_rtc.compile_cubin`) per phase."""
    from vlmctl.runtime.kernels import cuda_rtc

    count_calls_per_phase(cuda_rtc, "compile_cubin", compiles, phase)


def load_once(engine: Path, env: dict) -> dict:
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, __file__, "--child", str(engine)], env=env, capture_output=True,
                          text=True, timeout=900)
    wall = time.perf_counter() - t0
    if proc.returncode != 0:
        raise RuntimeError(f"loading {engine} failed (rc {proc.returncode}):\n{proc.stderr[-4000:]}")
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    out["process_s"] = round(wall, 3)
    return out


def main() -> None:
    ap = argparse.ArgumentParser()
    ap.add_argument("--child", help=argparse.SUPPRESS)
    ap.add_argument("--kv-cache-tokens", type=int, help=argparse.SUPPRESS)  # the child's KV pool (tests)
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/vlmctl-bench"))
    ap.add_argument("--smoke", action="store_true")
    ap.add_argument("--rounds", type=int, default=1)
    ap.add_argument("--engines", nargs="+", default=["fp16", "awq"], choices=["fp16", "awq"])
    ap.add_argument("--env-cases", nargs="+", default=[""],
                    help="environment settings per case, e.g. '' 'VLMCTL_COMPILE_WORKERS=1'; each case loads every "
                         "engine cold then warm, in every round")
    ap.add_argument("--build-only", action="store_true", help="make the checkpoint and engines, load nothing")
    ap.add_argument("--out")
    args = ap.parse_args()
    if args.child:
        return child(args.child, args.kv_cache_tokens)

    import torch

    sys.path.insert(0, str(ROOT / "benchmarks"))
    import serving_gpu as sg

    shape = sg.SMOKE if args.smoke else sg.SEVEN_B
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    ckpt = sg.make_checkpoint(args.work / "ckpt", shape, dev)
    engine_dir = args.work / "engine"
    if not (engine_dir / "build-llm" / "config.json").exists():
        engine_dir, _ = sg.build_engine(ckpt, args.work, "float16" if dev == "cuda" else "float32")
    engines = {"fp16": engine_dir}
    if "awq" in args.engines:
        engines["awq"] = sg.make_awq_engine(engine_dir, args.work, 64 if args.smoke else 128)
    if args.build_only:
        return None
    res: dict = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "cpus": os.cpu_count(),
                 "loads": []}
    cache_root = Path(tempfile.mkdtemp(prefix="load-caches-", dir=args.work))
    n = 0
    for rnd in range(args.rounds):
        order = args.engines if rnd % 2 == 0 else list(reversed(args.engines))
        for case in args.env_cases:
            for name in order:
                n += 1
                caches = {"TRITON_CACHE_DIR": str(cache_root / f"triton{n}"),
                          "VLMCTL_CACHE_DIR": str(cache_root / f"vlmctl{n}")}
                env = dict(os.environ, PYTHONPATH=os.pathsep.join([str(ROOT), os.environ.get("PYTHONPATH", "")]),
                           **caches)
                env.update(dict(kv.split("=", 1) for kv in shlex.split(case)))
                if args.smoke:
                    env["CUDA_VISIBLE_DEVICES"] = ""
                for cache in ("cold", "warm"):
                    r = load_once(engines[name], env)
                    r.update(engine=name, cache=cache, case=case, round=rnd)
                    res["loads"].append(r)
                    print(f"{name:4s} {cache} [{case or 'defaults'}] Engine() {r['engine_s']:.2f} s (process "
                          f"{r['process_s']:.1f} s), Triton compiles {r['triton_compiles']}: "
                          + ", ".join(f"{k} {v:.2f}" for k, v in r["phases_s"].items()) + f", other {r['other_s']:.2f}"
                          + f"  | compiles per phase {r['triton_compiles_per_phase']}"
                          + f", C builds per phase {r.get('c_builds_per_phase')}"
                          + f", NVRTC compiles per phase {r.get('nvrtc_compiles_per_phase')}", flush=True)
    for case in args.env_cases:
        for cache in ("cold", "warm"):
            line = []
            for name in args.engines:
                xs = sorted(r["engine_s"] for r in res["loads"]
                            if r["engine"] == name and r["cache"] == cache and r["case"] == case)
                line.append(f"{name} {', '.join(f'{x:.2f}' for x in xs)} s")
            print(f"[{case or 'defaults'}] {cache}: " + "; ".join(line))
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
