"""`vlmctl quantize [--awq] SRC`: AWQ 4-bit quantization of the language part only (pipeline.quantize)."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import JsonOption, SetOption, command_line_sets, console, print_json, progress_for, render_stage


def quantize_command(
    source: Path = typer.Argument(..., help="A work directory (vlmctl convert/build), a conversion workspace, a HF "
                                            "VLM checkpoint, or a plain HF Llama-family causal LM directory"),
    output: Path = typer.Option(None, "-o", "--output",
                                help="Output directory (required, except for a work directory: that gets quantize/, "
                                     "and -o with it is refused)"),
    awq: bool = typer.Option(True, "--awq", help="AWQ 4-bit weights, group-wise with zero points. AWQ is the only "
                                                 "method and the default: the flag only names it, with or without "
                                                 "it the command does the same"),
    group_size: int = typer.Option(None, "--group-size", help="Input channels per quantization group (default 128)"),
    calib_data: str = typer.Option(None, "--calib-data",
                                   help=".txt or .jsonl file, or a Hugging Face dataset NAME:CONFIG@SPLIT "
                                        "(config and split optional; needs `datasets`); default: a small built-in text"),
    calib_samples: int = typer.Option(None, "--calib-samples", help="Calibration blocks (default 128)"),
    calib_seq_len: int = typer.Option(None, "--calib-seq-len", help="Tokens per calibration block (default 512)"),
    duo_scaling: bool = typer.Option(None, "--duo-scaling/--no-duo-scaling",
                                     help="AutoAWQ's scale formula with a weight term (default on, as in AutoAWQ)"),
    impl: str = typer.Option(None, "--impl", help="vlmctl (default) or autoawq (needs the `autoawq` package)"),
    dtype: str = typer.Option(None, "--dtype", help="Float dtype for a VLM checkpoint's conversion (default float16)"),
    threads: int = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: the usable CPUs minus "
                                                              "one)"),
    overrides: list[str] = SetOption,
    force: bool = typer.Option(False, "--force", help="Re-run (work directory) or replace an existing OUTPUT"),
    json_: bool = JsonOption,
):
    from ..host import configure_threads

    n_threads = configure_threads(threads)
    sets = ["quantization.method=awq"]
    for key, value in (("group_size", group_size), ("duo_scaling", duo_scaling), ("impl", impl),
                       ("calibration.samples", calib_samples), ("calibration.seq_len", calib_seq_len)):
        if value is not None:
            sets.append(f"quantization.{key}={str(value).lower() if isinstance(value, bool) else value}")
    if calib_data is not None:
        sets.append(f"quantization.calibration.data={calib_data}")
    sets += list(overrides or [])
    if dtype:
        sets.append(f"dtype={dtype}")
    sets = command_line_sets(sets)  # --calib-data FILE is relative to the current directory, in every form

    from ..pipeline import quantize

    with progress_for(json_) as progress:
        res = quantize(source, output, sets, force=force, progress=progress)
    if isinstance(res, dict):  # quantized into OUTPUT
        res["threads"] = n_threads
        if json_:
            print_json(res)
        else:
            console.print(f"[green]✓[/green] quantize: wrote {output}")
            _render_summary(res)
    elif json_:  # a work directory's stage
        print_json({**res.to_json(), "threads": n_threads})
    else:
        render_stage(res)
        _render_summary({**res.info, "threads": n_threads})


def _render_summary(info: dict) -> None:
    if not info:
        return
    parts = []
    if "layers" in info:
        parts.append(f"{info['layers']} layers")
    if "group_size" in info:
        parts.append(f"group size {info['group_size']}")
    cal = info.get("calibration") or {}
    if cal:
        parts.append(f"calibration {cal.get('samples')}×{cal.get('seq_len')} tokens")
    if "threads" in info:
        parts.append(f"{info['threads']} CPU threads")
    if "wall_s" in info:
        parts.append(f"{info['wall_s']:.1f} s")
    if "peak_rss_mib" in info:
        parts.append(f"peak RSS {info['peak_rss_mib']:.0f} MiB")
    console.print("  " + ", ".join(parts))
