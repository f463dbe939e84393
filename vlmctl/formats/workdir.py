"""Work and engine directories: the one place that names every stage directory and every file other
stages read there, and `classify(path)`, which answers "what kind of directory is this?".

A work directory (`vlmctl build RECIPE -o DIR`, `vlmctl convert SRC -o DIR`) holds `recipe.json`
(the resolved recipe, so stand-alone stage commands reuse it) and one directory per stage, each with
its `manifest.json` (formats/artifacts.py):

  convert/        a conversion workspace (`Workspace`): vision/ (tower + projector weights and the
                  VLM's config.json), llm/ (the decoder as a plain HF causal LM), processor/
                  (tokenizer, image processor, chat template) and family.json (the family's name:
                  the one record of which family module reads this model)
  quantize/       llm/ (the AWQ decoder, AutoAWQ GEMM) and vlm/ (the whole-VLM AWQ checkpoint)
  export-vision/  model.onnx and io.json (input/output names, dtype, rows per image; export-triton reads it)
  build-vision/   runtime.json ({"runner": tensorrt | onnxruntime | torch, ...}: what the runtime
                  starts with) and model.engine when TensorRT built one
  build-llm/      config.json (the torch decoder layout, formats/torch_layout.py, or the TensorRT-LLM
                  engine's description, export/trtllm.py) and the weights or engine it names

An engine directory is a work directory whose engine stages (convert, build-vision, build-llm) ran;
`EngineDir` is the view chat, serve, bench, eval and export-triton take of it. A complete one has run every
stage its recipe needs (`WorkDir.needed_stages`: all, quantize only when the recipe quantizes); one that
has not (`build --until STAGE`) is incomplete, and `incomplete_engine` names the next stage to run.

Not here: what the files hold (their own modules in formats/), running and caching stages
(pipeline.py, formats/artifacts.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass
from pathlib import Path

from ..errors import CheckpointError, EngineError, InputError, StageError

STAGES = ("convert", "quantize", "export-vision", "build-vision", "build-llm")
# What chat/serve read: an engine directory without these is not one.
ENGINE_STAGES = ("convert", "build-vision", "build-llm")
MANIFEST = "manifest.json"
RECIPE_FILE = "recipe.json"
FAMILY_FILE = "family.json"
CONFIG = "config.json"
SOURCE_HASHES = ".source-hashes.json"  # (size, mtime) -> SHA-256 of the source checkpoint's files
ONNX_FILE = "model.onnx"  # export-vision's graph
ONNX_IO_FILE = "io.json"  # export-vision's description of it
VISION_ENGINE_FILE = "model.engine"  # build-vision's TensorRT engine
VISION_RUNTIME_FILE = "runtime.json"  # build-vision's record of the runner the runtime starts with

# What `classify` answers.
WORKDIR = "workdir"  # a work or engine directory
WORKSPACE = "workspace"  # a conversion workspace (convert/'s layout)
QUANTIZED = "quantized"  # quantize's output (llm/ [+ vlm/]) outside a work directory
CHECKPOINT = "checkpoint"  # a Hugging Face checkpoint directory (config.json): a whole VLM or a causal LM
TOKENIZER_FILES = ("tokenizer.json", "tokenizer.model", "vocab.json")


def _read_json(path: Path, what: str, error=CheckpointError) -> dict:
    try:
        return json.loads(Path(path).read_text())
    except FileNotFoundError:
        raise error(f"{path}: {what} is missing") from None
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise error(f"{path}: {what} is unreadable ({type(e).__name__})") from None


def has_tokenizer(d: Path) -> bool:
    return any((Path(d) / n).exists() for n in TOKENIZER_FILES)


@dataclass(frozen=True)
class Workspace:
    """A conversion workspace: `convert/` of a work directory, or a stand-alone one (quantize makes
    one from a VLM checkpoint)."""

    root: Path

    @property
    def vision(self) -> Path:
        return self.root / "vision"

    @property
    def llm(self) -> Path:
        return self.root / "llm"

    @property
    def processor(self) -> Path:
        return self.root / "processor"

    @property
    def family_file(self) -> Path:
        return self.root / FAMILY_FILE

    @property
    def vision_config(self) -> Path:
        """The whole VLM's config.json (kept beside the vision weights)."""
        return self.vision / CONFIG

    def exists(self) -> bool:
        return self.family_file.is_file() and self.llm.is_dir()

    def has_vision(self) -> bool:
        return self.vision.is_dir() and self.family_file.is_file()

    def write_family(self, info: dict) -> None:
        """family.json: {"family": name, ...} (the architecture, decoder model type and dtype beside it)."""
        self.family_file.write_text(json.dumps(info, indent=2))

    def family_name(self) -> str:
        """The family module that reads this workspace (family.json)."""
        if not self.family_file.is_file():
            raise StageError(f"{self.root}: no {FAMILY_FILE} (not a conversion workspace; run `vlmctl convert` first)")
        info = _read_json(self.family_file, FAMILY_FILE)
        if not isinstance(info, dict) or not isinstance(info.get("family"), str):
            raise CheckpointError(f"{self.family_file}: names no family")
        return info["family"]

    def read_vision_config(self) -> dict:
        return _read_json(self.vision_config, "the VLM config")


@dataclass(frozen=True)
class QuantizeOutput:
    """What quantize writes: llm/ (the AWQ decoder) and, for a VLM, vlm/ (the whole-VLM AWQ checkpoint)."""

    root: Path

    @property
    def llm(self) -> Path:
        return self.root / "llm"

    @property
    def vlm(self) -> Path:
        return self.root / "vlm"


