"""Async scheduling at the engine: decode throughput with the next step launched before the host reads the
previous step's tokens (the default on a GPU) against the synchronous engine, on one engine in one process.

The engine is `serving_gpu.py`'s LLaVA-1.5-7B-shaped one (random weights, built by `vlmctl build` with the
engine's defaults, max_batch_size 64), and with --awq its round-to-nearest AWQ twin. For each batch size, B
text-only requests (distinct random words, ~`--prompt-words` x 6.5 tokens each, greedy, EOS ignored,
`--output-len` tokens) run through `Engine.step()` as `generate` runs them; the decode phase is timed from
the step after the last request's first token to the end. The modes alternate (on, off, on, off) so that a
drifting clock or cache state shows up as a spread, not as a difference. The switch is the engine's
`async_scheduling` attribute, which `--no-async-scheduling` sets at load.

Also printed: the GPU's copy bandwidth, for scale (`decode_gpu.py` gives the step's bandwidth bound and the
transformers peer; run it on the same machine).

    python benchmarks/async_scheduling_gpu.py --work /var/tmp/vlmctl-bench [--awq] [--batches 1 8 64]
    python benchmarks/async_scheduling_gpu.py --smoke --work /tmp/smoke      # tiny shapes on the CPU
"""

from __future__ import annotations

import argparse
import json
import random
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent
sys.path.insert(0, str(ROOT))
sys.path.insert(0, str(ROOT.parent / "tests"))

from gpu_timing import copy_bandwidth  # noqa: E402
from serving_gpu import SEVEN_B, SMOKE, build_engine, load_engine, make_awq_engine, make_checkpoint  # noqa: E402


def log(*a):
    print(*a, flush=True)


def words(rng: random.Random, n: int) -> str:
    return " ".join("".join(rng.choice("abcdefghijklmnopqrstuvwxyz") for _ in range(rng.randint(3, 8)))
                    for _ in range(n))


def run(eng, batch: int, prompt_words: int, output_len: int, seed: int) -> dict:
    from vlmctl.runtime.sampling import SamplingParams

    rng = random.Random(seed)
    prompts = [eng.encode_text(words(rng, prompt_words)) for _ in range(batch)]
    params = SamplingParams(max_tokens=output_len, temperature=0, ignore_eos=True)
    reqs = [eng.submit(p, params) for p in prompts]
    while any(not r.output_ids for r in reqs):
        eng.step()
    steps0, ahead0, toks0 = eng.steps, eng.steps_ahead, sum(len(r.output_ids) for r in reqs)
    if torch.cuda.is_available():
        torch.cuda.synchronize()
    t0 = time.perf_counter()
    while any(not r.finished for r in reqs):
        eng.step()
    wall = time.perf_counter() - t0
    toks = sum(len(r.output_ids) for r in reqs) - toks0
    steps = eng.steps - steps0
    while eng.has_work():  # a step launched ahead for requests that had ended: read and dropped
        eng.step()
    return {"batch": batch, "async": eng.async_scheduling, "prompt_tokens": int(np.mean([len(p.token_ids)
                                                                                        for p in prompts])),
            "decode_steps": steps, "steps_ahead": eng.steps_ahead - ahead0, "decode_s": wall,
            "ms_per_step": 1000 * wall / max(1, steps), "tok_s": toks / wall}


def bench(engine_dir: Path, label: str, args) -> dict:
    eng, load_s, _ = load_engine(engine_dir)
    default = eng.async_scheduling
    log(f"{label}: loaded in {load_s:.1f} s; async scheduling by default: {default}")
    rows = []
    run(eng, 1, args.prompt_words, 8, 999)  # warm-up (graphs are captured at load; this warms the host side)
    for b in args.batches:
        for i, mode in enumerate([True, False] * args.repeats):
            eng.async_scheduling = mode
            r = run(eng, b, args.prompt_words, args.output_len, seed=1000 * b + i)
            r["engine"] = label
            rows.append(r)
            log(json.dumps(r))
    eng.async_scheduling = default
    del eng
    if torch.cuda.is_available():
        torch.cuda.empty_cache()
    return {"label": label, "load_s": load_s, "default_async": default, "runs": rows}


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--work", type=Path, default=Path("/var/tmp/vlmctl-bench"))
    ap.add_argument("--awq", action="store_true", help="also the AWQ engine (round-to-nearest int4, group 128)")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (async forced on for one mode)")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-words", type=int, default=80)
    ap.add_argument("--output-len", type=int, default=128)
    ap.add_argument("--repeats", type=int, default=2)
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    dev = "cuda" if torch.cuda.is_available() and not args.smoke else "cpu"
    args.work.mkdir(parents=True, exist_ok=True)
    shape = SMOKE if args.smoke else SEVEN_B
    if args.smoke:
        args.batches, args.output_len, args.prompt_words = [min(b, 8) for b in args.batches], 12, 6
    t0 = time.perf_counter()
    ckpt = make_checkpoint(args.work / "ckpt", shape, dev)
    engine, build_s = build_engine(ckpt, args.work, "float16" if dev == "cuda" else "float32")
    log(f"checkpoint and engine in {time.perf_counter() - t0:.0f} s (build {build_s:.0f} s)")
    bw = copy_bandwidth() if dev == "cuda" else None
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "copy_bandwidth_Bps": bw,
           "engines": [bench(engine, "fp16", args)]}
    if args.awq:
        res["engines"].append(bench(make_awq_engine(engine, args.work, 128), "awq", args))
    log(f"device: {res['device']}; copy bandwidth {bw / 1e12:.2f} TB/s" if bw else "device: cpu")
    log("| engine | batch | async ms/step | sync ms/step | async tok/s | sync tok/s |")
    log("| --- | ---: | ---: | ---: | ---: | ---: |")
    for e in res["engines"]:
        for b in args.batches:
            on = [r for r in e["runs"] if r["batch"] == b and r["async"]]
            off = [r for r in e["runs"] if r["batch"] == b and not r["async"]]
            fmt = lambda rs, k: "/".join(f"{r[k]:.2f}" if k == "ms_per_step" else f"{r[k]:.0f}" for r in rs)  # noqa: E731
            log(f"| {e['label']} | {b} | {fmt(on, 'ms_per_step')} | {fmt(off, 'ms_per_step')} | {fmt(on, 'tok_s')} "
                f"| {fmt(off, 'tok_s')} |")
    if args.out:
        args.out.write_text(json.dumps(res, indent=1))


if __name__ == "__main__":
    main()
