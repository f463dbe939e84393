"""InternVL (HF format) on a tiny random checkpoint: tiling + placeholder expansion, vision ONNX, and
greedy parity of `vlmctl build` + `vlmctl chat --json` with InternVLForConditionalGeneration.generate.

The reference prompt is built without vlmctl: transformers' PIL image processor called with
InternVLProcessor's own image defaults, and InternVLProcessor.replace_image_token for the
placeholder text (the combined processor itself needs torchvision to load).
"""

from __future__ import annotations

import json
from pathlib import Path
from types import SimpleNamespace

import numpy as np
import pytest
import torch

from conftest import cli, cli_json, hf_processor_image_defaults, write_recipe
from family_helpers import (AWQ_PROMPT, assert_awq_checkpoints, awq_build, build_engine, chat_with_images, greedy,
                            user)
from parity import assert_greedy_parity, parity_test, strip_eos
from tiny_models import make_image, make_internvl

MAX_NEW = 12
# (width, height) -> tiles with max_patches=6 and 32-px tiles: 3, 4, 1, 7, 5
SIZES = {"wide": (70, 30), "tall": (30, 90), "small": (20, 20), "grid3x2": (64, 48), "strip": (100, 25)}


# ---- the reference (transformers only) ---------------------------------------------------------
def hf_inputs(ckpt: Path, messages: list[dict], images: list):
    from transformers import AutoImageProcessor, AutoTokenizer
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    tok = AutoTokenizer.from_pretrained(ckpt)
    ip = AutoImageProcessor.from_pretrained(ckpt)
    text = tok.apply_chat_template(messages, chat_template=(ckpt / "chat_template.jinja").read_text(),
                                   add_generation_prompt=True, tokenize=False)
    proc = SimpleNamespace(start_image_token=tok.start_image_token, end_image_token=tok.end_image_token,
                           image_token=tok.context_image_token,
                           image_seq_length=json.loads((ckpt / "processor_config.json").read_text())["image_seq_length"])
    pixel_values = None
    if images:
        processed = ip(images, return_tensors="pt", **hf_processor_image_defaults(InternVLProcessor))
        parts = text.split(proc.image_token)
        assert len(parts) == len(images) + 1
        text = parts[0] + "".join(InternVLProcessor.replace_image_token(proc, processed, i) + rest
                                  for i, rest in enumerate(parts[1:]))
        pixel_values = processed["pixel_values"]
    return tok(text, return_tensors="pt"), pixel_values


def hf_greedy(model, ckpt, messages, images, max_new_tokens=MAX_NEW):
    enc, pv = hf_inputs(ckpt, messages, images)
    return greedy(model, {**enc, **({"pixel_values": pv} if pv is not None else {})}, max_new_tokens)


def load_hf(ckpt):
    from transformers import InternVLForConditionalGeneration

    return InternVLForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def ivl_ckpt(tmp_path_factory):
    return make_internvl(tmp_path_factory.mktemp("ivl") / "ckpt")


@pytest.fixture(scope="module")
def ivl_engine(ivl_ckpt, tmp_path_factory):
    return build_engine(ivl_ckpt, tmp_path_factory.mktemp("ivl-engine"), max_batch_size=3)


@pytest.fixture(scope="module")
def ivl_hf(ivl_ckpt):
    return load_hf(ivl_ckpt)


