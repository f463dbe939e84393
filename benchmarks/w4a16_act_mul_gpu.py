"""gate_up's act·mul in the batch-1 GEMV's epilogue (`w4a16.w4a16_act_mul`) against the GEMV followed by
the act·mul kernel, on one GPU, at a decoder's MLP shapes (LLaVA-1.5-7B by default: gate_up 22016 x 4096,
down 4096 x 11008, group 128, fp16, M = 1).

Each figure is one CUDA graph over --layers distinct weight sets (more bytes than L2 keeps), median of 15
replays, with programmatic dependent launch as the engine launches (`VLMCTL_PDL`):
  gate_up              the GEMV alone (output [1, 2I])
  gate_up + act_mul    the GEMV, then the act·mul kernel
  fused                `w4a16_act_mul` (output [1, I])
  chain, unfused       residual add + RMSNorm -> gate_up -> act·mul -> down, as a decoder layer's MLP
  chain, fused         residual add + RMSNorm -> fused gate_up -> down
Before timing, the fused result is checked bit for bit against its config's GEMV + act·mul kernel (a Triton
GEMV) or its config's own epilogue launched directly (the CUDA GEMV).

    OUT=results python benchmarks/w4a16_act_mul_gpu.py [--hidden 4096 --intermediate 11008] [--layers 32]
Writes $OUT/w4a16_act_mul.json.
"""
import argparse
import json
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from gpu_timing import graph_median_ms  # noqa: E402
from gpu_weights import random_packed  # noqa: E402
from vlmctl.runtime.kernels import w4a16 as W  # noqa: E402
from vlmctl.runtime.kernels.fused import act_mul, add_rms_norm  # noqa: E402


def main():
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--hidden", type=int, default=4096)
    ap.add_argument("--intermediate", type=int, default=11008)
    ap.add_argument("--group-size", type=int, default=128)
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--activation", choices=["silu", "gelu_tanh"], default="silu")
    ap.add_argument("--repeats", type=int, default=2, help="rounds of all five graphs")
    args = ap.parse_args()
    if not torch.cuda.is_available():
        sys.exit("error: needs a CUDA GPU")
    h, inter, g, act = args.hidden, args.intermediate, args.group_size, args.activation
    dev = torch.device("cuda")
    gate_up = [random_packed(2 * inter, h, g, 10 + i) for i in range(args.layers)]
    down = [random_packed(h, inter, g, 1000 + i) for i in range(args.layers)]
    x = torch.randn(1, h, device=dev, dtype=torch.float16)
    residual = torch.randn(1, h, device=dev, dtype=torch.float16)
    norm_w = torch.ones(h, device=dev, dtype=torch.float16)
    W.warmup(gate_up[:1] + down[:1], g, [1], torch.float16, dev, act_mul=gate_up[:1], activation=act)
    cfg = W.select_config(1, 2 * inter, h, g, torch.float16, dev, act_mul=True)
    print(f"{torch.cuda.get_device_name()}: gate_up {2 * inter}x{h} takes {W.describe(cfg)}", flush=True)

    fused_out = W.w4a16_act_mul(x, gate_up[0], g, act)
    if fused_out is None:
        sys.exit(f"error: w4a16_act_mul does not fuse at this shape ({W.describe(cfg)} has no act·mul epilogue)")
    # a Triton GEMV's epilogue equals its pair with the act·mul kernel bit for bit; the CUDA GEMV's rounds the
    # activation once more exactly (tests/test_w4a16_gemv_cuda.py bounds that), so it is checked against itself
    want = (W.launch(x, gate_up[0], g, cfg, act=act) if cfg.kernel == "gemv_cuda"
            else act_mul(W.launch(x, gate_up[0], g, cfg), act))
    if not torch.equal(fused_out, want):
        sys.exit("error: the fused result differs from its config's reference")

    def unfused(i, a):
        return act_mul(W.w4a16_linear(a, gate_up[i], g), act)

    def fused(i, a):
        return W.w4a16_act_mul(a, gate_up[i], g, act)

    def chain(i, mlp):
        return lambda: W.w4a16_linear(mlp(i, add_rms_norm(x, norm_w, 1e-5, residual)), down[i], g)

    L = range(args.layers)
    rows = []
    for _ in range(args.repeats):
        r = {"gate_up": graph_median_ms([lambda i=i: W.w4a16_linear(x, gate_up[i], g) for i in L]),
             "gate_up + act_mul": graph_median_ms([lambda i=i: unfused(i, x) for i in L]),
             "fused": graph_median_ms([lambda i=i: fused(i, x) for i in L]),
             "chain, unfused": graph_median_ms([chain(i, unfused) for i in L]),
             "chain, fused": graph_median_ms([chain(i, fused) for i in L])}
        print("  ".join(f"{k} {v:.3f} ms" for k, v in r.items()), flush=True)
        rows.append(r)
    out = os.environ.get("OUT")
    if out:
        os.makedirs(out, exist_ok=True)
        with open(os.path.join(out, "w4a16_act_mul.json"), "w") as f:
            json.dump({"device": torch.cuda.get_device_name(), "args": vars(args), "config": W.describe(cfg),
                       "ms": rows}, f, indent=1)


if __name__ == "__main__":
    main()
