"""TensorRT-LLM decoder backend, tested up to the call.

TensorRT-LLM cannot be installed here, so these tests pin what vlmctl hands it: the exact
`trtllm-build` command, the checkpoint conversion (QuantConfig for an AutoAWQ checkpoint, the
rewritten config.json), the executor request (fake ids, prompt-table rows, extra ids, sampling,
end/pad ids) and the clear errors when tensorrt_llm is absent. Tests that need tensorrt_llm itself
skip with the reason; nothing here fakes the package.
"""

from __future__ import annotations

import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

from vlmctl.errors import BackendUnavailableError, EngineError, InputError, StageError
from vlmctl.export import trtllm as T
from vlmctl.models.base import EncodedPrompt, ImageItem
from vlmctl.runtime import trtllm_decoder as D
from vlmctl.runtime.sampling import SamplingParams

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
needs_trtllm = pytest.mark.skipif(not HAVE_TRTLLM, reason="tensorrt_llm is not installable here (its PyPI package "
                                                          "downloads from NVIDIA's index, which is unreachable)")
no_trtllm = pytest.mark.skipif(HAVE_TRTLLM, reason="checks the behaviour without tensorrt_llm")

# Every flag vlmctl passes, as TensorRT-LLM 1.2's trtllm-build parser defines it
# (tensorrt_llm/commands/build.py parse_arguments; plugin flags from tensorrt_llm/plugin/plugin.py
# cli_plugin_args: plugin dtypes take auto/float16/..., features take enable/disable).
TRTLLM_BUILD_FLAGS = {"--checkpoint_dir", "--output_dir", "--max_batch_size", "--max_input_len", "--max_seq_len",
                      "--max_num_tokens", "--max_prompt_embedding_table_size", "--kv_cache_type",
                      "--gpt_attention_plugin", "--gemm_plugin", "--remove_input_padding"}

AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}


@pytest.fixture
def no_trtllm_python(monkeypatch):
    monkeypatch.delenv(T.PYTHON_ENV, raising=False)


# ---- trtllm-build ----------------------------------------------------------------------------
def test_build_command_for_llava_recipe(tmp_path):
    from vlmctl.recipe import load_recipe

    recipe = load_recipe("llava-1.5-7b")
    lim = recipe.limits
    table = lim.max_batch_size * lim.max_images_per_request * 576  # 336 px / 14 px patches = 24 x 24 rows
    cmd = T.trtllm_build_command(tmp_path / "ckpt", tmp_path / "engine", max_batch_size=lim.max_batch_size,
                                 max_input_len=lim.max_input_len, max_seq_len=lim.max_input_len + lim.max_output_len,
                                 prompt_table_size=table)
    assert cmd == ["trtllm-build", "--checkpoint_dir", str(tmp_path / "ckpt"), "--output_dir", str(tmp_path / "engine"),
                   "--max_batch_size", "8", "--max_input_len", "2048", "--max_seq_len", "2560",
                   "--max_num_tokens", "8192", "--max_prompt_embedding_table_size", "4608",
                   "--gpt_attention_plugin", "auto", "--gemm_plugin", "auto",
                   "--remove_input_padding", "enable", "--kv_cache_type", "paged"]
    assert {a for a in cmd if a.startswith("--")} <= TRTLLM_BUILD_FLAGS
    assert "--paged_kv_cache" not in cmd  # deprecated in 1.x in favour of --kv_cache_type


@pytest.mark.parametrize("batch,input_len,expected", [(8, 2048, 8192), (1, 1024, 1024), (2, 1024, 2048),
                                                     (4, 16384, 16384)])
def test_max_num_tokens_holds_a_whole_prompt(batch, input_len, expected):
    # Without chunked context the engine must take a full prompt in one step.
    assert T.max_num_tokens(batch, input_len) == expected


# ---- the checkpoint --------------------------------------------------------------------------
def test_quant_config_for_autoawq_checkpoint():
    cfg = {"model_type": "llama", "quantization_config": AWQ_CONFIG}
    # TensorRT-LLM reads `quant_method: awq` as W4A16_GPTQ + zero points + use_autoawq (its own
    # convert_checkpoint.py, update_quant_config_from_hf); W4A16_AWQ is ModelOpt's format.
    assert T.quant_config_for(cfg) == {"quant_algo": "W4A16_GPTQ", "group_size": 128, "has_zero_point": True,
                                       "pre_quant_scale": False}
    assert T.from_hf_kwargs(cfg) == {"use_autoawq": True}
    assert T.quant_config_for({"model_type": "llama"}) is None
    assert T.from_hf_kwargs({"model_type": "llama"}) == {}
    assert T.quant_config_for({"quantization_config": {**AWQ_CONFIG, "group_size": 64}})["group_size"] == 64


