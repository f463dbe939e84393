"""Where the "wgmma" W4A16 kernel's time goes (one sm_90 GPU): per-call times of shapes that isolate its parts.

    python benchmarks/w4a16_wgmma_probe.py [--ncu]

- one tile per block: N = 132 x 256 rows, K = 4096 (32 units a block, no stream-K parts), so time / 32 is the
  main loop's time per unit; the same with K = 1024 and 16384 gives the fixed cost per launch by difference;
- the 7B qkv shape (12288 x 4096) at M = 64 for comparison (11.6 units a block, parts on every tile).
--ncu: launches one qkv call for Nsight Compute to catch (kernel name w4a16_wgmma), and nothing else.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from gpu_timing import graph_median_ms as time_graph  # noqa: E402
from gpu_weights import random_packed  # noqa: E402
from vlmctl.runtime.kernels import w4a16 as W  # noqa: E402

dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(0).multi_processor_count


def cfg(nwg, bm, stages):
    return W.Config("wgmma", block_n=64 * nwg, block_k=128, block_m=bm, split_k=1, num_warps=4 * nwg,
                    num_stages=stages)


if "--ncu" in sys.argv:
    p = random_packed(12288, 4096, 128, 0)
    x = torch.randn(64, 4096, device=dev, dtype=torch.float16)
    for c in (cfg(4, 64, 6), cfg(4, 64, 4), cfg(2, 64, 4)):
        W.launch(x, p, 128, c)
    torch.cuda.synchronize()
    sys.exit(0)

for c in (cfg(4, 64, 4), cfg(4, 64, 5), cfg(2, 64, 4)):
    bn = c.block_n
    for n, k in ((sms * bn, 1024), (sms * bn, 4096), (sms * bn, 16384), (12288, 4096)):
        ps = [random_packed(n, k, 128, i) for i in range(4)]
        x = torch.randn(64, k, device=dev, dtype=torch.float16)
        y = torch.empty(64, n, device=dev, dtype=torch.float16)
        t = time_graph([lambda p=p: W.launch(x, p, 128, c, out=y) for p in ps]) * 1e3 / 4
        units = -(-n // bn) * (k // 128) / min(sms, -(-n // bn) * (k // 128))
        wd = W.dequantize(ps[0], 128, torch.float16)
        tc = time_graph([lambda: torch.mm(x, wd.t(), out=y)]) * 1e3
        print(f"{W.describe(c):34s} N {n:6d} K {k:6d}: {t:7.1f} us, {units:5.1f} units a block, "
              f"{t / units:5.2f} us a unit, {n * k / 2 / t / 1e6:.2f} TB/s int4 | cuBLAS dense {tc:6.1f} us", flush=True)
