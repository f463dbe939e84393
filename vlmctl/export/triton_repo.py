"""`vlmctl export-triton`: a Triton Inference Server model repository for an engine directory whose
decoder is a TensorRT-LLM 1.2 engine, in tensorrtllm_backend 1.2's multimodal in-flight-batching
layout (`ensemble` -> `preprocessing` -> `multimodal_encoders` -> `tensorrt_llm` -> `postprocessing`).

What it writes: every `config.pbtxt` filled (no `${...}` placeholders, so no `fill_template.py`
step), a vision engine in the form the stock `multimodal_encoders` model loads
(`multimodal_encoders/1/vision/`: `model.engine` with I/O `input` -> `encoder_output`, and a
`config.json` whose `builder_config` names the stock `model_type` and precision), the stock
Python models' files (copied from a tensorrtllm_backend `all_models` directory, or linked to
the copy inside NVIDIA's Triton TensorRT-LLM container), and `vlmctl-triton.json` (what was
exported, and the launch line). The decoder engine and the tokenizer stay in the engine
directory and are referenced by path.

Why a second vision engine: vlmctl's own (build-vision) is named after the family's ONNX I/O
(`pixel_values` -> `image_features`), which vlmctl's runtime feeds by name, and a serialized
TensorRT engine loads only under the TensorRT that built it. So the export renames the ONNX
graph's I/O (same nodes, same weights) and builds it with the TensorRT of the TensorRT-LLM
interpreter ($VLMCTL_TRTLLM_PYTHON), the one NVIDIA's container ships beside the same
TensorRT-LLM.

What it is not: vlmctl's own Python models. Families the stock models do not serve (their
`triton_stock` is None) are refused; vlmctl serves them with `vlmctl serve`. This path is legacy
upstream: the multimodal Triton models reach end of life with TensorRT-LLM 1.2, whose successor
is `trtllm-serve` on the PyTorch backend (docs/tensorrt-llm.md). None of it has run against a
real Triton server here (no TensorRT-LLM, no GPU); tests parse every config with Triton's
`model_config` protobuf and check the ensemble by Triton's own rules.
"""

from __future__ import annotations

import json
import os
import shutil
import subprocess
import tempfile
from dataclasses import dataclass
from pathlib import Path

from .. import __version__
from ..errors import (BackendUnavailableError, CheckpointError, EngineError, InputError, OptionError, StageError,
                      UnsupportedModelError)
from ..formats.triton_config import ModelConfig, Step, Tensor
from ..formats.workdir import EngineDir, WorkDir
from ..progress import Progress, ensure

# The all_models directory of tensorrtllm_backend inside NVIDIA's Triton TensorRT-LLM container
# (its Dockerfile copies triton_backend/all_models to /app/all_models).
STOCK_ALL_MODELS = "/app/all_models"
# The stock Python models' files, relative to all_models (tensorrtllm_backend 1.2).
STOCK_FILES = {
    "preprocessing": ("inflight_batcher_llm/preprocessing/1/model.py",),
    "postprocessing": ("inflight_batcher_llm/postprocessing/1/model.py",),
    "multimodal_encoders": ("multimodal/multimodal_encoders/1/model.py",
                            "multimodal/multimodal_encoders/1/multimodal_utils.py"),
}
MODELS = ("ensemble", "preprocessing", "multimodal_encoders", "tensorrt_llm", "postprocessing")
VISION_SUBDIR = "vision"  # inside multimodal_encoders/1/: Triton reads only numeric dirs as versions
VISION_INPUT, VISION_OUTPUT = "input", "encoder_output"  # what the stock encoder model feeds and reads
METADATA = "vlmctl-triton.json"  # Triton ignores files at the repository root
# The vision model shares GPU 0 with rank 0 of the decoder: TensorRT-LLM's own 0.9 leaves it too little.
KV_FRACTION_LIMIT = 0.9
# launch_triton_server.py's --multimodal_gpu0_cuda_mem_pool_bytes: GPU tensors (the prompt table)
# pass between models through this pool; upstream's multimodal guide uses 300 MB.
UPSTREAM_POOL_BYTES = 300_000_000


@dataclass
class EngineFacts:
    """What the export reads from a vlmctl engine directory (checked on the way)."""

    engine_dir: Path
    family: object
    stock: object
    trtllm_engine: Path
    processor: Path
    onnx: Path
    onnx_input: str
    onnx_output: str
    max_batch: int
    max_images: int
    table_rows: int
    hidden: int
    vocab: int
    world: int
    rows_per_image: int
    kv_fraction: float
    trtllm_version: str | None
    profile: dict
    workspace_gib: float
    vision_rows: int = -1  # rows per vision-engine batch item (export-vision's io.json), -1 if unknown


