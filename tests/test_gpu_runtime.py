"""The runtime on a CUDA device (marked `gpu`; run on the GPU machine: `pytest -m gpu`).

- a decode step replayed from a captured CUDA graph gives the same tokens as the same step run
  eagerly (same kernels, same batch bucket);
- fp16 on the GPU stays close to the CPU float32 reference engine (same greedy tokens for most of
  a long generation: fp16 rounding may flip a near tie late);
- chunked prefill, prefix hits and preemption on the GPU give the tokens of a plain run.
"""

from __future__ import annotations

import pytest
import torch

from conftest import write_recipe
from tiny_models import make_image, make_llava

pytestmark = [pytest.mark.gpu,
              pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")]


@pytest.fixture(scope="module")
def fp16_engine(tmp_path_factory):
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    d = tmp_path_factory.mktemp("gpu")
    # head_dim 32 (hidden 128, 4 heads): the Triton attention kernel's path
    ckpt = make_llava(d / "ckpt", hidden=128, text_layers=3, init_range=0.05)
    recipe = load_recipe(write_recipe(d / "r.yaml", ckpt, dtype="float16", profiles=[],
                                      limits={"max_batch_size": 8, "max_input_len": 256, "max_output_len": 64}))
    build(recipe, d / "eng")
    return d / "eng"


def prompts(eng, n):
    return [eng.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": t}]}],
                       [make_image(i)]) for i, t in enumerate(["what is in this image?", "hello", "describe the picture",
                                                               "a red square", "the sky is green"][:n])]


