"""Sampling extras (vlmctl/runtime/logits_processing.py) against their references on the same logits:
transformers' RepetitionPenaltyLogitsProcessor, MinPLogitsWarper and SequenceBiasLogitsProcessor,
and OpenAI's published formula for presence/frequency penalties (written out here from counts)."""

from __future__ import annotations

from collections import Counter

import pytest
import torch
from transformers.generation.logits_process import (MinPLogitsWarper, RepetitionPenaltyLogitsProcessor,
                                                    SequenceBiasLogitsProcessor, TemperatureLogitsWarper)

from vlmctl.errors import InputError
from vlmctl.runtime.logits_processing import LogitsParams, LogitsProcessor, apply_min_p

V = 300


def rand_logits(b, v=V, seed=0, dtype=torch.float32):
    return (torch.randn(b, v, generator=torch.Generator().manual_seed(seed)) * 3).to(dtype)


def rand_ids(n, seed, v=V):
    return torch.randint(0, v, (n,), generator=torch.Generator().manual_seed(seed)).tolist()


def openai_penalized(logits, outputs, presence, frequency):
    """OpenAI: mu[j] -> mu[j] - c[j] * alpha_frequency - float(c[j] > 0) * alpha_presence."""
    out = logits.clone()
    for j, c in Counter(outputs).items():
        out[j] -= c * frequency + (1.0 if c > 0 else 0.0) * presence
    return out


def run_steps(proc, keys, outputs_per_key):
    """Feed the sampled tokens step by step, as the engine would (batched update per step)."""
    steps = max(len(o) for o in outputs_per_key)
    for s in range(steps):
        ks = [k for k, o in zip(keys, outputs_per_key) if s < len(o)]
        toks = [o[s] for o in outputs_per_key if s < len(o)]
        proc.update(ks, torch.tensor(toks))


# ---- validation ------------------------------------------------------------------------------
@pytest.mark.parametrize("fields, param", [
    ({"presence_penalty": 2.5}, "presence_penalty"), ({"frequency_penalty": -2.01}, "frequency_penalty"),
    ({"frequency_penalty": float("nan")}, "frequency_penalty"), ({"repetition_penalty": 0}, "repetition_penalty"),
    ({"repetition_penalty": float("inf")}, "repetition_penalty"), ({"min_p": 1.5}, "min_p"),
    ({"min_p": -0.1}, "min_p"), ({"logit_bias": {"12": 101}}, "logit_bias"), ({"logit_bias": {"x": 1}}, "logit_bias"),
    ({"logit_bias": {str(V): 1}}, "logit_bias"), ({"logit_bias": {"-1": 1}}, "logit_bias"),
    ({"logit_bias": {"1.5": 1}}, "logit_bias"), ({"logit_bias": {"3": "high"}}, "logit_bias"),
    ({"logit_bias": [1, 2]}, "logit_bias"), ({"presence_penalty": True}, "presence_penalty"),
])
def test_invalid_values_name_their_field(fields, param):
    with pytest.raises(InputError) as e:
        LogitsParams.from_request(vocab_size=V, **fields)
    assert e.value.param == param and param in e.value.message


def test_defaults_use_nothing_and_zero_biases_are_dropped():
    p = LogitsParams.from_request(vocab_size=V, presence_penalty=0, frequency_penalty=None, repetition_penalty=1,
                                  logit_bias={"5": 0})
    assert not p.uses_counts and p.logit_bias == {}
    assert LogitsParams.from_request(vocab_size=V, logit_bias={"5": -100, "7": 100}).logit_bias == {5: -100.0,
                                                                                                   7: 100.0}


# ---- against the references --------------------------------------------------------------------
@pytest.mark.parametrize("penalty", [1.3, 0.7, 2.0])
def test_repetition_penalty_equals_transformers(penalty):
    b = 3
    prompts = [rand_ids(12, s) for s in range(b)]
    outputs = [rand_ids(n, 10 + s) for s, n in enumerate((5, 9, 1))]
    keys = ["a", "b", "c"]
    proc = LogitsProcessor(V)
    for k, p in zip(keys, prompts):
        assert proc.add(k, LogitsParams(repetition_penalty=penalty), p)
    run_steps(proc, keys, outputs)
    logits = rand_logits(b)
    ref = RepetitionPenaltyLogitsProcessor(penalty)
    want = torch.cat([ref(torch.tensor([p + o]), logits[i:i + 1].clone()) for i, (p, o) in
                      enumerate(zip(prompts, outputs))])
    got = proc.apply(logits.clone(), keys)
    assert torch.equal(got, want)


