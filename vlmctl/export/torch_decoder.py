"""`build-llm` for the embedded torch decoder: checks the decoder checkpoint against its
`DecoderSpec` and writes the engine layout (`vlmctl.formats.torch_layout`).

A float decoder is not copied: the layout points at the checkpoint `convert` wrote, and the
runtime fuses q|k|v and gate|up while loading it to the device. An AWQ decoder's linears are
fused and stored in `weights.safetensors`, so loading is a memory map.
"""

from __future__ import annotations

import os
from pathlib import Path

from ..checkpoint import TensorReader, read_config_json
from ..errors import UnsupportedModelError
from ..formats.awq_gemm import AwqGemmConfig
from ..formats.torch_layout import (FORMAT, WEIGHTS, LayoutConfig, awq_tensors, check_hf_sources, torch_dtype,
                                    write_layout)
from ..models.decoders import decoder_spec, rotary_position_limit
from ..progress import Progress


def build_torch_decoder(llm_dir: Path, out_dir: Path, *, engine_root: Path, dtype: str, extra_config: dict,
                        progress: Progress | None = None, image_attention: str = "causal") -> dict:
    """Write the torch decoder layout for the decoder in `llm_dir` (under `engine_root`) into `out_dir`.
    `image_attention`: the VLM family's (a property of the VLM, not of its text decoder's config)."""
    from dataclasses import replace

    import torch

    llm_dir = Path(llm_dir)
    cfg = read_config_json(llm_dir)
    awq = AwqGemmConfig.from_config(cfg, str(llm_dir / "config.json"))
    spec = replace(decoder_spec(cfg, awq), image_attention=image_attention)
    spec.validate()
    limits = extra_config.get("limits") or {}
    positions = limits.get("max_input_len", 0) + limits.get("max_output_len", 0)
    rope_limit = rotary_position_limit(cfg)
    if rope_limit is not None and positions > rope_limit:  # the runtime keeps one rotary table per layer
        raise UnsupportedModelError(
            f"{llm_dir / 'config.json'}: its rope scaling changes the rotary frequencies past {rope_limit} positions, "
            f"which the torch runtime does not do; limits.max_input_len + limits.max_output_len is {positions}: "
            f"lower them to {rope_limit} in all")
    reader = TensorReader(llm_dir)
    if awq is None:
        check_hf_sources(reader, spec, llm_dir)
        rel = os.path.relpath(llm_dir.resolve(), Path(engine_root).resolve())
        weights = {"kind": "hf", "dir": Path(rel).as_posix()}
    else:
        from safetensors.torch import save_file

        # repacked at build time for the W4A16 kernels, so loading is a memory map
        from ..formats.w4a16 import repack_gemm_tensors

        spec, tensors = repack_gemm_tensors(spec, awq_tensors(reader, spec, llm_dir, torch_dtype(dtype), progress))
        Path(out_dir).mkdir(parents=True, exist_ok=True)
        save_file({k: v.contiguous() for k, v in tensors.items()}, str(Path(out_dir) / WEIGHTS),
                  metadata={"format": FORMAT})
        weights = {"kind": "packed", "file": WEIGHTS}
    write_layout(out_dir, LayoutConfig(dtype, spec, weights, extra_config))
    return {"backend": "torch", "backend_version": f"torch {torch.__version__}", "layers": spec.num_layers,
            "quantization": "awq" if awq else "none", "weights": weights["kind"]}
