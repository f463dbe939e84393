"""Gemma 3 on tiny random checkpoints: prompt expansion (pan-and-scan too), vision ONNX, the decoder's
variants against transformers, bidirectional image attention (in one chunk, across chunks, after a
prefix-cache hit), greedy parity of `vlmctl build` + `vlmctl chat --json` with transformers'
generate, chunked prefill under a small token budget through the server, AWQ, and which
tie_word_embeddings flag decides.

The reference is transformers alone: Gemma3Processor (it loads without torchvision) with its
`apply_chat_template(tokenize=True)` (token_type_ids included, so image tokens attend to each other
as in the model card's generation path) and Gemma3ForConditionalGeneration.generate.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import cli, cli_json, write_recipe
from family_helpers import (AWQ_PROMPT, assert_awq_checkpoints, awq_build, build_engine, chat_with_images, greedy,
                            text_turn, user, with_images)
from parity import assert_equal_but_near_ties, assert_greedy_parity, parity_test, strip_eos
from tiny_gemma3 import make_gemma3
from tiny_models import make_image

MAX_NEW = 12
WINDOW = 12  # the tiny decoder's sliding window (tiny_gemma3 default): shorter than an image's 16 rows
ROWS = 16  # rows per image (mm_tokens_per_image)
SIZES = {"wide": (40, 30), "tall": (20, 50), "square": (64, 64), "tiny": (5, 7), "strip": (90, 20)}


# ---- the reference (transformers only) ---------------------------------------------------------
def hf_inputs(proc, messages, images):
    return proc.apply_chat_template(with_images(messages, images), add_generation_prompt=True, tokenize=True,
                                    return_dict=True, return_tensors="pt")


def hf_greedy(model, proc, messages, images, max_new_tokens=MAX_NEW):
    enc = hf_inputs(proc, messages, images)
    assert "token_type_ids" in enc
    return greedy(model, enc, max_new_tokens)


def load_hf(ckpt: Path):
    from transformers import Gemma3ForConditionalGeneration

    return Gemma3ForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


def load_proc(ckpt: Path):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(ckpt)
    assert type(proc).__name__ == "Gemma3Processor" and type(proc.image_processor).__name__ == \
        "Gemma3ImageProcessorPil"
    return proc


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint, engine, HF model, HF processor) of the default tiny Gemma 3."""
    ckpt = make_gemma3(tmp_path_factory.mktemp("gemma3") / "ckpt")
    return ckpt, build_engine(ckpt, tmp_path_factory.mktemp("gemma3-engine")), load_hf(ckpt), load_proc(ckpt)


# ---- prompt --------------------------------------------------------------------------------------
def test_encode_matches_processor(model):
    """Token ids (one BOS, `\\n\\n<boi>` + soft tokens + `<eoi>\\n\\n` per image) and pixels equal
    Gemma3Processor's for many sizes, two images, a system message and a multi-turn chat."""
    from vlmctl.models.registry import get_family

    ckpt, engine, _, proc = model
    fam = get_family("gemma3")
    mine = fam.load_processor(engine / "convert" / "processor")
    cases = [([user(1, "what is in this image?")], [make_image(i, s)]) for i, s in enumerate(SIZES.values())]
    cases += [([user(2, "compare")], [make_image(10, SIZES["wide"]), make_image(11, SIZES["tall"])]),
              ([text_turn("system", "numbers 0 1 2"), user(1, "hello")], [make_image(12, (33, 31))]),
              ([user(1, "hello"), text_turn("assistant", "a cat"), user(1, "and this one?")],
               [make_image(13, (20, 60)), make_image(14, (60, 28))]),
              ([user(0, "Tell me a story about a robot.")], [])]
    for msgs, imgs in cases:
        ref = hf_inputs(proc, msgs, imgs)
        got = mine.encode(msgs, imgs)
        assert got.token_ids == ref["input_ids"][0].tolist()
        assert got.token_ids.count(mine.tokenizer.bos_token_id) == 1
        assert [t == got.image_placeholder_id for t in got.token_ids] == ref["token_type_ids"][0].bool().tolist()
        assert [it.num_tokens for it in got.images] == [ROWS] * len(imgs)
        if imgs:
            np.testing.assert_array_equal(np.concatenate([it.inputs["pixel_values"] for it in got.images]),
                                          ref["pixel_values"].numpy())
    with pytest.raises(Exception, match="placeholder"):
        mine.encode([user(1, "x")], [make_image(1), make_image(2)])


