from __future__ import annotations

import json
from pathlib import Path

import typer

from .common import JsonOption, console, out, print_json, progress_for


def bench_command(
    engine_dir: Path = typer.Argument(None, help="Engine directory to benchmark offline (omit with --url)"),
    url: str = typer.Option(None, "--url", help="Benchmark a running OpenAI-compatible server instead "
                                                "(e.g. http://127.0.0.1:23333)"),
    num_requests: int = typer.Option(32, "--num-requests", "-n", help="Requests per run"),
    concurrency: list[int] = typer.Option(None, "--concurrency", "-c", help="Requests in flight (repeatable: one "
                                          "run per value; default 8)"),
    images: int = typer.Option(1, "--images", help="Images per request"),
    image_size: str = typer.Option("224x224", "--image-size", help="WIDTHxHEIGHT of the random images"),
    prompt_len: int = typer.Option(32, "--prompt-len", help="Words of prompt text besides the images"),
    output_len: int = typer.Option(64, "--output-len", help="Tokens generated per request (EOS ignored)"),
    same_image: bool = typer.Option(False, "--same-image", help="Send the same image(s) in every request "
                                    "(exercises the image-feature cache)"),
    temperature: float = typer.Option(0.0, "--temperature"),
    seed: int = typer.Option(0, "--seed"),
    warmup: int = typer.Option(1, "--warmup", help="Untimed requests before each run"),
    max_batch_size: int = typer.Option(None, "--max-batch-size", help="Engine mode: KV-cache slots (default: "
                                       "the engine's built limit)"),
    device: str = typer.Option(None, "--device", help="Engine mode: cpu or cuda"),
    threads: int = typer.Option(None, "--threads", min=1, help="Engine mode: torch CPU threads (default: the "
                                                              "usable CPUs minus one)"),
    async_scheduling: bool | None = typer.Option(None, "--async-scheduling/--no-async-scheduling",
                                                 help="Engine mode: launch each decode step before the previous "
                                                 "step's tokens are read [default: on with a GPU]",
                                                 show_default=False),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="Engine mode: KV cache storage, auto, "
                                       "int8 or fp8 (as `serve --kv-cache-dtype`)"),
    model: str = typer.Option(None, "--model", help="URL mode: model id (default: the server's first)"),
    api_key: str = typer.Option(None, "--api-key", envvar="VLMCTL_API_KEY", help="URL mode: bearer key"),
    timeout: float = typer.Option(600.0, "--timeout", help="URL mode: seconds allowed per request"),
    out_file: Path = typer.Option(None, "--out", help="Also write the JSON result to this file"),
    json_: bool = JsonOption,
):
    from ..measure.bench import BenchConfig, bench_engine, bench_url, check_url
    from ..errors import InputError, OptionError, RequestError

    if (engine_dir is None) == (url is None):
        raise OptionError("give an ENGINE_DIR (offline) or --url (a running server), not both" if url else
                          "give an ENGINE_DIR (offline) or --url (a running server)")
    try:
        w, h = (int(x) for x in image_size.lower().split("x"))
    except ValueError:
        raise OptionError(f"--image-size {image_size!r}: expected WIDTHxHEIGHT, e.g. 224x224") from None
    if not timeout > 0:  # httpx would time out at once, reported as an unreachable server
        raise OptionError(f"--timeout {timeout}: must be a positive number of seconds")
    if out_file is not None:  # checked before the run, not after it: a bench can take an hour
        _check_out_file(out_file)
    levels = list(concurrency or [8])
    try:  # the command line's values: exit 2
        if url is not None:
            check_url(url)
        configs = [BenchConfig(num_requests=num_requests, concurrency=c, images_per_request=images,
                               image_size=(w, h), prompt_len=prompt_len, output_len=output_len,
                               temperature=temperature, same_image=same_image, seed=seed, run=i,
                               warmup=warmup).validate()
                   for i, c in enumerate(levels)]
    except InputError as e:
        raise OptionError(e.message) from None
    engine = None
    if engine_dir is not None:
        from ..host import configure_threads, resolve_device
        from ..runtime.engine import Engine

        device = resolve_device(device)
        configure_threads(threads)
        engine = Engine(engine_dir, device=device, max_batch_size=max_batch_size, async_scheduling=async_scheduling,
                        kv_cache_dtype=kv_cache_dtype)
        slots = engine.limits["max_batch_size"]
        if max(levels) > slots and not json_:
            console.print(f"[yellow]note:[/yellow] concurrency {max(levels)} > {slots} KV-cache slots: the extra "
                          "requests wait (raise --max-batch-size to batch them)")
    runs = []
    with progress_for(json_) as progress:
        for cfg in configs:
            if engine is not None:
                runs.append(bench_engine(engine, cfg, progress))
            else:
                runs.append(bench_url(url, cfg, model=model, api_key=api_key, timeout_s=timeout, progress=progress))
    result = {"runs": runs}
    if len(runs) > 1 and runs[0]["output_throughput"]:
        result["output_throughput_vs_first"] = [round(r["output_throughput"] / runs[0]["output_throughput"], 3)
                                                for r in runs]
    if out_file is not None:
        out_file.parent.mkdir(parents=True, exist_ok=True)
        out_file.write_text(json.dumps(result, indent=2) + "\n")
    if json_:
        print_json(result)
    else:
        _render(result)
    failed = sum(r["failed"] for r in runs)
    if failed:  # the figures above cover only the requests that completed: not a clean run (exit 1)
        first = next((e for r in runs for e in r["errors"]), "none given")
        raise RequestError(f"{failed} of {sum(r['config']['num_requests'] for r in runs)} requests failed (first "
                           f"error: {first}); the figures cover only the completed ones")


