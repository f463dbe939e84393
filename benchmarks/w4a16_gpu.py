"""W4A16 linears at LLaVA-1.5-7B decoder shapes on one GPU: vlmctl's Triton kernels vs the alternatives.

One command (about 4 minutes on an H200), no checkpoint needed (random AWQ codes made on the device):

    python benchmarks/w4a16_gpu.py --out w4a16.json --table-out vlmctl/runtime/kernels/w4a16_tuned.json

Shapes (hidden 4096, intermediate 11008, 32 layers): qkv 12288x4096, o 4096x4096, gate_up 22016x4096,
down 4096x11008; group 128; fp16 and bf16; M in 1 2 4 8 16 32 64 128 512 2048. Steps:
  1. sweep: vlmctl's candidate configs per (shape, M) in fp16 (bf16 tries fp16's best three), the
     fastest pinned per (M bucket, N, K, dtype); --table-out writes them for `w4a16.select_config`
  2. correctness: each path's output against x @ dequantize(W)^T in fp32 (relative Frobenius error)
  3. timing, median of triton.testing.do_bench, which flushes L2 (a 256 MB write) before every run,
     so the weights come from HBM: vlmctl (tuned), vlmctl untuned heuristic, torch's built-in int4
     (`_weight_int4pack_mm`, bf16 only), gemlite if importable (fp16), dequantize + cuBLAS, and the
     fp16/bf16 cuBLAS linear on dense weights. TB/s = weight bytes read / time (int4 codes + scales +
     zero points for the int4 paths, 2 bytes per weight for cuBLAS); % of the card's device-to-device copy
     bandwidth, measured at the start (`gpu_timing.copy_bandwidth`; 4.1-4.3 TB/s on an H200, 2.95-3.0 on an H100).
  4. the decode step: per path, the sum over all 32 layers' 4 linears of the per-op medians, and a
     CUDA graph replaying 32 layers x 4 linears with 32 distinct weight sets (3.6 GB int4, 13 GB
     fp16), so nothing stays in L2 between layers as in a real decode step.
--smoke runs tiny shapes on the CPU (Triton interpreter, TRITON_INTERPRET=1) to show the script runs.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

from gpu_timing import copy_bandwidth, graph_median_ms  # noqa: E402  (benchmarks/, this script's directory)
from gpu_weights import random_packed  # noqa: E402

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
SMOKE_SHAPES = {"qkv": (96, 64), "o": (64, 64), "gate_up": (176, 64), "down": (64, 128)}
MS = [1, 2, 4, 8, 16, 32, 64, 128, 512, 2048]
STEP_MS = [1, 2, 4, 8, 16, 32, 64]


def log(*a):
    print(*a, flush=True)


class Clock:
    def __init__(self, budget_s: float):
        self.t0 = time.perf_counter()
        self.budget = budget_s

    def left(self) -> float:
        return self.budget - (time.perf_counter() - self.t0)


def timer(smoke: bool):
    if smoke:
        def bench(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
        return bench
    from triton.testing import do_bench

    return lambda fn: do_bench(fn, warmup=5, rep=25, return_mode="median")


def rel_err(y, ref) -> float:
    return float((y.float() - ref).norm() / ref.norm().clamp_min(1e-30))


# ----------------------------------------------------------------------------------- other paths


def torch_int4_prepare(packed, g, order):
    """tinygemm layout: uint8 [N, K/2] (two codes per byte) -> int4pack; w = (q - 8) * scale + zero."""
    import torch

    from vlmctl.runtime.kernels import w4a16 as W

    codes, zeros, scales = W.unpack(packed)
    hi, lo = (codes[:, ::2], codes[:, 1::2]) if order == "even_high" else (codes[:, 1::2], codes[:, ::2])
    w8 = ((hi << 4) | lo).to(torch.uint8).contiguous()
    wp = torch.ops.aten._convert_weight_to_int4pack(w8, 8)
    s = scales.float()
    sz = torch.stack([s, (8 - zeros.float()) * s], -1).transpose(0, 1).contiguous().to(torch.bfloat16)
    return wp, sz


def torch_int4_fn(x, prep, g):
    import torch

    return torch.ops.aten._weight_int4pack_mm(x, prep[0], g, prep[1])


def gemlite_prepare(packed, g, dtype):
    import torch
    from gemlite.core import DType, GemLiteLinearTriton

    from vlmctl.runtime.kernels import w4a16 as W

    codes, zeros, scales = W.unpack(packed)
    n, k = codes.shape
    dt = {torch.float16: DType.FP16, torch.bfloat16: DType.BF16}[dtype]
    lin = GemLiteLinearTriton(W_nbits=4, group_size=g, in_features=k, out_features=n, input_dtype=dt,
                              output_dtype=dt)
    lin.pack(codes.to(torch.uint8), scales.to(dtype), zeros.to(dtype), bias=None)
    return lin


# ----------------------------------------------------------------------------------- main


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write all results as JSON here")
    ap.add_argument("--table-out", help="write the tuned config table here (load with w4a16.load_tuned)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--ms", type=int, nargs="+", default=None)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--no-sweep", action="store_true", help="time the heuristic configs only")
    ap.add_argument("--no-step", action="store_true", help="skip the 32-layer CUDA-graph step")
    ap.add_argument("--budget-s", type=float, default=230.0, help="skip optional parts past this many seconds")
    args = ap.parse_args(argv)

    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    import torch

    from vlmctl.runtime.kernels import w4a16 as W

    clock = Clock(args.budget_s)
    smoke = args.smoke
    dev = torch.device("cpu" if smoke else "cuda")
    if not smoke and not torch.cuda.is_available():
        sys.exit("error: needs a CUDA GPU (or --smoke for a CPU check)")
    g = 32 if smoke else args.group_size
    shapes = SMOKE_SHAPES if smoke else SHAPES
    ms = args.ms or ([1, 2, 16, 130] if smoke else MS)
    dtypes = [getattr(torch, d) for d in args.dtypes]
    layers = 2 if smoke else args.layers
    bench = timer(smoke)
    import triton

    if smoke:
        from vlmctl.runtime.kernels import _interpreter

        _interpreter.patch()  # two bf16 bugs of Triton's interpreter (see that module)

    try:
        import gemlite

        gemlite_version = getattr(gemlite, "__version__", "?")
    except Exception as e:  # optional
        gemlite, gemlite_version = None, f"not importable ({type(e).__name__}: {e})"
    name = torch.cuda.get_device_name() if not smoke else "cpu (Triton interpreter)"
    bound_tbps = copy_bandwidth() / 1e12 if not smoke else float("nan")  # the smoke run's % is meaningless
    meta = {"device": name, "torch": torch.__version__, "triton": triton.__version__, "gemlite": gemlite_version,
            "group_size": g, "copy_tbps": None if smoke else bound_tbps, "smoke": smoke}
    log(f"device {name}; torch {torch.__version__}; triton {triton.__version__}; gemlite {gemlite_version}")
    results, sweep_log, step_rows, notes = [], {}, [], []

    weights = {s: random_packed(n, k, g, i, dev) for i, (s, (n, k)) in enumerate(shapes.items())}
    ref_w = {s: W.dequantize(p, g) for s, p in weights.items()}  # fp32 [N, K]

    # 1. sweep -------------------------------------------------------------------------------------------
    if not args.no_sweep:
        W._load_tuned_table()  # so that --table-out keeps the entries of the shapes and M not swept now
        t0 = time.perf_counter()
        for dtype in dtypes:
            for s, p in weights.items():
                n, k = shapes[s]
                for m in ms:
                    cands = W.candidate_configs(m, n, k, g, W._sm_count(dev))
                    if smoke:
                        cands = [c for c in cands if c.kernel != "dequant_mm"][:2] + \
                            [c for c in cands if c.kernel == "dequant_mm"]
                    if dtype != torch.float16 and ("float16", s, m) in sweep_log and clock.left() < 150:
                        # short of time: bf16 tries fp16's three best (it differs mostly in the dot path)
                        cands = [W.Config(**c) for c, _ in sweep_log[("float16", s, m)][:3]]
                    if smoke:
                        cands = [c for c in cands if c.kernel != "dequant_mm"]  # no cuBLAS in the interpreter
                    if clock.left() < 100:  # keep the whole run near its budget: the heuristic's neighbours
                        heur = W.heuristic_config(m, n, k, g, W._sm_count(dev))
                        cands = list(dict.fromkeys([heur] + cands[:5]))
                        meta["sweep_truncated"] = True
                    res = W.tune(p, g, [m], dtype, configs=cands, verbose=log, timer=bench if smoke else None,
                                 warmup_ms=3, rep_ms=15)
                    timed = res[m]
                    sweep_log[(W._dtype_name(dtype), s, m)] = [(vars(c) | {}, ms_) for c, ms_ in timed]
                    if timed:
                        best, best_ms = timed[0]
                        log(f"sweep {W._dtype_name(dtype):<9} {s:<8} M={m:<5} best {W.describe(best):<34} "
                            f"{best_ms * 1e3:8.1f} us   ({len(timed)} configs)")
        log(f"sweep took {time.perf_counter() - t0:.0f} s")
        if args.table_out:
            W.save_tuned(args.table_out)
            log(f"tuned table written to {args.table_out}")

    # 2+3. correctness and timing ------------------------------------------------------------------------
    int4_order = None
    for dtype in dtypes:
        dn = W._dtype_name(dtype)
        dense = {s: ref_w[s].to(dtype) for s in shapes}
        for s, p in weights.items():
            n, k = shapes[s]
            wb_int4 = W.weight_bytes(n, k, g)
            wb_dense = n * k * 2
            prep_int4 = prep_gl = None
            if not smoke and dtype == torch.bfloat16:
                for order in ([int4_order] if int4_order else ["even_high", "even_low"]):
                    try:
                        prep = torch_int4_prepare(p, g, order)
                        xt = torch.randn(4, k, device=dev, dtype=dtype)
                        if rel_err(torch_int4_fn(xt, prep, g), xt.float() @ dense[s].float().T) < 0.05:
                            prep_int4, int4_order = prep, order
                            break
                    except Exception as e:
                        notes.append(f"torch int4 {s}: {type(e).__name__}: {e}")
                        break
                if prep_int4 is None and not any(n_.startswith(f"torch int4 {s}") for n_ in notes):
                    notes.append(f"torch int4 {s}: neither nibble order matched the reference")
            if gemlite is not None and not smoke and clock.left() > 60:
                try:
                    prep_gl = gemlite_prepare(p, g, dtype)
                except Exception as e:
                    notes.append(f"gemlite {dn} {s}: {type(e).__name__}: {e}")
            for m in ms:
                x = torch.randn(m, k, device=dev, dtype=dtype)
                ref = x.float() @ dense[s].float().T
                cfg = W.select_config(m, n, k, g, dtype, dev)
                heur = W.heuristic_config(m, n, k, g, W._sm_count(dev))
                paths = {"vlmctl": (lambda: W.launch(x, p, g, cfg), wb_int4, W.describe(cfg))}
                if heur != cfg:
                    paths["vlmctl-untuned"] = (lambda: W.launch(x, p, g, heur), wb_int4, W.describe(heur))
                if not smoke:
                    paths["dequant+cublas"] = (lambda: W.launch(x, p, g, W.Config("dequant_mm")), wb_int4, "")
                    paths["cublas-dense"] = (lambda: torch.nn.functional.linear(x, dense[s]), wb_dense, dn)
                if prep_int4 is not None:
                    paths["torch-int4"] = (lambda: torch_int4_fn(x, prep_int4, g), wb_int4, int4_order)
                if prep_gl is not None:
                    paths["gemlite"] = (lambda: prep_gl(x), wb_int4, "")
                for path, (fn, nbytes, what) in paths.items():
                    row = {"dtype": dn, "shape": s, "n": n, "k": k, "m": m, "path": path, "config": what}
                    try:
                        row["rel_err"] = rel_err(fn(), ref)
                        t = bench(fn)
                        row.update(ms=t, tbps=nbytes / (t * 1e-3) / 1e12)
                        row["pct_copy"] = 100 * row["tbps"] / bound_tbps
                    except Exception as e:
                        row["error"] = f"{type(e).__name__}: {str(e).splitlines()[0][:200] if str(e) else ''}"
                    results.append(row)
            prep_int4 = prep_gl = None  # free before the next shape
        log(f"\n{dn}: per-op median time (us) / TB/s / % of this card's copy bandwidth ({bound_tbps:.2f} TB/s) / rel err")
        pnames = sorted({r["path"] for r in results if r["dtype"] == dn},
                        key=lambda p_: ["vlmctl", "vlmctl-untuned", "torch-int4", "gemlite", "dequant+cublas",
                                        "cublas-dense"].index(p_))
        for s in shapes:
            log(f"  {s} {shapes[s][0]}x{shapes[s][1]}")
            log("    " + f"{'M':>5} " + "".join(f"{p_:>30}" for p_ in pnames))
            for m in ms:
                cells = []
                for p_ in pnames:
                    r = next((r for r in results if (r["dtype"], r["shape"], r["m"], r["path"]) == (dn, s, m, p_)), None)
                    if r is None:
                        cells.append(f"{'-':>30}")
                    elif "error" in r:
                        cells.append(f"{'error':>30}")
                    else:
                        cells.append(f"{r['ms'] * 1e3:9.1f} {r['tbps']:5.2f} {r['pct_copy']:4.0f}% {r['rel_err']:8.1e}")
                log("    " + f"{m:>5} " + "".join(cells))
        log(f"  per decode step, {layers} layers x (qkv + o + gate_up + down), sum of per-op medians (ms):")
        for m in ms:
            parts = []
            for p_ in pnames:
                rs = [r for r in results if (r["dtype"], r["m"], r["path"]) == (dn, m, p_) and "ms" in r]
                if len(rs) == len(shapes):
                    tot = layers * sum(r["ms"] for r in rs)
                    parts.append(f"{p_} {tot:.3f}")
                    step_rows.append({"dtype": dn, "m": m, "path": p_, "kind": "sum_of_ops", "ms": tot})
            log(f"    M={m:<5} " + "   ".join(parts))

    # crossover: the smallest M from which dequantize + cuBLAS beats the Triton kernels on every shape
    for dtype in dtypes:
        dn = W._dtype_name(dtype)
        wins = [m for m in ms if all(
            (lambda a, b: a is not None and b is not None and b["ms"] < a["ms"])(
                next((r for r in results if (r["dtype"], r["shape"], r["m"], r["path"]) == (dn, s, m, "vlmctl")
                      and "ms" in r and not r["config"].startswith("dequant")), None),
                next((r for r in results if (r["dtype"], r["shape"], r["m"], r["path"]) == (dn, s, m, "dequant+cublas")
                      and "ms" in r), None)) for s in shapes)]
        meta[f"dequant_crossover_m_{dn}"] = wins[0] if wins else None
        if not smoke:
            log(f"{dn}: dequantize + cuBLAS beats the Triton kernels on all shapes from M = "
                f"{wins[0] if wins else 'never (in the measured M)'}; PREFILL_DEQUANT_MIN_M = {W.PREFILL_DEQUANT_MIN_M}")

    # 4. the decode step as a CUDA graph over distinct layers ------------------------------------------
    if not args.no_step and not smoke:
        if clock.left() < 20:
            notes.append("step graph skipped: time budget spent")
        else:
            step_rows += step_graphs(W, torch, shapes, g, layers, dtypes, int4_order, clock, notes,
                                     with_gemlite=gemlite is not None)

    for n_ in notes:
        log("note:", n_)
    out = {"meta": meta, "results": results, "step": step_rows, "notes": notes,
           "sweep": [{"dtype": d, "shape": s, "m": m, "timed": t} for (d, s, m), t in sweep_log.items()]}
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        log(f"results written to {args.out}")
    log(f"total {time.perf_counter() - clock.t0:.0f} s")
    return out


def step_graphs(W, torch, shapes, g, layers, dtypes, int4_order, clock, notes, with_gemlite=False):
    """Time one decode step's linears (layers x 4, distinct weights) as one CUDA graph per (path, M).
    with_gemlite: also gemlite's fp16 linears at M = 1, 2, 8 (per-call timing charges them their Python
    dispatch, which a graph does not replay)."""
    rows = []
    dev = torch.device("cuda")
    sets = [{s: random_packed(n, k, g, 1000 + 10 * i + j, dev) for j, (s, (n, k)) in enumerate(shapes.items())}
            for i in range(layers)]
    order = list(shapes)

    def run_graph(fn_for, m, dtype):
        xs = {s: torch.randn(m, shapes[s][1], device=dev, dtype=dtype) for s in order}
        return graph_median_ms([fn_for(i, s, xs[s]) for i in range(layers) for s in order])

    for dtype in dtypes:
        dn = W._dtype_name(dtype)
        for m in STEP_MS:
            if clock.left() < 15:
                notes.append(f"step graph {dn} M={m}: skipped, time budget spent")
                break
            W.warmup([sets[0][s] for s in order], g, [m], dtype, device=dev)
            try:
                t = run_graph(lambda i, s, x: (lambda: W.w4a16_linear(x, sets[i][s], g)), m, dtype)
                rows.append({"dtype": dn, "m": m, "path": "vlmctl", "kind": "graph", "ms": t})
                log(f"step graph {dn} M={m:<3} vlmctl {t:.3f} ms")
            except Exception as e:
                notes.append(f"step graph vlmctl {dn} M={m}: {type(e).__name__}: {e}")
    # dense fp16 and torch int4 for comparison, one layer set at a time to bound memory
    for dtype in dtypes:
        dn = W._dtype_name(dtype)
        if clock.left() < 30:
            notes.append(f"dense step graph {dn}: skipped, time budget spent")
            continue
        dense = [{s: W.dequantize(sets[i][s], g, dtype) for s in order} for i in range(layers)]
        for m in (1, 8, 64):
            try:
                t = run_graph(lambda i, s, x: (lambda: torch.nn.functional.linear(x, dense[i][s])), m, dtype)
                rows.append({"dtype": dn, "m": m, "path": "cublas-dense", "kind": "graph", "ms": t})
                log(f"step graph {dn} M={m:<3} cublas-dense {t:.3f} ms")
            except Exception as e:
                notes.append(f"step graph cublas {dn} M={m}: {type(e).__name__}: {e}")
        dense = None  # free before the next dtype
        torch.cuda.empty_cache()
        if dtype == torch.bfloat16 and int4_order and clock.left() > 20:
            preps = [{s: torch_int4_prepare(sets[i][s], g, int4_order) for s in order} for i in range(layers)]
            for m in (1, 8, 64):
                try:
                    t = run_graph(lambda i, s, x: (lambda: torch_int4_fn(x, preps[i][s], g)), m, dtype)
                    rows.append({"dtype": dn, "m": m, "path": "torch-int4", "kind": "graph", "ms": t})
                    log(f"step graph {dn} M={m:<3} torch-int4 {t:.3f} ms")
                except Exception as e:
                    notes.append(f"step graph torch-int4 M={m}: {type(e).__name__}: {e}")
            del preps
        if dtype == torch.float16 and with_gemlite and clock.left() > 30:
            try:
                gl = [{s: gemlite_prepare(sets[i][s], g, dtype) for s in order} for i in range(layers)]
            except Exception as e:
                notes.append(f"step graph gemlite: {type(e).__name__}: {e}")
                continue
            for m in (1, 2, 8):
                try:
                    for s in order:  # its autotuning runs here, outside the capture
                        gl[0][s](torch.randn(m, shapes[s][1], device=dev, dtype=dtype))
                    t = run_graph(lambda i, s, x: (lambda: gl[i][s](x)), m, dtype)
                    rows.append({"dtype": dn, "m": m, "path": "gemlite", "kind": "graph", "ms": t})
                    log(f"step graph {dn} M={m:<3} gemlite {t:.3f} ms")
                except Exception as e:
                    notes.append(f"step graph gemlite M={m}: {type(e).__name__}: {str(e).splitlines()[0][:200]}")
            del gl
            torch.cuda.empty_cache()
    return rows


if __name__ == "__main__":
    main()
