"""Shared fixtures: tiny checkpoints built once per session, the CLI run in-process."""

from __future__ import annotations

import contextlib
import json
import os
import subprocess
import sys
import time
from pathlib import Path

import pytest

sys.path.insert(0, str(Path(__file__).parent))
os.environ.setdefault("HF_HUB_OFFLINE", "1")
os.environ.setdefault("TOKENIZERS_PARALLELISM", "false")


def _no_cuda() -> bool:
    try:
        import torch

        return not torch.cuda.is_available()
    except Exception:
        return True


# Without CUDA, Triton kernels can only run in Triton's interpreter, and triton reads this before its
# own library functions are defined (at import), so it is set here, before any test imports triton.
if _no_cuda():
    os.environ.setdefault("TRITON_INTERPRET", "1")

SHARED = Path(__file__).resolve().parents[2] / "shared"
WIKITEXT = SHARED / "data" / "wikitext-2"


def cli(*args: str, capsys=None, expect: int | None = 0):
    """Run `vlmctl ARGS` in-process; return (exit code, stdout, stderr)."""
    from vlmctl.cli.main import cli_main

    code = cli_main([str(a) for a in args])
    o, e = ("", "")
    if capsys is not None:
        captured = capsys.readouterr()
        o, e = captured.out, captured.err
    if expect is not None:
        assert code == expect, f"vlmctl {' '.join(map(str, args))} exited {code}: {e[-2000:]}"
    return code, o, e


def cli_json(*args: str, capsys) -> dict:
    _, o, _ = cli(*args, capsys=capsys)
    return json.loads(o.strip().splitlines()[-1])


def write_recipe(path: Path, source: Path, **extra) -> Path:
    import yaml

    data = {"name": path.stem, "source": str(source), "profiles": ["fp32-cpu"], **extra}
    path.write_text(yaml.safe_dump(data))
    return path


def assert_warm_steps_touch_only_block_0(dec) -> None:
    """`TorchDecoder.warm_steps` (what a CUDA engine runs at load to compile its eager kernels) runs on this
    decoder (any device) and writes KV block 0 only, which the pools never hand out."""
    import torch

    k0, v0 = dec.k_cache.clone(), dec.v_cache.clone()
    steps = dec.warm_steps(3)
    assert [sum(c.is_decode for c in s) for s in steps] == [1, 3]
    for chunks in steps:
        logits = dec.forward(chunks)
        assert logits.shape[0] == 2 and torch.isfinite(logits).all()
    changed = [b for b in range(dec.k_cache.shape[1])
               if not (torch.equal(dec.k_cache[:, b], k0[:, b]) and torch.equal(dec.v_cache[:, b], v0[:, b]))]
    assert changed == [0]


@pytest.fixture
def triton_device() -> str:
    """Where the Triton kernels run: 'cuda' when present, else 'cpu' in Triton's interpreter (set above
    without CUDA); skips where neither is possible."""
    try:
        import triton  # noqa: F401
    except Exception as e:
        pytest.skip(f"triton is not importable here ({e}); the kernels need it")
    if not _no_cuda():
        return "cuda"
    if os.environ.get("TRITON_INTERPRET") != "1":
        pytest.skip("no CUDA and TRITON_INTERPRET is not 1: the kernels cannot run here")
    return "cpu"


@pytest.fixture(scope="session")
def tiny_llava(tmp_path_factory) -> Path:
    from tiny_models import make_llava

    return make_llava(tmp_path_factory.mktemp("ckpt") / "llava")


@pytest.fixture(scope="session")
def tiny_llava_engine(tiny_llava, tmp_path_factory) -> Path:
    """A built engine (fp32, embedded backends) of the default tiny LLaVA, built for batches of 8 (the
    server tests run 8 at once; a server can lower the batch, never raise it)."""
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    d = tmp_path_factory.mktemp("engine")
    recipe = load_recipe(write_recipe(d / "tiny.yaml", tiny_llava, limits={"max_batch_size": 8}))
    build(recipe, d / "engine")
    return d / "engine"


def serve_engine(engine_dir: Path, **load_app_kwargs):
    """The body of a module's `srv` fixture: `vlmctl serve`'s app for `engine_dir` (no stats lines) on a real
    uvicorn server on 127.0.0.1; yields (url, app) and stops the server after the module."""
    from test_serve import start_uvicorn
    from vlmctl.serve import ServerConfig, load_app

    app = load_app(engine_dir, ServerConfig(stats_interval_s=0), **load_app_kwargs)
    url, stop = start_uvicorn(app)
    yield url, app
    stop()


@pytest.fixture(scope="module")
def srv(tiny_llava_engine):
    """The session's tiny engine served for batches of 8: (url, app). A module that needs other settings
    defines its own `srv` (e.g. with `serve_engine`)."""
    yield from serve_engine(tiny_llava_engine, max_batch_size=8)


def free_port() -> int:
    """A TCP port on 127.0.0.1 that nothing listens on now."""
    import socket

    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        return s.getsockname()[1]


@contextlib.contextmanager
def serve_process(engine_dir: Path, cwd: Path, *args: str, log=subprocess.DEVNULL, err=None, env=None,
                  timeout_s: float = 120):
    """`python -m vlmctl serve ENGINE --port P ARGS` as a real process, run in `cwd` with its stdout to `log`
    and stderr to `err` (default: with stdout); yields (process, url) once /health answers 200, and kills it
    on the way out if the test left it running. `err`, when a file, is read back into a failure's message."""
    import httpx

    port = free_port()
    url = f"http://127.0.0.1:{port}"
    env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", **(env or {})}
    stderr = subprocess.STDOUT if err is None else err

    def output() -> str:
        f = err if err is not None else log
        try:
            return Path(f.name).read_text()[-2000:]
        except (AttributeError, TypeError, OSError):
            return ""

    proc = subprocess.Popen([sys.executable, "-m", "vlmctl", "serve", str(engine_dir), "--port", str(port),
                             *map(str, args)], stdout=log, stderr=stderr, env=env, cwd=cwd)
    try:
        deadline = time.monotonic() + timeout_s
        while True:
            assert proc.poll() is None, f"server exited early: {output()}"
            assert time.monotonic() < deadline, f"server did not become healthy: {output()}"
            try:
                if httpx.get(url + "/health", timeout=2).status_code == 200:
                    break
            except httpx.HTTPError:
                pass
            time.sleep(0.1)
        yield proc, url
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait(10)


def hf_processor_image_defaults(processor_cls) -> dict:
    """The image settings a transformers processor passes over its image processor's own: a class
    attribute from transformers ~5.20 on, the defaults of its kwargs class before."""
    got = getattr(processor_cls, "images_kwargs", None)
    if got is None:
        got = processor_cls.valid_processor_kwargs._defaults.get("images_kwargs", {})
    return dict(got)


def one_error_line(code: int, err: str, expect_code: int) -> str:
    """A command failed with `expect_code`, with exactly one `error:` line (the last) and no traceback."""
    lines = [line for line in err.splitlines() if line.strip()]
    assert code == expect_code, err[-2000:]
    assert "Traceback" not in err and lines and lines[-1].startswith("error: "), err[-2000:]
    assert sum(line.startswith("error:") for line in lines) == 1, err[-2000:]
    return lines[-1]


def file_snapshot(d) -> dict:
    """{relative path: bytes} of every file under d, to show a refused command changed nothing."""
    from pathlib import Path

    d = Path(d)
    return {p.relative_to(d).as_posix(): p.read_bytes() for p in sorted(d.rglob("*")) if p.is_file()}
