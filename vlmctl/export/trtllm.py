"""TensorRT-LLM decoder engine with prompt tuning (TensorRT-LLM 1.2.x, legacy engine flow).

The flow is TensorRT-LLM's own: a TensorRT-LLM checkpoint from the HF decoder directory through
the model class's `from_hugging_face`, then `trtllm-build` with `--max_prompt_embedding_table_size`
so image features enter through the prompt table, exactly as the embedded runtime does. The
engine flow is removed after 1.2, hence the version check.

What this module is not: a dequantize/requantize path. TensorRT-LLM reads an AutoAWQ GEMM
checkpoint itself (QuantAlgo.W4A16_GPTQ with zero points, `use_autoawq=True` so its loader
unpacks AutoAWQ's column order), so vlmctl's AWQ checkpoint goes in unchanged.

TensorRT-LLM 1.2 pins transformers 4.57 and vlmctl needs transformers 5, so the two usually live
in different Python environments. Conversion and `python -m tensorrt_llm.commands.build` (what
`trtllm-build` runs) therefore run as subprocesses of the TensorRT-LLM interpreter
(`VLMCTL_TRTLLM_PYTHON`, default: this one; probed in backends/trtllm.py). Tensor and pipeline
parallelism: one converted checkpoint per rank (`Mapping`), built by `--workers` processes.
None of this has run on vlmctl's machines (TensorRT-LLM is not installable there); it is checked
against TensorRT-LLM 1.2's recorded interfaces (tests/data/trtllm-1.2) up to the call.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from pathlib import Path

from ..backends.cuda import compute_capability, sm_string
from ..backends.trtllm import PYTHON_ENV, trtllm_available, trtllm_python, trtllm_version  # noqa: F401
from ..errors import BackendUnavailableError, StageError
from ..formats import trtllm_engine
from ..progress import Progress, ensure

ENGINE_FORMAT = trtllm_engine.FORMAT  # build-llm/config.json (formats/trtllm_engine.py)
# The largest context batch the engine schedules at once; TensorRT-LLM warns above 16384.
MAX_NUM_TOKENS_CAP = 8192
# TensorRT-LLM's weight-only groupwise GEMM (fpA_intB) kernels take these AWQ/GPTQ group sizes.
AWQ_GROUP_SIZES = (64, 128)
# TensorRT-LLM 1.2's builder refuses int8/int4 weight-only engines for 100 <= SM < 120
# (tensorrt_llm/builder.py: "INT8/INT4 quantization is not supported on SM>=100").
NO_INT4_SM = range(100, 120)
# LLaMAForCausalLM.from_hugging_face picks its weight-name mapping from substrings of the *path*
# it is given (a directory named ".../llava-1.5-7b/..." is read as a whole LLaVA checkpoint).
_PATH_WORDS_TRTLLM_READS = ("llava", "vila", "exaone")


# ---- what TensorRT-LLM can build ------------------------------------------------------------
def check_buildable(dtype: str, quantized: bool, capability: tuple[int, int] | None, *, tp_size: int = 1,
                    pp_size: int = 1) -> None:
    """Refuse, before any conversion runs, what TensorRT-LLM 1.2 would refuse or get wrong.

    float32: no paged context FMHA, so KV-cache block reuse (which the prompt-table requests rely
    on) would be switched off silently. AWQ: the int4 kernels take float16/bfloat16 activations
    and do not exist on SM 100-119 (Blackwell) in the engine flow."""
    if dtype not in ("float16", "bfloat16"):
        raise StageError(f"build-llm: the TensorRT-LLM decoder needs dtype float16 or bfloat16 (got {dtype}: no paged "
                         "context FMHA, so KV-cache reuse would be off); use a float16/bfloat16 profile or "
                         "decoder.backend: torch")
    if quantized and capability is not None and capability[0] * 10 + capability[1] in NO_INT4_SM:
        raise StageError(f"build-llm: TensorRT-LLM 1.2 builds no int4 (AWQ) engine for this GPU ({sm_string(capability)}:"
                         " \"INT8/INT4 quantization is not supported on SM>=100\"); use decoder.backend: torch "
                         "(vlmctl's own int4 kernel) or quantization.method: none")
    if tp_size < 1 or pp_size < 1:
        raise StageError(f"build-llm: tp_size {tp_size} / pp_size {pp_size} must be >= 1")


def prompt_table_size(limits, image_tokens_per_image: int) -> int:
    """Rows of the engine's prompt table: a batch of sequences, each holding at most its images'
    rows and never more than fit its prompt (TensorRT-LLM allocates all of it up front)."""
    per_seq = min(limits.max_images_per_request * image_tokens_per_image, limits.max_input_len)
    return limits.max_batch_size * per_seq


# ---- the checkpoint -------------------------------------------------------------------------
def quant_config_for(llm_config: dict) -> dict | None:
    """TensorRT-LLM QuantConfig fields for an AutoAWQ GEMM decoder config, else None (float).

    TensorRT-LLM's own reading of `quant_method: awq` (examples/models/core/llama/convert_checkpoint.py,
    `update_quant_config_from_hf`): W4A16_GPTQ with the checkpoint's group size and zero points,
    plus `use_autoawq=True` for `from_hugging_face` (see `from_hf_kwargs`). W4A16_AWQ would be wrong
    here: that is ModelOpt's format (pre-quant scales, symmetric int4)."""
    from ..errors import CheckpointError
    from ..formats.awq_gemm import AwqGemmConfig

    try:
        q = AwqGemmConfig.from_config(llm_config)
    except CheckpointError as e:  # another method, version or bit width
        raw = llm_config.get("quantization_config") or {}
        raise StageError(f"build-llm: TensorRT-LLM reads 4-bit AutoAWQ GEMM checkpoints only (got quant_method "
                         f"{raw.get('quant_method')!r}, bits {raw.get('bits')}, version {raw.get('version')!r}: "
                         f"{e.message})") from None
    if q is None:
        return None
    group = q.group_size
    if group not in AWQ_GROUP_SIZES:
        raise StageError(f"build-llm: AWQ group size {group} has no TensorRT-LLM weight-only kernel (it takes "
                         f"{' or '.join(map(str, AWQ_GROUP_SIZES))}); set quantization.group_size or decoder.backend: torch")
    if not q.zero_point:
        raise StageError("build-llm: TensorRT-LLM's AutoAWQ loader expects zero points (quantization.zero_point: true)")
    return {"quant_algo": "W4A16_GPTQ", "group_size": group, "has_zero_point": True, "pre_quant_scale": False}


