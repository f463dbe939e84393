"""Media inputs used as a demanding user and an attacker would: a real uvicorn server on 127.0.0.1
(the tiny LLaVA engine for images, the tiny Qwen2-VL one for videos) driven by the official `openai`
client and raw httpx, a local media host for remote URLs, and `vlmctl chat` for local files. Every bad
input is one 400 whose one-line message names what the client sent, and the server keeps serving.

Local files: only a regular file is read, opened without blocking and judged on the open descriptor,
off the event loop. Before, a named pipe or device swapped in after the path check blocked the event
loop for good (the whole server stopped answering), a file that failed to read (EIO) was a 500, a
directory or FIFO was "no such file", and `file:a.png` was read relative to the server's working
directory. Remote URLs: a redirect refusal now names the URL the client sent, and a body that does not
decode says what Content-Type the host sent."""

from __future__ import annotations

import http.server
import os
import pathlib
import sys
import threading
import time

import httpx
import pytest

from conftest import cli, write_recipe
from test_serve import png_bytes, start_uvicorn
from tiny_models import make_image

PROC_MEM = pathlib.Path("/proc/self/mem")  # a regular file whose read fails with EIO at offset 0


def chat(url: str, kind: str = "image_url") -> dict:
    return {"messages": [{"role": "user", "content": [{"type": kind, kind: {"url": url}},
                                                      {"type": "text", "text": "hi"}]}], "max_tokens": 2}


class _MediaHost(http.server.BaseHTTPRequestHandler):
    protocol_version = "HTTP/1.1"

    def _send(self, code, body=b"", ctype="image/png", headers=()):
        self.send_response(code)
        self.send_header("Content-Type", ctype)
        self.send_header("Content-Length", str(len(body)))
        for k, v in headers:
            self.send_header(k, v)
        self.end_headers()
        self.wfile.write(body)

    def do_GET(self):
        port = self.server.server_address[1]
        redirects = {"/to-evil": "http://evil.example/x.png", "/to-file": "file:///etc/passwd",
                     "/to-metadata": "http://169.254.169.254/latest/meta-data/",
                     "/to-localhost": f"http://localhost:{port}/ok.png"}
        if self.path == "/ok.png":
            self._send(200, png_bytes(3))
        elif self.path in redirects:
            self._send(302, headers=[("Location", redirects[self.path])])
        elif self.path == "/login.html":
            self._send(200, b"<html><body>please log in</body></html>", "text/html; charset=utf-8")
        elif self.path == "/octet":
            self._send(200, b"not an image at all", "application/octet-stream")
        else:
            self._send(404, b"no", "text/plain")

    def log_message(self, *a):
        pass


@pytest.fixture(scope="module")
def media_host():
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _MediaHost)
    httpd.daemon_threads = True
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    yield f"http://127.0.0.1:{httpd.server_address[1]}"
    httpd.shutdown()


@pytest.fixture(scope="module")
def srv(tiny_llava_engine, tmp_path_factory):
    from vlmctl.serve import MediaPolicy, ServerConfig, load_app

    media = tmp_path_factory.mktemp("media")
    make_image(4).save(media / "ok.png")
    (media / "adir").mkdir()
    os.mkfifo(media / "pipe.png")
    (media / "pipe-link.png").symlink_to(media / "pipe.png")
    policy = MediaPolicy(allowed_domains=["127.0.0.1"], allow_private_addresses=True, allowed_local_path=media,
                         timeout_s=2.0)
    url, stop = start_uvicorn(load_app(tiny_llava_engine, ServerConfig(media=policy)))
    yield {"url": url, "media": media}
    stop()


@pytest.fixture()
def client(srv):
    from openai import OpenAI

    return OpenAI(base_url=srv["url"] + "/v1", api_key="none", max_retries=0, timeout=30)


def bad_request(client, url: str, kind: str = "image_url") -> str:
    """The message of the one 400 the server answers for `url`."""
    import openai

    with pytest.raises(openai.BadRequestError) as e:
        client.chat.completions.create(model=client.models.list().data[0].id, **chat(url, kind))
    err = e.value.body if isinstance(e.value.body, dict) and "message" in e.value.body else e.value.body["error"]
    msg = err["message"]
    assert "\n" not in msg and "Traceback" not in msg
    return msg


