"""The tensor-core GEMV's zero-folded arithmetic (`mma_gemv` with VLMCTL_W4A16_ZERO_FOLD=1) on one GPU.

Session 37's ablation on an H200 (`w4a16_gemv_ablate_gpu.py`) put the batch-1 CUDA GEMV's arithmetic at 0.24 ms of
the 128 linears' 1.35: its 3.25 instructions a pair of weights (mask-or, subtract the zero point, multiply-add).
The zero-folded arithmetic (w4a16_mma.cu, mma_gemv_compute_zf) puts each code in the tensor core's A registers as
magic + code * unit with one AND-OR a pair, subtracts the zero point's share with a second mma against the same x,
and applies the scale once per 128-k chunk in fp32: about 1.25 instructions a pair, the products on tensor cores
that are idle at these batch sizes. This measures whether that makes the linears faster.

    OUT=results python benchmarks/w4a16_zero_fold_gpu.py [--ms 1 2 4 8] [--dtype bfloat16]

1. correctness: the 7B decoder's four linears at M 1, 2, 8: both arithmetics against the fp32 product with the
   unrounded weights (relative Frobenius error).
2. per linear and M: every mma_gemv config (block_m 8, 2/4/8 warps, 1-4 chunks ahead) with the arithmetic before
   and zero-folded, µs a call (a CUDA graph of 8 launches over distinct weights, median of 15 replays), against
   the selection's choice (at batch 1 in fp16 the CUDA GEMV).
3. the 128 linears (32 layers) as one graph at each M: the selection, the best config of each arithmetic.
4. tables for `decode_gpu.py --env-cases "VLMCTL_W4A16_ZERO_FOLD=1 VLMCTL_W4A16_TABLE=..."`: the shipped table
   with the zero-folded best config for each shape and M where it beat the selection (at batch 1 in place of the
   CUDA and half2 GEMVs' entries): $OUT/zf_table.json; and $OUT/zf_table_keep_gate_up.json, the same but the
   gate_up at batch 1 left to the CUDA GEMV (which fuses the act·mul into its epilogue).
Writes $OUT/zero_fold.json.
"""
import json
import os
import sys
import time
from dataclasses import asdict

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from gpu_timing import graph_median_ms as time_graph  # noqa: E402
from gpu_weights import random_packed  # noqa: E402
from vlmctl.runtime.kernels import cuda_rtc  # noqa: E402
from vlmctl.runtime.kernels import w4a16 as W  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
os.environ.setdefault("VLMCTL_CACHE_DIR", "/var/tmp/vlmctl-cache")
dev = torch.device("cuda")
MS = [int(v) for v in sys.argv[sys.argv.index("--ms") + 1:] if v.isdigit()] if "--ms" in sys.argv else [1, 2, 4, 8]
DT = torch.bfloat16 if "bfloat16" in sys.argv else torch.float16
G = 128
SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
res = {"device": torch.cuda.get_device_name(), "dtype": str(DT), "correct": [], "sweep": {}, "step": {}}
T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def zero_fold(on: bool) -> None:
    os.environ["VLMCTL_W4A16_ZERO_FOLD"] = "1" if on else "0"