def test_presence_and_frequency_follow_openai_formula():
    outputs = {"x": rand_ids(30, 1, v=20), "y": rand_ids(7, 2, v=40), "z": []}
    params = {"x": LogitsParams(presence_penalty=0.5, frequency_penalty=0.25),
              "y": LogitsParams(presence_penalty=-1.5, frequency_penalty=2.0),
              "z": LogitsParams(frequency_penalty=1.0)}
    proc = LogitsProcessor(V)
    for k, p in params.items():
        proc.add(k, p, rand_ids(10, 99))  # the prompt does not count for these two
    keys = list(params)
    run_steps(proc, keys, [outputs[k] for k in keys])
    for k in keys:
        want_counts = torch.zeros(V, dtype=torch.int32)
        for t, c in Counter(outputs[k]).items():
            want_counts[t] = c
        assert torch.equal(proc.output_counts(k), want_counts)
    logits = rand_logits(3, seed=4)
    got = proc.apply(logits.clone(), keys)
    for i, k in enumerate(keys):
        p = params[k]
        want = openai_penalized(logits[i], outputs[k], p.presence_penalty, p.frequency_penalty)
        torch.testing.assert_close(got[i], want, rtol=0, atol=1e-5)


def test_logit_bias_equals_transformers_sequence_bias():
    bias = {"3": 5.0, "17": -100, "299": 42.5}
    params = LogitsParams.from_request(vocab_size=V, logit_bias=bias)
    proc = LogitsProcessor(V)
    proc.add("r", params)
    logits = rand_logits(1, seed=5)
    ref = SequenceBiasLogitsProcessor([[[int(k)], float(v)] for k, v in bias.items()])
    want = ref(torch.tensor([[1, 2]]), logits.clone())
    assert torch.equal(proc.apply(logits.clone(), ["r"]), want)


def test_all_together_in_vllm_order():
    """bias, then repetition, then presence/frequency: the composition of the references."""
    prompt, out = rand_ids(20, 7), rand_ids(15, 8)
    bias = {int(prompt[0]): 3.0, int(out[0]): -2.0, 5: 1.5}
    p = LogitsParams(presence_penalty=0.4, frequency_penalty=0.3, repetition_penalty=1.2, logit_bias=bias)
    proc = LogitsProcessor(V)
    proc.add(0, p, prompt)
    run_steps(proc, [0], [out])
    logits = rand_logits(1, seed=9)
    want = SequenceBiasLogitsProcessor([[[k], v] for k, v in bias.items()])(torch.tensor([[0]]), logits.clone())
    want = RepetitionPenaltyLogitsProcessor(1.2)(torch.tensor([prompt + out]), want)
    want = openai_penalized(want[0], out, 0.4, 0.3)[None]
    torch.testing.assert_close(proc.apply(logits.clone(), [0]), want, rtol=0, atol=1e-5)


@pytest.mark.parametrize("min_p, temp", [(0.05, 1.0), (0.1, 0.7), (0.3, 1.8), (1.0, 1.0), (0.02, 0.2)])
def test_min_p_equals_transformers_after_temperature(min_p, temp):
    logits = rand_logits(4, seed=int(min_p * 100 + temp * 10))
    logits[1, 5:] = float("-inf")  # a row already masked (grammar): only five candidates
    scaled = TemperatureLogitsWarper(temp)(None, logits.clone())
    want = MinPLogitsWarper(min_p)(None, scaled)
    got = apply_min_p(logits.clone(), [min_p] * 4, [temp] * 4)
    assert torch.equal(torch.isinf(got), torch.isinf(want))  # the same tokens removed
    kept = ~torch.isinf(got)
    torch.testing.assert_close(got[kept] / temp, want[kept])
    assert kept.sum(-1).min() >= 1


def test_min_p_leaves_greedy_and_off_rows_alone():
    logits = rand_logits(3, seed=3)
    got = apply_min_p(logits.clone(), [0.2, 0.0, 0.2], [0.0, 1.0, 1.0])
    assert torch.equal(got[:2], logits[:2])
    assert torch.isinf(got[2]).any()


