"""Videos as inputs: decoding (media/video.py), the serve media policy for `video_url`, and one clean
error (CLI exit code 5, HTTP 400) for every hostile or huge file.

Videos are made here with PyAV (tests/tiny_video.py): real codecs in real containers, lossless where
a test compares decoded pixels, cut or stretched where it needs a broken or enormous file.
"""

from __future__ import annotations

import asyncio
import base64
import http.server
import threading

import httpx
import numpy as np
import pytest

from conftest import cli, write_recipe
from tiny_models import make_qwen2_vl
from tiny_video import frames_of, make_audio_only, make_lossless, make_video

pytest.importorskip("av", reason="video input needs PyAV (the `video` extra)")


def video(data: bytes, what="video"):
    from vlmctl.media.video import Video

    return Video(data, what)


def every(step):
    return lambda total, fps: np.arange(0, total, step)


# ---- decoding ------------------------------------------------------------------------------------
def test_lossless_frames_decode_exactly_and_uncounted_containers_are_counted(tmp_path):
    from vlmctl.media.video import VideoLimits

    frames = frames_of(1, 11)
    v = video(make_lossless(tmp_path / "a", frames, fps=5).read_bytes())
    assert (v.info.width, v.info.height, v.info.fps, v.info.frames) == (48, 32, 5.0, 0)  # Matroska: no count
    seen = []
    s = v.sample(lambda total, fps: seen.append((total, fps)) or np.array([0, 3, 3, 10]), VideoLimits())
    assert seen == [(11, 5.0)] and s.total_frames == 11
    assert s.frames.shape == (4, 32, 48, 3) and (s.frames == frames[[0, 3, 3, 10]]).all()
    # The per-frame transform sees every kept frame, and is told the frame count first (to refuse early).
    calls = []
    s = v.sample(every(5), VideoLimits(), lambda n: calls.append(n) or (lambda f: f[::2, ::2]))
    assert calls == [3] and s.frames.shape == (3, 16, 24, 3)


