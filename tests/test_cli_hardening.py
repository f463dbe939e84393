"""Issue 9, command-line items, through the INSTALLED `vlmctl` entry point (the console script next to
this interpreter): usage errors (5), Ctrl-C/SIGTERM during a build (6), damaged engine directories,
`vlmctl verify` and the build cache (7), serve's option checks (8), killed builds' temporary
directories (12), --dry-run (16), CPU threads (17), packaging (14) and the README's tables (18)."""

from __future__ import annotations

import json
import os
import re
import shutil
import signal
import socket
import subprocess
import sys
import time
from pathlib import Path

import pytest

from conftest import cli, cli_json, write_recipe

REPO = Path(__file__).resolve().parents[1]
VLMCTL = Path(sys.executable).parent / "vlmctl"
pytestmark = pytest.mark.skipif(not VLMCTL.exists(), reason=f"no installed entry point at {VLMCTL} "
                                                            "(pip install -e . first)")


def run(*args, cwd=None, timeout=300, env=None):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1", **(env or {})}
    return subprocess.run([str(VLMCTL), *map(str, args)], capture_output=True, text=True, cwd=cwd, env=env,
                          timeout=timeout)


def assert_one_line(proc, code, fragment=None):
    err = proc.stderr
    assert proc.returncode == code, f"exit {proc.returncode}, expected {code}: {err[-3000:]}"
    assert "Traceback" not in err and "Traceback" not in proc.stdout, err[-3000:]
    lines = [line for line in err.splitlines() if line.strip()]
    errors = [line for line in lines if line.startswith("error:")]
    # one error line, the last; before it only what a log shows of the work done (plain progress lines)
    assert len(errors) == 1 and lines[-1] == errors[0], err[-3000:]
    assert all(not line.startswith(" ") for line in lines), err[-3000:]  # no traceback or indented detail
    if fragment:
        assert fragment in errors[0], errors[0]
    return errors[0]


def free_port() -> int:
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


def recipe_of(engine: Path) -> Path:
    return engine.parent / "tiny.yaml"  # conftest writes it beside the session engine


@pytest.fixture()
def engine_copy(tiny_llava_engine, tmp_path) -> Path:
    dst = tmp_path / "engine"
    shutil.copytree(tiny_llava_engine, dst)  # copy2: modification times are kept
    return dst


# ---- item 5 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,code,fragment", [
    (("build", "--nope"), 2, "No such option: --nope"),
    (("chat",), 2, "Missing argument"),
    (("serve", "{engine}", "--port", "99999"), 2, "--port"),
    (("serve", "{engine}", "--port", "http"), 2, "--port"),
    (("serve", "{engine}", "--log-level", "nope"), 2, "--log-level"),
    (("serve", "{engine}", "--threads", "-5"), 2, "--threads"),
    (("serve", "{engine}", "--max-batch-size", "1e8"), 2, "--max-batch-size"),
    (("chat", "{engine}", "--prompt", "hi", "--max-tokens", "0"), 2, "--max-tokens"),
    (("chat", "{engine}", "--prompt", "hi", "--device", "tpu"), 2, "--device"),
    (("bench", "{engine}", "--threads", "0"), 2, "--threads"),
    (("quantize", "x", "-o", "y", "--threads", "-1"), 2, "--threads"),
    (("eval", "ppl"), 2, "Missing argument"),
    (("verify",), 2, "Missing argument"),
])
def test_usage_errors_are_one_line_and_exit_2(tiny_llava_engine, args, code, fragment):
    proc = run(*[a.replace("{engine}", str(tiny_llava_engine)) for a in args])
    assert_one_line(proc, code, fragment)


def test_cuda_on_a_cpu_host_is_one_line(tiny_llava_engine):
    import torch

    if torch.cuda.is_available():
        pytest.skip("this host has CUDA")
    assert_one_line(run("chat", tiny_llava_engine, "--prompt", "hi", "--device", "cuda"), 2, "no CUDA device")


