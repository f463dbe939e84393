"""`vlmctl export-triton`: the Triton model repository, read the way Triton reads it.

Every config.pbtxt is parsed with the `model_config` protobuf from `tritonclient`; the ensemble is
checked by Triton core's own rules (tests/triton_ensemble.py); the configs are compared with the
stock models' interfaces recorded from tensorrtllm_backend 1.2 (tests/data/tensorrtllm_backend-1.2,
see sources.json): what each stock Python model reads by name, the template types, the stock
ensemble's wiring. The renamed vision graph runs on ONNX Runtime against the original. The vision
engine build runs as a real subprocess of a "TensorRT-LLM interpreter" whose `tensorrt` is a
stand-in generated here: it refuses every name missing from the TensorRT 10.13 and 11.4 API
recordings (tests/data/tensorrt-*) and builds nothing. No Triton server runs here (no GPU).
"""

from __future__ import annotations

import argparse
import ast
import hashlib
import json
import shutil
import subprocess
import sys
from pathlib import Path

import numpy as np
import pytest

import trtllm_contract as C
from vlmctl.errors import EngineError, InputError, OptionError, UnsupportedModelError
from vlmctl.export import triton_repo as TR
from vlmctl.models.registry import FAMILIES, family_class

# The config.pbtxt files are parsed with tritonclient's protobuf (a dev dependency); without it, skip the module
pytest.importorskip("tritonclient.grpc", reason="needs tritonclient[grpc] (the dev extra) to parse config.pbtxt")
import triton_ensemble as TE  # noqa: E402

DATA = Path(__file__).parent / "data"
STOCK = json.loads((DATA / "tensorrtllm_backend-1.2" / "stock_models.json").read_text())
PY_ENV = "VLMCTL_TRTLLM_PYTHON"
FILLED = {"${prompt_embedding_table_data_type}": "TYPE_FP16", "${logits_datatype}": "TYPE_FP32"}
# Declarations that differ from a recorded template on purpose (name -> why).
DEVIATIONS = {
    ("multimodal_encoders", "image_sizes"): "the stored encoder template says [2], but the stock preprocessing "
                                            "emits IMAGE_SIZES as [-1, 2] per request (it unsqueezes to match its "
                                            "own config); both sides are declared [-1, 2]",
}


def cli(*args, expect: int | None = None) -> tuple[int, str, str]:
    """`vlmctl ARGS` in-process; (exit code, stdout, stderr)."""
    import contextlib
    import io

    from vlmctl.cli.main import cli_main

    out, err = io.StringIO(), io.StringIO()
    with contextlib.redirect_stdout(out), contextlib.redirect_stderr(err):
        code = cli_main([str(a) for a in args])
    if expect is not None:
        assert code == expect, err.getvalue()[-2000:]
    return code, out.getvalue(), err.getvalue()


# ---- interpreters and the TensorRT stand-in ------------------------------------------------------
def _tensorrt_names() -> list[str]:
    sets = [set(json.loads((DATA / f"tensorrt-{v}" / "api_names.json").read_text())["names"])
            for v in ("10.13.3.9", "11.4.0.106")]
    return sorted(sets[0] & sets[1])


