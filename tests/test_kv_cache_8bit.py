"""The 8-bit KV cache (`--kv-cache-dtype fp8 | int8`, vlmctl/runtime/kv_quant.py) against transformers running
the same model with a cache that stores each K/V row of a (token, head) the way the format does: e4m3 with the
row's largest magnitude / 448 as its scale, or integers with largest magnitude / 127. Greedy tokens must match
and every chosen token's logprob must agree to float32 noise, while the same reference without the rounding
differs by far more: the engine really reads K/V as stored. The formats are restated here from their
definitions (torch's own e4m3 cast and round), not imported."""

from __future__ import annotations

import pytest
import torch

from conftest import cli, write_recipe
from tiny_models import make_image, make_llava


def rows_8bit(x: torch.Tensor, kind: str) -> torch.Tensor:
    """x [..., d] as an 8-bit pool holds it: per row over the last axis, scale = max |x| / 448 (fp8) or / 127
    (int8), 1 for a row of zeros; the row / scale cast to e4m3, or rounded to an integer."""
    top = 448.0 if kind == "fp8" else 127.0
    xf = x.float()
    amax = xf.abs().amax(-1, keepdim=True)
    scale = torch.where(amax > 0, amax / top, torch.ones_like(amax))
    y = (xf / scale).clamp(-top, top)
    y = y.to(torch.float8_e4m3fn).float() if kind == "fp8" else torch.round(y)
    return (y * scale).to(x.dtype)


def row_cache_8bit(config, kind, layers=None):
    """A transformers DynamicCache whose K/V go through `rows_8bit` (in `layers` only, when given) before
    they are stored and attended to."""
    from transformers import DynamicCache

    class RowCache8(DynamicCache):
        def update(self, key_states, value_states, layer_idx, *args, **kwargs):
            if layers is None or layer_idx in layers:
                key_states, value_states = rows_8bit(key_states, kind), rows_8bit(value_states, kind)
            return super().update(key_states, value_states, layer_idx, *args, **kwargs)

    return RowCache8(config=config)


def hf_logprobs(model, inputs, n, cache=None) -> tuple[list[int], list[float]]:
    """Greedy tokens of transformers' generate and each one's logprob (log-softmax of its step's logits)."""
    with torch.no_grad():
        out = model.generate(**inputs, max_new_tokens=n, min_new_tokens=n, do_sample=False, output_logits=True,
                             return_dict_in_generate=True, past_key_values=cache)
    ids = out.sequences[0, inputs["input_ids"].shape[1]:].tolist()
    return ids, [float(torch.log_softmax(lg[0].float(), -1)[t]) for lg, t in zip(out.logits, ids)]


def engine_logprobs(engine_dir, messages, images, n, kv_cache_dtype) -> tuple[list[int], list[float]]:
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    eng = Engine(engine_dir, device="cpu", kv_cache_dtype=kv_cache_dtype)
    assert eng.decoder.k_cache.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kv_cache_dtype]
    done = eng.chat(messages, images, SamplingParams(max_tokens=n, temperature=0, logprobs=0, ignore_eos=True))
    return done.token_ids, [lp["logprob"] for lp in done.logprobs]


