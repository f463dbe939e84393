"""How long vlmctl's AWQ takes on a model of real size, and how much memory it holds.

Writes a random fp16 checkpoint with the shape of LLaVA-1.5-7B's language model (Llama-2-7B:
32 layers, hidden 4096; `--layers` fewer for a quick look) into `--workdir`, then runs
`quantize_causal_lm` on random calibration tokens (AutoAWQ's defaults: 128 x 512) on `--device`.
Random weights make the quality meaningless but not the work: every search does the same
arithmetic on any values. Prints the time per decoder layer as it goes, then a JSON summary
(wall time, time per layer, peak GPU memory, peak RSS).

    python benchmarks/awq_speed.py --device cuda [--layers 32] [--samples 128] [--seq-len 512]
"""

from __future__ import annotations

import argparse
import json
import shutil
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parent))
sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


class PrintingProgress:
    """Prints one line per finished decoder layer (the library itself never prints)."""

    def __init__(self):
        self.t0 = time.perf_counter()

    def task(self, description, total=None):
        progress = self

        class Task:
            n = 0
            last = time.perf_counter()

            def advance(self, amount=1.0):
                now = time.perf_counter()
                self.n += 1
                print(f"{description}: {self.n}/{total} in {now - self.last:.1f} s "
                      f"(total {now - progress.t0:.1f} s)", flush=True)
                self.last = now

            def done(self):
                pass

        return Task()

    def log(self, message):
        print(message, flush=True)


def write_random_checkpoint(out: Path, layers: int, device: str) -> Path:
    import torch
    from safetensors.torch import save_file
    from transformers import LlamaConfig

    from decode_gpu import llama7b_config, random_hf_state

    cfg = llama7b_config(layers)
    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    tmp.mkdir(parents=True)
    LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}, torch_dtype="float16").save_pretrained(tmp)
    sd = random_hf_state(cfg, device)
    index, shard, size, n = {}, {}, 0, 0

    def flush():
        nonlocal shard, size, n
        if shard:
            name = f"model-{n:05d}.safetensors"
            save_file({k: v.contiguous().cpu() for k, v in shard.items()}, str(tmp / name))
            index.update({k: name for k in shard})
            shard, size, n = {}, 0, n + 1

    for k, v in sd.items():
        shard[k] = v
        size += v.numel() * v.element_size()
        if size >= 2 << 30:
            flush()
    flush()
    (tmp / "model.safetensors.index.json").write_text(json.dumps({"metadata": {}, "weight_map": index}))
    del sd
    if device.startswith("cuda"):
        torch.cuda.empty_cache()
    tmp.rename(out)
    return out


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--device", default="cuda")
    p.add_argument("--layers", type=int, default=32)
    p.add_argument("--samples", type=int, default=128)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--group-size", type=int, default=128)
    p.add_argument("--no-duo-scaling", action="store_true")
    p.add_argument("--workdir", type=Path, default=Path("/tmp/vlmctl-awq-speed"))
    p.add_argument("--profile", action="store_true", help="print the functions that took the most time (cProfile)")
    a = p.parse_args()

    import torch

    from vlmctl.quant.awq import quantize_causal_lm
    from vlmctl.recipe import QuantizationSettings

    t = time.perf_counter()
    src = write_random_checkpoint(a.workdir / f"llama7b-{a.layers}l", a.layers, a.device)
    print(f"random checkpoint: {time.perf_counter() - t:.1f} s", flush=True)
    s = QuantizationSettings(method="awq", group_size=a.group_size, duo_scaling=not a.no_duo_scaling,
                             calibration={"samples": a.samples, "seq_len": a.seq_len})
    ids = torch.randint(0, 32000, (a.samples, a.seq_len), generator=torch.Generator().manual_seed(0))
    out = a.workdir / "awq"
    shutil.rmtree(out, ignore_errors=True)
    if a.device.startswith("cuda"):
        torch.cuda.reset_peak_memory_stats()
    if a.profile:
        import cProfile
        import pstats

        prof = cProfile.Profile()
        summary = prof.runcall(quantize_causal_lm, src, out, s, progress=PrintingProgress(), device=a.device,
                               calib_ids=ids)
        pstats.Stats(prof).sort_stats("tottime").print_stats(20)
    else:
        summary = quantize_causal_lm(src, out, s, progress=PrintingProgress(), device=a.device, calib_ids=ids)
    summary["seconds_per_layer"] = round(summary["wall_s"] / a.layers, 2)
    if a.device.startswith("cuda"):
        summary["peak_gpu_mib"] = round(torch.cuda.max_memory_allocated() / 2**20, 1)
        summary["gpu"] = torch.cuda.get_device_name()
    summary["checkpoint_gib"] = round(sum(f.stat().st_size for f in out.glob("*.safetensors")) / 2**30, 2)
    print(json.dumps(summary, indent=2), flush=True)


if __name__ == "__main__":
    main()