STANDIN = '''"""A stand-in for tests, not TensorRT: every attribute must be a name recorded in both TensorRT
10.13 and 11.4; calls are logged to $TRT_STANDIN_LOG; nothing is built."""
import json, os
__version__ = "10.14.1.48-standin"
_NAMES = set(%(names)s)
_LOG = os.environ.get("TRT_STANDIN_LOG")
_RESULTS = {"parse_from_file": True, "build_serialized_network": b"standin-engine", "num_errors": 0}


def _log(entry):
    if _LOG:
        with open(_LOG, "a") as f:
            f.write(json.dumps(entry, default=str) + "\\n")


class _Obj:
    def __init__(self, path):
        self._path = path

    def __getattr__(self, name):
        if name.startswith("__"):
            raise AttributeError(name)
        if name not in _NAMES and not any(n.endswith(name) for n in _NAMES):
            raise AttributeError("TensorRT has no " + name)
        if name in ("num_errors",):
            return _RESULTS[name]
        return _Obj(self._path + "." + name)

    def __call__(self, *args, **kwargs):
        leaf = self._path.rsplit(".", 1)[-1]
        entry = {"call": leaf, "args": [a if isinstance(a, (int, str, list, tuple)) else repr(a) for a in args]}
        if leaf == "parse_from_file":
            entry["exists"] = os.path.exists(args[0])
            entry["size"] = os.path.getsize(args[0]) if entry["exists"] else 0
        _log(entry)
        return _RESULTS.get(leaf, _Obj(self._path + "()"))

    def __int__(self):
        return 5


def __getattr__(name):
    return getattr(_Obj("trt"), name)
'''


def _venv(path: Path) -> Path:
    subprocess.run([sys.executable, "-m", "venv", "--without-pip", str(path)], check=True, capture_output=True)
    return path / "bin" / "python"


def _site(py: Path) -> Path:
    return Path(subprocess.run([str(py), "-c", "import sysconfig; print(sysconfig.get_paths()['purelib'])"],
                               check=True, capture_output=True, text=True).stdout.strip())


@pytest.fixture(scope="module")
def pythons(tmp_path_factory):
    """`trt`: TensorRT-LLM 1.2 (metadata stand-in) with the TensorRT stand-in; `no_tensorrt`: the
    same without tensorrt; `plain`: no TensorRT-LLM at all."""
    root = tmp_path_factory.mktemp("pythons")
    out = {}
    for name in ("trt", "no_tensorrt", "plain"):
        py = _venv(root / name)
        if name != "plain":
            C.write_fake_package(_site(py))
        if name == "trt":
            pkg = _site(py) / "tensorrt"
            pkg.mkdir()
            (pkg / "__init__.py").write_text(STANDIN % {"names": json.dumps(_tensorrt_names())})
        out[name] = py
    return out


@pytest.fixture(scope="module")
def trtllm_engine(tiny_llava_engine, tmp_path_factory) -> Path:
    """The tiny LLaVA engine with its decoder stage in the TensorRT-LLM layout (fp16 engine config as
    trtllm-build writes it; the engine itself cannot be built here)."""
    eng = tmp_path_factory.mktemp("trtllm") / "engine"
    shutil.copytree(tiny_llava_engine, eng, symlinks=True)
    cfg = json.loads((eng / "build-llm" / "config.json").read_text())
    llm = json.loads((eng / "convert" / "llm" / "config.json").read_text())
    shutil.rmtree(eng / "build-llm")
    _write_llm(eng, cfg, llm)
    return eng


def _write_llm(eng: Path, cfg: dict, llm: dict, *, dtype="float16", fraction=0.8, table_rows=None, tp=1):
    lim = cfg["limits"]
    rows = cfg["image_tokens_per_image"]
    table = table_rows if table_rows is not None else lim["max_batch_size"] * lim["max_images_per_request"] * rows
    d = eng / "build-llm"
    d.mkdir(exist_ok=True)
    C.write_engine(d / "engine", vocab=llm["vocab_size"], hidden=llm["hidden_size"], dtype=dtype,
                   max_batch=lim["max_batch_size"], table_rows=table, max_seq=lim["max_input_len"] * 2,
                   world_size=tp, tp_size=tp)
    (d / "config.json").write_text(json.dumps({
        **cfg, "format": "tensorrt-llm", "backend": "trtllm", "engine": "engine", "dtype": dtype,
        "vocab_size": llm["vocab_size"], "hidden_size": llm["hidden_size"], "prompt_table_size": table,
        "parallel": {"tp_size": tp, "pp_size": 1}, "kv_cache_free_gpu_memory_fraction": fraction}))
    (d / "manifest.json").write_text(json.dumps({"stage": "build-llm", "backend": "trtllm",
                                                 "backend_version": "tensorrt_llm 1.2.1", "settings": {},
                                                 "files": _file_entries(d)}))


