"""The decode step with W4A16 linears' batch-1 configs pinned (measurement): a kernel's best config in
isolation (`w4a16_gpu.py` sweeps: CUDA graphs of one linear after another) need not be its best inside a
step, where the kernel before it may be latency-bound (the decode attention before o, an RMSNorm before
qkv and gate_up) and leave DRAM idle for PDL's early weight loads.

    python benchmarks/decode_pinned_gpu.py --awq --batches 1 --hf-batches \\
        --env-variants awq --env-ab VLMCTL_PIN=default,4096:4096:gemv_cuda:8:4:4

Every argument goes to decode_gpu.py. `VLMCTL_PIN` (read before each capture, so `--env-ab` sweeps it in one
process): "default" (the shipped table) or pins N:K:KERNEL:BLOCK_N:WARPS:STAGES joined by "+", for one-row calls
with group size 128 and fp16 activations (decode_gpu.py's defaults).
"""

from __future__ import annotations

import os
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))


def _tables():
    """Every table `set_config` may pin into (per kernel kind)."""
    from vlmctl.runtime.kernels import w4a16 as W

    return (W._TUNED, W._TUNED_H2, W._TUNED_CUDA, W._TUNED_MMA_GEMV)


def apply_pins(shipped: list[dict]) -> None:
    """Restore the shipped tables (an earlier case's pins do not carry over), then pin `VLMCTL_PIN`'s configs."""
    import torch

    from vlmctl.runtime.kernels import w4a16 as W

    for table, saved in zip(_tables(), shipped):
        table.clear()
        table.update(saved)
    spec = os.environ.get("VLMCTL_PIN", "default").strip()
    if spec in ("", "default"):
        return
    for pin in spec.split("+"):
        try:
            n, k, kernel, bn, warps, stages = pin.split(":")
            cfg = W.Config(kernel, block_n=int(bn), num_warps=int(warps), num_stages=int(stages))
            W.set_config(1, int(n), int(k), 128, torch.float16, cfg, device=torch.device("cuda"))
        except ValueError as e:
            raise SystemExit(f"VLMCTL_PIN: {pin!r} is not N:K:KERNEL:BLOCK_N:WARPS:STAGES that fits its shape ({e})")
        print(f"pinned N={n} K={k}: {cfg}", flush=True)


def main() -> None:
    from vlmctl.runtime import decoder as D
    from vlmctl.runtime.kernels import w4a16 as W

    W._load_tuned_table()  # first: the shipped table is loaded lazily and would overwrite the pins
    shipped = [dict(t) for t in _tables()]
    capture = D.TorchDecoder.capture_graphs

    def capture_pinned(self, max_batch):
        apply_pins(shipped)
        return capture(self, max_batch)

    D.TorchDecoder.capture_graphs = capture_pinned
    import decode_gpu

    decode_gpu.main()


if __name__ == "__main__":
    main()
