"""W4A16 kernel choice at decoder shapes beyond the tuned table's (one GPU): does the untabled-shape
rule (`w4a16.heuristic_mma_config`, the "mma" kernel at 2-16 rows) pay off for other models?

For each model's four decoder linears (distinct random int4 weights per layer, group 128) and M in
1 2 4 8 16 32, one CUDA graph of a whole decoder's linears (all layers), median of 15 replays:
  before  what ran before the rule: the tuned table's config where it has the shape, else the Triton
          heuristic (`heuristic_config(..., mma=False)`)
  after   what `select_config` picks now (table, else the rules: at 2-16 rows the mma kernel, at 1 row
          the half2 GEMV's heuristic in fp16 and the GEMV's new block shape in bf16)
  cublas  cuBLAS on dense weights of the same shapes (the fp16/bf16 engine's linears)
  and candidate rules: at M = 1 in fp16 the fp32-unpack GEMV's (gemv_rule) and the half2 GEMV's (h2_rule),
  at M = 32 the mma rule with 32-row tiles (mma32_rule)
With --sweep, also per linear at M = 4 and 16 the best of a grid of mma configs (graphs of 4 launches
over distinct weights), to see how far the rule is from the best config it could have picked.

    OUT=results python benchmarks/w4a16_shapes_gpu.py [--dtypes float16 bfloat16] [--sweep]
Writes $OUT/w4a16_shapes.json.
"""
import argparse
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from gpu_timing import graph_median_ms as time_graph  # noqa: E402
from gpu_weights import random_packed  # noqa: E402
from vlmctl.runtime.kernels import w4a16 as W  # noqa: E402