def run(path, n=4, max_tokens=24, logprobs=None, **opts):
    """(engine, greedy tokens), and the logprobs where `logprobs` asks for them."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    opts.setdefault("kv_cache_tokens", 4096)  # several engines live at once in this module
    eng = Engine(path, device="cuda", **opts)
    done = eng.generate(prompts(eng, n), SamplingParams(max_tokens=max_tokens, temperature=0, ignore_eos=True,
                                                        logprobs=logprobs))
    out = [c.token_ids for c in done]
    return (eng, out) if logprobs is None else (eng, out, [c.logprobs for c in done])


def test_graphed_decode_equals_eager(fp16_engine, monkeypatch):
    """Decode graphs run the eager step's kernels: the same tokens. Prompt steps replayed from graphs attend
    through the paged prompt kernel where eager ones run SDPA, so with them only near-ties may differ."""
    from parity import assert_equal_but_near_ties

    eng_s, stepped = run(fp16_engine, cuda_graphs=True)
    eng_e, eager, lps = run(fp16_engine, cuda_graphs=False, logprobs=2)
    assert eng_s.decoder._step_graphs is not None and not eng_e.decoder.use_graphs
    assert assert_equal_but_near_ties(stepped, eager, lps) <= 1
    monkeypatch.setenv("VLMCTL_STEP_GRAPH_ROWS", "0")
    eng_g, graphed = run(fp16_engine, cuda_graphs=True)
    assert eng_g.decoder.use_graphs and eng_g.decoder._step_graphs is None
    assert graphed == eager


def test_chunked_prefix_and_preempted_runs_match_a_plain_run(fp16_engine):
    _, plain = run(fp16_engine, cuda_graphs=False)
    _, chunked = run(fp16_engine, cuda_graphs=False, max_num_batched_tokens=8, max_batch_size=4, block_size=4)
    assert chunked == plain
    eng, again = run(fp16_engine, cuda_graphs=False, block_size=4)
    assert again == plain
    small, pre = run(fp16_engine, cuda_graphs=False, block_size=4, kv_cache_tokens=160, enable_prefix_caching=False)
    assert pre == plain and small.scheduler.preemptions > 0 and small.pool.num_used() == 0


def test_gpu_fp16_follows_the_cpu_reference(fp16_engine):
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    _, gpu = run(fp16_engine, n=2, max_tokens=32)
    cpu = Engine(fp16_engine, device="cpu")
    ref = [c.token_ids for c in cpu.generate(prompts(cpu, 2), SamplingParams(max_tokens=32, temperature=0,
                                                                             ignore_eos=True))]
    same = sum(a == b for g, r in zip(gpu, ref) for a, b in zip(g, r))
    assert same >= 0.9 * sum(len(r) for r in ref), (gpu, ref)
    assert all(g[:4] == r[:4] for g, r in zip(gpu, ref))


@pytest.mark.parametrize("kind", ["fp8", "int8"])
def test_8bit_kv_cache_on_the_gpu(fp16_engine, kind, monkeypatch):
    """`kv_cache_dtype` fp8 / int8 on the GPU (the Triton kernels' QUANT paths): graphed decode == eager; chunked
    prefill (continuation chunks read the pool through `gather_context`), prefix hits and preemption follow a
    plain run (a preempted request's recompute attends through the prompt path, whose arithmetic differs from
    the decode kernel's: near-ties may go either way); the logprobs move by the rounding; and the tokens follow
    the CPU engine's with the same pool (the torch references, which tests/test_kv_cache_8bit.py checks against
    transformers) as fp16 follows float32 above."""
    from parity import assert_equal_but_near_ties

    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    def generate(**opts):
        return run(fp16_engine, logprobs=2, **opts)

    eng_s, stepped, _ = generate(cuda_graphs=True, kv_cache_dtype=kind)
    assert eng_s.decoder.k_cache.dtype == {"fp8": torch.float8_e4m3fn, "int8": torch.int8}[kind]
    assert eng_s.decoder._step_graphs is not None
    _, eager, eager_lps = generate(cuda_graphs=False, kv_cache_dtype=kind)
    # prompt steps replayed from graphs attend through the paged prompt kernel, eager ones through SDPA
    assert_equal_but_near_ties(stepped, eager, eager_lps)
    monkeypatch.setenv("VLMCTL_STEP_GRAPH_ROWS", "0")
    eng_g, graphed, lps = generate(cuda_graphs=True, kv_cache_dtype=kind)
    assert eng_g.decoder.use_graphs and eng_g.decoder._step_graphs is None
    assert graphed == eager
    monkeypatch.delenv("VLMCTL_STEP_GRAPH_ROWS")
    _, chunked, _ = generate(cuda_graphs=False, max_num_batched_tokens=8, max_batch_size=4, block_size=4,
                             kv_cache_dtype=kind)
    assert_equal_but_near_ties(chunked, graphed, lps)
    small, pre, _ = generate(cuda_graphs=True, block_size=4, kv_cache_tokens=160, enable_prefix_caching=False,
                             kv_cache_dtype=kind)
    assert small.scheduler.preemptions > 0
    assert_equal_but_near_ties(pre, graphed, lps)
    # read as stored: the logprobs move by the rounding (0.02 on the CPU with fp8 for this model), not by nothing
    _, _, plain = generate(cuda_graphs=True)
    moved = max(abs(a["logprob"] - b["logprob"]) for x, y in zip(plain, lps) for a, b in zip(x[:8], y[:8]))
    assert moved > 1e-3, moved
    _, gpu, _ = generate(n=2, max_tokens=32, kv_cache_dtype=kind)
    cpu = Engine(fp16_engine, device="cpu", kv_cache_dtype=kind)
    ref = [c.token_ids for c in cpu.generate(prompts(cpu, 2), SamplingParams(max_tokens=32, temperature=0,
                                                                             ignore_eos=True))]
    same = sum(a == b for g, r in zip(gpu, ref) for a, b in zip(g, r))
    assert same >= 0.9 * sum(len(r) for r in ref), (gpu, ref)
    assert all(g[:4] == r[:4] for g, r in zip(gpu, ref))


def test_graphed_vision_equals_eager(fp16_engine):
    """The torch vision runner's CUDA graphs (batch padded to its bucket) give the eager module's rows."""
    import numpy as np

    from vlmctl.runtime.engine import Engine

    eng = Engine(fp16_engine, device="cuda", kv_cache_tokens=1024)
    runner = eng.vision.runner
    assert runner.backend == "torch" and runner.graphs_enabled
    proc = eng.processor

    def items(n, offset):
        return [eng.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
                           [make_image(offset + i)]).images[0] for i in range(n)]

    def eager(its, pad_to=None):
        runner.graphs_enabled = False
        try:
            if pad_to is None:
                return proc.run_vision(its, runner)
            feed, _ = proc.collate(its)
            feed = {k: np.concatenate([v, np.zeros((pad_to - len(its),) + v.shape[1:], v.dtype)]) for k, v in feed.items()}
            return list(runner(feed)[:len(its)])
        finally:
            runner.graphs_enabled = True

    for n, offset in ((1, 0), (3, 10), (3, 20), (8, 30)):
        its = items(n, offset)
        before = runner.graph_replays
        graphed = proc.run_vision(its, runner)
        assert runner.graph_replays == before + 1
        bucket = 1 << (n - 1).bit_length()
        # the same kernels as an eager call on the padded batch: equal bit for bit
        for g, e in zip(graphed, eager(its, bucket)):
            assert torch.equal(g, e.reshape(g.shape))
        # and within fp16 rounding of an unpadded eager call (cuBLAS may pick other kernels)
        for g, e in zip(graphed, eager(its)):
            torch.testing.assert_close(g.float(), e.float(), rtol=2e-2, atol=2e-2)
    # more images than the largest graph bucket run eagerly
    before = runner.graph_replays
    proc.run_vision(items(runner.MAX_GRAPH_BATCH + 1, 40), runner)
    assert runner.graph_replays == before


def test_images_encoded_ahead_on_the_gpu(fp16_engine):
    """vision_overlap (the default with a GPU): the vision worker's stream encodes waiting requests'
    images; the tokens follow a run without it (fp16: the worker may batch the images differently,
    which may move a feature by one rounding step, so most rather than all tokens must agree)."""
    eng_a, ahead = run(fp16_engine, max_batch_size=2)
    eng_s, sync = run(fp16_engine, max_batch_size=2, vision_overlap=False)
    assert eng_a.stats()["vision_overlap"] and not eng_s.stats()["vision_overlap"]
    assert all(r is not None for r in ahead)
    same = sum(a == b for x, y in zip(ahead, sync) for a, b in zip(x, y))
    assert same >= 0.9 * sum(len(y) for y in sync), (ahead, sync)
    assert all(x[:4] == y[:4] for x, y in zip(ahead, sync))
    assert eng_a.pool.num_used() == 0


def test_graphed_vision_called_from_two_streams(fp16_engine):
    """The vision worker encodes on its own stream while the engine thread encodes on the default one:
    the graphs' static buffers are shared, so each replay must wait for the previous one (a CUDA
    event); every image's rows must equal those of a call made alone."""
    import threading

    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.vision import FeatureCache

    eng = Engine(fp16_engine, device="cuda", kv_cache_tokens=1024)
    enc = eng.vision
    assert enc.runner.graphs_enabled
    enc.cache = FeatureCache(0)  # no cache hits: every call below runs the tower

    def items(offset):
        return [eng.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "x"}]}],
                           [make_image(offset + i)]).images[0] for i in range(8)]

    alone = items(0)
    for it in alone:
        enc.encode([it])
    torch.cuda.synchronize()
    on_worker, on_main = items(0)[0::2], items(0)[1::2]
    side = torch.cuda.Stream()

    def worker():
        with torch.cuda.stream(side):
            for it in on_worker:
                enc.encode([it])
            side.synchronize()

    t = threading.Thread(target=worker)
    t.start()
    for it in on_main:
        enc.encode([it])
    t.join()
    torch.cuda.synchronize()
    both = [None] * 8
    both[0::2], both[1::2] = on_worker, on_main
    for a, b in zip(alone, both):
        assert torch.equal(a.features, b.features)


