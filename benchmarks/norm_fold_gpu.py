"""What folding the RMSNorms into the batch-1 GEMVs (`runtime/kernels/norm_fold.py`) costs and saves, outside the
decode step: a 7B AWQ decoder's 32 layers of linears without attention, as one CUDA graph each (median of 15
replays), every kernel launched with PDL as in the step:

- "norm kernels": add + RMSNorm (Triton) -> qkv GEMV; o GEMV -> add + RMSNorm -> gate_up GEMV (act·mul); down GEMV;
- "folded": qkv with the norm folded in (w4a16_gemv_norm); o adding into the residual (ADD); gate_up folded; down
  adding;
- "prepared (fold 2)": o and down also leave the next norm's input, qkv and gate_up scale their sums (no shared
  memory);
- "folded, carveout P": the same with every CUDA GEMV's preferred shared-memory carveout set to P % (the folded
  kernels hold 4 K bytes of shared memory a block, the plain ones none: an SM running one kind may have to drain
  before the other fits);
- alone: 32 calls of one kernel (qkv's plain GEMV, its folded one; o's plain, its adding one).

    OUT=results python benchmarks/norm_fold_gpu.py     # -> $OUT/norm_fold.json
"""
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
import torch

from gpu_timing import graph_median_ms
from gpu_weights import random_packed
from vlmctl.runtime.kernels import cuda_rtc, norm_fold
from vlmctl.runtime.kernels import w4a16 as W
from vlmctl.runtime.kernels.fused import add_rms_norm

SH = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
G = 128
CARVEOUT = 9  # CU_FUNC_ATTRIBUTE_PREFERRED_SHARED_MEMORY_CARVEOUT

dev = torch.device("cuda")
OUT = os.environ.get("OUT", "/tmp")
layers = [{nm: random_packed(n, k, G, 1000 * i + j, dev) for j, (nm, (n, k)) in enumerate(SH.items())}
          for i in range(32)]
