"""The user-facing error hierarchy.

Every error a user can cause (bad recipe, bad checkpoint, bad image, bad request) is a
`VlmctlError`. The CLI prints `error: <message>` on one line and exits with the class's exit
code; the server maps the same classes to 4xx responses. Bugs stay ordinary exceptions.
"""

from __future__ import annotations


class VlmctlError(Exception):
    """Base class: a problem the user can fix. `exit_code` is what the CLI returns."""

    exit_code = 1

    def __init__(self, message: str):
        super().__init__(message)
        self.message = message

    def __str__(self) -> str:
        return self.message


class RecipeError(VlmctlError):
    """The recipe file or an override is invalid."""

    exit_code = 2


class OptionError(VlmctlError):
    """A command-line option has a value the command cannot use (a port out of range, a negative limit), or a
    VLMCTL_* environment setting one the runtime cannot (`VLMCTL_PDL=sometimes`, a table file that is missing)."""

    exit_code = 2


class CheckpointError(VlmctlError):
    """The source checkpoint is missing, corrupt or does not match its config."""

    exit_code = 3


class UnsupportedModelError(VlmctlError):
    """No registered family handles this architecture."""

    exit_code = 4


class InputError(VlmctlError):
    """A request input (image, prompt, option) is invalid. `param`: the request field at fault,
    when there is one (the server puts it in the OpenAI error body)."""

    exit_code = 5

    def __init__(self, message: str, param: str | None = None):
        super().__init__(message)
        self.param = param


class BackendUnavailableError(VlmctlError):
    """An optional backend (TensorRT, TensorRT-LLM, AutoAWQ) is not installed or has the wrong version."""

    exit_code = 6


class StageError(VlmctlError):
    """A pipeline stage failed its own validation (e.g. ONNX output beyond tolerance)."""

    exit_code = 7


class EngineError(VlmctlError):
    """The engine directory is missing pieces or was built by an incompatible version."""

    exit_code = 8


class RequestError(VlmctlError):
    """One request failed inside the engine (not because of its input); the other requests go on."""


class LimitError(InputError):
    """A request exceeds the engine's limits (prompt length, images, output tokens)."""