# ---- prompt + tiling ---------------------------------------------------------------------------
def test_encode_matches_processor_expansion_and_tiling(ivl_engine, ivl_ckpt):
    """Token ids and per-image tiles equal the reference for many aspect ratios; tile counts
    follow transformers' canvas choice (grid + thumbnail)."""
    from transformers import AutoImageProcessor

    from vlmctl.models.registry import get_family

    fam = get_family("internvl")
    proc = fam.load_processor(ivl_engine / "convert" / "processor")
    ip = AutoImageProcessor.from_pretrained(ivl_ckpt)
    cfg = json.loads((ivl_ckpt / "config.json").read_text())
    assert proc.rows_per_tile == 16 and fam.max_image_tokens(cfg) == 13 * 16  # GotOcr2's default 12 tiles + 1
    seen_tiles = set()
    for i, size in enumerate([*SIZES.values(), (33, 32), (200, 10), (10, 200), (95, 65)]):
        img = make_image(i, size)
        msgs = [user(1, "what is in this image?")]
        ref_enc, ref_pv = hf_inputs(ivl_ckpt, msgs, [img])
        got = proc.encode(msgs, [img])
        assert got.token_ids == ref_enc["input_ids"][0].tolist(), size
        item = got.images[0]
        tiles = ip.get_number_of_image_patches(size[1], size[0], {"crop_to_patches": True})
        assert item.inputs["pixel_values"].shape[0] == tiles == item.meta["tiles"]
        assert item.num_tokens == 16 * tiles == got.token_ids.count(got.image_placeholder_id)
        assert proc.num_image_tokens(size) == item.num_tokens
        np.testing.assert_array_equal(item.inputs["pixel_values"], ref_pv.numpy())
        seen_tiles.add(tiles)
    assert {1, 3, 4, 5, 7} <= seen_tiles
    # two images: <img>…</img> blocks in order, each with its own tile count
    imgs = [make_image(20, SIZES["wide"]), make_image(21, SIZES["tall"])]
    got = proc.encode([user(2, "compare")], imgs)
    assert got.token_ids == hf_inputs(ivl_ckpt, [user(2, "compare")], imgs)[0]["input_ids"][0].tolist()
    assert [it.num_tokens for it in got.images] == [3 * 16, 4 * 16]
    with pytest.raises(Exception, match="placeholder"):
        proc.encode([user(1, "x")], imgs)


# ---- vision ONNX -------------------------------------------------------------------------------
def test_onnx_matches_torch_and_hf_at_unseen_tile_counts(ivl_engine, ivl_hf):
    from vlmctl.export.onnx_vision import ort_session
    from vlmctl.models.registry import get_family

    fam = get_family("internvl")
    vision_dir = ivl_engine / "convert" / "vision"
    cfg = json.loads((vision_dir / "config.json").read_text())
    module = fam.build_vision_module(vision_dir, torch.float32)
    sess = ort_session(ivl_engine / "export-vision" / "model.onnx", ["CPUExecutionProvider"])
    manifest = json.loads((ivl_engine / "export-vision" / "manifest.json").read_text())
    assert manifest["info"]["export_batch"] == 2 and manifest["info"]["validate_batch"] == 3
    assert manifest["info"]["max_abs_error"] <= 1e-4
    import onnx

    ops = {n.op_type for n in onnx.load(str(ivl_engine / "export-vision" / "model.onnx")).graph.node}
    assert "Resize" not in ops  # tiles use the position table as is (no traced identity interpolation)
    proc = fam.load_processor(ivl_engine / "convert" / "processor")
    real = torch.from_numpy(proc.preprocess(make_image(5, SIZES["grid3x2"])))  # 7 real tiles
    for pv in (fam.example_vision_inputs(cfg, 1, torch.float32, seed=1)["pixel_values"],
               fam.example_vision_inputs(cfg, 5, torch.float32, seed=5)["pixel_values"], real):
        got = sess.run(None, {"pixel_values": pv.numpy()})[0]
        with torch.no_grad():
            ref = module(pv).numpy()
            hf = fam.hf_image_features(ivl_hf, {"pixel_values": pv}).numpy()
        assert got.shape == ref.shape == hf.shape == (pv.shape[0], 16, 64)
        assert np.max(np.abs(got - ref)) <= 1e-4
        assert np.max(np.abs(hf - ref)) <= 1e-5


@pytest.mark.parametrize("layer,kw", [(-2, {}), (1, {"mean_pooling": False, "qk_norm": True,
                                                      "norm_type": "rms_norm"}), (-1, {"mean_pooling": False})],
                         ids=["layer-2", "layer1-rms-qknorm", "last-with-layernorm"])
def test_vision_wrapper_matches_hf_feature_layers(tmp_path, layer, kw):
    """Feature-layer selection (with the unused layers dropped), final layernorm, qk/rms norms."""
    from vlmctl.convert import convert_checkpoint
    from vlmctl.models.registry import get_family

    ckpt = make_internvl(tmp_path / "ckpt", feature_layer=layer, seed=3, **kw)
    convert_checkpoint(ckpt, tmp_path / "conv", "float32")
    fam = get_family("internvl")
    module = fam.build_vision_module(tmp_path / "conv" / "vision", torch.float32)
    expected_layers = 3 if layer == -1 else (layer if layer >= 0 else 4 + layer)
    assert len(module.vision_tower.encoder.layer) == expected_layers
    pv = torch.randn(3, 3, 32, 32, generator=torch.Generator().manual_seed(0))
    with torch.no_grad():
        ref = fam.hf_image_features(load_hf(ckpt), {"pixel_values": pv})
        assert torch.max(torch.abs(module(pv) - ref)) <= 1e-5