def test_prompt_attention_does_not_use_cudnn_sdpa(fp16_engine, monkeypatch):
    """cuDNN's SDPA builds an execution plan per new (query, key) length pair, ~1 ms of host time each,
    which made a process's first prefills ~3x slower than later ones (docs/benchmarks.md); prompt
    attention must run on the flash (or memory-efficient) backend instead."""
    from torch.profiler import ProfilerActivity, profile

    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    # the eager prompt step's attention; prompt steps replayed from graphs run the paged prompt kernel instead
    monkeypatch.setenv("VLMCTL_STEP_GRAPH_ROWS", "0")
    eng = Engine(fp16_engine, device="cuda", kv_cache_tokens=1024)
    with profile(activities=[ProfilerActivity.CPU]) as prof:
        eng.generate(prompts(eng, 3), SamplingParams(max_tokens=2, temperature=0, ignore_eos=True))
    names = {e.key for e in prof.key_averages()}
    assert not [n for n in names if "cudnn_attention" in n], sorted(names)
    assert [n for n in names if "flash_attention" in n or "efficient_attention" in n], sorted(names)


def test_pdl_steps_equal_plain_launches(fp16_engine, monkeypatch):
    """The engine's tokens with programmatic dependent launch (and the GEMVs' L2 prefetch) on and off,
    graphed: the same kernels in the same order, so the same tokens; the batch-1 rows take the Triton
    GEMV here (VLMCTL_GEMV=triton) so the prefetching kernels run."""
    if torch.cuda.get_device_capability()[0] < 9:
        pytest.skip("PDL needs compute capability 9.0")
    monkeypatch.setenv("VLMCTL_GEMV", "triton")
    monkeypatch.setenv("VLMCTL_L2_PREFETCH", "2")
    monkeypatch.setenv("VLMCTL_PDL", "1")
    _, with_pdl = run(fp16_engine, n=1, cuda_graphs=True)
    _, with_pdl4 = run(fp16_engine, n=4, cuda_graphs=True)
    monkeypatch.setenv("VLMCTL_PDL", "0")
    _, plain = run(fp16_engine, n=1, cuda_graphs=True)
    _, plain4 = run(fp16_engine, n=4, cuda_graphs=True)
    assert with_pdl == plain and with_pdl4 == plain4


