"""Sampling: greedy, seeds, top-k/top-p semantics, stop strings and limits through the engine."""

from __future__ import annotations

import pytest
import torch

from vlmctl.errors import InputError, LimitError
from vlmctl.runtime.sampling import SamplingParams, make_generator, sample
from tiny_models import make_image


def test_top_k_one_and_tiny_top_p_are_greedy():
    logits = torch.randn(4, 50, generator=torch.Generator().manual_seed(0))
    greedy = logits.argmax(-1)
    for p in (SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=2.0, top_p=1e-6)):
        toks, _, _ = sample(logits, [p] * 4, [make_generator(i, "cpu") for i in range(4)])
        assert torch.equal(toks, greedy)


def test_seeded_sampling_is_reproducible_and_within_top_k():
    logits = torch.randn(3, 100, generator=torch.Generator().manual_seed(1))
    p = SamplingParams(temperature=1.5, top_k=5)
    a, _, _ = sample(logits, [p] * 3, [make_generator(7, "cpu") for _ in range(3)])
    b, _, _ = sample(logits, [p] * 3, [make_generator(7, "cpu") for _ in range(3)])
    assert torch.equal(a, b)
    top5 = logits.topk(5, -1).indices
    assert all(int(a[i]) in top5[i].tolist() for i in range(3))


def test_logprobs_are_log_softmax():
    logits = torch.randn(2, 10)
    toks, chosen, top = sample(logits, [SamplingParams(temperature=0, logprobs=3)] * 2, [None, None])
    ref = logits.log_softmax(-1)
    assert torch.allclose(chosen, ref.gather(1, toks[:, None])[:, 0])
    assert torch.allclose(top.values, ref.topk(3, -1).values)


@pytest.mark.parametrize("kwargs", [{"max_tokens": 0}, {"temperature": -1}, {"top_p": 0}, {"top_k": -2}])
def test_invalid_params(kwargs):
    with pytest.raises(InputError):
        SamplingParams(**kwargs).validate()


def test_engine_stop_strings_seed_and_limits(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine

    eng = Engine(tiny_llava_engine)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "describe the picture"}]}]
    prompt = eng.encode(msgs, [make_image(3)])
    full = eng.generate([prompt], SamplingParams(max_tokens=12, temperature=0))[0]
    assert full.finish_reason == "length" and full.completion_tokens == 12
    text = full.text
    assert len(text) > 4, text  # 12 tokens of the tiny model's vocabulary: several characters
    stop = text[2:4]
    cut = eng.generate([eng.encode(msgs, [make_image(3)])],
                       SamplingParams(max_tokens=12, temperature=0, stop=[stop]))[0]
    assert cut.finish_reason == "stop" and cut.text == text[: text.find(stop)]
    s1 = eng.generate([eng.encode(msgs, [make_image(3)])], SamplingParams(max_tokens=8, temperature=1.0, seed=42))[0]
    s2 = eng.generate([eng.encode(msgs, [make_image(3)])], SamplingParams(max_tokens=8, temperature=1.0, seed=42))[0]
    assert s1.token_ids == s2.token_ids
    with pytest.raises(LimitError, match="at most 1"):
        eng.encode(msgs, [make_image(1), make_image(2)])
    with pytest.raises(LimitError, match="max_output_len"):
        eng.submit(prompt, SamplingParams(max_tokens=10_000))
    with pytest.raises(InputError, match="placeholder"):
        eng.encode([{"role": "user", "content": "no image here"}], [make_image(1)])


def test_streamed_deltas_concatenate_to_text(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine

    eng = Engine(tiny_llava_engine)
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hello"}]}]
    deltas = []
    res = eng.chat(msgs, [make_image(4)], SamplingParams(max_tokens=16, temperature=0),
                   on_event=lambda ev: deltas.append(ev.text_delta))
    assert "".join(deltas) == res.text
    # the same image again does not go through the vision model: its KV blocks are in the prefix cache
    misses, hit_tokens = eng.feature_cache.misses, eng.pool.hit_tokens
    eng.chat(msgs, [make_image(4)], SamplingParams(max_tokens=2, temperature=0))
    assert eng.feature_cache.misses == misses and eng.pool.hit_tokens > hit_tokens
    # without prefix caching the feature cache serves it
    eng = Engine(tiny_llava_engine, enable_prefix_caching=False)
    eng.chat(msgs, [make_image(4)], SamplingParams(max_tokens=2, temperature=0))
    eng.chat(msgs, [make_image(4)], SamplingParams(max_tokens=2, temperature=0))
    assert (eng.feature_cache.misses, eng.feature_cache.hits) == (1, 1)


def test_feature_cache_evicts_least_recently_used():
    from vlmctl.runtime.vision import FeatureCache

    cache = FeatureCache(2)
    cache.put("a", 1)
    cache.put("b", 2)
    assert cache.get("a") == 1  # a is now the most recent
    cache.put("c", 3)  # evicts b
    assert cache.get("b") is None and cache.get("a") == 1 and cache.get("c") == 3
    assert (cache.hits, cache.misses) == (3, 1)
    cache.put("", 4)  # no content hash: never cached
    assert len(cache.data) == 2
    FeatureCache(0).put("x", 1)


def test_interactive_chat_repl(tiny_llava_engine, tmp_path):
    """The REPL over a pipe: /image, a question, /reset, an unknown command, /exit."""
    import subprocess
    import sys

    make_image(1).save(tmp_path / "a.png")
    script = f"/image {tmp_path / 'missing.png'}\n/image {tmp_path / 'a.png'}\nwhat is in this image?\n/reset\n/bogus\nhello\n/exit\n"
    proc = subprocess.run([sys.executable, "-m", "vlmctl", "chat", str(tiny_llava_engine), "--max-tokens", "4"],
                          input=script, capture_output=True, text=True, timeout=300)
    assert proc.returncode == 0, proc.stderr
    assert "no such image file" in proc.stderr + proc.stdout
    assert "image attached" in proc.stderr + proc.stdout
    assert "conversation reset" in proc.stderr + proc.stdout
    assert "unknown command" in proc.stderr + proc.stdout
    assert proc.stdout.count("assistant>") == 2


def test_same_image_in_one_step_is_encoded_once(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine

    eng = Engine(tiny_llava_engine)
    calls = []
    real = eng.vision.runner
    eng.vision.runner = lambda feed: (calls.append(next(iter(feed.values())).shape[0]), real(feed))[1]
    eng.vision.runner.backend = real.backend
    msgs = [{"role": "user", "content": [{"type": "image"}, {"type": "text", "text": "hello"}]}]
    prompts = [eng.encode(msgs, [make_image(9)]) for _ in range(3)]
    res = eng.generate(prompts, SamplingParams(max_tokens=3, temperature=0))
    assert calls == [1]  # one image through the vision model, not three
    assert res[0].token_ids == res[1].token_ids == res[2].token_ids
    assert eng.feature_cache.misses == 1 and eng.feature_cache.hits == 2
