"""Issue 9, item 3 (unit level): the per-request text stream (incremental detokenization + stop strings)
against the tokenizer's own full decode, and the sampler against the values that crashed it (item 1)."""

from __future__ import annotations

import random
import time

import pytest

from tiny_models import make_qwen_tokenizer, make_tokenizer


def make_sentencepiece_style_tokenizer():
    """Llama-2 style: "▁" for spaces, byte fallback (<0xC3> ...), and a decoder that strips the leading
    space of whatever it decodes: decoding a window of tokens loses a space unless it keeps context."""
    from tokenizers import Tokenizer, decoders, models, normalizers, trainers
    from transformers import PreTrainedTokenizerFast

    from tiny_models import CORPUS

    tok = Tokenizer(models.BPE(unk_token="<unk>", byte_fallback=True, fuse_unk=True))
    tok.normalizer = normalizers.Sequence([normalizers.Prepend("\u2581"), normalizers.Replace(" ", "\u2581")])
    tok.decoder = decoders.Sequence([decoders.Replace("\u2581", " "), decoders.ByteFallback(), decoders.Fuse(),
                                     decoders.Strip(" ", 1, 0)])
    specials = ["<unk>", "<s>", "</s>"] + [f"<0x{i:02X}>" for i in range(256)]
    tok.train_from_iterator(CORPUS * 4, trainers.BpeTrainer(vocab_size=420, special_tokens=specials))
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", unk_token="<unk>")


@pytest.fixture(scope="module", params=["byte-level", "qwen-style", "sentencepiece-style"])
def tokenizer(request):
    return {"byte-level": lambda: make_tokenizer(["<image>"]), "qwen-style": make_qwen_tokenizer,
            "sentencepiece-style": make_sentencepiece_style_tokenizer}[request.param]()


def _stream_all(tok, ids, stop=()):
    from vlmctl.runtime.stopping import TextStream

    ts = TextStream(tok, stop)
    out, finish = [], None
    for t in ids:
        delta, finish = ts.append(t)
        out.append(delta)
        if finish:
            break
    else:
        out.append(ts.flush())
    return "".join(out), ts.text, finish


def test_incremental_text_equals_the_full_decode(tokenizer):
    """The oracle is `tokenizer.decode(all ids, skip_special_tokens=True)`, on random id sequences that
    include special tokens and byte tokens which split UTF-8 characters."""
    rng = random.Random(0)
    vocab = len(tokenizer)
    for n in (1, 2, 7, 60, 300):
        for _ in range(5):
            ids = [rng.randrange(vocab) for _ in range(n)]
            streamed, text, finish = _stream_all(tokenizer, ids)
            assert finish is None
            assert text == streamed == tokenizer.decode(ids, skip_special_tokens=True)


def test_fast_decoder_is_transformers_decode(tokenizer):
    """The direct path through the Rust tokenizer (taken for these tokenizers) decodes as
    transformers' `decode` does, special tokens kept or skipped; a tokenizer that cleans up
    spaces keeps transformers' own decode."""
    import copy

    from vlmctl.runtime.stopping import fast_decoder

    rng = random.Random(1)
    dec = fast_decoder(tokenizer)
    assert dec.__code__ is not fast_decoder(None).__code__  # the direct path, not the fallback
    for n in (1, 3, 40):
        for _ in range(10):
            ids = [rng.randrange(len(tokenizer)) for _ in range(n)]
            for skip in (True, False):
                assert dec(ids, skip) == tokenizer.decode(ids, skip_special_tokens=skip)
    cleaning = copy.deepcopy(tokenizer)
    cleaning.clean_up_tokenization_spaces = True
    assert fast_decoder(cleaning).__code__ is fast_decoder(None).__code__


def test_stop_strings_cut_the_text_where_the_full_decode_has_them(tokenizer):
    rng = random.Random(1)
    vocab = len(tokenizer)
    checked = 0
    for _ in range(200):
        ids = [rng.randrange(vocab) for _ in range(40)]
        full = tokenizer.decode(ids, skip_special_tokens=True)
        if len(full) < 12:
            continue
        a = rng.randrange(2, len(full) - 6)
        stop = full[a:a + rng.randrange(1, 5)]
        other = "\x00never"
        streamed, text, finish = _stream_all(tokenizer, ids, [other, stop])
        assert finish == "stop"
        assert text == streamed == full[:full.index(stop)]
        checked += 1
    assert checked > 50