def _file_entries(d: Path) -> list[dict]:
    """A manifest's `files` for every file under `d` (export-triton checks them as chat and serve do)."""
    return [{"path": p.relative_to(d).as_posix(), "bytes": p.stat().st_size,
             "sha256": hashlib.sha256(p.read_bytes()).hexdigest()}
            for p in sorted(d.rglob("*")) if p.is_file() and p.name != "manifest.json"]


def _rewrite(eng: Path, stage: str, rel: str, text: str) -> None:
    """Replace one file of a stage and its manifest entry (an engine built that way, not a damaged one)."""
    (eng / stage / rel).write_text(text)
    manifest = json.loads((eng / stage / "manifest.json").read_text())
    manifest["files"] = [e for e in manifest["files"] if e["path"] != rel] + \
        [e for e in _file_entries(eng / stage) if e["path"] == rel]
    (eng / stage / "manifest.json").write_text(json.dumps(manifest))


def _variant(trtllm_engine, tmp_path, **kw) -> Path:
    eng = tmp_path / "engine"
    shutil.copytree(trtllm_engine, eng, symlinks=True)
    cfg = json.loads((eng / "build-llm" / "config.json").read_text())
    llm = json.loads((eng / "convert" / "llm" / "config.json").read_text())
    shutil.rmtree(eng / "build-llm")
    _write_llm(eng, cfg, llm, **kw)
    return eng


@pytest.fixture(scope="module")
def exported(trtllm_engine, pythons, tmp_path_factory):
    """One export through the CLI, with the stand-in interpreter; its stand-in call log."""
    mp = pytest.MonkeyPatch()
    root = tmp_path_factory.mktemp("exported")
    log = root / "trt.log"
    mp.setenv(PY_ENV, str(pythons["trt"]))
    mp.setenv("TRT_STANDIN_LOG", str(log))
    try:
        code, out, err = cli("export-triton", str(trtllm_engine), "-o", str(root / "repo"), "--json")
    finally:
        mp.undo()
    assert code == 0, err
    lines = [json.loads(x) for x in log.read_text().splitlines()] if log.exists() else []
    return root / "repo", json.loads(out.strip().splitlines()[-1]), lines


def _facts(family_name: str, **kw) -> TR.EngineFacts:
    fam = family_class(family_name)()
    base = dict(engine_dir=Path("/e"), family=fam, stock=fam.triton_stock, trtllm_engine=Path("/e/build-llm/engine"),
                processor=Path("/e/convert/processor"), onnx=Path("/e/export-vision/model.onnx"),
                onnx_input="pixel_values", onnx_output="image_features", max_batch=8,
                max_images=fam.triton_stock.max_images or 2, table_rows=8 * 2 * 576, hidden=4096, vocab=32064,
                world=1, rows_per_image=576, kv_fraction=0.8, trtllm_version="1.2.1", profile={}, workspace_gib=4.0)
    base.update(kw)
    return TR.EngineFacts(**base)


PATHS = {"engine": "/e/build-llm/engine", "processor": "/e/convert/processor", "vision": "/r/multimodal_encoders/1/vision"}
SERVED = [n for n in FAMILIES if family_class(n).triton_stock is not None]


def _written(tmp_path, family: str, **kw) -> dict:
    configs = TR.model_configs(_facts(family), PATHS, **kw)
    for name, cfg in configs.items():
        (tmp_path / name).mkdir(parents=True, exist_ok=True)
        (tmp_path / name / "config.pbtxt").write_text(cfg.to_pbtxt())
    return TE.load_repo(tmp_path)


