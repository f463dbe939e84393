"""Structured outputs (vlmctl/runtime/grammar.py): specs and their cache, matchers, token masks.

Generated documents are checked with the `jsonschema` validator (an oracle independent of the
grammar engine); masks are checked against a bit-by-bit reference. Tokenizers are built locally
(a Qwen2-style byte-level BPE) or, where installed, SmolLM2's.
"""

from __future__ import annotations

import json

import pytest

import jsonschema  # noqa: E402  (the dev extra's validator: the oracle here)
import torch  # noqa: E402
from tiny_models import make_qwen_tokenizer  # noqa: E402

from vlmctl.errors import InputError  # noqa: E402
from vlmctl.runtime.grammar import (PARALLEL_FILL_MIN, GrammarCompiler, GrammarSpec, MaskBuffer,  # noqa: E402
                                    allocate_bitmask, apply_bitmask, apply_masks, close_objects, fill_bitmasks,
                                    unpack_bitmask)

NESTED = {"type": "object", "properties": {
    "name": {"type": "string", "maxLength": 12},
    "address": {"type": "object", "properties": {"city": {"type": "string", "maxLength": 10},
                                                 "zip": {"type": "integer", "minimum": 0, "maximum": 99999}},
                "required": ["city", "zip"]}},
    "required": ["name", "address"]}
ENUMS = {"type": "object", "properties": {"color": {"enum": ["red", "green", "blue"]}, "n": {"enum": [1, 2, 3]}},
         "required": ["color", "n"]}
ARRAYS = {"type": "object", "properties": {"tags": {"type": "array", "items": {"type": "string", "maxLength": 8},
                                                    "minItems": 1, "maxItems": 3},
                                           "box": {"type": "array", "items": {"type": "integer", "minimum": 0,
                                                                              "maximum": 9},
                                                   "minItems": 4, "maxItems": 4}},
          "required": ["tags", "box"]}
BOUNDS = {"type": "object", "properties": {"rating": {"type": "integer", "minimum": 1, "maximum": 5},
                                           "score": {"type": "number", "minimum": 0, "maximum": 1},
                                           "neg": {"type": "integer", "maximum": -3, "minimum": -20}},
          "required": ["rating", "score", "neg"]}
STRICT = {"type": "object", "additionalProperties": False, "required": ["title", "steps", "note"],
          "properties": {"title": {"type": "string", "maxLength": 10},
                         "steps": {"type": "array", "maxItems": 2, "items": {"$ref": "#/$defs/step"}},
                         "note": {"type": ["string", "null"], "maxLength": 6}},
          "$defs": {"step": {"type": "object", "additionalProperties": False, "required": ["out"],
                             "properties": {"out": {"type": "string", "maxLength": 6}}}}}
SCHEMAS = {"nested": NESTED, "enums": ENUMS, "arrays": ARRAYS, "bounds": BOUNDS, "strict": STRICT}


@pytest.fixture(scope="module")
def qwen_tok():
    return make_qwen_tokenizer()


@pytest.fixture(scope="module")
def compiler(qwen_tok):
    # model vocabulary padded past the tokenizer (as Qwen2.5's 152064 > 151665 tokenizer ids)
    return GrammarCompiler(qwen_tok, vocab_size=len(qwen_tok) + 37, stop_token_ids=[qwen_tok.eos_token_id])


def token_texts(tok, vocab):
    return [tok.decode([i]) if i < len(tok) else "" for i in range(vocab)]


def generate(compiler, tok, spec, *, seed, greedy, max_steps=400):
    """A stand-in for a model whose logits are random but lean towards closing things (quotes,
    brackets, commas, EOS), so that documents end: every token still passes through the mask."""
    g = torch.Generator().manual_seed(seed)
    # raw vocabulary pieces (byte-level BPE keeps these ASCII characters as they are): fast on 49k tokens
    pieces = tok.convert_ids_to_tokens(list(range(len(tok)))) + [""] * (compiler.vocab_size - len(tok))
    lean = torch.tensor([4.0 * any(c in (p or "") for c in '"}],') - 4.0 * bool(p and set(p) <= set("ĠĊĉč"))
                         for p in pieces])  # ...and away from whitespace-only tokens
    lean[list(compiler.stop_token_ids)] = 6.0
    m = compiler.matcher(spec)
    buf = MaskBuffer(compiler.vocab_size)
    out = []
    for _ in range(max_steps):
        logits = torch.randn(1, compiler.vocab_size, generator=g) + lean
        apply_masks(logits, [m], buf)
        if not greedy:  # a sample from softmax(logits), drawn as argmax(logits + Gumbel noise)
            logits = logits - torch.empty_like(logits).exponential_(generator=g).log()
        tok_id = int(logits.argmax())
        assert m.accept(tok_id), f"a token sampled from masked logits was refused: {tok_id}"
        if tok_id in compiler.stop_token_ids:
            assert m.is_terminated
            return tok.decode(out)
        out.append(tok_id)
    pytest.fail(f"no EOS after {max_steps} steps: {tok.decode(out)!r}")


