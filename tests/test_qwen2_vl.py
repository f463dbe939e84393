"""Qwen2-VL and Qwen2.5-VL (families `qwen2_vl`, `qwen2_5_vl`) against transformers.

- greedy parity: `vlmctl build` + `vlmctl chat --json` == `generate` (fp32, CPU), with images of
  different sizes and aspect ratios (inside, above and below the processor's pixel range) and two
  images in one message;
- vision: ONNX Runtime == the torch wrapper == transformers' own `get_image_features`, at patch
  counts the export never saw, several images of different grids in one call;
- M-RoPE positions == `get_rope_index`; continuous batching == requests alone (per-slot rope deltas);
- AWQ: the AWQ engine's greedy tokens == transformers with the same dequantized decoder weights.

The reference prompt is built the way Qwen2VLProcessor builds it (its video processor needs
torchvision, which is not installable here): chat template, image processor, each `<|image_pad|>`
repeated grid_thw.prod() // merge_size**2 times, mm_token_type_ids marking the image tokens.
"""

from __future__ import annotations

import json
from pathlib import Path

import numpy as np
import pytest
import torch

from conftest import cli, cli_json, write_recipe
from parity import assert_greedy_parity, parity_test, strip_eos
from tiny_models import make_image, make_qwen2_vl

VERSIONS = {"qwen2_vl": "2", "qwen2_5_vl": "2.5"}


def _hf_class(version: str):
    import transformers

    return (transformers.Qwen2VLForConditionalGeneration if version == "2"
            else transformers.Qwen2_5_VLForConditionalGeneration)


def hf_inputs(ckpt: Path, messages: list[dict], images: list, **image_kwargs) -> dict:
    from transformers import AutoImageProcessor, AutoTokenizer

    tok = AutoTokenizer.from_pretrained(ckpt)
    ip = AutoImageProcessor.from_pretrained(ckpt, **image_kwargs)
    text = tok.apply_chat_template(messages, chat_template=(ckpt / "chat_template.jinja").read_text(),
                                   add_generation_prompt=True, tokenize=False)
    inputs: dict = {}
    if images:
        inputs.update(ip(images=images, return_tensors="pt"))
        parts = text.split("<|image_pad|>")
        counts = [int(g.prod()) // ip.merge_size ** 2 for g in inputs["image_grid_thw"]]
        text = parts[0] + "".join("<|image_pad|>" * n + p for n, p in zip(counts, parts[1:]))
    enc = tok(text, return_tensors="pt")
    inputs["input_ids"], inputs["attention_mask"] = enc["input_ids"], enc["attention_mask"]
    image_id = tok.convert_tokens_to_ids("<|image_pad|>")
    inputs["mm_token_type_ids"] = (enc["input_ids"] == image_id).int()
    return inputs


def hf_greedy(ckpt: Path, version: str, messages, images, max_new_tokens: int, model=None, **image_kwargs):
    model = model or _hf_class(version).from_pretrained(ckpt, dtype=torch.float32).eval()
    inputs = hf_inputs(ckpt, messages, images, **image_kwargs)
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=max_new_tokens, do_sample=False)
    return out[0, inputs["input_ids"].shape[1]:].tolist()


def eos_ids(ckpt: Path) -> set[int]:
    e = json.loads((ckpt / "generation_config.json").read_text())["eos_token_id"]
    return set(e if isinstance(e, list) else [e])




def user(prompt: str, n_images: int) -> list[dict]:
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": prompt}]}]


# (family, checkpoint kwargs, image sizes (w, h), prompt). The processor's range is 256..4096 pixels:
# (100, 80) is scaled down, (10, 12) scaled up; (20, 50) is tall, (64, 40) wide.
CASES = [
    ("qwen2_vl", {}, [(40, 30)], "what is in this image?"),
    ("qwen2_vl", {"num_kv_heads": 1, "tie": True, "seed": 1}, [(20, 50), (100, 80)], "describe the picture"),
    ("qwen2_5_vl", {"seed": 2}, [(64, 40)], "hello world!"),
    ("qwen2_5_vl", {"num_kv_heads": 4, "seed": 3, "fullatt_block_indexes": (0, 2)}, [(100, 80), (10, 12)],
     "Tell me a story about a robot."),
]


