"""The fp16 batch-1 GEMV's configs timed where the decode step runs them: inside a CUDA graph, launched
with PDL one after another over distinct weights, rather than one call at a time with L2 flushed
(`gemv_gpu.py`'s sweep, which wrote today's table).

Why: in session 36's timeline of the fp16 step on the H200, qkv, o and gate_up ran at 81-96 % of the copy
bandwidth and down_proj (4096 x 11008, SiLU·mul read from the gate_up row) at 71 %. This times, at
LLaVA-1.5-7B's shapes and M = 1:
  1. per shape, every candidate config (`gemv.candidate_configs`, plus the table's) as a graph of
     `--layers` launches over distinct weights: us a call and TB/s;
  2. down_proj both ways: the GEMV that computes silu(gate) * up itself, and the act·mul kernel followed
     by the plain GEMV (each with its own configs), each after gate_up's launch, as in the step;
  3. the 128 linears of 32 layers as one graph: the table's configs (the heuristic's where it has none)
     against this run's winners and against cuBLAS (what the decoder runs where the table has no entry);
  4. with --table-out, this GPU's entries rewritten from the winners (other GPUs' entries kept); a
     down_proj whose winner is act·mul + GEMV gets a plain entry and no SiLU one, which the decoder reads
     as "act·mul, then the GEMV".

    OUT=DIR python benchmarks/gemv_f16_in_graph_gpu.py [--shapes qkv o gate_up down] [--layers 32] \
        [--table-out vlmctl/runtime/kernels/gemv_tuned.json]

--smoke runs tiny shapes on the CPU through Triton's interpreter with a wall-clock timer, to show the script
runs (its figures mean nothing).
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))
sys.path.insert(0, str(Path(__file__).resolve().parent))

SHAPES = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
SMOKE_SHAPES = {"qkv": (96, 128), "o": (64, 128), "gate_up": (512, 128), "down": (64, 256)}
TOP_MLP = 4  # down_proj configs of each form tried again after gate_up


def log(*a):
    print(*a, flush=True)


def main(argv=None) -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--shapes", nargs="+", choices=list(SHAPES), default=list(SHAPES))
    ap.add_argument("--layers", type=int, default=32, help="distinct weights per graph (32: nothing stays in L2)")
    ap.add_argument("--table-out", help="rewrite this GPU's entries of the fp16 GEMV table here")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (Triton interpreter)")
    args = ap.parse_args(argv)
    if args.smoke:
        os.environ.setdefault("TRITON_INTERPRET", "1")  # before triton is imported
        args.layers = min(args.layers, 2)
    os.environ.pop("VLMCTL_GEMV", None)
    import torch

    from vlmctl.runtime import ops
    from vlmctl.runtime.kernels import gemv as GV
    from vlmctl.runtime.kernels import w4a16 as W

    if not args.smoke and not torch.cuda.is_available():
        sys.exit("error: needs a CUDA GPU (or --smoke for a CPU check)")
    dev = torch.device("cpu" if args.smoke else "cuda")
    shapes = {s: (SMOKE_SHAPES if args.smoke else SHAPES)[s] for s in args.shapes}
    dt = torch.float16
    layers = args.layers
    GV._load_table()
    name = "cpu (Triton interpreter)" if args.smoke else torch.cuda.get_device_name()
    out_dir = Path(os.environ.get("OUT", "."))
    result = {"meta": {"device": name, "torch": torch.__version__, "layers": layers, "smoke": args.smoke},
              "sweep": {}, "mlp": [], "linears": [], "failures": []}
    if args.smoke:
        def run_graph(fns):
            for f in fns:
                f()
            t = time.perf_counter()
            for f in fns:
                f()
            return (time.perf_counter() - t) * 1e3
        bw = None
    else:
        from gpu_timing import copy_bandwidth, graph_median_ms as run_graph

        bw = copy_bandwidth()
    result["meta"]["copy_tbps"] = bw / 1e12 if bw else None
    log(f"device {name}; copy bandwidth {bw / 1e12:.2f} TB/s" if bw else f"device {name}")
    sms = W._sm_count(dev)
    gen = torch.Generator(device=dev).manual_seed(0)
    weights = {s: [(torch.randn(n, k, generator=gen, device=dev) * 0.02).to(dt) for _ in range(layers)]
               for s, (n, k) in shapes.items()}
    x_h = torch.randn(1, (SMOKE_SHAPES if args.smoke else SHAPES)["gate_up"][1], generator=gen, device=dev).to(dt)

    def x_for(s, silu):
        n, k = shapes[s]
        return torch.randn(1, 2 * k if silu else k, generator=gen, device=dev).to(dt)

    def check(s, silu, cfg, x) -> bool:  # each config against torch before it is timed
        w = weights[s][0]
        ref = GV.reference(x.double(), w.double(), silu=silu)
        err = float((GV.launch(x, w, cfg, silu=silu).double() - ref).norm() / ref.norm())
        if err > 2.0 ** -9:
            result["failures"].append(f"{s} silu={silu} {GV.describe(cfg)}: rel err {err:.2e}")
            return False
        return True

    def per_call(s, silu, cfg, x):
        return run_graph([lambda w=w: GV.launch(x, w, cfg, silu=silu) for w in weights[s]]) / layers

    table = {}
    forms = []
    for s in shapes:
        forms.append((s, False))
        if s == "down":
            forms.append((s, True))
    for s, silu in forms:
        n, k = shapes[s]
        x = x_for(s, silu)
        cands = GV.candidate_configs(1, n, k, sms)
        shipped = GV._TUNED.get((W._device_name(dev), n, k, "float16", silu))
        if shipped is not None and shipped not in cands:
            cands.insert(0, shipped)
        if args.smoke:
            cands = cands[:2]
        rows = []
        for cfg in cands:
            try:
                if not check(s, silu, cfg, x):
                    continue
                ms = per_call(s, silu, cfg, x)
            except Exception as e:  # a config that does not compile or run here is skipped
                log(f"  skip {s} {GV.describe(cfg)}: {type(e).__name__}: {str(e).splitlines()[0][:100]}")
                continue
            tb = 2 * n * k / (ms * 1e-3) / 1e12
            rows.append({"config": GV.describe(cfg), "us": ms * 1e3, "tbps": tb, "shipped": cfg == shipped})
            table.setdefault((s, silu), []).append((ms, cfg))
        rows.sort(key=lambda r: r["us"])
        key = f"{s}{' silu' if silu else ''}"
        result["sweep"][key] = rows
        ship = [r for r in rows if r["shipped"]]
        log(f"{key:10s} best {rows[0]['config']:22s} {rows[0]['us']:7.2f} us {rows[0]['tbps']:5.2f} TB/s"
            + (f"   table's {ship[0]['config']:22s} {ship[0]['us']:7.2f} us {ship[0]['tbps']:5.2f} TB/s" if ship else
               "   (no table entry)") if rows else f"{key}: no config ran")
    for v in table.values():
        v.sort(key=lambda t: t[0])

    # down_proj after gate_up, both forms, as the step runs them
    mlp_best = {}
    if "down" in shapes and "gate_up" in shapes and table.get(("gate_up", False)):
        gu_cfg = table[("gate_up", False)][0][1]
        n, k = shapes["down"]
        for fused in (True, False):
            for ms0, cfg in table.get(("down", fused), [])[:TOP_MLP]:
                fns = []
                for wg, wd in zip(weights["gate_up"], weights["down"]):
                    if fused:
                        fns.append(lambda wg=wg, wd=wd, c=cfg: GV.launch(GV.launch(x_h, wg, gu_cfg), wd, c, silu=True))
                    else:
                        fns.append(lambda wg=wg, wd=wd, c=cfg: GV.launch(
                            ops.act_mul(GV.launch(x_h, wg, gu_cfg), "silu"), wd, c))
                us = run_graph(fns) / layers * 1e3
                form = "silu in the GEMV" if fused else "act_mul, then the GEMV"
                result["mlp"].append({"form": form, "config": GV.describe(cfg), "us_per_layer": us})
                log(f"mlp  gate_up {GV.describe(gu_cfg)} + down {form:24s} {GV.describe(cfg):22s} {us:7.2f} us a layer")
                if us < mlp_best.get("us", float("inf")):
                    mlp_best = {"us": us, "fused": fused, "config": cfg}

    # the 128 linears as one graph: the table's configs against this run's winners and cuBLAS
    device = W._device_name(dev)
    if set(shapes) == set(SHAPES) or args.smoke and set(shapes) == set(SMOKE_SHAPES):
        x_o = x_for("o", False)

        def layer_fns(cfgs, fused):
            def f(i):
                GV.launch(x_h, weights["qkv"][i], cfgs["qkv"])
                GV.launch(x_o, weights["o"][i], cfgs["o"])
                gu = GV.launch(x_h, weights["gate_up"][i], cfgs["gate_up"])
                if fused:
                    GV.launch(gu, weights["down"][i], cfgs["down"], silu=True)
                else:
                    GV.launch(ops.act_mul(gu, "silu"), weights["down"][i], cfgs["down"])
            return [lambda i=i: f(i) for i in range(layers)]

        nbytes = layers * sum(2 * n * k for n, k in shapes.values())
        shipped = {s: GV.select_config(1, n, k, dt, silu=s == "down", device=dev) for s, (n, k) in shapes.items()}
        best = {s: table[(s, False)][0][1] for s in ("qkv", "o", "gate_up")}
        best["down"] = mlp_best.get("config", shipped["down"])
        has_entries = all((device, n, k, "float16", s == "down") in GV._TUNED for s, (n, k) in shapes.items())
        runs = [("table" if has_entries else "heuristic (the table has no entries for this GPU)", shipped, True),
                ("this run's winners", best, mlp_best.get("fused", True))]
        if not args.smoke:  # what the decoder runs where the table has no entry
            F = torch.nn.functional

            def cublas(i):
                F.linear(x_h, weights["qkv"][i])
                F.linear(x_o, weights["o"][i])
                F.linear(ops.act_mul(F.linear(x_h, weights["gate_up"][i]), "silu"), weights["down"][i])
            runs.append(("cuBLAS + act_mul", [lambda i=i: cublas(i) for i in range(layers)], None))
        for label, cfgs, fused in runs:
            ms = run_graph(cfgs if fused is None else layer_fns(cfgs, fused))
            down = "cuBLAS" if fused is None else "silu in the GEMV" if fused else "act_mul, then the GEMV"
            result["linears"].append({"configs": label, "ms": ms, "tbps": nbytes / (ms * 1e-3) / 1e12, "down": down})
            log(f"linears ({label}): {ms:.3f} ms, {nbytes / (ms * 1e-3) / 1e12:.2f} TB/s")

    if args.table_out and not args.smoke:
        for (s, silu), v in table.items():
            n, k = shapes[s]
            if s == "down":
                continue
            GV.set_config(n, k, dt, v[0][1], device=dev)
        if "down" in shapes and mlp_best:
            n, k = shapes["down"]
            GV._TUNED.pop((device, n, k, "float16", True), None)
            GV._TUNED.pop((device, n, k, "float16", False), None)
            GV.set_config(n, k, dt, mlp_best["config"], silu=mlp_best["fused"], device=dev)
        GV.save_tuned(args.table_out)
        log(f"wrote {args.table_out}")
    out_dir.mkdir(parents=True, exist_ok=True)
    (out_dir / "gemv_f16_in_graph.json").write_text(json.dumps(result, indent=1) + "\n")
    log(f"failures: {result['failures'] or 'none'}")
    return 1 if result["failures"] else 0


if __name__ == "__main__":
    sys.exit(main())