# ---- specs and the cache ----------------------------------------------------------------------
def test_spec_canonical_form_keeps_property_order():
    a = GrammarSpec.json_schema({"type": "object", "properties": {"a": {}, "b": {}}})
    b = GrammarSpec.json_schema('{ "type" : "object",\n "properties": {"a": {}, "b": {}} }')
    c = GrammarSpec.json_schema({"type": "object", "properties": {"b": {}, "a": {}}})
    assert a == b and hash(a) == hash(b)
    assert a != c  # order decides the order fields are generated in
    assert GrammarSpec.json_object() != GrammarSpec.json_schema({"type": "object"})


@pytest.mark.parametrize("bad, words", [("{not json", "not valid JSON"), ("[1, 2]", "must be an object"),
                                        (3, "must be an object")])
def test_spec_refuses_what_is_not_a_schema(bad, words):
    with pytest.raises(InputError, match=words):
        GrammarSpec.json_schema(bad)


def test_compile_cache_is_lru_keyed_by_spec(qwen_tok):
    comp = GrammarCompiler(qwen_tok, cache_size=2)
    s1, s2, s3 = (GrammarSpec.json_schema(s) for s in (ENUMS, BOUNDS, ARRAYS))
    c1 = comp.compile(s1)
    assert comp.compile(GrammarSpec.json_schema(json.dumps(ENUMS, indent=4))) is c1  # same schema, other spacing
    assert (comp.hits, comp.misses) == (1, 1)
    comp.compile(s2)
    comp.compile(s1)  # s1 is now the most recent
    comp.compile(s3)  # evicts s2
    assert comp.cache_len == 2 and (comp.hits, comp.misses) == (2, 3)
    assert comp.compile(s1) is c1
    comp.compile(s2)
    assert comp.misses == 4


@pytest.mark.parametrize("schema, words", [
    ({"type": "foo"}, "Invalid type: foo"),
    ({"$ref": "#/$defs/missing"}, "/$defs/missing' does not exist"),
    ({"type": "string", "pattern": "(("}, "unclosed group"),
    ({"type": "array", "uniqueItems": True}, "uniqueItems"),  # not silently ignored: the output could break it
    ({"type": "integer", "minimum": "x"}, "minimum"),
])
def test_uncompilable_schema_is_one_clean_input_error(compiler, schema, words):
    with pytest.raises(InputError) as e:
        compiler.compile(GrammarSpec.json_schema(schema))
    msg = e.value.message
    assert words in msg and msg.startswith("the JSON schema cannot be used")
    assert "\n" not in msg


def test_false_schema_is_refused_and_true_means_anything():
    with pytest.raises(InputError, match="no document"):
        GrammarSpec.json_schema(False)
    assert GrammarSpec.json_schema(True) == GrammarSpec.json_schema({})


# ---- generation under the mask ---------------------------------------------------------------
@pytest.mark.parametrize("name", sorted(SCHEMAS))
@pytest.mark.parametrize("greedy", [True, False], ids=["greedy", "sampled"])
def test_generated_documents_satisfy_the_schema(compiler, qwen_tok, name, greedy):
    schema = SCHEMAS[name]
    for seed in range(3):
        text = generate(compiler, qwen_tok, GrammarSpec.json_schema(schema), seed=seed, greedy=greedy)
        doc = json.loads(text)
        jsonschema.validate(doc, schema)