@pytest.mark.parametrize("family,kwargs,sizes,prompt", CASES,
                         ids=["qwen2-one-image", "qwen2-two-images-mqa-tied", "qwen2.5-one-image",
                              "qwen2.5-two-images-mha"])
@parity_test('qwen2_vl', 'qwen2_5_vl')
def test_chat_json_matches_transformers_generate(tmp_path, capsys, family, kwargs, sizes, prompt):
    version = VERSIONS[family]
    ckpt = make_qwen2_vl(tmp_path / "ckpt", version=version, **kwargs)
    recipe = write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_images_per_request": len(sizes)})
    build = cli_json("build", recipe, "-o", tmp_path / "eng", "--json", capsys=capsys)
    assert json.loads((tmp_path / "eng" / "convert" / "family.json").read_text())["family"] == family, build
    image_args, images = [], []
    for i, size in enumerate(sizes):
        img = make_image(20 + i, size)
        img.save(tmp_path / f"img{i}.png")
        images.append(img)
        image_args += ["--image", tmp_path / f"img{i}.png"]
    got = cli_json("chat", tmp_path / "eng", *image_args, "--prompt", prompt, "--temperature", "0",
                   "--max-tokens", "12", "--json", capsys=capsys)
    ref = hf_greedy(ckpt, version, user(prompt, len(sizes)), images, 12)
    assert_greedy_parity(got["token_ids"], ref, eos_ids(ckpt))
    assert got["finish_reason"] == ("stop" if len(got["token_ids"]) < len(ref) else "length")


@pytest.fixture(scope="module", params=list(VERSIONS))
def built(request, tmp_path_factory):
    """A built engine per version (fp32, embedded backends, up to 3 images a request)."""
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    family = request.param
    d = tmp_path_factory.mktemp(family)
    ckpt = make_qwen2_vl(d / "ckpt", version=VERSIONS[family], seed=7)
    recipe = load_recipe(write_recipe(d / "r.yaml", ckpt, limits={"max_images_per_request": 3, "max_batch_size": 3}))
    build(recipe, d / "eng")
    return family, ckpt, d / "eng"


def test_vision_onnx_torch_and_transformers_agree(built):
    """The exported graph at patch counts it was not exported with (3 images of other grids in one
    call, block-diagonal masks) == the torch wrapper == transformers' get_image_features."""
    from vlmctl.export.onnx_vision import EXPORT_BATCH, ort_session
    from vlmctl.models.registry import get_family

    family, ckpt, eng = built
    fam = get_family(family)
    report = json.loads((eng / "export-vision" / "manifest.json").read_text())["info"]
    assert report["max_abs_error"] <= 1e-4 and report["validate_batch"] != EXPORT_BATCH
    proc = fam.load_processor(eng / "convert" / "processor")
    images = [make_image(30, (52, 36)), make_image(31, (24, 70)), make_image(32, (90, 90))]
    prompt = proc.encode(user("hi", 3), images)
    export_patches = fam.example_vision_inputs(json.loads((eng / "convert" / "vision" / "config.json").read_text()),
                                               EXPORT_BATCH, torch.float32)["pixel_values"].shape[0]
    feed, sizes = proc.collate(prompt.images)
    assert feed["pixel_values"].shape[0] != export_patches
    assert len({it.meta["grid_thw"] for it in prompt.images}) == 3

    def per_image(out):
        return np.concatenate([proc.postprocess_features(c, it)
                               for c, it in zip(np.split(out, np.cumsum(sizes)[:-1]), prompt.images)])

    got = per_image(ort_session(eng / "export-vision" / "model.onnx", ["CPUExecutionProvider"]).run(None, feed)[0])
    module = fam.build_vision_module(eng / "convert" / "vision", torch.float32)
    with torch.no_grad():
        ref = per_image(module(*[torch.from_numpy(v) for v in feed.values()]).numpy())
    model = _hf_class(VERSIONS[family]).from_pretrained(ckpt, dtype=torch.float32).eval()
    with torch.no_grad():
        hf = fam.hf_image_features(model, proc.image_processor(images=images, return_tensors="pt")).numpy()
    rows = sum(it.num_tokens for it in prompt.images)
    assert got.shape == ref.shape == hf.shape == (rows, model.config.text_config.hidden_size)
    assert np.abs(got - ref).max() < 1e-4
    assert np.abs(got - hf).max() < 1e-4
    assert np.abs(hf).max() > 0.1  # features are not vanishingly small (the check above means something)
    # One image alone gives the same rows as inside the joint call (the masks isolate images).
    single, _ = proc.collate(prompt.images[1:2])
    with torch.no_grad():
        alone = proc.postprocess_features(module(*[torch.from_numpy(v) for v in single.values()]).numpy(),
                                          prompt.images[1])
    n0 = prompt.images[0].num_tokens
    assert np.abs(alone - ref[n0:n0 + prompt.images[1].num_tokens]).max() < 1e-5


