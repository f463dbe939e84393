"""The batch-1 CUDA GEMV against its shared-memory ring variant (`VLMCTL_W4A16_GEMV_RING`, session 25).

A 7B AWQ decoder's 128 batch-1 linears (qkv, o, gate_up, down x 32 layers), each the CUDA GEMV launched with PDL
(each waits for the one before, as in the step), as one CUDA graph, median of 15 replays, for ring depths 0 (the
register GEMV) and the given ones, twice, interleaved; and each linear alone, 8 launches over distinct weights.
Configs: the tuned table's (qkv, o, down on an H200), the CUDA GEMV's rule for gate_up. Each ring depth's outputs
are checked equal to the register GEMV's, bit for bit, the gate_up epilogue's (act·mul) too.
"step chain": the same 128 linears as the decode step calls them, gate_up through `w4a16_act_mul` (SiLU in the
epilogue): at depth 0 the shipped selection (the half2 Triton GEMV for gate_up), at depth N every linear on the
ring, gate_up included (session 26's epilogue).

    OUT=results python benchmarks/w4a16_gemv_ring_gpu.py --stages 2 3 4 6   # -> $OUT/gemv_ring.json
"""

from __future__ import annotations

import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))

SH = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
G = 128


def main() -> None:
    import torch

    from gpu_timing import graph_median_ms
    from gpu_weights import random_packed
    from vlmctl.runtime.kernels import w4a16 as W

    ap = argparse.ArgumentParser()
    ap.add_argument("--stages", type=int, nargs="+", default=[2, 3, 4, 6])
    args = ap.parse_args()
    dev = torch.device("cuda")
    layers = [{nm: random_packed(n, k, G, 1000 * i + j, dev) for j, (nm, (n, k)) in enumerate(SH.items())}
              for i in range(32)]
    xs = {nm: torch.randn(1, k, device=dev, dtype=torch.float16) for nm, (n, k) in SH.items()}
    ys = {nm: torch.empty(1, n, device=dev, dtype=torch.float16) for nm, (n, k) in SH.items()}
    cfg = {}
    for nm, (n, k) in SH.items():
        c = W.select_config(1, n, k, G, torch.float16, dev)
        cfg[nm] = c if c.kernel == "gemv_cuda" else W.heuristic_gemv_cuda_config(n, k, G)
    chain = [(L, nm) for L in layers for nm in SH]
    int4 = sum(n * k / 2 + n * k / G * 3 for n, k in SH.values()) * 32

    def set_stages(s: int) -> None:
        os.environ["VLMCTL_W4A16_GEMV_RING"] = str(s)

    res = {"configs": {nm: W.describe(c) for nm, c in cfg.items()}, "int4_bytes": int4, "chain_ms": {},
           "linear_us": {}, "device": torch.cuda.get_device_name()}
    print("configs:", res["configs"], flush=True)
    depths = [0] + list(args.stages)
    set_stages(0)
    want = {nm: W.launch(xs[nm], layers[0][nm], G, cfg[nm]) for nm in SH}
    want_act = W.launch(xs["gate_up"], layers[0]["gate_up"], G, cfg["gate_up"], act="silu")
    for s in args.stages:
        set_stages(s)
        for nm in SH:
            got = W.launch(xs[nm], layers[0][nm], G, cfg[nm])
            assert torch.equal(got, want[nm]), (s, nm)
        assert torch.equal(W.launch(xs["gate_up"], layers[0]["gate_up"], G, cfg["gate_up"], act="silu"), want_act)
    print("every ring depth's outputs equal the register GEMV's", flush=True)

    def step_call(L, nm):
        if nm == "gate_up":
            return lambda: W.w4a16_act_mul(xs[nm], L[nm], G, "silu")
        return lambda: W.w4a16_linear(xs[nm], L[nm], G)
    for rep in range(2):  # twice, interleaved: the spread between repeats is the noise
        for s in depths:
            set_stages(s)
            t = graph_median_ms([lambda L=L, nm=nm: W.launch(xs[nm], L[nm], G, cfg[nm], out=ys[nm]) for L, nm in chain])
            res["chain_ms"].setdefault(str(s), []).append(t)
            print(f"rep {rep} ring {s}: 128 linears {t:.3f} ms ({int4 / t / 1e9:.2f} TB/s)", flush=True)
            t = graph_median_ms([step_call(L, nm) for L, nm in chain])
            res.setdefault("step_chain_ms", {}).setdefault(str(s), []).append(t)
            print(f"rep {rep} ring {s}: step chain {t:.3f} ms ({int4 / t / 1e9:.2f} TB/s)", flush=True)
            for nm, (n, k) in SH.items():
                fns = [lambda L=L, nm=nm: W.launch(xs[nm], L[nm], G, cfg[nm], out=ys[nm]) for L in layers[:8]]
                us = graph_median_ms(fns) * 1e3 / 8
                res["linear_us"].setdefault(str(s), {}).setdefault(nm, []).append(us)
                print(f"   {nm:8s} {us:6.2f} us ({(n * k / 2 + n * k / G * 3) / us / 1e6:.2f} TB/s)", flush=True)
    set_stages(0)
    out = os.environ.get("OUT", "/tmp")
    with open(os.path.join(out, "gemv_ring.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
