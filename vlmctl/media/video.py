"""Videos as request inputs: a container's bytes, probed once, decoded into the frames a family samples.

What this module is: the one place that opens video containers (with PyAV, the library the
ecosystem decodes with; the `video` extra, imported only when a video arrives) and the limits that
keep a hostile or huge file to a bounded amount of work. A video is probed when it is loaded
(container, first video stream, frame size, frame rate, frame count), so a bad file fails before
any model work; frames are decoded later, when the family has picked which ones it wants
(`Video.sample`), and only those are kept, each passed through the family's per-frame transform
(its resize) as it is decoded, so memory holds the sampled frames at model size, not the stream.

Frame indices count decoded frames from the start, as transformers' own PyAV reader
(`video_utils.read_video_pyav`) counts them: the frame count and the frame rate come from the
container (`stream.frames`, `stream.average_rate`); where a container has no frame count, or one
the stream does not reach, the frames are counted by decoding and the family's choice is made
again on the true count.

Every failure is one `InputError` (HTTP 400, exit code 5) that says which video and why: not a
container FFmpeg can read, no video stream, no frames, frames larger than `max_side`, more than
`max_stream_frames` frames or `max_duration_s` seconds, a decode that runs past `decode_timeout_s`.
Not here: which frames a model samples and how it resizes them (models/), fetching URLs
(serve/media.py).
"""

from __future__ import annotations

import hashlib
import io
import time
from dataclasses import dataclass, replace
from fractions import Fraction
from pathlib import Path
from typing import Callable

import numpy as np

from ..errors import BackendUnavailableError, InputError, LimitError
from .local_files import read_regular_file

DEFAULT_MAX_FILE_BYTES = 1 << 30  # a local video file read for `vlmctl chat --video`


@dataclass(frozen=True)
class VideoLimits:
    """What one request's videos may cost. Sampling caps (`max_frames`) bound the model's work;
    the others bound decoding, whatever the model would sample."""

    max_videos_per_request: int = 1
    max_frames: int = 64  # frames sampled from one video (a family's fps rule is capped to it)
    max_pixels: int = 64 * 1024 * 1024  # sampled frames x pixels after the family's resize, per request
    max_side: int = 4096  # decoded frame width / height
    max_stream_frames: int = 100_000  # frames in the stream (decoding reads up to the last sampled one)
    max_duration_s: float = 4 * 3600.0
    decode_timeout_s: float = 60.0  # wall-clock for decoding one video's sampled frames

    @classmethod
    def with_overrides(cls, **values) -> "VideoLimits":
        """The defaults with the options a user gave (None keeps a default)."""
        return replace(cls(), **{k: v for k, v in values.items() if v is not None}).validate()

    def validate(self) -> "VideoLimits":
        for name in ("max_frames", "max_pixels", "max_side", "max_stream_frames"):
            if getattr(self, name) < 1:
                raise LimitError(f"video {name} must be at least 1 (got {getattr(self, name)})")
        if self.max_videos_per_request < 0:
            raise LimitError(f"max videos per request must be >= 0 (got {self.max_videos_per_request})")
        if not (self.max_duration_s > 0 and self.decode_timeout_s > 0):
            raise LimitError("video max_duration_s and decode_timeout_s must be positive")
        return self


@dataclass(frozen=True)
class VideoInfo:
    """What the container says about its first video stream."""

    width: int
    height: int
    fps: float | None  # average frame rate; None when the container gives none
    frames: int  # frame count in the header; 0 when the container does not record it
    duration_s: float | None


@dataclass
class SampledVideo:
    """The frames a family asked for, in the order of `indices`, after its per-frame transform."""

    frames: np.ndarray  # [n, H, W, 3] uint8 (or what the transform returns, stacked)
    indices: np.ndarray  # [n] frame numbers in the stream
    total_frames: int  # frames the choice was made on (decoded count where the header had none)
    fps: float | None