def test_captured_graphs_keep_their_workspaces_alive(fp16_engine, monkeypatch):
    """A CUDA graph holds raw pointers, not tensors: the decode attention's split workspaces, allocated
    outside the graph's pool before capture, must stay referenced as long as the graph. Freed, their
    memory goes to later tensors that every replay then overwrites (docs/benchmarks.md, session 12: an AWQ
    Qwen2-VL-7B-shaped decoder's illegal memory access)."""
    import gc
    import weakref

    from vlmctl.runtime.decoder import TorchDecoder

    made, capturing = [], [False]
    real, real_capture = TorchDecoder._workspace, TorchDecoder._capture

    def recording(self, B, splits):  # the workspaces of captured steps (the compile pass's are its own)
        ws = real(self, B, splits)
        if capturing[0]:
            made.extend(weakref.ref(t) for t in ws or ())
        return ws

    def capture(self, *a, **k):
        capturing[0] = True
        try:
            return real_capture(self, *a, **k)
        finally:
            capturing[0] = False

    monkeypatch.setattr(TorchDecoder, "_workspace", recording)
    monkeypatch.setattr(TorchDecoder, "_capture", capture)
    eng, _ = run(fp16_engine, n=1, cuda_graphs=True)
    gc.collect()
    assert eng.decoder.use_graphs and made, "no captured step here uses split workspaces: nothing tested"
    assert all(r() is not None for r in made)


