"""The Python library API (README's "Python API": load_recipe, build, Engine, encode, generate, chat,
load_image, SamplingParams) used as a user's program would: wrong arguments are one vlmctl error with a
clear message (never a bare TypeError / AttributeError from inside), images are preprocessed as
transformers' processor does, and an engine shared by threads gives each the answer it would alone."""

from __future__ import annotations

import threading
import time

import numpy as np
import pytest
from conftest import write_recipe
from PIL import Image

from vlmctl.errors import InputError, OptionError, RecipeError
from vlmctl.runtime.sampling import SamplingParams

IMAGE_MSGS = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "what is this?"}]}]


@pytest.fixture(scope="module")
def engine(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine

    return Engine(tiny_llava_engine)


@pytest.fixture(scope="module")
def hf_image_processor(tiny_llava):
    from transformers import AutoProcessor

    return AutoProcessor.from_pretrained(tiny_llava).image_processor


def engine_pixels(engine, image) -> np.ndarray:
    return engine.encode(IMAGE_MSGS, [image]).images[0].inputs["pixel_values"]


def hf_pixels(processor, image) -> np.ndarray:
    return processor(images=[image], return_tensors="np")["pixel_values"]


def transparent(mode: str) -> Image.Image:
    """An image whose left half is fully transparent over black (what `convert("RGB")` would show)."""
    rng = np.random.default_rng(1)
    if mode == "RGBA":
        a = rng.integers(0, 256, (30, 40, 4), dtype=np.uint8)
        a[:, :20, :3], a[:, :20, 3], a[:, 20:, 3] = 0, 0, 255
    else:  # LA
        a = rng.integers(0, 256, (30, 40, 2), dtype=np.uint8)
        a[:, :20, 0], a[:, :20, 1], a[:, 20:, 1] = 0, 0, 255
    return Image.fromarray(a, mode)


# ---- images -----------------------------------------------------------------------------------
@pytest.mark.parametrize("mode", ["RGBA", "LA"])
def test_transparent_images_are_preprocessed_as_transformers_does(engine, hf_image_processor, mode):
    """transformers composites transparency onto white before preprocessing; the engine used to drop the
    alpha band (`image.convert("RGB")` in the family), so transparent pixels came out as what they hide
    (here black) and the model saw another picture."""
    img = transparent(mode)
    np.testing.assert_allclose(engine_pixels(engine, img), hf_pixels(hf_image_processor, img), atol=1e-5)


def odd_images() -> dict:
    rng = np.random.default_rng(2)
    idx = rng.integers(0, 4, (30, 40), dtype=np.uint8)
    pal = Image.fromarray(idx, "P")
    pal.putpalette([0, 0, 0, 200, 0, 0, 0, 200, 0, 0, 0, 200] + [0] * 756)
    pal_t = pal.copy()
    pal_t.info["transparency"] = 0
    rgb = Image.fromarray(rng.integers(0, 256, (30, 40, 3), dtype=np.uint8))
    return {"P": pal, "P-transparent": pal_t, "CMYK": rgb.convert("CMYK"),
            "I;16": Image.fromarray(rng.integers(0, 65535, (30, 40), dtype=np.uint16)),
            "1": Image.fromarray(rng.integers(0, 256, (30, 40), dtype=np.uint8)).convert("1"),
            "1x1": Image.new("RGB", (1, 1), (10, 200, 30)), "150x1": rgb.resize((150, 1)),
            "1x150": rgb.resize((1, 150))}


@pytest.mark.parametrize("name", list(odd_images()))
def test_odd_image_modes_and_shapes_match_transformers_pixels(engine, hf_image_processor, name):
    """Regression: palette (with and without a transparent index), CMYK, 16-bit grey, bilevel, 1x1 and very
    elongated images give the engine the pixels transformers' processor makes of them."""
    img = odd_images()[name]
    np.testing.assert_allclose(engine_pixels(engine, img), hf_pixels(hf_image_processor, img), atol=1e-5)


def test_load_image_of_a_transparent_png_matches_transformers(engine, hf_image_processor, tmp_path):
    """load_image (decode_image, also the server's decoder) dropped the alpha band: the engine saw what the
    transparent pixels hide, where transformers composites them onto white."""
    from vlmctl.runtime.engine import load_image

    transparent("RGBA").save(tmp_path / "logo.png")
    np.testing.assert_allclose(engine_pixels(engine, load_image(tmp_path / "logo.png")),
                               hf_pixels(hf_image_processor, Image.open(tmp_path / "logo.png")), atol=1e-5)


def test_images_that_are_not_pil_images_are_input_errors(engine, tmp_path):
    """A numpy array, a path, bytes or None where a PIL image goes was an AttributeError / TypeError
    ('int' object is not subscriptable for an array) from the size check."""
    Image.new("RGB", (8, 8)).save(tmp_path / "x.png")
    for bad in (np.zeros((8, 8, 3), np.uint8), str(tmp_path / "x.png"), tmp_path / "x.png",
                (tmp_path / "x.png").read_bytes(), None):
        with pytest.raises(InputError, match="not a PIL image"):
            engine.encode(IMAGE_MSGS, [bad])
    with pytest.raises(InputError, match="list of PIL images"):
        engine.encode(IMAGE_MSGS, Image.new("RGB", (8, 8)))  # one image, not a list
    with pytest.raises(InputError, match="list of message dicts"):
        engine.encode("what is this?", [])
    with pytest.raises(InputError, match="list of message dicts"):
        engine.encode({"role": "user", "content": "hi"}, [])
    with pytest.raises(InputError, match="must be a string"):
        engine.encode_text(5)
    # images=None is a text-only request, as an empty list is
    text_only = [{"role": "user", "content": "hi"}]
    assert engine.encode(text_only, None).token_ids == engine.encode(text_only, []).token_ids


# ---- SamplingParams ---------------------------------------------------------------------------
def test_a_stop_string_is_one_stop_sequence_not_one_per_character(engine):
    """`stop="ab"` (OpenAI's string form) was taken as the list of its characters: stop at "a" or at "b"."""
    prompt = engine.encode_text("hello world")
    greedy = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0))[0]
    first = next(c for c in greedy.text if c != "\ufffd")
    stop = first + "\x00"  # never generated as a whole; its first character is
    got = engine.generate([prompt], SamplingParams(max_tokens=8, temperature=0, stop=stop))[0]
    assert (got.text, got.finish_reason) == (greedy.text, greedy.finish_reason)
    assert SamplingParams(stop="ab").validate().stop == ["ab"]