def test_pan_and_scan_in_the_config_changes_nothing(tmp_path):
    """A preprocessor_config.json that enables pan-and-scan: Gemma3Processor passes its own settings
    (pan-and-scan off) over it, so a wide image is still one image of 16 rows, here as there."""
    from vlmctl.models.registry import get_family

    ckpt = make_gemma3(tmp_path / "ckpt", pan_and_scan=True, text_layers=2, vision_layers=1)
    assert json.loads((ckpt / "preprocessor_config.json").read_text())["do_pan_and_scan"] is True
    proc = load_proc(ckpt)
    mine = get_family("gemma3").load_processor(ckpt)
    img = make_image(30, (90, 20))
    assert proc.image_processor(images=[img], return_tensors="np")["pixel_values"].shape[0] == 4  # it would crop
    ref = hf_inputs(proc, [user(1, "what is in this image?")], [img])
    got = mine.encode([user(1, "what is in this image?")], [img])
    assert got.token_ids == ref["input_ids"][0].tolist() and got.images[0].num_tokens == ROWS
    np.testing.assert_array_equal(got.images[0].inputs["pixel_values"], ref["pixel_values"].numpy())


# ---- vision ONNX ---------------------------------------------------------------------------------
def test_onnx_matches_torch_and_hf(model):
    from vlmctl.export.onnx_vision import ort_session
    from vlmctl.models.registry import get_family

    ckpt, engine, hf, _ = model
    fam = get_family("gemma3")
    vision_dir = engine / "convert" / "vision"
    cfg = json.loads((vision_dir / "config.json").read_text())
    module = fam.build_vision_module(vision_dir, torch.float32)
    sess = ort_session(engine / "export-vision" / "model.onnx", ["CPUExecutionProvider"])
    info = json.loads((engine / "export-vision" / "manifest.json").read_text())["info"]
    assert info["export_batch"] == 2 and info["validate_batch"] == 3 and info["max_abs_error"] <= 1e-4
    proc = fam.load_processor(engine / "convert" / "processor")
    real = torch.from_numpy(proc.preprocess(make_image(5, SIZES["strip"])))
    for pv in (fam.example_vision_inputs(cfg, 1, torch.float32, seed=1)["pixel_values"],
               fam.example_vision_inputs(cfg, 5, torch.float32, seed=5)["pixel_values"], real):
        got = sess.run(None, {"pixel_values": pv.numpy()})[0]
        with torch.no_grad():
            ref = module(pv).numpy()
            hf_feats = fam.hf_image_features(hf, {"pixel_values": pv}).numpy()
        assert got.shape == ref.shape == hf_feats.shape == (pv.shape[0], ROWS, 64)
        assert np.max(np.abs(got - ref)) <= 1e-4
        assert np.max(np.abs(hf_feats - ref)) <= 1e-5


# ---- the decoder contract -------------------------------------------------------------------------
def test_decoder_spec_carries_gemmas_variants(model):
    _, engine, _, _ = model
    spec = json.loads((engine / "build-llm" / "config.json").read_text())["decoder"]
    assert (spec["norm"], spec["activation"], spec["qk_norm"], spec["sandwich_norms"]) == \
        ("rms_one_plus", "gelu_tanh", True, True)
    assert spec["embed_scale"] == 64 ** 0.5 and spec["attention_scale"] == 24 ** -0.5
    assert spec["layer_types"] == ["sliding", "full", "sliding", "full"] and spec["sliding_window"] == WINDOW
    assert spec["image_attention"] == "bidirectional" and spec["final_logit_softcap"] is None
    assert spec["tie_word_embeddings"] and "lm_head" not in spec["tensor_sources"]
    d = 16
    base = torch.arange(0, d, 2, dtype=torch.float32) / d
    # global layers: theta 10000 with linear scaling 2; sliding layers: rope_local_base_freq 100
    assert torch.allclose(torch.tensor(spec["rope_inv_freq"]), 1.0 / (10000.0 ** base) / 2)
    assert torch.allclose(torch.tensor(spec["rope_local_inv_freq"]), 1.0 / (100.0 ** base))


