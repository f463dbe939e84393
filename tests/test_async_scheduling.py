"""Async scheduling: a step (decode rows, prompt chunks) is launched before the host reads the previous step's
tokens, its decode rows' input ids taken from that step's sampling on the device (runtime/engine.py,
`Engine._step_ahead`).

It is on by default on GPUs, where the host's per-token work (detokenizing, stop checks, scheduling) then
runs while the GPU computes. Here the engine runs it on the CPU (forced on), where it must give exactly what
the synchronous engine gives: with every sampling setting, stop rule, abort, late arrival and length limit,
and without leaking a KV block. The families' runs through it are in test_scheduler_families.py; on a GPU,
test_gpu_runtime.py checks that a step launched ahead never waits for the device.
"""

from __future__ import annotations

import json
import re
import time
import urllib.request

import pytest

from tiny_models import make_image


def _engine(path, **opts):
    from vlmctl.runtime.engine import Engine

    return Engine(path, **opts)


def _prompts(eng, n):
    texts = ["what is in this image?", "describe the picture", "hello world! how are you?", "a story, please",
             "count to ten", "name three colours", "why is the sky blue?", "say something"]
    out = []
    for i in range(n):
        content = [{"type": "text", "text": texts[i % len(texts)]}]
        images = []
        if i % 2 == 0:
            content.insert(0, {"type": "image"})
            images = [make_image(i, (40 + 4 * i, 30))]
        out.append(eng.encode([{"role": "user", "content": content}], images))
    return out


def _result(c):
    """What a completion says; log-probabilities flattened to numbers, compared with a tolerance (on the CPU a
    step launched ahead runs the decoder's decode path, the synchronous engine its chunk path: float noise)."""
    ids = [(d["token_id"], [t for t, _ in d["top"]]) for d in c.logprobs or []]
    values = [v for d in c.logprobs or [] for v in [d["logprob"]] + [v for _, v in d["top"]]]
    return c.token_ids, c.text, c.finish_reason, ids, values


SCHEMA = {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["c", "n"], "additionalProperties": False}


def _mixed_params(eng, reference_texts, reference_ids):
    from vlmctl.runtime.grammar import GrammarSpec
    from vlmctl.runtime.sampling import SamplingParams

    tok = eng.tokenizer
    no_space = {i: -100.0 for i in range(len(tok)) if tok.decode([i]) and not tok.decode([i]).strip()}

    # stop rules that fire: a piece of what the synchronous engine wrote, one of the tokens it drew
    stop_text = reference_texts[0][3:6]
    stop_id = reference_ids[2][4]
    return [SamplingParams(max_tokens=24, temperature=0, stop=[stop_text]),
            SamplingParams(max_tokens=30, temperature=0.9, seed=11, logprobs=3),
            SamplingParams(max_tokens=24, temperature=0, stop_token_ids=[stop_id]),
            SamplingParams(max_tokens=20, temperature=1.1, top_k=5, seed=12),
            SamplingParams(max_tokens=7, temperature=0.8, top_p=0.7, seed=13),
            SamplingParams(max_tokens=26, temperature=0, frequency_penalty=0.5, presence_penalty=0.3),
            # the grammar accepts the token read before the step launched ahead is sampled under its mask
            SamplingParams(max_tokens=60, temperature=0.7, seed=14, logprobs=0, grammar=GrammarSpec.json_schema(SCHEMA),
                           logit_bias=no_space),
            # counts kept on the device: each step's penalties must see the token sampled just before
            SamplingParams(max_tokens=22, temperature=0.8, seed=15, repetition_penalty=1.3, min_p=0.05,
                           logit_bias={reference_ids[1][0]: 3.0})]


def test_mixed_requests_equal_the_synchronous_engine(tiny_llava_engine):
    from vlmctl.runtime.sampling import SamplingParams

    sync = _engine(tiny_llava_engine, async_scheduling=False)
    plain = sync.generate(_prompts(sync, 8), SamplingParams(max_tokens=24, temperature=0))
    params = _mixed_params(sync, [c.text for c in plain], [c.token_ids for c in plain])
    expected = [_result(c) for c in sync.generate(_prompts(sync, 8), params)]
    assert expected[0][2] == "stop" and expected[2][2] == "stop"  # the stop rules did fire
    assert json.loads(expected[6][1])["c"] in ("red", "green", "blue") and expected[6][2] == "stop"
    assert sync.steps_ahead == 0

    eng = _engine(tiny_llava_engine, async_scheduling=True)
    got = [_result(c) for c in eng.generate(_prompts(eng, 8), params)]
    assert [g[:4] for g in got] == [e[:4] for e in expected]
    for g, e in zip(got, expected):
        assert g[4] == pytest.approx(e[4], abs=1e-4)
    assert sum(len(e[4]) for e in expected) > 50  # log-probabilities were compared
    assert eng.steps_ahead > 0 and eng.stats()["async_scheduling"] is True
    assert eng.pool.num_used() == 0 and not eng.has_work()


