"""TensorRT-LLM decoder engine with prompt tuning (TensorRT-LLM 1.2.x, legacy engine flow).

The flow is TensorRT-LLM's own: a TensorRT-LLM checkpoint from the HF decoder directory
(float, or the AWQ GEMM checkpoint as W4A16_AWQ), then `trtllm-build` with
`--max_prompt_embedding_table_size` so image features enter through the prompt table, exactly
as the embedded runtime does. The engine flow is removed after 1.2, hence the version check.
None of this has run on vlmctl's CI machines (TensorRT-LLM is not installable there); the
commands are tested up to the call.
"""

from __future__ import annotations

import json
import shutil
import subprocess
import sys
from pathlib import Path

from ..errors import BackendUnavailableError, StageError
from ..progress import Progress, ensure

SUPPORTED = ((1, 2),)


def trtllm_available(required: bool = False) -> bool:
    try:
        import importlib.metadata as md

        version = md.version("tensorrt_llm")
    except Exception:
        if required:
            raise BackendUnavailableError("decoder.backend is trtllm but tensorrt_llm is not installed "
                                          "(pip install 'vlmctl[trtllm]' on a machine with NVIDIA's index)") from None
        return False
    major_minor = tuple(int(x) for x in version.split(".")[:2] if x.isdigit())
    if major_minor not in SUPPORTED:
        if required:
            raise BackendUnavailableError(f"tensorrt_llm {version} is not supported: the engine flow "
                                          "(convert_checkpoint -> trtllm-build -> ModelRunner) needs 1.2.x")
        return False
    return True


def trtllm_build_command(checkpoint_dir: Path, engine_dir: Path, *, max_batch_size: int, max_input_len: int,
                         max_seq_len: int, prompt_table_size: int) -> list[str]:
    """The exact `trtllm-build` command line for a decoder that takes image features via prompt tuning."""
    cmd = ["trtllm-build", "--checkpoint_dir", str(checkpoint_dir), "--output_dir", str(engine_dir),
           "--max_batch_size", str(max_batch_size), "--max_input_len", str(max_input_len),
           "--max_seq_len", str(max_seq_len), "--max_num_tokens", str(max_batch_size * max_input_len),
           "--max_prompt_embedding_table_size", str(prompt_table_size),
           "--gemm_plugin", "auto", "--gpt_attention_plugin", "auto",
           "--remove_input_padding", "enable", "--paged_kv_cache", "enable"]
    # Quantization (W4A16 AWQ) travels in the checkpoint's config.json; trtllm-build reads it there.
    return cmd


def quant_config_for(llm_dir: Path) -> dict | None:
    """TensorRT-LLM QuantConfig fields for an AutoAWQ GEMM checkpoint (W4A16 AWQ), else None."""
    cfg = json.loads((Path(llm_dir) / "config.json").read_text())
    q = cfg.get("quantization_config")
    if not q:
        return None
    return {"quant_algo": "W4A16_AWQ", "group_size": int(q.get("group_size", 128)),
            "has_zero_point": bool(q.get("zero_point", True)), "pre_quant_scale": False}


def convert_checkpoint(llm_dir: Path, ckpt_dir: Path, dtype: str) -> None:
    """HF decoder -> TensorRT-LLM checkpoint through the library's `from_hugging_face`."""
    import tensorrt_llm  # noqa: F401
    from tensorrt_llm.models import AutoModelForCausalLM
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.quantization import QuantAlgo

    qc = quant_config_for(llm_dir)
    quant = QuantConfig()
    if qc:
        quant = QuantConfig(quant_algo=QuantAlgo.W4A16_AWQ, group_size=qc["group_size"],
                            has_zero_point=qc["has_zero_point"])
    model = AutoModelForCausalLM.from_hugging_face(str(llm_dir), dtype=dtype, quant_config=quant)
    model.save_checkpoint(str(ckpt_dir), save_config=True)


def build_trtllm_engine(llm_dir: Path, out_dir: Path, *, recipe, extra_config: dict,
                        progress: Progress | None = None) -> dict:
    rope = json.loads((Path(llm_dir) / "config.json").read_text()).get("rope_parameters") or {}
    if rope.get("mrope_section"):
        # A plain causal-LM engine would apply 1-D rotary to image tokens: wrong answers, no error.
        raise BackendUnavailableError("build-llm: this decoder uses multimodal rotary positions (M-RoPE), which "
                                      "vlmctl's TensorRT-LLM flow (a prompt-table engine with 1-D positions) does "
                                      "not drive; set decoder.backend: torch")
    trtllm_available(required=True)
    import importlib.metadata as md

    progress = ensure(progress)
    out_dir = Path(out_dir)
    ckpt = out_dir / "trtllm-checkpoint"
    task = progress.task("build-llm: TensorRT-LLM checkpoint", total=None)
    convert_checkpoint(llm_dir, ckpt, recipe.dtype)
    task.done()
    lim = recipe.limits
    cmd = trtllm_build_command(ckpt, out_dir / "engine", max_batch_size=lim.max_batch_size,
                               max_input_len=lim.max_input_len, max_seq_len=lim.max_input_len + lim.max_output_len,
                               prompt_table_size=extra_config["prompt_table_size"])
    task = progress.task("build-llm: trtllm-build", total=None)
    proc = subprocess.run(cmd, capture_output=True, text=True)
    task.done()
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise StageError("build-llm: trtllm-build failed: " + " | ".join(tail))
    shutil.rmtree(ckpt, ignore_errors=True)
    (out_dir / "config.json").write_text(json.dumps({"format": "tensorrt-llm", "engine": "engine",
                                                     "dtype": recipe.dtype, **extra_config}, indent=2))
    return {"backend": "trtllm", "backend_version": f"tensorrt_llm {md.version('tensorrt_llm')}",
            "command": " ".join(cmd), "python": sys.executable}
