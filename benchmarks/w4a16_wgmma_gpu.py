"""The Hopper "wgmma" W4A16 kernel (runtime/kernels/w4a16_wgmma.cu) on one sm_90 GPU: correctness, configs,
step graph.

    OUT=results python benchmarks/w4a16_wgmma_gpu.py [--quick]

1. correctness: shapes with odd N, K = 128 .. 11008, groups 64 / 128 / 256, one tile split over 86 blocks,
   x M in 1 .. 64 x bias x configs x fp16 / bf16, against x @ dequantize(W)^T in fp32 (relative Frobenius
   error; fp16 tolerance 2e-3, bf16 8e-3); each launch twice (bit-identical: the stream-K parts are added in
   block order); one CUDA-graph replay against the eager result.
2. per call at M = 32 and 64 for the LLaVA-1.5-7B decoder's four linears: every wgmma config (CUDA graphs of
   8 launches over distinct weights, so L2 does not keep them; median of 15 replays), against what selection
   takes with the kernel off (`VLMCTL_W4A16_WGMMA=0`: the shipped table) and cuBLAS on the dense fp16 weight.
3. step graph: 32 layers x 4 linears with distinct weights replayed as one CUDA graph, at M = 32, 48 and 64:
   the default wgmma config, the best per shape, the shipped table without the kernel, cuBLAS dense.
Writes $OUT/wgmma_exp.json.
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from gpu_timing import graph_median_ms as time_graph  # noqa: E402
from gpu_weights import random_packed  # noqa: E402
from vlmctl.runtime.kernels import cuda_rtc  # noqa: E402
from vlmctl.runtime.kernels import w4a16 as W  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
QUICK = "--quick" in sys.argv
dev = torch.device("cuda")
res = {"correct": [], "sweep": {}, "step": {}}
T0 = time.perf_counter()
os.environ.setdefault("VLMCTL_CACHE_DIR", "/var/tmp/vlmctl-cache")
os.environ["VLMCTL_W4A16_WGMMA"] = "1"  # selection may take the kernel (the "shipped" peer turns it off)


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def cfg(nwg, bm, stages):
    return W.Config("wgmma", block_n=64 * nwg, block_k=128, block_m=bm, split_k=1, num_warps=4 * nwg,
                    num_stages=stages)


def configs(m):
    out = []
    for bm in (32, 64):
        if m > bm:
            continue
        for nwg in (2, 4):
            for st in range(5, 9):
                c = cfg(nwg, bm, st)
                if c.valid_for(4096, 4096, 128) and not (QUICK and st not in (5, 6, 8)):
                    out.append(c)
    return out


def with_env(var, value, fn):
    old = os.environ.get(var)
    os.environ[var] = value
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop(var)
        else:
            os.environ[var] = old


def precompile(cfgs, groups, dtypes):
    t = time.perf_counter()
    names = sorted({W.wgmma_kernel_name(c, g, d) for c in cfgs for g in groups for d in dtypes})
    n = cuda_rtc.precompile(W.wgmma_source(W.wgmma_build_defines()), names, "sm_90a")  # the build W.launch runs
    log(f"compiled {n} kernels in {time.perf_counter() - t:.1f}s")


log("nvrtc", cuda_rtc.nvrtc_version(), torch.__version__, torch.cuda.get_device_name(),
    torch.cuda.get_device_capability())
if torch.cuda.get_device_capability() != (9, 0):
    sys.exit("the wgmma kernel runs on sm_90 only")

# ------------------------------------------------------------------ correctness
cases = [(4096, 4096, 128), (12288, 4096, 128), (4096, 11008, 128), (200, 384, 64), (72, 128, 128),
         (4096, 4096, 64), (1000, 1280, 256), (256, 11008, 128)]
ms = [1, 7, 17, 32, 33, 48, 64]
corr_cfgs = [cfg(4, 64, 6), cfg(2, 64, 5), cfg(4, 64, 5), cfg(4, 32, 8), cfg(2, 32, 7)]
precompile(corr_cfgs + [W.heuristic_wgmma_config(m) for m in (32, 64)], (64, 128, 256),
           (torch.float16, torch.bfloat16))
worst = {torch.float16: 0.0, torch.bfloat16: 0.0}
bad = 0
for dt in (torch.float16, torch.bfloat16):
    tol = 2e-3 if dt == torch.float16 else 8e-3
    for (n, k, g) in cases:
        p = random_packed(n, k, g, n + k)
        wdq = W.dequantize(p, g, dt).float()
        for m in ms:
            x = torch.randn(m, k, device=dev, dtype=dt)
            for bias in (None, torch.randn(n, device=dev, dtype=dt)):
                ref = x.float() @ wdq.t() + (0 if bias is None else bias.float())
                for c in corr_cfgs:
                    if m > c.block_m or not c.valid_for(n, k, g):
                        continue
                    y = W.launch(x, p, g, c, bias).float()
                    y2 = W.launch(x, p, g, c, bias).float()
                    e = float((y - ref).norm() / ref.norm())
                    mx = float((y - ref).abs().max() / ref.abs().max())
                    det = bool(torch.equal(y, y2))
                    worst[dt] = max(worst[dt], e)
                    if e > tol or not det or not torch.isfinite(y).all():
                        bad += 1
                        log(f"BAD {dt} n{n} k{k} g{g} m{m} bias{bias is not None} {W.describe(c)}: rel {e:.2e} "
                            f"max {mx:.2e} det {det}")
                    res["correct"].append(dict(dtype=str(dt), n=n, k=k, g=g, m=m, bias=bias is not None,
                                               cfg=W.describe(c), rel=e, maxrel=mx, det=det))
log(f"correctness: {len(res['correct'])} cases, {bad} bad, worst rel err fp16 {worst[torch.float16]:.2e}, "
    f"bf16 {worst[torch.bfloat16]:.2e}")
res["bad"] = bad

# selection takes the kernel at 17-64 rows
sel = {m: W.describe(W.select_config(m, 12288, 4096, 128, torch.float16, dev)) for m in (16, 17, 32, 48, 64, 65)}
log("selection:", sel)
res["selection"] = sel

# graph capture of one launch against the eager result
p = random_packed(4096, 4096, 128, 1)
x = torch.randn(64, 4096, device=dev, dtype=torch.float16)
c = W.heuristic_wgmma_config(64)
yref = W.launch(x, p, 128, c)
yg = torch.empty_like(yref)
time_graph([lambda: W.launch(x, p, 128, c, out=yg)], replays=3)  # eager once, then captured and replayed
torch.cuda.synchronize()
res["graph_equal"] = bool(torch.equal(yg, yref))
log("graph replay equal:", res["graph_equal"])

# ------------------------------------------------------------------ per call
SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
MS = [32, 64]
NW = 8
best = {}
precompile([c for m in MS for c in configs(m)], (128,), (torch.float16,))
for name, (n, k) in SHAPES.items():
    ps = [random_packed(n, k, 128, n + i) for i in range(NW)]
    wds = [W.dequantize(p, 128, torch.float16) for p in ps]
    for m in MS:
        x = torch.randn(m, k, device=dev, dtype=torch.float16)
        y = torch.empty(m, n, device=dev, dtype=torch.float16)

        def per_call(c):
            return time_graph([lambda p=p: W.launch(x, p, 128, c, out=y) for p in ps]) * 1e3 / NW

        shipped = with_env("VLMCTL_W4A16_WGMMA", "0", lambda: W.select_config(m, n, k, 128, torch.float16, dev))
        t_ship = per_call(shipped)
        t_cub = time_graph([lambda wd=wd: torch.mm(x, wd.t(), out=y) for wd in wds]) * 1e3 / NW
        timed = []
        for c in configs(m):
            try:
                timed.append((per_call(c), c))
            except Exception as e:
                log("fail", W.describe(c), str(e)[:200])
        timed.sort(key=lambda t: t[0])
        best[(name, m)] = timed[0][1]
        t_def = next(t for t, c in timed if c == W.heuristic_wgmma_config(m))
        byt = n * k / 2 + n * k / 128 * 3
        res["sweep"][f"{name}_m{m}"] = dict(shipped=(W.describe(shipped), t_ship), cublas=t_cub, default=t_def,
                                           top=[(W.describe(c), t) for t, c in timed[:6]])
        log(f"{name:8s} m{m:3d}: wgmma best {timed[0][0]:6.1f} us ({byt / timed[0][0] / 1e6:.2f} TB/s int4) "
            f"{W.describe(timed[0][1])} | default {t_def:6.1f} | shipped {t_ship:6.1f} ({W.describe(shipped)}) "
            f"| cublas {t_cub:6.1f}")

# ------------------------------------------------------------------ step graph (32 layers x 4 linears)
layers = [{nm: random_packed(n, k, 128, 1000 * i + j) for j, (nm, (n, k)) in enumerate(SHAPES.items())}
          for i in range(32)]
dense = [{nm: torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02 for nm, (n, k) in SHAPES.items()}
         for _ in range(32)]
for m in (32, 48, 64):
    xs = {nm: torch.randn(m, k, device=dev, dtype=torch.float16) for nm, (n, k) in SHAPES.items()}
    ys = {nm: torch.empty(m, n, device=dev, dtype=torch.float16) for nm, (n, k) in SHAPES.items()}
    fd, fb, fs, fc = [], [], [], []
    for L, D in zip(layers, dense):
        for nm, (n, k) in SHAPES.items():
            cd = W.heuristic_wgmma_config(m)
            cb = best.get((nm, 64 if m > 32 else 32), cd)
            cs = with_env("VLMCTL_W4A16_WGMMA", "0", lambda n=n, k=k: W.select_config(m, n, k, 128, torch.float16, dev))
            fd.append(lambda L=L, nm=nm, c=cd: W.launch(xs[nm], L[nm], 128, c, out=ys[nm]))
            fb.append(lambda L=L, nm=nm, c=cb: W.launch(xs[nm], L[nm], 128, c, out=ys[nm]))
            fs.append(lambda L=L, nm=nm, c=cs: W.launch(xs[nm], L[nm], 128, c, out=ys[nm]))
            fc.append(lambda D=D, nm=nm: torch.mm(xs[nm], D[nm].t(), out=ys[nm]))
    t = dict(default=time_graph(fd), best=time_graph(fb), shipped=time_graph(fs), cublas=time_graph(fc))
    res["step"][m] = t
    log(f"step graph m{m}: wgmma default {t['default']:.3f} ms, best per shape {t['best']:.3f}, "
        f"shipped without wgmma {t['shipped']:.3f}, cuBLAS fp16 dense {t['cublas']:.3f}")

json.dump(res, open(os.path.join(OUT, "wgmma_exp.json"), "w"), indent=1)
log("done")