@pytest.fixture(scope="module")
def awq_engine(tmp_path_factory):
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    d = tmp_path_factory.mktemp("gpu-awq")
    ckpt = make_llava(d / "ckpt", hidden=128, text_layers=3, init_range=0.05)
    recipe = load_recipe(write_recipe(
        d / "r.yaml", ckpt, dtype="float16", profiles=[],
        quantization={"method": "awq", "group_size": 32, "calibration": {"samples": 4, "seq_len": 32}},
        limits={"max_batch_size": 8, "max_input_len": 256, "max_output_len": 64}))
    build(recipe, d / "eng")
    return d / "eng"


def test_awq_act_mul_in_the_gemv_equals_the_separate_kernel(awq_engine, monkeypatch):
    """An AWQ engine's batch-1 steps run gate_up's act·mul in the GEMV's epilogue (`w4a16_act_mul`);
    graphed generations, one request and four, give the tokens of the linear + act·mul kernel pair."""
    from vlmctl.runtime.decoder import W4A16Linear
    from vlmctl.runtime.kernels import w4a16 as W

    monkeypatch.setenv("VLMCTL_W4A16_ACT_MUL", "1")
    eng, fused = run(awq_engine, n=1, cuda_graphs=True)
    _, fused4 = run(awq_engine, n=4, cuda_graphs=True)
    gate_up = eng.decoder.layers[0].gate_up
    assert isinstance(gate_up, W4A16Linear)
    x = torch.zeros(1, gate_up.packed["q4weight"].shape[1] * W.PACK, dtype=torch.float16, device="cuda")
    assert W.w4a16_act_mul(x, gate_up.packed, gate_up.group_size, "silu") is not None, "the fusion must run here"
    monkeypatch.setenv("VLMCTL_W4A16_ACT_MUL", "0")
    _, plain = run(awq_engine, n=1, cuda_graphs=True)
    _, plain4 = run(awq_engine, n=4, cuda_graphs=True)
    assert fused == plain and fused4 == plain4


@pytest.mark.parametrize("which,graphs,kv", [("fp16_engine", True, "auto"), ("fp16_engine", False, "auto"),
                                             ("awq_engine", True, "auto"), ("fp16_engine", True, "fp8"),
                                             ("fp16_engine", False, "fp8"), ("fp16_engine", True, "int8")])
