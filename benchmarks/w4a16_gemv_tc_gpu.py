"""The batch-1 GEMV on the tensor cores ("gemv_tc") against what selection runs at batch 1 (this card's table or
rule: the CUDA GEMV, or gemv_tc where the table names it), at a 7B decoder's linears.

Session 37 found the CUDA GEMV held by its arithmetic (its loads alone run at ~90 % of the copy bandwidth, with the
arithmetic ~60 %), and session 51 the flow step's consumers likewise. gemv_tc takes the arithmetic to 1.25
instructions a pair (one AND-OR into mma.sync's A registers, the magic and the zero point folded out per chunk).
This prints, for each linear (gate_up as the step runs it, with its act·mul epilogue):
- each kernel's error against the fp32 reference of the dequantized weights (and 0 outputs differing from run to run);
- µs a call: a CUDA graph of 8 PDL launches over distinct weights, median of 15 replays;
and the step's 128 linears (32 layers) as one graph with PDL, ms, for selection, gemv_tc at each config given, and
gemv_tc at each linear's fastest config, the chain timings interleaved `--repeats` times.

With --table-out FILE it writes the table in use plus a "tc" entry for each linear whose fastest gemv_tc config
beat selection by --margin or more a call (the table `VLMCTL_W4A16_TABLE=FILE` then selects from).

With --rows M (2-8) the same for M rows of x: gemv_tc's batched kernel (`w4a16_gemv_tc8`, B's columns the rows)
against selection at M rows (mma_gemv by the table or rule), gate_up without act·mul (batched steps do not fuse it),
and table entries for M's bucket.

    OUT=results python benchmarks/w4a16_gemv_tc_gpu.py            # -> $OUT/gemv_tc.json
    python benchmarks/w4a16_gemv_tc_gpu.py --configs 2:4:2 4:4:1   # T:W:S (tiles a warp, warps, chunks a run)
    python benchmarks/w4a16_gemv_tc_gpu.py --table-out tc.json
    python benchmarks/w4a16_gemv_tc_gpu.py --rows 8                # -> $OUT/gemv_tc_m8.json
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
sys.path.insert(0, os.path.dirname(os.path.abspath(__file__)))
from vlmctl.runtime.kernels import w4a16 as W

SH = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
G = 128
DEFAULT_CONFIGS = ["1:4:2", "1:8:2", "2:4:1", "2:8:1", "2:16:1", "2:4:2", "2:8:2", "4:4:1", "4:8:1", "1:16:2"]


def tc(spec: str, act: bool = False, rows: int = 1) -> W.Config | None:
    t, w, s = (int(v) for v in spec.split(":"))
    if act and t % 2:
        return None
    c = W.Config("gemv_tc", block_n=16 * t, block_m=8 if rows > 1 else 0, num_warps=w, num_stages=s)
    return c if c.valid_for(4096, 4096, G) else None


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    ap.add_argument("--configs", nargs="+", default=DEFAULT_CONFIGS, help="gemv_tc configs T:W:S")
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--activation", default="silu")
    ap.add_argument("--table-out", help="write the table in use plus the gemv_tc entries that won")
    ap.add_argument("--margin", type=float, default=0.02, help="how much faster a call an entry must be")
    ap.add_argument("--rows", type=int, default=1, choices=range(1, 9), metavar="M", help="rows of x (1-8)")
    args = ap.parse_args()
    rows = args.rows

    import torch
    from gpu_timing import copy_bandwidth, graph_median_ms
    from gpu_weights import random_packed

    dev = torch.device("cuda")
    out_dir = os.environ.get("OUT", "/tmp")
    os.makedirs(out_dir, exist_ok=True)  # docs/benchmarks.md runs it with OUT=p1, OUT=p2
    act = args.activation
    res = {"device": torch.cuda.get_device_name(dev), "copy_tb_s": copy_bandwidth() / 1e12, "selection": {},
           "rel_err": {}, "per_call_us": {}, "best": {}, "chain_ms": {}}
    print(f"{res['device']}, copy bandwidth {res['copy_tb_s']:.2f} TB/s, {rows} row(s) of x", flush=True)

    def is_act(nm):
        return nm == "gate_up" and rows == 1

    def tcr(spec, nm):
        return tc(spec, is_act(nm), rows)

    sel = {nm: W.select_config(rows, n, k, G, torch.float16, dev, act_mul=is_act(nm)) for nm, (n, k) in SH.items()}
    res["selection"] = {nm: W.describe(c) for nm, c in sel.items()}
    print("selection:", res["selection"], flush=True)
    cands = {nm: [("selection", sel[nm])] + [(s, c) for s in args.configs if (c := tcr(s, nm)) is not None]
             for nm in SH}

    def call(nm, cfg, p, x, y):
        W.launch(x, p, G, cfg, out=y, act=act if is_act(nm) else None)

    for nm, (n, k) in SH.items():
        n_out = n // 2 if is_act(nm) else n
        p = random_packed(n, k, G, 7, dev)
        x = torch.randn(rows, k, device=dev, dtype=torch.float16)
        ref = x.float() @ W.dequantize(p, G, torch.float16).float().T
        if is_act(nm):
            g, u = ref[:, : n // 2], ref[:, n // 2:]
            ref = torch.nn.functional.silu(g) * u if act == "silu" else \
                torch.nn.functional.gelu(g, approximate="tanh") * u
        for name, cfg in cands[nm]:
            y1 = torch.empty(rows, n_out, device=dev, dtype=torch.float16)
            y2 = torch.empty_like(y1)
            call(nm, cfg, p, x, y1)
            call(nm, cfg, p, x, y2)
            torch.cuda.synchronize()
            err = float((y1.float() - ref).norm() / ref.norm())
            res["rel_err"][f"{nm} / {name}"] = [err, int((y1 != y2).sum())]
            print(f"{nm:8s} {name:10s} {W.describe(cfg):24s} relative error {err:.2e}, "
                  f"{int((y1 != y2).sum())} outputs differ between two runs", flush=True)

    nws = 8
    for nm, (n, k) in SH.items():
        n_out = n // 2 if is_act(nm) else n
        ps = [random_packed(n, k, G, n + i, dev) for i in range(nws)]
        x = torch.randn(rows, k, device=dev, dtype=torch.float16)
        y = torch.empty(rows, n_out, device=dev, dtype=torch.float16)
        byt = n * k / 2 + n * k / G * 3
        best = None
        for name, cfg in cands[nm]:
            t = graph_median_ms([lambda p=p, c=cfg: call(nm, c, p, x, y) for p in ps]) * 1e3 / nws
            res["per_call_us"][f"{nm} / {name}"] = t
            if name != "selection" and (best is None or t < best[1]):
                best = (name, t)
            print(f"{nm:8s} {name:10s} {t:7.2f} us ({byt / t / 1e6:.2f} TB/s)", flush=True)
        res["best"][nm] = best[0]
        sel_t = res["per_call_us"][f"{nm} / selection"]
        if args.table_out and best[1] <= (1 - args.margin) * sel_t:
            W.set_config(rows, n, k, G, torch.float16, tcr(best[0], nm), dev)
            res.setdefault("table_entries", {})[nm] = best[0]
            print(f"{nm:8s} table entry gemv_tc {best[0]}: {best[1]:.2f} against {sel_t:.2f} us", flush=True)
        del ps

    layers = [{nm: random_packed(n, k, G, 1000 * i + j, dev) for j, (nm, (n, k)) in enumerate(SH.items())}
              for i in range(32)]
    xs = {nm: torch.randn(rows, k, device=dev, dtype=torch.float16) for nm, (n, k) in SH.items()}
    ys = {nm: torch.empty(rows, n // 2 if is_act(nm) else n, device=dev, dtype=torch.float16)
          for nm, (n, k) in SH.items()}
    int4 = sum(n * k / 2 + n * k / G * 3 for n, k in SH.values()) * 32
    chains = {"selection": sel, "gemv_tc, each linear's fastest": {nm: tcr(res["best"][nm], nm) for nm in SH}}
    for spec in args.configs:
        cfgs = {nm: tcr(spec, nm) for nm in SH}
        if all(c is not None for c in cfgs.values()):
            chains[f"gemv_tc {spec}"] = cfgs
    for rep in range(args.repeats):
        for label, cfgs in chains.items():
            t = graph_median_ms([lambda L=L, nm=nm, c=cfgs[nm]: call(nm, c, L[nm], xs[nm], ys[nm])
                                 for L in layers for nm in SH])
            res["chain_ms"].setdefault(label, []).append(t)
            print(f"rep {rep} {label:32s} {t:.3f} ms ({int4 / t / 1e9:.2f} TB/s)", flush=True)
    res["best_configs"] = {nm: res["best"][nm] for nm in SH}
    if args.table_out:
        W.save_tuned(args.table_out)
    with open(os.path.join(out_dir, "gemv_tc.json" if rows == 1 else f"gemv_tc_m{rows}.json"), "w") as f:
        json.dump(res, f, indent=1)


if __name__ == "__main__":
    main()
