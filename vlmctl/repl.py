"""The interactive `vlmctl chat`: a conversation with one engine in a terminal.

What it is: reading the user's turns (a line; several lines when a line ends with a backslash or
between lines of triple quotes), the commands (`/image PATH`, `/system TEXT`, `/reset`, `/exit`),
streaming each answer as it is generated, and Ctrl-C: during an answer it stops that answer (the
request is aborted in the engine; what was said so far stays in the conversation) and returns to
the prompt; at the prompt it leaves with exit code 130 (the CLI's rule for Ctrl-C). Ctrl-D at the
prompt leaves normally. What it is not: the engine, or the one-shot `--prompt` mode (cli/chat.py).
"""

from __future__ import annotations

import signal
import sys
import threading
from contextlib import contextmanager
from dataclasses import dataclass, field
from typing import Callable

from .errors import RequestError, VlmctlError

HELP = ("Commands: /image PATH (attach to your next message), /system TEXT (set the system message; /system alone "
        "clears it), /reset, /exit. End a line with \\ to continue it, or put lines between \"\"\" lines. Ctrl-C "
        "stops an answer; at the prompt it quits.")
QUOTES = '"""'


def read_message(read: Callable[[str], str], prompt: str, more: str) -> str:
    """One user turn from `read(prompt_text)` (which raises EOFError / KeyboardInterrupt as input()
    does): a line; lines joined while each ends with a backslash; or the lines between a line that
    starts with triple quotes and one that ends with them (the quotes themselves dropped)."""
    line = read(prompt)
    if line.lstrip().startswith(QUOTES):
        body = line.lstrip()[len(QUOTES):]
        if body.rstrip().endswith(QUOTES):
            return body.rstrip()[:-len(QUOTES)]
        lines = [body] if body else []
        while True:
            nxt = read(more)
            if nxt.rstrip().endswith(QUOTES):
                last = nxt.rstrip()[:-len(QUOTES)]
                if last:
                    lines.append(last)
                return "\n".join(lines)
            lines.append(nxt)
    lines = []
    while line.endswith("\\"):
        lines.append(line[:-1])
        line = read(more)
    lines.append(line)
    return "\n".join(lines)


def terminal_reader(console) -> Callable[[str], str]:
    """`read(prompt)` for the REPL. On a terminal it waits for a line in short `select` slices
    instead of one blocking read: Ctrl-C's SIGINT may be delivered to one of the native libraries'
    threads, which would leave a blocked read in the main thread uninterrupted (and the
    KeyboardInterrupt pending) until the next Enter. Between slices Python runs the handler at once.
    The terminal's own line editing (canonical mode) still applies."""
    stdin = sys.stdin
    if not stdin.isatty():
        return lambda prompt: console.input(prompt)
    import select

    def read(prompt: str) -> str:
        console.print(prompt, end="")
        while not select.select([stdin], [], [], 0.1)[0]:
            pass
        line = stdin.readline()
        if not line:
            raise EOFError
        return line[:-1] if line.endswith("\n") else line

    return read


def user_message(text: str, n_images: int, n_videos: int = 0) -> dict:
    return {"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "video"}] * n_videos
            + [{"type": "text", "text": text}]}


@dataclass
class Conversation:
    system: str | None = None
    turns: list[dict] = field(default_factory=list)
    images: list = field(default_factory=list)  # of the turns so far, in order
    videos: list = field(default_factory=list)  # likewise (media.video.Video objects)

    def messages(self, extra: list[dict] = ()) -> list[dict]:
        head = [{"role": "system", "content": self.system}] if self.system else []
        return head + self.turns + list(extra)