@pytest.mark.parametrize("bad,needle", [({"group_size": 32}, "group size 32"), ({"version": "gemv"}, "GEMM"),
                                        ({"zero_point": False}, "zero points"), ({"quant_method": "gptq"}, "AutoAWQ")])
def test_quant_config_refuses_what_trtllm_cannot_load(bad, needle):
    with pytest.raises(StageError, match=needle):
        T.quant_config_for({"quantization_config": {**AWQ_CONFIG, **bad}})


def test_hf_config_for_trtllm_rewrites_rope_for_transformers_4():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=100, rope_theta=500000.0).to_dict()
    assert "rope_parameters" in cfg  # transformers 5 writes this; 4.57 (TensorRT-LLM 1.2's) reads rope_theta
    out = T.hf_config_for_trtllm(cfg)
    assert out["rope_theta"] == 500000.0 and "rope_parameters" not in out and "rope_scaling" not in out
    assert out["architectures"] == ["LlamaForCausalLM"]

    llama3 = {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192}}
    out = T.hf_config_for_trtllm(llama3)
    assert out["rope_theta"] == 5e5
    assert out["rope_scaling"] == {"rope_type": "llama3", "type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                   "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}
    assert T.hf_config_for_trtllm({"model_type": "qwen2", "dtype": "float16"}) == {
        "model_type": "qwen2", "architectures": ["Qwen2ForCausalLM"], "torch_dtype": "float16"}


def test_stage_input_dir_links_weights_and_refuses_model_names_in_the_path(tmp_path):
    llm = tmp_path / "llm"
    llm.mkdir()
    (llm / "config.json").write_text(json.dumps({"model_type": "llama", "rope_parameters": {"rope_theta": 1e4}}))
    (llm / "model.safetensors").write_bytes(b"weights")
    (llm / "tokenizer.json").write_text("{}")
    out = T.stage_input_dir(llm, tmp_path / "stage" / "decoder")
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 1e4
    assert (out / "model.safetensors").is_symlink() and (out / "model.safetensors").read_bytes() == b"weights"
    assert (out / "tokenizer.json").exists()
    # from_hugging_face maps weight names by substrings of the path: "llava" means a whole LLaVA.
    with pytest.raises(StageError, match="llava"):
        T.stage_input_dir(llm, tmp_path / "engines" / "LLaVA-1.5-7b" / "decoder")


def test_convert_command_runs_from_hugging_face_with_the_awq_mapping(tmp_path):
    cfg = {"model_type": "llama", "quantization_config": AWQ_CONFIG}
    cmd = T.convert_command(tmp_path / "hf", tmp_path / "ckpt", "float16", cfg, python="/opt/trtllm/bin/python")
    assert cmd[:3] == ["/opt/trtllm/bin/python", "-c", T.CONVERT_SCRIPT]
    compile(cmd[2], "<convert>", "exec")  # valid Python for the other interpreter
    assert json.loads(cmd[3]) == {"hf_dir": str(tmp_path / "hf"), "out_dir": str(tmp_path / "ckpt"),
                                  "dtype": "float16", "quant": T.quant_config_for(cfg),
                                  "hf_kwargs": {"use_autoawq": True}}
    # The script imports only what TensorRT-LLM 1.2 provides at these paths.
    for name in ("from tensorrt_llm.models import MODEL_MAP", "from tensorrt_llm.models.modeling_utils import "
                 "QuantConfig", "from tensorrt_llm.quantization import QuantAlgo", ".from_hugging_face(",
                 ".save_checkpoint(spec[\"out_dir\"], save_config=True)"):
        assert name in T.CONVERT_SCRIPT


def _recipe(dtype="float16", quant=False, **limits):
    from vlmctl.recipe import Recipe

    data = {"name": "t", "source": "x", "dtype": dtype, "decoder": {"backend": "trtllm"}}
    if quant:
        data["quantization"] = {"method": "awq"}
    if limits:
        data["limits"] = limits
    return Recipe.model_validate(data)


def _llm_dir(tmp_path, **extra) -> Path:
    d = tmp_path / "llm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100, **extra}))
    return d


