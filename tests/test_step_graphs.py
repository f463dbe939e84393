"""Steps with prompt rows through the captured-step path (`runtime/step_graphs.py`): the static-shape step a CUDA
graph replays (rows padded to a bucket, every row's attention through the paged prompt kernel's tile table) gives
transformers' logits and the eager forward's cache, for mixed steps (decode rows beside prompt chunks, a
continuation longer than a tile, image rows from a prompt table), with sliding windows, 8-bit pools and multimodal
rotary; steps it cannot take run eagerly. On the CPU the same static steps run without capture; the GPU test
(`-m gpu`) replays the graphs."""

from __future__ import annotations

import numpy as np
import pytest
import torch

from vlmctl.runtime import kv_quant
from vlmctl.runtime.decoder import Chunk, TorchDecoder

BS = 4  # block size


def _llama(path, vocab=150, heads=4, kv=2, layers=2, dtype=torch.float32):
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.manual_seed(0)
    cfg = LlamaConfig(vocab_size=vocab, hidden_size=64, intermediate_size=128, num_hidden_layers=layers,
                      num_attention_heads=heads, num_key_value_heads=kv, max_position_embeddings=256)
    hf = LlamaForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.2 if p.dim() == 2 else 0.5)
    hf.save_pretrained(path)
    return hf


def _gemma3(path):
    from transformers import Gemma3ForCausalLM, Gemma3TextConfig

    torch.manual_seed(0)
    cfg = Gemma3TextConfig(vocab_size=150, hidden_size=64, intermediate_size=128, num_hidden_layers=4,
                           num_attention_heads=4, num_key_value_heads=2, head_dim=16, sliding_window=6,
                           sliding_window_pattern=2, query_pre_attn_scalar=24, final_logit_softcapping=30.0,
                           max_position_embeddings=256, rope_local_base_freq=100.0)
    hf = Gemma3ForCausalLM(cfg).eval()
    with torch.no_grad():
        for p in hf.parameters():
            p.normal_(0, 0.3 if p.dim() == 2 else 0.5)
    hf.save_pretrained(path)
    return hf


def _pair(path, device="cpu", kv_cache_dtype="auto", limit=64, dtype="float32"):
    """(eager decoder, decoder with captured steps up to `limit` rows), the same weights and pools."""
    out = []
    for graphs in (False, True):
        dec = TorchDecoder.from_hf_dir(path, max_seq=128, device=device, dtype=dtype)
        dec.kv_cache_dtype = kv_cache_dtype
        dec.allocate_cache(96, BS)
        if graphs:
            assert dec.capture_step_graphs(max_batch=4, max_rows=256, limit=limit) == [16, 32, limit]
        out.append(dec)
    return out


class _Counter:
    def __init__(self, graphs):
        self.n, run = 0, graphs.run

        def counted(*a, **k):
            self.n += 1
            return run(*a, **k)

        graphs.run = counted


SEQS = {"A": 60, "B": 45, "C": 8, "D": 80}
TABLES = {"A": list(range(1, 16)), "B": list(range(16, 28)), "C": list(range(28, 30)), "D": list(range(30, 51))}
# (sequence, start, rows) per step: prompts from 0, decode rows (one row after cached ones), a continuation longer
# than a 32-row tile, and a 68-row step past the largest bucket (64), which runs eagerly; then D's 12 rows after 68
# positions, whose later rows' sliding windows (Gemma 3's, 6) start past the first 64-position key tile
STEPS = [[("A", 0, 20), ("B", 0, 5)],
         [("A", 20, 1), ("B", 5, 35)],
         [("A", 21, 1), ("B", 40, 1), ("C", 0, 8)],
         [("A", 22, 38), ("B", 41, 4), ("C", 8, 0)],
         [("D", 0, 68)],
         [("D", 68, 12)]]


def _chunks(ids, step, vocab=None, table=None):
    out = []
    for name, start, n in step:
        if n:
            seq = ids[name][start:start + n]
            tab = table if vocab is not None and (seq >= vocab).any() else None
            out.append(Chunk(seq, np.arange(start, start + n), start, TABLES[name], tab))
    return out


def _ids(vocab, seed=1):
    g = np.random.default_rng(seed)
    return {name: g.integers(0, vocab, n) for name, n in SEQS.items()}


