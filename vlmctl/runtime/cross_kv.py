"""Where a request's image rows sit in its cross-attention KV, and which of them each token attends.

For decoders with cross-attention layers (Llama 3.2 Vision) the family describes, per prompt, which
images each token sees (`models.base.CrossAttention`, transformers' `cross_attention_mask`): a run
of consecutive images (their real tiles' rows), or - before the first image - every row of every
image, padding tiles included. This module orders the request's image rows so that each token's
rows are one contiguous range of its cross KV:

  [visible rows of the images the last prompt token sees] [visible rows of the other images, in
  prompt order] [every image's padding rows]

so a run of images is one range, "every row" is the whole span, and decode tokens (which see what
the last prompt token sees) attend [0, n): the paged decode kernel reads that in place. Reordering
keys does not change attention (up to the summation order of floats). The decoder computes the K/V
in this order once per admission (`TorchDecoder.write_cross_kv`); nothing here touches tensors.
"""

from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..errors import EngineError


@dataclass(frozen=True)
class CrossPlan:
    order: np.ndarray  # int64 [rows]: row of the concatenated image states at each cross-KV position
    lo: np.ndarray  # int64 [prompt tokens]: first cross-KV row a prompt token attends
    hi: np.ndarray  # int64 [prompt tokens]: one past its last
    mlp: np.ndarray  # bool [prompt tokens]: False before the first image (its MLP output is zeroed)
    decode_hi: int  # generated tokens attend [0, decode_hi)
    decode_mlp: bool

    @property
    def rows(self) -> int:
        return len(self.order)

    def rows_for(self, start: int, n: int) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
        """(lo, hi, mlp) of tokens [start, start + n): prompt tokens from the plan, later ones as decode."""
        P = len(self.lo)
        lo = np.zeros(n, np.int64)
        hi = np.full(n, self.decode_hi, np.int64)
        mlp = np.full(n, self.decode_mlp, bool)
        k = max(0, min(n, P - start))
        lo[:k], hi[:k], mlp[:k] = self.lo[start:start + k], self.hi[start:start + k], self.mlp[start:start + k]
        return lo, hi, mlp


def plan(cross) -> CrossPlan:
    """The cross-KV order and per-token ranges of a prompt's `CrossAttention` description."""
    rows = [int(r) for r in cross.image_rows]
    visible = [int(v) for v in cross.visible_rows]
    ti = np.asarray(cross.token_images, dtype=np.int64).reshape(-1, 2)
    n_img = len(rows)
    if n_img == 0 or len(visible) != n_img or any(not 0 < v <= r for v, r in zip(visible, rows)):
        raise EngineError("cross-attention images: visible rows must be within each image's rows")
    if len(ti) == 0 or ti.min() < 0 or ti.max() > n_img or (ti[:, 0] > ti[:, 1]).any():
        raise EngineError("cross-attention token ranges must be image index ranges")
    first = np.concatenate([[0], np.cumsum(rows)]).astype(np.int64)
    a, b = (int(x) for x in ti[-1])
    images = list(range(a, b)) + [i for i in range(n_img) if not a <= i < b]
    at = np.zeros(n_img + 1, np.int64)  # cross-KV start of each image's visible rows (in `images` order)
    pieces, pos = [], 0
    for i in images:
        at[i] = pos
        pieces.append(first[i] + np.arange(visible[i]))
        pos += visible[i]
    for i in range(n_img):  # padding rows: seen only by tokens before the first image
        pieces.append(first[i] + np.arange(visible[i], rows[i]))
    order = np.concatenate(pieces)
    total = len(order)
    some = ti[:, 0] < ti[:, 1]
    lo = np.where(some, at[ti[:, 0]], 0)
    last_of = np.maximum(ti[:, 1] - 1, 0)
    hi = np.where(some, at[last_of] + np.asarray(visible)[last_of], total)
    cum = np.concatenate([[0], np.cumsum(visible)])
    if (hi - lo != np.where(some, cum[ti[:, 1]] - cum[ti[:, 0]], total))[some].any():
        raise EngineError("a token's images are not one run in the cross-attention layout (a token sees images on "
                          "both sides of the last token's)")
    return CrossPlan(order=order, lo=lo, hi=hi, mlp=some, decode_hi=int(hi[-1]), decode_mlp=bool(some[-1]))
