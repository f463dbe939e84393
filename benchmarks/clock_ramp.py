"""Does the GPU's compute speed depend on how long it has been busy? A diagnostic for the serving
bench's slow first run (docs/benchmarks.md): its prefill steps took ~3x longer than in the next run
while its decode steps did not, which points at the SM clock rather than at vlmctl's code.

One process, about 40 s on a GPU, no checkpoint:
  1. intermittent load shaped like the engine's prefill steps (a burst of fp16 GEMMs at 2048 rows,
     ~10 ms, then 3 ms idle), 15 s;
  2. the same GEMMs back to back, 8 s;
  3. 5 s idle, then intermittent again, 8 s.
Every 0.5 s it prints the achieved TFLOP/s of the bursts and nvidia-smi's SM clock, power draw and
active clock-throttle reasons (when nvidia-smi is there).

    python benchmarks/clock_ramp.py [--out ramp.json]
"""

from __future__ import annotations

import argparse
import json
import subprocess
import sys
import time


def smi() -> dict:
    try:
        query = "clocks.sm,clocks.max.sm,clocks.mem,power.draw,temperature.gpu,clocks_throttle_reasons.active"
        out = subprocess.run(["nvidia-smi", f"--query-gpu={query}", "--format=csv,noheader,nounits"],
                             check=False, capture_output=True, text=True, timeout=5).stdout.strip().split(", ")
        keys = ("sm_mhz", "max_sm_mhz", "mem_mhz", "power_w", "temp_c", "throttle")
        return dict(zip(keys, out))
    except (OSError, subprocess.SubprocessError) as e:  # no nvidia-smi: the timings still say it
        return {"error": f"{type(e).__name__}: {e}"}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--out")
    args = ap.parse_args()
    import torch

    if not torch.cuda.is_available():
        sys.exit("error: needs a CUDA GPU")
    a = torch.randn(2048, 4096, device="cuda", dtype=torch.float16)
    ws = [torch.randn(4096, n, device="cuda", dtype=torch.float16) for n in (12288, 4096, 22016)]
    flop_burst = sum(2 * 2048 * 4096 * w.shape[1] for w in ws) * 4

    def burst():
        for _ in range(4):
            for w in ws:
                a @ w

    burst()
    torch.cuda.synchronize()
    rows, t_start = [], time.perf_counter()

    def phase(name: str, seconds: float, idle_s: float) -> None:
        end = time.perf_counter() + seconds
        while time.perf_counter() < end:
            win_end, busy, n = time.perf_counter() + 0.5, 0.0, 0
            while time.perf_counter() < win_end:
                t = time.perf_counter()
                burst()
                torch.cuda.synchronize()
                busy += time.perf_counter() - t
                n += 1
                if idle_s:
                    time.sleep(idle_s)
            row = {"phase": name, "t_s": round(time.perf_counter() - t_start, 2),
                   "tflops": round(flop_burst * n / busy / 1e12, 1), "burst_ms": round(1000 * busy / n, 2), **smi()}
            rows.append(row)
            print(json.dumps(row), flush=True)

    print(json.dumps({"phase": "start", **smi()}), flush=True)
    phase("intermittent", 15, 0.003)
    phase("continuous", 8, 0.0)
    time.sleep(5)
    phase("intermittent after 5 s idle", 8, 0.003)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(rows, f, indent=1)


if __name__ == "__main__":
    main()