def test_held_back_text_is_a_possible_stop_prefix_and_is_released_at_the_end():
    from vlmctl.runtime.stopping import TextStream

    tok = make_tokenizer([])
    ids = tok.encode("the cat sat on the mat", add_special_tokens=False)
    ts = TextStream(tok, ["mat!", "cat sat in"])
    deltas = [ts.append(t)[0] for t in ids]
    assert ts.text == tok.decode(ids, skip_special_tokens=True)
    emitted = "".join(deltas)
    # "mat" could still become "mat!": it is held back until the request ends
    assert ts.text.startswith(emitted) and ts.text[len(emitted):] == "mat"
    assert emitted + ts.flush() == ts.text


def test_overlapping_stop_strings_end_at_the_earliest_match():
    from vlmctl.runtime.stopping import _StopAutomaton

    def first_cut(text, stops):
        m = _StopAutomaton(stops)
        for i, c in enumerate(text):
            n = m.step(c)
            if n:
                return text[:i + 1 - n]
        return None

    rng = random.Random(2)
    for _ in range(2000):
        text = "".join(rng.choice("ab") for _ in range(rng.randrange(1, 20)))
        stops = ["".join(rng.choice("ab") for _ in range(rng.randrange(1, 5))) for _ in range(rng.randrange(1, 4))]
        # reference: the match that ends first (and, of those, starts first)
        ends = [(text.find(s) + len(s), text.find(s)) for s in stops if s in text]
        want = text[:min(ends)[1]] if ends else None
        assert first_cut(text, stops) == want, (text, stops)


def test_work_per_token_does_not_grow_with_the_text():
    """What the engine decodes per token is a window of recent tokens, not the whole output (the old
    path decoded every id again on every token: quadratic), and the stop-string work per token does not
    grow with the number of stop strings."""
    from vlmctl.runtime.stopping import TextStream

    tok = make_tokenizer([])

    class Counting:
        def __init__(self, inner):
            self.inner, self.ids_decoded = inner, 0

        def decode(self, ids, **kw):
            self.ids_decoded += len(ids)
            return self.inner.decode(ids, **kw)

    rng = random.Random(3)
    ids = [rng.randrange(10, len(tok)) for _ in range(2000)]
    counting = Counting(tok)
    ts = TextStream(counting, [])
    for t in ids:
        ts.append(t)
    ts.flush()
    assert ts.text == tok.decode(ids, skip_special_tokens=True)
    assert counting.ids_decoded < 10 * len(ids)

    def run(stops):
        s = TextStream(tok, stops)
        t0 = time.perf_counter()
        for t in ids:
            s.append(t)
        return time.perf_counter() - t0

    few = min(run(["\x00zz"]) for _ in range(3))
    many = min(run([f"\x00{i:05d}" + "q" * 20 for i in range(5000)]) for _ in range(3))
    assert many < 3 * few + 0.05, (few, many)


# ---- item 1: the sampler takes every value the schema lets through ----------------------------------
def test_sampler_survives_extreme_values():
    import torch

    from vlmctl.runtime.sampling import SamplingParams, make_generator, sample

    torch.manual_seed(0)
    V = 50
    logits = torch.randn(6, V) * 5
    logits[5, 7] = float("nan")
    params = [SamplingParams(temperature=1e-39), SamplingParams(temperature=1.0, top_k=2 ** 63),
              SamplingParams(temperature=1.0, top_p=1e-50), SamplingParams(temperature=1.0, top_k=V + 1, seed=3),
              SamplingParams(temperature=1.0, top_k=1), SamplingParams(temperature=0.7)]
    gens = [make_generator(p.seed, "cpu") for p in params]
    toks, _, _ = sample(logits, params, gens)
    greedy = logits.nan_to_num(nan=float("-inf")).argmax(-1)
    assert toks[0] == greedy[0]  # a tiny temperature is greedy
    assert toks[2] == greedy[2]  # a tiny top_p keeps the top token only
    assert toks[4] == greedy[4]  # top_k 1
    assert toks[5] != 7  # a NaN logit is never chosen
    # top_k >= vocab is no filter: the same draw as top_k 0 with the same seed
    ref, _, _ = sample(logits[3:4], [SamplingParams(temperature=1.0, top_k=0, seed=3)], [make_generator(3, "cpu")])
    assert toks[3] == ref[0]
    # every row all NaN: still a token, no exception
    toks, _, _ = sample(torch.full((2, V), float("nan")), [SamplingParams(temperature=1.0)] * 2, [None, None])
    assert toks.shape == (2,)


def test_sampling_params_refuse_non_finite_values():
    from vlmctl.errors import InputError
    from vlmctl.runtime.sampling import SamplingParams

    for kw in ({"temperature": float("nan")}, {"temperature": float("inf")}, {"top_p": float("nan")}):
        with pytest.raises(InputError, match="finite"):
            SamplingParams(**kw).validate()
