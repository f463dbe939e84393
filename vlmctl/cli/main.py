"""`vlmctl` entry point. Imports only Typer/Rich at start so `vlmctl --help` is instant."""

from __future__ import annotations

import sys

import typer

from .. import __version__

app = typer.Typer(name="vlmctl", no_args_is_help=True, add_completion=False, pretty_exceptions_enable=False,
                  help="Deploy vision-language models: convert, quantize (AWQ), export vision to ONNX/TensorRT, "
                       "build the decoder, then chat or serve.")


def _version(value: bool):
    if value:
        typer.echo(f"vlmctl {__version__}")
        raise typer.Exit()


@app.callback()
def main(version: bool = typer.Option(False, "--version", callback=_version, is_eager=True,
                                      help="Print the version and exit.")):
    pass


def _register() -> None:
    # Command modules import only Typer/Rich at module level; the library is imported inside them.
    from . import (bench, build, build_llm, build_vision, chat, convert, eval, export_triton, export_vision,
                   quantize, recipes, serve)

    app.command("recipes", help="List the bundled recipes.")(recipes.recipes_command)
    app.command("models", help="List the supported model families.")(recipes.models_command)
    app.command("convert", help="Split a HF VLM checkpoint into vision and decoder parts.")(convert.convert_command)
    app.command("quantize", help="AWQ 4-bit quantization of the decoder only.")(quantize.quantize_command)
    app.command("export-vision", help="Export the vision tower + projector to ONNX and validate it.")(
        export_vision.export_vision_command)
    app.command("build-vision", help="Build a TensorRT engine from the vision ONNX (or record the ONNX Runtime "
                                     "fallback).")(build_vision.build_vision_command)
    app.command("build-llm", help="Build the decoder engine (TensorRT-LLM, or the embedded torch layout).")(
        build_llm.build_llm_command)
    app.command("export-triton", help="Write a Triton Inference Server model repository (tensorrtllm_backend "
                                      "multimodal layout) for an engine with a TensorRT-LLM decoder.")(
        export_triton.export_triton_command)
    app.command("build", help="Run every stage of a recipe (cached per stage).")(build.build_command)
    app.command("chat", help="Chat with an engine directory (interactive, or one-shot with --prompt).")(
        chat.chat_command)
    app.command("serve", help="OpenAI-compatible HTTP server on an engine directory.")(serve.serve_command)
    app.command("bench", help="Benchmark an engine or a running server.")(bench.bench_command)
    app.add_typer(eval.eval_app, name="eval", help="Evaluate a model (perplexity).")


_register()


def cli_main(argv: list[str] | None = None) -> int:
    """Run the CLI; user errors become one line on stderr and a documented exit code (returned)."""
    import click

    from ..errors import VlmctlError

    try:
        app(args=argv, standalone_mode=False)
    except VlmctlError as e:
        sys.stderr.write(f"error: {e.message}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("interrupted\n")
        return 130
    except (typer.Exit, click.exceptions.Exit) as e:
        return e.exit_code
    except (typer.Abort, click.exceptions.Abort):
        sys.stderr.write("aborted\n")
        return 1
    except click.ClickException as e:
        e.show()
        return e.exit_code
    return 0


def run() -> None:
    """Console-script entry point."""
    sys.exit(cli_main())


if __name__ == "__main__":
    run()