@pytest.mark.parametrize("softcap", [None, 3.0])
def test_text_decoder_matches_gemma3_for_causal_lm(tmp_path, softcap):
    """The runtime from a Gemma3ForCausalLM checkpoint alone (its config has a final softcap here):
    full-forward logits, chunked prefill over the paged cache and decode rows (eager and the
    decode() path) equal transformers' logits at prompts longer than the window. Turning the window
    off changes them, so the sliding layers are exercised."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from vlmctl.runtime.decoder import Chunk, TorchDecoder

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=120, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                           sliding_window_pattern=2, query_pre_attn_scalar=24, final_logit_softcapping=softcap,
                           max_position_embeddings=256, rope_scaling={"rope_type": "linear", "factor": 2.0},
                           rope_local_base_freq=100.0)
    hf = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3 if p.dim() == 2 else 0.5)
    hf.save_pretrained(tmp_path / "llm")
    dec = TorchDecoder.from_hf_dir(tmp_path / "llm", max_seq=256)
    assert dec.spec.final_logit_softcap == softcap
    ids = torch.randint(0, 120, (2, 30), generator=torch.Generator().manual_seed(1))
    with torch.no_grad():
        ref = hf(ids).logits
    assert torch.allclose(dec.logits(ids), ref, atol=1e-4)
    if softcap is not None:
        assert ref.abs().max() < softcap
    dec.allocate_cache(64, 4)
    seq, bt = ids[0].numpy(), list(range(1, 12))
    out = dec.forward([Chunk(seq[:13], np.arange(13), 0, bt)])
    assert torch.allclose(out[0], ref[0, 12], atol=1e-4)
    out = dec.forward([Chunk(seq[13:25], np.arange(13, 25), 13, bt)])  # a chunk after cached rows
    assert torch.allclose(out[0], ref[0, 24], atol=1e-4)
    for t in range(25, 30):
        assert torch.allclose(dec.forward([Chunk(seq[t:t + 1], np.arange(t, t + 1), t, bt)])[0], ref[0, t], atol=1e-4)
        got = dec.decode(seq[t:t + 1], np.array([t]), np.array([bt[t // 4] * 4 + t % 4]), [bt], np.array([t + 1]))
        assert torch.allclose(got[0], ref[0, t], atol=1e-4)
    for layer in dec.layers:
        layer.window = None
    assert (dec.logits(ids) - ref).abs().max() > 0.1


def _prompt_rows(engine_obj, messages, images):
    """(fake ids [1, T], prompt table, image spans) of a prompt as the engine runs it."""
    from vlmctl.formats.prompt_table import fake_ids, image_spans

    prompt = engine_obj.encode(messages, images)
    engine_obj.vision.encode(prompt.images)
    rows = [it.num_tokens for it in prompt.images]
    ids = fake_ids(prompt.token_ids, prompt.image_placeholder_id, engine_obj.vocab_size, sum(rows))
    table = torch.cat([it.features for it in prompt.images])
    return ids, table, image_spans(ids, engine_obj.vocab_size, rows)


def test_image_rows_attend_to_each_other(model):
    """Prefill logits equal transformers' with token_type_ids (an image's rows see each other) and
    differ from its plain causal logits; over the paged cache, a chunk that starts inside an image
    after its first rows were computed with the whole image in view (a prefix-cache hit) gives the
    same logits, while cutting an image between two chunks would not - what the scheduler prevents."""
    from vlmctl.runtime.decoder import Chunk
    from vlmctl.runtime.engine import Engine

    _, engine, hf, proc = model
    eng = Engine(engine)
    msgs, imgs = [user(2, "describe the picture")], [make_image(20, SIZES["wide"]), make_image(21, SIZES["tall"])]
    ids, table, spans = _prompt_rows(eng, msgs, imgs)
    enc = hf_inputs(proc, msgs, imgs)
    with torch.no_grad():
        ref = hf(**enc).logits[0]
        causal = hf(**{k: v for k, v in enc.items() if k != "token_type_ids"}).logits[0]
    got = eng.decoder.logits(torch.from_numpy(ids)[None], table)[0]
    assert torch.allclose(got, ref, atol=1e-4)
    assert (causal - ref).abs().max() > 0.1  # the bidirectional rows change the answer

    dec = eng.decoder
    T = len(ids)
    bt = list(range(1, 1 + -(-T // dec.block_size)))
    pos = np.arange(T)
    whole = dec.forward([Chunk(ids, pos, 0, bt, table)])[0]
    assert torch.allclose(whole, ref[-1], atol=1e-4)
    first, rows = spans[1]
    mid = first + rows // 2
    again = dec.forward([Chunk(ids[mid:], pos[mid:], mid, bt, table)])[0]  # rows before `mid` from the cache
    assert torch.allclose(again, ref[-1], atol=1e-4)
    dec.forward([Chunk(ids[:mid], pos[:mid], 0, bt, table, want_logits=False)])  # the image cut in two
    split = dec.forward([Chunk(ids[mid:], pos[mid:], mid, bt, table)])[0]
    assert (split - ref[-1]).abs().max() > 1e-3


# ---- greedy parity through the CLI -----------------------------------------------------------------
CASES = [(["wide"], 30, "what is in this image?"), (["wide"], 31, "what is in this image?"),
         (["square"], 32, "describe the picture"), (["tiny"], 33, "hello world!"),
         (["strip", "tall"], 34, "Tell me a story about a robot."), ([], 0, "Tell me a story about a robot.")]


@parity_test('gemma3')
def test_chat_json_matches_transformers_generate(model, tmp_path, capsys):
    """Several image sizes, two images in one message and a text-only turn; every prompt is longer
    than the sliding window. The same prompt with another image of the same size decodes differently."""
    ckpt, engine, hf, proc = model
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
        assert got["prompt_tokens"] > 2 * WINDOW
        ref = hf_greedy(hf, proc, [user(len(images), prompt)], images)
        assert_greedy_parity(got["token_ids"], ref, eos)
        assert got["finish_reason"] == ("stop" if len(strip_eos(ref, eos)) < len(ref) else "length")
        outputs.append(got["token_ids"])
    assert outputs[0] != outputs[1]  # same size and prompt, other pixels
    assert sum(len(set(o)) for o in outputs) >= 12  # not a run of one repeated token


def test_batch_multi_turn_chunked_prefill_and_prefix_cache(model):
    """A batch of multi-turn requests (one text-only with a system message) under a token budget
    smaller than one image decodes like each request alone and like transformers; no chunk ends
    inside an image; the same prompt again starts from a prefix-cache hit that ends inside its
    second image and still decodes the same."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    ckpt, engine, hf, proc = model
    eos = hf.generation_config.eos_token_id
    convs = [
        ([user(1, "hello"), text_turn("assistant", "a cat"), user(1, "and this one?")],
         [make_image(50, (20, 60)), make_image(51, (60, 28))]),
        ([user(2, "describe the picture in one sentence.")], [make_image(52, (56, 56)), make_image(53, (9, 30))]),
        ([text_turn("system", "numbers 0 1 2"), user(0, "Tell me a story about a robot.")], []),
    ]
    refs = [strip_eos(hf_greedy(hf, proc, m, i, 8), eos) for m, i in convs]
    p = SamplingParams(max_tokens=8, temperature=0)

    eng = Engine(engine, max_num_batched_tokens=10, enable_prefix_caching=False)
    chunks = []  # (request, start, n) of every scheduled chunk
    schedule = eng.scheduler.schedule

    def recording():
        out, preempted = schedule()
        chunks.extend((s.request, s.start, s.n) for s in out)
        return out, preempted

    eng.scheduler.schedule = recording
    reqs = [eng.submit(eng.encode(m, i), p) for m, i in convs]
    while any(not r.finished for r in reqs):
        eng.step()
    assert [r.completion().token_ids for r in reqs] == refs
    assert sum(len(r.image_spans) for r in reqs) == 4 and all(rows == ROWS for r in reqs for _, rows in r.image_spans)
    for req, start, n in chunks:
        assert not any(first < start + n < first + rows for first, rows in req.image_spans), "chunk ends in an image"
    prefill = [(req, start, n) for req, start, n in chunks if start < req.prompt_len]
    assert any(n > 10 for _, _, n in prefill)  # an image taken whole past the budget
    assert max(len([c for c in prefill if c[0] is r]) for r in reqs) >= 4  # prompts really were chunked

    # prefix cache: the first prompt twice, with a block size that puts the cached prefix (whole blocks,
    # never the last token) inside its second image
    msgs, imgs = convs[0]
    n, (first_row, rows) = len(reqs[0].all_ids) - len(reqs[0].output_ids), reqs[0].image_spans[1]
    bs = next(b for b in range(4, 64) if first_row < (n - 1) // b * b < first_row + rows)
    e = Engine(engine, block_size=bs)
    first = e.generate([e.encode(msgs, imgs)], p)[0]
    again = e.submit(e.encode(msgs, imgs), p)
    while not again.finished:
        e.step()
    assert first_row < again.num_cached_tokens < first_row + rows
    assert first.token_ids == again.completion().token_ids == refs[0]


def test_served_concurrent_requests_with_a_small_budget(model):
    """`vlmctl serve`'s app with --max-num-batched-tokens 8 (half an image): concurrent image
    requests through the official openai client, each equal to transformers' greedy tokens."""
    import base64
    import io
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from test_serve import start_uvicorn
    from vlmctl.serve import ServerConfig, load_app

    ckpt, engine, hf, proc = model
    eos = hf.generation_config.eos_token_id
    app = load_app(engine, ServerConfig(), max_num_batched_tokens=8, max_batch_size=4)
    url, stop = start_uvicorn(app)
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id
        jobs = [([make_image(60, SIZES["wide"])], "what is in this image?"),
                ([make_image(61, SIZES["square"]), make_image(62, SIZES["tiny"])], "compare"),
                ([make_image(63, SIZES["strip"])], "describe the picture")]

        def ask(job):
            images, text = job
            parts = []
            for img in images:
                buf = io.BytesIO()
                img.save(buf, format="PNG")
                parts.append({"type": "image_url", "image_url": {
                    "url": "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()}})
            r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": parts + [
                {"type": "text", "text": text}]}], max_tokens=8, temperature=0)
            return r.choices[0].message.content, r.usage.prompt_tokens

        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(ask, jobs))
    finally:
        stop()
    tok = proc.tokenizer
    for (images, text), (content, prompt_tokens) in zip(jobs, answers):
        ref = strip_eos(hf_greedy(hf, proc, [user(len(images), text)], images, 8), eos)
        assert prompt_tokens > ROWS * len(images) > 8
        assert content == tok.decode(ref, skip_special_tokens=True) and content