def test_abort_and_arrivals_while_a_step_is_in_flight(tiny_llava_engine):
    from vlmctl.runtime.sampling import SamplingParams

    greedy = SamplingParams(max_tokens=30, temperature=0, ignore_eos=True)
    sync = _engine(tiny_llava_engine, async_scheduling=False)
    a_ref, c_ref = (c.token_ids for c in sync.generate(_prompts(sync, 3)[0::2], greedy))

    eng = _engine(tiny_llava_engine, async_scheduling=True)
    prompts = _prompts(eng, 3)
    a = eng.submit(prompts[0], greedy)
    b = eng.submit(prompts[1], greedy)
    while len(a.output_ids) < 5:
        eng.step()
    assert eng._in_flight is not None and eng.steps_ahead > 0  # a step's tokens are on their way
    eng.abort(b.id)
    c = eng.submit(prompts[2], greedy)  # arrives while a step is in flight: the scheduler admits it
    while eng.has_work():
        eng.step()
    assert b.finish_reason == "abort" and len(b.output_ids) < 30
    assert a.output_ids == a_ref and c.output_ids == c_ref
    assert eng.pool.num_used() == 0 and eng.num_running == 0


def test_the_last_position_of_a_sequence(tiny_llava_engine):
    """A prompt and max_tokens that fill the engine's sequence limit. A request whose token in flight is its
    last one (max_tokens) is left out of the step launched ahead: no step computes a token nobody reads."""
    import dataclasses

    from vlmctl.runtime.sampling import SamplingParams

    sync = _engine(tiny_llava_engine, async_scheduling=False)
    lim = sync.limits
    long = sync.encode_text("the quick brown fox jumps over the lazy dog " * 24)
    prompt = dataclasses.replace(long, token_ids=list(long.token_ids[:lim.max_input_len]))
    params = SamplingParams(max_tokens=lim.max_seq_len - lim.max_input_len, temperature=0, ignore_eos=True)
    assert params.max_tokens <= lim.max_output_len
    expected = sync.generate([prompt], params)[0]
    eng = _engine(tiny_llava_engine, async_scheduling=True)
    got = eng.generate([prompt], params)[0]
    assert got.token_ids == expected.token_ids and got.finish_reason == expected.finish_reason == "length"
    assert len(prompt.token_ids) + len(got.token_ids) == lim.max_seq_len and eng.steps_ahead > 0
    assert eng.steps == sync.steps
    assert eng.pool.num_used() == 0


def test_the_option_is_off_on_a_cpu_and_on_on_a_gpu(tiny_llava_engine):
    eng = _engine(tiny_llava_engine)
    assert eng.async_scheduling is (eng.device.type == "cuda")


@pytest.fixture(scope="module")
def two_servers(tiny_llava_engine):
    """The same engine served twice on real uvicorn servers: synchronous steps, and async scheduling."""
    from conftest import serve_engine

    gens = [serve_engine(tiny_llava_engine, max_batch_size=8, async_scheduling=mode) for mode in (False, True)]
    servers = [next(g) for g in gens]
    yield servers
    for g in gens:
        next(g, None)