def _av():
    try:
        import av
    except ImportError:
        raise BackendUnavailableError("video input needs PyAV: pip install 'vlmctl[video]' (or pip install av)") \
            from None
    return av


def _ffmpeg_errors(av) -> tuple:
    # PyAV raises FFmpegError subclasses for container/codec trouble, and ValueError/OSError for some inputs.
    return (av.error.FFmpegError, ValueError, OSError, EOFError, IndexError)


class Video:
    """An encoded video held as bytes. Construction probes it; `check` applies a request's limits;
    `sample` decodes the frames a family chooses."""

    def __init__(self, data: bytes, what: str = "video"):
        self.data = bytes(data)
        self.what = what
        self.content_hash = hashlib.sha256(self.data).hexdigest()
        self.info = self._probe()

    # ---- probing -----------------------------------------------------------------------------
    def _open(self):
        av = _av()
        try:
            return av.open(io.BytesIO(self.data), mode="r", metadata_errors="replace")
        except _ffmpeg_errors(av) as e:
            raise InputError(f"{self.what}: not a readable video container ({_why(e)})") from None

    def _probe(self) -> VideoInfo:
        if not self.data:
            raise InputError(f"{self.what}: the video is empty (0 bytes)")
        av = _av()
        with self._open() as container:
            try:
                streams = container.streams.video
                if not streams:
                    raise InputError(f"{self.what}: the container has no video stream")
                s = streams[0]
                cc = s.codec_context
                width, height = int(cc.width or 0), int(cc.height or 0)
                rate = s.average_rate or s.guessed_rate
                fps = float(rate) if rate and float(rate) > 0 else None
                frames = max(int(s.frames or 0), 0)
                duration = None
                if s.duration is not None and s.time_base:
                    duration = float(s.duration * Fraction(s.time_base))
                elif container.duration is not None:
                    duration = container.duration / av.time_base
            except _ffmpeg_errors(av) as e:
                raise InputError(f"{self.what}: not a readable video ({_why(e)})") from None
        if width <= 0 or height <= 0:
            raise InputError(f"{self.what}: the video stream has no frame size ({width}x{height})")
        return VideoInfo(width, height, fps, frames, duration if duration is not None and duration >= 0 else None)

    def check(self, limits: VideoLimits) -> None:
        """The limits that the header alone decides (before anything is decoded)."""
        w, h = self.info.width, self.info.height
        if max(w, h) > limits.max_side:
            raise LimitError(f"{self.what}: frames of {w}x{h} pixels; the longest side accepted is {limits.max_side}")
        if self.info.frames > limits.max_stream_frames:
            raise LimitError(f"{self.what}: {self.info.frames} frames; at most {limits.max_stream_frames} are accepted")
        if self.info.duration_s is not None and self.info.duration_s > limits.max_duration_s:
            raise LimitError(f"{self.what}: {self.info.duration_s:.0f} s long; at most {limits.max_duration_s:g} s "
                             "are accepted")

    # ---- decoding ----------------------------------------------------------------------------
    def sample(self, choose: Callable[[int, float | None], np.ndarray], limits: VideoLimits,
               transform: Callable[[int], Callable[[np.ndarray], np.ndarray] | None] | None = None) -> SampledVideo:
        """Decode the frames `choose(total_frames, fps)` picks (ascending frame numbers, repeats
        allowed). `transform(n)` gives the per-frame function for n sampled frames (RGB uint8
        [H, W, 3] in, the family's frame out), called before decoding so it can refuse (limits)."""
        self.check(limits)
        total = self.info.frames or self._count(limits)
        for _ in range(2):
            indices = self._chosen(choose, total, limits)
            fn = transform(len(indices)) if transform is not None else None
            frames, decoded = self._decode(set(indices.tolist()), int(indices[-1]), limits, fn)
            if decoded > int(indices[-1]):
                return SampledVideo(np.stack([frames[i] for i in indices.tolist()]), indices, total, self.info.fps)
            # The header counted frames the stream does not have: choose again on the true count.
            if decoded == 0:
                break
            total = decoded
        raise InputError(f"{self.what}: the video has no decodable frames")

    def _chosen(self, choose, total: int, limits: VideoLimits) -> np.ndarray:
        if total <= 0:
            raise InputError(f"{self.what}: the video has no frames")
        indices = np.asarray(choose(total, self.info.fps), dtype=np.int64).reshape(-1)
        if indices.size == 0:
            raise InputError(f"{self.what}: no frames to sample from a {total}-frame video")
        if indices.size > limits.max_frames:  # the family caps its rule; a larger choice is a bug there
            raise LimitError(f"{self.what}: {indices.size} frames sampled; at most {limits.max_frames} are accepted")
        if indices.min() < 0 or indices.max() >= total or (np.diff(indices) < 0).any():
            raise InputError(f"{self.what}: frame choice {indices.tolist()[:8]} does not fit a {total}-frame video")
        return indices

    def _count(self, limits: VideoLimits) -> int:
        """Frames in the stream, by decoding (containers that record no count)."""
        _, decoded = self._decode(set(), limits.max_stream_frames, limits, None)
        return decoded

    def _decode(self, wanted: set[int], last: int, limits: VideoLimits, fn) -> tuple[dict[int, np.ndarray], int]:
        """(frame number -> frame for the wanted ones, frames decoded), stopping after `last`."""
        av = _av()
        deadline = time.monotonic() + limits.decode_timeout_s
        out: dict[int, np.ndarray] = {}
        n = 0
        w0, h0 = self.info.width, self.info.height
        with self._open() as container:
            try:
                stream = container.streams.video[0]
                stream.thread_type = "AUTO"
                for frame in container.decode(stream):
                    if n >= limits.max_stream_frames:
                        raise LimitError(f"{self.what}: more than {limits.max_stream_frames} frames; at most "
                                         f"{limits.max_stream_frames} are accepted")
                    if time.monotonic() > deadline:
                        raise LimitError(f"{self.what}: decoding took longer than {limits.decode_timeout_s:g} s")
                    if (frame.width, frame.height) != (w0, h0):
                        if max(frame.width, frame.height) > limits.max_side:
                            raise LimitError(f"{self.what}: a frame of {frame.width}x{frame.height} pixels; the "
                                             f"longest side accepted is {limits.max_side}")
                        raise InputError(f"{self.what}: the frame size changes inside the stream ({w0}x{h0} to "
                                         f"{frame.width}x{frame.height})")
                    if n in wanted:
                        rgb = frame.to_ndarray(format="rgb24")
                        out[n] = fn(rgb) if fn is not None else rgb
                    n += 1
                    if n > last:
                        break
            except _ffmpeg_errors(av) as e:
                raise InputError(f"{self.what}: the video cannot be decoded ({_why(e)})") from None
        return out, n


def _why(e: BaseException) -> str:
    first = (str(e).strip().splitlines() or [""])[0][:200]
    return f"{type(e).__name__}: {first}" if first else type(e).__name__


def load_video(path: str | Path, max_bytes: int = DEFAULT_MAX_FILE_BYTES) -> Video:
    """A local video file, probed; a missing, oversized, unreadable or special file (a FIFO, a device,
    a /proc file that would block) is an InputError naming `path`."""
    p = Path(path)
    if not p.exists():
        raise InputError(f"{path}: no such video file")
    if not p.is_file():
        raise InputError(f"{path}: not a file")

    def too_big(size):
        return LimitError(f"{path}: {size} bytes, over the {max_bytes}-byte cap for a video file" if size is not None
                          else f"{path}: over the {max_bytes}-byte cap for a video file")

    return Video(read_regular_file(p, str(path), max_bytes, too_big), what=str(path))
