"""The interactive `vlmctl chat` as a user meets it: a real process on a pseudo-terminal, where Ctrl-C is
the terminal's interrupt character (the line discipline sends SIGINT), not a simulated exception.
Also the sampling options of one-shot chat and the multi-line reader."""

from __future__ import annotations

import json
import os
import re
import select
import signal
import sys
import time

import pytest

from conftest import cli, cli_json

from vlmctl.repl import read_message


def lines(*items):
    it = iter(items)

    def read(prompt):
        try:
            return next(it)
        except StopIteration:
            raise EOFError from None

    return read


def test_multi_line_input():
    assert read_message(lines("hello"), "> ", "... ") == "hello"
    assert read_message(lines("one \\", "two\\", "three"), "> ", "... ") == "one \ntwo\nthree"
    assert read_message(lines('"""first', "", "second", 'third"""'), "> ", "... ") == "first\n\nsecond\nthird"
    assert read_message(lines('"""', "a", '"""'), "> ", "... ") == "a"
    assert read_message(lines('"""inline"""'), "> ", "... ") == "inline"
    with pytest.raises(EOFError):
        read_message(lines('"""', "never closed"), "> ", "... ")


class Pty:
    """`vlmctl ARGS` with a pseudo-terminal as its controlling terminal (stdin, stdout and stderr)."""

    def __init__(self, args, cwd, sigint=signal.SIG_DFL):
        import pty

        # PYTHONFAULTHANDLER: on SIGABRT the child prints every thread's stack (see wait)
        env = {**os.environ, "HF_HUB_OFFLINE": "1", "TOKENIZERS_PARALLELISM": "false", "TERM": "dumb",
               "NO_COLOR": "1", "COLUMNS": "200", "PYTHONFAULTHANDLER": "1"}
        self.pid, self.fd = pty.fork()
        if self.pid == 0:  # the child: a new session whose controlling terminal is the pty
            # as a terminal's shell starts programs: SIGINT at its default, whatever this test run
            # inherited (started in the background, `make test &`, it has SIGINT ignored)
            signal.signal(signal.SIGINT, sigint)
            os.chdir(cwd)
            os.execve(sys.executable, [sys.executable, "-m", "vlmctl", *map(str, args)], env)
        self.buf, self.pos = "", 0

    def expect(self, pattern: str, timeout: float = 120) -> re.Match:
        rx = re.compile(pattern)
        deadline = time.monotonic() + timeout
        while True:
            m = rx.search(self.buf, self.pos)
            if m:
                self.pos = m.end()
                return m
            left = deadline - time.monotonic()
            assert left > 0, f"no {pattern!r} in: {self.buf[self.pos:][-3000:]!r}"
            r, _, _ = select.select([self.fd], [], [], min(left, 1.0))
            if r:
                try:
                    data = os.read(self.fd, 65536)
                except OSError:  # the child closed the terminal
                    data = b""
                if not data:
                    assert rx.search(self.buf, self.pos), f"process ended without {pattern!r}: {self.buf[-3000:]!r}"
                self.buf += data.decode(errors="replace")

    def send(self, text: str) -> None:
        os.write(self.fd, text.encode())

    def wait(self, timeout: float = 60) -> int:
        deadline = time.monotonic() + timeout
        while time.monotonic() < deadline:
            try:  # keep draining, so the child never blocks on a full terminal
                if select.select([self.fd], [], [], 0.05)[0]:
                    self.buf += os.read(self.fd, 65536).decode(errors="replace")
            except OSError:
                pass
            pid, status = os.waitpid(self.pid, os.WNOHANG)
            if pid:
                return os.waitstatus_to_exitcode(status)
        # still running: have it print where each thread is (faulthandler), then end it
        os.kill(self.pid, signal.SIGABRT)
        stop = time.monotonic() + 5
        while time.monotonic() < stop and not os.waitpid(self.pid, os.WNOHANG)[0]:
            try:
                if select.select([self.fd], [], [], 0.1)[0]:
                    self.buf += os.read(self.fd, 65536).decode(errors="replace")
            except OSError:
                break
        try:
            os.kill(self.pid, 9)
        except ProcessLookupError:
            pass
        raise AssertionError(f"chat did not exit: {self.buf[-8000:]!r}")

    def close(self):
        try:
            os.kill(self.pid, 9)
            os.waitpid(self.pid, 0)
        except (ProcessLookupError, ChildProcessError):
            pass
        os.close(self.fd)