def test_strict_adds_no_undeclared_keys_and_loose_follows_the_schema(compiler, qwen_tok):
    schema = {"type": "object", "properties": {"a": {"type": "integer", "minimum": 0, "maximum": 9}},
              "required": ["a"]}
    strict, loose = GrammarSpec.json_schema(schema, strict=True), GrammarSpec.json_schema(schema)
    assert strict != loose
    assert not compiler.matcher(strict).accept_text('{"a": 1, "b": 2}')
    assert compiler.matcher(loose).accept_text('{"a": 1, "b": 2}')  # JSON Schema: extra keys are allowed
    for seed in range(4):
        doc = json.loads(generate(compiler, qwen_tok, strict, seed=seed, greedy=False))
        assert set(doc) == {"a"}
        jsonschema.validate(doc, schema)
    # a schema that asks for other keys keeps them under strict
    m = compiler.matcher(GrammarSpec.json_schema({"type": "object", "additionalProperties": {"type": "integer"}},
                                                 strict=True))
    assert m.accept_text('{"x": 1, "y": 2}') and m.is_completed


def test_close_objects_closes_declared_objects_only():
    step = {"type": "object", "properties": {"out": {"type": "string"}}}
    schema = {"type": "object", "properties": {"steps": {"type": "array", "items": {"$ref": "#/$defs/step"}},
                                               "meta": {"type": "object"},  # "any object": stays open
                                               "either": {"anyOf": [step, {"type": "null"}]},
                                               "both": {"allOf": [step, {"properties": {"n": {}}}]}},
              "$defs": {"step": step}}
    closed = close_objects(schema)
    assert closed["additionalProperties"] is False
    assert closed["$defs"]["step"]["additionalProperties"] is False
    assert closed["properties"]["either"]["anyOf"][0]["additionalProperties"] is False
    assert "additionalProperties" not in closed["properties"]["meta"]
    assert all("additionalProperties" not in b for b in closed["properties"]["both"]["allOf"])
    assert "additionalProperties" not in step  # the input is not modified
    # an OpenAI strict schema already says it everywhere: unchanged
    assert close_objects(STRICT) == STRICT


def test_length_bounded_strings_stay_valid_json(compiler):
    # the case that ruled xgrammar 0.2.9 out (docs/structured-outputs.md): raw control characters
    # inside a maxLength string are not JSON, escapes are
    spec = GrammarSpec.json_schema({"type": "string", "maxLength": 8})
    assert not compiler.matcher(spec).accept_text('"ab\x1e"')
    assert not compiler.matcher(spec).accept_text('"ab\t"')
    assert not compiler.matcher(spec).accept_text('"abcdefghi"')
    for text in ('"a\\"b"', '"a\\nb"', '"abcdefgh"', '"caf\\u00e9"', '"\\ud83d\\ude00"'):
        m = compiler.matcher(spec)
        assert m.accept_text(text) and m.is_completed, text
        assert len(json.loads(text)) <= 8


def test_json_object_allows_any_object_and_only_objects(compiler, qwen_tok):
    m = compiler.matcher(GrammarSpec.json_object())
    assert m.accept_text('{"any": [1, {"thing": null}], "at": "all"}') and m.is_completed
    assert not compiler.matcher(GrammarSpec.json_object()).accept_text("[1, 2]")
    for seed in range(3):
        assert isinstance(json.loads(generate(compiler, qwen_tok, GrammarSpec.json_object(), seed=seed,
                                              greedy=False)), dict)


