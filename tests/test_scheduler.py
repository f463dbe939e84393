"""The paged KV cache and the token-budget scheduler against transformers (fp32, CPU).

Every way a request can be computed must give transformers' greedy tokens: prefilled whole or in
chunks of a few tokens, batched with others, resumed from prefix-cache hits (text and image
blocks), preempted and recomputed. Block accounting must return the pool to fully free after
finishes, aborts and failures; a request larger than the whole pool is refused cleanly.
"""

from __future__ import annotations

import numpy as np
import pytest

from conftest import assert_warm_steps_touch_only_block_0, cli
from parity import strip_eos
from test_llava_parity import hf_greedy
from tiny_models import make_image

EOS = 2


def user(text, n_images=1):
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


@pytest.fixture(scope="module")
def reference(tiny_llava):
    """transformers' greedy tokens for a few (prompt, image seed) cases, computed once."""
    cases = {("what is in this image?", 1): None, ("describe the picture in one sentence.", 2): None,
             ("hello world! how are you?", 3): None}
    for text, seed in cases:
        cases[(text, seed)] = strip_eos(hf_greedy(tiny_llava, user(text), [make_image(seed)], 10), EOS)
    return cases


def engine(path, **opts):
    from vlmctl.runtime.engine import Engine

    return Engine(path, **opts)


def params(n=10):
    from vlmctl.runtime.sampling import SamplingParams

    return SamplingParams(max_tokens=n, temperature=0)


def test_chunked_prefill_matches_transformers(tiny_llava_engine, reference):
    """A 3-token step budget splits every prompt (image rows included) into many chunks."""
    eng = engine(tiny_llava_engine, max_batch_size=2, max_num_batched_tokens=3, block_size=4)
    for (text, seed), ref in reference.items():
        got = eng.generate([eng.encode(user(text), [make_image(seed)])], params())[0]
        assert got.token_ids == ref
    assert eng.steps > sum(len(r) for r in reference.values()) + 10  # prompts really took several steps


def test_batched_prefill_and_decode_match_transformers(tiny_llava_engine, reference):
    eng = engine(tiny_llava_engine, max_batch_size=3, max_num_batched_tokens=64, block_size=4)
    prompts = [eng.encode(user(t), [make_image(s)]) for t, s in reference]
    got = [c.token_ids for c in eng.generate(prompts, params())]
    assert got == list(reference.values())
    assert eng.max_running_seen == 3


def test_load_time_warm_steps_touch_only_block_0(tiny_llava_engine, reference):
    """The steps a CUDA engine runs at load to compile its eager kernels (`TorchDecoder.warm_steps`: prompt,
    continuation and decode rows together) write block 0 only, which the pool never hands out; requests
    served after them still give transformers' tokens. Run here on the CPU, where load skips them."""
    eng = engine(tiny_llava_engine, max_batch_size=3, max_num_batched_tokens=64, block_size=4)
    dec = eng.decoder
    assert all(any(c.start == 0 and c.n > 1 for c in s) and any(c.start > 0 and c.n > 1 for c in s)
               for s in dec.warm_steps(3))
    assert_warm_steps_touch_only_block_0(dec)
    prompts = [eng.encode(user(t), [make_image(s)]) for t, s in reference]
    assert [c.token_ids for c in eng.generate(prompts, params())] == list(reference.values())


def test_images_encoded_ahead_on_the_vision_worker_give_the_same_tokens(tiny_llava_engine, reference):
    """vision_overlap: the images of requests left waiting are encoded on a worker thread while the
    running ones decode (one sequence at a time here, so the later requests wait and are encoded ahead)."""
    eng = engine(tiny_llava_engine, max_batch_size=1, block_size=4, vision_overlap=True)
    prompts = [eng.encode(user(t), [make_image(s)]) for t, s in reference]
    reqs = [eng.submit(p, params()) for p in prompts]
    while eng.has_work():
        eng.step()
    assert [r.completion().token_ids for r in reqs] == list(reference.values())
    # the first was admitted at once (encoded in its step); the others waited and were encoded ahead
    assert reqs[0].vision_job is None
    assert all(r.vision_job is not None and r.vision_job.ready and r.vision_job.error is None for r in reqs[1:])
    assert eng.vision.images_encoded == 3
    eng.vision._worker is None or eng.vision._worker.join(5)
    assert eng.vision._worker is None  # the worker exits once its queue is empty