def test_a_server_with_async_scheduling_answers_as_the_synchronous_one(two_servers):
    """Through `vlmctl serve` and the official client: concurrent streams with seeds, stop strings, n > 1 and
    log-probabilities give the same answers, and a client that leaves mid-stream (its request aborted from
    the event loop while a step is in flight) costs the others nothing and leaks no KV block."""
    import concurrent.futures as cf

    openai = pytest.importorskip("openai")

    def ask(url, i, stream):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        kw = dict(model=client.models.list().data[0].id, max_tokens=20 + i, seed=100 + i,
                  temperature=0 if i % 3 == 0 else 0.8, messages=[{"role": "user", "content": f"story number {i}"}])
        if i == 4:
            kw.update(n=2)
        if i == 5:
            kw.update(logprobs=True, top_logprobs=2)
        if stream:
            text = "".join(c.choices[0].delta.content or "" for c in client.chat.completions.create(stream=True, **kw)
                           if c.choices)
            return [text]
        r = client.chat.completions.create(**kw)
        return [(c.message.content, c.finish_reason) for c in r.choices]

    def leave_early(url):
        client = openai.OpenAI(base_url=url + "/v1", api_key="none", max_retries=0, timeout=120)
        stream = client.chat.completions.create(model=client.models.list().data[0].id, max_tokens=200,
                                                messages=[{"role": "user", "content": "go on and on"}], stream=True,
                                                extra_body={"ignore_eos": True})
        for k, _ in enumerate(stream):
            if k == 5:
                stream.close()
                break

    answers = []
    for url, app in two_servers:
        with cf.ThreadPoolExecutor(8) as pool:
            quitter = pool.submit(leave_early, url)
            futs = [pool.submit(ask, url, i, i % 2 == 1) for i in range(7)]
            answers.append([f.result() for f in futs])
            quitter.result()
        eng = app.state.engine
        deadline = time.monotonic() + 10
        while (eng.pool.num_used() or eng.num_running) and time.monotonic() < deadline:
            time.sleep(0.05)
        assert eng.pool.num_used() == 0 and eng.num_running == 0
    sync_answers, async_answers = answers
    assert async_answers == sync_answers
    ahead = []
    for url, _ in two_servers:  # what /metrics says of it
        text = urllib.request.urlopen(url + "/metrics", timeout=30).read().decode()
        ahead.append(float(re.search(r"^vlmctl_engine_steps_ahead_total\{[^}]*\} (\S+)$", text, re.M).group(1)))
    assert ahead[0] == 0 and ahead[1] > 0
    assert ahead[1] == two_servers[1][1].state.engine.steps_ahead


def _random_workload(seed: int):
    """Requests with random prompts, images, sampling settings and stop rules, arriving at random steps, some
    aborted; engine options that chunk prompts, cache prefixes or preempt."""
    import random

    rng = random.Random(seed)
    items = []
    for _ in range(rng.randint(4, 12)):
        p = dict(max_tokens=rng.randint(1, 32), temperature=rng.choice([0, 0, 0.7, 1.2]), seed=rng.randint(0, 99),
                 ignore_eos=rng.random() < 0.5)
        for key, chance, value in (("top_k", 0.2, lambda: rng.randint(1, 20)), ("top_p", 0.2, lambda: rng.uniform(0.3, 1)),
                                   ("frequency_penalty", 0.2, lambda: rng.uniform(0, 1)),
                                   ("repetition_penalty", 0.1, lambda: rng.uniform(1, 1.5)),
                                   ("min_p", 0.1, lambda: rng.uniform(0, 0.2)), ("logprobs", 0.2, lambda: rng.randint(0, 3)),
                                   ("stop", 0.2, lambda: [rng.choice("abcdefgh ") + rng.choice("abcdefgh")]),
                                   ("stop_token_ids", 0.2, lambda: [rng.randint(0, 199)])):
            if rng.random() < chance:
                p[key] = value()
        arrive = rng.randint(0, 24)
        abort = rng.randint(arrive + 1, arrive + 24) if rng.random() < 0.15 else None
        text = " ".join(rng.choice(["cat", "dog", "red", "sky", "one", "blue", "why"]) for _ in range(rng.randint(1, 12)))
        items.append((text, rng.random() < 0.4, rng.randint(0, 5), p, arrive, abort))
    opts = dict(block_size=rng.choice([4, 16]), enable_prefix_caching=rng.random() < 0.7,
                max_num_batched_tokens=rng.choice([None, 7, 64]), max_batch_size=rng.choice([2, 4, 8]))
    if rng.random() < 0.3:
        opts["kv_cache_tokens"] = rng.choice([160, 256, 400])
    return items, opts


def _run_workload(path, items, opts, mode):
    from vlmctl.runtime.sampling import SamplingParams

    eng = _engine(path, async_scheduling=mode, **opts)
    reqs, step = {}, 0
    while len(reqs) < len(items) or eng.has_work():
        for k, (text, image, image_seed, p, arrive, _) in enumerate(items):
            if arrive == step:
                content = [{"type": "text", "text": text}]
                images = [make_image(image_seed, (32 + 4 * image_seed, 30))] if image else []
                if image:
                    content.insert(0, {"type": "image"})
                reqs[k] = eng.submit(eng.encode([{"role": "user", "content": content}], images), SamplingParams(**p))
        for k, it in enumerate(items):
            if it[5] == step and k in reqs:
                eng.abort(reqs[k].id)
        eng.step()
        step += 1
        assert step < 3000
    assert eng.pool.num_used() == 0 and eng.num_running == 0
    for k, r in reqs.items():  # log-probabilities only for the requests that asked
        assert (r.logprobs == []) == (items[k][3].get("logprobs") is None) or not r.output_ids
    # log-probabilities: ids exactly, values within float noise (_result)
    return {k: (r.output_ids, r.finish_reason, r.text, [(d["token_id"], [t for t, _ in d["top"]]) for d in r.logprobs],
                [v for d in r.logprobs for v in [d["logprob"]] + [v for _, v in d["top"]]])
            for k, r in reqs.items()}, eng


