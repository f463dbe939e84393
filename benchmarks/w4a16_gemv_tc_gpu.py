"""The tensor-core batch-1 GEMV (gemv_tc, opt-in) on one GPU: correctness against the fp32 reference
(odd N, groups 32-128, M 1 and 3, bias; the shipped kernels' error beside it), a graph replay, per-call
timings of its configs against what selection picks (CUDA graphs of 8 launches over distinct weights),
and a LLaVA-1.5-7B decoder's 128 linears as one graph.

    OUT=results python benchmarks/w4a16_gemv_tc_gpu.py     # -> $OUT/gemv_tc.json
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from gpu_timing import graph_median_ms
from gpu_weights import random_packed
from vlmctl.runtime.kernels import w4a16 as W

dev = torch.device("cuda"); DT = torch.float16; OUT = os.environ.get("OUT", "/tmp")
res = {"correct": [], "per_call": {}, "step": {}}
TC = lambda kw, pf=2: W.Config("gemv_tc", block_n=16, num_warps=kw, num_stages=pf)
worst = 0.0; bad = 0
for n, k, g in [(12288, 4096, 128), (4096, 11008, 128), (4100, 4096, 128), (1000, 2112, 64), (577, 1536, 64),
                (4096, 4096, 128), (300, 1024, 32)]:
    p = random_packed(n, k, g, n + k, dev)
    wref = W.dequantize(p, g).float()
    for m in (1, 3):
        x = (torch.randn(m, k, device=dev) * 2).to(DT)
        for bias in (None, (torch.randn(n, device=dev) * 0.1).to(DT)):
            ref = x.float() @ wref.t() + (bias.float() if bias is not None else 0)
            ship = W.launch(x, p, g, W.select_config(1, n, k, g, DT, dev) if m == 1 else W.Config("gemv_cuda", 16, num_warps=4, num_stages=2), bias)
            e_ship = float((ship.float() - ref).norm() / ref.norm())
            for kw, pf in ((1, 1), (4, 2), (8, 4), (16, 2), (16, 4)):
                c = TC(kw, pf)
                if not c.valid_for(n, k, g):
                    continue
                y = W.launch(x, p, g, c, bias); y2 = W.launch(x, p, g, c, bias)
                e = float((y.float() - ref).norm() / ref.norm()); det = bool(torch.equal(y, y2))
                worst = max(worst, e)
                if e > 2e-3 or not det or not torch.isfinite(y).all():
                    bad += 1; print("BAD", n, k, g, m, bias is not None, kw, e, det, flush=True)
                res["correct"].append(dict(n=n, k=k, g=g, m=m, bias=bias is not None, kw=kw, rel=e, det=det, shipped_rel=e_ship))
    del p, wref
print(f"correctness: {len(res['correct'])} cases, worst rel {worst:.2e} (shipped kernels on the same inputs: worst "
      f"{max(r['shipped_rel'] for r in res['correct']):.2e}), bad {bad}", flush=True)
# graph replay equals eager
p = random_packed(4096, 4096, 128, 7, dev); x = torch.randn(1, 4096, device=dev, dtype=DT)
ye = W.launch(x, p, 128, TC(4)); gr = torch.cuda.CUDAGraph(); yg = torch.empty_like(ye)
s = torch.cuda.Stream(); s.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(s): W.launch(x, p, 128, TC(4), out=yg)
torch.cuda.current_stream().wait_stream(s)
with torch.cuda.graph(gr): W.launch(x, p, 128, TC(4), out=yg)
gr.replay(); torch.cuda.synchronize(); print("graph equal:", bool(torch.equal(ye, yg)), flush=True)

SH = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
best = {}
for name, (n, k) in SH.items():
    ps = [random_packed(n, k, 128, n + i, dev) for i in range(8)]
    x = torch.randn(1, k, device=dev, dtype=DT); y = torch.empty(1, n, device=dev, dtype=DT)
    pc = lambda c: graph_median_ms([lambda p=p: W.launch(x, p, 128, c, out=y) for p in ps]) * 1e3 / 8
    ship = W.select_config(1, n, k, 128, DT, dev); t_ship = pc(ship)
    rows = sorted((pc(TC(kw, pf)), (kw, pf)) for kw in (4, 8, 16) for pf in (1, 2, 4))
    best[name] = rows[0][1]
    byt = n * k / 2 + n * k / 128 * 3
    res["per_call"][name] = dict(shipped=(W.describe(ship), t_ship), tc=rows)
    print(f"{name:8s} shipped {W.describe(ship):28s} {t_ship:6.2f} us | tc " +
          " ".join(f"w{kw[0]}s{kw[1]}:{t:.2f}" for t, kw in rows) + f" | best {byt / rows[0][0] / 1e6:.2f} TB/s", flush=True)
    del ps
layers = [{nm: random_packed(n, k, 128, 1000 * i + j, dev) for j, (nm, (n, k)) in enumerate(SH.items())} for i in range(32)]
xs = {nm: torch.randn(1, k, device=dev, dtype=DT) for nm, (n, k) in SH.items()}
ys = {nm: torch.empty(1, n, device=dev, dtype=DT) for nm, (n, k) in SH.items()}
ship = {nm: W.select_config(1, n, k, 128, DT, dev) for nm, (n, k) in SH.items()}
step = lambda pick: graph_median_ms([lambda L=L, nm=nm: W.launch(xs[nm], L[nm], 128, pick(nm), out=ys[nm]) for L in layers for nm in SH])
res["step"] = dict(shipped=step(lambda nm: ship[nm]), tc_best=step(lambda nm: TC(*best[nm])), tc_rule=step(lambda nm: W.heuristic_gemv_tc_config(*SH[nm], 128)),
                   tc_but_gate_up=step(lambda nm: ship[nm] if nm == "gate_up" else TC(*best[nm])))
print("step graph (128 linears, ms):", {k: round(v, 3) for k, v in res["step"].items()}, flush=True)
json.dump(res, open(os.path.join(OUT, "gemv_tc.json"), "w"), indent=1)
