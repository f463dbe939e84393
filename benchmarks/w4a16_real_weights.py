"""The CUDA "mma" W4A16 kernel on real weights: the linears of a vlmctl AWQ checkpoint (e.g. SmolLM2-135M
quantized by `vlmctl quantize --awq`), against x @ dequantize(W)^T in float32.

Two steps, because the whole checkpoint is more than the GPU machine takes along:

    python benchmarks/w4a16_real_weights.py extract AWQ_DIR linears.safetensors [--layers 0 10 20 29]   # CPU
    python benchmarks/w4a16_real_weights.py check linears.safetensors [--out result.json]               # GPU

`extract` repacks the chosen layers' AutoAWQ GEMM tensors into the engine's W4A16 layout (exact);
`check` runs every mma config of a small grid (16/32/64-row tiles, 64-128-wide K chunks, split-K 1 and
3) at M = 1, 2, 8, 17, 32, 64 with fp16 and bf16 activations of unit and of large magnitude (x 64), reporting the
relative Frobenius error and the worst element error relative to the largest output. Real AWQ weights
differ from random ones in their per-channel scales (folded into the weights) and zero points.
"""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def extract(awq_dir: Path, out: Path, layers: list[int]) -> None:
    import torch
    from safetensors import safe_open
    from safetensors.torch import save_file

    from vlmctl.formats.w4a16 import repack_awq_gemm

    cfg = json.loads((awq_dir / "config.json").read_text())
    group = cfg["quantization_config"]["group_size"]
    tensors = {}
    for f in sorted(awq_dir.glob("*.safetensors")):
        with safe_open(f, "pt") as h:
            for name in h.keys():
                tensors[name] = h.get_tensor(name)
    picked = {}
    for name in sorted(tensors):
        if not name.endswith(".qweight"):
            continue
        parts = name.split(".")
        layer = int(parts[parts.index("layers") + 1])
        if layer not in layers:
            continue
        base = name[:-len(".qweight")]
        packed = repack_awq_gemm(tensors[name], tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], group)
        picked.update({f"{base}.{k}": v.contiguous() for k, v in packed.items()})
    picked["group_size"] = torch.tensor([group])
    save_file(picked, str(out))
    n = sum(v.numel() * v.element_size() for v in picked.values())
    print(f"{len(picked) // 3} linears of layers {layers}, group {group}: {n / 2 ** 20:.1f} MiB -> {out}")


def check(path: Path, out: Path | None) -> int:
    import torch
    from safetensors.torch import load_file

    from vlmctl.runtime.kernels import w4a16 as W

    t = load_file(str(path), device="cuda")
    group = int(t.pop("group_size")[0])
    bases = sorted({k.rsplit(".", 1)[0] for k in t})
    cfgs = [W.Config("mma", block_n=bn, block_k=bk, block_m=bm, split_k=sk, num_warps=w, num_stages=4)
            for bm, bn, w in ((16, 128, 8), (32, 64, 4), (64, 128, 8)) for bk in (64, 128) for sk in (1, 3)]
    gen = torch.Generator(device="cuda").manual_seed(0)
    tol = {"float16": 2 * 2.0 ** -11, "bfloat16": 2 * 2.0 ** -8}  # twice the output dtype's unit roundoff
    rows = []
    for base in bases:
        p = {k: t[f"{base}.{k}"] for k in W.KEYS}
        n, k = p["q4weight"].shape[0], p["q4weight"].shape[1] * 8
        for dt in (torch.float16, torch.bfloat16):
            wdq = W.dequantize(p, group, dt).float()
            for m in (1, 2, 8, 17, 32, 64):
                for scale in (1.0, 64.0):
                    x = (torch.randn(m, k, generator=gen, device="cuda") * scale).to(dt)
                    ref = x.float() @ wdq.T
                    for c in cfgs:
                        if not c.valid_for(n, k, group):
                            continue
                        y = W.launch(x, p, group, c).float()
                        rows.append(dict(linear=base, n=n, k=k, m=m, dtype=str(dt)[6:], x_scale=scale,
                                         cfg=W.describe(c), rel=float((y - ref).norm() / ref.norm()),
                                         max_rel=float((y - ref).abs().max() / ref.abs().max()),
                                         finite=bool(torch.isfinite(y).all())))
    bad = [r for r in rows if not (r["finite"] and r["rel"] <= tol[r["dtype"]])]
    summary = {}
    for d in tol:
        sel = [r for r in rows if r["dtype"] == d]
        summary[d] = dict(cases=len(sel), worst_rel=max(r["rel"] for r in sel),
                          worst_max_rel=max(r["max_rel"] for r in sel), tolerance=tol[d],
                          bad=sum(not (r["finite"] and r["rel"] <= tol[d]) for r in sel))
        print(f"{d}: {len(bases)} linears, {len(sel)} cases: worst relative error {summary[d]['worst_rel']:.2e} "
              f"(tolerance {tol[d]:.2e}), worst element error / max |y| {summary[d]['worst_max_rel']:.2e}; "
              f"{summary[d]['bad']} over tolerance")
    if out:
        out.write_text(json.dumps(dict(group=group, summary=summary, cases=rows), indent=1))
    return 1 if bad else 0


def main() -> int:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    sub = ap.add_subparsers(dest="cmd", required=True)
    e = sub.add_parser("extract")
    e.add_argument("awq_dir", type=Path)
    e.add_argument("out", type=Path)
    e.add_argument("--layers", type=int, nargs="+", default=[0, 10, 20, 29])
    c = sub.add_parser("check")
    c.add_argument("path", type=Path)
    c.add_argument("--out", type=Path)
    a = ap.parse_args()
    if a.cmd == "extract":
        extract(a.awq_dir, a.out, a.layers)
        return 0
    return check(a.path, a.out)


if __name__ == "__main__":
    raise SystemExit(main())
