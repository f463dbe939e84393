"""TensorRT-LLM decoder backend, checked against TensorRT-LLM 1.2's recorded interfaces.

TensorRT-LLM cannot be installed here. What vlmctl hands it is checked against data recorded
from its 1.2 sources (tests/data/trtllm-1.2, see sources.json): `trtllm-build` command lines are
parsed by a parser rebuilt from every recorded option; the conversion script and the worker run
as real subprocesses against a strict stand-in package generated from the same data
(tests/trtllm_contract.py), which refuses unknown keywords and validates tables, extra ids, end
ids and sampling ranges. Tests that need the real package skip with the reason.
"""

from __future__ import annotations

import argparse
import importlib.util
import io
import json
import os
import shutil
import subprocess
import sys
import time
from pathlib import Path

import numpy as np
import pytest

import trtllm_contract as C
from vlmctl.errors import BackendUnavailableError, EngineError, InputError, RecipeError, StageError
from vlmctl.export import trtllm as T
from vlmctl.models.base import EncodedPrompt, ImageItem
from vlmctl.models.registry import get_family
from vlmctl.runtime import trtllm_decoder as D
from vlmctl.runtime import trtllm_worker as W
from vlmctl.runtime.sampling import SamplingParams

HAVE_TRTLLM = importlib.util.find_spec("tensorrt_llm") is not None
needs_trtllm = pytest.mark.skipif(not HAVE_TRTLLM, reason="tensorrt_llm is not installable here (its PyPI package "
                                                          "downloads from NVIDIA's index, which is unreachable)")
no_trtllm = pytest.mark.skipif(HAVE_TRTLLM, reason="checks the behaviour without tensorrt_llm")
PY_ENV = "VLMCTL_TRTLLM_PYTHON"

AWQ_CONFIG = {"quant_method": "awq", "bits": 4, "group_size": 128, "zero_point": True, "version": "gemm",
              "modules_to_not_convert": None}


@pytest.fixture
def no_trtllm_python(monkeypatch):
    monkeypatch.delenv(PY_ENV, raising=False)


def _stdlib_venv(path: Path, *, site_paths: list[str] = ()) -> Path:
    """A venv from the same base interpreter as this one (no pip); `site_paths` join its path via a .pth."""
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, capture_output=True)
    py = path / "bin" / "python"
    site = Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())
    if site_paths:
        (site / "vlmctl_test_extra.pth").write_text("\n".join(site_paths) + "\n")
    return py


def _site(py: Path) -> Path:
    return Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())


@pytest.fixture(scope="module")
def envs(tmp_path_factory):
    """Interpreters as a user has them:
    - `plain`: a stdlib venv, no tensorrt_llm;
    - `trt`: a venv with the generated tensorrt_llm-1.2.1 stand-in and torch (a .pth to this
      environment's packages; their .pth hooks, e.g. vlmctl's editable install, do not run);
    - `user`: a venv where vlmctl is a normal, non-editable install (`pip install --target`),
      its dependencies reachable through a .pth, as after `pip install vlmctl`."""
    root = tmp_path_factory.mktemp("envs")
    deps = str(Path(np.__file__).resolve().parents[1])  # this environment's site-packages
    plain = _stdlib_venv(root / "plain")
    trt = _stdlib_venv(root / "trt", site_paths=[deps])
    C.write_fake_package(_site(trt))
    user = _stdlib_venv(root / "user", site_paths=[deps])
    repo = Path(__file__).resolve().parents[1]
    src = root / "src"  # a copy, so the build writes nothing into the source tree
    src.mkdir()
    for name in ("pyproject.toml", "README.md"):
        shutil.copy(repo / name, src / name)
    shutil.copytree(repo / "vlmctl", src / "vlmctl", ignore=shutil.ignore_patterns("__pycache__"))
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "-q", "--no-deps", "--no-build-isolation",
                           "--target", str(_site(user)), str(src)], capture_output=True, text=True)
    if proc.returncode != 0:
        pytest.skip(f"cannot build a non-editable vlmctl here: {proc.stderr.strip()[-300:]}")
    return {"plain": plain, "trt": trt, "user": user, "user_site": _site(user)}


# ---- 1. which interpreter has TensorRT-LLM ------------------------------------------------------
def test_version_probe_asks_a_venv_of_the_same_base_python(envs, monkeypatch):
    from vlmctl.backends import trtllm as B

    # Both venvs resolve to the very same executable file; only asking them tells them apart.
    assert os.path.realpath(envs["trt"]) == os.path.realpath(envs["plain"])
    monkeypatch.setenv(PY_ENV, str(envs["trt"]))
    assert B.trtllm_version() == "1.2.1" and B.trtllm_available(required=True)
    monkeypatch.setenv(PY_ENV, str(envs["plain"]))
    assert B.trtllm_version() is None
    with pytest.raises(BackendUnavailableError, match=f"not installed in {envs['plain']}"):
        B.trtllm_available(required=True)
    monkeypatch.setenv(PY_ENV, sys.executable)  # this interpreter, asked as a subprocess like any other
    assert B.trtllm_version() == (None if not HAVE_TRTLLM else B.trtllm_version())
    monkeypatch.setenv(PY_ENV, "/no/such/python")
    assert B.trtllm_version() is None