PROMPT = r"you> "


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pseudo-terminals")
def test_ctrl_c_stops_the_answer_then_quits_at_the_prompt(tiny_llava_engine, tmp_path):
    from vlmctl.repl import user_message
    from vlmctl.runtime.engine import Engine

    # greedy JSON mode: this random model fills the object with whitespace up to max_tokens (the grammar
    # allows no EOS before the object closes), so an answer runs long enough to be interrupted
    p = Pty(["chat", tiny_llava_engine, "--json-object", "--max-tokens", "256", "--temperature", "0"], tmp_path)
    try:
        p.expect(PROMPT)
        p.send("/system You are terse.\n")
        p.expect("system message set")
        p.expect(PROMPT)
        p.send("one \\\n")
        p.expect(r"\.\.\.> ")  # the line goes on: nothing was asked yet
        assert "assistant>" not in p.buf
        p.send("two\n")
        p.expect("assistant> ")
        p.expect(r"\{")  # the answer has begun
        p.send("\x03")
        m = p.expect(r"\[stopped \(Ctrl-C\): (\d+) prompt tokens, (\d+) completion tokens, abort\]")
        p.expect(PROMPT)
        prompt_tokens, completion_tokens = int(m.group(1)), int(m.group(2))
        assert 0 < completion_tokens < 256
        eng = Engine(tiny_llava_engine)
        want = eng.encode([{"role": "system", "content": "You are terse."}, user_message("one \ntwo", 0)], [])
        assert prompt_tokens == len(want.token_ids)  # the system message and both lines were sent

        p.send('"""\n')
        p.expect(r"\.\.\.> ")
        p.send("three\n")
        p.send('four"""\n')
        p.expect("assistant> ")
        # the answer may run to max_tokens or close its object early (its history holds the cut first answer)
        p.expect(r"\[\d+ prompt tokens, \d+ completion tokens, (stop|length)\]")
        p.expect(PROMPT)
        p.send("\x03")  # at the prompt: leave
        assert p.wait() == 130
    finally:
        p.close()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX pseudo-terminals")
def test_ctrl_c_quits_at_the_prompt_even_when_started_with_sigint_ignored(tiny_llava_engine, tmp_path):
    p = Pty(["chat", tiny_llava_engine], tmp_path, sigint=signal.SIG_IGN)
    try:
        p.expect(PROMPT)
        p.send("\x03")
        assert p.wait() == 130
    finally:
        p.close()


def test_ctrl_d_at_the_prompt_leaves_normally(tiny_llava_engine, tmp_path):
    p = Pty(["chat", tiny_llava_engine], tmp_path)
    try:
        p.expect(PROMPT)
        p.send("\x04")
        assert p.wait() == 0
    finally:
        p.close()


def test_one_shot_sampling_options(tiny_llava_engine, tmp_path, capsys):
    schema = {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]}}, "required": ["c"],
              "additionalProperties": False}
    (tmp_path / "s.json").write_text(json.dumps({"name": "color", "schema": schema, "strict": True}))
    args = ["chat", tiny_llava_engine, "-p", "hello world", "--max-tokens", "120", "--json"]
    plain = cli_json(*args, "--temperature", "0", capsys=capsys)
    pen = cli_json(*args, "--temperature", "0", "--repetition-penalty", "1.8", "--frequency-penalty", "1",
                   capsys=capsys)
    assert pen["token_ids"] != plain["token_ids"]
    assert cli_json(*args, "--temperature", "1.5", "--min-p", "1", "--seed", "3", capsys=capsys)["token_ids"] == \
        plain["token_ids"]
    # the JSON schema file: whitespace tokens would run to max_tokens with this random model, so the
    # answer is read as JSON only when it finished; its text is a prefix of a valid document either way
    got = cli_json(*args, "--temperature", "0.8", "--seed", "1", "--json-schema", tmp_path / "s.json",
                   capsys=capsys)
    if got["finish_reason"] == "stop":
        assert json.loads(got["text"])["c"] in ("red", "green", "blue")
    assert got["text"].startswith("{")


# README's exit codes: 2 for a command line that cannot be used (a value out of range, options that exclude each
# other), 5 for an input (here a schema file) that cannot be
@pytest.mark.parametrize("args, fragment, exit_code", [
    (["--json-object", "--json-schema", "s.json"], "give one of them", 2),
    (["--json-schema", "missing.json"], "cannot read", 5),
    (["--json-schema", "bad.json"], "not a JSON file", 5),
    (["--json-schema", "refused.json"], "cannot be used", 5),
    (["--presence-penalty", "3"], "--presence-penalty must be between -2 and 2", 2),
    (["--min-p", "1.5"], "--min-p", 2),
    (["--temperature", "-1"], "--temperature", 2),
    (["--top-p", "0"], "--top-p", 2),
    (["--top-k", "-3"], "--top-k", 2),
    (["--repetition-penalty", "0"], "--repetition-penalty", 2),
    (["--kv-cache-tokens", "1"], "--kv-cache-tokens", 2),
    (["--vision-backend", "bogus"], "--vision-backend", 2),
    (["--json-object", "--json"], None, 0),
])
def test_bad_sampling_options_are_one_line_errors(tiny_llava_engine, tmp_path, capsys, monkeypatch, args, fragment,
                                                  exit_code):
    monkeypatch.chdir(tmp_path)
    (tmp_path / "s.json").write_text('{"type": "object"}')
    (tmp_path / "bad.json").write_text("{not json")
    (tmp_path / "refused.json").write_text('{"type": "string", "pattern": "(["}')
    code, _, err = cli("chat", tiny_llava_engine, "-p", "hi", "--max-tokens", "4", *args, capsys=capsys, expect=None)
    if fragment is None:  # the control: the same command with usable options
        assert code == 0, err
        return
    assert code == exit_code and fragment in err and err.strip().startswith("error:"), (code, err)
    assert len(err.strip().splitlines()) == 1


def test_json_without_a_prompt_is_a_command_line_error(tiny_llava_engine, capsys):
    code, _, err = cli("chat", tiny_llava_engine, "--json", capsys=capsys, expect=None)
    assert code == 2 and "--json needs --prompt" in err
