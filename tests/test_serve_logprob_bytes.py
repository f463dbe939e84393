"""Logprobs and timestamps as OpenAI gives them:

- chat logprobs `bytes` are each token's own bytes, so that joining consecutive tokens' bytes rebuilds
  a character split across tokens (not U+FFFD's bytes for every partial-character token), on the
  tokenizer families in use: byte-level BPE (the tiny models', SmolLM2's) and SentencePiece style
  with byte fallback;
- legacy completions `top_logprobs` always holds the sampled token (up to logprobs + 1 entries),
  while chat's `top_logprobs` stays the top k;
- one `created` for every chunk of a streamed completion, taken when the request starts (and the
  same for a whole response).

The server tests run a real `vlmctl serve` app on uvicorn (the tiny LLaVA, whose tokenizer is a
byte-level BPE trained on English: every non-ASCII byte is a token of its own), driven by the
official `openai` client.
"""

from __future__ import annotations

import json
import time
from types import SimpleNamespace

import pytest

from test_stopping import make_sentencepiece_style_tokenizer
from tiny_models import make_qwen_tokenizer, make_tokenizer

openai = pytest.importorskip("openai")

TEXTS = ["héllo wörld, naïve café", "😀 emoji 🇫🇷 and 👩‍💻", "中文字符 and 日本語のテキスト", "Ωmega — “quotes” ±½"]


def smollm2_tokenizer():
    pytest.importorskip("gguf", reason="loading SmolLM2's GGUF tokenizer needs gguf")
    from transformers import AutoTokenizer

    from vlmctl.errors import CheckpointError
    from vlmctl.models.demo_checkpoint import smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except CheckpointError as e:
        pytest.skip(str(e))
    return AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)


# the text a tokenizer's tokens spell: the SentencePiece-style one prepends "▁" (a space) to its input
TOKENIZERS = {"byte-level": (lambda: make_tokenizer(["<image>"]), lambda s: s),
              "qwen-style": (lambda: make_qwen_tokenizer(tool_tokens=True), lambda s: s),
              "sentencepiece-style": (make_sentencepiece_style_tokenizer, lambda s: " " + s),
              "smollm2": (smollm2_tokenizer, lambda s: s)}


@pytest.fixture(scope="module", params=list(TOKENIZERS))
def tokenizer(request):
    make, spelled = TOKENIZERS[request.param]
    return make(), spelled


def chat_logprobs(tok, ids, tops=()):
    """The chat logprobs content render.ChatChoice gives for these ids (each with `tops` as its top
    alternatives), through a stand-in engine and events."""
    from vlmctl.serve.render import ChatChoice

    engine = SimpleNamespace(tokenizer=tok, eos_ids=set())
    req = SimpleNamespace(text="", finish_reason="length", params=SimpleNamespace(ignore_eos=False, stop_token_ids=[]))
    choice = ChatChoice(0, req, engine, logprobs=True)
    choice.record([SimpleNamespace(token_id=i, logprob=-0.5, top_logprobs=[(t, -1.0) for t in tops], error=None,
                                   finished=False, request=req, text_delta="") for i in ids])
    return choice.final().logprobs.content


def test_joined_token_bytes_are_the_texts_utf8(tokenizer):
    tok, spelled = tokenizer
    for text in TEXTS:
        ids = tok.encode(text, add_special_tokens=False)
        entries = chat_logprobs(tok, ids, tops=ids[:3])
        assert b"".join(bytes(e.bytes) for e in entries) == spelled(text).encode("utf-8"), text
        # the alternatives carry the same bytes as the same tokens sampled
        assert [t.bytes for t in entries[0].top_logprobs] == [e.bytes for e in entries[:3]]
    # where no character is split, the tokens' texts join into the text (a SentencePiece token keeps the
    # space its '▁' stands for, which decoding it alone drops)
    plain = "hello world, a plain sentence with spaces."
    entries = chat_logprobs(tok, tok.encode(plain, add_special_tokens=False))
    assert "".join(e.token for e in entries) == spelled(plain)
    # the texts do split characters across tokens here: such a token's text is U+FFFD, its bytes are not
    ids = [i for text in TEXTS for i in tok.encode(text, add_special_tokens=False)]
    partial = [e for e in chat_logprobs(tok, ids) if "\ufffd" in e.token]
    assert partial and all(bytes(e.bytes) != "\ufffd".encode() for e in partial)
    # special tokens are their text
    specials = [i for i, t in tok.added_tokens_decoder.items() if t.special and not t.content.startswith("<0x")]
    entries = chat_logprobs(tok, specials)
    assert [bytes(e.bytes).decode() for e in entries] == [tok.added_tokens_decoder[i].content for i in specials]


