"""The prompt-embedding-table contract between the vision part and the decoder (TensorRT-LLM's
prompt tuning, which the embedded decoder follows too).

A prompt's image placeholders are expanded (by the family) to one placeholder id per feature row;
here each becomes a fake id `vocab_size + k`, k counting the rows of all the request's images in
order, and row k of the request's table holds that feature row. Ids below `vocab_size` are
ordinary tokens. A prompt with videos has a second placeholder id (the family's video token); its
rows are numbered in the same count, in prompt order.
"""

from __future__ import annotations

import numpy as np


def fake_ids(token_ids, placeholder_id, vocab_size: int, rows: int) -> np.ndarray:
    """int64 ids with the `rows` placeholder positions (`placeholder_id`: one id or several)
    numbered vocab_size + 0, 1, ..."""
    ids = np.asarray(token_ids, dtype=np.int64).copy()
    mask = np.isin(ids, np.asarray(placeholder_id, dtype=np.int64).reshape(-1))
    n = int(mask.sum())
    if n != rows:
        from ..errors import EngineError

        raise EngineError(f"prompt has {n} image positions but its images give {rows} rows")
    ids[mask] = vocab_size + np.arange(n)
    return ids


def image_spans(ids: np.ndarray, vocab_size: int, rows_per_image: list[int]) -> list[tuple[int, int]]:
    """(first token index, extent) of each image in ids made by `fake_ids`: the extent runs from the
    image's first row to its last, so it covers the text between an image's rows where a family
    interleaves them (crops with separators); for contiguous rows it is the row count."""
    starts = np.nonzero(ids >= vocab_size)[0]
    spans, k = [], 0
    for rows in rows_per_image:
        spans.append((int(starts[k]), int(starts[k + rows - 1]) - int(starts[k]) + 1) if rows else (0, 0))
        k += rows
    return spans
