"""Reading and writing safetensors checkpoints: tensor iteration and lazy access by name with clear
errors, sharded writing. What the tensors mean is not here (formats/, models/)."""

from __future__ import annotations

import json
from pathlib import Path
from typing import Iterator

from .errors import CheckpointError

SHARD_BYTES = 4 << 30
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt")
# config.json is what a writer of a new checkpoint rewrites; manifest.json describes a vlmctl stage directory
SIDE_FILE_SKIP = ("config.json", "manifest.json")


def weight_files(ckpt_dir: Path) -> list[Path]:
    ckpt_dir = Path(ckpt_dir)
    index = ckpt_dir / "model.safetensors.index.json"
    if index.exists():
        try:
            data = json.loads(index.read_text(encoding="utf-8"))
        except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
            raise CheckpointError(f"{index}: invalid index (not valid JSON: {_short(e)})") from None
        weight_map = data.get("weight_map") if isinstance(data, dict) else None
        if not isinstance(weight_map, dict) or not all(isinstance(v, str) and v for v in weight_map.values()):
            raise CheckpointError(f"{index}: invalid index (expected an object whose \"weight_map\" maps tensor "
                                  "names to shard file names)")
        names = sorted(set(weight_map.values()))
        files = [ckpt_dir / n for n in names]
        missing = [str(f.name) for f in files if not f.exists()]
        if missing:
            raise CheckpointError(f"{ckpt_dir}: shards listed in the index are missing: {', '.join(missing)}")
        return files
    files = sorted(ckpt_dir.glob("*.safetensors"))
    if not files:
        bins = list(ckpt_dir.glob("*.bin")) + list(ckpt_dir.glob("*.pt"))
        hint = " (found PyTorch .bin files: re-save with safe_serialization=True)" if bins else ""
        raise CheckpointError(f"{ckpt_dir}: no .safetensors weights{hint}")
    return files


def iter_tensors(ckpt_dir: Path) -> Iterator[tuple[str, "object", Path]]:
    """Yield (name, tensor, file) for every tensor, one file open at a time."""
    from safetensors import safe_open

    for f in weight_files(ckpt_dir):
        try:
            handle = safe_open(str(f), framework="pt")
            keys = list(handle.keys())
        except Exception as e:
            raise CheckpointError(f"{f}: not a valid safetensors file ({_short(e)})") from None
        for k in keys:
            try:
                yield k, handle.get_tensor(k), f
            except Exception as e:
                raise CheckpointError(f"{f}: tensor {k!r} cannot be read ({_short(e)})") from None


class TensorReader:
    """Lazy access to the tensors of a safetensors checkpoint directory by name (memory-mapped).

    `release()` closes the files: pages of a memory-mapped file that were read stay resident (and
    count as this process's memory) until the mapping goes, so a reader that walks a large checkpoint
    layer by layer (the AWQ quantizer) releases them as it goes; the next access reopens the file.
    """

    def __init__(self, ckpt_dir: Path):
        self.dir = Path(ckpt_dir)
        self.files: dict[str, Path] = {}
        self._handles: dict[Path, object] = {}
        for f in weight_files(self.dir):
            for k in self._handle(f).keys():
                self.files[k] = f

    def _handle(self, f: Path):
        h = self._handles.get(f)
        if h is None:
            from safetensors import safe_open

            try:
                h = safe_open(str(f), framework="pt")
            except Exception as e:  # also when a file changed or vanished since it was listed
                raise CheckpointError(f"{f}: not a valid safetensors file ({_short(e)})") from None
            self._handles[f] = h
        return h

    def __contains__(self, name: str) -> bool:
        return name in self.files

    def names(self) -> list[str]:
        """Every tensor name, in file order."""
        return list(self.files)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self._handle(self._file(name)).get_slice(name).get_shape())

    def get(self, name: str):
        f = self._file(name)
        try:
            return self._handle(f).get_tensor(name)
        except CheckpointError:
            raise
        except Exception as e:
            raise CheckpointError(f"{f}: tensor {name!r} cannot be read ({_short(e)})") from None

    def _file(self, name: str) -> Path:
        if name not in self.files:
            raise CheckpointError(f"{self.dir}: tensor {name!r} is missing from the checkpoint")
        return self.files[name]

    def release(self) -> None:
        self._handles.clear()