def assert_serving(srv):
    r = httpx.post(srv["url"] + "/v1/chat/completions", json=chat(f"file://{srv['media']}/ok.png"), timeout=30)
    assert r.status_code == 200, r.text


# ---- local files ---------------------------------------------------------------------------------
@pytest.mark.parametrize("name,fragment", [
    ("adir", "adir is a directory, not a regular file"),
    ("pipe.png", "pipe.png is a named pipe (FIFO), not a regular file"),
    ("pipe-link.png", "pipe-link.png is a named pipe (FIFO), not a regular file"),
])
def test_directories_and_pipes_are_named_for_what_they_are(srv, client, name, fragment):
    t0 = time.monotonic()
    msg = bad_request(client, f"file://{srv['media']}/{name}")
    assert msg.startswith("image 1: ") and fragment in msg, msg
    assert time.monotonic() - t0 < 5
    assert_serving(srv)


def test_a_pipe_swapped_in_after_the_path_check_never_blocks_the_server(srv, client, monkeypatch):
    """The window between a path check and the read, made wide: every path looks like a regular file.
    Reading the FIFO would wait for a writer forever, on the event loop, and stop the whole server."""
    monkeypatch.setattr(pathlib.Path, "is_file", lambda self: True)
    t0 = time.monotonic()
    try:
        r = httpx.post(srv["url"] + "/v1/chat/completions", json=chat(f"file://{srv['media']}/pipe.png"), timeout=8)
    except httpx.ReadTimeout:
        pytest.fail("the server stopped answering: it is reading a named pipe on its event loop")
    assert r.status_code == 400 and "named pipe" in r.json()["error"]["message"], r.text
    assert time.monotonic() - t0 < 5
    monkeypatch.undo()
    assert_serving(srv)


@pytest.mark.skipif(not PROC_MEM.exists(), reason="needs Linux /proc")
def test_a_file_that_fails_to_read_is_a_400_not_a_500(tiny_llava_engine):
    """/proc/self/mem is a regular file whose read fails (EIO); any read error (EACCES, a bad disk) alike."""
    from vlmctl.serve import MediaPolicy, ServerConfig, load_app

    policy = MediaPolicy(allowed_local_path=pathlib.Path("/proc/self"), timeout_s=2.0)
    url, stop = start_uvicorn(load_app(tiny_llava_engine, ServerConfig(media=policy)))
    try:
        r = httpx.post(url + "/v1/chat/completions", json=chat("file:///proc/self/mem"), timeout=30)
        assert r.status_code == 400, r.text
        msg = r.json()["error"]["message"]
        assert msg.startswith("image 1: /proc/self/mem cannot be read (") and "\n" not in msg, msg
        r = httpx.post(url + "/v1/chat/completions", json=chat("file:///proc/self/mem", "video_url"), timeout=30)
        assert r.status_code == 400, r.text  # no video family here: refused before reading
        assert httpx.get(url + "/health", timeout=10).status_code == 200
    finally:
        stop()


@pytest.mark.skipif(os.name != "posix" or os.geteuid() == 0, reason="root reads any file")
def test_an_unreadable_file_is_a_400(srv, client):
    p = srv["media"] / "secret.png"
    p.write_bytes(png_bytes(1))
    p.chmod(0)
    try:
        assert "secret.png: permission denied" in bad_request(client, f"file://{p}")
    finally:
        p.chmod(0o600)


def test_relative_file_urls_are_refused_not_read_from_the_working_directory(srv, client, monkeypatch):
    monkeypatch.chdir(srv["media"])  # the server's working directory is inside the allowed path
    msg = bad_request(client, "file:ok.png")
    assert "file URLs must name an absolute path" in msg and "'ok.png'" in msg, msg
    assert_serving(srv)


def test_files_that_passed_before_still_pass(srv, client):
    for url in (f"file://{srv['media']}/ok.png", f"file://localhost{srv['media']}/ok.png",
                f"file://{srv['media']}/adir/../ok.png"):
        r = client.chat.completions.create(model=client.models.list().data[0].id, **chat(url))
        assert r.choices[0].finish_reason in ("length", "stop")


