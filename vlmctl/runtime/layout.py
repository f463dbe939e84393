"""The embedded decoder's on-disk layout (what `build-llm` writes for the torch backend).

Weights are stored the way the runtime computes with them, so loading is a memory map:
q/k/v fused into one `qkv` projection, gate/up fused into `gate_up`, AWQ linears kept packed
(qweight/qzeros/scales concatenated along the output axis, which AutoAWQ's packing allows
because it packs each run of 8 output columns independently).

Tensor names (i = layer index):
  embed, norm, lm_head (absent when tied), inv_freq
  layers.i.input_norm, layers.i.post_norm
  layers.i.{qkv,o,gate_up,down}.weight               float linears ([out, in])
  layers.i.{qkv,o,gate_up,down}.{qweight,qzeros,scales}   AWQ GEMM linears
  layers.i.qkv.bias                                   when the decoder has q/k/v biases
"""

from __future__ import annotations

import json
from pathlib import Path

from ..checkpoint import iter_tensors
from ..errors import CheckpointError
from ..models.decoders import decoder_family, rotary_tables, runtime_config
from ..progress import Progress, ensure

FORMAT = "vlmctl-torch-decoder"
FORMAT_VERSION = 1
WEIGHTS = "weights.safetensors"


def _dtype(name: str):
    import torch

    return {"float32": torch.float32, "float16": torch.float16, "bfloat16": torch.bfloat16}[name]


def read_hf_decoder(llm_dir: Path) -> tuple[dict, dict, dict | None]:
    """(HF text config, tensors by name, quantization_config or None) of a causal-LM directory."""
    llm_dir = Path(llm_dir)
    try:
        text_cfg = json.loads((llm_dir / "config.json").read_text())
    except FileNotFoundError:
        raise CheckpointError(f"{llm_dir}: no config.json") from None
    quant = text_cfg.get("quantization_config")
    if quant is not None and quant.get("quant_method") != "awq":
        raise CheckpointError(f"{llm_dir}: quantization {quant.get('quant_method')!r} is not supported (only awq)")
    if quant is not None and str(quant.get("version", "gemm")).lower() != "gemm":
        raise CheckpointError(f"{llm_dir}: AWQ version {quant.get('version')!r} is not supported (only gemm)")
    tensors = {k: t for k, t, _ in iter_tensors(llm_dir)}
    return text_cfg, tensors, quant


def fuse_decoder(text_cfg: dict, tensors: dict, quant: dict | None, dtype: str,
                 progress: Progress | None = None) -> tuple[dict, dict]:
    """HF decoder tensors -> (runtime config, runtime tensors)."""
    import torch

    progress = ensure(progress)
    fam = decoder_family(text_cfg.get("model_type", ""))
    cfg = runtime_config(text_cfg)
    target = _dtype(dtype)
    used: set[str] = set()

    def take(name: str):
        if name not in tensors:
            raise CheckpointError(f"decoder tensor {name!r} is missing")
        used.add(name)
        return tensors[name]

    def linear(prefix_names: list[str]) -> dict:
        first = prefix_names[0]
        if f"{first}.qweight" in tensors:
            parts = {s: [take(f"{n}.{s}") for n in prefix_names] for s in ("qweight", "qzeros", "scales")}
            return {"qweight": torch.cat(parts["qweight"], 1).to(torch.int32),
                    "qzeros": torch.cat(parts["qzeros"], 1).to(torch.int32),
                    "scales": torch.cat(parts["scales"], 1).to(torch.float16)}
        return {"weight": torch.cat([take(f"{n}.weight") for n in prefix_names], 0).to(target)}

    out: dict = {}
    out["embed"] = take("model.embed_tokens.weight").to(target)
    out["norm"] = take("model.norm.weight").to(target)
    if cfg["tie_word_embeddings"]:
        tensors.get("lm_head.weight") is not None and used.add("lm_head.weight")
    else:
        out["lm_head"] = take("lm_head.weight").to(target)
    task = progress.task("build-llm: fusing decoder layers", total=cfg["num_layers"])
    for i in range(cfg["num_layers"]):
        p = f"{fam.layer_prefix}.{i}"
        out[f"layers.{i}.input_norm"] = take(f"{p}.{fam.input_norm}.weight").to(target)
        out[f"layers.{i}.post_norm"] = take(f"{p}.{fam.post_norm}.weight").to(target)
        for short, names in (("qkv", [fam.q, fam.k, fam.v]), ("o", [fam.o]), ("gate_up", [fam.gate, fam.up]),
                             ("down", [fam.down])):
            for suffix, t in linear([f"{p}.{n}" for n in names]).items():
                out[f"layers.{i}.{short}.{suffix}"] = t
        if cfg["qkv_bias"]:
            out[f"layers.{i}.qkv.bias"] = torch.cat([take(f"{p}.{n}.bias") for n in (fam.q, fam.k, fam.v)]).to(target)
        task.advance()
    task.done()
    leftovers = sorted(set(tensors) - used)
    if leftovers:
        raise CheckpointError(f"decoder has {len(leftovers)} tensor(s) the runtime does not use, e.g. {leftovers[:3]}")
    inv_freq, scaling = rotary_tables(text_cfg)
    out["inv_freq"] = inv_freq
    cfg["attention_scaling"] = scaling
    cfg["mrope_section"] = (text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling") or {}).get("mrope_section")
    if quant is not None:
        cfg["quantization"] = {"method": "awq", "bits": int(quant.get("bits", quant.get("w_bit", 4))),
                               "group_size": int(quant.get("group_size", quant.get("q_group_size", 128))),
                               "format": "gemm"}
    return cfg, out


def build_torch_layout(llm_dir: Path, out_dir: Path, *, dtype: str, extra_config: dict,
                       progress: Progress | None = None) -> dict:
    """Write the runtime layout of the decoder in `llm_dir` (float or AWQ GEMM) into `out_dir`."""
    from safetensors.torch import save_file

    text_cfg, tensors, quant = read_hf_decoder(llm_dir)
    cfg, weights = fuse_decoder(text_cfg, tensors, quant, dtype, progress)
    out_dir = Path(out_dir)
    out_dir.mkdir(parents=True, exist_ok=True)
    save_file({k: v.contiguous() for k, v in weights.items()}, str(out_dir / WEIGHTS), metadata={"format": FORMAT})
    config = {"format": FORMAT, "format_version": FORMAT_VERSION, "dtype": dtype, "decoder": cfg, **extra_config}
    (out_dir / "config.json").write_text(json.dumps(config, indent=2))
    return {"backend": "torch", "backend_version": _torch_version(), "layers": cfg["num_layers"],
            "quantization": cfg.get("quantization", {}).get("method", "none")}


def _torch_version() -> str:
    import torch

    return f"torch {torch.__version__}"