# ---- tied embeddings ---------------------------------------------------------------------------
@pytest.mark.parametrize("top,text", [(True, None), (False, None), (True, False), (False, True)])
def test_tie_follows_transformers(tmp_path, top, text):
    """The standalone decoder is tied exactly when transformers ties the VLM's lm_head: by the
    top-level flag; the text config's flag is not read."""
    from vlmctl.checkpoint import iter_tensors
    from vlmctl.convert import convert_checkpoint
    from vlmctl.models.registry import get_family

    ckpt = make_gemma3(tmp_path / "ckpt", tie=top, text_tie=text, text_layers=2, vision_layers=1)
    hf = load_hf(ckpt)
    tied = hf.lm_head.weight.data_ptr() == hf.model.language_model.embed_tokens.weight.data_ptr()
    assert tied == top
    cfg = json.loads((ckpt / "config.json").read_text())
    assert get_family("gemma3").text_config_dict(cfg)["tie_word_embeddings"] == tied
    convert_checkpoint(ckpt, tmp_path / "conv", "float32")
    names = {k for k, _, _ in iter_tensors(tmp_path / "conv" / "llm")}
    assert ("lm_head.weight" in names) == (not tied)


# ---- AWQ ---------------------------------------------------------------------------------------
def test_awq_build_matches_transformers_on_dequantized_weights(tmp_path, capsys):
    """`--set quantization.method=awq`: the decoder is quantized (tower and projector untouched), scales
    folded into Gemma's (1 + w) norms keep the float model's function, and greedy tokens with two
    images equal transformers' with the AWQ checkpoint's dequantized weights."""
    from transformers import Gemma3ForConditionalGeneration

    from tiny_llava_anyres import dequantized_reference
    from vlmctl.models.registry import get_family

    ckpt = make_gemma3(tmp_path / "ckpt", seed=11)
    awq_build(ckpt, tmp_path, capsys)
    eng = tmp_path / "eng"
    imgs = [make_image(60, SIZES["wide"]), make_image(61, SIZES["square"])]
    got = chat_with_images(eng, tmp_path, imgs, capsys, MAX_NEW)
    qdir = assert_awq_checkpoints(eng, {"vision_tower", "multi_modal_projector"})
    hf = dequantized_reference(Gemma3ForConditionalGeneration, ckpt, qdir, get_family("gemma3"))
    plain = load_hf(ckpt)
    lm, plm = hf.model.language_model, plain.model.language_model
    assert not torch.equal(plm.layers[0].mlp.down_proj.weight, lm.layers[0].mlp.down_proj.weight)
    assert not torch.equal(plm.layers[0].input_layernorm.weight, lm.layers[0].input_layernorm.weight)  # scaled
    assert torch.equal(plain.model.multi_modal_projector.mm_input_projection_weight,
                       hf.model.multi_modal_projector.mm_input_projection_weight)
    proc = load_proc(ckpt)
    ref = hf_greedy(hf, proc, [user(2, AWQ_PROMPT)], imgs)
    assert got["token_ids"] == strip_eos(ref, hf.generation_config.eos_token_id)