def test_auto_backend_takes_trtllm_from_the_configured_venv(envs, monkeypatch):
    from vlmctl.pipeline import resolve_decoder_backend

    monkeypatch.setenv(PY_ENV, str(envs["trt"]))
    assert resolve_decoder_backend(_recipe(backend="auto")) == "trtllm"
    monkeypatch.setenv(PY_ENV, str(envs["plain"]))
    assert resolve_decoder_backend(_recipe(backend="auto")) == "torch"
    with pytest.raises(BackendUnavailableError, match="tensorrt_llm"):
        resolve_decoder_backend(_recipe(backend="trtllm"))
    with pytest.raises(BackendUnavailableError):  # parallelism is never silently dropped
        resolve_decoder_backend(_recipe(backend="auto", tp_size=2))


def test_unsupported_version_is_refused(tmp_path, monkeypatch):
    from vlmctl.backends import trtllm as B

    py = _stdlib_venv(tmp_path / "old")
    (dist := _site(py) / "tensorrt_llm-1.1.0.dist-info").mkdir()
    (dist / "METADATA").write_text("Metadata-Version: 2.1\nName: tensorrt_llm\nVersion: 1.1.0\n")
    monkeypatch.setenv(PY_ENV, str(py))
    with pytest.raises(BackendUnavailableError, match="1.1.0 .* needs 1.2.x"):
        B.trtllm_available(required=True)


# ---- 2. the worker's import path ------------------------------------------------------------------
def test_worker_of_an_installed_vlmctl_does_not_see_vlmctls_site_packages(envs, tmp_path):
    """Started from a non-editable vlmctl, the worker imports tensorrt_llm from its own
    environment and nothing from vlmctl's site-packages (which would shadow torch/transformers)."""
    layout = _layout(tmp_path / "build-llm", vocab=100, hidden=8)
    log = tmp_path / "fake.log"
    script = ("import json, sys, vlmctl\n"
              "from vlmctl.runtime.trtllm_decoder import TrtllmDecoder\n"
              "d = TrtllmDecoder.load(sys.argv[1], startup_timeout_s=120)\n"
              "print(json.dumps({'vlmctl': vlmctl.__file__, 'worker_sys_path': d.info['sys_path']}))\n"
              "d.close()\n")
    env = {k: v for k, v in os.environ.items() if k != "PYTHONPATH"}
    env.update({PY_ENV: str(envs["trt"]), "FAKE_TRTLLM_LOG": str(log)})
    proc = subprocess.run([str(envs["user"]), "-c", script, str(layout)], capture_output=True, text=True, env=env,
                          timeout=300, cwd=tmp_path)
    assert proc.returncode == 0, proc.stderr[-2000:]
    out = json.loads(proc.stdout.strip().splitlines()[-1])
    user_site = str(envs["user_site"])
    assert out["vlmctl"].startswith(user_site)  # the parent really ran the installed copy
    assert not any(p and Path(p).resolve() == Path(user_site).resolve() for p in out["worker_sys_path"])
    ev = [e for e in C.read_log(log) if e["event"] == "executor"][0]
    assert ev["vlmctl_imported"] is False


# ---- trtllm-build -----------------------------------------------------------------------------------
def _build_cmd(tmp_path, recipe_name="llava-1.5-7b", rows=576, python="/opt/trtllm/bin/python", workers=1):
    from vlmctl.recipe import load_recipe

    lim = load_recipe(recipe_name).limits
    return T.trtllm_build_command(tmp_path / "ckpt", tmp_path / "engine", max_batch_size=lim.max_batch_size,
                                  max_input_len=lim.max_input_len, max_seq_len=lim.max_input_len + lim.max_output_len,
                                  prompt_table_size=T.prompt_table_size(lim, rows), python=python, workers=workers)


def test_build_command_parses_with_the_recorded_trtllm_build_options(tmp_path):
    cmd = _build_cmd(tmp_path, workers=2)
    # The build module of the TensorRT-LLM interpreter itself, not a trtllm-build found on PATH.
    assert cmd[:3] == ["/opt/trtllm/bin/python", "-m", "tensorrt_llm.commands.build"]
    flags = [a for a in cmd[3:] if a.startswith("--")]
    assert set(flags) <= C.recorded_flags()  # exact names (TensorRT-LLM's parser would also take prefixes)
    ns = C.build_parser().parse_args(cmd[3:])
    assert ns.checkpoint_dir == str(tmp_path / "ckpt") and ns.output_dir == str(tmp_path / "engine")
    assert (ns.max_batch_size, ns.max_input_len, ns.max_seq_len) == (8, 2048, 2560)
    assert ns.max_num_tokens == 8192 and ns.max_prompt_embedding_table_size == 8 * 576
    assert ns.kv_cache_type == "paged" and not hasattr(ns, "paged_kv_cache")  # deprecated flag unused
    assert ns.use_paged_context_fmha == "enable" and ns.remove_input_padding == "enable"
    assert ns.gpt_attention_plugin == "auto" and ns.gemm_plugin == "auto" and ns.workers == 2