@pytest.mark.parametrize("field,value", [("top_k", 1.5), ("top_k", None), ("max_tokens", None), ("max_tokens", 1.5),
                                         ("temperature", None), ("temperature", "0"), ("top_p", None),
                                         ("seed", "x"), ("seed", 2.5), ("stop", None), ("stop", [None]),
                                         ("stop_token_ids", [True]), ("logprobs", 1.5)])
def test_sampling_params_of_the_wrong_type_are_input_errors(field, value):
    """They were TypeErrors from a comparison, silently accepted (max_tokens 1.5 ran 2 tokens; stop_token_ids
    [True] stopped at token 1), or, for top_k 1.5, a request failing inside a later step's sampling."""
    with pytest.raises(InputError, match=field):
        SamplingParams(**{field: value}).validate()


def test_top_k_not_an_integer_fails_at_submit_not_inside_a_step(engine):
    prompt = engine.encode_text("hello")
    with pytest.raises(InputError, match="top_k"):
        engine.submit(prompt, SamplingParams(max_tokens=2, temperature=1.0, top_k=1.5))
    assert not engine.has_work()


def test_seeds_are_64_bit_and_every_bit_counts():
    """Seeds past 64 bits wrapped silently (2**64 drew what 0 draws), and torch's CPU generator keeps only
    a seed's low 32 bits, so 0, 2**32 and -2**63 drew the same tokens on a CPU engine."""
    import torch

    from vlmctl.runtime.sampling import make_generator

    for seed in (2**63, 2**64, -(2**63) - 1):
        with pytest.raises(InputError, match="seed"):
            SamplingParams(seed=seed).validate()
    for seed in (-(2**63), -1, 0, 2**63 - 1):
        SamplingParams(seed=seed).validate()
    draws = {s: tuple(torch.rand(4, generator=make_generator(s, "cpu")).tolist()) for s in (0, 2**32, -(2**63), 1)}
    assert len(set(draws.values())) == 4, draws
    # a seed below 2**32 draws as before
    assert draws[1] == tuple(torch.rand(4, generator=torch.Generator().manual_seed(1)).tolist())


def test_generate_refuses_a_params_list_of_another_length(engine):
    """zip() cut the prompts to the shorter list: 2 prompts with 1 SamplingParams gave 1 completion."""
    prompts = [engine.encode_text("hello"), engine.encode_text("world")]
    with pytest.raises(InputError, match="2 prompts but 1 sampling"):
        engine.generate(prompts, [SamplingParams(max_tokens=2, temperature=0)])