def test_awq_scale_folding_keeps_the_one_plus_norm_exact():
    """Folding 1/s into a (1 + w) norm and s into the next linears leaves the layer's function unchanged
    (to float rounding); folding it as into a plain gain w would not."""
    from transformers import Gemma3TextConfig
    from transformers.models.gemma3.modeling_gemma3 import Gemma3DecoderLayer, Gemma3RotaryEmbedding

    from vlmctl.models.decoders import decoder_family
    from vlmctl.quant.awq_layer import LayerQuantizer

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=50, hidden_size=32, intermediate_size=64, num_hidden_layers=1,
                           num_attention_heads=2, num_key_value_heads=2, head_dim=16, sliding_window=8)
    cfg._attn_implementation = "sdpa"
    layer = Gemma3DecoderLayer(cfg, 0).eval()
    with torch.no_grad():
        for p in layer.parameters():
            p.normal_(0, 0.3)
    x = torch.randn(2, 10, 32)
    pos = torch.arange(10)[None]
    cos_sin = Gemma3RotaryEmbedding(cfg)(x, pos, cfg.layer_types[0])
    with torch.no_grad():
        ref = layer(x, position_embeddings=cos_sin, attention_mask=None)
    fam = decoder_family("gemma3_text")
    plain = Gemma3DecoderLayer(cfg, 0).eval()
    plain.load_state_dict(layer.state_dict())
    for g in fam.awq_groups:
        s = torch.rand(layer.get_submodule(g.linears[0]).in_features) + 0.5
        if g.requires_equal_shapes:
            continue
        LayerQuantizer.apply_scale(layer, g, s, fam.norm_gain_offset)
        LayerQuantizer.apply_scale(plain, g, s)
    with torch.no_grad():
        assert torch.allclose(layer(x, position_embeddings=cos_sin, attention_mask=None), ref, atol=1e-4)
        assert (plain(x, position_embeddings=cos_sin, attention_mask=None) - ref).abs().max() > 1e-2