def test_the_tensor_parallel_recipe_builds_per_rank(tmp_path):
    from vlmctl.recipe import load_recipe

    r = load_recipe("llava-v1.6-34b")
    assert (r.decoder.backend, r.decoder.tp_size, r.decoder.pp_size) == ("trtllm", 2, 1)
    world = r.decoder.tp_size * r.decoder.pp_size
    ns = C.build_parser().parse_args(_build_cmd(tmp_path, "llava-v1.6-34b", rows=2928, workers=world)[3:])
    assert ns.workers == 2 and ns.max_prompt_embedding_table_size == 8 * 2928
    spec = json.loads(T.convert_command(tmp_path, tmp_path / "c", r.dtype, {}, "py", tp_size=2, pp_size=1)[3])
    assert (spec["tp_size"], spec["pp_size"]) == (2, 1)
    assert load_recipe("llava-v1.6-34b", ["decoder.tp_size=4"]).decoder.tp_size == 4


def test_recorded_parser_is_strict():
    parser = C.build_parser()
    for bad in (["--kv_cache_type", "pagedd"], ["--gemm_plugin", "float8"], ["--use_paged_context_fmha", "yes"],
                ["--max_batch_size", "eight"]):
        with pytest.raises((argparse.ArgumentError, SystemExit)):
            parser.parse_args(bad)
    assert parser.parse_args(["--kv_cache_type", "PAGED"]).kv_cache_type == "paged"  # from_string upper-cases


@pytest.mark.parametrize("batch,input_len,expected", [(8, 2048, 8192), (1, 1024, 1024), (2, 1024, 2048),
                                                     (4, 16384, 16384)])
def test_max_num_tokens_holds_a_whole_prompt(batch, input_len, expected):
    # Without chunked context the engine must take a full prompt in one step.
    assert T.max_num_tokens(batch, input_len) == expected


def test_prompt_table_is_sized_per_sequence_by_what_fits_its_prompt():
    from vlmctl.recipe import load_recipe

    lim = load_recipe("llava-onevision-qwen2-7b").limits
    rows_per_image = 8829  # a lone OneVision image at its largest (the recipe's own note)
    naive = lim.max_batch_size * lim.max_images_per_request * rows_per_image
    rows = T.prompt_table_size(lim, rows_per_image)
    assert rows == lim.max_batch_size * lim.max_input_len < naive
    hidden, fp16 = 3584, 2  # Qwen2-7B
    assert round(rows * hidden * fp16 / 1e6) == 294 and round(naive * hidden * fp16 / 1e9, 2) == 1.01
    lim1 = load_recipe("llava-1.5-7b").limits  # one 576-row image per prompt: unchanged
    assert T.prompt_table_size(lim1, 576) == lim1.max_batch_size * 576


# ---- refusals before anything runs -------------------------------------------------------------------
def test_float32_is_refused_for_trtllm():
    with pytest.raises(StageError, match="float16 or bfloat16"):
        T.check_buildable("float32", False, (9, 0))
    with pytest.raises(RecipeError, match="float16 or bfloat16"):
        _load_recipe_text("dtype: float32\ndecoder: {backend: trtllm}\n")
    assert _recipe(dtype="float32", backend="auto").decoder.backend == "auto"  # auto falls back to torch


@pytest.mark.parametrize("cap,refused", [((10, 0), True), ((10, 3), True), ((11, 0), True), ((9, 0), False),
                                         ((8, 9), False), ((12, 0), False), (None, False)])
def test_awq_on_blackwell_is_refused_up_front(cap, refused):
    if refused:
        with pytest.raises(StageError, match="SM>=100.*decoder.backend: torch"):
            T.check_buildable("float16", True, cap)
    else:
        T.check_buildable("float16", True, cap)
    T.check_buildable("float16", False, cap)  # float engines build on every SM


def test_build_refuses_before_conversion(tmp_path, no_trtllm_python, monkeypatch):
    monkeypatch.setenv("VLMCTL_CUDA_CAPABILITY", "10.0")
    llm = _llm_dir(tmp_path, quantization_config=AWQ_CONFIG)
    with pytest.raises(StageError, match="SM>=100"):
        T.build_trtllm_engine(llm, tmp_path / "out", recipe=_recipe(quant=True), family=get_family("llava"),
                              extra_config={"prompt_table_size": 8})
    mrope = tmp_path / "m"
    mrope.mkdir()
    (mrope / "config.json").write_text(json.dumps({"model_type": "qwen2", "rope_parameters": {"mrope_section": [1]}}))
    with pytest.raises(BackendUnavailableError, match="M-RoPE"):  # the family says so; no config sniffing
        T.build_trtllm_engine(mrope, tmp_path / "out", recipe=_recipe(), family=get_family("qwen2_vl"),
                              extra_config={"prompt_table_size": 8})


