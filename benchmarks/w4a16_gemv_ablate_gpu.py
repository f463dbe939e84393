"""Which part of the batch-1 CUDA GEMV holds it below its loads' ceiling?

Session 11 measured the GEMV at ~2.2 TB/s a linear against ~4.2 TB/s for a kernel with the same weight loads
that only XORs them (`w4a16_stream_ceiling_gpu.py`), and a tensor-core GEMV with a third fewer instructions
tied; session 27's ring GEMV (more bytes in flight) was slower. What was never measured is the GEMV itself with
one part taken out at a time. This builds `w4a16_mma.cu` with W4A16_GEMV_ABLATE (bits: 1 x not loaded, 2 scales
and zero points not loaded, 4 no dequantize or multiply, 8 the first batch loaded after the PDL wait, 64 zero
points not loaded), W4A16_NIBBLE_MASK_IMMEDIATE (the shipped arithmetic with its masks as immediates, as compiled
before session 52: the same outputs, checked equal) or W4A16_GEMV_SCALE_PER_RUN=0 (the arithmetic before session 29:
each weight dequantized before its product, whose error against the fp32 reference is printed beside the shipped
one's), and times each build at the configs the
decode step runs (gate_up plain, by the CUDA GEMV's rule or table):
- per linear: a CUDA graph of 8 PDL launches over distinct weights, median of 15 replays, µs a call;
- the step's 128 linears (32 layers) as one graph with PDL, ms.
Registers per thread of each build are read from the loaded function. The outputs of the build with nothing
left out are checked equal to the shipped kernel's (the ablated builds compute something else by design).

    OUT=results python benchmarks/w4a16_gemv_ablate_gpu.py     # -> $OUT/gemv_ablate.json
    python benchmarks/w4a16_gemv_ablate_gpu.py --compile-only   # NVRTC + cuobjdump: registers, no GPU needed
"""
import argparse
import ctypes
import json
import os
import subprocess
import sys
import tempfile

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vlmctl.runtime.kernels import cuda_rtc
from vlmctl.runtime.kernels import w4a16 as W

SH = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
G = 128
# (name, ablate bits, each weight dequantized first: the arithmetic before session 29); "masks as immediates" is
# the shipped GEMV as compiled before session 52 (W4A16_NIBBLE_MASK_IMMEDIATE: the same arithmetic, more instructions)
BUILDS = [("shipped", 0, False), ("dequant each", 0, True), ("no x", 1, False), ("no s/z", 2, False),
          ("no x, s/z", 3, False), ("no math", 4, False), ("loads only", 7, False), ("weights after wait", 8, False),
          ("one s/z load", 64, False), ("masks as immediates", 0, "masks")]
# the H200 table's batch-1 configs (qkv, o, down) and the rule's, which gate_up takes plain
H200_CONFIGS = [(32, 4, 1), (8, 2, 2), (32, 8, 2)]


def source(bits: int, variant) -> str:
    """variant: True the arithmetic before session 29, "masks" the nibble masks as immediates"""
    return (f"#define W4A16_GEMV_ABLATE {bits}\n" + ("#define W4A16_GEMV_SCALE_PER_RUN 0\n" if variant is True else "")
            + ("#define W4A16_NIBBLE_MASK_IMMEDIATE\n" if variant == "masks" else "") + W.mma_source())


