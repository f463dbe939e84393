"""AWQ of a VLM: the language part of a conversion workspace, the whole-VLM AWQ checkpoint that keeps
the vision part float, and `quantize_path`, which takes a work directory, a workspace or a causal LM.

The decoder itself is quantized by awq.py (vlmctl's AWQ) or autoawq_impl.py (`--impl autoawq`),
calibrated on text or, with image-text records, on embeddings that include the image rows
(vlm_calibration.py; for a decoder that reads images in cross-attention layers, the image states
and masks those layers read). Publishing the output atomically is the caller's (pipeline.py).
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint import ShardWriter, copy_side_files, iter_tensors
from ..errors import CheckpointError, InputError
from ..formats.awq_gemm import AwqGemmConfig
from ..formats.workdir import QUANTIZED, WORKDIR, WORKSPACE, QuantizeOutput, WorkDir, Workspace, classify
from ..progress import Progress, ensure
from .awq import SHARD_BYTES, quantize_causal_lm


def write_vlm_checkpoint(workspace: Workspace, quantized_llm: Path, out_dir: Path,
                         progress: Progress | None = None) -> dict:
    """A whole-VLM AWQ checkpoint from a conversion workspace and its quantized decoder.

    Vision tensors are copied byte for byte from the workspace's vision/; decoder tensors come from
    `quantized_llm` (GEMM format). Names are the VLM's (the family's `join_key`), and
    `quantization_config.modules_to_not_convert` lists the family's vision modules, and any decoder
    linears the quantized decoder kept float (cross-attention layers).
    """
    from ..checkpoint import read_config_json
    from ..models.base import DECODER, VISION
    from ..models.registry import get_family

    progress = ensure(progress)
    quantized_llm, out_dir = Path(quantized_llm), Path(out_dir)
    family = get_family(workspace.family_name())
    awq = AwqGemmConfig.from_config(read_config_json(quantized_llm), str(quantized_llm / "config.json"))
    if awq is None:
        raise CheckpointError(f"{quantized_llm}: not an AWQ checkpoint")
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out_dir, max_bytes=SHARD_BYTES)
    counts = {VISION: 0, DECODER: 0}
    task = progress.task("awq: writing the whole-VLM checkpoint")
    for part, src in ((VISION, workspace.vision), (DECODER, quantized_llm)):
        for name, t, _ in iter_tensors(src):
            writer.add(family.join_key(part, name), t)
            counts[part] += 1
            task.advance()
    writer.close()
    task.done()
    keep_float = tuple(family.vision_module_names()) + awq.modules_to_not_convert
    vision_float = AwqGemmConfig(awq.bits, awq.group_size, modules_to_not_convert=keep_float)
    cfg = vision_float.apply_to(workspace.read_vision_config())
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    if workspace.processor.is_dir():
        copy_side_files(workspace.processor, out_dir)
    return {"vision_tensors": counts[VISION], "decoder_tensors": counts[DECODER]}


def quantize_workspace(workspace: Workspace, out_dir: Path, settings, base_dir: Path | None = None,
                       progress: Progress | None = None) -> dict:
    """Quantize a conversion workspace's decoder: out_dir/llm (decoder) and out_dir/vlm (whole VLM)."""
    workspace = workspace if isinstance(workspace, Workspace) else Workspace(Path(workspace))
    out = QuantizeOutput(Path(out_dir))
    if not (workspace.llm / "config.json").exists():
        raise CheckpointError(f"{workspace.root}: not a conversion workspace (no llm/config.json)")
    from ..checkpoint import read_config_json
    from .awq import check_group_size_for_config

    check_group_size_for_config(read_config_json(workspace.llm), settings)  # before calibration's image features
    from .vlm_calibration import cross_attention_calibration, image_text_embeddings, read_image_text_records

    cal = settings.calibration
    records = read_image_text_records(cal.data, base_dir)
    if settings.impl == "autoawq":
        if records is not None:
            raise InputError("image-text calibration runs with --impl vlmctl only (AutoAWQ takes text)")
        from .autoawq_impl import quantize_with_autoawq

        summary = quantize_with_autoawq(workspace.llm, out.llm, settings, base_dir, progress)
    else:
        embeds = cross = None
        if records is not None:
            if not workspace.vision.is_dir():
                raise InputError(f"{cal.data}: image-text calibration needs a VLM workspace (vision/ is missing)")
            from ..models.registry import get_family

            if get_family(workspace.family_name()).image_input == "cross_attention":
                embeds, cross = cross_attention_calibration(workspace, records, cal.samples, cal.seq_len,
                                                            progress=progress)
            else:
                embeds = image_text_embeddings(workspace, records, cal.samples, cal.seq_len, progress=progress)
        summary = quantize_causal_lm(workspace.llm, out.llm, settings, base_dir, progress, calib_embeds=embeds,
                                     calib_cross=cross)
    if workspace.has_vision():
        summary["vlm"] = write_vlm_checkpoint(workspace, out.llm, out.vlm, progress)
    return summary


def quantize_path(src: Path, out_dir: Path, settings, base_dir: Path | None = None,
                  progress: Progress | None = None) -> dict:
    """Quantize SRC into `out_dir` (see `formats.workdir.classify` for what SRC may be):

    - a work directory (its convert/) or a conversion workspace: out_dir/llm and out_dir/vlm;
    - a plain causal LM: out_dir is the AWQ checkpoint.
    A whole-VLM checkpoint is converted into a workspace first, by the caller (pipeline.quantize).
    """
    from ..checkpoint import read_config_json
    from ..models.decoders import is_decoder_config

    src, out_dir = Path(src), Path(out_dir)
    kind = classify(src)
    if kind == WORKDIR:
        ws = WorkDir(src).convert
        if not ws.exists():
            raise CheckpointError(f"{src}: stage 'convert' has not run here; run `vlmctl convert` first")
        return quantize_workspace(ws, out_dir, settings, base_dir, progress)
    if kind == WORKSPACE:
        return quantize_workspace(Workspace(src), out_dir, settings, base_dir, progress)
    if kind == QUANTIZED:
        raise CheckpointError(f"{src}: already quantized (an AWQ output); give a float checkpoint or workspace")
    if not is_decoder_config(read_config_json(src)):
        raise InputError(f"{src}: a whole-VLM checkpoint; convert it into a workspace first")
    if settings.impl == "autoawq":
        from .autoawq_impl import quantize_with_autoawq

        return quantize_with_autoawq(src, out_dir, settings, base_dir, progress)
    return quantize_causal_lm(src, out_dir, settings, base_dir, progress)
