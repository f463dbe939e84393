"""Stage artifacts: caching by hash, manifests, atomic outputs.

Each stage owns one directory under the work directory (`convert/`, `quantize/`,
`export-vision/`, `build-vision/`, `build-llm/`). A stage's cache key hashes the tool version,
the stage name, its resolved settings and the content hashes of its inputs; when the manifest
in its directory records the same key (and its files are intact), the stage is a cache hit.
Outputs are written to a temporary sibling directory and renamed into place only on success,
so an interrupted build never leaves a directory that looks finished.
"""

from __future__ import annotations

import hashlib
import json
import os
import shutil
import time
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable

from . import __version__
from .errors import StageError

STAGES = ("convert", "quantize", "export-vision", "build-vision", "build-llm")
MANIFEST = "manifest.json"


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def hash_tree(root: Path, files: list[Path] | None = None, stat_cache: Path | None = None) -> str:
    """Content hash of a directory: relative names and file contents, in sorted order.

    With `stat_cache`, a file whose size and modification time match the cached entry reuses its
    recorded SHA-256, so re-building from a multi-GB source checkpoint does not re-read it."""
    root = Path(root)
    files = sorted(files if files is not None else [p for p in root.rglob("*") if p.is_file()])
    cache: dict = {}
    if stat_cache is not None:
        try:
            cache = json.loads(Path(stat_cache).read_text())
        except (OSError, json.JSONDecodeError):
            cache = {}
    fresh: dict = {}
    h = hashlib.sha256()
    for p in files:
        rel = p.relative_to(root).as_posix()
        if rel == MANIFEST:
            continue
        st = p.stat()
        key = str(p.resolve())
        hit = cache.get(key)
        digest = hit[2] if hit and hit[0] == st.st_size and hit[1] == st.st_mtime_ns else sha256_file(p)
        fresh[key] = [st.st_size, st.st_mtime_ns, digest]
        h.update(rel.encode() + b"\0" + digest.encode() + b"\n")
    if stat_cache is not None:
        tmp = Path(stat_cache).with_suffix(".tmp")
        tmp.write_text(json.dumps(fresh))
        tmp.replace(stat_cache)
    return h.hexdigest()


def hash_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def read_manifest(stage_dir: Path) -> dict | None:
    try:
        return json.loads((Path(stage_dir) / MANIFEST).read_text())
    except (OSError, json.JSONDecodeError):
        return None


@dataclass
class StageResult:
    name: str
    cached: bool
    seconds: float
    directory: Path
    outputs: list[str] = field(default_factory=list)
    info: dict = field(default_factory=dict)
    skipped: str | None = None

    def to_json(self) -> dict:
        d = {"name": self.name, "cached": self.cached, "seconds": round(self.seconds, 3),
             "directory": str(self.directory), "outputs": self.outputs}
        if self.skipped:
            d["skipped"] = self.skipped
        if self.info:
            d["info"] = self.info
        return d


def _part_hashes(out_dir: Path) -> dict[str, str]:
    """A hash per top-level entry, so a consumer can depend on one part (e.g. convert's vision/)."""
    parts = {}
    for p in sorted(out_dir.iterdir()):
        if p.name == MANIFEST:
            continue
        parts[p.name] = hash_tree(p) if p.is_dir() else sha256_file(p)
    return parts


def run_stage(workdir: Path, name: str, settings: dict, inputs: dict[str, str],
              fn: Callable[[Path], dict], *, force: bool = False) -> StageResult:
    """Run `fn(tmp_dir)` unless the manifest says its key is unchanged; publish atomically."""
    workdir = Path(workdir)
    stage_dir = workdir / name
    key = hash_json({"tool": __version__, "stage": name, "settings": settings, "inputs": inputs})
    old = read_manifest(stage_dir)
    if not force and old and old.get("cache_key") == key and _intact(stage_dir, old):
        return StageResult(name, True, 0.0, stage_dir, [f["path"] for f in old["files"]], old.get("info", {}))

    workdir.mkdir(parents=True, exist_ok=True)
    tmp = workdir / f".{name}.tmp-{os.getpid()}"
    if tmp.exists():
        shutil.rmtree(tmp)
    tmp.mkdir()
    t0 = time.perf_counter()
    try:
        info = fn(tmp) or {}
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        file_entries = [{"path": p.relative_to(tmp).as_posix(), "bytes": p.stat().st_size, "sha256": sha256_file(p)}
                        for p in files]
        seconds = time.perf_counter() - t0
        manifest = {
            "tool": "vlmctl", "tool_version": __version__, "stage": name, "cache_key": key,
            "settings": settings, "inputs": inputs, "backend": info.pop("backend", None),
            "backend_version": info.pop("backend_version", None), "info": info,
            "parts": _part_hashes(tmp), "files": file_entries, "seconds": round(seconds, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    _publish(tmp, stage_dir)
    return StageResult(name, False, seconds, stage_dir, [f["path"] for f in file_entries], info)


def _intact(stage_dir: Path, manifest: dict) -> bool:
    for f in manifest.get("files", []):
        p = stage_dir / f["path"]
        if not p.is_file() or p.stat().st_size != f["bytes"]:
            return False
    return True


def _publish(tmp: Path, stage_dir: Path) -> None:
    if stage_dir.exists():
        trash = stage_dir.with_name(f".{stage_dir.name}.old-{os.getpid()}")
        stage_dir.rename(trash)
        tmp.rename(stage_dir)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(stage_dir)


def stage_part_hash(workdir: Path, stage: str, part: str | None = None) -> str:
    """An upstream stage's output hash (or one part of it) for a consumer's cache key."""
    m = read_manifest(Path(workdir) / stage)
    if m is None:
        raise StageError(f"{Path(workdir) / stage}: stage {stage!r} has not run here (no manifest.json); "
                         f"run `vlmctl {stage}` first")
    if part is None:
        return hash_json(m["parts"])
    if part not in m["parts"]:
        raise StageError(f"{Path(workdir) / stage}: has no {part!r} output")
    return m["parts"][part]


def require_stage(workdir: Path, stage: str) -> dict:
    m = read_manifest(Path(workdir) / stage)
    if m is None:
        raise StageError(f"{workdir}: stage {stage!r} has not run here; run `vlmctl {stage}` (or `vlmctl build`) first")
    return m



