"""`vlmctl export-triton ENGINE -o REPO`: a Triton Inference Server model repository (tensorrtllm_backend
1.2's multimodal layout) for an engine directory with a TensorRT-LLM decoder."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import JsonOption, console, print_json, progress_for


def export_triton_command(
    engine: Path = typer.Argument(..., help="Engine directory (vlmctl build) whose decoder is a TensorRT-LLM engine"),
    output: Path = typer.Option(..., "-o", "--output", help="Model repository to create"),
    streaming: bool = typer.Option(False, "--streaming", help="Decoupled tensorrt_llm model: requests may stream"),
    kv_cache_reuse: bool = typer.Option(False, "--kv-cache-reuse",
                                        help="Enable KV-cache block reuse; every request must then send "
                                             "prompt_table_extra_id naming its image content"),
    kv_cache_fraction: float = typer.Option(None, "--kv-cache-fraction",
                                            help="GPU memory share for the KV cache, below 0.9 (default: the "
                                                 "recipe's decoder.kv_cache_free_gpu_memory_fraction)"),
    stock_models: str = typer.Option("/app/all_models", "--stock-models",
                                     help="tensorrtllm_backend's all_models directory: copied when it is here, "
                                          "else linked (the default is the path inside NVIDIA's Triton container)"),
    mounts: list[str] = typer.Option(None, "--mount",
                                     help="HOST_DIR=SERVER_DIR: where the server sees a host directory (as docker -v); "
                                          "repeatable"),
    force: bool = typer.Option(False, "--force",
                               help="Replace a repository export-triton wrote before (or an empty directory); never "
                                    "another directory or a file"),
    json_: bool = JsonOption,
):
    from ..export.triton_repo import export_triton_repo

    with progress_for(json_) as progress:
        res = export_triton_repo(engine, output, streaming=streaming, kv_cache_reuse=kv_cache_reuse,
                                 kv_cache_fraction=kv_cache_fraction, stock_models=stock_models,
                                 mounts=mounts or [], force=force, progress=progress)
    if json_:
        print_json(res)
        return
    console.print(f"[green]✓[/green] export-triton: {res['repository']} ({res['family']} as the stock "
                  f"{res['stock_model_type']!r} models; stock model files {res['stock_files']})")
    console.print(f"  launch (inside the Triton TensorRT-LLM container): {' '.join(res['launch'])}")
    console.print("  [yellow]note:[/yellow] " + res["note"])