def test_unwritable_output_and_non_utf8_recipe(tiny_llava, tmp_path):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llava)
    assert_one_line(run("build", recipe, "-o", "/proc/x"), 1, "/proc/x")
    bad = tmp_path / "latin1.yaml"
    bad.write_bytes("name: caf\xe9\nsource: x\n".encode("latin-1"))
    assert_one_line(run("build", bad, "--dry-run"), 2, "not UTF-8")


def test_chat_with_a_tiny_temperature_is_greedy(tiny_llava_engine):
    a = run("chat", tiny_llava_engine, "--prompt", "hello", "--max-tokens", "6", "--temperature", "1e-39", "--json")
    b = run("chat", tiny_llava_engine, "--prompt", "hello", "--max-tokens", "6", "--temperature", "0", "--json")
    assert a.returncode == 0 and "Traceback" not in a.stderr, a.stderr[-2000:]
    assert json.loads(a.stdout)["token_ids"] == json.loads(b.stdout)["token_ids"]


# ---- item 6 -------------------------------------------------------------------------------------
def _start_build(recipe: Path, out: Path) -> subprocess.Popen:
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    # SIGINT back to its default in the child: a shell may start background jobs with it ignored.
    return subprocess.Popen([str(VLMCTL), "build", str(recipe), "-o", str(out)], stdout=subprocess.PIPE,
                            stderr=subprocess.PIPE, text=True, env=env,
                            preexec_fn=lambda: signal.signal(signal.SIGINT, signal.SIG_DFL))


def _wait_for_stage_temp(proc, out: Path, timeout: float = 240) -> Path:
    deadline = time.monotonic() + timeout
    while time.monotonic() < deadline:
        assert proc.poll() is None, f"build ended first: {proc.stderr.read()[-2000:]}"
        temps = [p for p in out.glob(".*.tmp-*")] if out.exists() else []
        if temps:
            return temps[0]
        time.sleep(0.05)
    raise AssertionError("no stage started")


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
@pytest.mark.parametrize("sig,code,fragment", [(signal.SIGINT, 130, "interrupted"),
                                               (signal.SIGTERM, 143, "terminated")])
def test_interrupted_build_exits_130_or_143_with_one_line(tiny_llava, tmp_path, sig, code, fragment):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llava)
    out = tmp_path / "eng"
    proc = _start_build(recipe, out)
    try:
        _wait_for_stage_temp(proc, out)
        time.sleep(0.3)
        proc.send_signal(sig)
        stdout, stderr = proc.communicate(timeout=120)
    finally:
        if proc.poll() is None:
            proc.kill()
    done = subprocess.CompletedProcess(proc.args, proc.returncode, stdout, stderr)
    assert_one_line(done, code, fragment)
    # nothing half-written: no temporary directory, no stage directory without its manifest
    assert not list(out.glob(".*.tmp-*"))
    for stage in (out.iterdir() if out.exists() else []):
        if stage.is_dir() and not stage.name.startswith("."):
            assert (stage / "manifest.json").exists(), stage


# ---- item 12 ------------------------------------------------------------------------------------
@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_killed_builds_temporary_directories_are_reclaimed(tiny_llava, tmp_path, capsys):
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llava)
    out = tmp_path / "eng"
    proc = _start_build(recipe, out)
    try:
        temp = _wait_for_stage_temp(proc, out)
        proc.send_signal(signal.SIGKILL)  # no chance to clean up
        proc.wait(60)
    finally:
        if proc.poll() is None:
            proc.kill()
    assert temp.exists(), "the kill left nothing to reclaim"
    # another live process's temporary directory must survive (its owner is still working)
    owner = subprocess.Popen([sys.executable, "-c", "import time; time.sleep(600)"])
    try:
        live = out / f".export-vision.tmp-{socket.gethostname()}-{owner.pid}"
        live.mkdir()
        cli("build", recipe, "-o", out, capsys=capsys)
        assert not temp.exists()
        assert live.exists()
        assert [p.name for p in out.glob(".*.tmp-*")] == [live.name]
        assert [p for p in out.glob(".*.old-*")] == []
    finally:
        owner.kill()
        owner.wait()