# ---- greedy parity through the CLI -------------------------------------------------------------
@pytest.mark.parametrize("names,prompt", [(["wide"], "what is in this image?"), (["tall"], "describe the picture"),
                                          (["small"], "hello world!"),
                                          (["grid3x2", "strip"], "Tell me a story about a robot.")],
                         ids=["wide-3tiles", "tall-4tiles", "small-1tile", "two-images-7+5tiles"])
@parity_test('internvl')
def test_chat_json_matches_transformers_generate(ivl_engine, ivl_ckpt, ivl_hf, tmp_path, capsys, names, prompt):
    images, args = [], []
    for i, name in enumerate(names):
        img = make_image(30 + i, SIZES[name])
        img.save(tmp_path / f"{name}.png")
        images.append(img)
        args += ["--image", tmp_path / f"{name}.png"]
    got = cli_json("chat", ivl_engine, *args, "--prompt", prompt, "--temperature", "0",
                   "--max-tokens", str(MAX_NEW), "--json", capsys=capsys)
    eos = ivl_hf.generation_config.eos_token_id
    ref = hf_greedy(ivl_hf, ivl_ckpt, [user(len(images), prompt)], images)
    assert_greedy_parity(got["token_ids"], ref, eos)
    assert got["finish_reason"] == ("stop" if eos in ref else "length")