# ---- the configs, as Triton reads them ------------------------------------------------------------
def test_the_stock_models_serve_llava_and_onevision_only():
    assert SERVED == ["llava", "llava_onevision"]
    types = STOCK["models"]["preprocessing"]["reads"]["model_types"]
    assert all(family_class(n).triton_stock.model_type in types for n in SERVED)
    # OneVision's images go through the stock preprocessing's HF processor; LLaVA's do not.
    processing = STOCK["models"]["preprocessing"]["reads"]["model_types_processing_images"]
    for n in SERVED:
        stock = family_class(n).triton_stock
        assert (stock.model_type in processing) == (not stock.client_pixels)


@pytest.mark.parametrize("family", SERVED)
@pytest.mark.parametrize("streaming,reuse", [(False, False), (True, True)])
def test_every_config_parses_and_the_ensemble_follows_tritons_rules(tmp_path, family, streaming, reuse):
    configs = _written(tmp_path, family, streaming=streaming, kv_cache_reuse=reuse)
    assert set(configs) == set(TR.MODELS)
    assert all("${" not in (tmp_path / m / "config.pbtxt").read_text() for m in TR.MODELS)
    assert TE.ensemble_errors(configs) == []
    llm = configs["tensorrt_llm"]
    assert llm.backend == "tensorrtllm" and llm.model_transaction_policy.decoupled == streaming
    assert configs["ensemble"].platform == "ensemble"
    assert all(configs[m].backend == "python" for m in ("preprocessing", "multimodal_encoders", "postprocessing"))
    params = {k: v.string_value for k, v in llm.parameters.items()}
    assert params["gpt_model_path"] == PATHS["engine"] and params["gpt_model_type"] == "inflight_fused_batching"
    assert params["enable_kv_cache_reuse"] == str(reuse).lower()
    assert 0 < float(params["kv_cache_free_gpu_mem_fraction"]) < 0.9
    table = {t.name: t for t in llm.input}["prompt_embedding_table"]
    assert table.data_type == TE.mc.TYPE_FP16


def test_the_checker_fails_broken_wiring(tmp_path):
    configs = _written(tmp_path, "llava", streaming=False, kv_cache_reuse=False)
    step = configs["ensemble"].ensemble_scheduling.step[2]
    step.input_map["input_lengths"] = "max_tokens"  # an ensemble input of the right type: fine
    assert TE.ensemble_errors(configs) == []
    step.input_map["prompt_embedding_table"] = "_INPUT_ID"  # INT32 into FP16
    step.input_map["temperature"] = "_NOWHERE"
    del step.input_map["request_output_len"]  # a required input left unmapped
    errors = "\n".join(TE.ensemble_errors(configs))
    assert "inconsistent data type" in errors and "_NOWHERE" in errors and "request_output_len" in errors


@pytest.mark.parametrize("family", SERVED)
def test_kv_cache_reuse_only_with_per_request_extra_ids(tmp_path, family):
    for reuse in (False, True):
        configs = _written(tmp_path / str(reuse), family, streaming=False, kv_cache_reuse=reuse)
        extra = {t.name: t for t in configs["ensemble"].input}["prompt_table_extra_id"]
        assert extra.optional == (not reuse)  # with reuse, Triton rejects a request without it
        prov = TE.provenance(configs["ensemble"])
        assert prov[("tensorrt_llm", "prompt_table_extra_ids")] == ("preprocessing", "OUT_PROMPT_TABLE_EXTRA_IDS")
        assert prov[("preprocessing", "PROMPT_TABLE_EXTRA_ID")] == ("input", "prompt_table_extra_id")