# (N, K) of qkv, o, gate_up, down, and the layer count
MODELS = {
    "llava-1.5-7b (tabled)": ({"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096),
                               "down": (4096, 11008)}, 32),
    "qwen2-vl-7b": ({"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)}, 28),
    "llava-1.6-mistral-7b": ({"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096),
                              "down": (4096, 14336)}, 32),
    "llava-1.5-13b": ({"qkv": (15360, 5120), "o": (5120, 5120), "gate_up": (27648, 5120), "down": (5120, 13824)}, 40),
}
G = 128
T0 = time.perf_counter()


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def before_config(m, n, k, dt, dev):
    """The selection before the untabled-shape rules (commit d0a09d1): the table, else the Triton
    heuristics; at batch 1 the fp32-unpack GEMV in 128-row, 64-wide K blocks with ~8 programs per SM."""
    key = (W._device_name(dev), W.bucket(m), n, k, G, W._dtype_name(dt))
    W._load_tuned_table()
    if W.bucket(m) == 1 and dt == torch.float16 and (key in W._TUNED_H2):
        return W._TUNED_H2[key]
    if key in W._TUNED:
        return W._TUNED[key]
    if W.bucket(m) == 1:
        bk = W._fit_block_k(64, k, G)
        return W.Config("gemv", 128, bk, 1, W._split_for(-(-n // 128), k // bk, W._sm_count(dev), 8), 1, 2)
    return W.heuristic_config(m, n, k, G, W._sm_count(dev), mma=False)


def sweep_cfgs(n, k):
    out = []
    for bn, w in ((64, 4), (128, 8), (128, 4), (256, 8)):
        for bk in (64, 128):
            for sk in (1, 2, 4, 8, 16):
                c = W.Config("mma", block_n=bn, block_k=bk, block_m=16, split_k=sk, num_warps=w, num_stages=4)
                if c.valid_for(n, k, G) and sk <= k // max(bk, G):
                    out.append(c)
    return out


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--dtypes", nargs="+", default=["float16", "bfloat16"])
    ap.add_argument("--models", nargs="+", default=list(MODELS))
    ap.add_argument("--ms", type=int, nargs="+", default=[1, 2, 4, 8, 16, 32])
    ap.add_argument("--sweep", action="store_true")
    args = ap.parse_args()
    out_dir = os.environ.get("OUT", "/tmp")
    os.environ.setdefault("VLMCTL_CACHE_DIR", "/var/tmp/vlmctl-cache")
    dev = torch.device("cuda")
    log(torch.__version__, torch.cuda.get_device_name(), "mma available:", W.mma_available())
    res = {"device": torch.cuda.get_device_name(), "step": [], "sweep": []}
    for mname in args.models:
        shapes, nl = MODELS[mname]
        layers = [{nm: random_packed(n, k, G, 1000 * i + j, dev) for j, (nm, (n, k)) in enumerate(shapes.items())}
                  for i in range(nl)]
        for dname in args.dtypes:
            dt = getattr(torch, dname)
            dense = [{nm: torch.randn(n, k, device=dev, dtype=dt) * 0.02 for nm, (n, k) in shapes.items()}
                     for _ in range(nl)]
            for m in args.ms:
                xs = {nm: torch.randn(m, k, device=dev, dtype=dt) for nm, (n, k) in shapes.items()}
                ys = {nm: torch.empty(m, n, device=dev, dtype=dt) for nm, (n, k) in shapes.items()}
                picks = {"before": {nm: before_config(m, n, k, dt, dev) for nm, (n, k) in shapes.items()},
                         "after": {nm: W.select_config(m, n, k, G, dt, dev) for nm, (n, k) in shapes.items()}}
                sms = W._sm_count(dev)
                if m == 1 and dt == torch.float16:  # the two GEMVs' untuned rules
                    picks["gemv_rule"] = {nm: W.heuristic_config(1, n, k, G, sms) for nm, (n, k) in shapes.items()}
                    picks["h2_rule"] = {nm: W.heuristic_h2_config(1, n, k, G, sms) for nm, (n, k) in shapes.items()}
                if m == 32:  # the mma rule with 32-row tiles
                    picks["mma32_rule"] = {nm: W.heuristic_mma_config(n, k, G, sms, dt, block_m=32)
                                           for nm, (n, k) in shapes.items()}
                row = {"model": mname, "dtype": dname, "m": m,
                       "configs": {v: {nm: W.describe(c) for nm, c in p.items()} for v, p in picks.items()}}
                for v, p in picks.items():
                    fns = [lambda L=L, nm=nm, c=p[nm]: W.launch(xs[nm], L[nm], G, c, out=ys[nm])
                           for L in layers for nm in shapes]
                    row[v] = time_graph(fns)
                row["cublas"] = time_graph([lambda D=D, nm=nm: torch.mm(xs[nm], D[nm].t(), out=ys[nm])
                                            for D in dense for nm in shapes])
                res["step"].append(row)
                extra = "".join(f", {v} {row[v]:.3f}" for v in picks if v not in ("before", "after"))
                log(f"{mname:22s} {dname:8s} m{m:3d}: before {row['before']:.3f} ms, after {row['after']:.3f}{extra}, "
                    f"cuBLAS {row['cublas']:.3f}  {row['configs']['after']}")
            del dense
            if args.sweep and "tabled" not in mname:
                for nm, (n, k) in shapes.items():
                    ps = [layers[i][nm] for i in range(4)]
                    for m in (4, 16):
                        x = torch.randn(m, k, device=dev, dtype=dt)
                        y = torch.empty(m, n, device=dev, dtype=dt)

                        def per_call(c):
                            return time_graph([lambda p=p: W.launch(x, p, G, c, out=y) for p in ps]) * 1e3 / len(ps)

                        timed = sorted((per_call(c), W.describe(c)) for c in sweep_cfgs(n, k))
                        rule = W.select_config(m, n, k, G, dt, dev)
                        t_rule = per_call(rule)
                        t_before = per_call(before_config(m, n, k, dt, dev))
                        res["sweep"].append(dict(model=mname, dtype=dname, linear=nm, m=m, best=timed[:3],
                                                 rule=(W.describe(rule), t_rule), before=t_before))
                        log(f"  {nm:8s} m{m:3d} {dname}: best {timed[0][0]:.1f} us ({timed[0][1]}), rule {t_rule:.1f}, "
                            f"before {t_before:.1f}")
        del layers
        torch.cuda.empty_cache()
    with open(os.path.join(out_dir, "w4a16_shapes.json"), "w") as f:
        json.dump(res, f, indent=1)
    log("done")


if __name__ == "__main__":
    main()