@no_trtllm
def test_build_raises_backend_unavailable_without_tensorrt_llm(tmp_path, no_trtllm_python):
    with pytest.raises(BackendUnavailableError, match="tensorrt_llm is not installed.*VLMCTL_TRTLLM_PYTHON"):
        T.build_trtllm_engine(_llm_dir(tmp_path), tmp_path / "out", recipe=_recipe(),
                              extra_config={"prompt_table_size": 8})
    assert T.trtllm_available() is False


@no_trtllm
def test_build_names_the_configured_interpreter(tmp_path, monkeypatch):
    monkeypatch.setenv(T.PYTHON_ENV, sys.executable)
    with pytest.raises(BackendUnavailableError, match=f"not installed in {sys.executable}"):
        T.trtllm_available(required=True)
    monkeypatch.setenv(T.PYTHON_ENV, str(tmp_path / "no-such-python"))
    assert T.trtllm_version() is None


def test_build_refuses_awq_in_float32_and_mrope_before_calling_trtllm(tmp_path, no_trtllm_python):
    llm = _llm_dir(tmp_path, quantization_config=AWQ_CONFIG)
    with pytest.raises(StageError, match="float16 or bfloat16"):
        T.build_trtllm_engine(llm, tmp_path / "out", recipe=_recipe("float32", quant=True),
                              extra_config={"prompt_table_size": 8})
    mrope = tmp_path / "m"
    mrope.mkdir()
    (mrope / "config.json").write_text(json.dumps({"model_type": "qwen2", "rope_parameters": {"mrope_section": [1]}}))
    with pytest.raises(BackendUnavailableError, match="M-RoPE"):
        T.build_trtllm_engine(mrope, tmp_path / "out", recipe=_recipe(), extra_config={"prompt_table_size": 8})


@no_trtllm
def test_pipeline_resolves_trtllm_backend_with_a_clear_error(no_trtllm_python):
    from vlmctl.pipeline import resolve_decoder_backend

    with pytest.raises(BackendUnavailableError, match="tensorrt_llm"):
        resolve_decoder_backend(_recipe())
    auto = _recipe()
    auto.decoder.backend = "auto"
    assert resolve_decoder_backend(auto) == "torch"


# ---- the executor request ----------------------------------------------------------------------
def _image(rows: int, hidden: int, seed: int, content: str) -> ImageItem:
    feats = np.random.default_rng(seed).standard_normal((rows, hidden)).astype(np.float32)
    return ImageItem(inputs={}, num_tokens=rows, content_hash=content, features=feats)


def test_expand_prompt_fake_ids_index_the_request_table():
    V, P = 50, 7
    a, b = _image(3, 4, 0, "a"), _image(2, 4, 1, "b")
    tokens = [1, 9, P, P, P, 10, P, P, 2]
    ids, table = D.expand_prompt(tokens, P, [a.features, b.features], V)
    assert ids == [1, 9, 50, 51, 52, 10, 53, 54, 2]  # counting up through the request's images
    assert table.shape == (5, 4)
    for pos, tok in enumerate(ids):  # the lookup TensorRT-LLM's PromptTuningEmbedding does
        if tok >= V:
            src = a.features if pos < 5 else b.features
            row = pos - 2 if pos < 5 else pos - 6
            np.testing.assert_array_equal(table[tok - V], src[row])
    assert D.expand_prompt([1, 2], P, [], V) == ([1, 2], None)
    with pytest.raises(EngineError, match="4 image positions"):
        D.expand_prompt([P, P, P, P], P, [a.features], V)


def test_expand_prompt_matches_the_torch_decoder_contract():
    import torch

    from vlmctl.runtime.decoder import TorchDecoder

    V, H = 20, 4
    dec = TorchDecoder.__new__(TorchDecoder)  # only the embedding lookup is exercised
    dec.vocab_size, dec.embed = V, torch.randn(V, H)
    img = _image(3, H, 2, "c")
    ids, table = D.expand_prompt([1, 5, 5, 5, 3], 5, [img.features], V)
    x = dec.embed_ids(torch.tensor(ids), torch.from_numpy(table))
    torch.testing.assert_close(x[1:4], torch.from_numpy(img.features))
    torch.testing.assert_close(x[0], dec.embed[1])