def test_tokens_and_mrope_positions_match_transformers(built):
    from vlmctl.models.registry import get_family

    family, ckpt, eng = built
    fam = get_family(family)
    proc = fam.load_processor(eng / "convert" / "processor")
    images = [make_image(40, (30, 60)), make_image(41, (72, 24))]
    messages = [{"role": "system", "content": "be brief"}] + user("compare", 2)
    prompt = proc.encode(messages, images)
    ref = hf_inputs(ckpt, messages, images)
    assert prompt.token_ids == ref["input_ids"][0].tolist()
    assert [it.num_tokens for it in prompt.images] == [proc.num_image_tokens(im.size) for im in images]
    model = _hf_class(VERSIONS[family]).from_pretrained(ckpt, dtype=torch.float32).eval()
    pos, delta = model.model.get_rope_index(ref["input_ids"], ref["mm_token_type_ids"],
                                            image_grid_thw=ref["image_grid_thw"])
    ours = proc.position_ids(prompt.token_ids, prompt)
    np.testing.assert_array_equal(ours, pos[:, 0].numpy())
    assert int(ours.max()) + 1 - len(prompt.token_ids) == int(delta[0, 0]) < 0  # the engine's rope_delta
    assert proc.position_ids(prompt.token_ids[:5], proc.encode(user("x", 0), [])) is None


