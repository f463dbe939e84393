from __future__ import annotations

import sys
from pathlib import Path

import typer

from .common import KvCacheDtypeOption, console, out, print_json


def chat_command(
    engine_dir: Path = typer.Argument(..., help="Engine directory made by `vlmctl build`"),
    prompt: str = typer.Option(None, "--prompt", "-p", help="Ask one question and exit (non-interactive)"),
    image: list[Path] = typer.Option(None, "--image", "-i", help="Image file (repeatable)"),
    video: list[Path] = typer.Option(None, "--video", help="Video file (repeatable; for the families that take "
                                     "videos, README's model table; needs PyAV: pip install 'vlmctl\\[video]')"),
    system: str = typer.Option(None, "--system", help="System message (interactive: /system TEXT changes it)"),
    max_tokens: int = typer.Option(256, "--max-tokens", min=1, help="Maximum new tokens"),
    temperature: float = typer.Option(0.0, "--temperature", help="0 (and anything below 1e-5) is greedy"),
    top_p: float = typer.Option(1.0, "--top-p"),
    top_k: int = typer.Option(0, "--top-k", help="0: no top-k filter"),
    min_p: float = typer.Option(0.0, "--min-p", help="Drop tokens less likely than min_p x the most likely one "
                                                     "(after the temperature); 0: off"),
    presence_penalty: float = typer.Option(0.0, "--presence-penalty", help="-2..2, OpenAI's: subtracted from "
                                           "tokens already in the answer"),
    frequency_penalty: float = typer.Option(0.0, "--frequency-penalty", help="-2..2, OpenAI's: subtracted per "
                                            "occurrence in the answer"),
    repetition_penalty: float = typer.Option(1.0, "--repetition-penalty", help="transformers': divides the "
                                             "logits of tokens in the prompt or answer; 1: off"),
    json_schema: Path = typer.Option(None, "--json-schema", help="Answer with JSON valid for this JSON schema file "
                                     "(a schema, or OpenAI's {name, schema, strict} object)"),
    json_object: bool = typer.Option(False, "--json-object", help="Answer with a JSON object"),
    seed: int = typer.Option(None, "--seed"),
    stop: list[str] = typer.Option(None, "--stop", help="Stop string (repeatable)"),
    device: str = typer.Option(None, "--device", help="cpu or cuda (default: cuda when available)"),
    threads: int = typer.Option(None, "--threads", min=1, help="torch CPU threads (default: the usable CPUs minus "
                                                              "one)"),
    kv_cache_tokens: int = typer.Option(None, "--kv-cache-tokens", min=1, help="KV cache size in tokens (default: "
                                        "from free GPU memory, or max batch x max sequence on a CPU)"),
    kv_cache_dtype: str = KvCacheDtypeOption,
    vision_backend: str = typer.Option("auto", "--vision-backend", help="auto, tensorrt, onnxruntime-gpu, "
                                       "onnxruntime or torch"),
    json_: bool = typer.Option(False, "--json", help="Print {text, token_ids, prompt_tokens, completion_tokens, "
                                                     "finish_reason}"),
):
    from ..errors import InputError, LimitError, OptionError
    from ..host import configure_threads, resolve_device
    from ..media.video import load_video
    from ..repl import run, user_message
    from ..runtime.engine import DEFAULT_MAX_STOP_SEQUENCES, Engine, EngineOptions, load_image
    from ..runtime.grammar import GrammarSpec, schema_file_spec
    from ..runtime.sampling import SamplingParams

    if json_schema is not None and json_object:
        raise OptionError("--json-schema and --json-object: give one of them")
    if prompt is None and json_:
        raise OptionError("--json needs --prompt (the interactive chat has no JSON form)")
    grammar = schema_file_spec(json_schema) if json_schema is not None else \
        GrammarSpec.json_object() if json_object else None
    try:  # the sampling options' ranges are the command line's (exit 2), not a request's
        params = SamplingParams(max_tokens=max_tokens, temperature=temperature, top_p=top_p, top_k=top_k, seed=seed,
                                stop=list(stop or []), min_p=min_p, presence_penalty=presence_penalty,
                                frequency_penalty=frequency_penalty, repetition_penalty=repetition_penalty,
                                grammar=grammar).validate()
    except InputError as e:  # "temperature must be ..." -> "--temperature must be ..."
        name = e.message.split(" ", 1)[0]
        raise OptionError("--" + name.replace("_", "-") + e.message[len(name):] if name.isidentifier()
                          else e.message) from None
    images = [load_image(p) for p in image or []]  # bad paths fail before the engine loads
    videos = [load_video(p) for p in video or []]
    device = resolve_device(device)
    configure_threads(threads)
    # OpenAI's cap of 4 stop strings guards a server against its clients (`serve --max-stop-sequences`); here the
    # stop strings are the user's own command line, which has no such option: every --stop given is taken
    engine = Engine(engine_dir, EngineOptions(device=device, kv_cache_tokens=kv_cache_tokens,
                                              kv_cache_dtype=kv_cache_dtype,
                                              vision_backend=vision_backend,
                                              max_stop_sequences=max(len(params.stop), DEFAULT_MAX_STOP_SEQUENCES)))
    if grammar is not None:
        engine.compile_grammar(grammar)  # a schema the grammar engine refuses fails now, not at the first answer
    if max_tokens > engine.limits.max_output_len:  # now, not at every turn of the interactive chat
        raise LimitError(f"--max-tokens {max_tokens} exceeds this engine's max_output_len {engine.limits.max_output_len}")
    if not json_:
        kv8 = "" if engine.kv_cache_dtype == "auto" else f" ({engine.kv_cache_dtype})"
        kv = f", KV cache {engine.limits.kv_cache_tokens} tokens{kv8}" if engine.limits.kv_cache_tokens else ""
        console.print(f"[dim]{engine.model_name}: {engine.device}, vision {engine.vision_summary}{kv}[/dim]")
    if prompt is not None:
        messages = ([{"role": "system", "content": system}] if system else []) + \
            [user_message(prompt, len(images), len(videos))]
        if json_:
            print_json(engine.chat(messages, images, params, videos=videos).to_json())
            return
        engine.chat(messages, images, params, on_event=lambda ev: _stream(ev.text_delta), videos=videos)
        out.print()
        return
    run(engine, params, system=system, images=images, videos=videos, console=console, out=out)


def _stream(delta: str) -> None:
    if delta:
        sys.stdout.write(delta)
        sys.stdout.flush()