# ---- batching: who pays ---------------------------------------------------------------------------
def test_only_registered_rows_are_touched():
    proc = LogitsProcessor(V)
    assert not proc.add("plain", LogitsParams(min_p=0.1))  # min_p needs no state here
    assert proc.add("pen", LogitsParams(frequency_penalty=1.0), [1, 2, 3])
    assert len(proc) == 1 and "plain" not in proc
    proc.update(["plain", None, "pen", "unknown"], torch.tensor([4, 4, 4, 4]))
    logits = rand_logits(4, v=V + 20, seed=1)  # model vocabulary padded past the tokenizer's
    before = logits.clone()
    out = proc.apply(logits, ["plain", None, "pen", "unknown"])
    assert out is logits
    unchanged = [0, 1, 3]
    assert torch.equal(logits[unchanged], before[unchanged])
    assert torch.equal(logits[2, V:], before[2, V:])  # padding columns are left alone
    diff = (logits[2] != before[2]).nonzero().flatten().tolist()
    assert diff == [4] and logits[2, 4] == before[2, 4] - 1.0


def test_no_registered_request_returns_at_once():
    proc = LogitsProcessor(V)
    logits = rand_logits(2)
    before = logits.clone()
    assert proc.apply(logits, ["a", "b"]) is logits and torch.equal(logits, before)


def test_rows_are_reused_and_the_pool_grows():
    proc = LogitsProcessor(V, initial_rows=2)
    for k in range(5):
        proc.add(k, LogitsParams(presence_penalty=1.0))
    assert proc._counts.shape[0] == 8 and len(proc) == 5
    proc.update([0, 1, 2, 3, 4], torch.tensor([7, 7, 7, 7, 7]))
    proc.remove(3)
    proc.add("new", LogitsParams(presence_penalty=1.0))
    assert int(proc.output_counts("new").sum()) == 0  # a reused row starts clean
    assert int(proc.output_counts(4)[7]) == 1 and proc._counts.shape[0] == 8
    with pytest.raises(ValueError):
        proc.add(4, LogitsParams(presence_penalty=1.0))


def test_prompt_table_ids_are_ignored():
    proc = LogitsProcessor(V)
    proc.add("r", LogitsParams(repetition_penalty=2.0), [3, V + 5, V + 6, 4])  # image rows: ids >= V
    logits = torch.ones(1, V)
    proc.apply(logits, ["r"])
    assert (logits[0] != 1).nonzero().flatten().tolist() == [3, 4]


@pytest.mark.parametrize("dtype", [torch.float16, torch.bfloat16])
def test_half_precision_logits(dtype):
    prompt, out = rand_ids(10, 1), rand_ids(10, 2)
    p = LogitsParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.5, logit_bias={3: 2.0})
    proc32, proc16 = LogitsProcessor(V), LogitsProcessor(V)
    for proc in (proc32, proc16):
        proc.add("r", p, prompt)
        run_steps(proc, ["r"], [out])
    logits = rand_logits(1, seed=3)
    want = proc32.apply(logits.clone(), ["r"])
    got = proc16.apply(logits.to(dtype), ["r"])
    assert got.dtype == dtype
    torch.testing.assert_close(got.float(), want, rtol=2e-2, atol=5e-2)


@pytest.mark.gpu
def test_cuda_equals_cpu():
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    prompt, out = rand_ids(10, 1), rand_ids(10, 2)
    p = LogitsParams(presence_penalty=0.5, frequency_penalty=0.5, repetition_penalty=1.5, logit_bias={3: 2.0})
    cpu, gpu = LogitsProcessor(V), LogitsProcessor(V, device="cuda")
    for proc in (cpu, gpu):
        proc.add("r", p, prompt)
        run_steps(proc, ["r"], [out])
    logits = rand_logits(2, seed=3)
    want = cpu.apply(logits.clone(), ["r", None])
    got = gpu.apply(logits.cuda(), ["r", None])
    torch.testing.assert_close(got.cpu(), want)
    want = apply_min_p(want, [0.1, 0.1], [0.8, 1.0])
    got = apply_min_p(got, [0.1, 0.1], [0.8, 1.0])
    assert torch.equal(torch.isinf(got.cpu()), torch.isinf(want))