def _check_steps(eager, graphed, ids, ref=None, atol=1e-4, table=None, vocab=None, min_graphed=5, code_steps=0):
    """Run STEPS on both decoders: equal logits (and transformers' `ref[name][position]` where given), equal pools
    (an 8-bit pool's values as stored, within atol plus `code_steps` of its codes' spacing: on a GPU a padded
    step's GEMMs may round a k/v element across a code boundary); returns how many steps replayed a captured step."""
    counter = _Counter(graphed._step_graphs)
    for step in STEPS:
        cs = _chunks(ids, step, vocab, table)
        want_e = eager.forward(cs)
        want_g = graphed.forward(_chunks(ids, step, vocab, table))
        assert want_g.shape == want_e.shape
        assert torch.allclose(want_g, want_e, atol=atol, rtol=0), (step, (want_g - want_e).abs().max())
        if ref is not None:
            for c, row in zip([s for s in step if s[2]], want_g):
                name, start, n = c
                assert torch.allclose(row, ref[name][start + n - 1], atol=atol, rtol=0), (c, (row - ref[name][
                    start + n - 1]).abs().max())
    pools = [(eager.k_cache, graphed.k_cache, eager.k_scale, graphed.k_scale),
             (eager.v_cache, graphed.v_cache, eager.v_scale, graphed.v_scale)]
    for a, b, sa, sb in pools:
        if sa is None:
            assert torch.allclose(a.float(), b.float(), atol=atol, rtol=0)
            continue
        da, db = kv_quant.dequantize(a, sa, torch.float32), kv_quant.dequantize(b, sb, torch.float32)
        step = torch.maximum(sa, sb)[..., None]  # int8: one code
        if a.dtype == kv_quant.FP8:  # e4m3: 3 mantissa bits, so one code is 2**-3 of the value (2**-9 subnormal)
            step = torch.maximum(da.abs(), db.abs()) * 2 ** -3 + step * 2 ** -9
        assert ((da - db).abs() <= atol + code_steps * step).all(), float((da - db).abs().max())
        assert torch.allclose(sa, sb, atol=atol / 127, rtol=1e-2)
    assert counter.n >= min_graphed
    return counter.n


def _hf_logits(hf, ids):
    with torch.no_grad():
        return {name: hf(torch.as_tensor(seq)[None]).logits[0] for name, seq in ids.items()}


def test_llama_steps_equal_transformers_and_the_eager_forward(tmp_path):
    hf = _llama(tmp_path / "llm")
    eager, graphed = _pair(tmp_path / "llm")
    ids = _ids(150)
    assert _check_steps(eager, graphed, ids, _hf_logits(hf, ids)) == 5  # all but the 68-row step


def test_gemma3_sliding_window_steps(tmp_path):
    """Sliding-window layers (window 6, shorter than the chunks), q/k norms, a softcap, a local rotary table."""
    hf = _gemma3(tmp_path / "llm")
    eager, graphed = _pair(tmp_path / "llm")
    assert any(layer.window for layer in graphed.layers)
    ids = _ids(150)
    _check_steps(eager, graphed, ids, _hf_logits(hf, ids))


def test_image_rows_and_an_8bit_pool(tmp_path):
    """Rows from a prompt-embedding table (ids past the vocabulary) embedded before the captured step; an int8 pool,
    whose rounding both paths share."""
    _llama(tmp_path / "llm")
    eager, graphed = _pair(tmp_path / "llm", kv_cache_dtype="int8")
    assert graphed.k_scale is not None
    ids = _ids(150)
    base = graphed.table_base
    ids["B"][3:9] = base + np.arange(6)  # six image rows in B's first chunks
    table = torch.randn(6, 64, generator=torch.Generator().manual_seed(5))
    _check_steps(eager, graphed, ids, table=table, vocab=base, atol=2e-4)