def test_a_header_that_overstates_the_frames_is_sampled_on_the_true_count(tmp_path):
    """An mp4 whose index (moov first) names 40 frames, cut so fewer decode: the family's choice is
    made again on the frames that exist."""
    from vlmctl.media.video import VideoLimits

    data = make_video(tmp_path / "f.mp4", frames_of(2, 40), container_options={"movflags": "faststart"}).read_bytes()
    v = video(data[: len(data) // 2])
    assert v.info.frames == 40
    totals = []
    s = v.sample(lambda total, fps: totals.append(total) or np.arange(0, total, max(1, total // 4)), VideoLimits())
    assert totals[0] == 40 and 0 < totals[-1] < 40 and s.total_frames == totals[-1]
    assert s.indices.max() < totals[-1]


@pytest.mark.parametrize("make,fragment", [
    (lambda p: b"", "empty"),
    (lambda p: b"this is not a video" * 50, "not a readable video container"),
    (lambda p: make_audio_only(p / "a.wav").read_bytes(), "no video stream"),
    (lambda p: (lambda d: d[: d.find(b"mdat") + 4])(
        make_video(p / "z.mp4", frames_of(3, 10), container_options={"movflags": "faststart"}).read_bytes()),
     "no decodable frames"),
    (lambda p: (lambda d: d[: d.find(b"mdat") + 60])(
        make_video(p / "c.mp4", frames_of(3, 10), container_options={"movflags": "faststart"}).read_bytes()),
     "cannot be decoded"),
], ids=["empty", "not-a-container", "audio-only", "zero-frames", "corrupt-frames"])
def test_bad_files_are_one_input_error(tmp_path, make, fragment):
    from vlmctl.errors import InputError
    from vlmctl.media.video import VideoLimits

    with pytest.raises(InputError, match=fragment):
        video(make(tmp_path), "clip.mp4").sample(every(2), VideoLimits())


def test_limits_refuse_huge_and_long_videos_before_or_while_decoding(tmp_path):
    from vlmctl.errors import LimitError
    from vlmctl.media.video import VideoLimits

    wide = video(make_lossless(tmp_path / "wide", np.zeros((2, 8, 4104, 3), np.uint8)).read_bytes())
    with pytest.raises(LimitError, match="4104x8 pixels; the longest side accepted is 4096"):
        wide.check(VideoLimits())  # from the header: nothing decoded
    mp4 = video(make_video(tmp_path / "l.mp4", frames_of(4, 30)).read_bytes())
    with pytest.raises(LimitError, match="30 frames; at most 20"):
        mp4.sample(every(1), VideoLimits(max_stream_frames=20))
    with pytest.raises(LimitError, match=r"\d s long; at most 5 s"):
        mp4.sample(every(1), VideoLimits(max_duration_s=5))
    mkv = video(make_lossless(tmp_path / "l", frames_of(4, 30)).read_bytes())  # no count: found by decoding
    with pytest.raises(LimitError, match="more than 20 frames"):
        mkv.sample(every(1), VideoLimits(max_stream_frames=20))
    with pytest.raises(LimitError, match="decoding took longer than"):
        mp4.sample(every(1), VideoLimits(decode_timeout_s=1e-9))
    with pytest.raises(LimitError, match="30 frames sampled; at most 8"):
        mp4.sample(every(1), VideoLimits(max_frames=8))


def test_load_video_paths(tmp_path):
    from vlmctl.errors import InputError, LimitError
    from vlmctl.media.video import load_video

    with pytest.raises(InputError, match="no such video file"):
        load_video(tmp_path / "missing.mp4")
    with pytest.raises(InputError, match="not a file"):
        load_video(tmp_path)
    path = make_video(tmp_path / "ok.mp4", frames_of(5, 4))
    assert load_video(path).info.frames == 4
    with pytest.raises(LimitError, match="over the 100-byte cap"):
        load_video(path, max_bytes=100)


# ---- the serve media policy ----------------------------------------------------------------------
class _VideoHost(http.server.BaseHTTPRequestHandler):
    body = b""

    def do_GET(self):
        self.send_response(200)
        self.send_header("Content-Type", "video/mp4")
        self.send_header("Content-Length", str(len(self.body)))
        self.end_headers()
        self.wfile.write(self.body)

    def log_message(self, *a):
        pass


def test_video_urls_follow_the_media_policy(tmp_path):
    from vlmctl.errors import InputError
    from vlmctl.serve.media import MediaPolicy, load_video_url

    data = make_video(tmp_path / "ok.mp4", frames_of(6, 8)).read_bytes()
    b64 = base64.b64encode(data).decode()
    policy = MediaPolicy(allowed_local_path=tmp_path)
    assert asyncio.run(load_video_url("data:video/mp4;base64," + b64, policy)).info.frames == 8
    with pytest.raises(InputError, match="media type 'image/png' is not a video"):
        asyncio.run(load_video_url("data:image/png;base64," + b64, policy))
    assert asyncio.run(load_video_url(f"file://{tmp_path}/ok.mp4", policy)).info.frames == 8
    with pytest.raises(InputError, match="outside the allowed local media path"):
        asyncio.run(load_video_url("file:///etc/hostname", policy))
    small = MediaPolicy(allowed_local_path=tmp_path, max_video_bytes=1000)
    with pytest.raises(InputError, match="over the 1000-byte media cap"):
        asyncio.run(load_video_url(f"file://{tmp_path}/ok.mp4", small))
    with pytest.raises(InputError, match="over the 1000-byte video cap"):
        asyncio.run(load_video_url("data:video/mp4;base64," + b64, small))
    with pytest.raises(InputError, match="video: fetching media from 'example.com' is not allowed"):
        asyncio.run(load_video_url("https://example.com/v.mp4", policy))
    # An allowed host, over real HTTP: its private address is refused unless the policy allows it.
    _VideoHost.body = data
    httpd = http.server.ThreadingHTTPServer(("127.0.0.1", 0), _VideoHost)
    threading.Thread(target=httpd.serve_forever, daemon=True).start()
    try:
        url = f"http://localhost:{httpd.server_address[1]}/v.mp4"
        with pytest.raises(InputError, match="loopback, private"):
            asyncio.run(load_video_url(url, MediaPolicy(allowed_domains=["localhost"])))
        ok = MediaPolicy(allowed_domains=["localhost"], allow_private_addresses=True)
        assert asyncio.run(load_video_url(url, ok)).info.frames == 8
        with pytest.raises(InputError, match="over the 1000-byte media cap"):
            asyncio.run(load_video_url(url, MediaPolicy(allowed_domains=["localhost"], allow_private_addresses=True,
                                                        max_video_bytes=1000)))
    finally:
        httpd.shutdown()


# ---- one clean error at the CLI and the server ----------------------------------------------------
@pytest.fixture(scope="module")
def qwen_engine(tmp_path_factory):
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    d = tmp_path_factory.mktemp("video-errors")
    ckpt = make_qwen2_vl(d / "ckpt", version="2", seed=4)
    build(load_recipe(write_recipe(d / "r.yaml", ckpt)), d / "eng")
    return d / "eng"


def test_cli_refuses_bad_videos_with_one_line(qwen_engine, tiny_llava_engine, tmp_path, capsys):
    (tmp_path / "junk.mp4").write_bytes(b"\x00\x01junk" * 100)
    wide = make_lossless(tmp_path / "wide", np.zeros((2, 8, 4104, 3), np.uint8))
    ok = make_video(tmp_path / "ok.mp4", frames_of(7, 8))
    cases = [
        (tmp_path / "nowhere", tmp_path / "missing.mp4", "no such video file"),  # before any engine loads
        (qwen_engine, tmp_path / "junk.mp4", "not a readable video container"),
        (qwen_engine, wide, "the longest side accepted is 4096"),
        (tiny_llava_engine, ok, "the llava family takes no video input"),
    ]
    for eng, path, fragment in cases:
        code, out, err = cli("chat", eng, "--video", path, "--prompt", "hi", "--json", capsys=capsys, expect=None)
        assert code == 5, err
        lines = [ln for ln in err.strip().splitlines() if ln.strip()]
        assert len(lines) == 1 and lines[0].startswith("error: ") and fragment in lines[0], err
        assert "Traceback" not in err and not out.strip()


def test_server_answers_400_for_bad_videos(qwen_engine, tiny_llava_engine, tmp_path):
    from test_serve import start_uvicorn

    from vlmctl.media.video import VideoLimits
    from vlmctl.serve import ServerConfig, load_app

    def url(path):
        return "data:video/mp4;base64," + base64.b64encode(path.read_bytes()).decode()

    def body(*urls):
        return {"messages": [{"role": "user", "content": [{"type": "video_url", "video_url": {"url": u}} for u in urls]
                              + [{"type": "text", "text": "hi"}]}], "max_tokens": 4}

    ok = url(make_video(tmp_path / "ok.mp4", frames_of(8, 8)))
    wide = url(make_lossless(tmp_path / "wide", np.zeros((2, 8, 4104, 3), np.uint8)))
    long = url(make_video(tmp_path / "long.mp4", frames_of(9, 60)))
    qwen_url, stop_q = start_uvicorn(load_app(qwen_engine, ServerConfig(),
                                              video_limits=VideoLimits(max_stream_frames=50)))
    llava_url, stop_l = start_uvicorn(load_app(tiny_llava_engine, ServerConfig()))
    try:
        post = lambda base, b: httpx.post(base + "/v1/chat/completions", json=b, timeout=60)  # noqa: E731
        r = post(qwen_url, body(ok))
        assert r.status_code == 200, r.text
        for b, fragment in [(body(ok, ok), "2 videos in one request; this engine accepts at most 1"),
                            (body(wide), "the longest side accepted is 4096"),
                            (body(long), "60 frames; at most 50 are accepted"),
                            (body("data:video/mp4;base64,AAAA"), "not a readable video container")]:
            r = post(qwen_url, b)
            assert r.status_code == 400 and fragment in r.json()["error"]["message"], r.text
        r = post(llava_url, body(ok))
        assert r.status_code == 400 and "takes no video input" in r.json()["error"]["message"]
        assert httpx.get(qwen_url + "/health", timeout=10).status_code == 200  # the server is still serving
    finally:
        stop_q()
        stop_l()


def test_models_lists_the_video_families(capsys):
    import json

    _, out, _ = cli("models", "--json", capsys=capsys)
    video = {r["family"] for r in json.loads(out) if r["video"]}
    assert video == {"qwen2_vl", "qwen2_5_vl", "llava_onevision"}


def test_serve_refuses_bad_video_options(tiny_llava_engine, capsys):
    code, _, err = cli("serve", tiny_llava_engine, "--max-video-frames", "0", capsys=capsys, expect=None)
    assert code == 2 and "--max-video-frames" in err