def _check_out_file(out_file: Path) -> None:
    """OptionError unless `out_file` could be written after the run; creates nothing (a bench that then fails
    leaves no trace)."""
    import os

    from ..errors import OptionError

    if out_file.is_dir():
        raise OptionError(f"--out {out_file}: is a directory; give a file name")
    nearest = out_file.absolute().parent
    while not nearest.exists() and nearest != nearest.parent:  # the directory its missing parents would go in
        nearest = nearest.parent
    if not nearest.is_dir() or not os.access(nearest, os.W_OK | os.X_OK):
        raise OptionError(f"--out {out_file}: cannot be written ({nearest} is not a writable directory)")


def _render(result: dict) -> None:
    from rich.table import Table

    runs = result["runs"]
    first = runs[0]
    cfg = first["config"]
    out.print(f"[bold]{first['mode']} bench[/bold] {first['target']} — {cfg['num_requests']} requests, "
              f"{cfg['images_per_request']} image(s) {cfg['image_size']}, ~{first.get('mean_prompt_tokens')} prompt "
              f"tokens, {cfg['output_len']} output tokens")
    # One column per run, one row per figure: stays readable in a narrow terminal.
    t = Table(show_edge=False)
    t.add_column("concurrency")
    for r in runs:
        t.add_column(str(r["config"]["concurrency"]), justify="right")

    def fmt(v, digits=1):
        return "-" if v is None else f"{v:.{digits}f}"

    t.add_row("requests/s", *(fmt(r["request_throughput"], 3) for r in runs))
    t.add_row("output tokens/s", *(fmt(r["output_throughput"]) for r in runs))
    for key, label in (("ttft_ms", "TTFT ms"), ("tpot_ms", "TPOT ms"), ("itl_ms", "ITL ms"), ("e2e_ms", "E2E ms")):
        for stat in ("mean", "median", "p99"):
            t.add_row(f"{label} {stat}", *(fmt(r[key][stat]) for r in runs))
    t.add_row("max running batch", *("-" if r.get("max_running") is None else str(r["max_running"]) for r in runs))
    t.add_row("mean batch", *(fmt(r.get("mean_batch_size"), 2) for r in runs))
    if first["mode"] == "engine":
        t.add_row("preemptions", *("-" if r.get("preemptions") is None else str(r["preemptions"]) for r in runs))
    t.add_row("failed", *(str(r["failed"]) for r in runs))
    out.print(t)
    if "output_throughput_vs_first" in result:
        ratios = ", ".join(f"c={r['config']['concurrency']}: {x:.2f}x"
                           for r, x in zip(runs, result["output_throughput_vs_first"]))
        out.print(f"output tok/s relative to the first run: {ratios}")
