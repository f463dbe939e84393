"""The 8-bit KV cache at the engine: decode ms a step and the KV pool's size with `--kv-cache-dtype auto`, `int8`
and `fp8`, on `serving_gpu.py`'s LLaVA-1.5-7B-shaped fp16 engine (random weights, built by `vlmctl build` with the
engine's defaults, max_batch_size 64), each loaded with its defaults otherwise (async scheduling on a GPU).
A mode `KIND@TILExWARPS` (e.g. `fp8@64x4`) sets VLMCTL_ATTN_KV8_TILE / _WARPS for that engine, and `+VAR=VALUE`
after it any other setting (e.g. `int8+VLMCTL_ATTN_KV8_WIDEN=0`; measurements).

For each batch size, B text-only requests of ~`--prompt-words` x 6.5 tokens decode `--output-len` greedy
tokens (EOS ignored) through `Engine.step()` (async_scheduling_gpu.py's `run`: the decode phase is timed).
The modes alternate (auto, int8, fp8, auto, int8, fp8 by default), each a fresh Engine in this process, so a
drifting clock shows as a spread. Printed beside them: the step's bandwidth bound, (weight bytes + the K/V bytes the batch's contexts
hold at mid-generation) / the copy bandwidth, for each mode.

    python benchmarks/kv_cache_8bit_gpu.py --work /var/tmp/vb [--batches 1 8 64] [--prompt-words 150] \
        [--modes auto int8 fp8 fp8@64x4 fp8+VLMCTL_ATTN_KV8_WIDEN=0]
    python benchmarks/kv_cache_8bit_gpu.py --smoke --work /tmp/smoke      # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time
from pathlib import Path

import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))

from async_scheduling_gpu import run  # noqa: E402
from gpu_timing import copy_bandwidth  # noqa: E402
from serving_gpu import SEVEN_B, SMOKE, build_engine, load_engine, make_checkpoint, weight_gib  # noqa: E402


def log(*a):
    print(*a, flush=True)


def step_weight_bytes(eng) -> int:
    """Weight bytes a decode step reads: every linear, the norms and the lm_head (one embedding row only)."""
    dec = eng.decoder
    total = int(weight_gib(eng) * 2**30)
    if dec.lm_head is not dec.embed:
        total -= dec.embed.numel() * dec.embed.element_size()
    return total


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/vlmctl-bench"))
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-words", type=int, default=150)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--modes", nargs="+", default=["auto", "int8", "fp8"], help="KIND[@TILExWARPS][+VAR=VALUE...]")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    if args.smoke:
        args.batches, args.output_len, args.prompt_words = sorted({min(b, 4) for b in args.batches}), 8, 6
    t0 = time.perf_counter()
    engine_dir = args.work / "engine"
    if not (engine_dir / "build-llm").is_dir():  # built by an earlier run (or dev_run): reused
        ckpt = make_checkpoint(args.work / "ckpt", SMOKE if args.smoke else SEVEN_B, dev)
        engine_dir, _ = build_engine(ckpt, args.work, "float16" if dev == "cuda" else "float32")
    log(f"engine ready in {time.perf_counter() - t0:.0f} s")
    bw = copy_bandwidth() if dev == "cuda" else None
    rows, pools, overridden = [], {}, {}
    for i, mode in enumerate(args.modes * args.repeats):
        head, *extra = mode.split("+")
        kv, _, tile = head.partition("@")
        settings = dict(zip(("VLMCTL_ATTN_KV8_TILE", "VLMCTL_ATTN_KV8_WARPS"), tile.split("x") if tile else ("", "")))
        settings.update(e.split("=", 1) for e in extra)
        for var in set(overridden) - set(settings):
            os.environ.pop(var, None)
        os.environ.update(settings)
        overridden = settings
        eng, load_s, _ = load_engine(engine_dir, device=dev, kv_cache_dtype=kv)
        dec = eng.decoder
        pools[mode] = {"kv_cache_tokens": eng.limits.kv_cache_tokens, "bytes_per_token": dec.kv_bytes_per_token(),
                       "weight_bytes": step_weight_bytes(eng)}
        log(f"{mode}: loaded in {load_s:.1f} s; {json.dumps(pools[mode])}")
        run(eng, 1, args.prompt_words, 4, 999)  # warm-up of the host side
        for b in args.batches:
            r = run(eng, b, args.prompt_words, args.output_len, seed=1000 * b + i // len(args.modes))
            ctx = r["prompt_tokens"] + args.output_len // 2
            r.update(mode=mode, bound_ms=1000 * (pools[mode]["weight_bytes"] + b * ctx *
                                                 pools[mode]["bytes_per_token"]) / bw if bw else None)
            rows.append(r)
            log(json.dumps(r))
        del eng, dec
        if dev == "cuda":
            torch.cuda.empty_cache()
    log(f"device: {torch.cuda.get_device_name() if dev == 'cuda' else 'cpu'}; copy bandwidth "
        f"{bw / 1e12:.2f} TB/s" if bw else "device: cpu")
    log("| mode | batch | prompt tokens | ms/step | bound ms | tok/s | KV pool tokens |")
    log("| --- | ---: | ---: | --- | ---: | --- | ---: |")
    for mode in args.modes:
        for b in args.batches:
            rs = [r for r in rows if r["batch"] == b and r["mode"] == mode]
            j = lambda k, p: "/".join(f"{r[k]:.{p}f}" for r in rs)  # noqa: E731
            bound = f"{rs[0]['bound_ms']:.2f}" if rs[0]["bound_ms"] else "-"
            log(f"| {mode} | {b} | {rs[0]['prompt_tokens']} | {j('ms_per_step', 2)} | {bound} | {j('tok_s', 0)} | "
                f"{pools[mode]['kv_cache_tokens']} |")
    if args.out:
        args.out.write_text(json.dumps({"copy_bandwidth_Bps": bw, "pools": pools, "runs": rows}, indent=1))


if __name__ == "__main__":
    main()
