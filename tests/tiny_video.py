"""Synthetic videos made locally with PyAV (nothing is downloaded): random frames, encoded with a
real codec into a real container, so decoding goes through FFmpeg as it would for a user's file."""

from __future__ import annotations

from pathlib import Path

import numpy as np


def frames_of(seed: int, n: int, size=(48, 32)) -> np.ndarray:
    """n random RGB frames of (width, height), smooth enough that a lossy codec keeps them apart."""
    rng = np.random.default_rng(seed)
    w, h = size
    base = rng.integers(0, 256, size=(n, h // 4 + 1, w // 4 + 1, 3)).astype(np.uint8)
    return np.ascontiguousarray(base.repeat(4, 1).repeat(4, 2)[:, :h, :w])


def make_video(path: Path, frames: np.ndarray, fps: int = 4, codec: str = "libx264", fmt: str | None = None,
               pix_fmt: str = "yuv420p", options: dict | None = None, container_options: dict | None = None) -> Path:
    """Encode [n, H, W, 3] uint8 frames into `path` (the container from its suffix unless `fmt`)."""
    import av

    path = Path(path)
    with av.open(str(path), "w", format=fmt, options=container_options or {}) as c:
        s = c.add_stream(codec, rate=fps, options=options or {})
        s.width, s.height, s.pix_fmt = frames.shape[2], frames.shape[1], pix_fmt
        for f in frames:
            for pkt in s.encode(av.VideoFrame.from_ndarray(np.ascontiguousarray(f), format="rgb24")):
                c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return path


def make_lossless(path: Path, frames: np.ndarray, fps: int = 4) -> Path:
    """FFV1 in Matroska: decodes to exactly `frames` (and records no frame count in its header)."""
    return make_video(Path(path).with_suffix(".mkv"), frames, fps, codec="ffv1", pix_fmt="bgr0")


def make_audio_only(path: Path) -> Path:
    import av

    with av.open(str(path), "w", format="wav") as c:
        s = c.add_stream("pcm_s16le", rate=8000)
        frame = av.AudioFrame.from_ndarray(np.zeros((1, 800), np.int16), format="s16", layout="mono")
        frame.sample_rate = 8000
        for pkt in s.encode(frame):
            c.mux(pkt)
        for pkt in s.encode():
            c.mux(pkt)
    return path
