"""How fast can a kernel shaped like the batch-1 W4A16 GEMV stream the int4 weights at all?

A read-only kernel with the CUDA GEMV's loads (a warp owns R weight rows, each lane reads 16 bytes of
a row per load, KS loads of each row in flight, weights not kept in L1) that XORs the words instead of
dequantizing and multiplying, against the GEMV that selection picks, per linear of a LLaVA-1.5-7B decoder
(CUDA graphs of 8 launches over distinct weights, median of 15 replays), a device-to-device copy of the
same bytes, and the step's 128 linears as one graph. If the read-only kernel is much faster than the
GEMV, the GEMV is bound by its instructions, not by memory (docs/benchmarks.md, session 11).

    OUT=results python benchmarks/w4a16_stream_ceiling_gpu.py     # -> $OUT/ceiling.json
    python benchmarks/w4a16_stream_ceiling_gpu.py --compile-only   # NVRTC only, no GPU needed
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch
from vlmctl.runtime.kernels import cuda_rtc
from vlmctl.runtime.kernels import w4a16 as W

SRC = r'''
typedef unsigned int u32;
struct alignas(16) u32x4 { u32 x, y, z, w; };
__device__ __forceinline__ u32x4 ld_stream16(const void* p) {
    u32x4 v;
    asm volatile("ld.global.nc.L1::no_allocate.v4.u32 {%0, %1, %2, %3}, [%4];"
                 : "=r"(v.x), "=r"(v.y), "=r"(v.z), "=r"(v.w) : "l"(p));
    return v;
}
template <int RPW, int NW, int KS>
__global__ void __launch_bounds__(NW * 32) readonly(const u32* __restrict__ qw, u32* __restrict__ y, int N, int K) {
    asm volatile("griddepcontrol.launch_dependents;");
    const int lane = threadIdx.x & 31;
    const int row0 = (blockIdx.x * NW + (threadIdx.x >> 5)) * RPW;
    const int KC = K >> 5;
    const u32* rows[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) rows[r] = qw + (size_t)min(row0 + r, N - 1) * (K >> 3);
    u32 acc[RPW];
#pragma unroll
    for (int r = 0; r < RPW; ++r) acc[r] = 0;
    for (int c0 = lane; c0 < KC; c0 += 32 * KS) {
        u32x4 w[KS][RPW];
#pragma unroll
        for (int u = 0; u < KS; ++u)
#pragma unroll
            for (int r = 0; r < RPW; ++r)
                if (c0 + 32 * u < KC) w[u][r] = ld_stream16(rows[r] + 4 * (c0 + 32 * u)); else w[u][r] = u32x4{0,0,0,0};
#pragma unroll
        for (int u = 0; u < KS; ++u)
#pragma unroll
            for (int r = 0; r < RPW; ++r) acc[r] ^= w[u][r].x ^ w[u][r].y ^ w[u][r].z ^ w[u][r].w;
    }
#pragma unroll
    for (int r = 0; r < RPW; ++r)
#pragma unroll
        for (int o = 16; o > 0; o >>= 1) acc[r] ^= __shfl_xor_sync(0xffffffffu, acc[r], o);
    if (lane == 0)
#pragma unroll
        for (int r = 0; r < RPW; ++r) if (row0 + r < N) y[row0 + r] = acc[r];
}
'''
CFGS = [(r, nw, ks) for r in (1, 2, 4) for nw in (4, 8) for ks in (2, 4, 8) if r * ks <= 16]
NAMES = [f"readonly<{r}, {nw}, {ks}>" for r, nw, ks in CFGS]

if "--compile-only" in sys.argv:
    cubin, lowered = cuda_rtc.compile_cubin(SRC, NAMES, "sm_90")
    print("compiled", len(cubin), "bytes,", len(lowered), "kernels")
    sys.exit()

from gpu_timing import graph_median_ms
from gpu_weights import random_packed
dev = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
SH = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
NWS = 8
res = {"per_call": {}, "step": {}}

def ro_launch(cfg, qw, y, pdl):
    r, nw, ks = cfg
    kern = cuda_rtc.load_kernel(SRC, f"readonly<{r}, {nw}, {ks}>", dev)
    n, kw = qw.shape
    kern.launch(((n + r * nw - 1) // (r * nw), 1, 1), (32 * nw, 1, 1), 0, [qw, y, n, kw * 8], dev, pdl=pdl)

best_ro = {}
for name, (n, k) in SH.items():
    ps = [random_packed(n, k, 128, n + i, dev) for i in range(NWS)]
    x = torch.randn(1, k, device=dev, dtype=torch.float16)
    y = torch.empty(1, n, device=dev, dtype=torch.float16)
    yi = torch.empty(n, device=dev, dtype=torch.int32)
    c = W.select_config(1, n, k, 128, torch.float16, dev)
    t_ship = graph_median_ms([lambda p=p: W.launch(x, p, 128, c, out=y) for p in ps]) * 1e3 / NWS
    rows = []
    for cfg in CFGS:
        for pdl in (False, True):
            t = graph_median_ms([lambda p=p: ro_launch(cfg, p["q4weight"], yi, pdl) for p in ps]) * 1e3 / NWS
            rows.append((t, cfg, pdl))
    rows.sort()
    byt = n * k / 2 + n * k / 128 * 3
    wbytes = n * k / 2
    cp = torch.empty(n * k // 8, device=dev, dtype=torch.int32)
    t_copy = graph_median_ms([lambda p=p: cp.copy_(p["q4weight"].view(-1)) for p in ps]) * 1e3 / NWS
    best_ro[name] = rows[0][1:]
    res["per_call"][name] = dict(shipped=(W.describe(c), t_ship), readonly_top=[(t, list(cf), pd) for t, cf, pd in rows[:6]],
                                 copy=t_copy)
    print(f"{name:8s} shipped {W.describe(c):28s} {t_ship:6.2f} us ({byt / t_ship / 1e6:.2f} TB/s) | "
          f"read-only best {rows[0][0]:6.2f} us {rows[0][1]} pdl={rows[0][2]} ({wbytes / rows[0][0] / 1e6:.2f} TB/s) | "
          f"D2D copy {t_copy:6.2f} us ({2 * wbytes / t_copy / 1e6:.2f} TB/s r+w)", flush=True)
    for t, cf, pd in rows[:6]:
        print(f"    {t:6.2f} {cf} pdl={pd}")
    del ps

layers = [{nm: random_packed(n, k, 128, 1000 * i + j, dev) for j, (nm, (n, k)) in enumerate(SH.items())} for i in range(32)]
xs = {nm: torch.randn(1, k, device=dev, dtype=torch.float16) for nm, (n, k) in SH.items()}
ys = {nm: torch.empty(1, n, device=dev, dtype=torch.float16) for nm, (n, k) in SH.items()}
yis = {nm: torch.empty(n, device=dev, dtype=torch.int32) for nm, (n, k) in SH.items()}
cfg = {nm: W.select_config(1, n, k, 128, torch.float16, dev) for nm, (n, k) in SH.items()}
int4 = sum(n * k / 2 + n * k / 128 * 3 for n, k in SH.values()) * 32
t_ship = graph_median_ms([lambda L=L, nm=nm: W.launch(xs[nm], L[nm], 128, cfg[nm], out=ys[nm]) for L in layers for nm in SH])
t_ro = graph_median_ms([lambda L=L, nm=nm: ro_launch(best_ro[nm][0], L[nm]["q4weight"], yis[nm], True) for L in layers for nm in SH])
t_ro_np = graph_median_ms([lambda L=L, nm=nm: ro_launch(best_ro[nm][0], L[nm]["q4weight"], yis[nm], False) for L in layers for nm in SH])
res["step"] = dict(shipped=t_ship, readonly_pdl=t_ro, readonly_nopdl=t_ro_np, int4_bytes=int4)
print(f"step graph 128 linears: shipped {t_ship:.3f} ms ({int4 / t_ship / 1e9:.2f} TB/s), read-only (PDL) {t_ro:.3f} ms, "
      f"read-only (no PDL) {t_ro_np:.3f} ms")
json.dump(res, open(os.path.join(OUT, "ceiling.json"), "w"), indent=1)
