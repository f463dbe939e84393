"""Media loading policy (unit level) and several images per request through the server."""

from __future__ import annotations

import asyncio
import base64

import pytest

from conftest import cli, cli_json, write_recipe
from tiny_models import make_image, make_llava


def test_data_url_parsing():
    from vlmctl.errors import InputError
    from vlmctl.serve.media import parse_data_url

    assert parse_data_url("data:image/png;base64," + base64.b64encode(b"abc").decode(), "img") == b"abc"
    assert parse_data_url("data:image/png;base64,YW Jj\n", "img") == b"abc"  # whitespace tolerated
    assert parse_data_url("data:;base64,YWJj", "img") == b"abc"
    for bad, fragment in (("data:image/png;base64,***", "invalid base64"), ("data:image/png;base64", "no ','"),
                          ("data:application/json;base64,e30=", "not an image")):
        with pytest.raises(InputError, match=fragment):
            parse_data_url(bad, "img")


def test_local_files_need_the_allowed_path(tmp_path):
    from vlmctl.errors import InputError
    from vlmctl.serve.media import MediaPolicy, load_image_url

    inside = tmp_path / "ok"
    inside.mkdir()
    make_image(1).save(inside / "a.png")
    make_image(2).save(tmp_path / "secret.png")
    (tmp_path / "ok" / "link.png").symlink_to(tmp_path / "secret.png")
    policy = MediaPolicy(allowed_local_path=inside)
    img = asyncio.run(load_image_url(f"file://{inside / 'a.png'}", policy))
    assert img.size == (40, 30) and img.mode == "RGB"
    for url, fragment in ((f"file://{tmp_path / 'secret.png'}", "outside"),
                          (f"file://{inside / 'link.png'}", "outside"),  # symlinks are resolved
                          (f"file://{inside}/../secret.png", "outside"),
                          (f"file://{inside / 'missing.png'}", "no such file"),
                          (f"file://otherhost{inside / 'a.png'}", "local path")):
        with pytest.raises(InputError, match=fragment):
            asyncio.run(load_image_url(url, policy))
    with pytest.raises(InputError, match="allowed-local-media-path"):
        asyncio.run(load_image_url(f"file://{inside / 'a.png'}", MediaPolicy()))
    with pytest.raises(InputError, match="media cap"):
        asyncio.run(load_image_url(f"file://{inside / 'a.png'}", MediaPolicy(allowed_local_path=inside, max_bytes=10)))


def test_remote_policy_without_network():
    from vlmctl.errors import InputError
    from vlmctl.serve.media import MediaPolicy, load_image_url

    assert MediaPolicy(allowed_domains=["Images.Example.com"]).host_allowed("images.example.com")
    assert not MediaPolicy(allowed_domains=["example.com"]).host_allowed("evil-example.com")
    assert not MediaPolicy(allowed_domains=["example.com"]).host_allowed("sub.example.com")
    with pytest.raises(InputError, match="none"):
        asyncio.run(load_image_url("https://example.com/a.png", MediaPolicy()))
    for url in ("ftp://example.com/a.png", "/etc/passwd", "gopher://x"):
        with pytest.raises(InputError, match="unsupported image URL"):
            asyncio.run(load_image_url(url, MediaPolicy()))


def test_decompression_bomb_is_a_400():
    import io

    from PIL import Image

    from vlmctl.errors import InputError
    from vlmctl.serve.media import decode_image

    buf = io.BytesIO()
    Image.new("L", (100, 100)).save(buf, "PNG")
    old = Image.MAX_IMAGE_PIXELS
    Image.MAX_IMAGE_PIXELS = 1000  # PIL refuses images over twice this many pixels
    try:
        with pytest.raises(InputError, match="too large"):
            decode_image(buf.getvalue(), "image 1")
    finally:
        Image.MAX_IMAGE_PIXELS = old


def test_two_images_in_one_message_match_cli(tmp_path, capsys):
    """An engine built for two images per request: the server's image order and text equal `vlmctl chat`."""
    from openai import OpenAI

    from test_serve import start_uvicorn
    from vlmctl.serve import ServerConfig, load_app

    ckpt = make_llava(tmp_path / "ckpt", seed=3, feature_layer=-3)
    recipe = write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_images_per_request": 2, "max_batch_size": 2})
    cli("build", recipe, "-o", tmp_path / "eng", capsys=capsys)
    paths = []
    for i, size in enumerate([(30, 30), (50, 20)]):
        p = tmp_path / f"img{i}.png"
        make_image(10 + i, size).save(p)
        paths.append(p)
    ref = cli_json("chat", tmp_path / "eng", "--image", paths[0], "--image", paths[1], "--prompt",
                   "Tell me a story about a robot.", "--temperature", "0", "--max-tokens", "10", "--json",
                   capsys=capsys)

    app = load_app(tmp_path / "eng", ServerConfig())
    url, stop = start_uvicorn(app)
    try:
        client = OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=60)
        parts = [{"type": "image_url", "image_url": {"url": "data:image/png;base64,"
                                                            + base64.b64encode(p.read_bytes()).decode()}}
                 for p in paths]
        msgs = [{"role": "user", "content": parts + [{"type": "text", "text": "Tell me a story about a robot."}]}]
        r = client.chat.completions.create(model=app.state.model_name, messages=msgs, max_tokens=10, temperature=0)
        assert r.choices[0].message.content == ref["text"]
        assert r.usage.prompt_tokens == ref["prompt_tokens"]
        assert r.usage.completion_tokens == ref["completion_tokens"]
        three = msgs[0]["content"][:1] * 3 + msgs[0]["content"][2:]
        from openai import BadRequestError

        with pytest.raises(BadRequestError, match="at most 2"):
            client.chat.completions.create(model=app.state.model_name, messages=[{"role": "user", "content": three}],
                                           max_tokens=2)
    finally:
        stop()


@pytest.mark.parametrize("args,fragment", [
    (("--allowed-local-media-path", "/nonexistent-dir"), "not a directory"),
    (("--max-output-len", "100000"), "above the engine's built limit 256"),
    (("--max-body-bytes", "0"), "must be positive"),
])
def test_serve_rejects_bad_options_before_listening(tiny_llava_engine, capsys, args, fragment):
    code, _, err = cli("serve", tiny_llava_engine, *args, capsys=capsys, expect=None)
    assert code != 0 and fragment in err


def test_serve_options_reach_the_app(tiny_llava_engine):
    from vlmctl.serve import ServerConfig, load_app

    app = load_app(tiny_llava_engine, ServerConfig(model_name="served"), max_batch_size=3, max_output_len=32,
                   max_input_len=None)
    eng = app.state.engine
    assert app.state.model_name == "served"
    assert eng.limits["max_batch_size"] == 3 and eng.limits["max_output_len"] == 32
    assert eng.limits["max_input_len"] == 1024
