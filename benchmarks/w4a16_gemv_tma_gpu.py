"""The batch-1 CUDA GEMV with its weights brought in by bulk copies (`w4a16_gemv_tma`, runtime/kernels/
w4a16_gemv_tma.cu) against the shipped selection, on one GPU.

Session 37's H200 ablation (`w4a16_gemv_ablate_gpu.py`) found the GEMV's loads alone at 3.9 TB/s but the GEMV at
2.5: its register-held loads are issued behind its arithmetic. This kernel issues each warp's whole share of the
weights as one bulk copy into shared memory when the block starts (before the PDL wait), and computes from there
with the same arithmetic, so what it measures is whether taking the loads off the registers lets the weight stream
run at the bandwidth while the arithmetic keeps up.

    OUT=results python benchmarks/w4a16_gemv_tma_gpu.py     # the pipelined version (a bulk copy per row and trip)
    VLMCTL_W4A16_GEMV_TMA=single OUT=results python benchmarks/w4a16_gemv_tma_gpu.py   # one copy a warp

1. correctness: at the 7B decoder's four linears (gate_up plain), every config against the CUDA GEMV with the same
   rows a warp (bit-equal: same arithmetic and order) and against the fp32 reference.
2. per linear: every config (rows a warp x warps a block, within the shared memory a block may have), µs a call
   in a CUDA graph of 8 PDL launches over distinct weights (median of 15 replays), beside the selection's choice.
3. the 128 linears (32 layers) as one graph, PDL between them: the selection, the best TMA config per shape, and
   the faster of the two per shape; two timings each.
Writes $OUT/gemv_tma.json.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from gpu_timing import copy_bandwidth  # noqa: E402
from gpu_timing import graph_median_ms as time_graph  # noqa: E402
from gpu_weights import random_packed  # noqa: E402
from vlmctl.runtime.kernels import cuda_rtc  # noqa: E402
from vlmctl.runtime.kernels import w4a16 as W  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
os.environ.setdefault("VLMCTL_CACHE_DIR", "/var/tmp/vlmctl-cache")
dev = torch.device("cuda")
G = 128
SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
GRID = [(1, 8), (1, 16), (2, 4), (2, 8), (2, 16), (4, 2), (4, 4), (4, 8), (8, 1), (8, 2), (8, 4)]
VERSION = "single" if os.environ.get("VLMCTL_W4A16_GEMV_TMA", "").strip() == "single" else "pipelined"
res = {"device": torch.cuda.get_device_name(), "version": VERSION, "correct": {}, "per_call_us": {}, "chain_ms": {}}
T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def tma(rpw, nw):
    return W.Config("gemv_tma", block_n=rpw * nw, num_warps=nw)


def cands(k):
    return [tma(r, w) for r, w in GRID if W.gemv_tma_shared_bytes(tma(r, w), k) <= W.MMA_MAX_SHARED]


def run_tma(x, p, c, y):
    W._launch_gemv_tma(x, p, G, c, None, y)
    return y


bw = copy_bandwidth()
res["copy_tb_s"] = bw / 1e12
log("nvrtc", cuda_rtc.nvrtc_version(), torch.__version__, res["device"], f"copy bandwidth {bw / 1e12:.2f} TB/s",
    f"version: {VERSION}")
cap = torch.cuda.get_device_capability()
t = time.perf_counter()
names = sorted({f"w4a16_gemv_tma<{c.block_n // c.num_warps}, {c.num_warps}, {G}"
                 + (", -1, 0>" if VERSION == "single" else ">") for (n, k) in SHAPES.values() for c in cands(k)})
cuda_rtc.precompile(W.gemv_tma_source(), names, f"sm_{cap[0]}{cap[1]}")
log(f"compiled {len(names)} kernels in {time.perf_counter() - t:.1f}s")

# ------------------------------------------------------------------ correctness
bad = 0
for name, (n, k) in SHAPES.items():
    p = random_packed(n, k, G, n + k)
    x = torch.randn(1, k, device=dev, dtype=torch.float16)
    ref = x.float() @ W.dequantize(p, G, torch.float16).float().t()
    for c in cands(k):
        rpw, nw = c.block_n // c.num_warps, c.num_warps
        y = run_tma(x, p, c, torch.empty(1, n, device=dev, dtype=torch.float16))
        yc = W.launch(x, p, G, W.Config("gemv_cuda", block_n=c.block_n, num_warps=nw, num_stages=1)) \
            if rpw in (1, 2, 4, 8) and nw in (1, 2, 4, 8, 16) else None
        err = float((y.float() - ref).norm() / ref.norm())
        same = None if yc is None else bool(torch.equal(y, yc))
        res["correct"][f"{name} {rpw}x{nw}"] = {"rel_err": err, "equals_cuda_gemv": same}
        if err > 2 * 2.0 ** -11 or same is False:
            bad += 1
            log(f"BAD {name} {rpw}x{nw}: relative error {err:.2e}, equal to the CUDA GEMV: {same}")
log(f"correctness: {len(res['correct'])} cases, {bad} bad")
if bad:
    json.dump(res, open(os.path.join(OUT, "gemv_tma.json"), "w"), indent=1)
    sys.exit("correctness failed: no timings")

# ------------------------------------------------------------------ per linear
NWS = 8
best, sel = {}, {}
for name, (n, k) in SHAPES.items():
    ps = [random_packed(n, k, G, n + i) for i in range(NWS)]
    x = torch.randn(1, k, device=dev, dtype=torch.float16)
    y = torch.empty(1, n, device=dev, dtype=torch.float16)
    byt = n * k / 2 + n * k / G * 3
    tc = W.select_config(1, n, k, G, torch.float16, dev)
    t_sel = time_graph([lambda p=p: W.launch(x, p, G, tc, out=y) for p in ps]) * 1e3 / NWS
    sel[name] = (t_sel, tc)
    timed = sorted(((time_graph([lambda p=p, c=c: run_tma(x, p, c, y) for p in ps]) * 1e3 / NWS, c)
                    for c in cands(k)), key=lambda v: v[0])
    best[name] = timed[0]
    res["per_call_us"][name] = {"selected": (W.describe(tc), t_sel),
                                "tma": [(f"{c.block_n // c.num_warps}x{c.num_warps}", us) for us, c in timed]}
    log(f"{name:8s} selected {t_sel:6.2f} us ({W.describe(tc)}, {byt / t_sel / 1e6:.2f} TB/s) | tma best "
        + ", ".join(f"{c.block_n // c.num_warps}x{c.num_warps} {us:6.2f} ({byt / us / 1e6:.2f} TB/s)"
                    for us, c in timed[:4]))

# ------------------------------------------------------------------ the 128 linears as one graph
layers = [{nm: random_packed(n, k, G, 1000 * i + j) for j, (nm, (n, k)) in enumerate(SHAPES.items())}
          for i in range(32)]
total = sum(n * k / 2 + n * k / G * 3 for (n, k) in SHAPES.values()) * 32
xs = {nm: torch.randn(1, k, device=dev, dtype=torch.float16) for nm, (n, k) in SHAPES.items()}
ys = {nm: torch.empty(1, n, device=dev, dtype=torch.float16) for nm, (n, k) in SHAPES.items()}


def call(nm, L, use_tma):
    if use_tma:
        c = best[nm][1]
        return lambda: run_tma(xs[nm], L[nm], c, ys[nm])
    c = sel[nm][1]
    return lambda: W.launch(xs[nm], L[nm], G, c, out=ys[nm])


mixed = {nm: best[nm][0] < sel[nm][0] for nm in SHAPES}
for label, pick in (("selected", lambda nm: False), ("tma", lambda nm: True), ("faster of the two", mixed.get)):
    fns = [call(nm, L, pick(nm)) for L in layers for nm in SHAPES]
    res["chain_ms"][label] = [time_graph(fns), time_graph(fns)]
for label, v in res["chain_ms"].items():
    log(f"128 linears, {label}: {min(v):.3f} / {max(v):.3f} ms ({total / min(v) / 1e9:.2f} TB/s)")
res["mixed"] = mixed
json.dump(res, open(os.path.join(OUT, "gemv_tma.json"), "w"), indent=1)
log("done")