def test_serving_compiles_no_triton_kernel_after_load(which, graphs, kv, request):
    """Every Triton kernel a serving engine runs is compiled while it loads (capture, the AWQ warm-up and
    `TorchDecoder.warm_forward`): chunked prompts, continuation chunks, graphed decode rows beside them, and
    without graphs decode rows (odd counts too) in the same eager forward as prompt rows compile nothing more.
    A compile mid-serving stalls every running request for 0.1-0.5 s."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.kernels import triton_watch
    from vlmctl.runtime.sampling import SamplingParams

    if not triton_watch.available():
        pytest.skip("this Triton does not report compilations")
    eng = Engine(request.getfixturevalue(which), device="cuda", kv_cache_tokens=4096, max_num_batched_tokens=12,
                 cuda_graphs=graphs, kv_cache_dtype=kv)
    steps = []
    forward = eng.decoder.forward

    def recording(chunks, device_ids=None):
        steps.append((sum(c.is_decode for c in chunks), any(not c.is_decode for c in chunks),
                      any(c.start > 0 and c.n > 1 for c in chunks)))
        return forward(chunks, device_ids)

    eng.decoder.forward = recording
    with triton_watch.triton_compiles() as compiled:
        eng.generate(prompts(eng, 5), SamplingParams(max_tokens=12, temperature=0, ignore_eos=True))
    assert any(cont for _, _, cont in steps), "no continuation chunk ran"
    if not graphs:  # decode rows beside prompt rows in one eager forward
        mixed = {n for n, prompt, _ in steps if n and prompt}
        assert {1, 3} <= mixed, f"no eager step held prompt rows beside an odd count of decode rows: {steps}"
    assert compiled == [], compiled


@pytest.mark.parametrize("which", ["fp16_engine", "awq_engine"])
def test_load_compiles_its_triton_kernels_in_one_parallel_pass(which, request, tmp_path):
    """A new process on an empty Triton cache (`benchmarks/load_gpu.py --child`): every Triton kernel the engine
    compiles while it loads is compiled in its "compile kernels" phase, on a thread pool, and its launcher built
    there, as is every NVRTC kernel of the packed linears; the phases after it (decode graphs, prefill kernels,
    warm steps) find each one compiled."""
    import json
    import os
    import subprocess
    import sys
    from pathlib import Path

    from vlmctl.runtime.kernels import compile_ahead, triton_watch

    if not triton_watch.available() or not compile_ahead.available():
        pytest.skip("this Triton does not report compilations or has no AsyncCompileMode")
    root = Path(__file__).resolve().parents[1]
    env = dict(os.environ, TRITON_CACHE_DIR=str(tmp_path / "triton"), VLMCTL_CACHE_DIR=str(tmp_path / "vlmctl"),
               PYTHONPATH=os.pathsep.join([str(root), os.environ.get("PYTHONPATH", "")]))
    env.pop("VLMCTL_COMPILE_WORKERS", None)
    proc = subprocess.run([sys.executable, str(root / "benchmarks" / "load_gpu.py"), "--child",
                           str(request.getfixturevalue(which)), "--kv-cache-tokens", "4096"],
                          env=env, capture_output=True, text=True, timeout=600)
    assert proc.returncode == 0, proc.stderr[-3000:]
    r = json.loads(proc.stdout.strip().splitlines()[-1])
    per_phase = r["triton_compiles_per_phase"]
    assert per_phase.get("compile kernels"), r
    assert set(per_phase) == {"compile kernels"}, per_phase
    # the kernels' launchers (C extensions built with gcc at a kernel's first launch) are built in that pass too
    builds = r["c_builds_per_phase"]
    assert builds.get("compile kernels"), r
    assert not set(builds) & {"decode graphs", "prefill kernels", "warm steps"}, builds
    # and so are the packed linears' NVRTC kernels, the fused gate_up's act·mul epilogue among them (session 32)
    assert not set(r["nvrtc_compiles_per_phase"]) & {"decode graphs", "prefill kernels", "warm steps"}, r


def _step_without_implicit_sync(eng) -> None:
    """One engine step under torch's sync debug mode: an implicit synchronization with the GPU is an error."""
    torch.cuda.set_sync_debug_mode("error")
    try:
        eng.step()
    finally:
        torch.cuda.set_sync_debug_mode("default")


def test_steps_launched_ahead_never_wait_for_the_gpu(fp16_engine):
    """Async scheduling (on by default here): every step of a decode batch launched ahead (graph replay,
    sampling of every kind, penalties, logit_bias, min_p and a grammar's mask, the copies back) runs without
    an implicit synchronization, which torch's sync debug mode turns into an error; the one wait is the
    explicit one for the previous step's tokens. The tokens equal the synchronous engine's."""
    pytest.importorskip("llguidance", reason="the grammar row needs the grammar engine (the dev extra)")
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.grammar import GrammarSpec
    from vlmctl.runtime.sampling import SamplingParams

    params = [SamplingParams(max_tokens=40, temperature=0, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.9, seed=3, ignore_eos=True, logprobs=2),
              SamplingParams(max_tokens=40, temperature=1.0, top_k=7, top_p=0.8, ignore_eos=True),
              SamplingParams(max_tokens=40, temperature=0.5, top_p=0.5, seed=4, ignore_eos=True,
                             frequency_penalty=0.4, repetition_penalty=1.2, min_p=0.05, logit_bias={5: 2.0}),
              SamplingParams(max_tokens=40, temperature=0.8, seed=5, grammar=GrammarSpec.json_object())]
    sync = Engine(fp16_engine, device="cuda", kv_cache_tokens=1024, async_scheduling=False)
    expected = [c.token_ids for c in sync.generate(prompts(sync, 5), params)]
    del sync
    eng = Engine(fp16_engine, device="cuda", kv_cache_tokens=1024)
    assert eng.async_scheduling
    reqs = [eng.submit(p, sp) for p, sp in zip(prompts(eng, 5), params)]
    checked = 0
    while eng.has_work():
        watched = eng._in_flight is not None and all(len(r.output_ids) > 2 or r.finished for r in reqs)
        (_step_without_implicit_sync if watched else type(eng).step)(eng)
        checked += watched
    assert checked > 20 and eng.steps_ahead > 20
    for i in (0, 1, 3, 4):  # the seeded and greedy ones (row 2 draws from the global generator)
        assert reqs[i].output_ids == expected[i]
    assert reqs[4].finish_reason in ("stop", "length") and reqs[4].error is None


