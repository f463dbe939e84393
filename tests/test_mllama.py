"""Llama 3.2 Vision (cross-attention) on tiny random checkpoints: the prompt and transformers'
cross_attention_mask, the cross-KV row layout, vision ONNX, prefill logits at every position (tokens
before the first image included), greedy parity of `vlmctl build` + `vlmctl chat --json` with
transformers' generate, continuous batching of requests with and without images, chunked prefill,
preemption and resume, the prefix cache keyed by the images, the captured decode step's body, the
OpenAI server, AWQ with float or quantized cross-attention layers, and TensorRT-LLM refused.

The reference is transformers alone: MllamaProcessor (it loads without torchvision) with its
`apply_chat_template(tokenize=True)` (input ids, pixel values, aspect-ratio ids and mask, and
cross_attention_mask) and MllamaForConditionalGeneration.generate / forward.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import cli, cli_json, write_recipe
from family_helpers import AWQ_PROMPT, awq_build, build_engine, chat_with_images, greedy, with_images
from parity import assert_equal_but_near_ties, assert_greedy_parity, parity_test, strip_eos
from tiny_mllama import make_mllama
from tiny_models import CORPUS, make_image

MAX_NEW = 12
ROWS = 4 * ((16 // 4) ** 2 + 1)  # rows of one image: 4 tiles x (4 x 4 patches + the class row)
SIZES = {"wide": (40, 30), "tall": (20, 60), "square": (64, 64), "tiny": (5, 7), "strip": (90, 20)}


# ---- the reference (transformers only) ---------------------------------------------------------
def user(*parts) -> dict:
    """A user message; str parts are text, None an image, in the order given."""
    return {"role": "user", "content": [{"type": "image"} if p is None else {"type": "text", "text": p}
                                        for p in parts]}


def assistant(text: str) -> dict:
    return {"role": "assistant", "content": [{"type": "text", "text": text}]}


def hf_inputs(proc, messages, images):
    return proc.apply_chat_template(with_images(messages, images), add_generation_prompt=True, tokenize=True,
                                    return_dict=True, return_tensors="pt")


def hf_greedy(model, proc, messages, images, max_new_tokens=MAX_NEW):
    return greedy(model, hf_inputs(proc, messages, images), max_new_tokens)


def load_hf(ckpt: Path):
    from transformers import MllamaForConditionalGeneration

    return MllamaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()


def load_proc(ckpt: Path):
    from transformers import AutoProcessor

    proc = AutoProcessor.from_pretrained(ckpt)
    assert type(proc).__name__ == "MllamaProcessor" and type(proc.image_processor).__name__ == \
        "MllamaImageProcessorPil"
    return proc


@pytest.fixture(scope="module")
def model(tmp_path_factory):
    """(checkpoint, engine, HF model, HF processor) of the default tiny Llama 3.2 Vision."""
    ckpt = make_mllama(tmp_path_factory.mktemp("mllama") / "ckpt")
    return ckpt, build_engine(ckpt, tmp_path_factory.mktemp("mllama-engine")), load_hf(ckpt), load_proc(ckpt)


# Prompts of every shape the mask has: one image after the header tokens, two consecutive images,
# text before the image in the same message, two images in two turns, no image.
CONVERSATIONS = [
    ([user(None, "what is in this image?")], [make_image(1, SIZES["wide"])]),
    ([user(None, None, "compare")], [make_image(2, SIZES["wide"]), make_image(3, SIZES["tall"])]),
    ([user("hello world!", None, "describe the picture")], [make_image(4, SIZES["square"])]),
    ([user(None, "hello"), assistant("a cat"), user(None, "and this one?")],
     [make_image(5, (10, 70)), make_image(6, SIZES["strip"])]),
    ([user("Tell me a story about a robot.")], []),
]


# ---- prompt --------------------------------------------------------------------------------------
def test_encode_matches_processor(model):
    """Token ids (one BOS, one <|image|> per image, no placeholder rows), pixels, aspect-ratio ids and
    masks equal MllamaProcessor's, and each token sees exactly the images and tiles its
    cross_attention_mask row lets it see, for every prompt shape and many image sizes."""
    from vlmctl.models.registry import get_family

    ckpt, engine, hf, proc = model
    mine = get_family("mllama").load_processor(engine / "convert" / "processor")
    image_id = hf.config.image_token_index
    assert image_id == hf.config.text_config.vocab_size  # <|image|> is past the LM head's vocabulary
    cases = list(CONVERSATIONS) + [([user(None, "what is in this image?")], [make_image(10 + i, s)])
                                   for i, s in enumerate(SIZES.values())]
    cases.append(([{"role": "system", "content": [{"type": "text", "text": "numbers 0 1 2"}]}, user("hello")], []))
    tiles_seen = set()
    for msgs, imgs in cases:
        ref = hf_inputs(proc, msgs, imgs)
        got = mine.encode(msgs, imgs)
        ids = ref["input_ids"][0].tolist()
        assert got.token_ids == ids
        assert ids.count(mine.tokenizer.bos_token_id) == 1 and ids.count(image_id) == len(imgs)
        if not imgs:
            assert got.cross is None and not got.images
            continue
        assert [it.num_tokens for it in got.images] == [0] * len(imgs)
        assert got.cross.image_rows == [ROWS] * len(imgs)
        np.testing.assert_array_equal(np.stack([it.inputs["pixel_values"] for it in got.images]),
                                      ref["pixel_values"][0].numpy())
        np.testing.assert_array_equal(np.concatenate([it.inputs["aspect_ratio_ids"] for it in got.images]),
                                      ref["aspect_ratio_ids"][0].numpy())
        np.testing.assert_array_equal(np.concatenate([it.inputs["aspect_ratio_mask"] for it in got.images]),
                                      ref["aspect_ratio_mask"][0].numpy())
        cam = ref["cross_attention_mask"][0].numpy()  # [T, images, tiles]
        for t, (first, end) in enumerate(got.cross.token_images):
            seen = np.nonzero(cam[t].any(-1))[0].tolist()
            assert seen == list(range(first, end)), (msgs, t)
            for k in seen:
                tiles = int(cam[t, k].sum())
                assert cam[t, k, :tiles].all() and got.cross.visible_rows[k] == tiles * (ROWS // 4)
                tiles_seen.add(tiles)
        assert not cam[0].any()  # the BOS sees no image
    assert len(tiles_seen) >= 3  # images of 1..4 tiles occurred
    with pytest.raises(Exception, match="placeholder"):
        mine.encode([user(None, "x")], [make_image(1), make_image(2)])


def test_cross_kv_plan_gives_each_token_its_rows_as_one_range(model):
    """For every prompt shape, the rows a token attends ([lo, hi) of the reordered cross KV) are
    exactly the rows transformers' mask lets it see; tokens before the first image see every row
    (padding tiles too) and get no MLP; generated tokens attend [0, n) like the last prompt token."""
    from vlmctl.models.base import CrossAttention
    from vlmctl.models.registry import get_family
    from vlmctl.runtime.cross_kv import plan

    _, engine, _, _ = model
    mine = get_family("mllama").load_processor(engine / "convert" / "processor")
    prompts = [mine.encode(m, i).cross for m, i in CONVERSATIONS if i]
    # three runs of images, the middle one two images wide, and the last token in the middle run
    prompts.append(CrossAttention(image_rows=[8, 6, 6, 4], visible_rows=[3, 6, 2, 4],
                                  token_images=np.array([[0, 0], [0, 1], [0, 1], [1, 2], [1, 3], [1, 3], [3, 4],
                                                         [1, 3]])))
    for cross in prompts:
        p = plan(cross)
        first = np.concatenate([[0], np.cumsum(cross.image_rows)])
        assert sorted(p.order.tolist()) == list(range(sum(cross.image_rows)))  # a permutation of the rows
        for t, (f, e) in enumerate(cross.token_images):
            want = set(range(first[-1])) if f == e else \
                {r for k in range(f, e) for r in range(first[k], first[k] + cross.visible_rows[k])}
            assert set(p.order[p.lo[t]:p.hi[t]].tolist()) == want, t
            assert p.mlp[t] == (f < e)
        lo, hi, mlp = p.rows_for(len(cross.token_images) - 1, 3)  # the last prompt token, then two generated
        assert lo.tolist() == [0, 0, 0] and hi.tolist() == [p.hi[-1]] * 3 == [p.decode_hi] * 3 and mlp.all()
    with pytest.raises(Exception, match="one run"):  # a token seeing images on both sides of the last token's
        plan(CrossAttention(image_rows=[4, 4, 4], visible_rows=[4, 4, 4],
                            token_images=np.array([[0, 0], [0, 3], [1, 2]])))


# ---- vision ONNX ---------------------------------------------------------------------------------
def test_onnx_matches_torch_and_hf(model):
    """One dynamic `tiles` axis (images x 4 tiles) with aspect-ratio ids and masks per image: ONNX
    Runtime equals the torch wrapper and transformers' vision_model + multi_modal_projector at image
    counts the export never used, with random ratios and real processed images."""
    from vlmctl.export.onnx_vision import ort_session
    from vlmctl.models.registry import get_family

    ckpt, engine, hf, _ = model
    fam = get_family("mllama")
    vision_dir = engine / "convert" / "vision"
    cfg = json.loads((vision_dir / "config.json").read_text())
    module = fam.build_vision_module(vision_dir, torch.float32)
    onnx = engine / "export-vision" / "model.onnx"
    sess = ort_session(onnx, ["CPUExecutionProvider"])
    info = json.loads((engine / "export-vision" / "manifest.json").read_text())["info"]
    assert info["export_batch"] == 2 and info["validate_batch"] == 3 and info["max_abs_error"] <= 1e-4
    assert info["dynamic_axes"]["pixel_values"] == {"0": "tiles"}
    proc = fam.load_processor(engine / "convert" / "processor")
    # the TensorRT profile (VisionAxis: 4 tiles an image beside per-image ratio ids and masks) spans
    # what the processor feeds for one image up to every image the engine admits at once (4 x 2)
    from vlmctl.export.tensorrt import vision_profile

    prof = vision_profile(fam.vision_axis(cfg, engine / "convert" / "processor"), 4, 2)
    for n, bound in ((1, 0), (8, 2)):
        fed, _ = proc.collate([proc.image_item(make_image(k, SIZES["wide"]), str(k)) for k in range(n)])
        assert {k: v.shape for k, v in fed.items()} == {k: v[bound] for k, v in prof.items()}
    assert prof["aspect_ratio_ids"][1] == (4,) and prof["pixel_values"][1][0] == 16
    real = [proc.preprocess(make_image(7, s))[0] for s in (SIZES["strip"], SIZES["tiny"], SIZES["square"])]
    real_feed = {k: torch.from_numpy(np.concatenate([r[k] for r in real])) for k in real[0]}
    assert sorted(real_feed["aspect_ratio_mask"].sum(1).tolist()) != [4, 4, 4]  # some padding tiles
    for feed in (fam.example_vision_inputs(cfg, 1, torch.float32, seed=1),
                 fam.example_vision_inputs(cfg, 5, torch.float32, seed=5), real_feed):
        n = feed["aspect_ratio_ids"].shape[0]
        got = sess.run(None, {k: v.numpy() for k, v in feed.items()})[0]
        with torch.no_grad():
            ref = module(*feed.values()).numpy()
            hf_feats = fam.hf_image_features(hf, feed).numpy()
        assert got.shape == ref.shape == hf_feats.shape == (n, ROWS, 64)
        assert np.max(np.abs(got - ref)) <= 1e-4
        assert np.max(np.abs(hf_feats - ref)) <= 1e-5


# ---- the decoder contract -------------------------------------------------------------------------
def test_decoder_spec_carries_cross_attention_layers(model):
    from vlmctl.formats.torch_layout import DecoderSpec
    from vlmctl.runtime.decoder import TorchDecoder

    _, engine, hf, _ = model
    cfg = json.loads((engine / "build-llm" / "config.json").read_text())
    spec = DecoderSpec.from_json(cfg["decoder"])
    tc = hf.config.text_config
    assert spec.layer_types == ("full", "cross_attention", "full", "cross_attention", "full")
    assert spec.cross_layers == (1, 3) and spec.self_layers == (0, 2, 4)
    assert spec.vocab_size == tc.vocab_size and spec.embed_rows == tc.vocab_size + 8 == spec.table_base
    src = spec.tensor_sources
    assert src["layers.{i}.cross_kv.weight"] == ("model.layers.{i}.cross_attn.k_proj.weight",
                                                 "model.layers.{i}.cross_attn.v_proj.weight")
    assert src["layers.{i}.cross_attn_gate"] == ("model.layers.{i}.cross_attn_attn_gate",)
    names = spec.runtime_names()
    assert "layers.1.cross_q.weight" in names and "layers.1.qkv.weight" not in names
    assert "layers.0.qkv.weight" in names and "layers.0.cross_q.weight" not in names
    assert "layers.1.gate_up.weight" in names and cfg["image_tokens_per_image"] == ROWS
    dec = TorchDecoder.load(engine / "build-llm")
    assert dec.kv_bytes_per_token() == 2 * 3 * spec.kv_size * 4  # self-attention layers only
    assert dec.cross_kv_bytes_per_row() == 2 * 2 * spec.kv_size * 4


def test_text_model_alone_matches_mllama_for_causal_lm(model):
    """The decoder checkpoint convert wrote, run without images (`eval ppl`'s path): logits equal
    transformers' MllamaForCausalLM, which skips its cross-attention layers too; `<|image|>` (an
    embedding row past the LM head) is looked up, not clamped."""
    from transformers import MllamaForCausalLM

    from vlmctl.runtime.decoder import TorchDecoder

    _, engine, hf, _ = model
    llm = engine / "convert" / "llm"
    ref_model = MllamaForCausalLM.from_pretrained(llm, dtype=torch.float32).eval()
    dec = TorchDecoder.from_hf_dir(llm)
    V = hf.config.text_config.vocab_size
    ids = torch.randint(0, V, (2, 20), generator=torch.Generator().manual_seed(3))
    ids[0, 5] = hf.config.image_token_index
    with torch.no_grad():
        ref = ref_model(ids).logits
        clamped = ref_model(torch.where(ids >= V, V - 1, ids)).logits
    assert torch.allclose(dec.logits(ids), ref, atol=1e-5)
    assert (clamped - ref)[0, 5:].abs().max() > 1e-3


def _prompt_state(eng, messages, images):
    """A prompt's ids, its cross plan and its cross blocks with the K/V written (as admission does)."""
    from vlmctl.runtime.cross_kv import plan

    prompt = eng.encode(messages, images)
    eng.vision.encode(prompt.images)
    p = plan(prompt.cross)
    blocks = eng.cross_pool.allocate(-(-p.rows // eng.decoder.block_size))
    states = torch.cat([it.features for it in prompt.images])[torch.from_numpy(p.order)]
    eng.decoder.write_cross_kv(states, blocks)
    return np.asarray(prompt.token_ids), p, blocks


def test_prefill_logits_match_transformers_at_every_position(model):
    """Over the paged caches, in one chunk, in chunks of 1 (decode rows) and in uneven chunks, the
    logits at every prompt position equal transformers' forward with pixel values and
    cross_attention_mask. Tokens before the first image depend on the image (they attend to all of its
    rows), and keeping their cross-attention MLP output instead of zeroing it changes them."""
    from vlmctl.runtime.decoder import Chunk, CrossRows
    from vlmctl.runtime.engine import Engine

    _, engine, hf, proc = model
    eng = Engine(engine)
    dec = eng.decoder
    msgs = [user("hello world!", None, "describe the picture")]
    results = {}
    for name, img in (("a", make_image(40, SIZES["wide"])), ("b", make_image(41, SIZES["wide"]))):
        ids, p, xblocks = _prompt_state(eng, msgs, [img])
        with torch.no_grad():
            ref = hf(**hf_inputs(proc, msgs, [img])).logits[0]
        T = len(ids)
        bt = list(range(1, 1 + -(-T // dec.block_size)))
        first_image = int(np.nonzero(ids == hf.config.image_token_index)[0][0])
        assert first_image > 8 and not p.mlp[:first_image].any()

        def run(bounds, mlp=None):
            out = []
            for a, b in zip(bounds[:-1], bounds[1:]):
                lo, hi, m = p.rows_for(a, b - a)
                rows = CrossRows(xblocks, lo, hi, m if mlp is None else mlp[a:b])
                out.append(dec.forward([Chunk(ids[a:b], np.arange(a, b), a, bt, None, True, rows)])[0])
            return torch.stack(out)

        whole = run([0, T])
        assert torch.allclose(whole[0], ref[-1], atol=1e-4)
        singles = run(list(range(T + 1)))
        assert torch.allclose(singles, ref, atol=1e-4)
        uneven = [0, 3, first_image, first_image + 1, first_image + 7, T]
        assert torch.allclose(run(uneven), ref[[b - 1 for b in uneven[1:]]], atol=1e-4)
        kept = run(list(range(first_image + 1)), mlp=np.ones(T, bool))
        assert (kept[:first_image] - ref[:first_image]).abs().max() > 1e-2
        results[name] = ref[:first_image]
        eng.cross_pool.release(xblocks)
    assert (results["a"] - results["b"]).abs().max() > 1e-3  # text before the image sees the image


# ---- greedy parity through the CLI -----------------------------------------------------------------
CASES = [(["wide"], 30, "what is in this image?"), (["wide"], 31, "what is in this image?"),
         (["square"], 32, "describe the picture"), (["tiny"], 33, "hello world!"),
         (["strip", "tall"], 34, "Tell me a story about a robot."), ([], 0, "Tell me a story about a robot.")]


@parity_test("mllama")
def test_chat_json_matches_transformers_generate(model, tmp_path, capsys):
    """Several image sizes, two images in one message and a text-only prompt (which gets the
    template's system block and skips the cross-attention layers). The same prompt with another
    image of the same size decodes differently."""
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
        ref = hf_greedy(hf, proc, [user(*([None] * len(images)), prompt)], images)
        assert_greedy_parity(got["token_ids"], ref, eos)
        assert got["finish_reason"] == ("stop" if len(strip_eos(ref, eos)) < len(ref) else "length")
        outputs.append(got["token_ids"])
    assert outputs[0] != outputs[1]  # same size and prompt, other pixels
    assert sum(len(set(o)) for o in outputs) >= 12  # not a run of one repeated token


# ---- the engine: batching, chunks, preemption, prefix cache ------------------------------------------
def _refs(model, max_tokens=8):
    _, _, hf, proc = model
    eos = hf.generation_config.eos_token_id
    return [strip_eos(hf_greedy(hf, proc, m, i, max_tokens), eos) for m, i in CONVERSATIONS]


def _recording(eng):
    """Every scheduled step: [(request, start, n)]."""
    steps = []
    schedule = eng.scheduler.schedule

    def recording():
        out, preempted = schedule()
        steps.append([(s.request, s.start, s.n) for s in out])
        return out, preempted

    eng.scheduler.schedule = recording
    return steps


def test_batch_with_and_without_images_equals_each_alone(model):
    """All prompt shapes at once (four with images, one without) decode as each alone and as
    transformers; decode steps really mix requests with and without images."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    _, engine, _, _ = model
    refs = _refs(model)
    p = SamplingParams(max_tokens=8, temperature=0)
    alone = []
    for msgs, imgs in CONVERSATIONS:
        e = Engine(engine)
        alone.append(e.chat(msgs, imgs, p).token_ids)
    assert alone == refs
    eng = Engine(engine, max_batch_size=4)
    steps = _recording(eng)
    order = [4, 0, 1, 2, 3]  # the text-only request first: it decodes beside the image requests
    outs = eng.generate([eng.encode(*CONVERSATIONS[k]) for k in order], p)
    assert [o.token_ids for o in outs] == [refs[k] for k in order]
    mixed = [s for s in steps if any(r.cross is None for r, _, _ in s) and any(r.cross is not None for r, _, _ in s)
             and all(n == 1 for _, _, n in s)]
    assert mixed, "no decode step mixed requests with and without images"
    assert eng.cross_pool.num_used() == 0 and eng.stats()["cross_kv_blocks_used"] == 0


def test_chunked_prefill_under_a_small_budget(model):
    """A token budget of 5 cuts every prompt into many chunks (some starting at, some after the image
    token, with decode rows beside them); tokens equal transformers'."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    _, engine, _, _ = model
    refs = _refs(model)
    eng = Engine(engine, max_num_batched_tokens=5, enable_prefix_caching=False)
    steps = _recording(eng)
    order = [4, 0, 1, 2, 3]
    outs = eng.generate([eng.encode(*CONVERSATIONS[k]) for k in order], SamplingParams(max_tokens=8, temperature=0))
    assert [o.token_ids for o in outs] == [refs[k] for k in order]
    chunks = [(r, a, n) for s in steps for r, a, n in s if a < r.prompt_len]
    assert max(len([c for c in chunks if c[0] is r]) for r, _, _ in chunks) >= 8
    assert any(len({r.cross is None for r, _, _ in s}) == 2 and any(a < r.prompt_len for r, a, _ in s)
               and any(a >= r.prompt_len for r, a, _ in s) for s in steps)  # prefill beside decode, mixed


def test_preemption_recomputes_cross_attention_kv(model):
    """A KV cache of 136 tokens for five requests forces preemptions; a preempted request gives back
    its cross-attention blocks and has its cross K/V recomputed from its image features when it
    comes back; tokens equal transformers' and every block is free at the end."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    _, engine, _, _ = model
    refs = _refs(model)
    eng = Engine(engine, kv_cache_tokens=136, block_size=4, enable_prefix_caching=False)
    writes = []
    write = eng.decoder.write_cross_kv
    eng.decoder.write_cross_kv = lambda states, blocks: (writes.append(len(blocks)), write(states, blocks))[1]
    encodes = []
    run = eng.vision._run
    eng.vision._run = lambda items: (encodes.extend(items), run(items))[1]
    order = [0, 1, 2, 3, 4]  # the newest running request is preempted: here one with images
    reqs = [eng.submit(eng.encode(*CONVERSATIONS[k]), SamplingParams(max_tokens=8, temperature=0)) for k in order]
    while not all(r.finished for r in reqs):
        eng.step()
    assert [r.completion().token_ids for r in reqs] == [refs[k] for k in order]
    preempted = sum(r.preemptions for r in reqs if r.cross is not None)
    assert preempted > 0 and eng.scheduler.preemptions >= preempted
    assert len(writes) == 4 + preempted  # cross K/V written at every admission, recomputed after a preemption
    assert len(encodes) == 6  # the images were encoded once each (their features stay with the request)
    assert eng.pool.num_used() == 0 and eng.cross_pool.num_used() == 0


def test_prefix_cache_is_keyed_by_the_images(model):
    """The same messages with another image of the same size share no block (every token's K/V depends
    on the images); the same image again hits whole blocks, and both decode like transformers."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    _, engine, hf, proc = model
    eos = hf.generation_config.eos_token_id
    p = SamplingParams(max_tokens=8, temperature=0)
    msgs = [user(None, "what is in this image?")]
    a, b = make_image(70, SIZES["wide"]), make_image(71, SIZES["wide"])
    eng = Engine(engine, block_size=4)
    first = eng.chat(msgs, [a], p)
    other = eng.submit(eng.encode(msgs, [b]), p)
    while not other.finished:
        eng.step()
    assert other.num_cached_tokens == 0
    again = eng.submit(eng.encode(msgs, [a]), p)
    while not again.finished:
        eng.step()
    assert again.num_cached_tokens >= 40
    assert first.token_ids == again.completion().token_ids == strip_eos(hf_greedy(hf, proc, msgs, [a], 8), eos)
    assert other.completion().token_ids == strip_eos(hf_greedy(hf, proc, msgs, [b], 8), eos)


def test_parallel_samples_share_the_prompt_and_write_their_own_cross_kv(model):
    """n > 1 samples of a prompt with images (api2's leader and siblings): the siblings wait for the
    leader's prefill, take its full blocks from the prefix cache (keyed by the images), write their own
    cross-attention K/V from the shared image features (the images are encoded once), and each
    decodes as it would alone."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    _, engine, _, _ = model
    msgs, imgs = CONVERSATIONS[1]
    sp = [SamplingParams(max_tokens=8, temperature=1.0, seed=s) for s in (1, 2, 3)]
    alone = []
    for params in sp:
        e = Engine(engine)
        alone.append(e.generate([e.encode(msgs, imgs)], params)[0].token_ids)
    eng = Engine(engine, block_size=4)
    writes = []
    write = eng.decoder.write_cross_kv
    eng.decoder.write_cross_kv = lambda states, blocks: (writes.append(tuple(blocks)), write(states, blocks))[1]
    p = eng.encode(msgs, imgs)
    lead = eng.submit(p, sp[0])
    sibs = [eng.submit(p, params, leader=lead) for params in sp[1:]]
    eng.step()
    assert [s.status for s in sibs] == ["waiting", "waiting"] and lead.num_computed >= lead.prompt_len
    while eng.has_work():
        eng.step()
    full = (lead.prompt_len - 1) // 4 * 4
    assert [s.num_cached_tokens for s in sibs] == [full, full]
    assert len(writes) == 3 and len(set(writes)) == 3  # three requests, three block sets
    assert eng.vision.images_encoded == 2  # the two images, once
    assert [r.completion().token_ids for r in [lead] + sibs] == alone
    assert eng.cross_pool.num_used() == 0


def test_decode_body_with_and_without_cross_rows(model):
    """`TorchDecoder.decode` (the body a CUDA graph captures, run eagerly here) over a batch of a
    request with images and one without equals the general forward; a batch of text rows alone runs
    without the cross-attention layers and equals it too; so do a captured bucket's input buffers
    (padding rows included), filled as a replay fills them."""
    from vlmctl.runtime.decoder import Chunk, CrossRows
    from vlmctl.runtime.engine import Engine

    _, engine, _, _ = model
    eng = Engine(engine)
    dec = eng.decoder
    assert not dec.use_graphs
    ids_a, p, xblocks = _prompt_state(eng, *CONVERSATIONS[1])
    ids_b = np.asarray(eng.encode(*CONVERSATIONS[4]).token_ids)
    bs = dec.block_size
    bt_a = list(range(1, 1 + -(-(len(ids_a) + 4) // bs)))
    bt_b = list(range(bt_a[-1] + 1, bt_a[-1] + 1 + -(-(len(ids_b) + 4) // bs)))
    rows_a = CrossRows(xblocks, *p.rows_for(0, len(ids_a)))
    dec.forward([Chunk(ids_a, np.arange(len(ids_a)), 0, bt_a, None, True, rows_a),
                 Chunk(ids_b, np.arange(len(ids_b)), 0, bt_b)])
    toks = np.array([17, 23], dtype=np.int64)
    pos = np.array([len(ids_a), len(ids_b)], dtype=np.int64)
    slots = np.array([bt_a[pos[0] // bs] * bs + pos[0] % bs, bt_b[pos[1] // bs] * bs + pos[1] % bs], np.int64)
    got = dec.decode(toks, pos, slots, [bt_a, bt_b], pos + 1, [xblocks, []], np.array([p.decode_hi, 0]))
    ref = dec.forward([Chunk(toks[:1], pos[:1], int(pos[0]), bt_a, None, True,
                             CrossRows(xblocks, *p.rows_for(int(pos[0]), 1))),
                       Chunk(toks[1:], pos[1:], int(pos[1]), bt_b)])
    assert torch.allclose(got, ref, atol=1e-4)
    text_only = dec.decode(toks[1:], pos[1:], slots[1:], [bt_b], pos[1:] + 1)
    assert torch.allclose(text_only[0], ref[1], atol=1e-4)
    # a captured bucket's buffers (4 rows: two of padding), filled and run as a graph replay runs them
    st, body = dec._graph_inputs(4, True)
    dec._fill_graph_inputs(st, toks, pos, slots, [bt_a, bt_b], pos + 1, [xblocks, []], np.array([p.decode_hi, 0]))
    st["dev"].copy_(st["host"])
    assert torch.allclose(body()[:2], ref, atol=1e-4)
    st, body = dec._graph_inputs(4, False)
    dec._fill_graph_inputs(st, toks[1:], pos[1:], slots[1:], [bt_b], pos[1:] + 1)
    st["dev"].copy_(st["host"])
    assert torch.allclose(body()[0], ref[1], atol=1e-4)
    eng.cross_pool.release(xblocks)


def test_structured_output_with_a_token_past_the_lm_head(model):
    """The tokenizer has `<|image|>` one id past the LM head's vocabulary: the grammar engine is built
    over every tokenizer id while the logits (and logit_bias) stay the LM head's; a JSON schema is
    followed for a prompt with an image, beside an unconstrained request that decodes as transformers."""
    import jsonschema

    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.grammar import GrammarSpec
    from vlmctl.runtime.sampling import SamplingParams

    _, engine, hf, proc = model
    eng = Engine(engine)
    tok = eng.tokenizer
    assert len(tok) == eng.vocab_size + 1 == hf.config.image_token_index + 1
    schema = {"type": "object", "properties": {"n": {"type": "integer", "minimum": 1, "maximum": 9},
                                               "c": {"enum": ["red", "green"]}}, "required": ["n", "c"]}
    no_ws = {i: -100.0 for i in range(eng.vocab_size) if tok.decode([i]) and not tok.decode([i]).strip()}
    msgs, imgs = CONVERSATIONS[0]
    constrained = SamplingParams(max_tokens=60, temperature=0, grammar=GrammarSpec.json_schema(schema),
                                 logit_bias=no_ws)
    got, plain = eng.generate([eng.encode(msgs, imgs), eng.encode(msgs, imgs)],
                              [constrained, SamplingParams(max_tokens=8, temperature=0)])
    assert got.finish_reason == "stop"
    jsonschema.validate(json.loads(got.text), schema)
    assert plain.token_ids == strip_eos(hf_greedy(hf, proc, msgs, imgs, 8), hf.generation_config.eos_token_id)
    assert eng.grammar_compiler.vocab_size == eng.vocab_size and eng.grammar_compiler.mask_size == len(tok)


# ---- serving -----------------------------------------------------------------------------------------
def test_metrics_follow_the_cross_attention_pool(model):
    """/metrics' cross-attention gauges are the engine's stats(): blocks held while a request with images
    runs, none once it finished."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams
    from vlmctl.serve.metrics import ServerMetrics

    _, engine, _, _ = model
    eng = Engine(engine)
    metrics = ServerMetrics(eng, "m")

    def gauge(name):
        line = next(ln for ln in metrics.render().decode().splitlines() if ln.startswith(f"vlmctl_{name}{{"))
        return float(line.split()[-1])

    req = eng.submit(eng.encode(*CONVERSATIONS[1]), SamplingParams(max_tokens=4, temperature=0))
    eng.step()  # admitted: its two images' cross-attention blocks are taken
    held = eng.cross_pool.num_used()
    assert held == -(-2 * ROWS // eng.limits.block_size) and gauge("cross_kv_cache_blocks_used") == held
    assert gauge("cross_kv_cache_blocks_total") == eng.cross_pool.capacity == eng.stats()["cross_kv_blocks_total"]
    while not req.finished:
        eng.step()
    assert gauge("cross_kv_cache_blocks_used") == 0


def test_served_concurrent_requests_with_and_without_images(model):
    """`vlmctl serve`'s app (token budget 6): concurrent requests through the official openai client -
    an image, two images, text before the image, and text only - each equal to transformers' greedy
    tokens."""
    import base64
    import io
    from concurrent.futures import ThreadPoolExecutor

    from openai import OpenAI

    from test_serve import start_uvicorn
    from vlmctl.serve import ServerConfig, load_app

    ckpt, engine, hf, proc = model
    eos = hf.generation_config.eos_token_id
    app = load_app(engine, ServerConfig(), max_num_batched_tokens=6, max_batch_size=4)
    url, stop = start_uvicorn(app)

    def part(p):
        if isinstance(p, str):
            return {"type": "text", "text": p}
        buf = io.BytesIO()
        p.save(buf, format="PNG")
        return {"type": "image_url", "image_url": {"url": "data:image/png;base64," +
                                                   base64.b64encode(buf.getvalue()).decode()}}

    jobs = [[make_image(80, SIZES["wide"]), "what is in this image?"],
            [make_image(81, SIZES["square"]), make_image(82, SIZES["tiny"]), "compare"],
            ["hello world!", make_image(83, SIZES["strip"]), "describe the picture"],
            ["Tell me a story about a robot."]]
    try:
        client = OpenAI(base_url=f"{url}/v1", api_key="x", max_retries=0, timeout=120)
        model_id = client.models.list().data[0].id

        def ask(parts):
            r = client.chat.completions.create(model=model_id, messages=[{"role": "user", "content": [
                part(p) for p in parts]}], max_tokens=8, temperature=0)
            return r.choices[0].message.content

        with ThreadPoolExecutor(len(jobs)) as pool:
            answers = list(pool.map(ask, jobs))
        import httpx

        metrics = httpx.get(url + "/metrics", timeout=10).text  # the engine's cross-attention pool, exported
    finally:
        stop()
    pool_blocks = app.state.engine.cross_pool.capacity
    assert pool_blocks > 0
    assert f'vlmctl_cross_kv_cache_blocks_total{{model_name="{model_id}"}} {float(pool_blocks)}' in metrics
    assert f'vlmctl_cross_kv_cache_blocks_used{{model_name="{model_id}"}} 0.0' in metrics
    for parts, content in zip(jobs, answers):
        images = [p for p in parts if not isinstance(p, str)]
        msgs = [user(*[None if not isinstance(p, str) else p for p in parts])]
        ref = strip_eos(hf_greedy(hf, proc, msgs, images, 8), eos)
        assert content == proc.tokenizer.decode(ref, skip_special_tokens=True) and content


# ---- AWQ ---------------------------------------------------------------------------------------------
def _awq_parity(ckpt, eng, tmp_path, capsys, seed):
    from transformers import MllamaForConditionalGeneration

    from tiny_llava_anyres import dequantized_reference
    from vlmctl.models.registry import get_family

    imgs = [make_image(seed, SIZES["wide"]), make_image(seed + 1, SIZES["square"])]
    got = chat_with_images(eng, tmp_path, imgs, capsys, MAX_NEW)
    text = cli_json("chat", eng, "--prompt", "Tell me a story about a robot.", "--max-tokens", str(MAX_NEW),
                    "--json", capsys=capsys)
    hf = dequantized_reference(MllamaForConditionalGeneration, ckpt, eng / "quantize" / "llm", get_family("mllama"))
    proc = load_proc(ckpt)
    eos = hf.generation_config.eos_token_id
    assert got["token_ids"] == strip_eos(hf_greedy(hf, proc, [user(None, None, AWQ_PROMPT)], imgs), eos)
    assert text["token_ids"] == strip_eos(hf_greedy(hf, proc, [user("Tell me a story about a robot.")], []), eos)
    return hf


def test_awq_keeps_cross_attention_layers_float_by_default(tmp_path, capsys):
    """`--set quantization.method=awq` on text calibration: the self-attention layers are quantized,
    the cross-attention layers (which text never reaches) are copied float and listed in
    modules_to_not_convert (both checkpoints), and greedy tokens with two images and without images
    equal transformers' with the dequantized weights."""
    from vlmctl.checkpoint import iter_tensors

    ckpt = make_mllama(tmp_path / "ckpt", seed=11)
    awq_build(ckpt, tmp_path, capsys)
    eng = tmp_path / "eng"
    q = {k: t for k, t, _ in iter_tensors(eng / "quantize" / "llm")}
    conv = {k: t for k, t, _ in iter_tensors(eng / "convert" / "llm")}
    assert "model.layers.0.self_attn.q_proj.qweight" in q and "model.layers.2.mlp.down_proj.qweight" in q
    for k in [n for n in conv if n.startswith(("model.layers.1.", "model.layers.3."))]:
        assert torch.equal(q[k], conv[k]), k  # byte for byte
    assert not any(k.startswith("model.layers.1.") and k.endswith("qweight") for k in q)
    llm_cfg = json.loads((eng / "quantize" / "llm" / "config.json").read_text())["quantization_config"]
    vlm_cfg = json.loads((eng / "quantize" / "vlm" / "config.json").read_text())["quantization_config"]
    cross = {f"layers.{i}.{m}" for i in (1, 3) for m in ("cross_attn.q_proj", "cross_attn.k_proj", "cross_attn.v_proj",
                                                          "cross_attn.o_proj", "mlp.gate_proj", "mlp.up_proj",
                                                          "mlp.down_proj")}
    assert set(llm_cfg["modules_to_not_convert"]) == cross
    assert set(vlm_cfg["modules_to_not_convert"]) == cross | {"vision_model", "multi_modal_projector"}
    info = json.loads((eng / "quantize" / "manifest.json").read_text())["info"]
    assert info["cross_attention"] == {"layers": [1, 3], "mode": "float", "calibrated_with_images": False}
    hf = _awq_parity(ckpt, eng, tmp_path, capsys, 60)
    from transformers.quantizers.quantizers_utils import should_convert_module

    names = [n for n, _ in hf.named_modules()]
    skip = vlm_cfg["modules_to_not_convert"]
    assert not should_convert_module("model.language_model.layers.1.cross_attn.q_proj", skip)
    assert not should_convert_module("model.language_model.layers.3.mlp.down_proj", skip)
    assert should_convert_module("model.language_model.layers.0.self_attn.q_proj", skip)
    assert "model.language_model.layers.1.cross_attn.q_proj" in names


def _calibration_jsonl(d: Path, n: int = 6) -> Path:
    d.mkdir(parents=True, exist_ok=True)
    recs = []
    for i in range(n):
        make_image(100 + i, (30 + 9 * i, 40)).save(d / f"img{i}.png")
        recs.append({"text": CORPUS[i % len(CORPUS)], "image": f"img{i}.png"})
    recs.append({"text": " ".join(CORPUS)})
    (d / "cal.jsonl").write_text("\n".join(json.dumps(r) for r in recs))
    return d / "cal.jsonl"


def test_awq_quantizes_cross_attention_layers_from_image_text_calibration(tmp_path, capsys):
    """`quantization.cross_attention: quantize` with a .jsonl naming images: every decoder linear is
    4-bit, the cross-attention k/v (fed by image states) included; greedy tokens equal transformers'
    with the dequantized weights. Without image records it is one clear error before anything is written."""
    from vlmctl.checkpoint import iter_tensors

    ckpt = make_mllama(tmp_path / "ckpt", seed=12)
    cal = _calibration_jsonl(tmp_path / "cal")
    awq_build(ckpt, tmp_path, capsys, f"quantization.calibration.data={cal}", "quantization.cross_attention=quantize")
    eng = tmp_path / "eng"
    q = {k for k, _, _ in iter_tensors(eng / "quantize" / "llm")}
    for i in (1, 3):
        for m in ("cross_attn.q_proj", "cross_attn.k_proj", "cross_attn.v_proj", "cross_attn.o_proj", "mlp.down_proj"):
            assert f"model.layers.{i}.{m}.qweight" in q and f"model.layers.{i}.{m}.weight" not in q
    llm_cfg = json.loads((eng / "quantize" / "llm" / "config.json").read_text())["quantization_config"]
    assert not llm_cfg["modules_to_not_convert"]
    info = json.loads((eng / "quantize" / "manifest.json").read_text())["info"]
    assert info["cross_attention"] == {"layers": [1, 3], "mode": "quantize", "calibrated_with_images": True}
    _awq_parity(ckpt, eng, tmp_path, capsys, 62)

    _, _, err = awq_build(ckpt, tmp_path / "text", capsys, "quantization.cross_attention=quantize", expect=5)
    assert "error:" in err and "image-text calibration" in err and "Traceback" not in err
    assert not (tmp_path / "text" / "eng" / "quantize").exists()


def test_awq_calibration_pass_reproduces_the_models_forward(model, tmp_path):
    """What AWQ's calibration feeds each layer - token embeddings, the record's image states and the
    additive cross-attention mask and row mask - reproduces transformers' own forward layer by layer,
    for a sample continued with other records' text past its prompt (as generation continues it)."""
    from vlmctl.models.decoders import calibration_layer_kwargs, decoder_family
    from vlmctl.quant.vlm_calibration import cross_attention_calibration, read_image_text_records

    ckpt, engine, hf, proc = model
    cal = _calibration_jsonl(tmp_path / "cal", n=2)
    records = read_image_text_records(str(cal))
    T = 160  # longer than each record's prompt: the rest is other records' text
    x, cross = cross_attention_calibration(engine / "convert", records, 2, T)
    assert x.shape == (2, T, 64) and cross["states"].shape == (2, ROWS, 64)
    inner = hf.model.language_model
    hf.config.text_config._attn_implementation = "sdpa"
    from PIL import Image

    def prompt_ids(r):
        return hf_inputs(proc, [user(None, r["text"])], [Image.open(r["images"][0]).convert("RGB")])["input_ids"][0]

    # which record sample 0 is (the order is shuffled): the one whose prompt begins it
    j = 0
    ids = cross["ids"][j]
    rec = next(r for r in records if r["images"] and ids[:len(prompt_ids(r))].tolist() == prompt_ids(r).tolist())
    img = Image.open(rec["images"][0]).convert("RGB")
    enc = hf_inputs(proc, [user(None, rec["text"])], [img])
    tokens = enc["input_ids"][0]
    assert len(tokens) < T and torch.equal(x[j], inner.embed_tokens.weight[ids])
    cam = enc["cross_attention_mask"]  # generated tokens' rows repeat the last one
    cam = torch.cat([cam, cam[:, -1:].expand(1, T - len(tokens), -1, -1)], 1)
    with torch.no_grad():
        ref = hf(input_ids=ids[None], pixel_values=enc["pixel_values"], aspect_ratio_ids=enc["aspect_ratio_ids"],
                 aspect_ratio_mask=enc["aspect_ratio_mask"], cross_attention_mask=cam,
                 output_hidden_states=True).hidden_states
    fam = decoder_family("mllama_text_model")
    h = x[j:j + 1]
    kwargs = calibration_layer_kwargs(fam, inner.config, inner.rotary_emb, h, torch.arange(T)[None])
    assert torch.allclose(h, ref[0], atol=1e-6)
    with torch.no_grad():
        for i, layer in enumerate(inner.layers):
            kw = dict(kwargs[i], cross_attention_states=cross["states"][j:j + 1],
                      cross_attention_mask=cross["mask"][j:j + 1],
                      full_text_row_masked_out_mask=cross["rowmask"][j:j + 1])
            h = layer(h, **kw)
            h = h[0] if isinstance(h, tuple) else h
            if i + 1 < len(inner.layers):
                assert torch.allclose(h, ref[i + 1], atol=1e-4), i


def test_autoawq_impl_refuses_mllama_cleanly(tmp_path, capsys):
    if __import__("importlib").util.find_spec("awq") is None:
        pytest.skip("autoawq is not installed")
    ckpt = make_mllama(tmp_path / "ckpt", text_layers=3, cross_layers=(1,), vision_layers=2)
    _, _, err = awq_build(ckpt, tmp_path, capsys, "quantization.impl=autoawq", expect=4)
    assert "error:" in err and "mllama_text_model" in err and "Traceback" not in err


# ---- hub shapes, limits, backends -------------------------------------------------------------------
def test_hub_shaped_config():
    """meta-llama/Llama-3.2-11B-Vision-Instruct's config: detected, 4 x 1601 = 6404 rows an image, a
    text decoder with cross-attention layers 3, 8, ..., 38 and 128264 embedding rows, and the hub's
    tensor names map onto transformers 5's and back."""
    from vlmctl.convert import expected_tensors
    from vlmctl.models.base import DECODER, VISION
    from vlmctl.models.decoders import decoder_spec
    from vlmctl.models.registry import detect_family

    cfg = {"architectures": ["MllamaForConditionalGeneration"], "model_type": "mllama", "image_token_index": 128256,
           "text_config": {"model_type": "mllama_text_model", "vocab_size": 128256, "hidden_size": 4096,
                           "intermediate_size": 14336, "num_hidden_layers": 40, "num_attention_heads": 32,
                           "num_key_value_heads": 8, "cross_attention_layers": [3, 8, 13, 18, 23, 28, 33, 38],
                           "max_position_embeddings": 131072, "rope_theta": 500000.0,
                           "rope_scaling": {"rope_type": "llama3", "factor": 8.0, "low_freq_factor": 1.0,
                                            "high_freq_factor": 4.0, "original_max_position_embeddings": 8192}},
           "vision_config": {"model_type": "mllama_vision_model", "hidden_size": 1280, "image_size": 560,
                             "patch_size": 14, "max_num_tiles": 4, "num_hidden_layers": 32, "num_global_layers": 8,
                             "attention_heads": 16, "intermediate_size": 5120, "vision_output_dim": 7680,
                             "intermediate_layers_indices": [3, 7, 15, 23, 30]}}
    fam = detect_family(cfg)
    assert fam.name == "mllama" and fam.max_image_tokens(cfg) == 6404 and fam.image_input == "cross_attention"
    dec = fam.text_config_dict(cfg)
    assert dec["architectures"] == ["MllamaForCausalLM"] and dec["tie_word_embeddings"] is False
    spec = decoder_spec(dec)
    assert spec.cross_layers == (3, 8, 13, 18, 23, 28, 33, 38) and len(spec.self_layers) == 32
    assert spec.embed_rows == 128264 and spec.head_dim == 128
    names = expected_tensors(fam, cfg)
    assert names["model.language_model.embed_tokens.weight"][0] == (128264, 4096)
    assert names["lm_head.weight"][0] == (128256, 4096)
    hub = {"language_model.model.layers.3.cross_attn.k_norm.weight":
           "model.language_model.layers.3.cross_attn.k_norm.weight",
           "language_model.lm_head.weight": "lm_head.weight",
           "vision_model.global_transformer.layers.0.gate_attn":
           "model.vision_model.global_transformer.layers.0.gate_attn",
           "multi_modal_projector.weight": "model.multi_modal_projector.weight"}
    for old, new in hub.items():
        assert fam.canonical_key(old) == new and new in names
        part, inner = fam.split_key(new)
        assert fam.join_key(part, inner) == new
        assert part == (DECODER if "language" in old or "lm_head" in old else VISION)


def test_trtllm_refused_and_auto_picks_torch():
    from vlmctl.errors import StageError
    from vlmctl.models.registry import get_family
    from vlmctl.pipeline import resolve_decoder_backend
    from vlmctl.recipe import Recipe

    fam = get_family("mllama")
    assert resolve_decoder_backend(Recipe(source="x", dtype="bfloat16"), fam) == "torch"
    with pytest.raises(StageError, match="cross-attention"):
        resolve_decoder_backend(Recipe(source="x", dtype="bfloat16", decoder={"backend": "trtllm"}), fam)


def test_build_llm_with_trtllm_is_one_clear_error(model, tmp_path, capsys):
    """`vlmctl build-llm --set decoder.backend=trtllm` on a Llama 3.2 Vision work directory: exit 7,
    one line naming the cross-attention layers, the built decoder left as it was."""
    import shutil

    _, engine, _, _ = model
    work = tmp_path / "eng"
    shutil.copytree(engine, work)
    before = (work / "build-llm" / "config.json").read_text()
    _, _, err = cli("build-llm", work, "--set", "decoder.backend=trtllm", "--set", "dtype=bfloat16", capsys=capsys,
                    expect=7)
    assert err.count("error:") == 1 and "cross-attention" in err and "Traceback" not in err
    assert (work / "build-llm" / "config.json").read_text() == before


def test_bundled_recipes_load():
    from vlmctl.recipe import RECIPES_DIR, load_recipe

    r = load_recipe(RECIPES_DIR / "llama-3.2-11b-vision-instruct.yaml")
    assert r.source == "meta-llama/Llama-3.2-11B-Vision-Instruct" and r.dtype == "bfloat16"
    assert r.decoder.backend == "torch" and r.quantization.method == "none"
    r = load_recipe(RECIPES_DIR / "llama-3.2-90b-vision-instruct.yaml")
    assert r.source == "meta-llama/Llama-3.2-90B-Vision-Instruct" and r.quantization.method == "awq"
    assert r.quantization.cross_attention == "float" and r.decoder.backend == "torch"
    for r in (load_recipe(RECIPES_DIR / f"llama-3.2-{s}-vision-instruct.yaml") for s in ("11b", "90b")):
        assert r.limits.max_input_len + r.limits.max_output_len <= 131072 and r.limits.max_images_per_request >= 1


# ---- on a CUDA device (marked gpu; run on the GPU machine: `pytest -m gpu tests/test_mllama.py`) ----
needs_cuda = pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")


@pytest.fixture(scope="module")
def gpu_engine(tmp_path_factory):
    """fp16, head_dim 32 (the Triton kernels' path: paged decode over the cross-attention pool)."""
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    d = tmp_path_factory.mktemp("mllama-gpu")
    ckpt = make_mllama(d / "ckpt", hidden=128, init_range=0.1)
    recipe = load_recipe(write_recipe(d / "r.yaml", ckpt, dtype="float16", profiles=[],
                                      limits={"max_batch_size": 8, "max_input_len": 256, "max_output_len": 64,
                                              "max_images_per_request": 2}))
    build(recipe, d / "eng")
    return d / "eng"


def _gpu_prompts(eng, n):
    out = []
    for i in range(n):
        if i % 3 == 2:
            out.append(eng.encode([user("Tell me a story about a robot.")], []))
        else:
            k = 1 + i % 2
            out.append(eng.encode([user(*([None] * k), "what is in this image?")],
                                  [make_image(10 * i + j, (30 + 7 * j, 40)) for j in range(k)]))
    return out


def _gpu_run(path, n=6, max_tokens=24, device="cuda", logprobs=None, **opts):
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    opts.setdefault("kv_cache_tokens", 4096)
    eng = Engine(path, device=device, **opts)
    params = SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True, logprobs=logprobs)
    done = eng.generate(_gpu_prompts(eng, n), params)
    return (eng, [c.token_ids for c in done]) + ((([c.logprobs for c in done]),) if logprobs else ())


@pytest.mark.gpu
@needs_cuda
def test_gpu_graphed_decode_equals_eager(gpu_engine, monkeypatch):
    """Decode steps mixing requests with and without images replay the graphs captured with the
    cross-attention layers; text-only steps the ones without; tokens equal the eager run's."""
    # decode graphs alone (prompt steps replayed from graphs attend through another kernel than eager ones)
    monkeypatch.setenv("VLMCTL_STEP_GRAPH_ROWS", "0")
    eng_g, graphed = _gpu_run(gpu_engine, cuda_graphs=True)
    eng_e, eager = _gpu_run(gpu_engine, cuda_graphs=False)
    assert eng_g.decoder.use_graphs and not eng_e.decoder.use_graphs
    assert any(k[1] for k in eng_g.decoder._graphs) and any(not k[1] for k in eng_g.decoder._graphs)
    assert graphed == eager


@pytest.mark.gpu
@needs_cuda
def test_gpu_async_scheduling_equals_synchronous_steps(gpu_engine):
    """Steps launched before the last step's tokens are read (the default on a GPU) replay the same graphs,
    with and without the cross-attention layers, and give the synchronous engine's tokens."""
    eng_a, ahead = _gpu_run(gpu_engine)
    eng_s, sync = _gpu_run(gpu_engine, async_scheduling=False)
    assert eng_a.async_scheduling and eng_a.steps_ahead > 0 and eng_s.steps_ahead == 0
    assert any(k[1] for k in eng_a.decoder._graphs)
    assert ahead == sync


@pytest.mark.gpu
@needs_cuda
def test_gpu_chunked_prefix_and_preempted_runs_match_a_plain_run(gpu_engine):
    """fp16: equal tokens but for near-ties (parity.assert_equal_but_near_ties says why); on an H200 one
    of six Mllama sequences took the other side of an exact tie (-3.2774 nats both) at its 23rd
    token when chunked."""
    _, plain, plain_lps = _gpu_run(gpu_engine, cuda_graphs=False, logprobs=2)
    _, chunked = _gpu_run(gpu_engine, cuda_graphs=False, max_num_batched_tokens=8, max_batch_size=4, block_size=4)
    assert assert_equal_but_near_ties(chunked, plain, plain_lps) <= 1
    small, pre = _gpu_run(gpu_engine, cuda_graphs=False, block_size=4, kv_cache_tokens=200,
                          enable_prefix_caching=False)
    assert assert_equal_but_near_ties(pre, plain, plain_lps) <= 1
    assert small.scheduler.preemptions > 0 and small.cross_pool.num_used() == 0


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