H = 4096
nw = [(torch.rand(H, device=dev) + 0.5).half() for _ in range(64)]
acts = {nm: (None if nm != "gate_up" else "silu") for nm in SH}
cfg = {nm: norm_fold.fold_config(layers[0][nm], G, dev, acts[nm]) for nm in SH}
print("configs:", {nm: W.describe(c) if c else None for nm, c in cfg.items()}, flush=True)
residual = torch.randn(1, H, device=dev).half()
h_in = torch.randn(1, H, device=dev).half()
normed = torch.empty(1, H, device=dev, dtype=torch.float16)
qkv = torch.empty(1, SH["qkv"][0], device=dev, dtype=torch.float16)
attn = torch.randn(1, H, device=dev).half()
o_out = torch.empty(1, H, device=dev, dtype=torch.float16)
gu = torch.empty(1, SH["gate_up"][0] // 2, device=dev, dtype=torch.float16)
down_out = torch.empty(1, H, device=dev, dtype=torch.float16)


def with_norm_kernels():
    fns = []
    for i, L in enumerate(layers):
        fns += [lambda i=i: add_rms_norm(down_out, nw[2 * i], 1e-5, residual, out=normed),
                lambda L=L: W.launch(normed, L["qkv"], G, cfg["qkv"], out=qkv),
                lambda L=L: W.launch(attn, L["o"], G, cfg["o"], out=o_out),
                lambda i=i: add_rms_norm(o_out, nw[2 * i + 1], 1e-5, residual, out=normed),
                lambda L=L: W.launch(normed, L["gate_up"], G, cfg["gate_up"], out=gu, act="silu"),
                lambda L=L: W.launch(gu, L["down"], G, cfg["down"], out=down_out)]
    return fns


def folded():
    fns = []
    for i, L in enumerate(layers):
        fns += [lambda i=i, L=L: norm_fold.norm_linear(residual, L["qkv"], G, cfg["qkv"], nw[2 * i], 1e-5, out=qkv),
                lambda L=L: norm_fold.add_linear(attn, L["o"], G, cfg["o"], residual),
                lambda i=i, L=L: norm_fold.norm_linear(residual, L["gate_up"], G, cfg["gate_up"], nw[2 * i + 1], 1e-5,
                                                       act="silu", out=gu),
                lambda L=L: norm_fold.add_linear(gu, L["down"], G, cfg["down"], residual)]
    return fns


u = [torch.empty(1, H, device=dev, dtype=torch.float16) for _ in range(2)]
part = [torch.zeros(4096, device=dev) for _ in range(2)]


def prepared():
    """VLMCTL_NORM_FOLD=2: o and down leave the next norm's input; qkv and gate_up scale their sums"""
    cnt_o, cnt_d = norm_fold.partial_count(cfg["o"], H), norm_fold.partial_count(cfg["down"], H)
    fns = []
    for i, L in enumerate(layers):
        fns += [lambda L=L: norm_fold.scaled_linear(u[0], L["qkv"], G, cfg["qkv"], part[0], cnt_d, 1e-5, out=qkv),
                lambda i=i, L=L: norm_fold.add_prepare(attn, L["o"], G, cfg["o"], residual, nw[2 * i + 1], u[1],
                                                       part[1]),
                lambda L=L: norm_fold.scaled_linear(u[1], L["gate_up"], G, cfg["gate_up"], part[1], cnt_o, 1e-5,
                                                    act="silu", out=gu),
                lambda i=i, L=L: norm_fold.add_prepare(gu, L["down"], G, cfg["down"], residual, nw[2 * i], u[0],
                                                       part[0])]
    return fns


def set_carveout(pct):
    names = [W.gemv_cuda_kernel_name(cfg[nm], G, acts[nm]) for nm in SH]
    names += [norm_fold.norm_kernel_name(cfg[nm], G, acts[nm]) for nm in ("qkv", "gate_up")]
    names += [norm_fold.add_kernel_name(cfg[nm], G) for nm in ("o", "down")]
    names += [norm_fold.scaled_kernel_name(cfg[nm], G, acts[nm]) for nm in ("qkv", "gate_up")]
    names += [norm_fold.add_prepare_kernel_name(cfg[nm], G) for nm in ("o", "down")]
    for name in names:
        k = cuda_rtc.load_kernel(W.mma_source(), name, dev)
        r = cuda_rtc._driver().cuFuncSetAttribute(k.func, CARVEOUT, pct)
        assert r == 0, (name, r)


res = {"configs": {nm: W.describe(c) for nm, c in cfg.items()}, "ms": {}}
with torch.inference_mode():
    def t(name, fns):
        ms = [graph_median_ms(fns) for _ in range(2)]
        res["ms"][name] = ms
        print(f"{name:34s} " + " ".join(f"{m:.3f}" for m in ms), flush=True)

    for _ in range(2):
        t("norm kernels", with_norm_kernels())
        t("folded", folded())
        t("prepared (fold 2)", prepared())
    L0 = layers[0]
    t("alone: qkv plain x32", [lambda: W.launch(normed, L0["qkv"], G, cfg["qkv"], out=qkv)] * 32)
    t("alone: qkv folded x32", [lambda: norm_fold.norm_linear(residual, L0["qkv"], G, cfg["qkv"], nw[0], 1e-5,
                                                              out=qkv)] * 32)
    t("alone: o plain x32", [lambda: W.launch(attn, L0["o"], G, cfg["o"], out=o_out)] * 32)
    t("alone: o adding x32", [lambda: norm_fold.add_linear(attn, L0["o"], G, cfg["o"], residual)] * 32)
    t("alone: norm kernel x32", [lambda: add_rms_norm(o_out, nw[0], 1e-5, residual, out=normed)] * 32)
    for pct in (0, 25, 50, 100):
        set_carveout(pct)
        t(f"folded, carveout {pct}", folded())
        t(f"norm kernels, carveout {pct}", with_norm_kernels())
        t(f"prepared, carveout {pct}", prepared())
with open(os.path.join(OUT, "norm_fold.json"), "w") as f:
    json.dump(res, f, indent=1)
