"""Per-image pixel-count limit, checked on the image header before any pixel is decoded (a PNG of
~170 KB can decode to ~180 Mpx, over 1 GB), and `file://` refusals that name the path the client
sent, never a symlink's resolved target. Real PIL images throughout; the only instrument is a spy
that counts PIL's decoding calls (and calls through)."""

from __future__ import annotations

import asyncio
import base64
import io
import signal
import sys
import time
import warnings

import httpx
import pytest
from PIL import Image, ImageFile

from conftest import serve_process
from test_serve import image_message, start_uvicorn
from tiny_models import make_image

BOMB = (16384, 10900)  # the report's image: within the side limit, ~178.6 Mpx


def png(size: tuple[int, int], mode: str = "L") -> bytes:
    """An all-zero PNG: large in pixels, tiny in bytes."""
    buf = io.BytesIO()
    Image.new(mode, size).save(buf, "PNG")
    return buf.getvalue()


def data_url(data: bytes) -> str:
    return "data:image/png;base64," + base64.b64encode(data).decode()


@pytest.fixture(scope="module")
def bomb_png() -> bytes:
    return png(BOMB)


@pytest.fixture()
def decodes(monkeypatch) -> list:
    """Sizes of the images PIL decoded (ImageFile.load, what every file format's pixels go through; it
    is called again, and returns at once, by convert())."""
    seen, real = [], ImageFile.ImageFile.load

    def load(self):
        seen.append(self.size)
        return real(self)

    monkeypatch.setattr(ImageFile.ImageFile, "load", load)
    return seen


def test_image_limits_count_pixels():
    from vlmctl.errors import LimitError
    from vlmctl.runtime.image_limits import DEFAULT_MAX_PIXELS, ImageLimits

    assert DEFAULT_MAX_PIXELS == ImageLimits().max_pixels == 8192 * 8192
    ImageLimits().check((8192, 8192))
    with pytest.raises(LimitError, match=r"8193x8192 is 67,117,056 pixels; at most 67,108,864 pixels"):
        ImageLimits().check((8193, 8192))
    lim = ImageLimits.with_overrides(max_pixels=1_000_000)
    assert lim.max_pixels == 1_000_000 and lim.max_side == ImageLimits().max_side
    lim.check((1000, 1000))
    with pytest.raises(LimitError, match=r"^image 2: 1001x1000 is 1,001,000 pixels; at most 1,000,000 pixels"):
        lim.check((1001, 1000), "image 2")
    with pytest.raises(LimitError, match="max image pixels must be at least 1"):
        ImageLimits.with_overrides(max_pixels=0)


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_the_default_refuses_the_reported_png_from_its_header(bomb_png, decodes):
    """The report's image at the real defaults, through the function the server calls for image URLs:
    refused from the header (no decode), although Pillow alone lets it through with a warning."""
    from vlmctl.errors import LimitError
    from vlmctl.serve.media import MediaPolicy, load_image_url

    assert len(bomb_png) < 200_000
    pixels = BOMB[0] * BOMB[1]
    assert Image.MAX_IMAGE_PIXELS < pixels <= 2 * Image.MAX_IMAGE_PIXELS  # Pillow's warning band: it only warns
    t = time.monotonic()
    with pytest.raises(LimitError) as e:
        asyncio.run(load_image_url(data_url(bomb_png), MediaPolicy(), "image 1"))
    assert e.value.message == "image 1: 16384x10900 is 178,585,600 pixels; at most 67,108,864 pixels are accepted"
    assert decodes == [], "the image was decoded before it was refused"
    assert time.monotonic() - t < 5


def test_a_configured_limit_refuses_before_decoding(tmp_path, decodes):
    """A large-dimension, tiny-on-disk PNG under a lowered limit, as a data: URL and as a file:// URL;
    at the limit exactly it is decoded as before."""
    from vlmctl.errors import LimitError
    from vlmctl.runtime.image_limits import ImageLimits
    from vlmctl.serve.media import MediaPolicy, load_image_url

    (tmp_path / "big.png").write_bytes(png((9000, 8000), mode="1"))
    assert (tmp_path / "big.png").stat().st_size < 20_000
    policy, limits = MediaPolicy(allowed_local_path=tmp_path), ImageLimits(max_pixels=50_000_000)
    for url in (data_url((tmp_path / "big.png").read_bytes()), f"file://{tmp_path / 'big.png'}"):
        with pytest.raises(LimitError, match=r"^image 3: 9000x8000 is 72,000,000 pixels; at most 50,000,000 pixels"):
            asyncio.run(load_image_url(url, policy, "image 3", limits=limits))
    assert decodes == []
    small = ImageLimits(max_pixels=40 * 30)
    img = asyncio.run(load_image_url(data_url(png((40, 30))), MediaPolicy(), limits=small))
    assert img.size == (40, 30) and img.mode == "RGB" and set(decodes) == {(40, 30)}
    with pytest.raises(LimitError, match="41x30 is 1,230 pixels; at most 1,200"):
        asyncio.run(load_image_url(data_url(png((41, 30))), MediaPolicy(), limits=small))
    assert set(decodes) == {(40, 30)}