def answer(engine, messages: list[dict], images: list, params, write: Callable[[str], None],
           videos: list | None = None):
    """Generate one answer, streaming its text to `write`. Ctrl-C (SIGINT) while it runs aborts the
    request and returns what was generated: (Completion, interrupted). `videos`: in the order of
    the messages' video parts."""
    stop = threading.Event()
    main = threading.current_thread() is threading.main_thread()
    previous = signal.signal(signal.SIGINT, lambda *_: stop.set()) if main else None
    aborted = False
    try:
        req = engine.submit(engine.encode(messages, images, videos=videos), params)
        while not req.finished:
            if stop.is_set() and not aborted:
                engine.abort(req.id)  # the next step takes it out of the batch and frees its KV blocks
                aborted = True
            for ev in engine.step():
                if ev.request is req and ev.text_delta:
                    write(ev.text_delta)
    finally:
        if main:
            signal.signal(signal.SIGINT, previous)
    if req.error is not None:
        raise RequestError(req.error)
    return req.completion(), aborted


@contextmanager
def _ctrl_c_on_terminal():
    """On a terminal, Ctrl-C works as documented even where the process started with SIGINT ignored (a
    job that a non-interactive shell starts in the background inherits that, and exec keeps it): without
    this an answer would still stop (`answer` installs its own handler) but the prompt would not quit."""
    restore = None
    if (sys.stdin.isatty() and threading.current_thread() is threading.main_thread()
            and signal.getsignal(signal.SIGINT) is signal.SIG_IGN):
        restore = signal.signal(signal.SIGINT, signal.default_int_handler)
    try:
        yield
    finally:
        if restore is not None:
            signal.signal(signal.SIGINT, restore)


def run(engine, params, *, system: str | None = None, images: list | None = None, videos: list | None = None,
        console=None, out=None, read: Callable[[str], str] | None = None) -> None:
    """The loop. `console` (stderr) shows prompts and notes, `out` (stdout) the answers. `images`
    and `videos` (--image, --video) go with the first message."""
    with _ctrl_c_on_terminal():
        _loop(engine, params, system, images, videos, console, out, read)


def _loop(engine, params, system, images, videos, console, out, read) -> None:
    from .runtime.engine import load_image

    def write(s: str) -> None:
        sys.stdout.write(s)
        sys.stdout.flush()

    read = read or terminal_reader(console)
    console.print(f"[bold]vlmctl chat[/bold] — {engine.model_name} ({engine.device}). {HELP}")
    conv = Conversation(system=system)
    pending, pending_v = list(images or []), list(videos or [])
    while True:
        try:
            text = read_message(read, "[bold cyan]you>[/bold cyan] ", "[cyan]...>[/cyan] ")
        except EOFError:
            console.print()
            return
        # KeyboardInterrupt at the prompt goes up: the CLI exits with 130
        line = text.strip()
        if not line:
            continue
        if line in ("/exit", "/quit"):
            return
        if line == "/reset":
            conv, pending, pending_v = Conversation(system=conv.system), [], []
            console.print("[dim]conversation reset (the system message stays)[/dim]")
            continue
        if line == "/system" or line.startswith("/system "):
            conv.system = line[len("/system"):].strip() or None
            console.print(f"[dim]system message {'set' if conv.system else 'cleared'}[/dim]")
            continue
        if line == "/image" or line.startswith("/image "):
            path = line[len("/image"):].strip()
            try:
                pending.append(load_image(path))
                console.print(f"[dim]image attached to your next message: {path}[/dim]")
            except VlmctlError as e:
                console.print(f"[red]error:[/red] {e}")
            continue
        if line.startswith("/"):
            console.print(f"[red]unknown command[/red] {line.split()[0]} ({HELP})")
            continue
        msg = user_message(text, len(pending), len(pending_v))
        out.print("[bold green]assistant>[/bold green] ", end="")
        try:
            res, interrupted = answer(engine, conv.messages([msg]), conv.images + pending, params, write,
                                      videos=conv.videos + pending_v)
        except VlmctlError as e:
            console.print(f"\n[red]error:[/red] {e}")
            continue
        out.print()
        note = f"{res.prompt_tokens} prompt tokens, {res.completion_tokens} completion tokens, {res.finish_reason}"
        console.print(f"[dim]\\[{'stopped (Ctrl-C): ' if interrupted else ''}{note}][/dim]")
        conv.turns += [msg, {"role": "assistant", "content": [{"type": "text", "text": res.text}]}]
        conv.images += pending
        conv.videos += pending_v
        pending, pending_v = [], []