def check_against(ours, quantized, plain) -> None:
    """Tokens equal; logprobs at float32 noise for most steps. A value computed a rounding apart by the two
    (another GEMM shape) can land on the other side of a quantization step, and that row then differs by one
    step for the rest of the run, so the largest difference is held to a tenth of what the rounding itself
    moves the logprobs (the unrounded reference against the rounded one), not to the noise."""
    assert ours[0] == quantized[0], f"8-bit engine {ours[0]} != transformers with the 8-bit cache {quantized[0]}"
    diffs = sorted(abs(a - b) for a, b in zip(ours[1], quantized[1]))
    k = next((i for i, (a, b) in enumerate(zip(plain[0], quantized[0])) if a != b), len(plain[0]))
    far = max(abs(plain[1][i] - quantized[1][i]) for i in range(k)) if k else 1.0
    assert diffs[len(diffs) // 2] < 1e-5, f"8-bit engine's logprobs: median {diffs[len(diffs) // 2]:.2e} off"
    assert diffs[-1] < far / 10, f"8-bit engine's logprobs up to {diffs[-1]:.2e} off; the rounding moves them {far:.2e}"
    assert far > 1e-3, f"the 8-bit rounding moved the logprobs by only {far:.2e}"


@pytest.mark.parametrize("kind", ["fp8", "int8"])
@pytest.mark.parametrize("kwargs", [{"num_kv_heads": 2}, {"num_kv_heads": 1, "seed": 2, "tie": True}],
                         ids=["gqa", "mqa-tied"])
def test_llava_8bit_kv_matches_transformers_with_an_8bit_cache(tmp_path, capsys, kwargs, kind):
    from transformers import AutoProcessor, LlavaForConditionalGeneration

    ckpt = make_llava(tmp_path / "ckpt", **kwargs)
    cli("build", write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_batch_size": 2}), "-o", tmp_path / "eng",
        capsys=capsys)
    img = make_image(3, (40, 30))
    messages = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe the picture"}]}]
    proc = AutoProcessor.from_pretrained(ckpt)
    model = LlavaForConditionalGeneration.from_pretrained(ckpt, dtype=torch.float32).eval()
    inputs = proc(images=[img], text=proc.apply_chat_template(messages, add_generation_prompt=True),
                  return_tensors="pt")
    n = 16
    check_against(engine_logprobs(tmp_path / "eng", messages, [img], n, kind),
                  hf_logprobs(model, inputs, n, row_cache_8bit(model.config, kind)), hf_logprobs(model, inputs, n))


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_gemma3_8bit_kv_with_sliding_window_and_image_blocks(tmp_path, kind):
    """Sliding-window layers (window 12 < an image's 16 rows) and image rows that see each other."""
    from family_helpers import build_engine
    from test_gemma3 import hf_inputs, load_hf, load_proc, user
    from tiny_gemma3 import make_gemma3

    ckpt = make_gemma3(tmp_path / "ckpt")
    engine_dir = build_engine(ckpt, tmp_path)
    model, proc = load_hf(ckpt), load_proc(ckpt)
    img = make_image(5, (64, 64))
    messages = [user(1, "what is this?")]
    inputs = hf_inputs(proc, messages, [img])
    n = 14
    check_against(engine_logprobs(engine_dir, messages, [img], n, kind),
                  hf_logprobs(model, inputs, n, row_cache_8bit(model.config, kind)), hf_logprobs(model, inputs, n))


def test_8bit_pool_holds_more_tokens_in_the_same_bytes(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine

    plain = Engine(tiny_llava_engine, device="cpu")
    fp8 = Engine(tiny_llava_engine, device="cpu", kv_cache_dtype="fp8")
    dec16, dec8 = plain.decoder, fp8.decoder
    per16, per8 = dec16.kv_bytes_per_token(), dec8.kv_bytes_per_token()
    # one byte a value against four (this engine is float32), plus a float32 scale a row of head_dim values
    rows = 2 * dec8.n_self_layers * dec8.n_kv
    assert per8 == rows * (dec8.head_dim + 4) and per16 == rows * dec16.head_dim * 4
    used = sum(t.numel() * t.element_size() for t in (dec8.k_cache, dec8.v_cache, dec8.k_scale, dec8.v_scale))
    assert used == per8 * dec8.num_blocks * dec8.block_size
    assert dec16.k_scale is None and dec8.k_scale.dtype == torch.float32


def test_kv_cache_dtype_is_checked(tiny_llava_engine, capsys):
    from conftest import one_error_line

    code, _, err = cli("chat", tiny_llava_engine, "--prompt", "hi", "--kv-cache-dtype", "int4", "--json",
                       capsys=capsys, expect=None)
    line = one_error_line(code, err, 2)
    assert "--kv-cache-dtype" in line and "fp8" in line


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_qwen2_vl_8bit_kv_with_mrope(tmp_path, kind):
    """M-RoPE (3-D positions): the rotated keys are what is rounded and stored."""
    from test_qwen2_vl import _hf_class, hf_inputs, user

    from tiny_models import make_qwen2_vl
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    ckpt = make_qwen2_vl(tmp_path / "ckpt", version="2", num_kv_heads=1, seed=4)
    build(load_recipe(write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_batch_size": 2})), tmp_path / "eng")
    img = make_image(21, (64, 40))
    messages = user("describe the picture", 1)
    model = _hf_class("2").from_pretrained(ckpt, dtype=torch.float32).eval()
    inputs = hf_inputs(ckpt, messages, [img])
    n = 14
    check_against(engine_logprobs(tmp_path / "eng", messages, [img], n, kind),
                  hf_logprobs(model, inputs, n, row_cache_8bit(model.config, kind)), hf_logprobs(model, inputs, n))


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_mllama_8bit_kv_rounds_self_attention_only(tmp_path, kind):
    """Llama 3.2 Vision: the self-attention layers' pool is 8-bit; the cross-attention pool (image K/V, computed
    once at admission) stays in the model dtype, so the reference rounds only the self-attention layers."""
    from family_helpers import build_engine
    from test_mllama import hf_inputs, load_hf, load_proc, user
    from tiny_mllama import make_mllama

    ckpt = make_mllama(tmp_path / "ckpt")
    engine_dir = build_engine(ckpt, tmp_path)
    model, proc = load_hf(ckpt), load_proc(ckpt)
    text = model.config.text_config
    self_layers = set(range(text.num_hidden_layers)) - set(text.cross_attention_layers)
    img = make_image(6, (40, 30))
    messages = [user(None, "what is in this image?")]
    inputs = hf_inputs(proc, messages, [img])
    n = 12
    check_against(engine_logprobs(engine_dir, messages, [img], n, kind),
                  hf_logprobs(model, inputs, n, row_cache_8bit(model.config, kind, self_layers)),
                  hf_logprobs(model, inputs, n))


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_eval_ppl_with_an_8bit_cache_is_transformers_with_the_rounding_cache(tmp_path, capsys, kind):
    """`vlmctl eval ppl --kv-cache-dtype K` (the quality cost of an 8-bit pool) == the perplexity of transformers'
    forward over the same windows with a cache that rounds K/V the same way; and != the unrounded one."""
    import math

    from conftest import cli_json
    from test_awq_quantize import calib_file, make_tiny_llama
    from transformers import AutoModelForCausalLM, AutoTokenizer

    from vlmctl.quant.calibration import load_eval_tokens

    src = make_tiny_llama(tmp_path / "src")
    data = calib_file(tmp_path)
    seq, windows = 32, 3
    got = cli_json("eval", "ppl", src, "--data", data, "--seq-len", str(seq), "--samples", str(windows),
                   "--kv-cache-dtype", kind, "--json", capsys=capsys)
    plain = cli_json("eval", "ppl", src, "--data", data, "--seq-len", str(seq), "--samples", str(windows), "--json",
                     capsys=capsys)
    assert got["kv_cache_dtype"] == kind and plain["kv_cache_dtype"] == "auto"
    model = AutoModelForCausalLM.from_pretrained(src, dtype=torch.float32).eval()
    ids = load_eval_tokens(str(data), AutoTokenizer.from_pretrained(src))[: windows * seq].view(windows, seq)
    nll = []
    with torch.no_grad():
        for w in ids:
            logits = model(w[None], past_key_values=row_cache_8bit(model.config, kind), use_cache=True).logits[0]
            nll.append(torch.nn.functional.cross_entropy(logits[:-1].double(), w[1:], reduction="none"))
    want = math.exp(float(torch.cat(nll).mean()))
    assert got["perplexity"] == pytest.approx(want, rel=1e-5)
    assert abs(got["perplexity"] - plain["perplexity"]) > 1e-4 * plain["perplexity"]


def test_served_through_the_openai_client(tiny_llava_engine, tmp_path):
    """`vlmctl serve --kv-cache-dtype int8` as a process, asked through the official `openai` client: the start-up
    line and /metrics name the pool's type, and the greedy answer's tokens are the library engine's with the same
    pool (and not the 16-bit pool's logprobs)."""
    import signal

    import httpx
    import openai

    from conftest import serve_process
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    messages = [{"role": "user", "content": "tell me about the sea"}]
    err = open(tmp_path / "serve.err", "w+")
    with serve_process(tiny_llava_engine, tmp_path, "--kv-cache-dtype", "int8", "--stats-interval", "0",
                       err=err) as (proc, url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none")
        r = client.chat.completions.create(model="tiny", messages=messages, max_tokens=10, temperature=0,
                                           logprobs=True)
        metrics = httpx.get(url + "/metrics", timeout=30).text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    start = next(line for line in (tmp_path / "serve.err").read_text().splitlines() if "vlmctl serve" in line)
    assert "tokens (int8);" in start, start
    assert 'vlmctl_kv_cache_config_info{block_size="16",dtype="int8",model_name="tiny"} 1.0' in metrics
    served = [t.logprob for t in r.choices[0].logprobs.content]
    p = SamplingParams(max_tokens=10, temperature=0, logprobs=0)
    want = Engine(tiny_llava_engine, device="cpu", kv_cache_dtype="int8").chat(messages, [], p)
    plain = Engine(tiny_llava_engine, device="cpu").chat(messages, [], p)
    assert r.choices[0].message.content == want.text
    assert served == pytest.approx([lp["logprob"] for lp in want.logprobs], abs=1e-4)
    assert max(abs(a["logprob"] - b["logprob"]) for a, b in zip(want.logprobs, plain.logprobs)) > 1e-3