def registers_offline(configs) -> dict:
    """{(build, kernel name): registers} from the sm_90 cubins, through Triton's bundled cuobjdump."""
    import triton

    cuobj = os.path.join(os.path.dirname(triton.__file__), "backends", "nvidia", "bin", "cuobjdump")
    names = sorted({W.gemv_cuda_kernel_name(c, G) for c in configs})
    out = {}
    for build, bits, each in BUILDS:
        cubin, lowered = cuda_rtc.compile_cubin(source(bits, each), names, "sm_90")
        with tempfile.NamedTemporaryFile("wb", suffix=".cubin") as f:
            f.write(cubin)
            f.flush()
            lines = subprocess.run([cuobj, "-res-usage", f.name], capture_output=True, text=True,
                                   check=True).stdout.splitlines()
        for name in names:
            for i, line in enumerate(lines):
                if lowered[name] in line:
                    fields = dict(kv.split(":") for kv in lines[i + 1].split() if ":" in kv)
                    out[(build, name)] = (int(fields["REG"]), int(fields["LOCAL"]))
    return out


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--compile-only", action="store_true")
    ap.add_argument("--builds", nargs="+", default=[b[0] for b in BUILDS], choices=[b[0] for b in BUILDS])
    ap.add_argument("--repeats", type=int, default=2, help="chain timings, interleaved (their spread is the noise)")
    args = ap.parse_args()
    if args.compile_only:
        configs = [W.Config("gemv_cuda", block_n=a, num_warps=b, num_stages=c) for a, b, c in H200_CONFIGS]
        configs += [W.heuristic_gemv_cuda_config(n, k, G) for n, k in SH.values()]
        for (build, name), (regs, local) in registers_offline(configs).items():
            print(f"{build:20s} {name:32s} {regs:4d} registers, {local} B local")
        return

    import torch
    from gpu_timing import graph_median_ms
    from gpu_weights import random_packed

    dev = torch.device("cuda")
    out_dir = os.environ.get("OUT", "/tmp")
    builds = [b for b in BUILDS if b[0] in args.builds]
    sel = {nm: W.select_config(1, n, k, G, torch.float16, dev) for nm, (n, k) in SH.items()}
    cfg = {nm: c if c.kernel == "gemv_cuda" else W.heuristic_gemv_cuda_config(*SH[nm], G) for nm, c in sel.items()}
    print("configs:", {nm: W.describe(c) for nm, c in cfg.items()}, flush=True)

    def kernel(build, nm):
        _, bits, each = build
        return cuda_rtc.load_kernel(source(bits, each), W.gemv_cuda_kernel_name(cfg[nm], G), dev)

    def launch(build, nm, p, x, y):
        c = cfg[nm]
        n, k = p["q4weight"].shape[0], x.shape[1]
        kernel(build, nm).launch((W.triton_cdiv(n, c.block_n), 1, 1), (32 * c.num_warps, 1, 1), 0,
                                 [x, p["q4weight"], p["q4scales"], p["q4zeros"], None, y, n, k, x.stride(0), 0],
                                 dev, pdl=True)

    drv = cuda_rtc._driver()
    res = {"device": torch.cuda.get_device_name(dev), "configs": {nm: W.describe(c) for nm, c in cfg.items()},
           "registers": {}, "per_call_us": {}, "chain_ms": {}}
    for build in builds:
        for nm in SH:
            regs = ctypes.c_int()
            cuda_rtc._check_cuda(drv.cuFuncGetAttribute(ctypes.byref(regs), 4, kernel(build, nm).func), "registers")
            res["registers"][f"{build[0]} / {nm}"] = regs.value

    # the build with nothing left out computes what the shipped kernel computes; both arithmetics' error
    res["rel_err"] = {}
    for nm, (n, k) in SH.items():
        p = random_packed(n, k, G, 7, dev)
        x = torch.randn(1, k, device=dev, dtype=torch.float16)
        ref = x.float() @ W.dequantize(p, G, torch.float32).T
        y0 = torch.empty(1, n, device=dev, dtype=torch.float16)
        y1 = torch.empty_like(y0)
        W.launch(x, p, G, cfg[nm], out=y0)
        launch(BUILDS[0], nm, p, x, y1)
        torch.cuda.synchronize()
        assert torch.equal(y0, y1), nm
        launch(BUILDS[-1], nm, p, x, y1)  # the masks as immediates: the same arithmetic
        torch.cuda.synchronize()
        assert torch.equal(y0, y1), nm
        for build in BUILDS[:2]:
            launch(build, nm, p, x, y1)
            err = float((y1.float() - ref).norm() / ref.norm())
            res["rel_err"][f"{build[0]} / {nm}"] = err
            print(f"{nm:8s} {build[0]:20s} relative error against the fp32 reference {err:.2e}", flush=True)

    nws = 8
    for nm, (n, k) in SH.items():
        ps = [random_packed(n, k, G, n + i, dev) for i in range(nws)]
        x = torch.randn(1, k, device=dev, dtype=torch.float16)
        y = torch.empty(1, n, device=dev, dtype=torch.float16)
        byt = n * k / 2 + n * k / G * 3
        for build in builds:
            t = graph_median_ms([lambda p=p, b=build: launch(b, nm, p, x, y) for p in ps]) * 1e3 / nws
            res["per_call_us"][f"{build[0]} / {nm}"] = t
            print(f"{nm:8s} {build[0]:20s} {t:7.2f} us ({byt / t / 1e6:.2f} TB/s), "
                  f"{res['registers'][build[0] + ' / ' + nm]} registers", flush=True)
        del ps

    layers = [{nm: random_packed(n, k, G, 1000 * i + j, dev) for j, (nm, (n, k)) in enumerate(SH.items())}
              for i in range(32)]
    xs = {nm: torch.randn(1, k, device=dev, dtype=torch.float16) for nm, (n, k) in SH.items()}
    ys = {nm: torch.empty(1, n, device=dev, dtype=torch.float16) for nm, (n, k) in SH.items()}
    int4 = sum(n * k / 2 + n * k / G * 3 for n, k in SH.values()) * 32
    selected = [lambda L=L, nm=nm: W.launch(xs[nm], L[nm], G, sel[nm], out=ys[nm]) for L in layers for nm in SH]
    for rep in range(args.repeats):
        t = graph_median_ms(selected)
        res["chain_ms"].setdefault("selection (gate_up as selected)", []).append(t)
        print(f"rep {rep} {'selection':20s} {t:.3f} ms ({int4 / t / 1e9:.2f} TB/s)", flush=True)
        for build in builds:
            t = graph_median_ms([lambda L=L, nm=nm, b=build: launch(b, nm, L[nm], xs[nm], ys[nm])
                                 for L in layers for nm in SH])
            res["chain_ms"].setdefault(build[0], []).append(t)
            print(f"rep {rep} {build[0]:20s} {t:.3f} ms ({int4 / t / 1e9:.2f} TB/s)", flush=True)
    with open(os.path.join(out_dir, "gemv_ablate.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