@pytest.mark.parametrize("seed", range(8))
def test_random_workloads_equal_the_synchronous_engine(tiny_llava_engine, seed):
    items, opts = _random_workload(seed)
    sync, _ = _run_workload(tiny_llava_engine, items, opts, False)
    ahead, eng = _run_workload(tiny_llava_engine, items, opts, True)
    # an abort lands at a step index, which async scheduling reaches at another point of the request's life
    aborted = {k for k, it in enumerate(items) if it[5] is not None}
    kept = [k for k in sync if k not in aborted]
    assert [ahead[k][:4] for k in kept] == [sync[k][:4] for k in kept]
    for k in kept:
        assert ahead[k][4] == pytest.approx(sync[k][4], abs=1e-4)
    assert eng.steps_ahead > 0


def test_cross_attention_requests_with_and_without_images(tmp_path):
    """Llama 3.2 Vision: a step launched ahead passes each row's cross-attention blocks (none for a text-only
    request), as the synchronous step does."""
    from conftest import write_recipe
    from tiny_mllama import make_mllama
    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe
    from vlmctl.runtime.sampling import SamplingParams

    ckpt = make_mllama(tmp_path / "ckpt")
    build(load_recipe(write_recipe(tmp_path / "r.yaml", ckpt, limits={"max_batch_size": 4})), tmp_path / "eng")
    out = {}
    for mode in (False, True):
        eng = _engine(tmp_path / "eng", async_scheduling=mode)
        prompts = [eng.encode([{"role": "user", "content": [{"type": "image"}] * (i % 2 == 0)
                                + [{"type": "text", "text": f"hi there {i}"}]}],
                              [make_image(i)] if i % 2 == 0 else []) for i in range(4)]
        params = [SamplingParams(max_tokens=12 + i, temperature=0, ignore_eos=True) for i in range(4)]
        out[mode] = [c.token_ids for c in eng.generate(prompts, params)]
        assert (eng.steps_ahead > 0) == mode and eng.pool.num_used() == 0
    assert out[True] == out[False]


@pytest.mark.parametrize("flag, on", [("--async-scheduling", True), (None, False)])
def test_the_serve_flag(tiny_llava_engine, tmp_path, flag, on):
    """`vlmctl serve --async-scheduling` (the installed command line, as a process): the start-up line says
    so, and the server answers with steps launched ahead; without the flag a CPU server runs synchronously."""
    import signal

    import httpx

    from conftest import serve_process

    err = open(tmp_path / "serve.err", "w+")
    args = ["--stats-interval", "0"] + ([flag] if flag else [])
    with serve_process(tiny_llava_engine, tmp_path, *args, err=err) as (proc, url):
        r = httpx.post(url + "/v1/chat/completions", timeout=60, json={
            "messages": [{"role": "user", "content": "hello there"}], "max_tokens": 12, "temperature": 0})
        assert r.status_code == 200 and r.json()["usage"]["completion_tokens"] > 0
        metrics = httpx.get(url + "/metrics", timeout=30).text
        proc.send_signal(signal.SIGTERM)
        assert proc.wait(60) == 0
    ahead = float(re.search(r"^vlmctl_engine_steps_ahead_total\{[^}]*\} (\S+)$", metrics, re.M).group(1))
    assert (ahead > 0) == on
    start = next(line for line in (tmp_path / "serve.err").read_text().splitlines() if "vlmctl serve" in line)
    assert ("async scheduling;" in start) == on, start