@dataclass(frozen=True)
class WorkDir:
    """A work directory: every stage's path."""

    root: Path

    def __post_init__(self):
        object.__setattr__(self, "root", Path(self.root))

    @property
    def recipe_file(self) -> Path:
        return self.root / RECIPE_FILE

    @property
    def source_hashes(self) -> Path:
        return self.root / SOURCE_HASHES

    @property
    def convert(self) -> Workspace:
        return Workspace(self.root / "convert")

    @property
    def quantize(self) -> QuantizeOutput:
        return QuantizeOutput(self.root / "quantize")

    @property
    def export_vision(self) -> Path:
        return self.root / "export-vision"

    @property
    def onnx(self) -> Path:
        return self.export_vision / ONNX_FILE

    @property
    def onnx_io(self) -> Path:
        return self.export_vision / ONNX_IO_FILE

    @property
    def build_vision(self) -> Path:
        return self.root / "build-vision"

    @property
    def vision_engine(self) -> Path:
        return self.build_vision / VISION_ENGINE_FILE

    @property
    def vision_runtime(self) -> Path:
        return self.build_vision / VISION_RUNTIME_FILE

    @property
    def build_llm(self) -> Path:
        return self.root / "build-llm"

    @property
    def llm_config(self) -> Path:
        return self.build_llm / CONFIG

    def family_name(self) -> str:
        if not self.convert.family_file.is_file():
            raise StageError(f"{self.root}: stage 'convert' has not run here; run `vlmctl convert` first")
        return self.convert.family_name()

    def is_engine(self) -> bool:
        return self.llm_config.is_file() and self.convert.family_file.is_file()

    def saved_quantization(self) -> str | None:
        """quantization.method of the saved recipe.json (pipeline.save_recipe writes it), or None when there is
        no readable one."""
        try:
            method = json.loads(self.recipe_file.read_text())["quantization"]["method"]
        except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError):
            return None
        return method if isinstance(method, str) else None

    def needed_stages(self) -> tuple[str, ...]:
        """The stages a complete engine of this directory has run, in order: every stage, quantize only when the
        saved recipe quantizes (without a readable recipe.json: when quantize/ is there)."""
        method = self.saved_quantization()
        quantized = (self.root / "quantize").is_dir() if method is None else method != "none"
        return tuple(s for s in STAGES if s != "quantize" or quantized)

    def missing_stages(self) -> list[str]:
        """The needed stages whose directory is not there (a stage publishes its directory only when it
        succeeded, so a missing one has not run)."""
        return [s for s in self.needed_stages() if not (self.root / s).is_dir()]


class EngineDir(WorkDir):
    """An engine directory, checked on opening: its decoder config and family record are there."""

    @classmethod
    def open(cls, path: Path) -> "EngineDir":
        d = cls(Path(path))
        if not d.root.is_dir() or not d.is_engine():
            raise EngineError(not_an_engine(d.root))
        return d

    def vision_runner(self) -> str:
        """The vision runner build-vision recorded (tensorrt, onnxruntime or torch)."""
        runner = _read_json(self.vision_runtime, "build-vision's runner record", EngineError).get("runner")
        if not isinstance(runner, str):
            raise EngineError(f"{self.vision_runtime}: names no runner")
        return runner


def not_an_engine(path: Path) -> str:
    return f"{path}: not a vlmctl engine directory (run `vlmctl build RECIPE -o {path}`)"


def stage_command(stage: str, path: Path) -> str:
    """The command line that runs one stage in the work directory `path`."""
    return f"vlmctl convert SRC -o {path}" if stage == "convert" else f"vlmctl {stage} {path}"


def incomplete_engine(path: Path) -> str | None:
    """What chat, serve and verify say of a work directory whose engine stages have not all run (e.g. one
    built with `vlmctl build --until STAGE`): the stages missing and the next one to run, as `build --until`
    names it. None when every needed stage's directory is there."""
    wd = WorkDir(path)
    needed, missing = wd.needed_stages(), wd.missing_stages()
    if not missing:
        return None
    first = missing[0]
    done = [s for s in needed if s not in missing]
    # `build --until S` leaves every stage after S unbuilt; a stage removed from the middle is only missing
    built = f"built up to {done[-1]}; " if done and list(needed[needed.index(first):]) == missing else ""
    return (f"{path}: incomplete engine ({built}missing {', '.join(missing)}): the next stage is {first} "
            f"(`{stage_command(first, path)}`, or `vlmctl build RECIPE -o {path}` for the rest)")


def classify(path: Path) -> str:
    """WORKDIR, WORKSPACE, QUANTIZED or CHECKPOINT: what the directory a user named is.

    In this order: a work directory has recipe.json or a stage's output (convert/family.json,
    build-llm/config.json); a workspace has family.json beside llm/; a Hugging Face checkpoint has
    config.json; quantize's output has llm/config.json without family.json. InputError when `path` is no
    directory, CheckpointError when it is none of these."""
    path = Path(path)
    if not path.is_dir():
        raise InputError(f"{path}: no such directory")
    wd = WorkDir(path)
    if wd.recipe_file.is_file() or wd.convert.family_file.is_file() or wd.llm_config.is_file():
        return WORKDIR
    if Workspace(path).exists():
        return WORKSPACE
    if (path / CONFIG).is_file():
        return CHECKPOINT
    if (QuantizeOutput(path).llm / CONFIG).is_file():
        return QUANTIZED
    raise CheckpointError(f"{path}: neither a Hugging Face checkpoint (config.json), a conversion workspace "
                          "(family.json + llm/) nor a vlmctl work directory")