def test_a_sliding_window_decoder_is_refused_for_trtllm(tmp_path, no_trtllm_python):
    """vlmctl does not pass TensorRT-LLM a max_attention_window: a Mistral decoder whose window is under the
    engine's positions would attend past it. A window no sequence reaches builds as usual."""
    llm = _llm_dir(tmp_path, model_type="mistral", sliding_window=1024, num_hidden_layers=2)
    with pytest.raises(BackendUnavailableError, match=r"sliding window \(1024 positions.*decoder.backend: torch"):
        T.build_trtllm_engine(llm, tmp_path / "out", recipe=_recipe(), family=get_family("llava_next"),
                              extra_config={"prompt_table_size": 8})
    wide = json.loads((llm / "config.json").read_text()) | {"sliding_window": 4096}
    (llm / "config.json").write_text(json.dumps(wide))
    with pytest.raises(BackendUnavailableError, match="TensorRT-LLM") as e:  # on to the missing TensorRT-LLM
        T.build_trtllm_engine(llm, tmp_path / "out", recipe=_recipe(), family=get_family("llava_next"),
                              extra_config={"prompt_table_size": 8})
    assert "sliding window" not in str(e.value)


def test_parallel_recipes_need_trtllm():
    with pytest.raises(RecipeError, match="tp_size/pp_size > 1 needs decoder.backend: trtllm"):
        _load_recipe_text("decoder: {backend: torch, tp_size: 2}\n")
    with pytest.raises(RecipeError, match="kv_cache_free_gpu_memory_fraction"):
        _load_recipe_text("decoder: {kv_cache_free_gpu_memory_fraction: 1.5}\n")


# ---- the checkpoint conversion, run against the recorded interfaces -----------------------------------
def test_quant_config_for_autoawq_checkpoint():
    cfg = {"model_type": "llama", "quantization_config": AWQ_CONFIG}
    fields = {f["name"] for f in C.load("models.json")["QuantConfig"]["fields"]}
    q = T.quant_config_for(cfg)
    assert set(q) <= fields and q["quant_algo"] in C.load("models.json")["QuantAlgo"]["members_seen"]
    # TensorRT-LLM reads `quant_method: awq` as W4A16_GPTQ + zero points + use_autoawq (its own
    # convert_checkpoint.py); W4A16_AWQ is ModelOpt's format.
    assert (q["quant_algo"], q["group_size"], q["has_zero_point"], q["pre_quant_scale"]) == ("W4A16_GPTQ", 128, True, False)
    assert T.from_hf_kwargs(cfg) == {"use_autoawq": True}
    assert T.quant_config_for({"model_type": "llama"}) is None and T.from_hf_kwargs({"model_type": "llama"}) == {}


@pytest.mark.parametrize("bad,needle", [({"group_size": 32}, "group size 32"), ({"version": "gemv"}, "GEMM"),
                                        ({"zero_point": False}, "zero points"), ({"quant_method": "gptq"}, "AutoAWQ")])
def test_quant_config_refuses_what_trtllm_cannot_load(bad, needle):
    with pytest.raises(StageError, match=needle):
        T.quant_config_for({"quantization_config": {**AWQ_CONFIG, **bad}})


@pytest.mark.parametrize("tp,pp,quant", [(1, 1, False), (2, 1, True), (2, 2, False)])
def test_convert_script_runs_against_the_recorded_interfaces(envs, tmp_path, tp, pp, quant):
    """The conversion script, as vlmctl hands it to the TensorRT-LLM interpreter, through the
    strict stand-in: one Mapping per rank, the config once, AutoAWQ's keywords accepted."""
    from transformers import LlamaConfig

    hf = tmp_path / "hf"
    hf.mkdir()
    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=100, rope_theta=500000.0).to_dict()
    if quant:
        cfg["quantization_config"] = AWQ_CONFIG
    (hf / "config.json").write_text(json.dumps(T.hf_config_for_trtllm(cfg)))
    log = tmp_path / "log"
    cmd = T.convert_command(hf, tmp_path / "ckpt", "float16", cfg, str(envs["trt"]), tp_size=tp, pp_size=pp)
    proc = subprocess.run(cmd, capture_output=True, text=True, env={**os.environ, "FAKE_TRTLLM_LOG": str(log)},
                          timeout=120)
    assert proc.returncode == 0, proc.stderr[-1500:]
    saves = [e for e in C.read_log(log) if e["event"] == "save_checkpoint"]
    assert [e["rank"] for e in saves] == list(range(tp * pp))
    assert [e["save_config"] for e in saves] == [True] + [False] * (tp * pp - 1)
    assert {(e["world_size"], e["tp_size"], e["pp_size"]) for e in saves} == {(tp * pp, tp, pp)}
    assert saves[0]["model"] == "LLaMAForCausalLM" and saves[0]["rope_theta"] == 500000.0
    if quant:
        assert saves[0]["quant"] == {"algo": "W4A16_GPTQ", "group_size": 128, "has_zero_point": True,
                                     "pre_quant_scale": False}
        assert saves[0]["use_autoawq"] is True
    else:
        assert saves[0]["quant"] is None
    assert sorted(p.name for p in (tmp_path / "ckpt").iterdir()) == \
        ["config.json"] + [f"rank{r}.safetensors" for r in range(tp * pp)]


def test_the_stand_in_refuses_unknown_keywords(envs, tmp_path):
    snippet = ("from tensorrt_llm.models.modeling_utils import QuantConfig\n"
               "QuantConfig(quant_algo=None, zero_point=True)\n")
    proc = subprocess.run([str(envs["trt"]), "-c", snippet], capture_output=True, text=True)
    assert proc.returncode != 0 and "unexpected keyword argument 'zero_point'" in proc.stderr


