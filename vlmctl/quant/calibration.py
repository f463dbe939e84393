"""Calibration and evaluation text: reading `.txt` / `.jsonl` files or a `datasets` name into token blocks.

Calibration blocks are built the way AutoAWQ builds them, so both quantizers can be fed the same
tokens: records (non-empty lines of a `.txt`, the `text` field of each `.jsonl` object, or rows of
a dataset) are shuffled with a fixed seed, each is tokenized on its own, records longer than one
block are skipped (used only when the shorter ones do not fill the blocks asked for), and the rest
are concatenated and cut into blocks of `seq_len` tokens.

Evaluation text is different: the whole file is tokenized as one stream and cut into consecutive
windows (the usual WikiText perplexity protocol), see `load_eval_tokens`.

This module does not know about images: image-text records are handled by `vlm_calibration`
(for VLMs) and rejected here.
"""

from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Iterator

from ..errors import BackendUnavailableError, InputError

DEFAULT_SEED = 42


def _resolve(spec: str, base_dir: Path | None) -> Path:
    p = Path(spec).expanduser()
    if not p.is_absolute() and base_dir is not None:
        p = Path(base_dir) / p
    return p


def _looks_like_file(spec: str) -> bool:
    return spec.endswith((".txt", ".jsonl", ".json")) or spec.startswith((".", "/", "~")) or "\\" in spec


def read_records(spec: str | None, base_dir: Path | None = None, role: str = "calibration") -> list[str]:
    """The text records of a calibration source (see the module docstring). None: the built-in text.
    `role` names the data in error messages ("calibration", "evaluation")."""
    if spec is None:
        from .builtin_text import BUILTIN_CALIBRATION_TEXT

        return [line.strip() for line in BUILTIN_CALIBRATION_TEXT.splitlines() if line.strip()]
    if not spec.strip():  # else "" would resolve to the current directory ("is a directory")
        raise InputError(f"{role} data is an empty name; give a .txt or .jsonl file or a dataset name, "
                         "or leave it out for the built-in text")
    path = _resolve(spec, base_dir)
    if path.exists():
        if path.is_dir():
            raise InputError(f"{spec}: is a directory; expected a .txt or .jsonl file")
        if path.suffix in (".jsonl", ".json"):
            return list(_jsonl_texts(path))
        return _txt_lines(path)
    if _looks_like_file(spec):
        raise InputError(f"{spec}: no such {role} file")
    return _dataset_texts(spec)


def _read_text(path: Path) -> str:
    try:
        return path.read_text(encoding="utf-8")
    except UnicodeDecodeError as e:
        raise InputError(f"{path}: not UTF-8 text ({e.reason} at byte {e.start})") from None
    except OSError as e:
        raise InputError(f"{path}: cannot read ({e.strerror})") from None


def _txt_lines(path: Path) -> list[str]:
    lines = [line.strip() for line in _read_text(path).splitlines()]
    return [line for line in lines if line]


def jsonl_objects(path: Path) -> Iterator[tuple[int, object]]:
    """(line number, parsed value) of each non-blank line of a JSON-lines file; InputError naming the line
    on invalid JSON."""
    for n, line in enumerate(_read_text(path).splitlines(), 1):
        if not line.strip():
            continue
        try:
            yield n, json.loads(line)
        except json.JSONDecodeError as e:
            raise InputError(f"{path}:{n}: invalid JSON ({e.msg})") from None


def _jsonl_texts(path: Path) -> Iterator[str]:
    for n, obj in jsonl_objects(path):
        if isinstance(obj, str):
            text = obj
        elif isinstance(obj, dict):
            if "image" in obj or "images" in obj:
                raise InputError(f"{path}:{n}: image-text calibration records need a VLM (a checkpoint or a "
                                 "workspace, not a language model alone) and --impl vlmctl")
            text = obj.get("text")
            if not isinstance(text, str):
                raise InputError(f"{path}:{n}: expected an object with a string \"text\" field")
        else:
            raise InputError(f"{path}:{n}: expected an object with a \"text\" field or a string")
        if text.strip():
            yield text.strip()


def _dataset_texts(spec: str) -> list[str]:
    """`NAME[:CONFIG][@SPLIT]` through `datasets` (split defaults to train; text column `text`)."""
    try:
        import datasets
    except ImportError:
        raise BackendUnavailableError(
            f"{spec}: not a file, and the `datasets` package (needed for dataset names) is not installed") from None
    name, _, split = spec.partition("@")
    name, _, config = name.partition(":")
    try:
        ds = datasets.load_dataset(name, config or None, split=split or "train")
    except Exception as e:  # datasets raises many types; all mean "cannot get it"
        raise InputError(f"{spec}: cannot load dataset ({str(e).splitlines()[0][:200] if str(e) else type(e).__name__})") from None
    if "text" not in ds.column_names:
        raise InputError(f"{spec}: dataset has no `text` column (columns: {', '.join(ds.column_names)})")
    return [t.strip() for t in ds["text"] if isinstance(t, str) and t.strip()]


def calibration_blocks(records: list[str], tokenizer, samples: int, seq_len: int, seed: int = DEFAULT_SEED,
                       source: str = "calibration data"):
    """LongTensor [n, seq_len] with n <= samples (fewer when the data is short, never zero)."""
    import torch

    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    need = samples * seq_len
    ids: list[int] = []
    long: list[list[int]] = []
    for i in order:
        enc = tokenizer.encode(records[i])
        if not enc:
            continue
        if len(enc) > seq_len:  # AutoAWQ skips records longer than one block
            long.append(enc)
            continue
        ids.extend(enc)
        if len(ids) >= need:
            break
    for enc in long:  # ...unless the short ones are not enough (small data, small vocabularies)
        if len(ids) >= need:
            break
        ids.extend(enc)
    n = min(samples, len(ids) // seq_len)
    if n == 0:
        raise InputError(f"{source}: only {len(ids)} tokens; need at least one block of {seq_len} "
                         "(lower --calib-seq-len or give more text)")
    return torch.tensor(ids[: n * seq_len], dtype=torch.long).view(n, seq_len)


def load_calibration(spec: str | None, tokenizer, samples: int, seq_len: int, base_dir: Path | None = None,
                     seed: int = DEFAULT_SEED):
    """Calibration token blocks [n, seq_len] from a file, a dataset name, or (None) the built-in text."""
    records = read_records(spec, base_dir)
    if not records:
        raise InputError(f"{spec}: no text records")
    return calibration_blocks(records, tokenizer, samples, seq_len, seed, source=spec or "built-in calibration text")


def load_eval_tokens(spec: str, tokenizer, base_dir: Path | None = None):
    """The whole evaluation text as one LongTensor of token ids.

    A `.txt` file is tokenized as it is; `.jsonl` texts (and dataset rows) are joined with blank lines.
    """
    import torch

    path = _resolve(spec, base_dir)
    if path.is_file() and path.suffix not in (".jsonl", ".json"):
        text = _read_text(path)
    else:
        text = "\n\n".join(read_records(spec, base_dir, role="evaluation"))
    ids = tokenizer(text, add_special_tokens=False)["input_ids"]
    if not ids:
        raise InputError(f"{spec}: no text to evaluate")
    return torch.tensor(ids, dtype=torch.long)
