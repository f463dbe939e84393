"""`vlmctl eval ppl MODEL --data FILE`: perplexity of a float or AWQ decoder, a workspace or an engine."""

from __future__ import annotations

from pathlib import Path

import typer

from .common import JsonOption, console, out, print_json, progress_for

eval_app = typer.Typer(no_args_is_help=True, help="Evaluate a model.")


@eval_app.command("ppl", help="Perplexity over consecutive windows of a text file (WikiText protocol).")
def ppl_command(
    model: Path = typer.Argument(..., help="HF causal-LM directory (float or AWQ), a workspace, or an engine directory"),
    data: str = typer.Option(..., "--data", help=".txt or .jsonl file (or a datasets NAME:CONFIG@SPLIT, config and split optional)"),
    seq_len: int = typer.Option(512, "--seq-len", min=2, help="Tokens per window"),
    samples: int = typer.Option(None, "--samples", min=1, help="Windows to score (default: all)"),
    dtype: str = typer.Option(None, "--dtype", help="Compute dtype for HF directories (default: float32); an engine "
                              "runs in the dtype it was built in (another --dtype is refused)"),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)"),
    threads: int = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: the usable CPUs minus "
                                                              "one)"),
    kv_cache_dtype: str = typer.Option("auto", "--kv-cache-dtype", help="auto, int8 or fp8: attention reads K/V "
                                       "as `serve --kv-cache-dtype` stores them (the quality cost on this model)"),
    json_: bool = JsonOption,
):
    from ..errors import OptionError
    from ..measure.perplexity import evaluate_perplexity

    if dtype is not None and dtype not in ("float32", "float16", "bfloat16"):
        raise OptionError(f"--dtype {dtype!r}: expected float32, float16 or bfloat16")
    from ..host import configure_threads, resolve_device

    device = resolve_device(device)
    configure_threads(threads)
    with progress_for(json_) as progress:
        res = evaluate_perplexity(model, data, seq_len=seq_len, samples=samples, dtype=dtype, device=device,
                                  base_dir=Path.cwd(), progress=progress, kv_cache_dtype=kv_cache_dtype)
    if json_:
        print_json(res)
    else:
        out.print(f"perplexity: {res['perplexity']:.4f}")
        kv = "" if kv_cache_dtype == "auto" else f"; {kv_cache_dtype} KV"
        console.print(f"  {res['samples']} windows × {res['seq_len']} tokens of {data}; decoder {res['decoder_dir']} "
                      f"({res['quantization']}{kv})")