def test_awq_calibration_pass_reproduces_the_models_forward(tmp_path):
    """What AWQ's calibration feeds each layer (scaled embeddings, the layer type's rotary table, the
    sliding window as a mask) reproduces transformers' own forward layer by layer, at a sequence
    longer than the window."""
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    from vlmctl.models.decoders import calibration_layer_kwargs, decoder_family
    from vlmctl.quant.awq import embedding_scale

    cfg = Gemma3TextConfig(vocab_size=90, hidden_size=32, intermediate_size=64, num_hidden_layers=4,
                           num_attention_heads=2, num_key_value_heads=1, head_dim=16, sliding_window=5,
                           sliding_window_pattern=2, rope_local_base_freq=100.0)
    torch.manual_seed(0)
    hf = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3)
    hf.save_pretrained(tmp_path / "llm")
    ids = torch.randint(0, 90, (2, 17))
    with torch.no_grad():
        ref = hf(ids, output_hidden_states=True).hidden_states
    hf.config._attn_implementation = "sdpa"
    inner = hf.model
    x = torch.nn.functional.embedding(ids, inner.embed_tokens.weight) * embedding_scale(tmp_path / "llm")
    pos = torch.arange(17)[None]
    kwargs = calibration_layer_kwargs(decoder_family("gemma3_text"), hf.config, inner.rotary_emb, x, pos)
    assert kwargs[0]["attention_mask"] is not None and kwargs[1]["attention_mask"] is None
    with torch.no_grad():
        assert torch.allclose(x, ref[0], atol=1e-5)
        for i, layer in enumerate(inner.layers):
            x = layer(x, **kwargs[i])
            x = x[0] if isinstance(x, tuple) else x
            if i + 1 < len(inner.layers):
                assert torch.allclose(x, ref[i + 1], atol=1e-4), i


def test_autoawq_impl_refuses_gemma3_cleanly(tmp_path, capsys):
    """AutoAWQ 0.2.9 has no Gemma 3 model: `quantization.impl: autoawq` is one clear error (exit 4)."""
    if __import__("importlib").util.find_spec("awq") is None:
        pytest.skip("autoawq is not installed")
    ckpt = make_gemma3(tmp_path / "ckpt", text_layers=2, vision_layers=1)
    recipe = write_recipe(tmp_path / "r.yaml", ckpt)
    _, _, err = cli("build", recipe, "-o", tmp_path / "eng", "--set", "quantization.method=awq", "--set",
                    "quantization.impl=autoawq", "--set", "quantization.group_size=32", capsys=capsys, expect=4)
    assert "error:" in err and "gemma3_text" in err and "Traceback" not in err


