"""Checkpoint conversion: split a VLM checkpoint into vision (tower + projector) and decoder parts.

Output layout (a conversion workspace, formats/workdir.py; one directory, written atomically by the
pipeline):
  vision/     model.safetensors (vision tower + projector) + config.json (the VLM config)
  llm/        the decoder as a plain Hugging Face causal-LM checkpoint, with its tokenizer
  processor/  tokenizer, image processor, chat template and config, as the runtime needs them
  family.json the family module that reads it

Every tensor is checked against the names, shapes and dtypes the architecture expects;
unknown or missing tensors fail the stage. So do a config.json that transformers refuses (checked
first) and a tokenizer or processor that does not load as the engine loads it (checked last, on the
converted files, before the stage is published): a CheckpointError naming the source's file.
"""

from __future__ import annotations

import json
import shutil
from pathlib import Path

from .checkpoint import ShardWriter, iter_tensors
from .errors import CheckpointError, VlmctlError
from .formats.awq_gemm import AwqGemmConfig
from .formats.workdir import Workspace
from .models.base import DECODER, VISION, ProcessorFileError, VLMFamily, config_refusals, refusal_text
from .models.decoders import decoder_spec
from .models.registry import detect_family, read_config
from .progress import Progress, ensure

TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "special_tokens_map.json", "tokenizer.model",
                   "vocab.json", "merges.txt", "added_tokens.json")
PROCESSOR_FILES = TOKENIZER_FILES + ("processor_config.json", "preprocessor_config.json", "chat_template.jinja",
                                     "chat_template.json", "config.json", "generation_config.json",
                                     "video_preprocessor_config.json")

DTYPES = {"float32": "float32", "float16": "float16", "bfloat16": "bfloat16"}


def load_source_config(src: Path) -> tuple[dict, VLMFamily]:
    """(config.json, family) of a whole-VLM checkpoint, once transformers has built its config: a
    config.json it refuses (a hidden size its heads do not divide, a string where an int goes) is one
    CheckpointError naming the file, for every family, before any tensor is read; a decoder the runtime does not
    run is an UnsupportedModelError then too."""
    config = read_config(src)
    where = str(Path(src) / "config.json")
    family = detect_family(config, where=where)
    family.load_hf_config(config, where)
    # a decoder variant the runtime does not run (e.g. attention_bias) is refused now, not after the vision stages
    decoder_spec(family.text_config_dict(config))
    return config, family


def expected_tensors(family, config_dict: dict, where: str = "config.json") -> dict[str, tuple[tuple[int, ...], bool]]:
    """name -> (shape, may_be_absent) for the whole VLM, from a meta-device instance of the HF class.
    A config that transformers cannot build the model from (an activation or rope type it does not know)
    is a CheckpointError naming `where`."""
    import torch

    config = family.load_hf_config(config_dict, where)
    model_class = family.hf_model_class()
    try:
        with torch.device("meta"):
            model = model_class(config)
    except config_refusals() as e:
        raise CheckpointError(f"{where}: transformers cannot build {model_class.__name__} from it "
                              f"({refusal_text(e)})") from e
    tied = set()
    if family.ties_lm_head(config_dict):  # then lm_head may be absent: it is the word embedding
        tied = {k for k in model.state_dict() if k.endswith("lm_head.weight")}
    return {k: (tuple(v.shape), k in tied) for k, v in model.state_dict().items()}


def read_vlm_decoder(src: Path) -> tuple[dict, dict]:
    """The decoder of a whole-VLM checkpoint, in memory, as a plain causal LM: (text config, tensors by
    causal-LM name). Float or AWQ (vlmctl's whole-VLM AWQ checkpoint keeps the vision modules float and
    lists them in `modules_to_not_convert`): the text config then declares the decoder's AWQ settings."""
    src = Path(src)
    config, family = load_source_config(src)
    tensors = {}
    for key, tensor, _ in iter_tensors(src):
        part, name = family.split_key(family.canonical_key(key))
        if part == DECODER:
            tensors[name] = tensor
    text_cfg = family.text_config_dict(config)
    text_cfg["tie_word_embeddings"] = family.ties_lm_head(config) and "lm_head.weight" not in tensors
    awq = AwqGemmConfig.from_config(config, str(src / "config.json"))
    if awq is not None:  # the vision modules it lists are no part of the decoder
        text_cfg = AwqGemmConfig(awq.bits, awq.group_size, awq.zero_point).apply_to(text_cfg)
    return text_cfg, tensors


