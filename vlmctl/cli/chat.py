from __future__ import annotations

import sys
from pathlib import Path

import typer

from .common import console, out, print_json


def chat_command(
    engine_dir: Path = typer.Argument(..., help="Engine directory made by `vlmctl build`"),
    prompt: str = typer.Option(None, "--prompt", "-p", help="Ask one question and exit (non-interactive)"),
    image: list[Path] = typer.Option(None, "--image", "-i", help="Image file (repeatable)"),
    video: list[Path] = typer.Option(None, "--video", help="Video file (repeatable; Qwen2-VL, Qwen2.5-VL, "
                                     "LLaVA-OneVision; needs PyAV: pip install 'vlmctl[video]')"),
    system: str = typer.Option(None, "--system", help="System message"),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="Maximum new tokens"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 (and anything below 1e-5) is greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0: no top-k filter"),
    seed: int = typer.Option(None, "--seed"),
    stop: list[str] = typer.Option(None, "--stop", help="Stop string (repeatable)"),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)"),
    threads: int = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: the usable CPUs minus "
                                                              "one)"),
    kv_cache_tokens: int = typer.Option(None, "--kv-cache-tokens", min=1, help="KV cache size in tokens (default: "
                                        "from free GPU memory, or max batch x max sequence on a CPU)"),
    vision_backend: str = typer.Option("auto", "--vision-backend", help="auto, tensorrt, onnxruntime-gpu, "
                                       "onnxruntime or torch"),
    json_: bool = typer.Option(False, "--json", help="Print {text, token_ids, prompt_tokens, completion_tokens, "
                                                     "finish_reason}"),
):
    from ..host import configure_threads, resolve_device
    from ..media.video import load_video
    from ..runtime.engine import Engine, EngineOptions, load_image
    from ..runtime.sampling import SamplingParams

    params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                            stop=list(stop or [])).validate()
    images = [load_image(p) for p in image or []]  # bad paths fail before the engine loads
    videos = [load_video(p) for p in video or []]
    if prompt is None and json_:
        from ..errors import InputError

        raise InputError("--json needs --prompt (the interactive chat has no JSON form)")
    device = resolve_device(device)
    configure_threads(threads)
    engine = Engine(engine_dir, EngineOptions(device=device, kv_cache_tokens=kv_cache_tokens,
                                              vision_backend=vision_backend))
    base = [{"role": "system", "content": system}] if system else []
    if not json_:
        kv = f", KV cache {engine.limits.kv_cache_tokens} tokens" if engine.limits.kv_cache_tokens else ""
        console.print(f"[dim]{engine.model_name}: {engine.device}, vision {engine.vision.backend}{kv}[/dim]")
    if prompt is not None:
        messages = base + [user_message(prompt, len(images), len(videos))]
        if json_:
            print_json(engine.chat(messages, images, params, videos=videos).to_json())
            return
        engine.chat(messages, images, params, on_event=lambda ev: _stream(ev.text_delta), videos=videos)
        out.print()
        return
    _repl(engine, params, base, images, videos)


def user_message(text: str, n_images: int, n_videos: int = 0) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos
            + [{"type": "text", "text": text}]}


def _stream(delta: str) -> None:
    if delta:
        sys.stdout.write(delta)
        sys.stdout.flush()


def _repl(engine, params, base: list[dict], pending_images: list, pending_videos: list = ()) -> None:
    from ..errors import VlmctlError
    from ..runtime.engine import load_image

    console.print(f"[bold]vlmctl chat[/bold] — {engine.model_name} ({engine.device}). "
                  "Commands: /image PATH, /reset, /exit")
    history: list[dict] = list(base)
    images: list = []
    pending = list(pending_images)
    videos, pending_v = [], list(pending_videos)  # --video files go with the first message
    while True:
        try:
            line = console.input("[bold cyan]you>[/bold cyan] ").strip()
        except (EOFError, KeyboardInterrupt):
            console.print()
            return
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            history, images, pending, videos, pending_v = list(base), [], [], [], []
            console.print("[dim]conversation reset[/dim]")
            continue
        if line.startswith("/image"):
            path = line[len("/image"):].strip()
            try:
                pending.append(load_image(path))
                console.print(f"[dim]image attached to your next message: {path}[/dim]")
            except VlmctlError as e:
                console.print(f"[red]error:[/red] {e}")
            continue
        if line.startswith("/"):
            console.print("[red]unknown command[/red] (use /image PATH, /reset, /exit)")
            continue
        msg = user_message(line, len(pending), len(pending_v))
        try:
            out.print("[bold green]assistant>[/bold green] ", end="")
            res = engine.chat(history + [msg], images + pending, params, on_event=lambda ev: _stream(ev.text_delta),
                              videos=videos + pending_v)
        except VlmctlError as e:
            console.print(f"\n[red]error:[/red] {e}")
            continue
        out.print()
        history += [msg, {"role": "assistant", "content": [{"type": "text", "text": res.text}]}]
        images += pending
        videos += pending_v
        pending, pending_v = [], []