# ---- hub shapes, limits, backends -------------------------------------------------------------------
def _hub_like(text: dict, vision: dict | None = None) -> dict:
    """config.json as google/gemma-3-*-it has it (transformers 4.x keys: rope_scaling, rope_local_base_freq)."""
    return {"architectures": ["Gemma3ForConditionalGeneration"], "model_type": "gemma3", "boi_token_index": 255999,
            "eoi_token_index": 256000, "image_token_index": 262144, "mm_tokens_per_image": 256,
            "eos_token_id": [1, 106],
            "text_config": {"model_type": "gemma3_text", "rope_scaling": {"factor": 8.0, "rope_type": "linear"},
                            "sliding_window": 1024, "rope_theta": 1000000.0, "rope_local_base_freq": 10000.0,
                            "sliding_window_pattern": 6, "vocab_size": 262208, "max_position_embeddings": 131072,
                            **text},
            "vision_config": {"model_type": "siglip_vision_model", "hidden_size": 1152, "image_size": 896,
                              "intermediate_size": 4304, "num_attention_heads": 16, "num_hidden_layers": 27,
                              "patch_size": 14, "vision_use_head": False, **(vision or {})}}


@pytest.mark.parametrize("text", [
    dict(hidden_size=2560, intermediate_size=10240, num_hidden_layers=34, num_attention_heads=8,
         num_key_value_heads=4, head_dim=256, query_pre_attn_scalar=256),  # gemma-3-4b-it
    dict(hidden_size=3840, intermediate_size=15360, num_hidden_layers=48, num_attention_heads=16,
         num_key_value_heads=8, head_dim=256, query_pre_attn_scalar=256),  # gemma-3-12b-it
    dict(hidden_size=5376, intermediate_size=21504, num_hidden_layers=62, num_attention_heads=32,
         num_key_value_heads=16, head_dim=128, query_pre_attn_scalar=168),  # gemma-3-27b-it
], ids=["4b", "12b", "27b"])
def test_hub_shaped_configs(text):
    """The hub checkpoints' configs: detected, 256 rows an image, split into a Gemma 3 text decoder
    whose spec has five sliding layers (window 1024, local theta 10k) per global one (theta 1M, linear
    scaling 8), and the hub's tensor names map onto transformers 5's and back."""
    from vlmctl.convert import expected_tensors
    from vlmctl.models.decoders import decoder_spec
    from vlmctl.models.registry import detect_family

    cfg = _hub_like(text)
    fam = detect_family(cfg)
    assert fam.name == "gemma3" and fam.max_image_tokens(cfg) == 256
    dec = fam.text_config_dict(cfg)
    assert dec["architectures"] == ["Gemma3ForCausalLM"] and dec["tie_word_embeddings"] is True
    spec = decoder_spec(dec)
    n = text["num_hidden_layers"]
    assert spec.layer_types == tuple("full" if (i + 1) % 6 == 0 else "sliding" for i in range(n))
    assert spec.sliding_window == 1024 and spec.attention_scale == text["query_pre_attn_scalar"] ** -0.5
    d = text["head_dim"]
    base = torch.arange(0, d, 2, dtype=torch.float32) / d
    assert torch.allclose(torch.tensor(spec.rope_inv_freq), 1.0 / (1e6 ** base) / 8)
    assert torch.allclose(torch.tensor(spec.rope_local_inv_freq), 1.0 / (1e4 ** base))
    names = expected_tensors(fam, cfg)
    assert "model.multi_modal_projector.mm_input_projection_weight" in names
    hub = {"language_model.model.layers.0.self_attn.q_norm.weight":
           "model.language_model.layers.0.self_attn.q_norm.weight",
           "vision_tower.vision_model.encoder.layers.0.mlp.fc1.weight":
           "model.vision_tower.encoder.layers.0.mlp.fc1.weight",
           "multi_modal_projector.mm_soft_emb_norm.weight": "model.multi_modal_projector.mm_soft_emb_norm.weight",
           "language_model.lm_head.weight": "lm_head.weight"}
    for old, new in hub.items():
        assert fam.canonical_key(old) == new and new in names
    assert {fam.split_key(k)[0] for k in names} == {"vision", "decoder"}
    assert all(fam.join_key(*fam.split_key(k)) == k for k in names)


def test_trtllm_backend_is_refused_for_bidirectional_image_attention():
    from vlmctl.errors import StageError
    from vlmctl.models.registry import get_family
    from vlmctl.pipeline import resolve_decoder_backend
    from vlmctl.recipe import Recipe

    fam = get_family("gemma3")
    assert resolve_decoder_backend(Recipe(source="x", dtype="bfloat16"), fam) == "torch"
    with pytest.raises(StageError, match="causally"):  # the family's own reason
        resolve_decoder_backend(Recipe(source="x", dtype="bfloat16", decoder={"backend": "trtllm"}), fam)


