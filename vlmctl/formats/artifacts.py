"""Stage artifacts: caching by hash, manifests, atomic outputs.

Each stage owns one directory under the work directory (formats/workdir.py names them). A stage's
cache key hashes the tool version, the stage name, its resolved settings and the content hashes of
its inputs; when the manifest in its directory records the same key (and its files are intact), the
stage is a cache hit.
Outputs are written to a temporary sibling directory and renamed into place only on success,
so an interrupted build never leaves a directory that looks finished. Temporary directories are
named after the host and process that own them; one whose process is gone (a killed build) is
removed by the next stage run in the same work directory.

Trust in a finished stage: its manifest lists every file with its size, modification time and
SHA-256. The cache trusts a file whose size and modification time match and re-hashes one whose
time changed (a touched or copied file is fine if its content is the same); `check_engine_files`
(run by chat and serve at start) compares sizes; `verify_engine` (`vlmctl verify`) compares hashes.
"""

from __future__ import annotations

import errno
import hashlib
import json
import os
import shutil
import socket
import time
from contextlib import contextmanager
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, Callable, Iterator

from .. import __version__
from ..errors import EngineError, StageError
from .workdir import (ENGINE_STAGES, MANIFEST, RECIPE_FILE, SOURCE_HASHES, STAGES, WorkDir, incomplete_engine,
                      not_an_engine)


def sha256_file(path: Path, chunk: int = 1 << 22) -> str:
    h = hashlib.sha256()
    with open(path, "rb") as f:
        while True:
            b = f.read(chunk)
            if not b:
                break
            h.update(b)
    return h.hexdigest()


def hash_tree(root: Path, files: list[Path] | None = None, stat_cache: Path | None = None,
              save_cache: bool = True) -> str:
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
    if stat_cache is not None and save_cache:
        tmp = Path(stat_cache).with_suffix(".tmp")
        tmp.write_text(json.dumps(fresh))
        tmp.replace(stat_cache)
    return h.hexdigest()


def hash_json(obj: Any) -> str:
    return hashlib.sha256(json.dumps(obj, sort_keys=True, default=str).encode()).hexdigest()


def read_manifest(stage_dir: Path) -> dict | None:
    """A stage's manifest, or None when it is missing or unreadable (not JSON, not UTF-8, not a JSON object)."""
    try:
        m = json.loads((Path(stage_dir) / MANIFEST).read_text())
    except (OSError, ValueError):  # ValueError: JSONDecodeError and UnicodeDecodeError
        return None
    return m if isinstance(m, dict) else None


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


def stage_key(name: str, settings: dict, inputs: dict[str, str]) -> str:
    return hash_json({"tool": __version__, "stage": name, "settings": settings, "inputs": inputs})


def cache_status(workdir: Path, name: str, settings: dict, inputs: dict[str, str]) -> tuple[bool, str]:
    """(cache hit?, why) for a stage whose settings and inputs are these."""
    stage_dir = Path(workdir) / name
    old = read_manifest(stage_dir)
    if old is None:
        return False, "no output yet" if not stage_dir.exists() else "its manifest is missing or unreadable"
    if old.get("cache_key") != stage_key(name, settings, inputs):
        return False, "its settings or inputs changed"
    if not _intact(stage_dir, old):
        return False, "its files changed since it ran"
    return True, "cached (the manifest matches)"


def run_stage(workdir: Path, name: str, settings: dict, inputs: dict[str, str],
              fn: Callable[[Path], dict], *, force: bool = False) -> StageResult:
    """Run `fn(tmp_dir)` unless the manifest says its key is unchanged; publish atomically."""
    workdir = Path(workdir)
    stage_dir = workdir / name
    key = stage_key(name, settings, inputs)
    if workdir.is_dir():  # every stage's, not only this one's, cache hit or not: a killed build left them
        reclaim_stale_temps(workdir, STAGES)
    if not force and cache_status(workdir, name, settings, inputs)[0]:
        old = read_manifest(stage_dir)
        return StageResult(name, True, 0.0, stage_dir, [f["path"] for f in old.get("files", [])], old.get("info", {}))

    workdir.mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    with atomic_dir(stage_dir, reclaim=False) as tmp:
        info = fn(tmp) or {}
        files = sorted(p for p in tmp.rglob("*") if p.is_file())
        file_entries = [{"path": p.relative_to(tmp).as_posix(), "bytes": p.stat().st_size,
                         "mtime_ns": p.stat().st_mtime_ns, "sha256": sha256_file(p)} for p in files]
        seconds = time.perf_counter() - t0
        manifest = {
            "tool": "vlmctl", "tool_version": __version__, "stage": name, "cache_key": key,
            "settings": settings, "inputs": inputs, "backend": info.pop("backend", None),
            "backend_version": info.pop("backend_version", None), "info": info,
            "parts": _part_hashes(tmp), "files": file_entries, "seconds": round(seconds, 3),
            "created": time.strftime("%Y-%m-%dT%H:%M:%SZ", time.gmtime()),
        }
        (tmp / MANIFEST).write_text(json.dumps(manifest, indent=2))
    return StageResult(name, False, seconds, stage_dir, [f["path"] for f in file_entries], info)