# ---- the matcher -----------------------------------------------------------------------------
def test_matcher_masks_specials_padding_and_stops(compiler, qwen_tok):
    eos = qwen_tok.eos_token_id
    specials = [qwen_tok.convert_tokens_to_ids(t) for t in ("<|im_start|>", "<|image_pad|>", "<|vision_start|>")]
    m = compiler.matcher(GrammarSpec.json_schema({"type": "object", "properties": {"s": {"type": "string"}},
                                                  "required": ["s"]}))
    assert m.accept_text('{"s": "ab')
    allowed = m.allowed_tokens()
    assert allowed.shape == (compiler.vocab_size,)
    assert not allowed[specials].any(), "special tokens must never appear inside a document"
    assert not allowed[len(qwen_tok):].any(), "ids past the tokenizer (padding) must never be allowed"
    assert not allowed[eos], "EOS is not allowed before the document is complete"
    texts = token_texts(qwen_tok, compiler.vocab_size)
    assert allowed[qwen_tok.convert_tokens_to_ids("a")]
    assert all(allowed[i] for i, t in enumerate(texts[: len(qwen_tok)])
               if i not in specials + [eos] and t and '"' not in t and "\\" not in t and t.isprintable()
               and "\ufffd" not in t  # lone UTF-8 bytes: only lead bytes may start a character
               and i not in qwen_tok.all_special_ids)
    assert m.accept_text('"}') and m.is_completed and not m.is_terminated
    allowed = m.allowed_tokens()
    assert allowed[eos] and int(allowed.sum()) == 1, "a complete document allows only the stop token"
    bad = qwen_tok.convert_tokens_to_ids("a")
    assert not m.accept(bad) and not m.is_terminated  # refused, state kept
    assert m.accept(eos) and m.is_terminated


def test_fork_is_independent(compiler):
    m = compiler.matcher(GrammarSpec.json_schema(ENUMS))
    assert m.accept_text('{"color": "')
    f = m.fork()
    assert f.accept_text('red", "n": 1}') and f.is_completed
    assert not m.is_completed
    assert m.accept_text('blue", "n": 3}') and m.is_completed


# ---- masks over a batch ----------------------------------------------------------------------
def reference_apply(logits, bitmask, rows):
    """Bit by bit, in Python: the definition apply_bitmask must meet."""
    out = logits.clone()
    V = logits.shape[1]
    for j, r in enumerate(rows):
        for t in range(V):
            w = t // 32
            ok = w < bitmask.shape[1] and (int(bitmask[j, w]) >> (t % 32)) & 1
            if not ok:
                out[r, t] = float("-inf")
    return out


@pytest.mark.parametrize("vocab, words", [(100, 4), (128, 4), (70, 4), (96, 3)], ids=["exact-ish", "exact",
                                                                                       "narrower", "wider"])
@pytest.mark.parametrize("dtype", [torch.float32, torch.float16, torch.bfloat16])
def test_apply_bitmask_matches_bitwise_reference(vocab, words, dtype):
    g = torch.Generator().manual_seed(vocab)
    logits = torch.randn(5, vocab, generator=g).to(dtype)
    bitmask = torch.randint(-2**31, 2**31 - 1, (3, words), dtype=torch.int32, generator=g)
    rows = [4, 0, 2]
    want = reference_apply(logits, bitmask, rows)
    got = apply_bitmask(logits.clone(), bitmask, torch.tensor(rows))
    assert torch.equal(got, want)
    assert torch.equal(got[[1, 3]], logits[[1, 3]])  # unconstrained rows untouched, bit for bit


def test_apply_masks_touches_only_constrained_rows(compiler):
    m1 = compiler.matcher(GrammarSpec.json_schema(ENUMS))
    m2 = compiler.matcher(GrammarSpec.json_object())
    assert m2.accept_text('{"k": ')
    logits = torch.randn(4, compiler.vocab_size, generator=torch.Generator().manual_seed(0))
    before = logits.clone()
    out = apply_masks(logits, [None, m1, None, m2])
    assert out is logits
    assert torch.equal(logits[0], before[0]) and torch.equal(logits[2], before[2])
    for row, m in ((1, m1), (3, m2)):
        allowed = m.allowed_tokens()
        assert torch.equal(logits[row][allowed], before[row][allowed])
        assert bool((logits[row][~allowed] == float("-inf")).all())


def test_apply_masks_without_matchers_does_nothing():
    logits = torch.randn(3, 50)
    before = logits.clone()
    buf = MaskBuffer(50)
    assert apply_masks(logits, [None, None, None], buf) is logits
    assert torch.equal(logits, before) and buf._buf is None  # no host buffer was even allocated


def test_fill_bitmasks_packs_constrained_rows_in_order(compiler):
    ms = [None, compiler.matcher(GrammarSpec.json_schema(ENUMS)), None, compiler.matcher(GrammarSpec.json_object())]
    bm = allocate_bitmask(4, compiler.vocab_size, pin=False)
    bm.zero_()
    assert fill_bitmasks(ms, bm) == [1, 3]
    bits = unpack_bitmask(bm)[:, : compiler.vocab_size]
    assert torch.equal(bits[0], ms[1].allowed_tokens()) and torch.equal(bits[1], ms[3].allowed_tokens())
    assert not bits[2:].any()  # rows past the constrained ones are not written