def test_bundled_recipes_load():
    from vlmctl.recipe import RECIPES_DIR, load_recipe

    for name, params in (("gemma-3-4b-it", 4), ("gemma-3-12b-it", 12), ("gemma-3-27b-it", 27)):
        r = load_recipe(RECIPES_DIR / f"{name}.yaml")
        assert r.source == f"google/{name}" and r.dtype == "bfloat16"
        assert r.limits.max_input_len + r.limits.max_output_len <= 131072
        assert r.limits.max_images_per_request >= 2


# ---- on a CUDA device (marked gpu; run on the GPU machine: `pytest -m gpu tests/test_gemma3.py`) ----
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gpu_engine(tmp_path_factory):
    """fp16, head_dim 32 (the Triton kernels' path: q/k norm, (1 + w) norm, GELU-tanh, windowed decode)."""
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    d = tmp_path_factory.mktemp("gemma3-gpu")
    ckpt = make_gemma3(d / "ckpt", hidden=128, head_dim=32, init_range=0.1, embed_init=0.05)
    recipe = load_recipe(write_recipe(d / "r.yaml", ckpt, dtype="float16", profiles=[],
                                      limits={"max_batch_size": 8, "max_input_len": 256, "max_output_len": 64,
                                              "max_images_per_request": 2}))
    build(recipe, d / "eng")
    return d / "eng"


def _gpu_prompts(eng, n):
    texts = ["what is in this image?", "hello", "describe the picture", "a red square", "the sky is green"]
    return [eng.encode([user(1 + i % 2, t)], [make_image(10 * i + k, (30 + 7 * k, 40)) for k in range(1 + i % 2)])
            for i, t in enumerate(texts[:n])]


def _gpu_run(path, n=4, max_tokens=24, device="cuda", logprobs=None, **opts):
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    opts.setdefault("kv_cache_tokens", 4096)  # several engines live at once in this module
    eng = Engine(path, device=device, **opts)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)
    done = eng.generate(_gpu_prompts(eng, n), params)
    return (eng, [c.token_ids for c in done]) + ((([c.logprobs for c in done]),) if logprobs else ())


@pytest.mark.gpu
@needs_cuda
def test_gpu_graphed_decode_equals_eager(gpu_engine, monkeypatch):
    # decode graphs alone (prompt steps replayed from graphs attend through another kernel than eager ones)
    monkeypatch.setenv("VLMCTL_STEP_GRAPH_ROWS", "0")
    eng_g, graphed = _gpu_run(gpu_engine, cuda_graphs=True)
    eng_e, eager = _gpu_run(gpu_engine, cuda_graphs=False)
    assert eng_g.decoder.use_graphs and not eng_e.decoder.use_graphs
    assert graphed == eager


@pytest.mark.gpu
@needs_cuda
def test_gpu_chunked_prefix_and_preempted_runs_match_a_plain_run(gpu_engine):
    """fp16: equal tokens but for near-ties (parity.assert_equal_but_near_ties says why)."""
    _, plain, plain_lps = _gpu_run(gpu_engine, cuda_graphs=False, logprobs=2)
    _, chunked = _gpu_run(gpu_engine, cuda_graphs=False, max_num_batched_tokens=8, max_batch_size=4, block_size=4)
    assert assert_equal_but_near_ties(chunked, plain, plain_lps) <= 1
    _, again = _gpu_run(gpu_engine, cuda_graphs=False, block_size=4)
    assert assert_equal_but_near_ties(again, plain, plain_lps) <= 1
    small, pre = _gpu_run(gpu_engine, cuda_graphs=False, block_size=4, kv_cache_tokens=200,
                          enable_prefix_caching=False)
    assert assert_equal_but_near_ties(pre, plain, plain_lps) <= 1
    assert small.scheduler.preemptions > 0 and small.pool.num_used() == 0


@pytest.mark.gpu
@needs_cuda
def test_gpu_fp16_follows_the_cpu_reference(gpu_engine):
    _, gpu_out = _gpu_run(gpu_engine, n=3, max_tokens=32)
    _, cpu_out = _gpu_run(gpu_engine, n=3, max_tokens=32, device="cpu")
    same = sum(a == b for g, r in zip(gpu_out, cpu_out) for a, b in zip(g, r))
    assert same >= 0.9 * sum(len(r) for r in cpu_out), (gpu_out, cpu_out)
    assert all(g[:4] == r[:4] for g, r in zip(gpu_out, cpu_out))


def test_load_time_warm_steps_touch_only_block_0(model):
    """What a CUDA engine runs at load (`TorchDecoder.warm_forward`) works for this family's decoder and
    writes only the scratch KV block 0."""
    from conftest import assert_warm_steps_touch_only_block_0
    from vlmctl.runtime.engine import Engine

    assert_warm_steps_touch_only_block_0(Engine(model[1]).decoder)