def cands(k):
    return [W.Config("mma_gemv", block_n=16, block_m=8, num_warps=nw, num_stages=st)
            for nw in (2, 4, 8) for st in (1, 2, 3, 4) if k // 128 >= nw]


log("nvrtc", cuda_rtc.nvrtc_version(), torch.__version__, res["device"], res["dtype"])
names = set()
for on in (False, True):
    zero_fold(on)
    names |= {W.mma_gemv_kernel_name(c, G, DT) for (n, k) in SHAPES.values() for c in cands(k)}
cap = torch.cuda.get_device_capability()
t = time.perf_counter()
cuda_rtc.precompile(W.mma_source(), sorted(names), f"sm_{cap[0]}{cap[1]}")
log(f"compiled {len(names)} kernels in {time.perf_counter() - t:.1f}s")

# ------------------------------------------------------------------ correctness
for name, (n, k) in SHAPES.items():
    p = random_packed(n, k, G, n + k)
    wx = W.dequantize(p, G)  # fp32, unrounded
    for m in (1, 2, 8):
        x = torch.randn(m, k, device=dev, dtype=DT)
        ref = x.float() @ wx.t()
        row = {"shape": name, "m": m}
        for on in (False, True):
            zero_fold(on)
            y = W.launch(x, p, G, cands(k)[0]).float()
            row["zero_fold" if on else "before"] = float((y - ref).norm() / ref.norm())
        res["correct"].append(row)
        log(f"{name:8s} m{m}: relative error against the unrounded product: before {row['before']:.2e}, "
            f"zero-folded {row['zero_fold']:.2e}")
bad = [r for r in res["correct"] if r["zero_fold"] > (2.0 ** -11 if DT == torch.float16 else 2.0 ** -8)]
if bad:
    json.dump(res, open(os.path.join(OUT, "zero_fold.json"), "w"), indent=1)
    sys.exit(f"zero-folded results outside the output rounding: {bad}")

# ------------------------------------------------------------------ per linear
NWS = 8  # weight sets per shape, cycled in each timed graph: more bytes than L2 holds
best = {}  # (name, m, on) -> (µs, config)
sel = {}   # (name, m) -> (µs, config)
for name, (n, k) in SHAPES.items():
    ps = [random_packed(n, k, G, n + i) for i in range(NWS)]
    byt = n * k / 2 + n * k / G * 3
    for m in MS:
        x = torch.randn(m, k, device=dev, dtype=DT)
        y = torch.empty(m, n, device=dev, dtype=DT)

        def per_call(c):
            return time_graph([lambda p=p: W.launch(x, p, G, c, out=y) for p in ps]) * 1e3 / NWS

        zero_fold(False)
        tc = W.select_config(m, n, k, G, DT, dev)
        sel[(name, m)] = (per_call(tc), tc)
        row = {"selected": (W.describe(tc), sel[(name, m)][0])}
        for on in (False, True):
            zero_fold(on)
            timed = sorted(((per_call(c), c) for c in cands(k)), key=lambda v: v[0])
            best[(name, m, on)] = timed[0]
            row["zero_fold" if on else "before"] = [(W.describe(c), us) for us, c in timed]
        res["sweep"][f"{name}_m{m}"] = row
        b0, b1 = best[(name, m, False)], best[(name, m, True)]
        log(f"{name:8s} m{m}: selected {sel[(name, m)][0]:6.2f} us ({W.describe(tc)}) | mma_gemv before "
            f"{b0[0]:6.2f} ({W.describe(b0[1])}) | zero-folded {b1[0]:6.2f} ({W.describe(b1[1])}, "
            f"{byt / b1[0] / 1e6:.2f} TB/s)")

# ------------------------------------------------------------------ the 128 linears as one graph
layers = [{nm: random_packed(n, k, G, 1000 * i + j) for j, (nm, (n, k)) in enumerate(SHAPES.items())}
          for i in range(32)]
total = sum(n * k / 2 + n * k / G * 3 for (n, k) in SHAPES.values()) * 32
for m in MS:
    xs = {nm: torch.randn(m, k, device=dev, dtype=DT) for nm, (n, k) in SHAPES.items()}
    ys = {nm: torch.empty(m, n, device=dev, dtype=DT) for nm, (n, k) in SHAPES.items()}
    row = {}
    for label, on, pick in (("selected", False, lambda nm: sel[(nm, m)][1]),
                            ("mma_gemv before", False, lambda nm: best[(nm, m, False)][1]),
                            ("zero-folded", True, lambda nm: best[(nm, m, True)][1])):
        zero_fold(on)
        fns = [lambda L=L, nm=nm, c=pick(nm): W.launch(xs[nm], L[nm], G, c, out=ys[nm]) for L in layers
               for nm in SHAPES]
        row[label] = [time_graph(fns), time_graph(fns)]
    res["step"][f"m{m}"] = row
    log(f"128 linears m{m}: " + " | ".join(f"{lb} {min(v):.3f} ms ({total / min(v) / 1e9:.2f} TB/s)"
                                           for lb, v in row.items()))

# ------------------------------------------------------------------ tables for the decode step
shipped = json.loads(W.TUNED_TABLE.read_text())
gpu, dtn = res["device"], {torch.float16: "float16", torch.bfloat16: "bfloat16"}[DT]
for fname, keep in (("zf_table.json", ()), ("zf_table_keep_gate_up.json", ("gate_up",))):
    entries = list(shipped["entries"])
    chosen = []
    for name, (n, k) in SHAPES.items():
        for m in MS:
            us, c = best[(name, m, True)]
            if us >= sel[(name, m)][0] or (m == 1 and name in keep):
                continue
            b = W.bucket(m)
            if b == 1:  # the CUDA and half2 GEMVs' entries come first at batch 1: take them out for this shape
                entries = [e for e in entries if not (e["device"] == gpu and e["bucket"] == 1 and e["n"] == n
                                                      and e["k"] == k and e["group_size"] == G and e["dtype"] == dtn
                                                      and e.get("variant") in ("cuda", "h2"))]
            entries = [e for e in entries if not (e["device"] == gpu and e["bucket"] == b and e["n"] == n
                                                  and e["k"] == k and e["group_size"] == G and e["dtype"] == dtn
                                                  and e.get("variant") == "mma_gemv")]
            entries.append({"device": gpu, "bucket": b, "n": n, "k": k, "group_size": G, "dtype": dtn,
                            "variant": "mma_gemv", "config": asdict(c)})
            chosen.append(f"{name} m{m} {W.describe(c)}")
    with open(os.path.join(OUT, fname), "w") as f:
        json.dump({"format": shipped["format"], "entries": entries}, f, indent=1)
    log(f"{fname}: zero-folded mma_gemv for {', '.join(chosen) or 'nothing'}")
json.dump(res, open(os.path.join(OUT, "zero_fold.json"), "w"), indent=1)
log("done")
