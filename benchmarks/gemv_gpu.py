"""Batch-1 decode GEMVs at LLaVA-1.5-7B decoder shapes on one GPU: the Triton fp16 GEMV (split-K
in-kernel, SiLU·mul fused into down_proj) vs cuBLAS, and the half2 W4A16 GEMV vs the current one.

One command (about 3 minutes on an H200), no checkpoint needed (random weights made on the device):

    python benchmarks/gemv_gpu.py --out gemv.json --table-out vlmctl/runtime/kernels/gemv_tuned.json \
        --w4a16-table-out vlmctl/runtime/kernels/w4a16_tuned.json

Shapes (N x K; hidden 4096, intermediate 11008, 32 layers): qkv 12288x4096, o 4096x4096, gate_up
22016x4096, down 4096x11008 (the fp16 GEMV's down reads silu(gate) * up from a gate_up row [2 x 11008]);
W4A16 group 128; fp16 activations; M = 1. Steps:
  1. correctness at each shape against a float64 reference (dense: x @ W^T, with x = silu(g) * u
     rounded to fp16 for down; W4A16: x @ dequantize(W).half()^T): cuBLAS, the fp16 GEMV (heuristic
     config), the current W4A16 GEMV (its tuned/heuristic config) and the half2 GEMV (heuristic)
  2. sweep: the candidate configs of both new kernels per shape, triton.testing.do_bench median (L2
     flushed before every run); the fastest pinned; --table-out writes the fp16 GEMV's table
     (`gemv.load_tuned`), --w4a16-table-out the W4A16 table with the half2 entries added ("variant":
     "h2", read only with VLMCTL_GEMV=triton). cuBLAS (and cuBLAS + the SiLU·mul kernel for down) and
     the current W4A16 config are timed the same way beside them.
  3. the decode step's linears as one CUDA graph per path, 32 layers with distinct weights (13 GB
     fp16, 3.6 GB int4, so nothing stays in L2 between layers): cuBLAS fp16 (qkv, o, gate_up,
     SiLU·mul kernel, down) vs the fp16 GEMV (SiLU fused into down); the current W4A16 GEMV vs the
     half2 one. ms (median of 10 replays) and TB/s = weight bytes read / time.
--smoke runs tiny shapes on the CPU (Triton interpreter, TRITON_INTERPRET=1) to show the script runs
(steps 1-2 only; the timings there mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
SMOKE_SHAPES = {"qkv": (96, 128), "o": (64, 128), "gate_up": (176, 128), "down": (64, 256)}
G = 128
TOL = {"cublas": 2.0 ** -10, "gemv_f16": 2.0 ** -10, "w4a16": 2.0 ** -10, "w4a16_h2": 2.0 ** -9}


def log(*a):
    print(*a, flush=True)


def main(argv=None):
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out", help="write all results as JSON here")
    ap.add_argument("--table-out", help="write the fp16 GEMV's tuned table here (gemv.load_tuned)")
    ap.add_argument("--w4a16-table-out", help="write the W4A16 table with the half2 GEMV's entries here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU through Triton's interpreter")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--no-sweep", action="store_true", help="heuristic configs only")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
    os.environ.pop("VLMCTL_GEMV", None)  # "current" W4A16 below means the default selection
    import torch
    import triton

    from vlmctl.runtime import ops
    from vlmctl.runtime.kernels import gemv as GV
    from vlmctl.runtime.kernels import w4a16 as W
    from w4a16_gpu import make_weights

    smoke = args.smoke
    if not smoke and not torch.cuda.is_available():
        sys.exit("error: needs a CUDA GPU (or --smoke for a CPU check)")
    dev = torch.device("cpu" if smoke else "cuda")
    shapes = SMOKE_SHAPES if smoke else SHAPES
    g = 32 if smoke else G
    dt = torch.float16
    t_start = time.perf_counter()
    name = "cpu (Triton interpreter)" if smoke else torch.cuda.get_device_name()
    log(f"device {name}; torch {torch.__version__}; triton {triton.__version__}")
    out = {"meta": {"device": name, "torch": torch.__version__, "triton": triton.__version__, "group_size": g,
                    "smoke": smoke}, "correctness": [], "sweep": {}, "ops": [], "step": [], "failures": []}
    W._load_tuned_table()  # so that --w4a16-table-out keeps the entries already measured

    if smoke:
        def bench(fn):
            fn()
            t = time.perf_counter()
            fn()
            return (time.perf_counter() - t) * 1e3
    else:
        from triton.testing import do_bench

        def bench(fn):
            return do_bench(fn, warmup=5, rep=20, return_mode="median")

    def silu_x(x2):
        gg, u = x2.double().chunk(2, -1)
        return (gg * torch.sigmoid(gg) * u).to(dt).double()

    def rel(y, ref):
        return float((y.double() - ref).norm() / ref.norm())

    gen = torch.Generator(device=dev).manual_seed(0)
    dense = {s: (torch.randn(n, k, generator=gen, device=dev) * 0.02).to(dt) for s, (n, k) in shapes.items()}
    packed = {s: make_weights(n, k, g, dev, seed=i) for i, (s, (n, k)) in enumerate(shapes.items())}
    xs = {s: torch.randn(1, 2 * k if s == "down" else k, generator=gen, device=dev).to(dt)
          for s, (n, k) in shapes.items()}

    def f16_x(s):  # the activation row cuBLAS and the W4A16 kernels take (down: silu(g) * u, in fp16)
        return ops.act_mul(xs[s], "silu") if s == "down" else xs[s]

    # 1. correctness -------------------------------------------------------------------------------------
    for s, (n, k) in shapes.items():
        silu = s == "down"
        x = f16_x(s)
        ref_d = (silu_x(xs[s]) if silu else xs[s].double()) @ dense[s].double().T
        wq = W.dequantize(packed[s], g, dt).double()
        ref_q = x.double() @ wq.T
        cur = W.select_config(1, n, k, g, dt, dev)
        h2 = W.heuristic_h2_config(1, n, k, g, W._sm_count(dev))
        runs = {"gemv_f16": lambda: GV.launch(xs[s], dense[s], GV.heuristic_config(1, n, k), silu=silu),
                "w4a16": lambda: W.launch(x, packed[s], g, cur),
                "w4a16_h2": lambda: W.launch(x, packed[s], g, h2)}
        if not smoke:
            runs["cublas"] = lambda: torch.nn.functional.linear(x, dense[s])
        for path, fn in runs.items():
            err = rel(fn(), ref_q if path.startswith("w4a16") else ref_d)
            ok = err <= TOL[path]
            out["correctness"].append({"shape": s, "path": path, "rel_err": err, "tol": TOL[path], "ok": ok})
            log(f"check {s:8s} {path:9s} rel err {err:.2e} (bound {TOL[path]:.1e}){'' if ok else '  FAIL'}")
            if not ok:
                out["failures"].append(f"{s} {path}: {err:.2e}")

    # 2. sweep and per-op timings ----------------------------------------------------------------------
    sms = W._sm_count(dev)
    for s, (n, k) in shapes.items():
        silu = s == "down"
        x = f16_x(s)
        cands = GV.candidate_configs(1, n, k, sms)
        hc = W.h2_candidate_configs(1, n, k, g, sms)
        if args.no_sweep or smoke:
            cands = [GV.heuristic_config(1, n, k, sms)] + cands[:1]
            hc = [W.heuristic_h2_config(1, n, k, g, sms)] + hc[:1]
        res = GV.tune(dense[s], [1], dt, silu=silu, configs=cands, verbose=log, timer=bench)[1]
        res_h2 = W.tune(packed[s], g, [1], dt, configs=hc, verbose=log, timer=bench)[1]
        out["sweep"][s] = {"gemv_f16": [[GV.describe(c), ms] for c, ms in res],
                           "w4a16_h2": [[W.describe(c), ms] for c, ms in res_h2]}
        timed = {"gemv_f16": res[0][1] if res else None, "w4a16_h2": res_h2[0][1] if res_h2 else None,
                 "w4a16": bench(lambda: W.launch(x, packed[s], g, W.select_config(1, n, k, g, dt, dev)))}
        if not smoke:
            timed["cublas"] = bench(lambda: torch.nn.functional.linear(x, dense[s]))
            if silu:
                timed["cublas+act_mul"] = bench(lambda: torch.nn.functional.linear(ops.act_mul(xs[s], "silu"),
                                                                                   dense[s]))
        for path, ms in timed.items():
            if ms is None:
                continue
            nbytes = W.weight_bytes(n, k, g) if path.startswith("w4a16") else 2 * n * k
            out["ops"].append({"shape": s, "path": path, "ms": ms, "tbps": nbytes / ms / 1e9})
            log(f"op {s:8s} {path:15s} {ms * 1e3:8.1f} us {nbytes / ms / 1e9:6.2f} TB/s"
                + (f"  best {GV.describe(res[0][0])}" if path == "gemv_f16" and res else "")
                + (f"  best {W.describe(res_h2[0][0])}" if path == "w4a16_h2" and res_h2 else ""))
    if args.table_out:
        GV.save_tuned(args.table_out)
        log(f"wrote {args.table_out}")
    if args.w4a16_table_out:
        W.save_tuned(args.w4a16_table_out)
        log(f"wrote {args.w4a16_table_out}")

    # 3. the decode step's linears as CUDA graphs ------------------------------------------------------
    if not smoke:
        out["step"] = step_graphs(torch, ops, GV, W, make_weights, shapes, g, args.layers, log)
    out["meta"]["seconds"] = time.perf_counter() - t_start
    log(f"done in {out['meta']['seconds']:.0f} s; failures: {out['failures'] or 'none'}")
    if args.out:
        Path(args.out).write_text(json.dumps(out, indent=1) + "\n")
        log(f"wrote {args.out}")
    return 1 if out["failures"] else 0


def step_graphs(torch, ops, GV, W, make_weights, shapes, g, layers, log):
    """One CUDA graph per path over `layers` layers x 4 linears with distinct weights; median of 10 replays."""
    dev = torch.device("cuda")
    dt = torch.float16
    F = torch.nn.functional
    n_qkv, k = shapes["qkv"]
    inter = shapes["down"][1]
    x_h = torch.randn(1, k, device=dev, dtype=dt)
    x_o = torch.randn(1, shapes["o"][1], device=dev, dtype=dt)
    rows = []

    from w4a16_gpu import graph_median_ms as run_graph

    def add(path, ms, nbytes):
        rows.append({"path": path, "layers": layers, "ms": ms, "tbps": nbytes / ms / 1e9})
        log(f"step graph {path:22s} {ms:7.3f} ms  {nbytes / ms / 1e9:5.2f} TB/s")

    # dense fp16: cuBLAS + the SiLU·mul kernel vs the Triton GEMV with SiLU fused into down
    gen = torch.Generator(device=dev).manual_seed(1)
    ws = [{s: (torch.randn(n, kk, generator=gen, device=dev) * 0.02).to(dt) for s, (n, kk) in shapes.items()}
          for _ in range(layers)]
    nbytes = layers * sum(2 * n * kk for n, kk in shapes.values())

    def cublas_layer(w):
        def f():
            F.linear(x_h, w["qkv"])
            F.linear(x_o, w["o"])
            F.linear(ops.act_mul(F.linear(x_h, w["gate_up"]), "silu"), w["down"])
        return f

    def gemv_layer(w):
        cfg = {s: GV.select_config(1, n, kk, dt, silu=s == "down", device=dev) for s, (n, kk) in shapes.items()}

        def f():
            GV.launch(x_h, w["qkv"], cfg["qkv"])
            GV.launch(x_o, w["o"], cfg["o"])
            GV.launch(GV.launch(x_h, w["gate_up"], cfg["gate_up"]), w["down"], cfg["down"], silu=True)
        return f

    add("cublas_fp16+act_mul", run_graph([cublas_layer(w) for w in ws]), nbytes)
    add("triton_gemv_fp16", run_graph([gemv_layer(w) for w in ws]), nbytes)
    ws = None
    torch.cuda.empty_cache()

    # W4A16: the current GEMV (default selection) vs the half2 GEMV (its tuned or heuristic config)
    pk = [{s: make_weights(n, kk, g, dev, seed=100 + 10 * i + j) for j, (s, (n, kk)) in enumerate(shapes.items())}
          for i in range(layers)]
    nbytes = layers * sum(W.weight_bytes(n, kk, g) for n, kk in shapes.values())
    x_i = torch.randn(1, inter, device=dev, dtype=dt)
    xin = {"qkv": x_h, "o": x_o, "gate_up": x_h, "down": x_i}

    def w4_layer(p, h2):
        if h2:
            os.environ["VLMCTL_GEMV"] = "triton"
        try:
            cfg = {s: W.select_config(1, n, kk, g, dt, dev) for s, (n, kk) in shapes.items()}
        finally:
            os.environ.pop("VLMCTL_GEMV", None)

        def f():
            for s in shapes:
                W.launch(xin[s], p[s], g, cfg[s])
        return f

    add("w4a16_gemv_current", run_graph([w4_layer(p, False) for p in pk]), nbytes)
    add("w4a16_gemv_h2", run_graph([w4_layer(p, True) for p in pk]), nbytes)
    return rows


if __name__ == "__main__":
    sys.exit(main())