def _intact(stage_dir: Path, manifest: dict) -> bool:
    """Whether every file the manifest lists is still what the stage wrote: same size, and same
    modification time or (when the time changed, or an older manifest did not record it) same SHA-256."""
    try:
        for f in manifest.get("files", []):
            p = stage_dir / f["path"]
            if not p.is_file():
                return False
            st = p.stat()
            if st.st_size != f["bytes"]:
                return False
            if st.st_mtime_ns != f.get("mtime_ns") and sha256_file(p) != f["sha256"]:
                return False
    except (KeyError, TypeError, OSError):  # a manifest that is not ours, or a file gone meanwhile
        return False
    return True


# ---- temporary directories of killed builds --------------------------------------------------
def temp_name(base: str, kind: str) -> str:
    """`.BASE.KIND-HOST-PID`: the owner is recorded in the name, so its absence can be detected."""
    return f".{base}.{kind}-{socket.gethostname()}-{os.getpid()}"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:  # another user's live process
        return True
    except OSError as e:
        return e.errno != errno.ESRCH
    return True


def reclaim_stale_temps(parent: Path, bases) -> list[Path]:
    """Remove `.BASE.tmp-…` / `.BASE.old-…` directories under `parent` whose owning process (on this
    host) no longer exists: what a killed build left. A live owner's, or another host's, stay."""
    removed = []
    try:
        entries = list(Path(parent).iterdir())
    except OSError:
        return removed
    host = socket.gethostname()
    for p in entries:
        for base in bases:
            for kind in ("tmp", "old"):
                prefix = f".{base}.{kind}-"
                if not p.name.startswith(prefix):
                    continue
                owner, _, pid = p.name[len(prefix):].rpartition("-")
                # Names without a host are from vlmctl versions before this one: the owner was local.
                if not pid.isdigit() or (owner and owner != host) or int(pid) == os.getpid():
                    continue
                if not _pid_alive(int(pid)):
                    shutil.rmtree(p, ignore_errors=True)
                    removed.append(p)
    return removed


@contextmanager
def atomic_dir(final: Path, *, reclaim: bool = True) -> Iterator[Path]:
    """A fresh temporary sibling of `final` to write into; when the block succeeds it replaces `final`
    (renamed into place), when it raises (or is interrupted) it is removed. Nobody ever sees a
    half-written `final`. With `reclaim`, temporaries of `final` that killed processes left are
    removed first."""
    final = Path(final)
    made = _missing_dirs(final.parent)
    try:
        final.parent.mkdir(parents=True, exist_ok=True)
        if reclaim:
            reclaim_stale_temps(final.parent, [final.name])
        tmp = final.with_name(temp_name(final.name, "tmp"))
        if tmp.exists():
            shutil.rmtree(tmp)
        tmp.mkdir()
    except OSError as e:  # named for the output asked for, not for the temporary sibling
        _remove_empty(made)
        where = "" if e.filename is None or Path(e.filename).name.startswith(f".{final.name}.") else f": {e.filename}"
        raise OSError(e.errno, f"cannot create it ({e.strerror}{where})", str(final)) from None
    except BaseException:
        _remove_empty(made)
        raise
    try:
        yield tmp
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        _remove_empty(made)  # a failed write leaves no trace, not even the parents it made
        raise
    _publish(tmp, final)


def _missing_dirs(path: Path) -> list[Path]:
    """The directories `mkdir -p path` would create, outermost first."""
    missing = []
    p = Path(path)
    while not p.exists() and not p.is_symlink() and p != p.parent:
        missing.append(p)
        p = p.parent
    return missing[::-1]


def _remove_empty(dirs: list[Path]) -> None:
    for d in reversed(dirs):
        try:
            d.rmdir()
        except FileNotFoundError:  # never made (a mkdir -p that stopped part-way)
            continue
        except OSError:  # not empty: something else wrote there meanwhile
            break


def _publish(tmp: Path, final: Path) -> None:
    if final.exists():
        trash = final.with_name(temp_name(final.name, "old"))
        final.rename(trash)
        tmp.rename(final)
        shutil.rmtree(trash, ignore_errors=True)
    else:
        tmp.rename(final)


def stage_part_hash(workdir: Path, stage: str, part: str | None = None) -> str:
    """An upstream stage's output hash (or one part of it) for a consumer's cache key."""
    m = read_manifest(Path(workdir) / stage)
    if m is None:
        raise StageError(f"{Path(workdir) / stage}: stage {stage!r} has not run here (no manifest.json); "
                         f"run `vlmctl {stage}` first")
    if not isinstance(m.get("parts"), dict):  # a manifest edited by hand, or not ours
        raise StageError(f"{Path(workdir) / stage}: its {MANIFEST} is damaged (no parts); re-run `vlmctl {stage}`")
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


