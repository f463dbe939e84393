"""The TensorRT-LLM decoder of an engine directory: `build-llm/config.json` when build-llm's backend is
trtllm. Written by export/trtllm.py, read by runtime/trtllm_decoder.py and export/triton_repo.py.

config.json: {"format": "tensorrt-llm", "format_version": 2, "engine": the trtllm-build output
directory (relative to build-llm/), "dtype", "vocab_size", "hidden_size", "quantization" (TensorRT-LLM
QuantConfig fields, or null), "end_id", "pad_id", "parallel": {"tp_size", "pp_size"},
"kv_cache_free_gpu_memory_fraction", and the pipeline's keys (name, backend, limits,
prompt_table_size, image_tokens_per_image, eos_token_ids)}. The embedded torch decoder's config.json
is formats/torch_layout.py; `format` tells them apart.
"""

from __future__ import annotations

from pathlib import Path

FORMAT = "tensorrt-llm"
FORMAT_VERSION = 2
ENGINE_SUBDIR = "engine"


def is_trtllm_engine(config: dict) -> bool:
    return config.get("format") == FORMAT


def engine_path(layout_dir: Path, config: dict) -> Path:
    """The trtllm-build output directory a config.json names."""
    return Path(layout_dir) / config.get("engine", ENGINE_SUBDIR)