# ---- Engine -----------------------------------------------------------------------------------
def test_keyword_overrides_leave_the_callers_options_alone(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine, EngineOptions

    opts = EngineOptions(max_batch_size=2)
    eng = Engine(tiny_llava_engine, opts, max_batch_size=3)
    assert eng.limits.max_batch_size == 3
    assert opts.max_batch_size == 2  # was 3: Engine wrote the override into the caller's object


@pytest.mark.parametrize("kw", [{"block_size": 0}, {"block_size": -16}, {"max_batch_size": "4"},
                                {"max_batch_size": 2.5}, {"max_num_batched_tokens": -5},
                                {"max_num_batched_tokens": 0}, {"image_limits": {"max_side": 10}},
                                {"vision_batch_size": 0}, {"feature_cache_size": -1}, {"async_scheduling": "no"},
                                {"cuda_graphs": 0}, {"enable_prefix_caching": None}])
def test_bad_engine_options_are_option_errors(tiny_llava_engine, kw):
    """block_size 0 and a string max_batch_size were EngineErrors (exit 8) blaming the engine's files and
    pointing at `vlmctl verify`; a non-positive token budget was silently replaced; a dict of image limits
    was an AttributeError."""
    from vlmctl.runtime.engine import Engine

    with pytest.raises(OptionError) as e:
        Engine(tiny_llava_engine, **kw)
    assert e.value.exit_code == 2 and "verify" not in str(e.value) and len(str(e.value).splitlines()) == 1


def test_submit_leaves_the_callers_sampling_params_alone(engine):
    """A top_k of the whole vocabulary means no filter: submit wrote top_k = 0 into the caller's SamplingParams
    (which may serve other prompts, or be printed). A copy made with replace() keeps a one-string stop whole."""
    params = SamplingParams(max_tokens=2, temperature=0, top_k=10 ** 9)
    engine.generate([engine.encode_text("hello")], params)
    assert params.top_k == 10 ** 9
    assert SamplingParams(stop="ab").replace(seed=1).stop == ["ab"]


def test_engine_shared_by_threads_gives_each_its_own_answer(tiny_llava_engine):
    """Two threads calling generate() on one engine stepped it at once: both scheduled the same chunks, which
    then ran twice (in a stress run, wrong tokens or 'internal error in forward'), and, every time, each
    thread's on_event got the other's events. Steps are now serialized and each generate() holds them until
    its own requests end."""
    from vlmctl.runtime.engine import Engine

    eng = Engine(tiny_llava_engine)
    params = SamplingParams(max_tokens=6, temperature=0)
    prompts = [eng.encode_text(f"hello number {i}") for i in range(3)]
    ref = [c.token_ids for c in eng.generate(prompts, params)]
    run = eng._run

    def slow_run(scheduled):  # widen the window in which another thread could step too
        time.sleep(0.02)
        return run(scheduled)

    eng._run = slow_run
    results, errors, seen = {}, {}, {0: set(), 1: set()}

    def worker(k):
        try:
            out = eng.generate(prompts, params, on_event=lambda ev: seen[k].add(ev.request.id))
            results[k] = [c.token_ids for c in out]
        except Exception as e:  # noqa: BLE001 - reported below
            errors[k] = repr(e)

    threads = [threading.Thread(target=worker, args=(k,)) for k in range(2)]
    for t in threads:
        t.start()
    for t in threads:
        t.join(25)
    assert not any(t.is_alive() for t in threads) and not errors, errors
    assert [results.get(k) for k in range(2)] == [ref, ref]
    assert seen[0].isdisjoint(seen[1]) and len(seen[0]) == len(seen[1]) == 3


# ---- pipeline / recipe ------------------------------------------------------------------------
def test_build_into_a_file_is_an_option_error(tiny_llava, tmp_path):
    """A file at the output path (or above it) was a bare FileExistsError / NotADirectoryError."""
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    recipe = load_recipe(write_recipe(tmp_path / "r.yaml", tiny_llava))
    (tmp_path / "taken").write_text("x")
    for out in (tmp_path / "taken", tmp_path / "taken" / "engine"):
        with pytest.raises(OptionError, match="a file, not a directory"):
            build(recipe, out)
    assert (tmp_path / "taken").read_text() == "x"


def test_one_override_given_as_a_string(tiny_llava, tmp_path):
    """`load_recipe(path, "limits.max_batch_size=4")` read the string character by character
    ("--set 'l': expected dotted.key=value")."""
    from vlmctl.recipe import load_recipe

    path = write_recipe(tmp_path / "r.yaml", tiny_llava)
    assert load_recipe(path, "limits.max_batch_size=4").limits.max_batch_size == 4
    with pytest.raises(RecipeError, match="limits.foo"):
        load_recipe(path, "limits.foo=1")
