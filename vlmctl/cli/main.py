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
    from . import build, build_llm, build_vision, chat, convert, export_vision, recipes

    app.command("recipes", help="List the bundled recipes.")(recipes.recipes_command)
    app.command("models", help="List the supported model families.")(recipes.models_command)
    app.command("convert", help="Split a HF VLM checkpoint into vision and decoder parts.")(convert.convert_command)
    _register_optional()
    app.command("export-vision", help="Export the vision tower + projector to ONNX and validate it.")(
        export_vision.export_vision_command)
    app.command("build-vision", help="Build a TensorRT engine from the vision ONNX (or record the ONNX Runtime "
                                     "fallback).")(build_vision.build_vision_command)
    app.command("build-llm", help="Build the decoder engine (TensorRT-LLM, or the embedded torch layout).")(
        build_llm.build_llm_command)
    app.command("build", help="Run every stage of a recipe (cached per stage).")(build.build_command)
    app.command("chat", help="Chat with an engine directory (interactive, or one-shot with --prompt).")(
        chat.chat_command)


def _register_optional() -> None:
    """Commands from other modules; each is added when its module exists."""
    import importlib

    for module, attr, name, help_text, kind in (
        ("quantize", "quantize_command", "quantize", "AWQ 4-bit quantization of the decoder only.", "command"),
        ("eval", "eval_app", "eval", "Evaluate a model (perplexity).", "group"),
        ("serve", "serve_command", "serve", "OpenAI-compatible HTTP server on an engine directory.", "command"),
        ("bench", "bench_command", "bench", "Benchmark an engine or a running server.", "command"),
    ):
        try:
            mod = importlib.import_module(f"vlmctl.cli.{module}")
        except ModuleNotFoundError as e:
            if e.name == f"vlmctl.cli.{module}":
                continue
            raise
        obj = getattr(mod, attr)
        if kind == "group":
            app.add_typer(obj, name=name, help=help_text)
        else:
            app.command(name, help=help_text)(obj)


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
