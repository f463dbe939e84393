"""The engine's sampling extras (structured output, penalties, logit_bias, min_p) and n > 1 siblings, at
the engine's own interface: only the requests that use an extra pay for it, nothing leaks when requests
end, preemption keeps grammar and penalty state exact, log-probabilities are the model's, and a
sibling takes its leader's prompt from the prefix cache. The same on CUDA is marked `gpu`."""

from __future__ import annotations

import json

import pytest
import torch

from tiny_models import make_image


def user(text, n_images=0):
    return [{"role": "user", "content": [{"type": "image"}] * n_images + [{"type": "text", "text": text}]}]


def sp(**kw):
    from vlmctl.runtime.sampling import SamplingParams

    kw.setdefault("max_tokens", 12)
    kw.setdefault("temperature", 0)
    return SamplingParams(**kw)


def no_ws(eng) -> dict[int, float]:
    tok = eng.tokenizer
    return {i: -100.0 for i in range(len(tok)) if tok.decode([i]) and not tok.decode([i]).strip()}


SCHEMA = {"type": "object", "properties": {"c": {"enum": ["red", "green", "blue"]},
                                           "n": {"type": "integer", "minimum": 1, "maximum": 9}},
          "required": ["c", "n"], "additionalProperties": False}


def test_plain_batches_pay_nothing_and_mixed_batches_touch_only_their_rows(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.grammar import GrammarSpec

    eng = Engine(tiny_llava_engine)
    texts = ["hello world", "a red square on a blue background", "tell me a story", "what is this?"]
    prompts = [eng.encode(user(t), []) for t in texts]
    solo = [eng.generate([p], sp())[0].token_ids for p in prompts]
    assert eng.logits_proc is None and eng._mask_buffer is None  # no extra was ever used: nothing was made
    mixed = eng.generate(prompts, [sp(), sp(grammar=GrammarSpec.json_schema(SCHEMA), logit_bias=no_ws(eng),
                                          max_tokens=60),
                                   sp(repetition_penalty=1.8, frequency_penalty=1.0), sp(min_p=0.5, temperature=1.2,
                                                                                         seed=3)])
    assert mixed[0].token_ids == solo[0]
    assert mixed[1].finish_reason == "stop" and json.loads(mixed[1].text)["c"] in ("red", "green", "blue")
    assert mixed[2].token_ids != solo[2]
    assert len(eng.logits_proc) == 0  # finished requests gave their rows back


def test_preemption_keeps_grammar_and_penalty_state(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.grammar import GrammarSpec

    texts = ["hello world! how are you?", "describe the picture in one sentence.", "Tell me a story about a robot."]

    def params(eng):
        return [sp(grammar=GrammarSpec.json_schema(SCHEMA), logit_bias=no_ws(eng), max_tokens=40),
                sp(repetition_penalty=1.6, presence_penalty=0.5, max_tokens=40, ignore_eos=True),
                sp(frequency_penalty=1.5, max_tokens=40, ignore_eos=True)]

    roomy = Engine(tiny_llava_engine, max_batch_size=3, block_size=4)
    want = [c.token_ids for c in roomy.generate([roomy.encode(user(t, 1), [make_image(i)]) for i, t in
                                                 enumerate(texts)], params(roomy))]
    lens = [len(roomy.encode(user(t, 1), [make_image(i)]).token_ids) for i, t in enumerate(texts)]
    tight = Engine(tiny_llava_engine, max_batch_size=3, block_size=4, kv_cache_tokens=sum(lens) + 40,
                   enable_prefix_caching=False)
    got = [c.token_ids for c in tight.generate([tight.encode(user(t, 1), [make_image(i)]) for i, t in
                                                enumerate(texts)], params(tight))]
    assert tight.scheduler.preemptions > 0
    assert got == want
    assert len(tight.logits_proc) == 0 and tight.pool.num_used() == 0


def test_aborted_and_failed_requests_release_their_rows(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine

    eng = Engine(tiny_llava_engine, max_batch_size=4)
    reqs = [eng.submit(eng.encode(user(f"hello {i}"), []), sp(frequency_penalty=1.0, max_tokens=30,
                                                                ignore_eos=True)) for i in range(3)]
    for _ in range(4):
        eng.step()
    assert len(eng.logits_proc) == 3
    eng.abort(reqs[0].id)
    eng.step()
    assert len(eng.logits_proc) == 2 and reqs[0].finish_reason == "abort"
    while eng.has_work():
        eng.step()
    assert len(eng.logits_proc) == 0


def test_logprobs_are_the_models_before_penalties_and_masks(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.grammar import GrammarSpec

    eng = Engine(tiny_llava_engine)
    p = eng.encode(user("hello world"), [])
    plain = eng.generate([p], sp(max_tokens=1, logprobs=5))[0].logprobs[0]
    for extra in ({"repetition_penalty": 2.0, "logit_bias": {plain["token_id"]: -100.0}},
                  {"grammar": GrammarSpec.json_object()}):
        got = eng.generate([p], sp(max_tokens=1, logprobs=5, **extra))[0].logprobs[0]
        assert got["token_id"] != plain["token_id"]  # the extra changed the choice...
        assert got["top"] == plain["top"]  # ...not the model's distribution that logprobs report
        assert got["logprob"] < plain["top"][0][1]  # the chosen token's own log-probability, not 0
        tops = dict(plain["top"])
        if got["token_id"] in tops:
            assert got["logprob"] == pytest.approx(tops[got["token_id"]])


def test_siblings_wait_for_the_leader_and_hit_its_blocks(tiny_llava_engine):
    from vlmctl.runtime.engine import Engine

    eng = Engine(tiny_llava_engine, max_batch_size=4, block_size=4, max_num_batched_tokens=512)
    p = eng.encode(user("describe the picture in one sentence.", 1), [make_image(5)])
    lead = eng.submit(p, sp(temperature=1.0, seed=1))
    sibs = [eng.submit(p, sp(temperature=1.0, seed=1 + i), leader=lead) for i in (1, 2)]
    eng.step()  # the leader's whole prompt fits one step; the siblings wait
    assert [s.status for s in sibs] == ["waiting", "waiting"] and lead.num_computed >= lead.prompt_len
    eng.step()
    full = (lead.prompt_len - 1) // 4 * 4
    assert [s.num_cached_tokens for s in sibs] == [full, full]
    while eng.has_work():
        eng.step()
    alone = [eng.generate([eng.encode(user("describe the picture in one sentence.", 1), [make_image(5)])],
                          sp(temperature=1.0, seed=1 + i))[0].token_ids for i in (1, 2)]
    assert [s.output_ids for s in sibs] == alone  # sharing the prompt changed nothing
    # without prefix caching there is nothing to share: nobody waits
    eng2 = Engine(tiny_llava_engine, max_batch_size=4, block_size=4, enable_prefix_caching=False)
    lead = eng2.submit(p, sp())
    sib = eng2.submit(p, sp(), leader=lead)
    eng2.step()
    assert sib.status == "running"
    while eng2.has_work():
        eng2.step()
    assert lead.error is None and sib.error is None and sib.output_ids == lead.output_ids  # both greedy


def test_tensorrt_llm_refuses_what_it_cannot_apply():
    from vlmctl.errors import InputError
    from vlmctl.runtime.grammar import GrammarSpec
    from vlmctl.runtime.trtllm_decoder import check_params

    check_params(sp(temperature=0.7, top_p=0.9, top_k=5, seed=1))
    for kw, name in (({"presence_penalty": 0.5}, "presence_penalty"),
                     ({"frequency_penalty": -1.0}, "frequency_penalty"),
                     ({"repetition_penalty": 1.2}, "repetition_penalty"), ({"min_p": 0.1}, "min_p"),
                     ({"logit_bias": {3: 1.0}}, "logit_bias"), ({"grammar": GrammarSpec.json_object()},
                                                                "response_format")):
        with pytest.raises(InputError) as e:
            check_params(sp(**kw))
        assert e.value.param == name and "TensorRT-LLM" in e.value.message


def test_sampling_params_validate_the_extras():
    from vlmctl.errors import InputError
    from vlmctl.runtime.grammar import GrammarSpec

    for kw, param in (({"presence_penalty": 3.0}, "presence_penalty"), ({"min_p": -0.1}, "min_p"),
                      ({"repetition_penalty": 0.0}, "repetition_penalty"), ({"logit_bias": {1: 101.0}}, "logit_bias"),
                      ({"logit_bias": {-1: 1.0}}, "logit_bias"), ({"logit_bias": {1: float("nan")}}, "logit_bias"),
                      ({"grammar": GrammarSpec.json_object(), "ignore_eos": True}, "ignore_eos")):
        with pytest.raises(InputError) as e:
            sp(**kw).validate()
        assert e.value.param == param


@pytest.mark.gpu
@pytest.mark.skipif(not torch.cuda.is_available(), reason="needs a CUDA device")
def test_extras_on_cuda(tmp_path):
    """On the GPU: masks and penalties are applied to device logits, constrained outputs are valid,
    and the engine's extra state lives on the device."""
    pytest.importorskip("llguidance", reason="structured outputs need the grammar engine (the dev extra)")
    from conftest import write_recipe
    from tiny_models import make_llava

    from vlmctl.pipeline import build
    from vlmctl.recipe import load_recipe
    from vlmctl.runtime.engine import Engine
    from vlmctl.runtime.grammar import GrammarSpec

    ckpt = make_llava(tmp_path / "ckpt", hidden=128, text_layers=3, init_range=0.05)
    build(load_recipe(write_recipe(tmp_path / "r.yaml", ckpt, dtype="float16", profiles=[],
                                   limits={"max_batch_size": 8, "max_input_len": 256, "max_output_len": 64})),
          tmp_path / "eng")
    eng = Engine(tmp_path / "eng", device="cuda", kv_cache_tokens=4096)
    prompts = [eng.encode(user(t, 1), [make_image(i)]) for i, t in enumerate(["hello", "a red square", "what?",
                                                                              "the sky"])]
    outs = eng.generate(prompts, [sp(grammar=GrammarSpec.json_schema(SCHEMA), logit_bias=no_ws(eng), max_tokens=60),
                                  sp(grammar=GrammarSpec.json_object(), logit_bias=no_ws(eng), max_tokens=60,
                                     temperature=0.8, seed=2),
                                  sp(repetition_penalty=1.5, frequency_penalty=0.5, logprobs=2), sp(min_p=0.3,
                                                                                                    temperature=1.0)])
    assert eng.logits_proc.device.type == "cuda"
    doc = json.loads(outs[0].text)
    assert doc["c"] in ("red", "green", "blue") and 1 <= doc["n"] <= 9
    if outs[1].finish_reason == "stop":
        assert isinstance(json.loads(outs[1].text), dict)
    assert outs[2].logprobs and len(outs[2].logprobs) == len(outs[2].token_ids)