# ---- engine directory integrity ----------------------------------------------------------------
def _stage_problems(stage_dir: Path, deep: bool) -> tuple[int, list[str], list[str]]:
    """(files checked, problems, files the manifest does not list) of one stage directory against its manifest."""
    path = stage_dir / MANIFEST
    stage = stage_dir.name
    if not path.is_file():
        return 0, [f"{stage}/{MANIFEST} is missing"], []
    try:
        manifest = json.loads(path.read_text())
        files = manifest["files"]
        entries = [(str(f["path"]), int(f["bytes"]), str(f["sha256"])) for f in files]
    except (OSError, UnicodeDecodeError, json.JSONDecodeError, KeyError, TypeError, ValueError):
        return 0, [f"{stage}/{MANIFEST} is unreadable or not a vlmctl manifest"], []
    problems = []
    for rel, size, digest in entries:
        p = stage_dir / rel
        if not p.is_file():
            problems.append(f"{stage}/{rel} is missing")
            continue
        actual = p.stat().st_size
        if actual != size:
            problems.append(f"{stage}/{rel} is {actual} bytes; the manifest says {size}")
        elif deep and sha256_file(p) != digest:
            problems.append(f"{stage}/{rel} does not match its SHA-256 in the manifest")
    listed = {rel for rel, _, _ in entries} | {MANIFEST}
    unlisted = sorted(f"{stage}/{rel}" for rel in (p.relative_to(stage_dir).as_posix() for p in stage_dir.rglob("*")
                                                   if p.is_file()) if rel not in listed)
    return len(entries), problems, unlisted


def _unlisted_top_level(engine_dir: Path) -> list[str]:
    """Entries of the work directory itself that no stage wrote: not a stage directory, recipe.json or the
    source-hash cache (a directory is named once, with a trailing /)."""
    known = set(STAGES) | {RECIPE_FILE, SOURCE_HASHES}
    return sorted(p.name + ("/" if p.is_dir() else "") for p in engine_dir.iterdir() if p.name not in known)


def verify_engine(engine_dir: Path, deep: bool = True) -> dict:
    """Check every file every stage manifest lists: sizes, and with `deep` their SHA-256.

    Returns {"engine_dir", "ok", "checked": "sha256"|"size", "complete", "next_stage", "stages": [{"stage",
    "files", "problems", "missing"}], "unlisted"}. Every stage a complete engine has run (WorkDir.needed_stages:
    all of them, quantize when the recipe quantizes) must be there: one missing is a problem, and
    "next_stage" names the first; other stages are checked when present. "unlisted": files in the directory
    that no manifest lists (nothing checks them; they do not make the report fail)."""
    engine_dir = Path(engine_dir)
    wd = WorkDir(engine_dir)
    needed, missing = wd.needed_stages(), wd.missing_stages()
    stages, unlisted = [], _unlisted_top_level(engine_dir)
    for name in STAGES:
        d = engine_dir / name
        if not d.is_dir():
            if name in needed:
                stages.append({"stage": name, "files": 0, "missing": True,
                               "problems": [f"{name}/ is missing (the stage has not run here)"]})
            continue
        n, problems, extra = _stage_problems(d, deep)
        stages.append({"stage": name, "files": n, "missing": False, "problems": problems})
        unlisted += extra
    return {"engine_dir": str(engine_dir), "ok": not any(s["problems"] for s in stages),
            "checked": "sha256" if deep else "size", "complete": not missing,
            "next_stage": missing[0] if missing else None, "stages": stages, "unlisted": unlisted}


def check_engine_files(engine_dir: Path) -> None:
    """The start-up check of chat and serve: every needed stage there (else the stage to run next is named),
    and every listed file present with its recorded size (a stat per file, no reading). Raises one
    EngineError naming the first problem."""
    engine_dir = Path(engine_dir)
    if not engine_dir.is_dir() or not any((engine_dir / s).is_dir() for s in ENGINE_STAGES):
        raise EngineError(not_an_engine(engine_dir))
    incomplete = incomplete_engine(engine_dir)
    if incomplete is not None:
        raise EngineError(incomplete)
    report = verify_engine(engine_dir, deep=False)
    if report["ok"]:
        return
    problems = [p for s in report["stages"] for p in s["problems"]]
    more = f" (and {len(problems) - 1} more problem(s))" if len(problems) > 1 else ""
    raise EngineError(f"{engine_dir}: damaged engine directory: {problems[0]}{more}; rebuild it, or run "
                      f"`vlmctl verify {engine_dir}` for every file")