def test_hf_config_for_trtllm_rewrites_rope_for_transformers_4():
    from transformers import LlamaConfig

    cfg = LlamaConfig(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                      vocab_size=100, rope_theta=500000.0).to_dict()
    assert "rope_parameters" in cfg  # transformers 5 writes this; 4.57 (TensorRT-LLM 1.2's) reads rope_theta
    out = T.hf_config_for_trtllm(cfg)
    assert out["rope_theta"] == 500000.0 and "rope_parameters" not in out and "rope_scaling" not in out
    assert out["architectures"] == ["LlamaForCausalLM"]
    assert out["architectures"][0] in C.load("models.json")["MODEL_MAP"]
    llama3 = {"model_type": "llama", "rope_parameters": {"rope_type": "llama3", "rope_theta": 5e5, "factor": 8.0,
                                                         "low_freq_factor": 1.0, "high_freq_factor": 4.0,
                                                         "original_max_position_embeddings": 8192}}
    out = T.hf_config_for_trtllm(llama3)
    assert out["rope_theta"] == 5e5 and out["rope_scaling"]["type"] == "llama3"
    assert T.hf_config_for_trtllm({"model_type": "qwen2", "dtype": "float16"})["architectures"][0] in \
        C.load("models.json")["MODEL_MAP"]


def test_stage_input_dir_links_weights_and_refuses_model_names_in_the_path(tmp_path):
    llm = tmp_path / "llm"
    llm.mkdir()
    (llm / "config.json").write_text(json.dumps({"model_type": "llama", "rope_parameters": {"rope_theta": 1e4}}))
    (llm / "model.safetensors").write_bytes(b"weights")
    out = T.stage_input_dir(llm, tmp_path / "stage" / "decoder")
    assert json.loads((out / "config.json").read_text())["rope_theta"] == 1e4
    assert (out / "model.safetensors").is_symlink() and (out / "model.safetensors").read_bytes() == b"weights"
    # from_hugging_face maps weight names by substrings of the path: "llava" means a whole LLaVA.
    with pytest.raises(StageError, match="llava"):
        T.stage_input_dir(llm, tmp_path / "engines" / "LLaVA-1.5-7b" / "decoder")


# ---- the executor request ------------------------------------------------------------------------------
def _image(rows: int, hidden: int, seed: int, content: str) -> ImageItem:
    feats = np.random.default_rng(seed).standard_normal((rows, hidden)).astype(np.float32)
    return ImageItem(inputs={}, num_tokens=rows, content_hash=content, features=feats)


def test_expand_prompt_matches_the_torch_decoder_contract():
    import torch

    from vlmctl.runtime.decoder import TorchDecoder

    from vlmctl.formats.prompt_table import fake_ids

    V, H = 20, 4
    dec = TorchDecoder.__new__(TorchDecoder)  # only the embedding lookup is exercised
    dec.vocab_size, dec.embed, dec.embed_scale = V, torch.randn(V, H), None
    dec.table_base = V  # fake ids start at the vocabulary's end (no extra embedding rows here)
    a, b = _image(3, H, 2, "c"), _image(2, H, 3, "d")
    ids, table = D.expand_prompt([1, 5, 5, 5, 3, 5, 5], 5, [a.features, b.features], V)
    assert ids == fake_ids([1, 5, 5, 5, 3, 5, 5], 5, V, 5).tolist()
    t = torch.tensor(ids)
    fake = (t >= V).nonzero()[:, 0]
    x = dec._embed(t, fake, t[fake] - V, torch.from_numpy(table))
    torch.testing.assert_close(x[1:4], torch.from_numpy(a.features))
    torch.testing.assert_close(x[5:7], torch.from_numpy(b.features))
    torch.testing.assert_close(x[0], dec.embed[1])
    with pytest.raises(EngineError, match="4 image positions"):
        D.expand_prompt([5, 5, 5, 5], 5, [a.features], V)


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


@pytest.mark.parametrize("params", [SamplingParams(temperature=0.0), SamplingParams(temperature=0.7, top_p=0.9, top_k=40,
                                                                                   seed=5),
                                    SamplingParams(temperature=1.0, seed=-1), SamplingParams(temperature=0.8)])
def test_sampling_config_binds_to_the_recorded_signature(params):
    sig = C.load("executor_bindings.json")["classes"]["SamplingConfig"]["init"]
    names = {p["name"] for p in sig}
    kw = D.sampling_config_kwargs(params)
    assert set(kw) <= names
    if params.temperature == 0:
        assert kw["top_k"] == 1  # greedy whatever the runtime's defaults for unset fields
    else:
        assert 0 < kw["top_p"] <= 1 and 0 <= kw["seed"] < 1 << 64 and kw["temperature"] == params.temperature


def test_top_logprobs_is_refused():
    with pytest.raises(InputError, match="top_logprobs"):
        D.request_spec([1], None, None, SamplingParams(logprobs=3), end_id=2, pad_id=0)