def test_multimodal_rotary_steps(tmp_path):
    """M-RoPE (Qwen2-VL's): 3-D positions per row computed outside the graph into its cos|sin rows, and 1-D
    positions (every section equal) in the same model."""
    import json

    _llama(tmp_path / "llm")
    cfg = json.loads((tmp_path / "llm" / "config.json").read_text())
    key = "rope_parameters" if "rope_parameters" in cfg else "rope_scaling"
    cfg[key] = {**(cfg.get(key) or {"rope_type": "default"}), "mrope_section": [2, 3, 3]}  # head_dim 16
    (tmp_path / "llm" / "config.json").write_text(json.dumps(cfg))
    eager, graphed = _pair(tmp_path / "llm")
    assert graphed.mrope_section == (2, 3, 3)
    ids = _ids(150)
    counter = _Counter(graphed._step_graphs)
    for k, step in enumerate(STEPS[:4]):
        outs = []
        for dec in (eager, graphed):
            cs = _chunks(ids, step)
            if k % 2 == 0:  # 3-D positions that differ by section; the other steps keep 1-D ones
                for c in cs:
                    c.positions = np.stack([c.positions, c.positions + 2 + c.start % 3, c.positions + 1])
            outs.append(dec.forward(cs))
        assert torch.allclose(outs[1], outs[0], atol=1e-4, rtol=0), (step, (outs[1] - outs[0]).abs().max())
    assert counter.n == 4


def test_steps_the_graph_cannot_take_run_eagerly(tmp_path):
    """More sequences than a bucket holds and a block table longer than the captured one fall back to the eager
    forward; buckets are powers of two up to the limit, and a limit of 0 captures nothing."""
    from vlmctl.runtime.step_graphs import buckets

    assert buckets(0) == [] and buckets(16) == [16] and buckets(100) == [16, 32, 64, 100]
    assert buckets(600) == [16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 600]
    _llama(tmp_path / "llm")
    eager, graphed = _pair(tmp_path / "llm")
    sg = graphed._step_graphs
    ids = _ids(150)
    five = [Chunk(ids["D"][i:i + 1], np.arange(i, i + 1), i, TABLES["D"]) for i in range(5)]
    assert not sg.takes(five, 5)  # max_batch 4: a 16-row bucket holds 4 sequences
    assert sg.takes(five[:4], 4)
    long = Chunk(ids["A"][:3], np.arange(3), 0, list(range(1, 40)))  # more blocks than max_seq 128 needs
    assert not sg.takes([long], 3)
    # the compile pass's uncaptured runs of every bucket (rows in no tile, no slot) leave the pool as it was
    graphed.forward(_chunks(ids, STEPS[0]))
    before = graphed.k_cache.clone(), graphed.v_cache.clone()
    graphed._step_graphs_for(4, 256, 32).compile_only()
    assert torch.equal(before[0], graphed.k_cache) and torch.equal(before[1], graphed.v_cache)
    assert graphed.capture_step_graphs(4, 256, limit=0) == [] and graphed._step_graphs is None
    assert graphed.capture_step_graphs(4, 256, limit=32) == [16, 32]
    graphed.allocate_cache(96, BS)  # steps built on the old pools go with them
    assert graphed._step_graphs is None and graphed.forward(_chunks(ids, STEPS[0])).shape[0] == 2


def test_a_decoder_with_captured_steps_is_freed_when_its_last_user_lets_go(tmp_path):
    """Its steps hold it weakly: dropping the decoder frees it (its weights and KV pool; on a GPU, memory a next
    engine needs) at once, not when Python's cycle collector next runs. A benchmark that loaded a second engine in
    the same process ran out of GPU memory before (session 48)."""
    import gc
    import weakref

    _llama(tmp_path / "llm")
    _, graphed = _pair(tmp_path / "llm")
    graphed.forward(_chunks(_ids(150), STEPS[0]))  # a step through the captured path
    gone = weakref.ref(graphed)
    gc.disable()
    try:
        del graphed
        assert gone() is None
    finally:
        gc.enable()