def _read_json(path: Path, what: str) -> dict:
    try:
        data = json.loads(Path(path).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{path}: {what} is missing or unreadable ({type(e).__name__})") from None
    if not isinstance(data, dict):
        raise EngineError(f"{path}: {what} is not a JSON object")
    return data


def read_engine(engine_dir: Path, *, kv_cache_fraction: float | None = None) -> EngineFacts:
    """Check that `engine_dir` is a vlmctl engine directory that the stock multimodal models can serve."""
    from ..formats.artifacts import check_engine_files, read_manifest
    from ..models.registry import get_family
    from ..formats.trtllm_engine import engine_path, is_trtllm_engine

    engine_dir = Path(engine_dir)
    ed = EngineDir.open(engine_dir)
    # As chat and serve check it: every stage there, every file its manifest lists with its size (the
    # repository points at the decoder engine and the tokenizer, and builds from export-vision's graph).
    check_engine_files(engine_dir)
    llm = _read_json(ed.llm_config, "the decoder config")
    if not is_trtllm_engine(llm):
        raise EngineError(f"{engine_dir}: its decoder is not a TensorRT-LLM engine (backend "
                          f"{llm.get('backend', llm.get('format'))!r}); a Triton repository needs one: rebuild with "
                          "`--set decoder.backend=trtllm` (or serve this engine with `vlmctl serve`)")
    trtllm_engine = engine_path(ed.build_llm, llm)
    built = _read_json(trtllm_engine / "config.json", "the TensorRT-LLM engine's config.json")
    pretrained, build_cfg = built.get("pretrained_config") or {}, built.get("build_config") or {}
    try:
        family = get_family(ed.family_name())
    except CheckpointError as e:
        raise EngineError(e.message) from None
    stock = family.triton_stock
    if stock is None:
        from ..models.registry import FAMILIES, family_class

        served = [n for n in FAMILIES if family_class(n).triton_stock is not None]
        raise UnsupportedModelError(
            f"tensorrtllm_backend's stock multimodal models do not serve the {family.name} family (vlmctl families "
            f"they serve: {', '.join(served)}); serve it with `vlmctl serve`")
    dtype = pretrained.get("dtype")
    if dtype != "float16":
        raise EngineError(f"{trtllm_engine}: the engine is {dtype}; the Triton multimodal path passes the prompt table "
                          "between its models as float16 (TYPE_FP16, its documented setting) and TensorRT-LLM takes the "
                          "table in the engine's dtype: rebuild with a float16 profile")
    lim = llm.get("limits") or {}
    max_batch = int(build_cfg.get("max_batch_size", lim.get("max_batch_size", 0)))
    table_rows = int(build_cfg.get("max_prompt_embedding_table_size", llm.get("prompt_table_size", 0)))
    max_images = stock.max_images or int(lim.get("max_images_per_request", 1))
    rows_per_image = int(llm.get("image_tokens_per_image", 0))
    if stock.client_pixels and (max_batch <= 0 or table_rows // max_batch // max_images != rows_per_image):
        # The stock preprocessing reserves table rows / max_batch_size / max_num_images fake ids per image.
        raise EngineError(
            f"{engine_dir}: the stock preprocessing would give each image {table_rows // max(max_batch, 1) // max_images} "
            f"prompt rows (prompt table {table_rows} / batch {max_batch} / {max_images} images) but the vision model "
            f"gives {rows_per_image}; rebuild with limits.max_input_len >= {max_images * rows_per_image}")
    onnx = ed.onnx
    io = _read_json(ed.onnx_io, "export-vision/io.json")
    if not onnx.exists() or len(io.get("inputs", [])) != 1 or len(io.get("outputs", [])) != 1:
        raise EngineError(f"{engine_dir}/export-vision: needs one ONNX graph of one input and one output "
                          "(rerun `vlmctl export-vision`)")
    fraction = kv_cache_fraction if kv_cache_fraction is not None else \
        float(llm.get("kv_cache_free_gpu_memory_fraction", 0.8))
    if not 0 < fraction < KV_FRACTION_LIMIT:
        if kv_cache_fraction is not None:  # the command line's (2), the recipe's (5)
            raise OptionError(f"--kv-cache-fraction {fraction}: must be above 0 and below {KV_FRACTION_LIMIT} (the "
                              "vision engine shares GPU 0 with the decoder)")
        raise InputError(f"KV-cache memory fraction {fraction}: must be above 0 and below {KV_FRACTION_LIMIT} (the vision "
                         "engine shares GPU 0 with the decoder); pass --kv-cache-fraction")
    vision = (read_manifest(ed.build_vision) or {}).get("settings", {})
    backend_version = str((read_manifest(ed.build_llm) or {}).get("backend_version") or "")
    parallel = llm.get("parallel") or {}
    return EngineFacts(
        engine_dir=engine_dir.resolve(), family=family, stock=stock, trtllm_engine=trtllm_engine.resolve(),
        processor=ed.convert.processor.resolve(), onnx=onnx.resolve(),
        onnx_input=io["inputs"][0], onnx_output=io["outputs"][0], max_batch=max_batch, max_images=max_images,
        table_rows=table_rows, hidden=int(pretrained.get("hidden_size", llm.get("hidden_size", 0))),
        vocab=int(pretrained.get("vocab_size", llm.get("vocab_size", 0))),
        world=int(parallel.get("tp_size", 1)) * int(parallel.get("pp_size", 1)), rows_per_image=rows_per_image,
        kv_fraction=fraction, trtllm_version=backend_version.split()[-1] if backend_version else None,
        profile=vision.get("profile") or {}, workspace_gib=float(vision.get("workspace_gib", 4.0)),
        vision_rows=int(io.get("feature_rows", -1)))


# ---- the vision engine the stock encoder model loads ----------------------------------------
def rename_vision_io(src: Path, dest: Path, input_name: str, output_name: str) -> dict:
    """`dest`: the ONNX graph of `src` with its one input renamed `input` and its one output
    `encoder_output` (every node that reads or writes them follows; weights untouched, an
    external data file is linked, not copied). Returns the graph's I/O dtype and shapes."""
    import onnx
    from google.protobuf.message import DecodeError

    src, dest = Path(src), Path(dest)
    try:
        model = onnx.load(str(src), load_external_data=False)
    except DecodeError:
        raise EngineError(f"{src}: not a readable ONNX graph (rerun `vlmctl export-vision`)") from None
    g = model.graph
    inputs = [i for i in g.input if i.name not in {t.name for t in g.initializer}]
    if [i.name for i in inputs] != [input_name] or [o.name for o in g.output] != [output_name]:
        raise EngineError(f"{src}: expected input {input_name!r} and output {output_name!r}, found "
                          f"{[i.name for i in inputs]} -> {[o.name for o in g.output]}")
    names = {input_name: VISION_INPUT, output_name: VISION_OUTPUT}
    taken = {n for node in g.node for n in (*node.input, *node.output)} | {t.name for t in g.initializer}
    clash = (taken - set(names)) & set(names.values())
    if clash:
        raise EngineError(f"{src}: the graph already uses the name(s) {sorted(clash)}")
    for vi in (*g.input, *g.output, *g.value_info):
        vi.name = names.get(vi.name, vi.name)
    for node in g.node:
        node.input[:] = [names.get(n, n) for n in node.input]
        node.output[:] = [names.get(n, n) for n in node.output]
    dest.parent.mkdir(parents=True, exist_ok=True)
    for t in g.initializer:  # external weights stay where they are: link them beside the new graph
        for entry in t.external_data:
            if entry.key == "location" and not (dest.parent / entry.value).exists():
                os.symlink((src.parent / entry.value).resolve(), dest.parent / entry.value)
    onnx.save_model(model, str(dest))

    def describe(vi):
        t = vi.type.tensor_type
        return {"dtype": onnx.helper.tensor_dtype_to_np_dtype(t.elem_type).name,
                "shape": [d.dim_value if d.HasField("dim_value") else -1 for d in t.shape.dim]}

    return {"input": describe(g.input[[i.name for i in g.input].index(VISION_INPUT)]), "output": describe(g.output[0])}


# Runs in the TensorRT-LLM interpreter (stdlib + tensorrt only): the renamed graph, built strongly
# typed as build-vision builds vlmctl's own (the graph carries its precision; TensorRT 11 has no
# other way), with the same optimization profile. argv[1] is the JSON spec.
VISION_BUILD_SCRIPT = """\
import json, sys
spec = json.loads(sys.argv[1])
import tensorrt as trt
logger = trt.Logger(trt.Logger.WARNING)
builder = trt.Builder(logger)
network = builder.create_network(1 << int(trt.NetworkDefinitionCreationFlag.STRONGLY_TYPED))
parser = trt.OnnxParser(network, logger)
if not parser.parse_from_file(spec["onnx"]):
    sys.exit("TensorRT could not parse the ONNX graph: " + "; ".join(str(parser.get_error(i)) for i in range(parser.num_errors)))
config = builder.create_builder_config()
config.set_memory_pool_limit(trt.MemoryPoolType.WORKSPACE, int(spec["workspace_bytes"]))
profile = builder.create_optimization_profile()
for name, (lo, opt, hi) in spec["profile"].items():
    profile.set_shape(name, lo, opt, hi)
config.add_optimization_profile(profile)
serialized = builder.build_serialized_network(network, config)
if serialized is None:
    sys.exit("TensorRT failed to build the vision engine")
with open(spec["engine"], "wb") as f:
    f.write(bytes(serialized))
print(json.dumps({"tensorrt": trt.__version__}))
"""


def vision_profile(facts: EngineFacts, onnx_info: dict) -> dict:
    """build-vision's optimization profile, keyed by the renamed input."""
    if facts.profile:
        prof = facts.profile.get(facts.onnx_input)
        if prof is None:
            raise EngineError(f"{facts.engine_dir}/build-vision: its profile has no input {facts.onnx_input!r}")
        return {VISION_INPUT: [list(s) for s in prof]}
    from .tensorrt import profile_shapes

    from ..formats.artifacts import read_manifest

    settings = (read_manifest(WorkDir(facts.engine_dir).build_vision) or {}).get("settings", {})
    max_images = int(settings.get("max_images", facts.max_batch * facts.max_images))
    shape = tuple(onnx_info["input"]["shape"])
    try:
        lo, opt, hi = profile_shapes({VISION_INPUT: shape}, max_images)[VISION_INPUT]
    except StageError as e:
        raise EngineError(f"{facts.onnx}: {e}") from None
    return {VISION_INPUT: [list(lo), list(opt), list(hi)]}


def vision_build_command(onnx: Path, engine: Path, profile: dict, workspace_gib: float, python: str) -> list[str]:
    spec = {"onnx": str(onnx), "engine": str(engine), "profile": profile,
            "workspace_bytes": int(workspace_gib * (1 << 30))}
    return [python, "-c", VISION_BUILD_SCRIPT, json.dumps(spec)]


def builder_config(stock, onnx_info: dict, profile: dict, rows: int = -1) -> dict:
    """The vision engine's config.json: `builder_config` as TensorRT-LLM's multimodal builder
    writes it (the stock models read `model_type` and `precision`). `rows`: the output's row
    count where the graph leaves it symbolic (export-vision measured it)."""
    out_shape = list(onnx_info["output"]["shape"])
    if len(out_shape) == 3 and out_shape[1] < 0:
        out_shape[1] = rows
    return {"builder_config": {
        "model_type": stock.model_type, "precision": onnx_info["input"]["dtype"], "strongly_typed": True,
        "max_batch_size": int(profile[VISION_INPUT][2][0]), "model_name": "multiModal",
        "output_shape": [-1, *out_shape[1:]]}}


def _run_vision_build(cmd: list[str]) -> str:
    try:
        proc = subprocess.run(cmd, capture_output=True, text=True, stdin=subprocess.DEVNULL)
    except OSError as e:
        raise BackendUnavailableError(f"export-triton: cannot run {cmd[0]} ({e})") from None
    if proc.returncode != 0:
        tail = " | ".join((proc.stderr or proc.stdout).strip().splitlines()[-5:])
        if "No module named 'tensorrt'" in tail:
            raise BackendUnavailableError(f"export-triton: {cmd[0]} has no tensorrt to build the vision engine with "
                                          "(point VLMCTL_TRTLLM_PYTHON at TensorRT-LLM 1.2's interpreter)")
        raise StageError(f"export-triton: the vision engine build failed: {tail}")
    try:
        return json.loads(proc.stdout.strip().splitlines()[-1])["tensorrt"]
    except (IndexError, ValueError, KeyError):
        raise StageError(f"export-triton: the vision engine build printed no TensorRT version: {proc.stdout[-200:]}") \
            from None


# ---- the model configs ----------------------------------------------------------------------
def _t(name, dt, dims, **kw) -> Tensor:
    return Tensor(name, dt, tuple(dims), **kw)


def _scalar(name, dt, **kw) -> Tensor:
    # The TensorRT-LLM backend takes per-request scalars as [1] reshaped to [] (its documented form).
    return Tensor(name, dt, (1,), reshape=(), **kw)


def model_configs(facts: EngineFacts, paths: dict[str, str], *, streaming: bool, kv_cache_reuse: bool) -> dict:
    """The five `config.pbtxt` models. `paths`: server-side paths of the engine, tokenizer and vision engine."""
    mbs, stock = facts.max_batch, facts.stock
    opt = {"optional": True}
    images_raw = not stock.client_pixels

    pre_in = [_t("QUERY", "TYPE_STRING", [1]), _t("DECODER_QUERY", "TYPE_STRING", [1], **opt),
              _t("IMAGE_BYTES", "TYPE_UINT8", [-1, -1, -1, -1], **opt), _t("IMAGE_URL", "TYPE_STRING", [1], **opt),
              _t("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1]), _t("BAD_WORDS_DICT", "TYPE_STRING", [-1], **opt),
              _t("STOP_WORDS_DICT", "TYPE_STRING", [-1], **opt),
              _t("EMBEDDING_BIAS_WORDS", "TYPE_STRING", [-1], **opt),
              _t("EMBEDDING_BIAS_WEIGHTS", "TYPE_FP32", [-1], **opt), _t("END_ID", "TYPE_INT32", [1], **opt),
              _t("PAD_ID", "TYPE_INT32", [1], **opt), _t("PROMPT_TABLE_EXTRA_ID", "TYPE_UINT64", [1], **opt)]
    pre_out = [_t("INPUT_ID", "TYPE_INT32", [-1]), _t("REQUEST_INPUT_LEN", "TYPE_INT32", [1]),
               _t("DECODER_INPUT_ID", "TYPE_INT32", [-1]), _t("REQUEST_DECODER_INPUT_LEN", "TYPE_INT32", [1]),
               _t("BAD_WORDS_IDS", "TYPE_INT32", [2, -1]), _t("STOP_WORDS_IDS", "TYPE_INT32", [2, -1]),
               _t("EMBEDDING_BIAS", "TYPE_FP32", [-1]), _t("REQUEST_OUTPUT_LEN", "TYPE_INT32", [1]),
               _t("OUT_END_ID", "TYPE_INT32", [1]), _t("OUT_PAD_ID", "TYPE_INT32", [1]),
               _t("OUT_PROMPT_TABLE_EXTRA_IDS", "TYPE_UINT64", [-1]),
               _t("PIXEL_VALUES", "TYPE_FP16", [-1, -1, -1, -1]), _t("IMAGE_SIZES", "TYPE_INT64", [-1, 2]),
               _t("IS_VIDEO_INPUT", "TYPE_BOOL", [1])]
    preprocessing = ModelConfig(
        "preprocessing", mbs, pre_in, pre_out, backend="python", dynamic_batching={},
        parameters={"tokenizer_dir": paths["processor"], "add_special_tokens": "true",
                    "multimodal_model_path": paths["vision"], "gpt_model_path": paths["engine"],
                    "max_num_images": str(facts.max_images), "hf_model_path": paths["processor"]})

    enc_in = [_t("IMAGE", "TYPE_FP16", [-1, -1, -1, -1], **opt), _t("pixel_values", "TYPE_FP16", [-1, -1, -1, -1], **opt),
              _t("image_sizes", "TYPE_INT64", [-1, 2], **opt), _t("is_video_input", "TYPE_BOOL", [1], **opt)]
    enc_out = [_t("OUT_PROMPT_EMBEDDING_TABLE", "TYPE_FP16", [-1, -1]), _t("OUT_PROMPT_VOCAB_SIZE", "TYPE_INT32", [1])]
    encoders = ModelConfig("multimodal_encoders", mbs, enc_in, enc_out, backend="python", dynamic_batching={},
                           parameters={"multimodal_model_path": paths["vision"], "hf_model_path": paths["processor"]})

    llm_in = [_t("input_ids", "TYPE_INT32", [-1], allow_ragged_batch=True, **opt),
              _scalar("input_lengths", "TYPE_INT32"), _scalar("request_output_len", "TYPE_INT32"),
              _t("decoder_input_ids", "TYPE_INT32", [-1], allow_ragged_batch=True, **opt),
              _scalar("decoder_input_lengths", "TYPE_INT32", **opt),
              _scalar("end_id", "TYPE_INT32", **opt), _scalar("pad_id", "TYPE_INT32", **opt),
              _t("stop_words_list", "TYPE_INT32", [2, -1], allow_ragged_batch=True, **opt),
              _t("bad_words_list", "TYPE_INT32", [2, -1], allow_ragged_batch=True, **opt),
              _t("embedding_bias", "TYPE_FP32", [-1], allow_ragged_batch=True, **opt),
              _scalar("beam_width", "TYPE_INT32", **opt), _scalar("temperature", "TYPE_FP32", **opt),
              _scalar("runtime_top_k", "TYPE_INT32", **opt), _scalar("runtime_top_p", "TYPE_FP32", **opt),
              _scalar("len_penalty", "TYPE_FP32", **opt), _scalar("repetition_penalty", "TYPE_FP32", **opt),
              _scalar("min_tokens", "TYPE_INT32", **opt), _scalar("presence_penalty", "TYPE_FP32", **opt),
              _scalar("frequency_penalty", "TYPE_FP32", **opt), _scalar("seed", "TYPE_UINT64", **opt),
              _scalar("return_log_probs", "TYPE_BOOL", **opt), _scalar("return_context_logits", "TYPE_BOOL", **opt),
              _scalar("return_generation_logits", "TYPE_BOOL", **opt), _scalar("exclude_input_in_output", "TYPE_BOOL", **opt),
              _scalar("stop", "TYPE_BOOL", **opt), _scalar("streaming", "TYPE_BOOL", **opt),
              _t("prompt_embedding_table", "TYPE_FP16", [-1, -1], allow_ragged_batch=True, **opt),
              _t("prompt_table_extra_ids", "TYPE_UINT64", [-1], allow_ragged_batch=True, **opt),
              _scalar("prompt_vocab_size", "TYPE_INT32", **opt)]
    llm_out = [_t("output_ids", "TYPE_INT32", [-1, -1]), _t("sequence_length", "TYPE_INT32", [-1]),
               _t("cum_log_probs", "TYPE_FP32", [-1]), _t("output_log_probs", "TYPE_FP32", [-1, -1]),
               _t("context_logits", "TYPE_FP32", [-1, -1]), _t("generation_logits", "TYPE_FP32", [-1, -1, -1]),
               _t("batch_index", "TYPE_INT32", [1]), _t("sequence_index", "TYPE_INT32", [1])]
    llm_params = {
        "gpt_model_type": "inflight_fused_batching", "gpt_model_path": paths["engine"], "max_beam_width": "1",
        "FORCE_CPU_ONLY_INPUT_TENSORS": "no", "batch_scheduler_policy": "guaranteed_no_evict",
        "kv_cache_free_gpu_mem_fraction": f"{facts.kv_fraction:g}",
        # Reuse keys KV blocks by token ids; image rows carry fake ids (vocab_size + k) that repeat
        # across requests, so reuse is safe only when each request names its image content with
        # prompt_table_extra_id (which the ensemble then requires).
        "enable_kv_cache_reuse": str(kv_cache_reuse).lower(), "exclude_input_in_output": "true",
        "enable_chunked_context": "false", "normalize_log_probs": "true",
        "executor_worker_path": "/opt/tritonserver/backends/tensorrtllm/trtllmExecutorWorker"}
    tensorrt_llm = ModelConfig("tensorrt_llm", mbs, llm_in, llm_out, backend="tensorrtllm", decoupled=streaming,
                               dynamic_batching={"preferred_batch_size": [mbs], "max_queue_delay_microseconds": 0},
                               parameters=llm_params)

    postprocessing = ModelConfig("postprocessing", mbs,
                                 [_t("TOKENS_BATCH", "TYPE_INT32", [-1, -1]), _t("SEQUENCE_LENGTH", "TYPE_INT32", [-1])],
                                 [_t("OUTPUT", "TYPE_STRING", [-1])], backend="python", dynamic_batching={},
                                 parameters={"tokenizer_dir": paths["processor"], "skip_special_tokens": "true"})

    ens_in = [_t("text_input", "TYPE_STRING", [1]), _t("max_tokens", "TYPE_INT32", [1])]
    if stock.client_pixels:
        ens_in.append(_t("image_input", "TYPE_FP16", [-1, -1, -1, -1], **opt))
    if images_raw:
        ens_in += [_t("image_bytes_input", "TYPE_UINT8", [-1, -1, -1, -1], **opt),
                   _t("image_url_input", "TYPE_STRING", [1], **opt)]
    ens_in += [_t("bad_words", "TYPE_STRING", [-1], **opt), _t("stop_words", "TYPE_STRING", [-1], **opt),
               _t("end_id", "TYPE_INT32", [1], **opt), _t("pad_id", "TYPE_INT32", [1], **opt),
               _t("top_k", "TYPE_INT32", [1], **opt), _t("top_p", "TYPE_FP32", [1], **opt),
               _t("temperature", "TYPE_FP32", [1], **opt), _t("length_penalty", "TYPE_FP32", [1], **opt),
               _t("repetition_penalty", "TYPE_FP32", [1], **opt), _t("min_tokens", "TYPE_INT32", [1], **opt),
               _t("presence_penalty", "TYPE_FP32", [1], **opt), _t("frequency_penalty", "TYPE_FP32", [1], **opt),
               _t("seed", "TYPE_UINT64", [1], **opt), _t("return_log_probs", "TYPE_BOOL", [1], **opt),
               _t("beam_width", "TYPE_INT32", [1], **opt), _t("stream", "TYPE_BOOL", [1], **opt),
               _t("prompt_table_extra_id", "TYPE_UINT64", [1], optional=not kv_cache_reuse),
               _t("embedding_bias_words", "TYPE_STRING", [-1], **opt),
               _t("embedding_bias_weights", "TYPE_FP32", [-1], **opt)]
    ens_out = [_t("text_output", "TYPE_STRING", [-1]), _t("cum_log_probs", "TYPE_FP32", [-1]),
               _t("output_log_probs", "TYPE_FP32", [-1, -1]), _t("batch_index", "TYPE_INT32", [1]),
               _t("sequence_index", "TYPE_INT32", [1])]
    pre_map = {"QUERY": "text_input", "REQUEST_OUTPUT_LEN": "max_tokens", "BAD_WORDS_DICT": "bad_words",
               "STOP_WORDS_DICT": "stop_words", "EMBEDDING_BIAS_WORDS": "embedding_bias_words",
               "EMBEDDING_BIAS_WEIGHTS": "embedding_bias_weights", "END_ID": "end_id", "PAD_ID": "pad_id",
               "PROMPT_TABLE_EXTRA_ID": "prompt_table_extra_id"}
    if images_raw:
        pre_map.update({"IMAGE_BYTES": "image_bytes_input", "IMAGE_URL": "image_url_input"})
    pre_out_map = {"INPUT_ID": "_INPUT_ID", "REQUEST_INPUT_LEN": "_REQUEST_INPUT_LEN",
                   "REQUEST_OUTPUT_LEN": "_REQUEST_OUTPUT_LEN", "STOP_WORDS_IDS": "_STOP_WORDS_IDS",
                   "BAD_WORDS_IDS": "_BAD_WORDS_IDS", "EMBEDDING_BIAS": "_EMBEDDING_BIAS",
                   "OUT_END_ID": "_PREPROCESSOR_END_ID", "OUT_PAD_ID": "_PREPROCESSOR_PAD_ID",
                   "OUT_PROMPT_TABLE_EXTRA_IDS": "_OUT_PROMPT_TABLE_EXTRA_IDS"}
    enc_map: dict[str, str] = {}
    if stock.client_pixels:
        enc_map["IMAGE"] = "image_input"
    if images_raw:
        pre_out_map.update({"PIXEL_VALUES": "_PIXEL_VALUES", "IMAGE_SIZES": "_IMAGE_SIZES",
                            "IS_VIDEO_INPUT": "_IS_VIDEO_INPUT"})
        enc_map.update({"pixel_values": "_PIXEL_VALUES", "image_sizes": "_IMAGE_SIZES",
                        "is_video_input": "_IS_VIDEO_INPUT"})
    llm_map = {"input_ids": "_INPUT_ID", "input_lengths": "_REQUEST_INPUT_LEN",
               "request_output_len": "_REQUEST_OUTPUT_LEN", "end_id": "_PREPROCESSOR_END_ID",
               "pad_id": "_PREPROCESSOR_PAD_ID", "embedding_bias": "_EMBEDDING_BIAS", "runtime_top_k": "top_k",
               "runtime_top_p": "top_p", "temperature": "temperature", "len_penalty": "length_penalty",
               "repetition_penalty": "repetition_penalty", "min_tokens": "min_tokens",
               "presence_penalty": "presence_penalty", "frequency_penalty": "frequency_penalty", "seed": "seed",
               "return_log_probs": "return_log_probs", "beam_width": "beam_width", "streaming": "stream",
               "prompt_embedding_table": "_PROMPT_EMBEDDING_TABLE", "prompt_vocab_size": "_PROMPT_VOCAB_SIZE",
               "stop_words_list": "_STOP_WORDS_IDS", "bad_words_list": "_BAD_WORDS_IDS",
               "prompt_table_extra_ids": "_OUT_PROMPT_TABLE_EXTRA_IDS"}
    ensemble = ModelConfig(
        "ensemble", mbs, ens_in, ens_out, platform="ensemble", instance_count=None,
        steps=[Step("preprocessing", pre_map, pre_out_map),
               Step("multimodal_encoders", enc_map, {"OUT_PROMPT_EMBEDDING_TABLE": "_PROMPT_EMBEDDING_TABLE",
                                                     "OUT_PROMPT_VOCAB_SIZE": "_PROMPT_VOCAB_SIZE"}),
               Step("tensorrt_llm", llm_map, {"output_ids": "_TOKENS_BATCH", "sequence_length": "_SEQUENCE_LENGTH",
                                              "cum_log_probs": "cum_log_probs", "output_log_probs": "output_log_probs",
                                              "batch_index": "batch_index", "sequence_index": "sequence_index"}),
               Step("postprocessing", {"TOKENS_BATCH": "_TOKENS_BATCH", "SEQUENCE_LENGTH": "_SEQUENCE_LENGTH"},
                    {"OUTPUT": "text_output"})])
    return {"ensemble": ensemble, "preprocessing": preprocessing, "multimodal_encoders": encoders,
            "tensorrt_llm": tensorrt_llm, "postprocessing": postprocessing}


# ---- paths, stock files, launch ---------------------------------------------------------------
def parse_mounts(mounts: list[str] | tuple[str, ...]) -> list[tuple[str, str]]:
    """`HOST=SERVER` prefixes (as `docker run -v HOST:SERVER`), longest host prefix first."""
    out = []
    for m in mounts or ():
        host, sep, server = m.partition("=")
        if not sep or not host or not server.startswith("/"):
            raise OptionError(f"--mount {m!r}: expected HOST_DIR=SERVER_DIR (an absolute path as the server sees it)")
        out.append((str(Path(host).resolve()), server.rstrip("/") or "/"))
    return sorted(out, key=lambda hs: -len(hs[0]))


def server_path(path: Path, mounts: list[tuple[str, str]]) -> str:
    p = str(Path(path).resolve())
    for host, server in mounts:
        if p == host or p.startswith(host.rstrip("/") + "/"):
            rest = p[len(host.rstrip("/")):]  # "" or "/..."
            return (server.rstrip("/") + rest) or "/"  # a mount at the server's / gives /x, not //x
    return p


def check_stock_models(stock_models: str) -> bool:
    """True when `stock_models` is an all_models directory here (its files get copied); False for
    a path only the server has (absolute; its files get linked). Checked before any build runs."""
    src = Path(stock_models)
    if not src.is_dir():
        if not src.is_absolute():
            raise OptionError(f"--stock-models {stock_models}: no such directory here (a path that only the server "
                             "has must be absolute)")
        return False
    missing = [f for files in STOCK_FILES.values() for f in files if not (src / f).is_file()]
    if missing:
        raise InputError(f"--stock-models {src}: not a tensorrtllm_backend all_models directory (no {missing[0]})")
    return True


def place_stock_files(repo: Path, stock_models: str) -> dict:
    """Copy the stock Python models' files from a local all_models directory, or, when the
    directory is not here (NVIDIA's container path, by default), link to where the server has it."""
    local = check_stock_models(stock_models)
    for model, files in STOCK_FILES.items():
        for f in files:
            dest = repo / model / "1" / Path(f).name
            if local:
                shutil.copyfile(Path(stock_models) / f, dest)
            else:
                os.symlink(str(Path(stock_models) / f), dest)
    return {"stock_models": str(stock_models),
            "stock_files": "copied" if local else "linked (resolved where the server runs)"}


def launch_command(repo_on_server: str, world: int, pool_bytes: int) -> list[str]:
    return ["python3", "/app/scripts/launch_triton_server.py", f"--world_size={world}", f"--model_repo={repo_on_server}",
            "--tensorrt_llm_model_name=tensorrt_llm,multimodal_encoders",
            f"--multimodal_gpu0_cuda_mem_pool_bytes={pool_bytes}"]


def pool_bytes(facts: EngineFacts) -> int:
    """Upstream's 300 MB, or twice the engine's whole float16 prompt table when that is larger (an estimate)."""
    return max(UPSTREAM_POOL_BYTES, 2 * 2 * facts.table_rows * facts.hidden)


def check_output(out_dir: Path, engine_dir: Path, stock_models: str, *, force: bool) -> None:
    """Where the repository may go: neither inside nor around the engine directory (or a local
    all_models directory), since publishing replaces `out_dir` whole; an existing `out_dir` only with
    `force`, and only a repository export-triton wrote (its METADATA file) or an empty directory."""
    out = Path(out_dir).resolve()
    if out == engine_dir or engine_dir in out.parents:
        raise InputError(f"{out_dir}: the repository must lie outside the engine directory")
    if out in engine_dir.parents:
        raise InputError(f"{out_dir}: holds the engine directory {engine_dir}, which writing the repository there "
                         "would delete; choose a directory of its own")
    stock = Path(stock_models)
    if stock.is_dir() and (stock.resolve() == out or out in stock.resolve().parents):
        raise InputError(f"{out_dir}: holds --stock-models {stock_models}, which writing the repository there would "
                         "delete; choose a directory of its own")
    if not out_dir.exists() and not out_dir.is_symlink():
        return
    if not out_dir.is_dir():
        raise InputError(f"{out_dir} exists and is not a directory")
    if not force:
        raise InputError(f"{out_dir} already exists (use --force to replace it)")
    if not (out_dir / METADATA).is_file() and any(out_dir.iterdir()):
        raise InputError(f"{out_dir}: not a repository export-triton wrote (no {METADATA}); --force replaces only "
                         "those, or an empty directory")


# ---- the command ------------------------------------------------------------------------------
def export_triton_repo(engine_dir: Path, out_dir: Path, *, streaming: bool = False, kv_cache_reuse: bool = False,
                       kv_cache_fraction: float | None = None, stock_models: str = STOCK_ALL_MODELS,
                       mounts: list[str] | tuple[str, ...] = (), force: bool = False,
                       progress: Progress | None = None) -> dict:
    from ..backends.trtllm import PYTHON_ENV, trtllm_python, trtllm_version, version_supported

    progress = ensure(progress)
    out_dir = Path(out_dir)
    mount_list = parse_mounts(mounts)
    facts = read_engine(engine_dir, kv_cache_fraction=kv_cache_fraction)
    check_stock_models(stock_models)
    check_output(out_dir, facts.engine_dir, stock_models, force=force)
    python = trtllm_python()
    version = trtllm_version(python if os.environ.get(PYTHON_ENV) else None)
    if version is None or not version_supported(version):
        have = f"tensorrt_llm {version}" if version else "no tensorrt_llm"
        raise BackendUnavailableError(f"export-triton builds the vision engine with TensorRT-LLM 1.2's TensorRT, but "
                                      f"{python} has {have}; set {PYTHON_ENV} to TensorRT-LLM 1.2's interpreter")

    from ..formats.artifacts import atomic_dir

    with atomic_dir(out_dir) as tmp:
        for m in MODELS:
            (tmp / m / "1").mkdir(parents=True)
        vision = tmp / "multimodal_encoders" / "1" / VISION_SUBDIR
        vision.mkdir()
        final_vision = out_dir.resolve() / "multimodal_encoders" / "1" / VISION_SUBDIR
        with tempfile.TemporaryDirectory(prefix="vlmctl-triton-onnx-") as work:
            onnx_path = Path(work) / "model.onnx"
            task = progress.task("export-triton: renaming the vision graph's I/O", total=None)
            onnx_info = rename_vision_io(facts.onnx, onnx_path, facts.onnx_input, facts.onnx_output)
            task.done()
            profile = vision_profile(facts, onnx_info)
            cmd = vision_build_command(onnx_path, vision / "model.engine", profile, facts.workspace_gib, python)
            task = progress.task("export-triton: building the vision engine (TensorRT)", total=None)
            trt_version = _run_vision_build(cmd)
            task.done()
        cfg = builder_config(facts.stock, onnx_info, profile, facts.vision_rows)
        cfg["vlmctl"] = {"tensorrt_version": trt_version, "source_onnx": str(facts.onnx)}
        (vision / "config.json").write_text(json.dumps(cfg, indent=2))
        extra = facts.family.triton_vision_files(WorkDir(facts.engine_dir).convert.vision, vision)
        paths = {"engine": server_path(facts.trtllm_engine, mount_list),
                 "processor": server_path(facts.processor, mount_list),
                 "vision": server_path(final_vision, mount_list)}
        configs = model_configs(facts, paths, streaming=streaming, kv_cache_reuse=kv_cache_reuse)
        for name, mc in configs.items():
            (tmp / name / "config.pbtxt").write_text(mc.to_pbtxt())
        placed = place_stock_files(tmp, stock_models)
        pool = pool_bytes(facts)
        launch = launch_command(server_path(out_dir.resolve(), mount_list), facts.world, pool)
        result = {
            "repository": str(out_dir.resolve()), "engine_dir": str(facts.engine_dir), "family": facts.family.name,
            "stock_model_type": facts.stock.model_type, "models": list(MODELS), "max_batch_size": facts.max_batch,
            "max_num_images": facts.max_images, "world_size": facts.world, "streaming": streaming,
            "kv_cache_reuse": kv_cache_reuse, "kv_cache_free_gpu_mem_fraction": facts.kv_fraction,
            "tensorrt_llm_version": facts.trtllm_version, "vision_tensorrt_version": trt_version,
            "vision_engine": {"dir": paths["vision"], "files": ["model.engine", "config.json", *extra],
                              "profile": profile, "precision": onnx_info["input"]["dtype"]},
            "paths_on_server": paths, **placed, "cuda_memory_pool_bytes": pool, "launch": launch,
            "vlmctl_version": __version__,
            "note": "tensorrtllm_backend's multimodal models are legacy upstream (end of life with TensorRT-LLM "
                    "1.2); the successor is trtllm-serve on the PyTorch backend"}
        (tmp / METADATA).write_text(json.dumps(result, indent=2))
    return result