def test_byte_fallback_tokens_are_their_byte():
    """SentencePiece byte fallback: '<0xE2>' is the byte 0xE2 (its text alone is U+FFFD)."""
    tok = make_sentencepiece_style_tokenizer()
    entries = chat_logprobs(tok, [tok.convert_tokens_to_ids(f"<0x{b:02X}>") for b in range(256)])
    assert [e.bytes for e in entries] == [[b] for b in range(256)]
    assert entries[0xE2].token == "\ufffd"


# ---- against a real server ---------------------------------------------------------------------
@pytest.fixture()
def client(srv):  # srv: conftest's (the tiny engine served for batches of 8)
    return openai.OpenAI(base_url=srv[0] + "/v1", api_key="none", max_retries=0, timeout=120)


def model_of(srv) -> str:
    return srv[1].state.model_name


USER = [{"role": "user", "content": "say something."}]


def vocab_bytes(tok) -> set[bytes]:
    """Every byte string a token of this byte-level vocabulary stands for (GPT-2's byte alphabet,
    transformers' own copy of it), and the added tokens' texts."""
    from transformers.convert_slow_tokenizer import bytes_to_unicode

    back = {c: b for b, c in bytes_to_unicode().items()}
    added = {t.content for t in tok.added_tokens_decoder.values()}
    return ({bytes(back[c] for c in s) for s in tok.get_vocab() if s not in added}
            | {s.encode() for s in added})


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_chat_bytes_rebuild_characters_split_across_tokens(srv, client, stream):
    """A JSON-schema const makes the model write non-ASCII text, one byte-token at a time: the bytes
    of the content's tokens, joined, are that text's UTF-8."""
    text = "é😀中"
    rf = {"type": "json_schema", "json_schema": {"name": "c", "schema": {"const": text}, "strict": True}}
    kw = dict(model=model_of(srv), messages=USER, response_format=rf, max_tokens=40, temperature=0,
              logprobs=True, top_logprobs=3)
    if stream:
        chunks = list(client.chat.completions.create(stream=True, **kw))
        content = "".join(c.choices[0].delta.content or "" for c in chunks if c.choices)
        entries = [e for c in chunks if c.choices and c.choices[0].logprobs for e in c.choices[0].logprobs.content]
    else:
        r = client.chat.completions.create(**kw)
        content, entries = r.choices[0].message.content, r.choices[0].logprobs.content
    assert json.loads(content) == text
    assert b"".join(bytes(e.bytes) for e in entries) == json.dumps(text, ensure_ascii=False).encode()
    assert any(e.token == "\ufffd" for e in entries)  # tokens holding part of a character
    known = vocab_bytes(srv[1].state.engine.tokenizer)
    for e in entries:
        assert bytes(e.bytes) in known
        for t in e.top_logprobs:
            assert bytes(t.bytes) in known and bytes(t.bytes).decode("utf-8", "replace") == t.token