def test_prompt_table_travels_in_the_engine_dtype():
    import torch

    x = np.random.default_rng(0).standard_normal((5, 7)).astype(np.float32) * 100
    for dtype in ("float16", "bfloat16"):
        wire = D.table_to_wire(x, dtype)
        assert len(wire["data"]) == x.size * 2  # half of float32
        ref = torch.from_numpy(x).to(getattr(torch, dtype))
        got = torch.frombuffer(bytearray(wire["data"]), dtype=getattr(torch, dtype)).reshape(wire["shape"])
        assert torch.equal(got, ref)  # bit-identical to torch's own rounding
    with pytest.raises(EngineError, match="float32"):
        D.table_to_wire(x, "float32")


def test_frames_round_trip_and_end():
    buf = io.BytesIO()
    spec = D.request_spec([1, 2], np.ones((2, 3)), [0, 0], SamplingParams(), end_id=2, pad_id=0)
    W.write_frame(buf, ("submit", "r1", spec))
    W.write_frame(buf, ("cancel", "r1"))
    buf.seek(0)
    kind, rid, got = W.read_frame(buf)
    assert (kind, rid) == ("submit", "r1") and got["input_token_ids"] == [1, 2]
    assert W.read_frame(buf) == ("cancel", "r1") and W.read_frame(buf) is None
    assert W.read_frame(io.BytesIO(b"\x10\x00\x00\x00\x00\x00\x00\x00abc")) is None  # torn frame


def test_finish_reasons_cover_the_recorded_enum():
    assert set(D.FINISH_REASONS) == set(C.load("executor_bindings.json")["enums"]["FinishReason"])


def test_worker_imports_nothing_of_vlmctl():
    import ast

    tree = ast.parse(Path(W.__file__).read_text())
    top = [n for n in tree.body if isinstance(n, (ast.Import, ast.ImportFrom))]
    mods = {a.name.split(".")[0] for n in top if isinstance(n, ast.Import) for a in n.names} | \
        {n.module.split(".")[0] for n in top if isinstance(n, ast.ImportFrom) and n.module}
    assert mods <= set(sys.stdlib_module_names) | {"__future__"}
    assert not any(isinstance(n, ast.ImportFrom) and n.level for n in ast.walk(tree))


# ---- the worker as a real subprocess, against the stand-in ----------------------------------------------
def _layout(d: Path, *, vocab: int, hidden: int, dtype: str = "float16", world: int = 1, max_batch: int = 4,
            table_rows: int = 64, **extra) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    C.write_engine(d / "engine", vocab=vocab, hidden=hidden, dtype=dtype, max_batch=max_batch, table_rows=table_rows,
                   max_seq=80, world_size=world, tp_size=world)
    (d / "config.json").write_text(json.dumps({
        "format": T.ENGINE_FORMAT, "engine": "engine", "vocab_size": vocab, "hidden_size": hidden, "dtype": dtype,
        "end_id": 2, "pad_id": 0, "backend": "trtllm", "parallel": {"tp_size": world, "pp_size": 1},
        "kv_cache_free_gpu_memory_fraction": 0.7, "prompt_table_size": table_rows,
        "limits": {"max_batch_size": max_batch, "max_input_len": 40, "max_output_len": 40, "max_images_per_request": 1},
        **extra}))
    return d


def _drain(dec, rid, until_final=True, budget_s=30.0):
    outs, t0 = [], time.time()
    while time.time() - t0 < budget_s:
        for o in dec.poll(0.05):
            assert o.request_id == rid
            outs.append(o)
            if o.final:
                return outs
        if not until_final and outs:
            return outs
    raise AssertionError(f"no final output for {rid}")


@pytest.mark.parametrize("dtype", ["float16", "bfloat16"])
def test_worker_submit_stream_cancel_shutdown(envs, tmp_path, monkeypatch, dtype):
    V, H, P = 100, 8, 7
    log = tmp_path / "log"
    monkeypatch.setenv(PY_ENV, str(envs["trt"]))
    monkeypatch.setenv("FAKE_TRTLLM_LOG", str(log))
    dec = D.TrtllmDecoder.load(_layout(tmp_path / "build-llm", vocab=V, hidden=H, dtype=dtype), max_batch=2,
                               startup_timeout_s=120)
    try:
        ev = [e for e in C.read_log(log) if e["event"] == "executor"][0]
        assert ev["kv"] == {"enable_block_reuse": True, "max_tokens": 2 * 80, "free_gpu_memory_fraction": 0.7}
        assert ev["max_batch_size"] == 2 and ev["parallel"] is None
        img = _image(3, H, 0, "img")
        prompt = EncodedPrompt(token_ids=[1, P, P, P, 4], images=[img], image_placeholder_id=P)
        dec.submit("a", prompt, SamplingParams(max_tokens=5, temperature=0, logprobs=0))
        outs = _drain(dec, "a")
        toks = [t for o in outs for t in o.tokens]
        assert len(toks) == 5 and outs[-1].reason == "length" and outs[-1].error is None
        assert all(o.logprobs is not None and len(o.logprobs) == len(o.tokens) for o in outs)
        enq = [e for e in C.read_log(log) if e["event"] == "enqueue"][0]
        assert enq["table"]["shape"] == [3, H] and enq["table"]["dtype"] == dtype
        assert len(enq["table"]["extra_ids"]) == 2 and 0 in enq["table"]["extra_ids"]  # text 0, one image id
        assert enq["sampling"]["top_k"] == 1 and enq["exclude_input"] is True and enq["streaming"] is True
        np.testing.assert_allclose(enq["table"]["first"], img.features[0, :4], rtol=1e-2, atol=1e-2)

        dec.submit("b", EncodedPrompt(token_ids=[1, 2, 3], images=[], image_placeholder_id=P),
                   SamplingParams(max_tokens=30, temperature=0.5, top_p=0.9, seed=3))
        first = _drain(dec, "b", until_final=False)
        assert not first[-1].final
        dec.cancel("b")
        rest = _drain(dec, "b")
        assert rest[-1].final and rest[-1].reason == "abort"
        enq_b = [e for e in C.read_log(log) if e["event"] == "enqueue"][1]
        assert enq_b["table"] is None and enq_b["sampling"]["seed"] == 3
    finally:
        dec.close()
    assert dec._proc.returncode == 0
    assert [e["event"] for e in C.read_log(log)][-1] == "shutdown"