@pytest.mark.gpu
@pytest.mark.parametrize("kv,splits", [("auto", ""), ("int8", ""), ("fp8", ""), ("auto", "1"), ("int8", "4")])
def test_captured_steps_replay_on_the_gpu(tmp_path, kv, splits, monkeypatch):
    """The same mixed steps replayed from CUDA graphs (fp16 weights): the eager forward's logits within fp16
    noise, and transformers' (float32) within the fp16 model's error. splits: the most programs a tile's context is
    divided among (`VLMCTL_PROMPT_SPLITS`, "" its default, 1 none; splits of 16 positions, so that these short
    contexts are split)."""
    from vlmctl.runtime.kernels import paged_prefill

    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    monkeypatch.setenv("VLMCTL_PROMPT_SPLITS", splits)
    monkeypatch.setattr(paged_prefill, "SPLIT_POSITIONS", 16)
    hf = _llama(tmp_path / "llm")
    eager, graphed = _pair(tmp_path / "llm", device="cuda", kv_cache_dtype=kv, dtype="float16")
    assert graphed.use_graphs and all(st["graph"] is not None for st in graphed._step_graphs.entries.values())
    # what a run that switches pools does (prompt_host_gpu.py's modes): no steps, new pools, steps again; the first
    # graphs' memory pool is released with them and a capture into it would fail
    assert graphed.capture_step_graphs(4, 256, limit=0) == []
    graphed.allocate_cache(96, BS)
    assert graphed.capture_step_graphs(4, 256, limit=64) == [16, 32, 64]
    assert max(graphed._step_graphs.splits.values()) == int(splits or paged_prefill.DEFAULT_SPLITS)
    ids = _ids(150)
    ref = _hf_logits(hf, ids)
    assert max(float(r.abs().max()) for r in ref.values()) < 10  # so that 5e-2 is fp16 noise, not agreement by luck
    # transformers has no 8-bit cache here: an 8-bit pool is checked against the eager forward only
    _check_steps(eager, graphed, ids, {k: v.cuda() for k, v in ref.items()} if kv == "auto" else None, atol=5e-2,
                 code_steps=1)


@pytest.mark.gpu
def test_gemma3_window_steps_replay_on_the_gpu(tmp_path):
    """Gemma 3's sliding-window layers through the paged prompt kernel in replayed steps (fp16 weights), against the
    eager forward, which gathers each chunk's context for SDPA. In D's last step rows see no key in the first key
    tile their program walks: the kernel gave them NaN before session 47."""
    if not torch.cuda.is_available():
        pytest.skip("needs a CUDA GPU")
    _gemma3(tmp_path / "llm")
    eager, graphed = _pair(tmp_path / "llm", device="cuda", dtype="float16")
    assert any(layer.window for layer in graphed.layers)
    _check_steps(eager, graphed, _ids(150), atol=1e-1)


def test_an_engine_serving_through_the_static_steps(tiny_llava_engine):
    """The engine's steps with prompt rows through the static steps (what a GPU engine replays; run eagerly here):
    chunked prompts with image rows beside decode rows, prefix hits, and steps launched ahead, whose decode rows'
    ids are still on the device, give the plain engine's tokens and log-probabilities."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams
    from vlmctl.runtime.step_graphs import StepGraphs
    from tiny_models import make_image

    def prompts(eng):
        texts = ["what is in this image?", "describe the picture", "hello world! how are you?", "a story, please"]
        out = []
        for i in range(6):
            content = [{"type": "text", "text": texts[i % 4]}]
            images = [make_image(i % 3, (40, 30))] if i % 2 == 0 else []
            out.append(eng.encode([{"role": "user", "content": [{"type": "image"}] * bool(images) + content}],
                                  images))
        return out

    params = SamplingParams(max_tokens=10, temperature=0, logprobs=2)
    opts = dict(max_num_batched_tokens=24, max_batch_size=4, block_size=4, enable_prefix_caching=True)
    plain = Engine(tiny_llava_engine, async_scheduling=False, **opts)
    want = plain.generate(prompts(plain), params)
    eng = Engine(tiny_llava_engine, async_scheduling=True, **opts)
    assert eng.decoder.capture_step_graphs(4, eng.limits.max_num_batched_tokens, limit=24) == [16, 24]
    calls, forward = [], eng.decoder.forward

    def spied(chunks, device_ids=None):
        calls.append(device_ids is not None)
        return forward(chunks, device_ids)

    eng.decoder.forward = spied
    runs, original = [], StepGraphs.run

    def counted(self, *a, **k):
        runs.append(1)
        return original(self, *a, **k)

    StepGraphs.run = counted
    try:
        got = eng.generate(prompts(eng), params)
    finally:
        StepGraphs.run = original
    assert [c.token_ids for c in got] == [c.token_ids for c in want]
    for g, w in zip(got, want):
        assert [d["logprob"] for d in g.logprobs] == pytest.approx([d["logprob"] for d in w.logprobs], abs=1e-4)
    assert len(runs) == len(calls) and any(calls), (runs, calls)  # every forward was a static step, some ahead
    assert eng.pool.num_used() == 0