def test_parallel_fill_equals_one_by_one(compiler):
    specs = [GrammarSpec.json_schema(SCHEMAS[n]) for n in sorted(SCHEMAS)] + [GrammarSpec.json_object()]
    n = PARALLEL_FILL_MIN + 3
    ms = [compiler.matcher(specs[i % len(specs)]) if i % 4 != 1 else None for i in range(n)]
    for i, m in enumerate(ms):
        if m is not None and i % 3 == 0:
            assert m.accept_text("{")
    assert sum(m is not None for m in ms) >= PARALLEL_FILL_MIN
    bm = allocate_bitmask(n, compiler.vocab_size, pin=False)
    bm.zero_()
    rows = fill_bitmasks(ms, bm)
    assert rows == [i for i, m in enumerate(ms) if m is not None]
    bits = unpack_bitmask(bm)[:, : compiler.vocab_size]
    for j, i in enumerate(rows):
        assert torch.equal(bits[j], ms[i].allowed_tokens())


def test_fill_refuses_a_bitmask_of_the_wrong_shape(compiler):
    m = compiler.matcher(GrammarSpec.json_object())
    with pytest.raises(ValueError, match="bitmask"):
        m.fill_bitmask(torch.zeros(1, 3, dtype=torch.int32))
    with pytest.raises(ValueError, match="bitmask"):
        m.fill_bitmask(allocate_bitmask(1, compiler.vocab_size, pin=False), row=1)
    with pytest.raises(ValueError, match="bitmask"):
        m.fill_bitmask(allocate_bitmask(1, compiler.vocab_size, pin=False).to(torch.int64))


@pytest.mark.gpu
def test_apply_masks_on_cuda_equals_cpu(compiler):
    if not torch.cuda.is_available():
        pytest.skip("needs CUDA")
    m = compiler.matcher(GrammarSpec.json_schema(NESTED))
    logits = torch.randn(3, compiler.vocab_size + 11, generator=torch.Generator().manual_seed(0))
    cpu = apply_masks(logits.clone(), [m, None, m])
    for dtype in (torch.float32, torch.bfloat16):
        gpu = apply_masks(logits.to("cuda", dtype), [m, None, m])
        assert torch.equal(gpu.cpu(), cpu.to(dtype))


# ---- a real tokenizer --------------------------------------------------------------------------
def test_smollm2_tokenizer_generates_valid_documents():
    pytest.importorskip("gguf", reason="loading SmolLM2's GGUF tokenizer needs gguf")
    from vlmctl.errors import CheckpointError
    from vlmctl.models.demo_checkpoint import smollm2_gguf

    try:
        gguf = smollm2_gguf()
    except CheckpointError as e:
        pytest.skip(str(e))
    from transformers import AutoTokenizer

    tok = AutoTokenizer.from_pretrained(str(gguf.parent), gguf_file=gguf.name)
    comp = GrammarCompiler(tok, stop_token_ids=[tok.eos_token_id])
    assert comp.vocab_size == 49152
    for name in ("nested", "strict"):
        text = generate(comp, tok, GrammarSpec.json_schema(SCHEMAS[name]), seed=0, greedy=False, max_steps=600)
        jsonschema.validate(json.loads(text), SCHEMAS[name])


def test_an_engine_older_than_the_floor_is_one_clear_error(monkeypatch):
    """An llguidance below pyproject's floor imports, then fails deep inside at the first compile: it is
    refused up front, naming its version and the install command."""
    from importlib import metadata

    from vlmctl.errors import BackendUnavailableError
    from vlmctl.runtime import grammar

    real = metadata.version
    monkeypatch.setattr(metadata, "version", lambda name: "1.6.1" if name == "llguidance" else real(name))
    with pytest.raises(BackendUnavailableError, match=r"llguidance 1\.6 is too old; .*pip install 'llguidance>=1\.8"):
        grammar._engine()
    monkeypatch.setattr(metadata, "version", real)
    assert grammar._engine_version() >= grammar.MIN_ENGINE_VERSION
    assert grammar._engine() is not None
