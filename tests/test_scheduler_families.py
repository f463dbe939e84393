"""Every family through the scheduler's other paths: chunked prefill, prefix-cache hits, preemption.

Each family's parity test proves the engine's default run equals transformers' `generate`. Here the
same engine, for every family, must give exactly those tokens when prompts are prefilled a few
tokens a step, when a repeated prompt (same image) is served from the prefix cache, and when the
KV pool is too small for all requests so the newest are preempted and recomputed (fp32, CPU).
"""

from __future__ import annotations

import pytest

from conftest import write_recipe
from tiny_models import make_image

FAMILIES = ["llava", "llava_next", "llava_onevision", "qwen2_vl", "qwen2_5_vl", "internvl", "idefics3", "gemma3",
            "mllama"]


def _make(family: str, out):
    if family == "llava":
        from tiny_models import make_llava

        return make_llava(out)
    if family in ("qwen2_vl", "qwen2_5_vl"):
        from tiny_models import make_qwen2_vl

        return make_qwen2_vl(out, version="2" if family == "qwen2_vl" else "2.5", seed=3)
    if family == "internvl":
        from tiny_models import make_internvl

        return make_internvl(out)
    if family == "llava_next":
        from tiny_llava_anyres import make_llava_next

        return make_llava_next(out)
    if family == "llava_onevision":
        from tiny_llava_anyres import make_llava_onevision

        return make_llava_onevision(out)
    if family == "idefics3":
        from tiny_idefics3 import make_idefics3

        return make_idefics3(out)
    if family == "mllama":
        from tiny_mllama import make_mllama

        return make_mllama(out)
    from tiny_gemma3 import make_gemma3

    return make_gemma3(out)


@pytest.fixture(scope="module", params=FAMILIES)
def engine_dir(request, tmp_path_factory):
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe

    d = tmp_path_factory.mktemp(request.param)
    ckpt = _make(request.param, d / "ckpt")
    build(load_recipe(write_recipe(d / "r.yaml", ckpt, limits={"max_batch_size": 3})), d / "eng")
    return d / "eng"


PROMPTS = [("what is in this image?", 1, (40, 30)), ("describe the picture", 2, (30, 52)),
           ("hello world! how are you?", 3, (64, 48))]


def _run(path, n=3, **opts):
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.sampling import SamplingParams

    eng = Engine(path, **opts)
    prompts = [eng.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": t}]}],
                          [make_image(s, size)]) for t, s, size in PROMPTS[:n]]
    out = [c.token_ids for c in eng.generate(prompts, SamplingParams(max_tokens=8, temperature=0))]
    return eng, prompts, out


def test_chunked_prefix_and_preempted_runs_equal_the_default_run(engine_dir):
    from vlmctl.runtime.sampling import SamplingParams

    _, prompts, base = _run(engine_dir)
    # a budget of 5 tokens a step: every prompt, image rows included, is prefilled in many chunks
    _, _, chunked = _run(engine_dir, max_num_batched_tokens=5, max_batch_size=3, block_size=4)
    assert chunked == base
    # the same prompts again on one engine: their image blocks come from the prefix cache
    eng, _, first = _run(engine_dir, block_size=4)
    hits = eng.pool.hit_tokens
    again = [c.token_ids for c in eng.generate(
        [eng.encode([{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": t}]}],
                    [make_image(s, size)]) for t, s, size in PROMPTS], SamplingParams(max_tokens=8, temperature=0))]
    assert first == again == base and eng.pool.hit_tokens > hits
    # a pool holding the prompts but not their outputs: the newest running requests are preempted
    room = sum(-(-len(p.token_ids) // 4) * 4 for p in prompts) + 8
    small, _, pre = _run(engine_dir, block_size=4, kv_cache_tokens=room, enable_prefix_caching=False)
    assert pre == base
    assert small.scheduler.preemptions > 0 and small.pool.num_used() == 0


def test_async_scheduling_equals_the_default_run(engine_dir):
    """Decode steps launched before the previous step's tokens are read (on by default on GPUs) give the
    same tokens, also chunked and preempted (for Llama 3.2 Vision with its cross-attention K/V read by the
    steps launched ahead)."""
    _, prompts, base = _run(engine_dir, async_scheduling=False)
    eng, _, ahead = _run(engine_dir, async_scheduling=True)
    assert ahead == base
    assert eng.steps_ahead > 0
    _, _, chunked = _run(engine_dir, async_scheduling=True, max_num_batched_tokens=5, max_batch_size=3, block_size=4)
    assert chunked == base
    room = sum(-(-len(p.token_ids) // 4) * 4 for p in prompts) + 8
    small, _, pre = _run(engine_dir, async_scheduling=True, block_size=4, kv_cache_tokens=room,
                         enable_prefix_caching=False)
    assert pre == base
    assert small.scheduler.preemptions > 0 and small.pool.num_used() == 0