def test_a_killed_builds_temporary_directory_goes_even_when_every_stage_is_cached(tiny_llava_engine, tmp_path,
                                                                                   capsys):
    """The reclaim ran only where a stage ran: a build (or stage command) whose stages were all cache hits
    left a killed build's temporary directory in place."""
    eng = tmp_path / "eng"
    shutil.copytree(tiny_llava_engine, eng)  # copy2 keeps the files' times: every stage stays a cache hit
    gone = subprocess.Popen([sys.executable, "-c", "pass"])
    gone.wait()  # an owner that no longer exists
    stale = eng / f".build-llm.tmp-{socket.gethostname()}-{gone.pid}"
    (stale / "part").mkdir(parents=True)
    report = cli_json("build-llm", eng, "--json", capsys=capsys)
    assert report["name"] == "build-llm" and report["cached"] is True
    assert not stale.exists()


# ---- item 7 -------------------------------------------------------------------------------------
def _truncate(p: Path):
    data = p.read_bytes()
    p.write_bytes(data[: len(data) // 2])


def _flip_same_size(p: Path):
    data = bytearray(p.read_bytes())
    data[len(data) // 2] ^= 0xFF
    data[0] = ord("#") if data[0] != ord("#") else ord("!")  # JSON files stop parsing
    p.write_bytes(bytes(data))


CORRUPTIONS = {
    "truncated-weights": lambda e: _truncate(e / "convert" / "llm" / "model.safetensors"),  # the float decoder
    "cut-config": lambda e: _truncate(e / "build-llm" / "config.json"),
    "broken-manifest": lambda e: (e / "build-llm" / "manifest.json").write_text("{not json"),
    "missing-manifest": lambda e: (e / "build-vision" / "manifest.json").unlink(),
    "truncated-onnx": lambda e: _truncate(e / "export-vision" / "model.onnx"),
    "tokenizer-json-same-size": lambda e: _flip_same_size(e / "convert" / "processor" / "tokenizer.json"),
}


@pytest.mark.parametrize("case", list(CORRUPTIONS))
def test_damaged_engine_chat_is_exit_8(engine_copy, case):
    CORRUPTIONS[case](engine_copy)
    assert_one_line(run("chat", engine_copy, "--prompt", "hi", "--json"), 8, str(engine_copy))


@pytest.mark.parametrize("case", ["truncated-weights", "broken-manifest", "tokenizer-json-same-size"])
def test_damaged_engine_serve_is_exit_8_before_listening(engine_copy, case):
    CORRUPTIONS[case](engine_copy)
    port = free_port()
    proc = run("serve", engine_copy, "--port", port, timeout=120)
    line = assert_one_line(proc, 8, str(engine_copy))
    assert "vlmctl serve" not in proc.stderr + proc.stdout  # the banner comes only once loaded
    assert "verify" in line or "damaged" in line


def test_verify_checks_every_files_sha256(engine_copy):
    ok = run("verify", engine_copy, "--json")
    assert ok.returncode == 0, ok.stderr
    report = json.loads(ok.stdout)
    assert report["ok"] and report["checked"] == "sha256"
    assert {s["stage"] for s in report["stages"]} >= {"convert", "export-vision", "build-vision", "build-llm"}
    assert all(s["files"] > 0 and not s["problems"] for s in report["stages"])

    weights = engine_copy / "convert" / "llm" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01  # one bit, same size: only a hash sees it
    weights.write_bytes(bytes(data))
    bad = run("verify", engine_copy, "--json")
    assert_one_line(bad, 8, "1 problem")
    report = json.loads(bad.stdout)
    assert not report["ok"]
    assert [p for s in report["stages"] for p in s["problems"]] == [
        "convert/llm/model.safetensors does not match its SHA-256 in the manifest"]
    human = run("verify", engine_copy)
    assert "convert/llm/model.safetensors" in human.stderr and human.returncode == 8
    assert_one_line(run("verify", engine_copy / "nope"), 8, "no such engine directory")


def test_verify_warns_of_files_no_manifest_lists(engine_copy):
    """A file no manifest lists is a warning line each, not a failure: the listed files are what verify
    vouches for (a fresh engine has none unlisted)."""
    assert "warning:" not in run("verify", engine_copy).stderr  # a fresh engine has no file outside its manifests
    (engine_copy / "notes.txt").write_text("mine")
    (engine_copy / "build-llm" / "extra.bin").write_bytes(b"\0" * 8)
    (engine_copy / "logs").mkdir()
    (engine_copy / "logs" / "a.log").write_text("x")
    proc = run("verify", engine_copy)
    assert proc.returncode == 0 and "error:" not in proc.stderr, proc.stderr
    warnings = [line for line in proc.stderr.splitlines() if line.startswith("warning:")]
    assert warnings == [f"warning: {rel} is in no manifest (not written by a stage; not checked)"
                        for rel in ("logs/", "notes.txt", "build-llm/extra.bin")], proc.stderr
    report = json.loads(run("verify", engine_copy, "--json").stdout)
    assert report["ok"] and report["unlisted"] == ["logs/", "notes.txt", "build-llm/extra.bin"]


def test_build_cache_does_not_trust_a_changed_file(tiny_llava_engine, engine_copy, capsys):
    recipe = recipe_of(tiny_llava_engine)
    first = cli_json("build", recipe, "-o", engine_copy, "--json", capsys=capsys)
    assert all(s["cached"] or s.get("skipped") for s in first["stages"])  # a faithful copy is all cache hits
    weights = engine_copy / "convert" / "llm" / "model.safetensors"
    data = bytearray(weights.read_bytes())
    data[-5] ^= 0x01
    weights.write_bytes(bytes(data))
    again = {s["name"]: s for s in cli_json("build", recipe, "-o", engine_copy, "--json", capsys=capsys)["stages"]}
    assert not again["convert"]["cached"]  # the stage that owns the changed file runs again...
    # ...and writes the same content, so what depends on it stays cached
    assert again["export-vision"]["cached"] and again["build-llm"]["cached"]
    assert run("verify", engine_copy).returncode == 0
    # a touched but unchanged file is still a cache hit (its content is hashed again, and matches)
    os.utime(weights, ns=(time.time_ns(), time.time_ns() + 10**9))
    third = {s["name"]: s for s in cli_json("build", recipe, "-o", engine_copy, "--json", capsys=capsys)["stages"]}
    assert third["build-llm"]["cached"]


# ---- item 8 -------------------------------------------------------------------------------------
@pytest.mark.parametrize("args,code,fragment", [
    (("--api-key", ""), 2, "--api-key is empty"),
    (("--api-key", "  "), 2, "--api-key is empty"),
    (("--max-batch-size", "-1"), 2, "--max-batch-size"),
    (("--max-batch-size", "0"), 2, "--max-batch-size"),
    (("--max-batch-size", "9"), 5, "built limit"),
    (("--max-input-len", "0"), 2, "--max-input-len"),
    (("--max-output-len", "-3"), 2, "--max-output-len"),
    (("--max-images-per-request", "-1"), 2, "--max-images-per-request"),
    (("--max-image-side", "0"), 2, "--max-image-side"),
    (("--media-timeout", "0"), 2, "--media-timeout"),
    (("--feature-cache-size", "-1"), 2, "--feature-cache-size"),
    (("--vision-backend", "bogus"), 2, "--vision-backend"),
    (("--kv-cache-tokens", "1"), 2, "--kv-cache-tokens"),
    (("--host", "999.1.1.1"), 2, "--host '999.1.1.1': not an address"),
    (("--host", "192.0.2.1"), 2, "cannot listen there"),  # TEST-NET-1: never this machine's
])
def test_serve_refuses_unusable_options_before_listening(tiny_llava_engine, args, code, fragment):
    proc = run("serve", tiny_llava_engine, "--port", free_port(), *args, timeout=120)
    assert_one_line(proc, code, fragment)


def test_serve_refuses_a_port_in_use_before_loading(tiny_llava_engine):
    import socket

    with socket.socket() as busy:
        busy.bind(("127.0.0.1", 0))
        busy.listen()
        port = str(busy.getsockname()[1])
        proc = run("serve", tiny_llava_engine, "--port", port, timeout=120)
    assert_one_line(proc, 2, f"--port {port}: cannot listen there")


def test_engine_batch_rule_is_the_same_for_every_backend(tiny_llava_engine):
    from vlmctl.errors import LimitError
    from vlmctl.runtime.engine import Engine

    built = json.loads((tiny_llava_engine / "build-llm" / "config.json").read_text())["limits"]["max_batch_size"]
    with pytest.raises(LimitError, match="built limit"):
        Engine(tiny_llava_engine, max_batch_size=built + 1)
    assert Engine(tiny_llava_engine, max_batch_size=built).limits["max_batch_size"] == built


# ---- item 16 ------------------------------------------------------------------------------------
def test_dry_run_reports_cache_hits_and_checks_the_source(tiny_llava_engine, engine_copy, tmp_path):
    recipe = recipe_of(tiny_llava_engine)
    proc = run("build", recipe, "-o", engine_copy, "--dry-run", "--json")
    assert proc.returncode == 0, proc.stderr
    plan = {p["stage"]: p for p in json.loads(proc.stdout)["plan"]}
    assert not any(p["runs"] for p in plan.values()), plan
    assert "cached" in plan["build-llm"]["reason"]
    changed = run("build", recipe, "-o", engine_copy, "--dry-run", "--json", "--set", "limits.max_batch_size=3")
    plan = {p["stage"]: p["runs"] for p in json.loads(changed.stdout)["plan"]}
    assert plan == {"convert": False, "quantize": False, "export-vision": False, "build-vision": True,
                    "build-llm": True}
    fresh = json.loads(run("build", recipe, "-o", tmp_path / "new", "--dry-run", "--json").stdout)["plan"]
    assert [p["runs"] for p in fresh] == [True, False, True, True, True]
    assert not (tmp_path / "new").exists()  # a dry run writes nothing

    missing = write_recipe(tmp_path / "missing.yaml", tmp_path / "nowhere")
    assert_one_line(run("build", missing, "--dry-run"), 3, "no such directory")
    assert_one_line(run("build", missing, "-o", tmp_path / "e"), 3, "no such directory")


# ---- item 17 ------------------------------------------------------------------------------------
def test_default_threads_leave_a_core_and_follow_the_affinity_mask():
    if not hasattr(os, "sched_setaffinity"):
        pytest.skip("no CPU affinity on this platform")
    code = ("import os, sys, torch; from vlmctl.host import configure_threads; "
            "cpus = sorted(os.sched_getaffinity(0)); n = configure_threads(None); "
            "print(json.dumps({'cpus': len(cpus), 'threads': n, 'torch': torch.get_num_threads(), "
            "'torch_default': int(sys.argv[1])}))")
    import torch

    env = {k: v for k, v in os.environ.items() if k not in ("OMP_NUM_THREADS", "MKL_NUM_THREADS")}
    torch_default = torch.get_num_threads() if not os.environ.get("OMP_NUM_THREADS") else (os.cpu_count() or 1)
    all_cpus = sorted(os.sched_getaffinity(0))
    for mask in ({all_cpus[0]}, set(all_cpus)):
        proc = subprocess.run([sys.executable, "-c", "import json; " + code, str(torch_default)], env=env,
                              capture_output=True, text=True, timeout=120,
                              preexec_fn=lambda m=mask: os.sched_setaffinity(0, m))
        assert proc.returncode == 0, proc.stderr
        got = json.loads(proc.stdout)
        assert got["threads"] == got["torch"]
        assert got["threads"] == max(1, min(len(mask), torch_default) - 1)
        if len(mask) > 1:
            assert got["threads"] < len(mask)  # never one thread per usable CPU: the rest of the work needs one


def test_quantize_takes_threads(tiny_llava, tmp_path):
    data = tmp_path / "calib.txt"
    data.write_text("\n".join(f"line {i}: the quick brown fox jumps over the lazy dog." for i in range(40)))
    proc = run("quantize", "--awq", tiny_llava, "-o", tmp_path / "q", "--group-size", "32", "--calib-data", data,
               "--calib-samples", "2", "--calib-seq-len", "16", "--threads", "1", "--json")
    assert proc.returncode == 0, proc.stderr[-2000:]
    assert json.loads(proc.stdout.strip().splitlines()[-1])["threads"] == 1


# ---- item 14 ------------------------------------------------------------------------------------
def test_a_non_editable_install_ships_recipes_and_profiles(tmp_path):
    try:
        import setuptools

        if int(setuptools.__version__.split(".")[0]) < 68:
            raise ImportError
    except ImportError:
        pytest.skip("needs setuptools >= 68 in this environment (the install runs without network)")
    src = tmp_path / "src"
    src.mkdir()
    for name in ("pyproject.toml", "setup.py", "README.md"):
        shutil.copy2(REPO / name, src / name)
    for name in ("vlmctl", "recipes", "configs"):
        shutil.copytree(REPO / name, src / name, ignore=shutil.ignore_patterns("__pycache__"))
    target = tmp_path / "site"
    proc = subprocess.run([sys.executable, "-m", "pip", "install", "--no-deps", "--no-build-isolation", "--no-index",
                           "--target", str(target), str(src)], capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr[-3000:]
    env = {**os.environ, "PYTHONPATH": str(target)}
    code = ("import json, vlmctl, vlmctl.recipe as r; "
            "print(json.dumps({'file': vlmctl.__file__, 'recipes': [x['name'] for x in r.list_recipes()]}))")
    where = json.loads(subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True,
                                      text=True, timeout=120).stdout)
    assert where["file"].startswith(str(target))
    assert {p.stem for p in (REPO / "recipes").glob("*.yaml")} == set(where["recipes"])
    listed = subprocess.run([str(target / "bin" / "vlmctl"), "recipes", "--json"], env=env, cwd=tmp_path,
                            capture_output=True, text=True, timeout=120)
    assert listed.returncode == 0, listed.stderr
    assert {r["name"] for r in json.loads(listed.stdout)} == set(where["recipes"])
    (tmp_path / "ck").mkdir()
    (tmp_path / "r.yaml").write_text(f"source: {tmp_path / 'ck'}\nprofiles: [fp16, awq]\n")
    code = "import vlmctl.recipe as r; x = r.load_recipe('r.yaml'); print(x.dtype, x.quantization.method)"
    proc = subprocess.run([sys.executable, "-c", code], env=env, cwd=tmp_path, capture_output=True, text=True,
                          timeout=120)
    assert proc.stdout.split() == ["float16", "awq"], proc.stderr[-2000:]
    # what the package declares, it ships
    assert (target / "vlmctl" / "py.typed").exists() or "py.typed" not in (REPO / "pyproject.toml").read_text()


def test_torch_lower_bound_is_what_transformers_needs():
    import importlib.metadata as md

    from packaging.requirements import Requirement
    from packaging.version import Version

    need = [Requirement(r) for r in md.requires("transformers") or [] if r.startswith("torch")]
    need = [r for r in need if r.name == "torch"]
    if not need:
        pytest.skip("transformers declares no torch requirement")
    floor = max(Version(s.version) for r in need for s in r.specifier if s.operator == ">=")
    text = (REPO / "pyproject.toml").read_text()
    ours = Version(re.search(r'"torch>=([0-9.]+)', text).group(1))
    assert ours >= floor, f"torch>={ours} in pyproject.toml; transformers needs torch>={floor}"


# ---- item 18 ------------------------------------------------------------------------------------
def test_readme_cli_table_lists_every_command():
    from vlmctl.cli.main import app

    readme = (REPO / "README.md").read_text()
    table = readme.split("## CLI reference", 1)[1].split("\n## ", 1)[0]
    documented = set(re.findall(r"^\| `vlmctl ([a-z-]+)", table, re.M))
    commands = {c.name for c in app.registered_commands} | {g.name for g in app.registered_groups}
    assert commands <= documented, f"undocumented: {sorted(commands - documented)}"


def test_readme_exit_codes_cover_every_error_and_signal():
    from vlmctl import errors

    readme = (REPO / "README.md").read_text()
    table = readme.split("## Exit codes", 1)[1].split("\n## ", 1)[0]
    codes = {int(c) for c in re.findall(r"^\| (\d+) \|", table, re.M)}
    used = {cls.exit_code for cls in vars(errors).values()
            if isinstance(cls, type) and issubclass(cls, errors.VlmctlError)}
    assert used | {0, 2, 130, 143} <= codes


def test_readme_models_table_names_every_bundled_recipe():
    from vlmctl.recipe import list_recipes

    readme = (REPO / "README.md").read_text()
    table = readme.split("## Supported models", 1)[1].strip().split("\n\n", 1)[0]
    named = {name for row in re.findall(r"^\| [^|]+\| [^|]+\| ([^|]+)\|", table, re.M)
             for name in re.findall(r"[a-z0-9][a-z0-9.-]+[a-z0-9]", row)}
    missing = sorted(r["name"] for r in list_recipes() if r["name"] not in named)
    assert not missing, f"bundled recipes the Supported models table does not name: {missing}"


def test_readme_quickstart_downloads_with_hf_and_warns_about_group_size():
    readme = (REPO / "README.md").read_text()
    quick = readme.split("## Quickstart", 1)[1].split("\n## ", 1)[0]
    assert "hf download llava-hf/llava-1.5-7b-hf" in quick
    assert "huggingface-cli" not in readme
    awq = readme.split("## AWQ", 1)[1].split("\n## ", 1)[0]
    assert "group_size" in awq and "64" in awq and "576" in awq


# ---- progress where stderr is not a terminal -----------------------------------------------------
def test_stages_report_progress_in_a_log(tiny_llava, tmp_path):
    """A CI log (stderr a pipe) gets plain progress lines from the long stages, where bars would show
    nothing at all, and an error is still one line, with no blank line before it."""
    recipe = write_recipe(tmp_path / "r.yaml", tiny_llava)
    proc = run("build", recipe, "-o", tmp_path / "e")
    assert proc.returncode == 0, proc.stderr[-3000:]
    lines = proc.stderr.splitlines()
    assert any(re.fullmatch(r"convert: splitting tensors: 0/\d+", line) for line in lines), lines
    assert "export-vision: validating on ONNX Runtime ..." in lines
    assert not any("\x1b[" in line for line in lines), "terminal control codes in a log"
    bad = run("convert", tmp_path / "nope", "-o", tmp_path / "c")
    assert bad.returncode == 3 and bad.stderr.startswith("error: "), repr(bad.stderr)


def test_interactive_chat_checks_max_tokens_before_the_first_turn(tiny_llava_engine):
    env = {**os.environ, "PYTHONWARNINGS": "ignore", "HF_HUB_OFFLINE": "1"}
    proc = subprocess.run([str(VLMCTL), "chat", str(tiny_llava_engine), "--max-tokens", "100000"], input="hi\nhello\n",
                          capture_output=True, text=True, env=env, timeout=300)
    assert_one_line(proc, 5, "--max-tokens 100000 exceeds this engine's max_output_len")