# ---- against the stock models' recorded interfaces -------------------------------------------------
@pytest.mark.parametrize("family", SERVED)
def test_configs_declare_what_the_stock_models_read(tmp_path, family):
    configs = _written(tmp_path, family, streaming=False, kv_cache_reuse=False)
    for name, rec in STOCK["models"].items():
        cfg, reads = configs[name], rec["reads"]
        ins, outs = {t.name: t for t in cfg.input}, {t.name: t for t in cfg.output}
        params = set(cfg.parameters)
        assert set(reads["parameters_required"]) <= params, name
        assert set(reads.get("input_configs", [])) <= set(ins), name  # read in initialize(): must exist
        assert set(reads.get("output_configs", [])) <= set(outs), name
        for kind, declared in (("input", ins), ("output", outs)):
            for t in rec["template"][kind]:
                if t["name"] not in declared or (name, t["name"]) in DEVIATIONS:
                    continue
                mine = declared[t["name"]]
                want = FILLED.get(t["data_type"], t["data_type"])
                assert TE.mc.DataType.Name(mine.data_type) == want, (name, t["name"])
                assert TE._dims_match(list(mine.dims), t["dims"]), (name, t["name"], list(mine.dims), t["dims"])
                if "reshape" in t:
                    assert list(mine.reshape.shape) == t["reshape"], (name, t["name"])
                if kind == "input" and t.get("optional"):
                    assert mine.optional, (name, t["name"])
    # Names every stock model looks up at all must be names the stock templates declare.
    for name, rec in STOCK["models"].items():
        declared = {t.name for t in list(configs[name].input) + list(configs[name].output)}
        template = {t["name"] for k in ("input", "output") for t in rec["template"][k]}
        assert declared <= template | set(rec["reads"].get("inputs", [])) | set(rec["reads"].get("outputs", [])), name


@pytest.mark.parametrize("family", SERVED)
def test_the_wiring_is_the_stock_ensembles(tmp_path, family):
    """Every tensor vlmctl routes into a step comes from where the stock multimodal ensemble takes it."""
    ens = _written(tmp_path, family, streaming=False, kv_cache_reuse=False)["ensemble"]
    stock_ens = STOCK["ensemble"]
    made = {v: (m, k) for m, s in stock_ens["steps"].items() for k, v in s["output_map"].items()}
    stock_inputs = {t["name"] for t in stock_ens["input"]}
    for (model, key), source in TE.provenance(ens).items():
        stock_value = stock_ens["steps"][model]["input_map"].get(key)
        assert stock_value is not None, (model, key)
        expected = ("input", stock_value) if stock_value in stock_inputs else made[stock_value]
        assert source == expected, (model, key, source, expected)
    # Ensemble inputs and outputs vlmctl exposes are the stock ones (types; dims by Triton's wildcard rule).
    stock_io = {t["name"]: t for k in ("input", "output") for t in stock_ens[k]}
    for t in list(ens.input) + list(ens.output):
        assert TE.mc.DataType.Name(t.data_type) == stock_io[t.name]["data_type"], t.name
        assert TE._dims_match(list(t.dims), stock_io[t.name]["dims"]), t.name


def test_the_vision_engine_config_has_the_builder_config_the_stock_models_read():
    facts = _facts("llava")
    info = {"input": {"dtype": "float16", "shape": [-1, 3, 336, 336]}, "output": {"dtype": "float16",
                                                                                  "shape": [-1, 576, 4096]}}
    cfg = TR.builder_config(facts.stock, info, {"input": [[1, 3, 336, 336], [4, 3, 336, 336], [8, 3, 336, 336]]})
    rec = STOCK["vision_builder_config"]
    assert list(cfg) == ["builder_config"] and set(cfg["builder_config"]) == set(rec["keys"])
    bc = cfg["builder_config"]
    assert bc["model_type"] == "llava" and bc["precision"] == "float16" and bc["model_name"] == rec["model_name"]
    assert bc["max_batch_size"] == 8 and bc["output_shape"] == [-1, 576, 4096]
    assert set(STOCK["models"]["multimodal_encoders"]["reads"]["builder_config"]) <= set(bc)


