"""Does DRAM idle between the dependent batch-1 GEMVs of a decode step, and does asking L2 for the next
linear's weights from the current kernel fill that gap?

A 7B AWQ decoder's 128 batch-1 linears (qkv, o, gate_up, down x 32 layers), each the CUDA GEMV launched
with PDL (so each waits for the one before it, as in the step), as one CUDA graph, median of 15 replays:
- "selected": what `w4a16.select_config` picks (the Triton GEMV with act.mul keeps gate_up in the step; here
  plain), through `w4a16.launch`;
- "cuda": the CUDA GEMV on all four (gate_up by its rule), through `w4a16.launch`;
- "next W/P": the CUDA GEMV built with W4A16_GEMV_L2_NEXT, each kernel issuing cp.async.bulk.prefetch.L2 for
  the first P bytes of every row of the NEXT linear's packed weights, before its PDL wait (W = 1) or after
  its main loop (W = 2); W = 0 is that build with the prefetch off (its cost alone).
Outputs of the prefetching build are checked equal to the shipped kernel's. Session 11 measured the chain's
floor at 0.72-0.98 ms with read-only kernels, against 1.50 ms for the GEMVs (docs/benchmarks.md).

    OUT=results python benchmarks/w4a16_gemv_chain_gpu.py     # -> $OUT/gemv_chain.json
    python benchmarks/w4a16_gemv_chain_gpu.py --compile-only   # NVRTC only, no GPU needed
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from vlmctl.runtime.kernels import cuda_rtc
from vlmctl.runtime.kernels import w4a16 as W

SRC = "#define W4A16_GEMV_L2_NEXT 1\n" + W.mma_source()
SH = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
G = 128

if "--compile-only" in sys.argv:
    # the rule's configs and the H200 table's (qkv, o, down)
    cfgs = [W.heuristic_gemv_cuda_config(n, k, G) for n, k in SH.values()] + [
        W.Config("gemv_cuda", block_n=bn, num_warps=w, num_stages=ks) for bn, w, ks in ((32, 4, 1), (8, 2, 2), (32, 8, 2))]
    names = [W.gemv_cuda_kernel_name(c, G) for c in cfgs]
    cubin, lowered = cuda_rtc.compile_cubin(SRC, names, "sm_90")
    print("compiled", len(cubin), "bytes,", len(lowered), "kernels:", ", ".join(sorted(set(names))))
    sys.exit()

from gpu_timing import graph_median_ms
from gpu_weights import random_packed

dev = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
layers = [{nm: random_packed(n, k, G, 1000 * i + j, dev) for j, (nm, (n, k)) in enumerate(SH.items())}
          for i in range(32)]
xs = {nm: torch.randn(1, k, device=dev, dtype=torch.float16) for nm, (n, k) in SH.items()}
ys = {nm: torch.empty(1, n, device=dev, dtype=torch.float16) for nm, (n, k) in SH.items()}
sel = {nm: W.select_config(1, n, k, G, torch.float16, dev) for nm, (n, k) in SH.items()}
cud = {nm: c if c.kernel == "gemv_cuda" else W.heuristic_gemv_cuda_config(*SH[nm], G) for nm, c in sel.items()}
chain = [(L, nm) for L in layers for nm in SH]
int4 = sum(n * k / 2 + n * k / G * 3 for n, k in SH.values()) * 32


def probe_launch(i, pre, when):
    L, nm = chain[i]
    Ln, nmn = chain[(i + 1) % len(chain)]
    p, c, x, y = L[nm], cud[nm], xs[nm], ys[nm]
    qn = Ln[nmn]["q4weight"]
    row_bytes = qn.shape[1] * 4
    kern = cuda_rtc.load_kernel(SRC, W.gemv_cuda_kernel_name(c, G), dev)
    n, k = p["q4weight"].shape[0], x.shape[1]
    kern.launch((W.triton_cdiv(n, c.block_n), 1, 1), (32 * c.num_warps, 1, 1), 0,
                [x, p["q4weight"], p["q4scales"], p["q4zeros"], None, y, n, k, x.stride(0), 0,
                 qn, qn.shape[0], row_bytes, min(pre, row_bytes), when], dev, pdl=True)


res = {"configs": {nm: [W.describe(sel[nm]), W.describe(cud[nm])] for nm in SH}, "int4_bytes": int4, "chain_ms": {}}
print("selected:", res["configs"], flush=True)
# the prefetching build computes what the shipped kernel computes
for nm in SH:
    probe_launch(list(SH).index(nm), 1024, 2)
    got = ys[nm].clone()
    W.launch(xs[nm], layers[0][nm], G, cud[nm], out=ys[nm])
    torch.cuda.synchronize()
    assert torch.equal(got, ys[nm]), nm
cases = {"selected": [lambda L=L, nm=nm: W.launch(xs[nm], L[nm], G, sel[nm], out=ys[nm]) for L, nm in chain],
         "cuda": [lambda L=L, nm=nm: W.launch(xs[nm], L[nm], G, cud[nm], out=ys[nm]) for L, nm in chain],
         "next 0": [lambda i=i: probe_launch(i, 16, 0) for i in range(len(chain))]}
for when in (1, 2):
    for pre in (256, 512, 1024, 2048, 4096):
        cases[f"next {when}/{pre}"] = [lambda i=i, pre=pre, when=when: probe_launch(i, pre, when)
                                       for i in range(len(chain))]
for rep in range(2):  # twice, interleaved: the spread between repeats is the noise
    for name, fns in cases.items():
        t = graph_median_ms(fns)
        res["chain_ms"].setdefault(name, []).append(t)
        print(f"rep {rep} {name:14s} {t:.3f} ms ({int4 / t / 1e9:.2f} TB/s)", flush=True)
json.dump(res, open(os.path.join(OUT, "gemv_chain.json"), "w"), indent=1)