def test_prompts_admitted_ahead_never_wait_for_the_gpu(fp16_engine):
    """Async scheduling: a text prompt that arrives while decode steps are in flight is admitted and prefilled
    (in chunks, with min_p and a seed) by steps launched ahead, beside the running requests' decode rows; those
    steps, the chunk forward's input copies included, run without an implicit synchronization (torch's sync
    debug mode makes one an error). The tokens equal the synchronous engine's."""
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    long = SamplingParams(max_tokens=48, temperature=0, ignore_eos=True)
    late = SamplingParams(max_tokens=12, temperature=0.7, seed=9, min_p=0.05, ignore_eos=True)
    text = "count from one to twenty and then say the colours of the rainbow in order please"
    out = {}
    for mode in (False, True):
        eng = Engine(fp16_engine, device="cuda", kv_cache_tokens=1024, max_num_batched_tokens=8,
                     async_scheduling=mode)
        a, b = (eng.submit(p, long) for p in prompts(eng, 2))
        while len(b.output_ids) < 4:
            eng.step()
        c = eng.submit(eng.encode_text(text), late)
        checked = 0
        while eng.has_work():
            prefilling = c.num_computed < c.prompt_len
            watched = mode and prefilling and eng._in_flight is not None
            (_step_without_implicit_sync if watched else type(eng).step)(eng)
            checked += watched
        out[mode] = [a.output_ids, b.output_ids, c.output_ids]
        if mode:
            assert checked >= 3 and eng.steps_ahead > 20
    assert out[True] == out[False]



@pytest.mark.parametrize("which", ["fp16_engine", "awq_engine"])
def test_captured_prompt_steps_follow_the_eager_forward(which, request, monkeypatch):
    """Steps with prompt rows replayed from CUDA graphs (`VLMCTL_STEP_GRAPH_ROWS`): whole prompts, chunked prompts
    beside decode rows and prefix hits give the eager forward's tokens (fp16: all but a rare near-tie), and the
    steps did replay graphs."""
    from vlmctl.runtime.step_graphs import StepGraphs

    path = request.getfixturevalue(which)
    _, plain = run(path, cuda_graphs=True)
    replays = []
    original = StepGraphs.run

    def counted(self, *a, **k):
        replays.append(self.entries[self.bucket(a[1].shape[0])]["graph"] is not None)
        return original(self, *a, **k)

    monkeypatch.setattr(StepGraphs, "run", counted)
    monkeypatch.setenv("VLMCTL_STEP_GRAPH_ROWS", "64")
    for opts in ({}, {"max_num_batched_tokens": 8, "max_batch_size": 4, "block_size": 4}):
        eng, got = run(path, cuda_graphs=True, **opts)
        sizes = eng.decoder._step_graphs.sizes  # capped at the step's token budget
        assert sizes == [16, 32, 64] if not opts else sizes == [opts["max_num_batched_tokens"]]
        same = sum(a == b for g, p in zip(got, plain) for a, b in zip(g, p))
        assert [g[0] for g in got] == [p[0] for p in plain] and same >= 0.9 * sum(map(len, plain)), (got, plain)
    assert replays and all(replays)