# ---- the renamed vision graph ---------------------------------------------------------------------
def test_renamed_vision_graph_computes_what_the_original_does(tiny_llava_engine, tmp_path):
    import onnxruntime as ort

    src = tiny_llava_engine / "export-vision" / "model.onnx"
    info = TR.rename_vision_io(src, tmp_path / "model.onnx", "pixel_values", "image_features")
    a = ort.InferenceSession(str(src), providers=["CPUExecutionProvider"])
    b = ort.InferenceSession(str(tmp_path / "model.onnx"), providers=["CPUExecutionProvider"])
    assert [i.name for i in b.get_inputs()] == ["input"] and [o.name for o in b.get_outputs()] == ["encoder_output"]
    x = np.random.default_rng(0).standard_normal((3, *a.get_inputs()[0].shape[1:])).astype(np.float32)
    np.testing.assert_array_equal(a.run(None, {"pixel_values": x})[0], b.run(None, {"input": x})[0])
    assert info["input"]["dtype"] == "float32" and info["input"]["shape"][0] == -1
    with pytest.raises(EngineError, match="expected input"):
        TR.rename_vision_io(src, tmp_path / "other.onnx", "pixels", "image_features")


def test_the_vision_build_script_uses_only_recorded_tensorrt_names():
    names = set(_tensorrt_names())
    used = set()
    for node in ast.walk(ast.parse(TR.VISION_BUILD_SCRIPT)):
        if isinstance(node, ast.Attribute):
            base = node
            while isinstance(base, ast.Attribute):
                base = base.value
            if isinstance(base, ast.Name) and base.id in {"trt", "builder", "network", "parser", "config", "profile"}:
                used.add(node.attr)
    assert {"STRONGLY_TYPED", "parse_from_file", "build_serialized_network", "set_shape"} <= used
    assert not {n for n in used if n not in names and not any(m.endswith(n) for m in names)}
    assert "FP16" not in used  # weak typing is gone in TensorRT 11