def test_batch_of_different_requests_matches_each_alone(built):
    """Continuous batching with different rope deltas per slot decodes like each request alone."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    family, ckpt, eng = built
    engine = Engine(eng)
    prompts = [engine.encode(user("what is in this image?", 1), [make_image(50, (40, 30))]),
               engine.encode(user("hello", 0), []),
               engine.encode(user("describe the picture in one sentence.", 2),
                             [make_image(51, (20, 50)), make_image(52, (64, 40))])]
    params = SamplingParams(max_tokens=8, temperature=0)
    alone = [engine.generate([p], params)[0].token_ids for p in prompts]
    together = [c.token_ids for c in engine.generate(prompts, params)]
    assert together == alone
    assert engine.max_running_seen >= 2
    ref = hf_greedy(ckpt, VERSIONS[family], user("describe the picture in one sentence.", 2),
                    [make_image(51, (20, 50)), make_image(52, (64, 40))], 8)
    assert alone[2] == strip_eos(ref, eos_ids(ckpt))


def test_checkpoint_names_round_trip():
    from vlmctl.models.base import DECODER, VISION
    from vlmctl.models.registry import detect_family, get_family

    for family in VERSIONS:
        fam = get_family(family)
        assert detect_family({"architectures": list(fam.architectures)}).name == family
        for hub, canonical, part, inner in [
            ("visual.blocks.0.attn.qkv.weight", "model.visual.blocks.0.attn.qkv.weight", VISION,
             "visual.blocks.0.attn.qkv.weight"),
            ("model.layers.1.mlp.up_proj.weight", "model.language_model.layers.1.mlp.up_proj.weight", DECODER,
             "model.layers.1.mlp.up_proj.weight"),
            ("lm_head.weight", "lm_head.weight", DECODER, "lm_head.weight"),
        ]:
            assert fam.canonical_key(hub) == canonical and fam.canonical_key(canonical) == canonical
            assert fam.split_key(canonical) == (part, inner)
            assert fam.join_key(part, inner) == canonical
        assert fam.vision_module_names() == ["visual"]


def dequantized_hf_model(ckpt: Path, version: str, vlm_dir: Path, group_size: int):
    """transformers' model of `ckpt` with every decoder tensor taken from the whole-VLM AWQ checkpoint
    `vlm_dir` (packed linears dequantized; norms and biases as AWQ's scaling left them)."""
    from safetensors.torch import load_file

    from vlmctl.formats.awq_gemm import dequantize_gemm

    model = _hf_class(version).from_pretrained(ckpt, dtype=torch.float32).eval()
    awq = {}
    for f in sorted(vlm_dir.glob("*.safetensors")):
        awq.update(load_file(str(f)))
    state = model.state_dict()
    new, packed = {}, 0
    for name, t in awq.items():
        if name.endswith(".qweight"):
            p = name[: -len(".qweight")]
            new[p + ".weight"] = dequantize_gemm(t, awq[p + ".qzeros"], awq[p + ".scales"], 4, group_size)
            packed += 1
        elif not name.endswith((".qzeros", ".scales")):
            new[name] = t.float()
    assert packed == 7 * model.config.text_config.num_hidden_layers
    assert set(new) <= set(state), sorted(set(new) - set(state))[:3]
    assert not any(k.startswith("model.visual.") and not torch.equal(new[k], state[k]) for k in new)
    model.load_state_dict({**state, **new})
    return model


# One version: the decoder, its AWQ groups and the checkpoint names are the same for both.
@pytest.mark.parametrize("family", ["qwen2_5_vl"])
def test_awq_build_matches_transformers_on_dequantized_weights(tmp_path, capsys, family):
    version = VERSIONS[family]
    ckpt = make_qwen2_vl(tmp_path / "ckpt", version=version, seed=11)
    recipe = write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_images_per_request": 2})
    group = 32  # divides the tiny decoder's 64 and 128 input features
    cli("build", recipe, "-o", tmp_path / "eng", "--set", "quantization.method=awq",
        "--set", f"quantization.group_size={group}", "--set", "quantization.calibration.samples=8",
        "--set", "quantization.calibration.seq_len=64", capsys=capsys)
    vlm = tmp_path / "eng" / "quantize" / "vlm"
    qcfg = json.loads((vlm / "config.json").read_text())["quantization_config"]
    assert qcfg["group_size"] == group and qcfg["modules_to_not_convert"] == ["visual"]
    llm_cfg = json.loads((tmp_path / "eng" / "build-llm" / "config.json").read_text())["decoder"]
    assert llm_cfg["quantization"]["method"] == "awq" and llm_cfg["mrope_section"] == [2, 3, 3]
    sizes = [(52, 36), (24, 70)]
    image_args, images = [], []
    for i, size in enumerate(sizes):
        img = make_image(60 + i, size)
        img.save(tmp_path / f"img{i}.png")
        images.append(img)
        image_args += ["--image", tmp_path / f"img{i}.png"]
    prompt = "describe the picture in one sentence."
    got = cli_json("chat", tmp_path / "eng", *image_args, "--prompt", prompt, "--temperature", "0",
                   "--max-tokens", "12", "--json", capsys=capsys)
    model = dequantized_hf_model(ckpt, version, vlm, group)
    ref = hf_greedy(ckpt, version, user(prompt, len(sizes)), images, 12, model=model)
    assert got["token_ids"] == strip_eos(ref, eos_ids(ckpt))
    # The quantization is real: the float model answers differently.
    assert ref != hf_greedy(ckpt, version, user(prompt, len(sizes)), images, 12)


def test_recipe_pixel_range_overrides_the_checkpoint(tmp_path, capsys):
    """`image.min_pixels` / `image.max_pixels` reach the engine's processor (tokens per image, the
    prompt-table bound, TensorRT's patch-axis profile) and still match transformers given the same."""
    from vlmctl.errors import RecipeError
    from vlmctl.models.registry import get_family

    ckpt = make_qwen2_vl(tmp_path / "ckpt", version="2.5", seed=5)  # checkpoint range: 256..4096 pixels
    recipe = write_recipe(tmp_path / "r.yaml", ckpt, image={"min_pixels": 512, "max_pixels": 1024},
                          limits={"max_images_per_request": 2})
    cli("build", recipe, "-o", tmp_path / "eng", capsys=capsys)
    eng = tmp_path / "eng"
    llm = json.loads((eng / "build-llm" / "config.json").read_text())
    assert llm["image_tokens_per_image"] == 1024 // 8 ** 2
    profile = json.loads((eng / "build-vision" / "manifest.json").read_text())["settings"]["profile"]
    assert profile["pixel_values"] == [[4, 96], [16, 96], [2 * 1024 // 16, 96]]
    assert set(profile) == {"pixel_values", "vision_pos_ids", "attention_segments", "window_segments"}
    images = [make_image(70, (100, 80)), make_image(71, (10, 12))]  # scaled down, scaled up
    for i, img in enumerate(images):
        img.save(tmp_path / f"img{i}.png")
    got = cli_json("chat", eng, "--image", tmp_path / "img0.png", "--image", tmp_path / "img1.png", "--prompt",
                   "hello", "--max-tokens", "10", "--json", capsys=capsys)
    ref_inputs = hf_inputs(ckpt, user("hello", 2), images, min_pixels=512, max_pixels=1024)
    assert got["prompt_tokens"] == ref_inputs["input_ids"].shape[1]
    assert all(512 <= int(g.prod()) * 4 * 4 <= 1024 for g in ref_inputs["image_grid_thw"])  # 4x4-pixel patches
    ref = hf_greedy(ckpt, "2.5", user("hello", 2), images, 10, min_pixels=512, max_pixels=1024)
    assert got["token_ids"] == strip_eos(ref, eos_ids(ckpt))
    with pytest.raises(RecipeError, match="image.max_pixels"):
        get_family("llava").apply_image_settings(tmp_path, {"max_pixels": 1024})
    bad = write_recipe(tmp_path / "bad.yaml", ckpt, image={"min_pixels": 4096, "max_pixels": 1024})
    code, _, err = cli("build", bad, "-o", tmp_path / "eng2", capsys=capsys, expect=None)
    assert code != 0 and "max_pixels" in err


def test_fp16_vision_graph_exports_and_validates(built, tmp_path):
    """The recipes' fp16 profile: an fp16 graph (masks and rotary built in-graph without float32
    constants leaking into fp16 ops) that ONNX Runtime loads and that stays close to torch."""
    import onnxruntime

    from vlmctl.export.onnx_vision import export_vision_onnx
    from vlmctl.models.registry import get_family

    family, _, eng = built
    report = export_vision_onnx(get_family(family), eng / "convert" / "vision", tmp_path, dtype="float16")
    assert report["onnx_dtype"] == "float16" and report["cosine"] > 0.9999
    types = {i.name: i.type for i in onnxruntime.InferenceSession(str(tmp_path / "model.onnx")).get_inputs()}
    assert types["pixel_values"] == "tensor(float16)" and types["attention_segments"] == "tensor(int64)"


def test_serve_openai_client_two_images(built):
    """`vlmctl serve`'s app over real HTTP with the official client: two data-URL images of different
    sizes in one message answer what transformers answers (greedy)."""
    import base64
    import io
    import socket
    import threading
    import time

    import uvicorn
    from openai import OpenAI

    from vlmctl.serve import ServerConfig, load_app

    family, ckpt, eng = built
    images = [make_image(80, (30, 60)), make_image(81, (90, 40))]

    def data_url(img) -> str:
        buf = io.BytesIO()
        img.save(buf, "PNG")
        return "data:image/png;base64," + base64.b64encode(buf.getvalue()).decode()

    app = load_app(eng, ServerConfig(api_keys=["k"]))
    sock = socket.socket()
    sock.bind(("127.0.0.1", 0))
    server = uvicorn.Server(uvicorn.Config(app, log_level="warning", lifespan="on"))
    thread = threading.Thread(target=server.run, kwargs={"sockets": [sock]}, daemon=True)
    thread.start()
    try:
        deadline = time.monotonic() + 60
        while not server.started:
            assert thread.is_alive() and time.monotonic() < deadline, "server did not start"
            time.sleep(0.05)
        client = OpenAI(base_url=f"http://127.0.0.1:{sock.getsockname()[1]}/v1", api_key="k", max_retries=0)
        content = [{"type": "image_url", "image_url": {"url": data_url(im)}} for im in images]
        messages = [{"role": "user", "content": content + [{"type": "text", "text": "compare the pictures"}]}]
        r = client.chat.completions.create(model=client.models.list().data[0].id, temperature=0, max_tokens=10,
                                           messages=messages)
    finally:
        server.should_exit = True
        thread.join(30)
        sock.close()
    ref = strip_eos(hf_greedy(ckpt, VERSIONS[family], user("compare the pictures", 2), images, 10), eos_ids(ckpt))
    from transformers import AutoTokenizer

    assert r.choices[0].message.content == AutoTokenizer.from_pretrained(ckpt).decode(ref, skip_special_tokens=True)
    assert r.usage.completion_tokens == len(ref)
    assert r.usage.prompt_tokens == hf_inputs(ckpt, user("compare the pictures", 2), images)["input_ids"].shape[1]


def test_trtllm_refuses_an_mrope_decoder(built, tmp_path):
    """A plain TensorRT-LLM causal-LM engine would rotate image tokens by 1-D positions: refused
    before TensorRT-LLM is even needed, and the bundled recipes pick the embedded decoder."""
    from vlmctl.errors import BackendUnavailableError
    from vlmctl.export.trtllm import build_trtllm_engine
    from vlmctl.models.registry import get_family
    from vlmctl.pipeline import resolve_decoder_backend
    from vlmctl.recipe import load_recipe

    _, _, eng = built
    with pytest.raises(BackendUnavailableError, match="M-RoPE"):
        build_trtllm_engine(eng / "convert" / "llm", tmp_path / "out", recipe=None, family=get_family("qwen2_vl"),
                            extra_config={})
    for name in ("qwen2-vl-2b-instruct", "qwen2-vl-7b-instruct", "qwen2.5-vl-3b-instruct", "qwen2.5-vl-7b-instruct"):
        r = load_recipe(name)
        assert r.decoder.backend == "torch" and r.image.max_pixels == 1280 * 28 * 28
    # the backend choice asks the family: `auto` takes the torch decoder, `trtllm` is refused with the reason
    from vlmctl.errors import StageError
    from vlmctl.recipe import Recipe

    for name in ("qwen2_vl", "qwen2_5_vl"):
        fam = get_family(name)
        assert resolve_decoder_backend(Recipe(source="x", dtype="float16"), fam) == "torch"
        with pytest.raises(StageError, match="M-RoPE"):
            resolve_decoder_backend(Recipe(source="x", dtype="float16", decoder={"backend": "trtllm"}), fam)


def test_load_time_warm_steps_touch_only_block_0(built):
    """What a CUDA engine runs at load (`TorchDecoder.warm_forward`) works for this family's decoder and
    writes only the scratch KV block 0."""
    from conftest import assert_warm_steps_touch_only_block_0
    from vlmctl.runtime.engine import Engine

    assert_warm_steps_touch_only_block_0(Engine(built[2]).decoder)