def from_hf_kwargs(llm_config: dict) -> dict:
    """Extra keyword arguments for `<Model>.from_hugging_face` (AutoAWQ's packing order)."""
    from ..formats.awq_gemm import AwqGemmConfig

    return {"use_autoawq": True} if AwqGemmConfig.from_config(llm_config) is not None else {}


def hf_config_for_trtllm(text_cfg: dict) -> dict:
    """The decoder's config.json as TensorRT-LLM 1.2's transformers (4.57) reads it.

    transformers 5 writes rotary settings as `rope_parameters`; 4.57 reads `rope_theta` and
    `rope_scaling` and would silently fall back to theta 10000 without them."""
    from ..models.decoders import decoder_family

    cfg = dict(text_cfg)
    rope = cfg.pop("rope_parameters", None)
    if isinstance(rope, dict):
        rope = dict(rope)
        if "rope_theta" in rope:
            cfg.setdefault("rope_theta", rope.pop("rope_theta"))
        if rope.get("rope_type", "default") != "default":
            cfg.setdefault("rope_scaling", {**rope, "type": rope["rope_type"]})
    cfg["architectures"] = [decoder_family(cfg.get("model_type", "")).causal_lm_class]
    if "dtype" in cfg:
        cfg.setdefault("torch_dtype", cfg.pop("dtype"))
    return cfg


def stage_input_dir(llm_dir: Path, dest: Path) -> Path:
    """`dest`: the decoder directory as TensorRT-LLM reads it (rewritten config.json, every other
    file linked). The path is checked because TensorRT-LLM keys its weight mapping off it."""
    dest = Path(dest)
    bad = [w for w in _PATH_WORDS_TRTLLM_READS if w in str(dest).lower()]
    if bad:
        raise StageError(f"build-llm: the staging path {dest} contains {bad[0]!r}, which TensorRT-LLM's "
                         "from_hugging_face reads as a model name; set TMPDIR to a neutral directory")
    dest.mkdir(parents=True, exist_ok=True)
    cfg = json.loads((Path(llm_dir) / "config.json").read_text())
    (dest / "config.json").write_text(json.dumps(hf_config_for_trtllm(cfg), indent=2))
    for p in Path(llm_dir).iterdir():
        if p.name != "config.json" and p.is_file():
            os.symlink(p.resolve(), dest / p.name)
    return dest