class DictTensorReader(TensorReader):
    """The same access over tensors already in memory (e.g. the decoder part of a whole-VLM checkpoint)."""

    def __init__(self, tensors: dict, where: str = "decoder"):
        self.tensors = tensors
        self.files = {k: Path(where) for k in tensors}
        self._handles = {}
        self.dir = Path(where)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.get(name).shape)

    def get(self, name: str):
        self._file(name)  # the missing-tensor error
        return self.tensors[name]


def read_config_json(ckpt_dir: Path) -> dict:
    """config.json of a checkpoint directory, with one clear error when it is missing, not JSON or not a JSON
    object."""
    path = Path(ckpt_dir) / "config.json"
    if not path.exists():
        raise CheckpointError(f"{ckpt_dir}: no config.json (not a Hugging Face checkpoint directory)")
    if not path.is_file():
        raise CheckpointError(f"{path} is not a file")
    try:
        data = json.loads(path.read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise CheckpointError(f"{path}: not valid JSON ({_short(e)})") from None
    if not isinstance(data, dict):
        raise CheckpointError(f"{path}: not a JSON object (a checkpoint's config is one)")
    return data


def _short(e: Exception) -> str:
    return str(e).splitlines()[0][:200] if str(e) else type(e).__name__


class ShardWriter:
    """Writes tensors into model.safetensors (or numbered shards with an index when large)."""

    def __init__(self, out_dir: Path, max_bytes: int = SHARD_BYTES, metadata: dict | None = None):
        self.out_dir = Path(out_dir)
        self.out_dir.mkdir(parents=True, exist_ok=True)
        self.max_bytes = max_bytes
        self.metadata = {"format": "pt", **(metadata or {})}
        self.pending: dict = {}
        self.pending_bytes = 0
        self.shards: list[dict] = []

    def add(self, name: str, tensor) -> None:
        nbytes = tensor.numel() * tensor.element_size()
        if self.pending and self.pending_bytes + nbytes > self.max_bytes:
            self._flush()
        self.pending[name] = tensor.contiguous()
        self.pending_bytes += nbytes

    def _flush(self) -> None:
        from safetensors.torch import save_file

        path = self.out_dir / f".shard-{len(self.shards):05d}.safetensors"
        save_file(self.pending, str(path), metadata=self.metadata)
        self.shards.append({"path": path, "names": list(self.pending), "bytes": self.pending_bytes})
        self.pending, self.pending_bytes = {}, 0

    def close(self) -> list[Path]:
        if self.pending or not self.shards:
            self._flush()
        if len(self.shards) == 1:
            final = self.out_dir / "model.safetensors"
            self.shards[0]["path"].rename(final)
            return [final]
        n = len(self.shards)
        weight_map, files = {}, []
        for i, s in enumerate(self.shards):
            final = self.out_dir / f"model-{i + 1:05d}-of-{n:05d}.safetensors"
            s["path"].rename(final)
            files.append(final)
            weight_map.update({name: final.name for name in s["names"]})
        index = {"metadata": {"total_size": sum(s["bytes"] for s in self.shards)}, "weight_map": weight_map}
        (self.out_dir / "model.safetensors.index.json").write_text(json.dumps(index, indent=2))
        return files


def copy_side_files(src_dir: Path, out_dir: Path) -> None:
    """Tokenizer, generation config, chat template...: every non-weight file but config.json."""
    import shutil

    for p in Path(src_dir).iterdir():
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and p.name not in SIDE_FILE_SKIP:
            shutil.copy2(p, Path(out_dir) / p.name)


def load_state_dict(ckpt_dir: Path) -> dict:
    return {k: t for k, t, _ in iter_tensors(ckpt_dir)}
