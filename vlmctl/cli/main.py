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
                   quantize, recipes, serve, verify)

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
    app.command("verify", help=verify.HELP, short_help="Check every file of an engine directory against its "
                "manifests (SHA-256).")(verify.verify_command)
    app.add_typer(eval.eval_app, name="eval", help="Evaluate a model (perplexity).")


_register()


class Terminated(BaseException):
    """SIGTERM arrived. A BaseException, like KeyboardInterrupt, so that library code's `except
    Exception` does not swallow it while stages still remove their temporary outputs on the way out."""


_SIGNALLED: list[int] = []  # the SIGINT / SIGTERM that arrived during this `cli_main` run


def _raise_terminated(signum, frame):
    _SIGNALLED.append(signum)
    raise Terminated()


def _raise_interrupted(signum, frame):
    _SIGNALLED.append(signum)
    raise KeyboardInterrupt()


def _signal_exception(e: BaseException, reported: tuple) -> BaseException:
    """What escaped the command; but where a signal arrived and what escaped is no error the CLI reports (one that
    would print a traceback), the signal's exception: a library turned the handler's exception into its own. CI saw
    it: SIGTERM during `convert`'s first import of a transformers model module surfaced as ModuleNotFoundError
    ("Could not import module 'GenerationMixin'") and a traceback with exit 1, not 143."""
    import signal

    if not _SIGNALLED or isinstance(e, (KeyboardInterrupt, Terminated, *reported)):
        return e
    return Terminated() if _SIGNALLED[-1] == signal.SIGTERM else KeyboardInterrupt()


def _click_exception_types() -> tuple[tuple[type, ...], tuple[type, ...], tuple[type, ...]]:
    """(ClickException, Exit, Abort) classes the installed typer can raise. typer >= 0.2x bundles its own
    copy of click (`typer._click`), whose exceptions are not `click`'s; older typer raises click's."""
    import importlib

    errors, exits, aborts = [], [typer.Exit], [typer.Abort]
    for name in ("typer._click.exceptions", "click.exceptions"):
        try:
            mod = importlib.import_module(name)
        except ImportError:
            continue
        errors.append(mod.ClickException)
        exits.append(getattr(mod, "Exit", typer.Exit))
        aborts.append(getattr(mod, "Abort", typer.Abort))
    return tuple(errors), tuple(exits), tuple(aborts)


def _one_line(text: str) -> str:
    return " ".join(str(text).split())


def _usage_message(e) -> str:
    msg = _one_line(e.format_message())
    ctx = getattr(e, "ctx", None)
    if ctx is not None and getattr(e, "exit_code", 1) == 2:
        msg += f" (see `{ctx.command_path} --help`)"
    return msg


def cli_main(argv: list[str] | None = None) -> int:
    """Run the CLI and return its exit code. User errors, usage errors, Ctrl-C and SIGTERM become one
    `error: ...` line on stderr and the exit code the README documents; never a traceback."""
    import signal
    import threading

    from ..errors import VlmctlError

    click_errors, exits, aborts = _click_exception_types()
    previous = {}
    _SIGNALLED.clear()
    if threading.current_thread() is threading.main_thread():
        previous = {signal.SIGTERM: signal.signal(signal.SIGTERM, _raise_terminated)}
        if signal.getsignal(signal.SIGINT) is signal.default_int_handler:  # (not where SIGINT is ignored)
            previous[signal.SIGINT] = signal.signal(signal.SIGINT, _raise_interrupted)
    try:
        try:
            rv = app(args=argv, standalone_mode=False)
        except BaseException as e:
            mapped = _signal_exception(e, (VlmctlError, *exits, *aborts, *click_errors, OSError))
            if mapped is e:
                raise
            raise mapped from e
    except VlmctlError as e:
        sys.stderr.write(f"error: {_one_line(e.message)}\n")
        return e.exit_code
    except KeyboardInterrupt:
        sys.stderr.write("error: interrupted\n")
        return 130
    except Terminated:
        sys.stderr.write("error: terminated (SIGTERM)\n")
        return 143
    except exits as e:
        return _exit_code(e.exit_code)
    except aborts:
        sys.stderr.write("error: aborted\n")
        return 1
    except click_errors as e:
        if type(e).__name__ == "NoArgsIsHelpError":  # `vlmctl eval` alone: the help text is the answer
            e.show()
            return e.exit_code
        sys.stderr.write(f"error: {_usage_message(e)}\n")
        return e.exit_code
    except OSError as e:  # the file system refused (permissions, a full disk, /proc): the user's to fix
        where = f"{e.filename}: " if getattr(e, "filename", None) else ""
        sys.stderr.write(f"error: {where}{e.strerror or _one_line(e)}\n")
        return 1
    finally:
        for sig, handler in previous.items():
            signal.signal(sig, handler)
    # In non-standalone mode typer *returns* the code of an Exit it caught, e.g. 130 for Ctrl-C.
    return _exit_code(rv) if isinstance(rv, int) and not isinstance(rv, bool) else 0


def _exit_code(code) -> int:
    code = int(code or 0)
    if code == 130:
        sys.stderr.write("error: interrupted\n")
    return code


def run() -> None:
    """Console-script entry point."""
    sys.exit(cli_main())


if __name__ == "__main__":
    run()