def test_token_extra_ids_name_image_content():
    V, P = 50, 7
    a, b, a2 = _image(2, 4, 0, "hash-a"), _image(2, 4, 1, "hash-b"), _image(2, 4, 3, "hash-a")
    ids, _ = D.expand_prompt([1, P, P, 3, P, P], P, [a.features, b.features], V)
    extra = D.token_extra_ids(ids, V, [a, b])
    assert extra[0] == 0 and extra[3] == 0
    assert extra[1] == extra[2] != 0 and extra[4] == extra[5] != 0 and extra[1] != extra[4]
    assert all(0 < e < 1 << 63 for e in extra if e)
    ids2, _ = D.expand_prompt([1, P, P], P, [a2.features], V)
    assert D.token_extra_ids(ids2, V, [a2])[1] == extra[1]  # same content -> same id -> reusable KV blocks


@pytest.mark.parametrize("params,expected", [
    (SamplingParams(temperature=0.0), {"beam_width": 1, "top_k": 1}),
    (SamplingParams(temperature=0.7, top_p=0.9, top_k=40, seed=5),
     {"beam_width": 1, "temperature": 0.7, "top_p": 0.9, "top_k": 40, "seed": 5}),
    (SamplingParams(temperature=1.0, seed=-1), {"beam_width": 1, "temperature": 1.0, "top_p": 1.0, "seed": 2**64 - 1}),
])
def test_sampling_config_mapping(params, expected):
    assert D.sampling_config_kwargs(params) == expected


def test_sampling_config_without_seed_draws_one():
    kw = D.sampling_config_kwargs(SamplingParams(temperature=0.8))
    assert "top_k" not in kw and kw["top_p"] == 1.0 and 0 <= kw["seed"] < 1 << 63


def test_request_spec_carries_table_extra_ids_and_stop_ids():
    V, P, H = 50, 7, 4
    img = _image(3, H, 0, "x")
    prompt = EncodedPrompt(token_ids=[1, P, P, P, 2], images=[img], image_placeholder_id=P)
    ids, table = D.expand_prompt(prompt.token_ids, P, [img.features], V)
    extra = D.token_extra_ids(ids, V, prompt.images)
    spec = D.request_spec(ids, table, extra, SamplingParams(max_tokens=12, temperature=0), end_id=2, pad_id=0)
    assert spec["input_token_ids"] == [1, 50, 51, 52, 2]
    assert spec["max_tokens"] == 12 and spec["streaming"] is True
    assert spec["end_id"] == 2 and spec["pad_id"] == 0
    assert spec["sampling"] == {"beam_width": 1, "top_k": 1}
    assert spec["return_log_probs"] is False
    # PromptTuningConfig(embedding_table=[rows, hidden], input_token_extra_ids=[one per input token])
    np.testing.assert_array_equal(D.table_from_wire(spec["prompt_table"]), img.features)
    assert len(spec["input_token_extra_ids"]) == len(spec["input_token_ids"])
    text = D.request_spec([1, 2], None, None, SamplingParams(ignore_eos=True, logprobs=0), end_id=2, pad_id=None)
    assert text["end_id"] == -1 and text["pad_id"] == 0  # -1: never stop, as TensorRT-LLM's LLM API does
    assert text["prompt_table"] is None and text["input_token_extra_ids"] is None
    assert text["return_log_probs"] is True
    assert D.request_spec([1], None, None, SamplingParams(), end_id=None, pad_id=None)["end_id"] == -1
    with pytest.raises(InputError, match="top_logprobs"):
        D.request_spec([1], None, None, SamplingParams(logprobs=3), end_id=2, pad_id=0)


def test_frames_round_trip_and_end():
    buf = io.BytesIO()
    spec = D.request_spec([1, 2], np.ones((2, 3)), [0, 0], SamplingParams(), end_id=2, pad_id=0)
    D.write_frame(buf, ("submit", "r1", spec))
    D.write_frame(buf, ("cancel", "r1"))
    buf.seek(0)
    kind, rid, got = D.read_frame(buf)
    assert (kind, rid) == ("submit", "r1") and got["input_token_ids"] == [1, 2]
    assert D.table_from_wire(got["prompt_table"]).shape == (2, 3)
    assert D.read_frame(buf) == ("cancel", "r1")
    assert D.read_frame(buf) is None
    assert D.read_frame(io.BytesIO(b"\x10\x00\x00\x00\x00\x00\x00\x00abc")) is None  # torn frame


def test_finish_reasons_cover_trtllm_enum():
    # tensorrt_llm.bindings.executor.FinishReason values (nanobind/executor/request.cpp)
    assert set(D.FINISH_REASONS) == {"NOT_FINISHED", "END_ID", "STOP_WORDS", "LENGTH", "TIMED_OUT", "CANCELLED"}
    assert D.FINISH_REASONS["END_ID"] == "stop" and D.FINISH_REASONS["LENGTH"] == "length"