def test_prefix_cache_hits_give_the_same_tokens(tiny_llava_engine, reference):
    """The same image and prompt again (and a longer prompt sharing the image prefix) reuse blocks."""
    eng = engine(tiny_llava_engine, max_batch_size=2, block_size=4)
    (text, seed), ref = next(iter(reference.items()))
    first = eng.generate([eng.encode(user(text), [make_image(seed)])], params())[0]
    hits0 = eng.pool.hit_tokens
    again = eng.generate([eng.encode(user(text), [make_image(seed)])], params())[0]
    assert first.token_ids == again.token_ids == ref
    assert eng.pool.hit_tokens - hits0 >= 16  # at least the image's rows came from the cache
    # another image at the same positions must not hit the first image's blocks
    other = eng.encode(user(text), [make_image(seed + 1)])
    req = eng.submit(other, params())
    while not req.finished:
        eng.step()
    assert req.num_cached_tokens < 4 + 16  # only the text blocks before the image can match


def test_preempted_requests_resume_exactly(tiny_llava_engine, reference):
    """A pool that holds the three prompts but not their outputs: the newest running request is
    preempted when the others need blocks, and recomputed later."""
    lens = [len(engine(tiny_llava_engine, kv_cache_tokens=4096).encode(user(t), [make_image(s)]).token_ids)
            for t, s in reference]
    room = sum(-(-n // 4) * 4 for n in lens) + 8  # every prompt, and two more blocks
    eng = engine(tiny_llava_engine, max_batch_size=3, block_size=4, kv_cache_tokens=room,
                 enable_prefix_caching=False)
    prompts = [eng.encode(user(t), [make_image(s)]) for t, s in reference]
    got = [c.token_ids for c in eng.generate(prompts, params())]
    assert got == list(reference.values())
    assert eng.scheduler.preemptions > 0
    assert eng.pool.num_used() == 0


@pytest.mark.parametrize("vision_overlap", [False, True])
def test_pool_is_fully_free_after_aborts_and_failures(tiny_llava_engine, vision_overlap):
    eng = engine(tiny_llava_engine, max_batch_size=4, block_size=4, vision_overlap=vision_overlap)
    reqs = [eng.submit(eng.encode(user("hello"), [make_image(i)]), params(20)) for i in range(6)]
    for _ in range(3):
        eng.step()
    assert eng.pool.num_used() > 0
    eng.abort(reqs[0].id)  # running
    eng.abort(reqs[5].id)  # still waiting
    # a failing request: its image's features are poisoned to a wrong row count
    bad = eng.submit(eng.encode(user("what is in this image?"), [make_image(40)]), params(5))
    bad.prompt.images[0].num_tokens += 1  # the vision output will not match: this request alone fails
    while eng.has_work():
        eng.step()
    assert reqs[0].finish_reason == "abort" and reqs[5].finish_reason == "abort"
    assert bad.finish_reason == "error" and "rows" in bad.error
    assert all(r.finish_reason == "length" for r in reqs[1:5])
    assert eng.pool.num_used() == 0 and eng.pool.num_free() == eng.pool.capacity


def test_request_larger_than_the_pool_is_refused(tiny_llava_engine, tmp_path, capsys):
    from vlmctl.errors import LimitError

    eng = engine(tiny_llava_engine, kv_cache_tokens=16, block_size=4)
    with pytest.raises(LimitError, match="KV cache"):
        eng.submit(eng.encode(user("hello"), [make_image(1)]), params(10))
    make_image(1).save(tmp_path / "i.png")
    code, _, err = cli("chat", tiny_llava_engine, "--image", tmp_path / "i.png", "--prompt", "hello",
                       "--kv-cache-tokens", "16", capsys=capsys, expect=None)
    assert code == 5 and "KV cache" in err


def test_block_pool_accounting_and_prefix_keys():
    from vlmctl.runtime.kv_cache import BlockPool, block_hashes, image_row_tokens

    pool = BlockPool(9, 4)
    assert pool.capacity == 8 and pool.num_free() == 8
    a = pool.allocate(3)
    assert 0 not in a and pool.num_free() == 5
    toks = np.arange(12, dtype=np.int64)
    hs = block_hashes(toks, 4)
    for b, h in zip(a, hs):
        pool.commit(b, h)
    pool.release(a)
    assert pool.num_free() == 8 and pool.num_used() == 0
    # the same tokens find the same blocks; a different middle block breaks the chain after it
    assert pool.lookup(hs) == a
    pool.release(a)
    toks2 = toks.copy()
    toks2[5] = 99
    assert pool.lookup(block_hashes(toks2, 4)) == a[:1]
    pool.release(a[:1])
    # cached blocks are reused last and evicted when the pool needs them
    got = pool.allocate(8)
    assert sorted(got) == list(range(1, 9)) and pool.lookup(hs) == []
    assert pool.allocate(1) is None
    # image rows are keyed by content, not by per-request fake ids
    assert (image_row_tokens("abc", 3) == image_row_tokens("abc", 3)).all()
    assert not (image_row_tokens("abc", 3) == image_row_tokens("abd", 3)).any()
    assert (image_row_tokens("abc", 3) < 0).all()


def test_chunks_never_end_inside_an_image_when_asked():
    """keep_images_whole: a chunk stops before an image it cannot finish, takes an image that begins
    it whole (past the budget), may start inside an image after a prefix hit, and later text is
    chunked as usual; without the flag chunks cut anywhere."""
    from vlmctl.models.base import EncodedPrompt
    from vlmctl.runtime.kv_cache import BlockPool
    from vlmctl.runtime.request import Request
    from vlmctl.runtime.sampling import SamplingParams
    from vlmctl.runtime.scheduler import Scheduler

    def run(keep, budget, num_computed=0):
        pool = BlockPool(64, 4, enable_prefix_caching=False)
        s = Scheduler(pool, max_num_seqs=2, max_num_batched_tokens=budget, keep_images_whole=keep)
        req = Request("r", EncodedPrompt([], [], -1), SamplingParams(max_tokens=1))
        req.all_ids = list(range(40))
        req.image_spans = [(5, 10), (20, 12)]  # rows 5..14 and 20..31
        s.add(req)
        req.num_computed = num_computed
        s._prefix_hit = lambda r: None  # keep the given start (a hit computed elsewhere)
        chunks = []
        while req.num_computed < req.num_tokens:
            out, _ = s.schedule()
            (c,) = out
            chunks.append((c.start, c.n))
            s.advance(out)
        return chunks

    assert run(False, 8) == [(0, 8), (8, 8), (16, 8), (24, 8), (32, 8)]
    assert run(True, 8) == [(0, 5), (5, 10), (15, 5), (20, 12), (32, 8)]
    assert run(True, 12) == [(0, 5), (5, 12), (17, 3), (20, 12), (32, 8)]
    assert run(True, 16) == [(0, 16), (16, 16), (32, 8)]  # boundaries that fall outside images stay
    assert run(True, 4, num_computed=9) == [(9, 6), (15, 4), (19, 1), (20, 12), (32, 4), (36, 4)]  # mid-image start


def test_image_spans_cover_an_images_extent():
    from vlmctl.formats.prompt_table import fake_ids, image_spans

    V, P = 100, 7
    toks = [1, P, P, 2, P, P, 3, P, P, P, 4]  # image 0: rows at 1, 2, 4, 5 (a separator between); image 1: 7..9
    ids = fake_ids(toks, P, V, 7)
    assert image_spans(ids, V, [4, 3]) == [(1, 5), (7, 3)]