def test_worker_reports_what_the_executor_refuses(envs, tmp_path, monkeypatch):
    """A table wider than the engine's hidden size comes back as an error, and the worker lives on."""
    V, H, P = 100, 8, 7
    monkeypatch.setenv(PY_ENV, str(envs["trt"]))
    dec = D.TrtllmDecoder.load(_layout(tmp_path / "b", vocab=V, hidden=H), startup_timeout_s=120)
    try:
        bad = _image(2, H + 1, 0, "x")
        dec.submit("bad", EncodedPrompt(token_ids=[1, P, P], images=[bad], image_placeholder_id=P),
                   SamplingParams(max_tokens=3, temperature=0))
        out = _drain(dec, "bad")
        assert out[-1].final and "hidden size 9 != engine 8" in out[-1].error
        dec.submit("ok", EncodedPrompt(token_ids=[1, 2], images=[], image_placeholder_id=P),
                   SamplingParams(max_tokens=2, temperature=0))
        assert _drain(dec, "ok")[-1].reason == "length"
    finally:
        dec.close()


def test_worker_runs_a_parallel_engine_in_orchestrator_mode(envs, tmp_path, monkeypatch):
    log = tmp_path / "log"
    monkeypatch.setenv(PY_ENV, str(envs["trt"]))
    monkeypatch.setenv("FAKE_TRTLLM_LOG", str(log))
    dec = D.TrtllmDecoder.load(_layout(tmp_path / "p", vocab=100, hidden=8, world=2), startup_timeout_s=120)
    dec.close()
    ev = [e for e in C.read_log(log) if e["event"] == "executor"][0]
    assert ev["world_size"] == 2 and ev["parallel"]["mode"] == "ORCHESTRATOR"
    assert ev["parallel"]["device_ids"] == [0, 1] and ev["parallel"]["worker"].endswith("bin/executorWorker")


def test_executor_config_binds_to_the_recorded_signatures():
    data = C.load("executor_bindings.json")
    kw = W.executor_config_kwargs({"kv_cache_free_gpu_memory_fraction": 0.5, "kv_cache_max_tokens": 10,
                                   "max_batch_size": 2}, 4, "/x/executorWorker")

    def check(cls, kwargs):
        assert set(kwargs) <= {p["name"] for p in data["classes"][cls]["init"]}, cls
        for v in kwargs.values():
            if isinstance(v, tuple) and isinstance(v[1], dict):
                check(*v)
            elif isinstance(v, tuple):
                assert v[1] in data["enums"][v[0]]

    check("ExecutorConfig", kw)


def test_worker_reports_missing_tensorrt_llm(envs, tmp_path):
    """The worker, started as the parent starts it, answers with a clear first frame."""
    cmd = D.worker_command(str(envs["plain"]), tmp_path, {})
    proc = subprocess.run(cmd, input=b"", capture_output=True, timeout=120)
    kind, message = W.read_frame(io.BytesIO(proc.stdout))
    assert kind == "unavailable" and "cannot import tensorrt_llm" in message
    assert proc.returncode == 1


# ---- the engine -------------------------------------------------------------------------------------------
def _standin_engine_dir(tiny_llava_engine, tmp_path):
    """The tiny engine with its build-llm replaced by a TensorRT-LLM layout for the recorded stand-in."""
    eng = tmp_path / "engine"
    shutil.copytree(tiny_llava_engine, eng, symlinks=True)
    cfg = json.loads((eng / "build-llm" / "config.json").read_text())
    shutil.rmtree(eng / "build-llm")
    llm = json.loads((eng / "convert" / "llm" / "config.json").read_text())
    # published as build-llm publishes (with its manifest): chat/serve check an engine's files at start
    from vlmctl.formats.artifacts import run_stage

    def write(out):
        _layout(out, vocab=llm["vocab_size"], hidden=llm["hidden_size"], table_rows=64,
                max_batch=cfg["limits"]["max_batch_size"],
                eos_token_ids=cfg.get("eos_token_ids"), image_tokens_per_image=cfg.get("image_tokens_per_image"),
                limits={**cfg["limits"], "max_input_len": 40, "max_output_len": 40})
        return {}

    run_stage(eng, "build-llm", {}, {}, write)
    return eng