def test_variant_build_multi_turn_and_batch(tmp_path, capsys):
    """Tied embeddings, MQA, 28-px tiles of 7-px patches (4 rows per tile), max_patches 4, final
    layernorm + rms/qk norms: CLI parity with two images, then a batch of multi-turn requests
    with different tile counts decodes like each request alone and like transformers."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    ckpt = make_internvl(tmp_path / "ckpt", seed=7, image_size=28, patch_size=7, max_patches=4, num_kv_heads=1,
                         tie=True, mean_pooling=False, qk_norm=True, norm_type="rms_norm")
    cfg = json.loads((ckpt / "config.json").read_text())
    assert cfg["tie_word_embeddings"] and cfg["text_config"]["tie_word_embeddings"]
    recipe = write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_images_per_request": 2, "max_batch_size": 3})
    cli("build", recipe, "-o", tmp_path / "eng", capsys=capsys)
    hf = load_hf(ckpt)
    eos = hf.generation_config.eos_token_id

    imgs = [make_image(40, (90, 40)), make_image(41, (28, 28))]
    for i, img in enumerate(imgs):
        img.save(tmp_path / f"v{i}.png")
    got = cli_json("chat", tmp_path / "eng", "--image", tmp_path / "v0.png", "--image", tmp_path / "v1.png",
                   "--prompt", "what is in this image?", "--max-tokens", str(MAX_NEW), "--json", capsys=capsys)
    assert got["token_ids"] == strip_eos(hf_greedy(hf, ckpt, [user(2, "what is in this image?")], imgs), eos)

    eng = Engine(tmp_path / "eng")
    convs = [
        ([user(1, "hello"), {"role": "assistant", "content": "a cat"}, user(1, "and this one?")],
         [make_image(50, (20, 60)), make_image(51, (60, 28))]),
        ([user(1, "describe the picture in one sentence.")], [make_image(52, (56, 56))]),
        ([{"role": "system", "content": "numbers 0 1 2"}, user(0, "Tell me a story about a robot.")], []),
    ]
    prompts = [eng.encode(m, i) for m, i in convs]
    assert len({it.inputs["pixel_values"].shape[0] for p in prompts for it in p.images}) >= 2
    p = SamplingParams(max_tokens=8, temperature=0)
    alone = [eng.generate([pr], p)[0].token_ids for pr in prompts]
    together = [c.token_ids for c in eng.generate([eng.encode(m, i) for m, i in convs], p)]
    assert together == alone
    for (msgs, images), toks in zip(convs, together):
        assert toks == strip_eos(hf_greedy(hf, ckpt, msgs, images, 8), eos)


# ---- AWQ ---------------------------------------------------------------------------------------
def test_awq_build_matches_transformers_on_dequantized_weights(tmp_path, capsys):
    """`--set quantization.method=awq`: the decoder is quantized (vision untouched), and greedy
    tokens with two images equal transformers' with the AWQ checkpoint's dequantized weights."""
    from vlmctl.checkpoint import load_state_dict
    from vlmctl.models.base import DECODER
    from vlmctl.models.registry import get_family
    from vlmctl.formats.awq_gemm import dequantize_gemm

    ckpt = make_internvl(tmp_path / "ckpt", seed=11)
    awq_build(ckpt, tmp_path, capsys)
    eng = tmp_path / "eng"
    imgs = [make_image(60, SIZES["wide"]), make_image(61, SIZES["small"])]
    got = chat_with_images(eng, tmp_path, imgs, capsys, MAX_NEW)
    qdir = assert_awq_checkpoints(eng, {"vision_tower", "multi_modal_projector"})
    fam = get_family("internvl")
    tensors = load_state_dict(qdir)
    state = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            base = name[: -len(".qweight")]
            state[fam.join_key(DECODER, base + ".weight")] = dequantize_gemm(
                t, tensors[base + ".qzeros"], tensors[base + ".scales"], 4, 32)
        elif not name.endswith((".qzeros", ".scales")):
            state[fam.join_key(DECODER, name)] = t.float()
    assert sum(n.endswith(".qweight") for n in tensors) == 7 * 2  # q k v o gate up down, 2 layers
    hf = load_hf(ckpt)
    before = hf.model.language_model.layers[0].mlp.down_proj.weight.clone()
    missing, unexpected = hf.load_state_dict(state, strict=False)
    assert not unexpected and all(k.startswith(("model.vision_tower.", "model.multi_modal_projector.")) for k in missing)
    assert not torch.equal(before, hf.model.language_model.layers[0].mlp.down_proj.weight)
    ref = hf_greedy(hf, ckpt, [user(2, AWQ_PROMPT)], imgs)
    assert got["token_ids"] == strip_eos(ref, hf.generation_config.eos_token_id)


def test_tensorrt_profile_counts_tiles(tmp_path):
    """The vision engine's batch axis is tiles: its profile must cover every image at its most tiles,
    and the prompt table every image at its most rows. The expected numbers come from the checkpoint's
    own image processor (transformers' tile counts) and processor_config.json, not from vlmctl."""
    import json

    from transformers import AutoImageProcessor
    from transformers.models.internvl.processing_internvl import InternVLProcessor

    from tiny_models import make_internvl
    from vlmctl.export.tensorrt import vision_profile
    from vlmctl.models.internvl import InternVLFamily

    ckpt = make_internvl(tmp_path / "ck")
    cfg = json.loads((ckpt / "config.json").read_text())
    ip = AutoImageProcessor.from_pretrained(ckpt)
    assert ip.max_patches == 6  # the tiny processor's setting, not GotOcr2's default 12
    sizes = [(w, h) for w in (8, 31, 32, 64, 95, 100, 190, 300) for h in (8, 20, 32, 47, 64, 96, 190, 300)]
    tiles = [int(ip.get_number_of_image_patches(h, w, hf_processor_image_defaults(InternVLProcessor)))
             for w, h in sizes]
    most_tiles = max(tiles)
    rows_per_tile = json.loads((ckpt / "processor_config.json").read_text())["image_seq_length"]
    fam = InternVLFamily()
    prof = vision_profile(fam.vision_axis(cfg, ckpt), max_batch_size=2, max_images_per_request=3)
    (lo, opt, hi) = prof["pixel_values"]
    assert lo == (1, 3, 32, 32) and opt == (most_tiles, 3, 32, 32) and hi == (2 * 3 * most_tiles, 3, 32, 32)
    assert fam.max_image_tokens(cfg, ckpt) == most_tiles * rows_per_tile
    # the fewest rows any image takes: one tile (a small image), what build-llm's max_input_len check leaves room for
    assert fam.min_image_tokens(cfg) == min(tiles) * rows_per_tile == rows_per_tile


def test_max_input_len_without_room_for_one_tile_is_refused(tmp_path, capsys):
    """A tiny InternVL image is one tile of 16 rows at least: a max_input_len of 16 with images allowed is refused
    before any stage runs (the dry run says so too); 17 is planned."""
    ckpt = make_internvl(tmp_path / "ck")
    eng = tmp_path / "eng"
    small = write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_input_len": 16})
    _, _, err = cli("build", small, "-o", eng, "--dry-run", capsys=capsys, expect=2)
    assert "limits.max_input_len 16 leaves no room for text beside one image, which takes 16 prompt rows" in err
    assert not eng.exists()
    ok = write_recipe(tmp_path / "ok.yaml", ckpt, limits={"max_input_len": 17})
    cli_json("build", ok, "-o", eng, "--dry-run", "--json", capsys=capsys)