# ---- remote URLs ---------------------------------------------------------------------------------
@pytest.mark.parametrize("path,fragment", [
    ("/to-evil", "redirected to http://evil.example/x.png: fetching media from 'evil.example' is not allowed"),
    ("/to-metadata", "redirected to http://169.254.169.254/latest/meta-data/: fetching media from "
                     "'169.254.169.254' is not allowed"),
    ("/to-localhost", "fetching media from 'localhost' is not allowed"),
    ("/to-file", "redirected to a 'file' URL"),
])
def test_redirect_refusals_name_the_url_the_client_sent(srv, client, media_host, path, fragment):
    msg = bad_request(client, media_host + path)
    assert msg.startswith(f"image 1: {media_host}{path} ") and fragment in msg, msg


def test_a_non_image_body_says_what_the_host_sent(srv, client, media_host):
    msg = bad_request(client, media_host + "/login.html")
    assert msg == (f"image 1: {media_host}/login.html sent Content-Type 'text/html': the data is not a "
                   "decodable image (UnidentifiedImageError)"), msg
    # a generic binary type keeps the decoder's own message
    assert bad_request(client, media_host + "/octet") == \
        "image 1: the data is not a decodable image (UnidentifiedImageError)"
    assert "returned HTTP 404" in bad_request(client, media_host + "/missing.png")
    r = client.chat.completions.create(model=client.models.list().data[0].id, **chat(media_host + "/ok.png"))
    assert r.choices[0].message.content is not None


# ---- videos --------------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def qwen_srv(tmp_path_factory):
    pytest.importorskip("av", reason="video input needs PyAV (the `video` extra)")
    from tiny_models import make_qwen2_vl
    from tiny_video import frames_of, make_video
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe
    from vlmctl.serve import MediaPolicy, ServerConfig, load_app

    d = tmp_path_factory.mktemp("qwen-media")
    build(load_recipe(write_recipe(d / "r.yaml", make_qwen2_vl(d / "ckpt", version="2", seed=4))), d / "eng")
    media = d / "media"
    media.mkdir()
    make_video(media / "ok.mp4", frames_of(2, 8))
    os.mkfifo(media / "pipe.mp4")
    url, stop = start_uvicorn(load_app(d / "eng", ServerConfig(media=MediaPolicy(allowed_local_path=media,
                                                                                 timeout_s=2.0))))
    yield {"url": url, "media": media}
    stop()


def test_video_urls_refuse_pipes_and_directories(qwen_srv, monkeypatch):
    post = lambda u: httpx.post(qwen_srv["url"] + "/v1/chat/completions", json=chat(u, "video_url"),  # noqa: E731
                                timeout=8)
    media = qwen_srv["media"]
    assert post(f"file://{media}/ok.mp4").status_code == 200
    monkeypatch.setattr(pathlib.Path, "is_file", lambda self: True)  # a pipe swapped in after any path check
    for name, fragment in (("pipe.mp4", "pipe.mp4 is a named pipe (FIFO)"), ("", "is a directory")):
        try:
            r = post(f"file://{media}/{name}")
        except httpx.ReadTimeout:
            pytest.fail("the server stopped answering: it is reading a named pipe on its event loop")
        assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
    monkeypatch.undo()
    assert post(f"file://{media}/ok.mp4").status_code == 200


def test_a_slow_video_decode_does_not_hold_other_requests(qwen_srv, monkeypatch):
    """Videos are decoded on a worker of their own: while one request's video decodes (held here on an event,
    as a long 4K video holds it for seconds), a text request is encoded and answered; then the video request
    completes. Before, both shared the one encode worker, and the text request waited for the decode."""
    from vlmctl.media.video import Video

    started, release = threading.Event(), threading.Event()
    decode = Video.sample

    def held(self, *args, **kwargs):
        started.set()
        release.wait(30)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(Video, "sample", held)
    url = qwen_srv["url"] + "/v1/chat/completions"
    done = {}
    video = threading.Thread(target=lambda: done.update(r=httpx.post(
        url, json=chat(f"file://{qwen_srv['media']}/ok.mp4", "video_url"), timeout=60)))
    video.start()
    try:
        assert started.wait(20), "the video request never reached its decode"
        try:
            r = httpx.post(url, json={"messages": [{"role": "user", "content": "hi"}], "max_tokens": 2}, timeout=10)
        except httpx.ReadTimeout:
            pytest.fail("a text request waited for another request's video decode")
        assert r.status_code == 200, r.text
        assert "r" not in done  # the video request is still decoding
    finally:
        release.set()
        video.join(60)
    assert done["r"].status_code == 200, done["r"].text