@pytest.mark.parametrize("stream", [False, True], ids=["whole", "streamed"])
def test_completion_top_logprobs_hold_the_sampled_token(srv, client, stream):
    """Hot sampling from a random model often picks a token outside the top k: completions still list
    it (OpenAI: up to logprobs + 1 entries); chat lists the top k only."""
    k = 2
    kw = dict(model=model_of(srv), prompt="the picture shows", max_tokens=48, temperature=2.0, seed=5, logprobs=k,
              extra_body={"ignore_eos": True})
    if stream:
        chunks = list(client.completions.create(stream=True, **kw))
        lps = [c.choices[0].logprobs for c in chunks if c.choices and c.choices[0].logprobs]
        tokens = [t for lp in lps for t in lp.tokens]
        token_lps = [v for lp in lps for v in lp.token_logprobs]
        tops = [d for lp in lps for d in lp.top_logprobs]
    else:
        lp = client.completions.create(**kw).choices[0].logprobs
        tokens, token_lps, tops = lp.tokens, lp.token_logprobs, lp.top_logprobs
    assert len(tokens) == len(tops) == 48
    for tok, v, top in zip(tokens, token_lps, tops):
        assert tok in top and len(top) <= k + 1
        assert top[tok] >= v - 1e-6  # its own logprob, or a likelier token's that decodes the same
        assert list(top.values()) == sorted(top.values(), reverse=True)
    assert any(len(top) == k + 1 for top in tops)  # the seed does sample outside the top k
    # logprobs=0: the sampled token alone
    lp0 = client.completions.create(**{**kw, "logprobs": 0}).choices[0].logprobs
    assert [list(top) for top in lp0.top_logprobs] == [[t] for t in lp0.tokens]
    # chat: the sampled token is the entry itself; top_logprobs is the top k
    r = client.chat.completions.create(model=model_of(srv), messages=USER, max_tokens=48, temperature=2.0, seed=5,
                                       logprobs=True, top_logprobs=k, extra_body={"ignore_eos": True})
    assert all(len(e.top_logprobs) == k for e in r.choices[0].logprobs.content)


class FakeClock:
    """schema.py's clock: the real time plus `offset`, and one second later at every reading, so that
    any two objects that each read it get different timestamps."""

    def __init__(self):
        self.offset, self.reads = 0, 0

    def time(self) -> float:
        self.reads += 1
        return time.time() + self.offset + self.reads


def test_one_created_for_every_chunk_of_a_stream(srv, client, monkeypatch):
    from vlmctl.serve import schema

    monkeypatch.setattr(schema, "time", FakeClock())
    # the clock moves on at every read: any two chunks made at different times would differ. (How many chunks
    # there are depends on how many steps' events the stream finds waiting each time it reads.)
    chat = list(client.chat.completions.create(model=model_of(srv), messages=USER, max_tokens=12, n=2,
                                               logprobs=True, stream=True, stream_options={"include_usage": True},
                                               extra_body={"ignore_eos": True}))
    cmpl = list(client.completions.create(model=model_of(srv), prompt="a picture", max_tokens=12, stream=True,
                                          logprobs=1, stream_options={"include_usage": True},
                                          extra_body={"ignore_eos": True}))
    for chunks in (chat, cmpl):
        assert len(chunks) >= 2 and chunks[-1].usage is not None
        assert len({c.created for c in chunks}) == 1, [c.created for c in chunks]
        assert len({c.id for c in chunks}) == 1
    assert chat[0].created != cmpl[0].created  # each completion its own


@pytest.mark.parametrize("endpoint", ["chat", "completions"])
def test_created_is_when_the_request_starts(srv, client, monkeypatch, endpoint):
    """Each engine step moves schema.py's clock an hour on: a `created` taken at the start of the
    request is within a minute of that clock's time before it was sent; one taken after a step, hours
    later."""
    from vlmctl.serve import schema

    clock = FakeClock()
    monkeypatch.setattr(schema, "time", clock)
    engine = srv[1].state.engine
    real_step = engine.step

    def step():
        clock.offset += 3600
        return real_step()

    monkeypatch.setattr(engine, "step", step)
    kw = dict(model=model_of(srv), max_tokens=8, extra_body={"ignore_eos": True})
    for stream in (False, True):
        before = time.time() + clock.offset
        if endpoint == "chat":
            got = client.chat.completions.create(messages=USER, stream=stream, **kw)
        else:
            got = client.completions.create(prompt="a picture", stream=stream, **kw)
        created = {c.created for c in got} if stream else {got.created}
        assert len(created) == 1 and before <= created.pop() <= before + 60
    assert clock.offset >= 3600  # the engine did step