# ---- the command, end to end ------------------------------------------------------------------------
def test_export_writes_a_complete_repository(exported, trtllm_engine):
    repo, res, calls = exported
    configs = TE.load_repo(repo)
    assert set(configs) == set(TR.MODELS) and TE.ensemble_errors(configs) == []
    vision = repo / "multimodal_encoders" / "1" / "vision"
    assert (vision / "model.engine").read_bytes() == b"standin-engine"
    cfg = json.loads((vision / "config.json").read_text())["builder_config"]
    io = json.loads((trtllm_engine / "export-vision" / "io.json").read_text())
    assert cfg["model_type"] == "llava" and cfg["precision"] == "float32"  # the tiny engine is fp32
    assert cfg["output_shape"] == [-1, io["feature_rows"], io["hidden_size"]]
    # The build ran the renamed graph through the interpreter's TensorRT with build-vision's profile.
    parse = [c for c in calls if c["call"] == "parse_from_file"]
    assert len(parse) == 1 and parse[0]["exists"] and parse[0]["size"] > 0
    shapes = [c["args"] for c in calls if c["call"] == "set_shape"]
    settings = json.loads((trtllm_engine / "build-vision" / "manifest.json").read_text())["settings"]
    assert shapes == [["input", [1, 3, 28, 28], [(settings["max_images"] + 1) // 2, 3, 28, 28],
                       [settings["max_images"], 3, 28, 28]]]
    # Parameters point at the engine directory; the stock Python models are linked to the container's copy.
    params = {k: v.string_value for k, v in configs["preprocessing"].parameters.items()}
    assert params["gpt_model_path"] == str((trtllm_engine / "build-llm" / "engine").resolve())
    assert params["multimodal_model_path"] == str(vision.resolve())
    assert params["max_num_images"] == "1"
    link = repo / "preprocessing" / "1" / "model.py"
    assert link.is_symlink() and str(link.readlink()).startswith("/app/all_models/inflight_batcher_llm/")
    assert (repo / "multimodal_encoders" / "1" / "multimodal_utils.py").is_symlink()
    meta = json.loads((repo / TR.METADATA).read_text())
    assert meta == res and res["vision_tensorrt_version"] == "10.14.1.48-standin"
    assert res["tensorrt_llm_version"] == "1.2.1" and "trtllm-serve" in res["note"]
    assert not list(repo.parent.glob(".repo.tmp-*"))


def test_the_launch_line_parses_with_launch_triton_servers_recorded_options(exported):
    _, res, _ = exported
    parser = argparse.ArgumentParser(exit_on_error=False)
    for opt in STOCK["launch_triton_server_options"]:
        parser.add_argument(opt)
    launch = res["launch"]
    assert launch[:2] == ["python3", "/app/scripts/launch_triton_server.py"]
    args = parser.parse_args([a for a in launch[2:]])
    assert args.world_size == "1" and args.tensorrt_llm_model_name == "tensorrt_llm,multimodal_encoders"
    assert int(args.multimodal_gpu0_cuda_mem_pool_bytes) >= TR.UPSTREAM_POOL_BYTES


def test_stock_files_are_copied_from_a_local_all_models_directory(exported, pythons, trtllm_engine, tmp_path,
                                                                  monkeypatch):
    stock = tmp_path / "all_models"
    for files in TR.STOCK_FILES.values():
        for f in files:
            (stock / f).parent.mkdir(parents=True, exist_ok=True)
            (stock / f).write_text(f"# stand-in for {f}\n")
    monkeypatch.setenv(PY_ENV, str(pythons["trt"]))
    cli("export-triton", str(trtllm_engine), "-o", str(tmp_path / "repo"), "--stock-models", str(stock),
        "--mount", f"{trtllm_engine}=/engines/llava", "--mount", f"{tmp_path}=/models", expect=0)
    copied = tmp_path / "repo" / "multimodal_encoders" / "1" / "multimodal_utils.py"
    assert not copied.is_symlink() and "multimodal_utils.py" in copied.read_text()
    params = {k: v.string_value for k, v in TE.parse(tmp_path / "repo" / "preprocessing" / "config.pbtxt")
              .parameters.items()}
    assert params["gpt_model_path"] == "/engines/llava/build-llm/engine"
    assert params["tokenizer_dir"] == "/engines/llava/convert/processor"
    assert params["multimodal_model_path"] == "/models/repo/multimodal_encoders/1/vision"
    (stock / TR.STOCK_FILES["postprocessing"][0]).unlink()
    code, _, err = cli("export-triton", str(trtllm_engine), "-o", str(tmp_path / "repo2"), "--stock-models",
                       str(stock))
    assert code == InputError.exit_code and "all_models" in err and not (tmp_path / "repo2").exists()


# ---- refusals ----------------------------------------------------------------------------------------
def _refused(args, expect_code, needle, out):
    code, _, err = cli(*args)
    assert code == expect_code, err
    lines = err.strip().splitlines()  # progress lines of the work done, then one error line
    assert lines[-1].startswith("error: ") and needle in lines[-1], err
    assert not any(line.startswith("error: ") for line in lines[:-1]), err
    assert not Path(out).exists()


def test_a_torch_decoder_engine_is_refused(tiny_llava_engine, tmp_path):
    _refused(["export-triton", str(tiny_llava_engine), "-o", str(tmp_path / "r")], EngineError.exit_code,
             "not a TensorRT-LLM engine", tmp_path / "r")
    _refused(["export-triton", str(tmp_path), "-o", str(tmp_path / "r")], EngineError.exit_code,
             "not a vlmctl engine directory", tmp_path / "r")


def test_what_the_stock_path_cannot_serve_is_refused(trtllm_engine, pythons, tmp_path, monkeypatch):
    monkeypatch.setenv(PY_ENV, str(pythons["trt"]))
    eng = _variant(trtllm_engine, tmp_path / "bf16", dtype="bfloat16")
    _refused(["export-triton", str(eng), "-o", str(tmp_path / "r")], EngineError.exit_code, "float16", tmp_path / "r")
    eng = _variant(trtllm_engine, tmp_path / "rows", table_rows=40)  # not batch x images x rows per image
    _refused(["export-triton", str(eng), "-o", str(tmp_path / "r")], EngineError.exit_code, "prompt rows",
             tmp_path / "r")
    eng = _variant(trtllm_engine, tmp_path / "frac", fraction=0.95)
    _refused(["export-triton", str(eng), "-o", str(tmp_path / "r")], InputError.exit_code, "--kv-cache-fraction",
             tmp_path / "r")
    _refused(["export-triton", str(trtllm_engine), "-o", str(tmp_path / "r"), "--kv-cache-fraction", "0.9"],
             OptionError.exit_code, "below 0.9", tmp_path / "r")
    eng = _variant(trtllm_engine, tmp_path / "next")
    family = json.loads((eng / "convert" / "family.json").read_text())
    _rewrite(eng, "convert", "family.json", json.dumps({**family, "family": "llava_next"}))
    _refused(["export-triton", str(eng), "-o", str(tmp_path / "r")], UnsupportedModelError.exit_code,
             "do not serve the llava_next family", tmp_path / "r")
    # the command line's own mistakes exit 2 (README's table)
    _refused(["export-triton", str(trtllm_engine), "-o", str(tmp_path / "r"), "--mount", "relative"],
             OptionError.exit_code, "--mount", tmp_path / "r")
    _refused(["export-triton", str(trtllm_engine), "-o", str(tmp_path / "r"), "--stock-models", "all_models"],
             OptionError.exit_code, "must be absolute", tmp_path / "r")


def test_without_tensorrt_llm_or_tensorrt_nothing_is_written(trtllm_engine, pythons, tmp_path, monkeypatch):
    for which, needle in (("plain", "TensorRT-LLM 1.2"), ("no_tensorrt", "no tensorrt")):
        monkeypatch.setenv(PY_ENV, str(pythons[which]))
        _refused(["export-triton", str(trtllm_engine), "-o", str(tmp_path / which)], 6, needle, tmp_path / which)
        assert not list(tmp_path.glob(f".{which}.tmp-*"))


def test_an_existing_repository_needs_force(exported, trtllm_engine, pythons, tmp_path, monkeypatch):
    monkeypatch.setenv(PY_ENV, str(pythons["trt"]))
    (tmp_path / "repo").mkdir()
    _refused(["export-triton", str(trtllm_engine), "-o", str(tmp_path / "repo")], InputError.exit_code,
             "already exists", tmp_path / "repo" / "ensemble")
    cli("export-triton", str(trtllm_engine), "-o", str(tmp_path / "repo"), "--force", "--streaming",
        "--kv-cache-reuse", "--kv-cache-fraction", "0.6", expect=0)
    llm = TE.parse(tmp_path / "repo" / "tensorrt_llm" / "config.pbtxt")
    assert llm.model_transaction_policy.decoupled
    assert llm.parameters["kv_cache_free_gpu_mem_fraction"].string_value == "0.6"
    assert llm.parameters["enable_kv_cache_reuse"].string_value == "true"


# ---- OneVision's newline file -------------------------------------------------------------------------
def test_onevision_writes_the_newline_the_stock_encoder_loads(tmp_path):
    import torch
    from safetensors.torch import load_file, save_file

    from vlmctl.models.llava_onevision import LlavaOnevisionFamily

    vision = tmp_path / "vision"
    vision.mkdir()
    newline = torch.randn(48)
    save_file({"image_newline": newline, "multi_modal_projector.linear_1.bias": torch.zeros(3)},
              str(vision / "model.safetensors"))
    dest = tmp_path / "out"
    dest.mkdir()
    assert LlavaOnevisionFamily().triton_vision_files(vision, dest) == ["image_newlines.safetensors"]
    got = load_file(str(dest / "image_newlines.safetensors"))
    rec = STOCK["models"]["multimodal_encoders"]["reads"]
    assert list(got) == [rec["newline_tensor"]] and got["image_newline"].dtype == torch.float16
    torch.testing.assert_close(got["image_newline"].float(), newline.half().float())
    assert rec["vision_dir_files"]["llava_onevision"] == ["image_newlines.safetensors"]