def test_a_slow_video_decode_does_not_hold_the_next_video_request(qwen_srv, monkeypatch):
    """Two video requests decode at a time: while the first one's video is held in its decode, a second video
    request is decoded and answered; then the first completes. Before, one video worker served them in turn."""
    from vlmctl.media.video import Video

    started, release = threading.Event(), threading.Event()
    decode = Video.sample
    calls = []

    def first_held(self, *args, **kwargs):
        calls.append(1)
        if len(calls) == 1:
            started.set()
            release.wait(30)
        return decode(self, *args, **kwargs)

    monkeypatch.setattr(Video, "sample", first_held)
    url = qwen_srv["url"] + "/v1/chat/completions"
    body = chat(f"file://{qwen_srv['media']}/ok.mp4", "video_url")
    done = {}
    first = threading.Thread(target=lambda: done.update(r=httpx.post(url, json=body, timeout=60)))
    first.start()
    try:
        assert started.wait(20), "the first video request never reached its decode"
        try:
            r = httpx.post(url, json=body, timeout=15)
        except httpx.ReadTimeout:
            pytest.fail("a video request waited for another request's video decode")
        assert r.status_code == 200, r.text
        assert "r" not in done  # the first is still decoding
    finally:
        release.set()
        first.join(60)
    assert done["r"].status_code == 200, done["r"].text


def test_a_video_request_over_a_cheap_limit_is_refused_before_decoding(qwen_srv, monkeypatch):
    """Text far beyond what fits the prompt is refused by its size before the request's video is decoded."""
    from vlmctl.media.video import Video

    decoded = threading.Event()
    decode = Video.sample
    monkeypatch.setattr(Video, "sample", lambda self, *a, **k: (decoded.set(), decode(self, *a, **k))[1])
    body = chat(f"file://{qwen_srv['media']}/ok.mp4", "video_url")
    body["messages"][0]["content"][1]["text"] = "word " * 1_000_000
    r = httpx.post(qwen_srv["url"] + "/v1/chat/completions", json=body, timeout=30)
    assert r.status_code == 400, r.text
    assert not decoded.is_set()


@pytest.mark.skipif(not PROC_MEM.exists(), reason="needs Linux /proc")
def test_cli_video_that_fails_to_read_is_one_line_exit_5(tmp_path, capsys):
    pytest.importorskip("av", reason="video input needs PyAV (the `video` extra)")
    code, out, err = cli("chat", tmp_path / "no-engine", "--video", PROC_MEM, "--prompt", "hi", "--json",
                         capsys=capsys, expect=None)
    lines = [ln for ln in err.strip().splitlines() if ln.strip()]
    assert code == 5, err
    assert len(lines) == 1 and lines[0].startswith("error: /proc/self/mem cannot be read ("), err


def test_read_regular_file_caps_what_it_reads_whatever_the_size_reported(tmp_path):
    """A file whose reported size is under the cap but whose content is not (it grew after the stat; /proc
    files report 0) is read only to one byte past the cap."""
    from vlmctl.errors import InputError
    from vlmctl.media.local_files import read_regular_file

    p = tmp_path / "f.bin"
    p.write_bytes(b"x" * 100)

    def too_big(size):
        return InputError(f"too big {size}")

    assert read_regular_file(p, "f", 100, too_big) == b"x" * 100
    with pytest.raises(InputError, match="too big 100"):
        read_regular_file(p, "f", 99, too_big)
    if sys.platform.startswith("linux"):
        with pytest.raises(InputError, match="too big None"):  # st_size 0, content longer than 10 bytes
            read_regular_file("/proc/self/maps", "maps", 10, too_big)