# ---- the runtime without tensorrt_llm -----------------------------------------------------------
def _trtllm_layout(d: Path, **extra) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    (d / "engine").mkdir(exist_ok=True)
    (d / "engine" / "config.json").write_text(json.dumps({"pretrained_config": {"dtype": "float16"}}))
    (d / "config.json").write_text(json.dumps({"format": T.ENGINE_FORMAT, "engine": "engine", "vocab_size": 100,
                                               "end_id": 2, "pad_id": 0, "backend": "trtllm",
                                               "limits": {"max_batch_size": 2, "max_input_len": 64,
                                                          "max_output_len": 16, "max_images_per_request": 1},
                                               **extra}))
    return d


@no_trtllm
def test_decoder_load_raises_backend_unavailable(tmp_path, no_trtllm_python):
    with pytest.raises(BackendUnavailableError, match="tensorrt_llm is not installed"):
        D.TrtllmDecoder.load(_trtllm_layout(tmp_path / "build-llm"))
    with pytest.raises(EngineError, match="not a TensorRT-LLM decoder"):
        D.TrtllmDecoder.load(_trtllm_layout(tmp_path / "other", format="vlmctl-torch-decoder"))


@no_trtllm
def test_worker_reports_missing_tensorrt_llm(tmp_path):
    """The worker process itself (as the parent starts it) answers with a clear first frame."""
    env = {**os.environ, "PYTHONPATH": str(Path(D.__file__).resolve().parents[2])}
    proc = subprocess.run([sys.executable, "-m", "vlmctl.runtime.trtllm_decoder", str(tmp_path)], input=b"",
                          capture_output=True, env=env, timeout=120)
    kind, message = D.read_frame(io.BytesIO(proc.stdout))
    assert kind == "unavailable" and "cannot import tensorrt_llm" in message
    assert proc.returncode == 1


@no_trtllm
def test_engine_with_trtllm_build_raises_backend_unavailable(tiny_llava_engine, tmp_path, no_trtllm_python):
    from vlmctl.runtime.engine import Engine

    eng = tmp_path / "engine"
    shutil.copytree(tiny_llava_engine, eng, symlinks=True)
    shutil.rmtree(eng / "build-llm")
    # published as build-llm publishes (with its manifest): chat/serve check an engine's files at start
    from vlmctl.artifacts import run_stage

    run_stage(eng, "build-llm", {}, {}, lambda out: _trtllm_layout(out) and {})
    with pytest.raises(BackendUnavailableError, match="tensorrt_llm"):
        Engine(eng, device="cpu")


# ---- with tensorrt_llm -------------------------------------------------------------------------
@needs_trtllm
def test_executor_bindings_take_the_request_spec():
    import tensorrt_llm.bindings.executor as tle
    import torch

    spec = D.request_spec([1, 2, 3], None, None, SamplingParams(temperature=0.5, top_k=4, seed=1, max_tokens=5),
                          end_id=2, pad_id=0)
    req, table = D.build_request(tle, torch, spec, torch.float16)
    assert table is None and list(req.input_token_ids) == [1, 2, 3] and req.max_tokens == 5
    assert req.sampling_config.top_k == 4 and req.end_id == 2 and req.streaming


@needs_trtllm
@pytest.mark.gpu
def test_trtllm_engine_matches_torch_decoder_greedy(tmp_path):
    """Build the tiny LLaVA both ways (fp16) and compare greedy tokens; only runs where TensorRT-LLM does."""
    from conftest import write_recipe
    from tiny_models import make_image, make_llava

    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe
    from vlmctl.runtime.engine import Engine

    ckpt = make_llava(tmp_path / "ckpt", hidden=256)  # head size 64: one the attention kernels take
    outs = {}
    for backend in ("torch", "trtllm"):
        recipe = load_recipe(write_recipe(tmp_path / f"{backend}.yaml", ckpt, profiles=["fp16"],
                                          decoder={"backend": backend}, vision={"backend": "onnxruntime"}))
        build(recipe, tmp_path / backend)
        eng = Engine(tmp_path / backend, device="cuda")
        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "What is this?"}]}]
        outs[backend] = eng.chat(msgs, [make_image(0)], SamplingParams(max_tokens=12, temperature=0)).token_ids
    assert outs["trtllm"] == outs["torch"]