def test_engine_loads_vision_before_the_executor(tiny_llava_engine, envs, tmp_path, monkeypatch):
    """TensorRT-LLM sizes its KV cache from the memory free when the executor starts: the vision
    model must be loaded by then. Also a whole chat through the worker and the stand-in."""
    from vlmctl.runtime import engine as E
    from vlmctl.runtime.trtllm_decoder import TrtllmDecoder

    eng = _standin_engine_dir(tiny_llava_engine, tmp_path)
    order = []
    real_vision, real_load = E.Engine._load_vision, TrtllmDecoder.load
    monkeypatch.setattr(E.Engine, "_load_vision",
                        lambda self, *a, **k: (order.append("vision"), real_vision(self, *a, **k))[1])
    monkeypatch.setattr(TrtllmDecoder, "load", classmethod(
        lambda cls, *a, **k: (order.append("executor"), real_load.__func__(cls, *a, **k))[1]))
    monkeypatch.setenv(PY_ENV, str(envs["trt"]))
    engine = E.Engine(eng, device="cpu")
    try:
        assert order == ["vision", "executor"]
        from tiny_models import make_image

        msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hi"}]}]
        done = engine.chat(msgs, [make_image(0)], SamplingParams(max_tokens=4, temperature=0, ignore_eos=True))
        assert done.completion_tokens == 4 and done.finish_reason == "length"
    finally:
        engine.decoder.close()


def test_server_refuses_what_the_trtllm_decoder_cannot_apply(tiny_llava_engine, envs, tmp_path, monkeypatch):
    """TensorRT-LLM samples inside its executor: the extras vlmctl applies to logits are 400s naming
    their field; n > 1 (several requests) works; the built image cap stays."""
    import httpx

    from test_serve import start_uvicorn
    from vlmctl.errors import LimitError
    from vlmctl.runtime.engine import Engine
    from vlmctl.serve import ServerConfig, create_app

    eng = _standin_engine_dir(tiny_llava_engine, tmp_path)
    monkeypatch.setenv(PY_ENV, str(envs["trt"]))
    with pytest.raises(LimitError, match="TensorRT-LLM"):
        Engine(eng, device="cpu", max_images_per_request=2)
    engine = Engine(eng, device="cpu")
    try:
        url, stop = start_uvicorn(create_app(engine, ServerConfig(stats_interval_s=0)))
        try:
            chat = {"messages": [{"role": "user", "content": "hi"}], "max_tokens": 3}
            for extra, param in (({"response_format": {"type": "json_object"}}, "response_format"),
                                 ({"response_format": {"type": "json_schema", "json_schema": {
                                     "name": "x", "schema": {"type": "object"}}}}, "response_format"),
                                 ({"presence_penalty": 0.5}, "presence_penalty"), ({"min_p": 0.1}, "min_p"),
                                 ({"repetition_penalty": 1.1}, "repetition_penalty"),
                                 ({"logit_bias": {"5": 1}}, "logit_bias")):
                r = httpx.post(url + "/v1/chat/completions", json={**chat, **extra}, timeout=60)
                assert r.status_code == 400 and r.json()["error"]["param"] == param, r.text
                assert "TensorRT-LLM" in r.json()["error"]["message"]
            r = httpx.post(url + "/v1/chat/completions", json={**chat, "n": 2, "temperature": 0}, timeout=60)
            assert r.status_code == 200 and len(r.json()["choices"]) == 2
        finally:
            stop()
    finally:
        engine.decoder.close()


# ---- with tensorrt_llm itself -------------------------------------------------------------------------------
@needs_trtllm
def test_real_executor_bindings_take_the_request_spec():
    import tensorrt_llm.bindings.executor as tle
    import torch

    spec = D.request_spec([1, 2, 3], None, None, SamplingParams(temperature=0.5, top_k=4, seed=1, max_tokens=5),
                          end_id=2, pad_id=0)
    req, table = W.build_request(tle, torch, spec)
    assert table is None and list(req.input_token_ids) == [1, 2, 3] and req.max_tokens == 5


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


# ---- helpers --------------------------------------------------------------------------------------------------
def _recipe(dtype="float16", quant=False, backend="trtllm", **decoder):
    from vlmctl.recipe import Recipe

    data = {"name": "t", "source": "x", "dtype": dtype, "decoder": {"backend": backend, **decoder}}
    if quant:
        data["quantization"] = {"method": "awq"}
    return Recipe.model_validate(data)


def _load_recipe_text(text: str, tmp=None):
    import tempfile

    from vlmctl.recipe import load_recipe

    with tempfile.TemporaryDirectory() as d:
        p = Path(d) / "r.yaml"
        p.write_text("source: x\n" + text)
        return load_recipe(p)


def _llm_dir(tmp_path, **extra) -> Path:
    d = tmp_path / "llm"
    d.mkdir()
    (d / "config.json").write_text(json.dumps({"model_type": "llama", "vocab_size": 100, "hidden_size": 8, **extra}))
    return d