# Runs in the TensorRT-LLM interpreter (stdlib + tensorrt_llm only); argv[1] is the JSON spec.
# One checkpoint shard per rank, as TensorRT-LLM's own convert_checkpoint.py writes them: each
# rank's weights through `Mapping(world_size, rank, tp_size=, pp_size=)`, the config once.
CONVERT_SCRIPT = """\
import json, sys
spec = json.loads(sys.argv[1])
from tensorrt_llm.mapping import Mapping
from tensorrt_llm.models import MODEL_MAP
from tensorrt_llm.models.modeling_utils import QuantConfig
from tensorrt_llm.quantization import QuantAlgo
with open(spec["hf_dir"] + "/config.json") as f:
    arch = json.load(f)["architectures"][0]
if arch not in MODEL_MAP:
    sys.exit(f"TensorRT-LLM has no model class for {arch}")
q = spec["quant"]
tp, pp = spec["tp_size"], spec["pp_size"]
for rank in range(tp * pp):
    quant = QuantConfig() if q is None else QuantConfig(
        quant_algo=QuantAlgo[q["quant_algo"]], group_size=q["group_size"],
        has_zero_point=q["has_zero_point"], pre_quant_scale=q["pre_quant_scale"])
    mapping = Mapping(world_size=tp * pp, rank=rank, tp_size=tp, pp_size=pp)
    model = MODEL_MAP[arch].from_hugging_face(spec["hf_dir"], dtype=spec["dtype"], mapping=mapping,
                                              quant_config=quant, **spec["hf_kwargs"])
    model.save_checkpoint(spec["out_dir"], save_config=(rank == 0))
    del model
"""


def convert_command(hf_dir: Path, ckpt_dir: Path, dtype: str, llm_config: dict, python: str | None = None, *,
                    tp_size: int = 1, pp_size: int = 1) -> list[str]:
    """HF decoder -> TensorRT-LLM checkpoint (one shard per rank), as a command for the TensorRT-LLM interpreter."""
    spec = {"hf_dir": str(hf_dir), "out_dir": str(ckpt_dir), "dtype": dtype, "quant": quant_config_for(llm_config),
            "hf_kwargs": from_hf_kwargs(llm_config), "tp_size": int(tp_size), "pp_size": int(pp_size)}
    return [python or trtllm_python(), "-c", CONVERT_SCRIPT, json.dumps(spec)]


# ---- the engine -----------------------------------------------------------------------------
def max_num_tokens(max_batch_size: int, max_input_len: int) -> int:
    """Tokens one engine step may carry. Without chunked context a whole prompt must fit, so
    never below max_input_len; otherwise a batch of full prompts, capped where TensorRT-LLM
    expects no further gain."""
    return max(max_input_len, min(max_batch_size * max_input_len, MAX_NUM_TOKENS_CAP))


def trtllm_build_command(checkpoint_dir: Path, engine_dir: Path, *, max_batch_size: int, max_input_len: int,
                         max_seq_len: int, prompt_table_size: int, python: str = "python",
                         workers: int = 1) -> list[str]:
    """The exact build command line for a decoder that takes image features via prompt tuning.

    `python -m tensorrt_llm.commands.build` is what the `trtllm-build` script runs, taken from the
    TensorRT-LLM interpreter itself (a `trtllm-build` on PATH may belong to another install).
    In-flight batching needs the GPT attention plugin, packed inputs and a paged KV cache
    (`--kv_cache_type paged`; `--paged_kv_cache` is deprecated in 1.x). Paged context FMHA is
    what lets KV-cache blocks be reused; it is the 1.2 default, passed explicitly so a changed
    default cannot turn reuse off. `--max_prompt_embedding_table_size` (alias
    `--max_multimodal_len`) bounds the prompt-table rows of a whole batch. `--workers` builds the
    ranks of a tensor/pipeline-parallel checkpoint in parallel. Quantization (W4A16 groupwise)
    travels in the checkpoint's config.json."""
    return [python, "-m", "tensorrt_llm.commands.build", "--checkpoint_dir", str(checkpoint_dir),
            "--output_dir", str(engine_dir),
            "--max_batch_size", str(max_batch_size), "--max_input_len", str(max_input_len),
            "--max_seq_len", str(max_seq_len), "--max_num_tokens", str(max_num_tokens(max_batch_size, max_input_len)),
            "--max_prompt_embedding_table_size", str(prompt_table_size),
            "--gpt_attention_plugin", "auto", "--gemm_plugin", "auto",
            "--remove_input_padding", "enable", "--kv_cache_type", "paged", "--use_paged_context_fmha", "enable",
            "--workers", str(workers)]