def convert_checkpoint(src: Path, out: Path, dtype: str = "float16", progress: Progress | None = None,
                       image_settings: dict | None = None) -> dict:
    """Convert `src` into `out` (which must not exist). Returns a summary for the manifest.

    `image_settings` (a recipe's `image:` keys) override the checkpoint's image-processor settings."""
    import torch

    progress = ensure(progress)
    src = Path(src)
    if not src.is_dir():
        raise CheckpointError(f"{src}: no such checkpoint directory")
    config, family = load_source_config(src)
    expected = expected_tensors(family, config, str(src / "config.json"))
    target = getattr(torch, DTYPES[dtype])

    ws = Workspace(Path(out))
    writers = {VISION: ShardWriter(ws.vision), DECODER: ShardWriter(ws.llm)}
    seen: set[str] = set()
    decoder_names: set[str] = set()
    counts = {VISION: 0, DECODER: 0}
    task = progress.task("convert: splitting tensors", total=len(expected))
    for key, tensor, f in iter_tensors(src):
        name = family.canonical_key(key)
        if name not in expected:
            raise CheckpointError(f"{f.name}: unexpected tensor {key!r} (not part of {config['architectures'][0]} "
                                  "with this config)")
        if name in seen:
            raise CheckpointError(f"{f.name}: tensor {key!r} appears twice")
        shape, _ = expected[name]
        if tuple(tensor.shape) != shape:
            raise CheckpointError(f"{f.name}: tensor {key!r} has shape {tuple(tensor.shape)}, config.json implies {shape}")
        if not tensor.is_floating_point():
            raise CheckpointError(f"{f.name}: tensor {key!r} has dtype {tensor.dtype}; expected floating point weights")
        part, part_name = family.split_key(name)
        writers[part].add(part_name, tensor.to(target))
        if part == DECODER:
            decoder_names.add(part_name)
        seen.add(name)
        counts[part] += 1
        task.advance()
    task.done()
    missing = [k for k, (_, optional) in expected.items() if k not in seen and not optional]
    if missing:
        raise CheckpointError(f"{src}: {len(missing)} tensor(s) missing from the checkpoint, e.g. {missing[:3]}")
    for w in writers.values():
        w.close()

    # vision/: the whole VLM config (the vision wrapper needs projector and feature-layer settings)
    config_out = dict(config)
    config_out["torch_dtype"] = dtype
    ws.vision_config.write_text(json.dumps(config_out, indent=2))

    # llm/: a plain causal LM
    text_cfg = family.text_config_dict(config)
    # As transformers loads the VLM: tied by the top-level rule, unless the checkpoint carries its own
    # lm_head (kept as written; when it equals the embedding the values are the same either way).
    text_cfg["tie_word_embeddings"] = family.ties_lm_head(config) and "lm_head.weight" not in decoder_names
    text_cfg["torch_dtype"] = dtype
    text_cfg.pop("dtype", None)
    (ws.llm / "config.json").write_text(json.dumps(text_cfg, indent=2))
    proc = ws.processor
    proc.mkdir(parents=True)
    for name in PROCESSOR_FILES:
        if (src / name).exists():
            shutil.copy2(src / name, proc / name)
            if name in TOKENIZER_FILES or name in ("generation_config.json", "chat_template.jinja"):
                shutil.copy2(src / name, ws.llm / name)
    if not any((proc / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json")):
        raise CheckpointError(f"{src}: no tokenizer files (tokenizer.json or tokenizer.model)")
    if image_settings:
        family.apply_image_settings(proc, image_settings)
    check_processor(family, ws, src)
    ws.write_family({"family": family.name, "architecture": config["architectures"][0],
                     "decoder_model_type": text_cfg["model_type"], "dtype": dtype})
    return {"family": family.name, "vision_tensors": counts[VISION], "decoder_tensors": counts[DECODER]}


def check_processor(family, ws: Workspace, src: Path) -> None:
    """Load the tokenizer, chat template and image processor from the converted files as the engine will
    (`family.load_processor` on processor/ and vision/, what runtime/engine.py's `_load` calls), so that
    files transformers cannot load fail the stage (before it is published) with one CheckpointError naming
    the source checkpoint's file, instead of an engine that builds and then cannot load. processor/ holds
    copies of the source's files under the same names."""
    try:
        family.load_processor(ws.processor, ws.vision)
    except ProcessorFileError as e:
        raise CheckpointError(e.describe(src)) from e
    except CheckpointError as e:  # the family's own checks, about the copy: name the source
        raise CheckpointError(e.message.replace(str(ws.processor), str(src))) from e
    except VlmctlError:
        raise
    except Exception as e:  # anything else the processor's set-up reads (a processor_config.json that is not JSON)
        first = (str(e).strip().splitlines() or [""])[0][:200]
        raise CheckpointError(f"{src}: the processor cannot be loaded from the checkpoint's files "
                              f"({type(e).__name__}: {first})") from e
