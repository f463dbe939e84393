"""The paged prompt kernel in several versions, one process: captured 7B prompt steps and one layer's attention
with each version of `vlmctl/runtime/kernels/paged_prefill.py` in turn, in rounds, so that machine-to-machine and
process-to-process differences (±0.3 ms a step on H100s) do not decide an A/B.

    python benchmarks/prompt_kernel_variants_gpu.py --variants before=/path/to/old/paged_prefill.py \
        now=vlmctl/runtime/kernels/paged_prefill.py [--chunks 0:384 512:81 1888:92] [--attention 1888:92] \
        [--rounds 2] [--repeats 5] [--out results.json]
    python benchmarks/prompt_kernel_variants_gpu.py --smoke --variants ...   # tiny shapes on the CPU (checks the
                                                                            # harness; the CPU runs no kernel)

A version is any copy of the module with the same public functions (e.g. `git show REV:vlmctl/runtime/kernels/
paged_prefill.py > old.py`); it is loaded beside the engine's own, and the engine's callers (captured steps, the eager
forward, chunk_attention) are pointed at its functions while it is timed.
"""

from __future__ import annotations

import argparse
import importlib.util
import json
import statistics
import sys
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_gpu as D  # noqa: E402
import prompt_host_gpu as P  # noqa: E402

PATCHED = ("prompt_attention", "chunk_attention", "split_workspace")  # what the engine calls, each version its own


def load_variant(name: str, path: Path):
    """The module at `path` as a sibling of vlmctl.runtime.kernels.paged_prefill (its relative imports resolve)."""
    spec = importlib.util.spec_from_file_location(f"vlmctl.runtime.kernels._prompt_variant_{name}", path)
    mod = importlib.util.module_from_spec(spec)
    spec.loader.exec_module(mod)
    return mod


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n\n")[0])
    ap.add_argument("--variants", nargs="+", required=True, metavar="NAME=PATH")
    ap.add_argument("--chunks", nargs="+", default=["0:384", "0:128", "512:81", "1888:16", "1888:92"],
                    metavar="START:N")
    ap.add_argument("--attention", nargs="*", default=[], metavar="START:N")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--rounds", type=int, default=2)
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.smoke:
        D.DEV, shape, args.layers, args.attention = "cpu", D.SMOKE, 2, []
        args.chunks = ["0:12", "20:6"]
    elif not torch.cuda.is_available():
        sys.exit("prompt_kernel_variants_gpu.py times GPU kernels: no GPU here (--smoke checks the script on the CPU)")
    else:
        shape = D.SHAPE
    from vlmctl.runtime.kernels import paged_prefill

    own = {f: getattr(paged_prefill, f) for f in PATCHED}
    variants = {}
    for spec in args.variants:
        name, path = spec.split("=", 1)
        variants[name] = load_variant(name, Path(path))
    cfg = D.llama7b_config(args.layers, shape)
    sd = D.random_hf_state(cfg, D.DEV)
    dec = D.make_decoder(cfg, sd, None)
    del sd
    rows = []
    for rnd in range(args.rounds):
        for name, mod in variants.items():
            for f in PATCHED:
                setattr(paged_prefill, f, getattr(mod, f))
            try:
                for r in P.attention_times(args.attention) if args.attention else []:
                    rows.append({"round": rnd, "variant": name, "kind": "attention", **r})
                    P.log(json.dumps(rows[-1]))
                dec.allocate_cache(P.pool_blocks(dec, args.chunks, 0), 16)
                if D.DEV == "cuda":  # the last version's steps and pool, freed
                    torch.cuda.empty_cache()
                dec.capture_step_graphs(16, 2048)
                for i, spec in enumerate(args.chunks):
                    start, n = (int(v) for v in spec.split(":"))
                    r = P.time_forward(dec, P.chunks_of(dec, start, n, i), args.repeats)
                    rows.append({"round": rnd, "variant": name, "kind": "step", "start": start, "n": n, **r,
                                 "module": paged_prefill.prompt_attention.__module__})
                    P.log(json.dumps(rows[-1]))
            finally:
                for f, fn in own.items():
                    setattr(paged_prefill, f, fn)
    device = torch.cuda.get_device_name() if D.DEV == "cuda" else "cpu (smoke)"
    P.log(f"device: {device}; {args.layers} layers; GPU ms a captured step (wall on the CPU), median over rounds")
    names = list(variants)
    P.log("| cached | new | " + " | ".join(names) + " |")
    P.log("| ---: | ---: | " + " | ".join("---:" for _ in names) + " |")
    for spec in args.chunks:
        start, n = (int(v) for v in spec.split(":"))
        cells = []
        for name in names:
            xs = [r["gpu_ms"] or r["wall_ms"] for r in rows if r["kind"] == "step" and r["variant"] == name
                  and r["start"] == start and r["n"] == n]
            cells.append(f"{statistics.median(xs):.3f} ({', '.join(f'{x:.2f}' for x in xs)})")
        P.log(f"| {start} | {n} | " + " | ".join(cells) + " |")
    if args.out:
        args.out.write_text(json.dumps(rows, indent=1))


if __name__ == "__main__":
    main()