def test_pillows_bomb_warning_cannot_let_a_larger_image_through(monkeypatch):
    """Between Pillow's MAX_IMAGE_PIXELS and twice that, Pillow only warns: the configured limit still
    refuses from the header; and where warnings are errors the warning is a 400, not a crash."""
    from vlmctl.errors import InputError, LimitError
    from vlmctl.runtime.image_limits import ImageLimits
    from vlmctl.serve.media import decode_image

    monkeypatch.setattr(Image, "MAX_IMAGE_PIXELS", 1000)
    data = png((40, 30))  # 1,200 pixels: in the warning band (1,000 < 1,200 <= 2,000)
    with pytest.warns(Image.DecompressionBombWarning), pytest.raises(LimitError, match="at most 1,100 pixels"):
        decode_image(data, "image 1", ImageLimits(max_pixels=1100))
    with warnings.catch_warnings():
        warnings.simplefilter("error", Image.DecompressionBombWarning)
        with pytest.raises(InputError, match="image 1: image is too large"):
            decode_image(data, "image 1")


def test_file_url_refusals_name_the_sent_path_not_the_target(tmp_path):
    from vlmctl.errors import InputError
    from vlmctl.serve.media import MediaPolicy, load_image_url

    root = tmp_path / "media"
    root.mkdir()
    make_image(1).save(tmp_path / "secret-target.png")
    make_image(2).save(root / "inner-target.png")
    (root / "out.png").symlink_to(tmp_path / "secret-target.png")
    (root / "dangling.png").symlink_to(root / "hidden-name.png")
    (root / "big.png").symlink_to(root / "inner-target.png")
    policy = MediaPolicy(allowed_local_path=root)
    cases = ((policy, "out.png", "resolves outside the allowed local media path", "secret-target"),
             (policy, "dangling.png", "no such file", "hidden-name"),
             (MediaPolicy(allowed_local_path=root, max_bytes=10), "big.png", "media cap", "inner-target"))
    for pol, name, fragment, hidden in cases:
        with pytest.raises(InputError) as e:
            asyncio.run(load_image_url(f"file://{root / name}", pol, "image 1"))
        msg = e.value.message
        assert msg.startswith(f"image 1: {root / name}") and fragment in msg, msg
        assert hidden not in msg, msg


@pytest.mark.filterwarnings("ignore::PIL.Image.DecompressionBombWarning")
def test_the_server_answers_400_with_openais_shape(tiny_llava_engine, tmp_path, bomb_png):
    """The real server, default limits, the official client: the reported PNG and a symlink leading
    out of the media directory are 400s that say why and reveal nothing; an ordinary image is served."""
    from openai import BadRequestError, OpenAI

    from vlmctl.serve import MediaPolicy, ServerConfig, load_app

    make_image(1).save(tmp_path / "secret-target.png")
    media = tmp_path / "media"
    media.mkdir()
    (media / "link.png").symlink_to(tmp_path / "secret-target.png")
    url, stop = start_uvicorn(load_app(tiny_llava_engine, ServerConfig(media=MediaPolicy(allowed_local_path=media))))
    try:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        with pytest.raises(BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=image_message(data_url(bomb_png)), max_tokens=2)
        assert e.value.status_code == 400
        err = e.value.response.json()["error"]
        assert err["message"] == ("image 1: 16384x10900 is 178,585,600 pixels; at most 67,108,864 pixels are "
                                  "accepted")
        assert err["code"] == "limit_exceeded" and err["type"] == "invalid_request_error"
        with pytest.raises(BadRequestError) as e:
            client.chat.completions.create(model="tiny", messages=image_message(f"file://{media / 'link.png'}"),
                                           max_tokens=2)
        msg = e.value.response.json()["error"]["message"]
        assert str(media / "link.png") in msg and "secret-target" not in msg, msg
        ok = client.chat.completions.create(model="tiny", messages=image_message(data_url(png((40, 30)))),
                                            max_tokens=2)
        assert ok.choices[0].finish_reason in ("stop", "length")
    finally:
        stop()


@pytest.mark.skipif(sys.platform == "win32", reason="POSIX signals")
def test_serve_option_max_image_pixels(tiny_llava_engine, tmp_path):
    """`vlmctl serve --max-image-pixels N` applies N on the header check."""
    with serve_process(tiny_llava_engine, tmp_path, "--max-image-pixels", "1200", "--stats-interval", "0",
                       err=open(tmp_path / "serve.err", "w"), env={"PYTHONWARNINGS": "ignore"}) as (proc, url):
        body = {"messages": image_message(data_url(png((41, 30)))), "max_tokens": 2}
        r = httpx.post(url + "/v1/chat/completions", json=body, timeout=120)
        assert r.status_code == 400, r.text
        assert r.json()["error"]["message"] == "image 1: 41x30 is 1,230 pixels; at most 1,200 pixels are accepted"
        body["messages"] = image_message(data_url(png((40, 30))))
        assert httpx.post(url + "/v1/chat/completions", json=body, timeout=120).status_code == 200
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