def _run(cmd: list[str], what: str) -> None:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as e:
        raise BackendUnavailableError(f"build-llm: cannot run {cmd[0]} ({e})") from None
    if proc.returncode != 0:
        tail = (proc.stderr or proc.stdout).strip().splitlines()[-5:]
        raise StageError(f"build-llm: {what} failed: " + " | ".join(tail))


def build_trtllm_engine(llm_dir: Path, out_dir: Path, *, recipe, family, extra_config: dict,
                        progress: Progress | None = None) -> dict:
    """The build-llm stage with TensorRT-LLM, for the decoder of `family` (a VLMFamily) in `llm_dir`."""
    llm_dir, out_dir = Path(llm_dir), Path(out_dir)
    if not family.supports_trtllm:
        # e.g. an engine that would apply 1-D rotary to image tokens: wrong answers, no error
        raise BackendUnavailableError(f"build-llm: the {family.name} family is not served by TensorRT-LLM: "
                                      f"{family.trtllm_refusal}; set decoder.backend: torch")
    llm_config = json.loads((llm_dir / "config.json").read_text())
    quant = quant_config_for(llm_config)
    dec = recipe.decoder
    capability = compute_capability()
    check_buildable(recipe.dtype, quant is not None, capability, tp_size=dec.tp_size, pp_size=dec.pp_size)
    from ..models.decoders import sliding_window_layers

    window = sliding_window_layers(llm_config).get("sliding_window")
    positions = recipe.limits.max_input_len + recipe.limits.max_output_len
    if window is not None and window < positions:
        # TensorRT-LLM takes a window at run time (KvCacheConfig.max_attention_window), which vlmctl does not set
        # (not run here): without it the engine would attend past the window, other answers than transformers
        raise BackendUnavailableError(f"build-llm: the decoder's sliding window ({window} positions, under the "
                                      f"{positions} the limits allow) is not passed to TensorRT-LLM by vlmctl; "
                                      "set decoder.backend: torch")
    trtllm_available(required=True)
    python = trtllm_python()
    progress = ensure(progress)
    ckpt = out_dir / "trtllm-checkpoint"
    lim = recipe.limits
    world = dec.tp_size * dec.pp_size
    table_rows = int(extra_config["prompt_table_size"])  # pipeline: prompt_table_size(limits, rows per image)
    build_cmd = trtllm_build_command(ckpt, out_dir / trtllm_engine.ENGINE_SUBDIR, max_batch_size=lim.max_batch_size,
                                     max_input_len=lim.max_input_len,
                                     max_seq_len=lim.max_input_len + lim.max_output_len,
                                     prompt_table_size=table_rows, python=python, workers=world)
    with tempfile.TemporaryDirectory(prefix="vlmctl-trtllm-") as tmp:
        hf_dir = stage_input_dir(llm_dir, Path(tmp) / "decoder")
        convert_cmd = convert_command(hf_dir, ckpt, recipe.dtype, llm_config, python,
                                      tp_size=dec.tp_size, pp_size=dec.pp_size)
        task = progress.task(f"build-llm: TensorRT-LLM checkpoint ({world} rank{'s' if world > 1 else ''})", total=None)
        _run(convert_cmd, "TensorRT-LLM checkpoint conversion")
        task.done()
    task = progress.task("build-llm: trtllm-build", total=None)
    _run(build_cmd, "trtllm-build")
    task.done()
    shutil.rmtree(ckpt, ignore_errors=True)
    eos = extra_config.get("eos_token_ids") or []
    pad = llm_config.get("pad_token_id")
    (out_dir / "config.json").write_text(json.dumps({
        "format": trtllm_engine.FORMAT, "format_version": trtllm_engine.FORMAT_VERSION,
        "engine": trtllm_engine.ENGINE_SUBDIR, "dtype": recipe.dtype,
        "vocab_size": int(llm_config["vocab_size"]), "hidden_size": int(llm_config["hidden_size"]),
        "quantization": quant, "end_id": eos[0] if eos else None,
        "pad_id": pad if pad is not None else (eos[0] if eos else None),
        "parallel": {"tp_size": dec.tp_size, "pp_size": dec.pp_size},
        "kv_cache_free_gpu_memory_fraction": dec.kv_cache_free_gpu_memory_fraction,
        **extra_config}, indent=2))
    return {"backend": "trtllm", "backend_version": f"tensorrt_llm {trtllm_version(python)}",
            "gpu": sm_string(capability), "python": python,
            "convert_command": " ".join(convert_cmd[:2] + ["<CONVERT_SCRIPT>", convert_cmd[3]]),
            "command": " ".join(build_cmd)}
