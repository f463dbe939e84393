"""Reading a local file named by an untrusted caller (a request's file:// URL, `vlmctl chat --image/--video`):
only a regular file, never blocking on a named pipe, a device or a /proc file, and never more than a cap.

Not here: which paths are allowed (serve/media.py), decoding what was read (runtime/image_limits.py, video.py).
"""

from __future__ import annotations

import errno
import os
import stat
from pathlib import Path
from typing import Callable

from ..errors import InputError


def _file_kind(mode: int) -> str:
    for test, name in ((stat.S_ISDIR, "a directory"), (stat.S_ISFIFO, "a named pipe (FIFO)"),
                       (stat.S_ISCHR, "a character device"), (stat.S_ISBLK, "a block device"),
                       (stat.S_ISSOCK, "a socket"), (stat.S_ISLNK, "a symbolic link")):
        if test(mode):
            return name
    return "a special file"


def read_regular_file(path: str | Path, shown: str, max_bytes: int, too_big: Callable[[int | None], Exception],
                      follow_symlinks: bool = True, inside: Path | None = None) -> bytes:
    """The bytes of the regular file at `path`, at most `max_bytes`, for untrusted paths.

    Opened without blocking (O_NONBLOCK: a named pipe, a device or a /proc file like kmsg never stalls
    the reader) and judged on the open descriptor (fstat), so a path swapped for a FIFO or a device
    between a check and the read cannot be read; the read stops one byte past the cap whatever the size
    the file system reports (0 for /proc files, a file that grows). `follow_symlinks=False` refuses a
    symlink as the last component (O_NOFOLLOW); `inside`: the descriptor's real path must be under it
    (Linux, via /proc/self/fd), so a directory swapped for a symlink after the caller resolved the path
    is refused too. `too_big(size)` makes the over-the-cap error (size None: found while reading).
    Every failure is an InputError naming `shown`, never the resolved path."""
    flags = os.O_RDONLY | getattr(os, "O_NONBLOCK", 0) | getattr(os, "O_NOCTTY", 0) | getattr(os, "O_CLOEXEC", 0)
    if not follow_symlinks:
        flags |= getattr(os, "O_NOFOLLOW", 0)
    try:
        fd = os.open(path, flags)
    except (FileNotFoundError, NotADirectoryError):
        raise InputError(f"{shown}: no such file") from None
    except PermissionError:
        raise InputError(f"{shown}: permission denied") from None
    except OSError as e:
        if not follow_symlinks and e.errno == errno.ELOOP:
            raise InputError(f"{shown} is a symbolic link (changed while it was read)") from None
        raise InputError(f"{shown} cannot be opened ({e.strerror or type(e).__name__})") from None
    try:
        st = os.fstat(fd)
        if not stat.S_ISREG(st.st_mode):
            raise InputError(f"{shown} is {_file_kind(st.st_mode)}, not a regular file")
        if inside is not None and os.path.isdir("/proc/self/fd"):
            try:
                real = Path(os.readlink(f"/proc/self/fd/{fd}"))
            except OSError:
                real = None
            if real is not None and not real.is_relative_to(inside):
                raise InputError(f"{shown} resolves outside the allowed local media path (changed while it was read)")
        if st.st_size > max_bytes:
            raise too_big(st.st_size)
        chunks, n = [], 0
        while True:
            try:
                chunk = os.read(fd, min(1 << 20, max_bytes + 1 - n))
            except BlockingIOError:
                raise InputError(f"{shown} cannot be read without waiting (not an ordinary file)") from None
            except OSError as e:
                raise InputError(f"{shown} cannot be read ({e.strerror or type(e).__name__})") from None
            if not chunk:
                return b"".join(chunks)
            chunks.append(chunk)
            n += len(chunk)
            if n > max_bytes:
                raise too_big(None)
    finally:
        os.close(fd)