def test_steps_run_ahead_while_the_queue_waits_for_blocks(tiny_llava_engine):
    """A request left waiting because the KV pool is too full for its prompt does not stop the running ones'
    steps from launching ahead (before, any waiting request made every step synchronous, so under memory
    pressure, when load is highest, async scheduling was off); it is admitted when blocks free up, and every
    token equals the synchronous engine's."""
    from vlmctl.runtime.sampling import SamplingParams

    outputs, waited_ahead = {}, 0
    for mode in (False, True):
        eng = _engine(tiny_llava_engine, async_scheduling=mode, block_size=4, kv_cache_tokens=168, max_batch_size=4)
        prompts = [eng.encode_text(t) for t in ["hello world number one tell", "the quick brown fox jumps",
                                                "a story about a robot please"]]
        long = SamplingParams(max_tokens=60, temperature=0, ignore_eos=True)
        a, b = eng.submit(prompts[0], long), eng.submit(prompts[1], long)
        c = None
        while c is None or eng.has_work():
            if c is None and len(a.output_ids) >= 52:  # the pool now holds too little for c's prompt
                c = eng.submit(prompts[2], SamplingParams(max_tokens=20, temperature=0, ignore_eos=True))
            waiting, before = eng.num_waiting, eng.steps_ahead
            eng.step()
            waited_ahead += bool(waiting and eng.steps_ahead > before)
        outputs[mode] = [a.output_ids, b.output_ids, c.output_ids]
        assert len(c.output_ids) == 20 and eng.pool.num_used() == 0
    assert outputs[True] == outputs[False]
    assert waited_ahead > 0


def test_prompts_are_admitted_and_prefilled_in_steps_launched_ahead(tiny_llava_engine):
    """A request arriving while a step is in flight is admitted, and its prompt prefilled chunk by chunk, by
    steps launched ahead: beside its chunks, the running request's decode row takes the token still on the
    device. (Before, a request the scheduler could admit made the step synchronous, and each of its prefill
    steps too; it waited for the step in flight before its first chunk launched.) Every token equals the
    synchronous engine's, and no block leaks."""
    from vlmctl.runtime.sampling import SamplingParams

    outputs, prefill_steps = {}, {}
    for mode in (False, True):
        eng = _engine(tiny_llava_engine, async_scheduling=mode, max_num_batched_tokens=9)
        prompts = _prompts(eng, 3)
        a = eng.submit(prompts[1], SamplingParams(max_tokens=40, temperature=0, ignore_eos=True))
        while len(a.output_ids) < 3:
            eng.step()
        b = eng.submit(prompts[0], SamplingParams(max_tokens=10, temperature=0.8, seed=3, logprobs=2))  # with an image
        assert b.prompt_len > 3 * 9  # prefilled over several steps
        prefill_steps[mode] = []
        while eng.has_work():
            before, ahead = b.num_computed, eng.steps_ahead
            eng.step()
            if b.num_computed > before and before < b.prompt_len:
                prefill_steps[mode].append(eng.steps_ahead > ahead)
        outputs[mode] = [a.output_ids, b.output_ids, [d["token_id"] for d in b.logprobs]]
        assert eng.pool.num_used() == 0 and len(b.output_ids) == 10
    assert outputs[True] == outputs[False]
    assert len(prefill_steps[True]) >= 4 and all(prefill_steps[True]), prefill_steps[True]
    assert not any(prefill_steps[False])


def test_a_one_token_prompt_chunk_admitted_ahead_is_computed(tiny_llava_engine):
    """A prompt whose prefix-cache hit leaves one token to compute is a graph-shaped row (one token, after
    position 0); admitted in a step launched ahead, beside decode rows whose ids are still on the device, it must
    be computed and sampled like the others. The decoder is made to take the graph route here (on the CPU it has
    no graphs: its decode step runs eagerly), so the routing is what a GPU engine does."""
    from vlmctl.runtime.sampling import SamplingParams

    outputs = {}
    for mode in (False, True):
        eng = _engine(tiny_llava_engine, async_scheduling=mode, block_size=4, enable_prefix_caching=True)
        dec = eng.decoder
        real = dec.decode

        def eager(*a, **k):  # the graph route, run eagerly
            dec.use_graphs = False
            try:
                return real(*a, **k)
            finally:
                dec.use_graphs = True

        dec.use_graphs, dec.decode = True, eager
        texts = (f"hello there {'word ' * i}" for i in range(12))
        text = next(t for t in texts if len(eng.encode_text(t).token_ids) % 4 == 1)
        params = SamplingParams(max_tokens=6, temperature=0, ignore_eos=True)
        first = eng.generate([eng.encode_text(text)], params)[0].token_ids  # its blocks stay in the prefix cache
        a = eng.submit(eng.encode_text("a long answer please"), SamplingParams(max_tokens=30, temperature=0,
                                                                               ignore_eos=True))
        while len(a.output_ids) < 3:
            eng.step()
        again = eng.submit(eng.encode_text(text), params)  # arrives while a's step is in flight
        while eng.has_work():
            eng.step()
        assert again.num_cached_tokens == len(again.prompt.token_ids) - 1  # one token left to compute
        outputs[mode] = [first, a.output_ids, again.output_ids]
        assert again.output_ids == first and eng.pool.num_used() == 0, mode
    assert outputs[True] == outputs[False]
