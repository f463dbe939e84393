"""Structured outputs: grammars that constrain decoding to JSON, applied as token masks.

What it is: the one place that talks to the grammar engine (llguidance, imported lazily;
docs/structured-outputs.md has the measurements that chose it over xgrammar). `GrammarCompiler`
turns a `GrammarSpec` (json_object, or a JSON schema) into a compiled grammar for one tokenizer,
with an LRU cache keyed by the spec; `GrammarMatcher` follows one request's accepted tokens and
says which tokens may come next; `apply_masks` (or `fill_bitmasks` + `apply_bitmask`, for an
engine that fills on the host while the device runs the forward pass) sets the disallowed logits
of the constrained rows of a batch to -inf, on CPU or CUDA logits alike. Unconstrained rows are
never read or written, and a batch without constrained requests costs nothing.

What it is not: the sampler (runtime/sampling.py), the OpenAI request parsing (the server turns
`response_format` / `tool_choice` into a GrammarSpec), or the tool-call format (models/tool_calls.py).
"""

from __future__ import annotations

import json
import os
import threading
from collections import OrderedDict
from dataclasses import dataclass
from typing import TYPE_CHECKING, Any, Sequence

from ..errors import BackendUnavailableError, InputError

if TYPE_CHECKING:
    import torch

JSON_OBJECT = "json_object"
JSON_SCHEMA = "json_schema"
LARK = "lark"  # a full grammar in llguidance's Lark dialect (forced tool calls: models/tool_calls.py)

INSTALL_HINT = "structured outputs need the grammar engine llguidance: pip install 'llguidance>=1.8,<2'"

# Keywords whose values are subschemas (dict), lists of subschemas, or maps of subschemas.
_SUB_ONE = ("additionalProperties", "items", "contains", "not", "if", "then", "else", "propertyNames",
            "unevaluatedItems", "unevaluatedProperties", "additionalItems")
_SUB_LIST = ("anyOf", "oneOf", "allOf", "prefixItems")
_SUB_MAP = ("properties", "patternProperties", "$defs", "definitions", "dependentSchemas")


def close_objects(schema: Any, _in_all_of: bool = False) -> Any:
    """A copy of `schema` where every object that declares `properties` and says nothing about
    other keys gets `additionalProperties: false`: OpenAI's strict mode, which its own strict
    schemas spell out everywhere (for them this changes nothing). Left open: an object without
    `properties` (the only way to ask for "any object"), and the branches of an `allOf`, where
    closing one branch would forbid the keys that another declares."""
    if isinstance(schema, list):
        return [close_objects(s) for s in schema]
    if not isinstance(schema, dict):
        return schema
    out = {}
    for k, v in schema.items():
        if k in _SUB_ONE and isinstance(v, (dict, list)):
            out[k] = close_objects(v)
        elif k in _SUB_LIST and isinstance(v, list):
            out[k] = [close_objects(s, _in_all_of=(k == "allOf")) for s in v]
        elif k in _SUB_MAP and isinstance(v, dict):
            out[k] = {name: close_objects(s) for name, s in v.items()}
        else:
            out[k] = v
    says_other_keys = any(k in out for k in ("additionalProperties", "patternProperties", "unevaluatedProperties"))
    if isinstance(out.get("properties"), dict) and not says_other_keys and not _in_all_of and "allOf" not in out:
        out["additionalProperties"] = False
    return out


@dataclass(frozen=True)
class GrammarSpec:
    """What a request's output must match; hashable, so it is also the compile-cache key.

    `schema` is the JSON schema as compiled, serialized compactly with the client's key order
    kept: property order decides the order in which fields are generated, so two schemas that
    differ only in order are different grammars. For json_object it is empty.
    """

    kind: str
    schema: str = ""

    @classmethod
    def json_object(cls) -> "GrammarSpec":
        return cls(JSON_OBJECT)

    @classmethod
    def lark(cls, grammar: str) -> "GrammarSpec":
        """A grammar in llguidance's Lark dialect (%json {...} embeds a JSON schema; <[id]> is a token)."""
        if not isinstance(grammar, str) or "start" not in grammar:
            raise InputError("a Lark grammar needs a `start` rule")
        return cls(LARK, grammar)

    @classmethod
    def json_schema(cls, schema: dict | str | bool, *, strict: bool = False) -> "GrammarSpec":
        """OpenAI's response_format json_schema. strict=False: the schema as JSON Schema defines it
        (keys not declared are allowed unless additionalProperties says no). strict=True: objects
        with declared properties take no other keys (`close_objects`). Both always produce a
        document that the schema validates."""
        if isinstance(schema, str):
            try:
                schema = json.loads(schema)
            except json.JSONDecodeError as e:
                raise InputError(f"the JSON schema is not valid JSON ({e.msg} at character {e.pos})") from None
        if schema is True:
            schema = {}
        if schema is False:
            raise InputError("the JSON schema is `false`, which no document satisfies")
        if not isinstance(schema, dict):
            raise InputError(f"a JSON schema must be an object (got {type(schema).__name__})")
        if strict:
            schema = close_objects(schema)
        try:
            text = json.dumps(schema, separators=(",", ":"), ensure_ascii=False, allow_nan=False)
        except ValueError as e:
            raise InputError(f"the JSON schema cannot be serialized: {e}") from None
        return cls(JSON_SCHEMA, text)


def schema_file_spec(path) -> GrammarSpec:
    """The GrammarSpec of a JSON file holding a JSON schema, or OpenAI's json_schema object
    ({"name", "schema", "strict"}: its strict flag is used). InputError for anything else."""
    from pathlib import Path

    path = Path(path)
    try:
        data = json.loads(path.read_text())
    except OSError as e:
        raise InputError(f"{path}: cannot read the JSON schema ({e.strerror or e})") from None
    except (ValueError, UnicodeDecodeError) as e:
        raise InputError(f"{path}: not a JSON file ({e})") from None
    if isinstance(data, dict) and "schema" in data and "name" in data:
        strict = data.get("strict")
        if strict is not None and not isinstance(strict, bool):
            raise InputError(f"{path}: strict must be true or false")
        data, strict = data["schema"], bool(strict)
    else:
        strict = False
    try:
        return GrammarSpec.json_schema(data, strict=strict)
    except InputError as e:
        raise InputError(f"{path}: {e.message}") from None


MIN_ENGINE_VERSION = (1, 8)  # the first llguidance whose tokenizer takes several stop ids (pyproject's floor)


def _engine():
    try:
        import llguidance
        import llguidance.hf  # noqa: F401
    except ImportError:
        raise BackendUnavailableError(INSTALL_HINT) from None
    # an older llguidance imports but fails deep inside at the first compile (a TypeError on the stop ids)
    version = _engine_version()
    if version is not None and version < MIN_ENGINE_VERSION:
        raise BackendUnavailableError(f"llguidance {'.'.join(map(str, version))} is too old; {INSTALL_HINT}")
    return llguidance


def _engine_version() -> tuple[int, ...] | None:
    """The installed llguidance's (major, minor), or None where its metadata cannot be read."""
    from importlib import metadata

    try:
        parts = metadata.version("llguidance").split(".")[:2]
        return tuple(int("".join(c for c in p if c.isdigit()) or 0) for p in parts)
    except (metadata.PackageNotFoundError, ValueError):
        return None


def engine_available() -> bool:
    """Whether structured outputs can be served here (the grammar engine imports)."""
    try:
        _engine()
    except BackendUnavailableError:
        return False
    return True


def _one_line(msg: str) -> str:
    return " ".join(str(msg).split())


class GrammarMatcher:
    """One request's position in its grammar. Not thread-safe; owned by the engine thread.

    Once the document is complete the mask allows only the stop tokens (or, for an open-ended
    value such as a number, its continuation and the stop tokens); accepting a stop token
    terminates the matcher and the request ends with finish_reason "stop".
    """

    __slots__ = ("_m", "_lltok", "spec", "vocab_size", "stop_token_ids", "_terminated")

    def __init__(self, handle, lltok, spec: GrammarSpec, vocab_size: int, stop_token_ids: frozenset):
        self._m, self._lltok, self.spec = handle, lltok, spec
        self.vocab_size, self.stop_token_ids = vocab_size, stop_token_ids
        self._terminated = False

    def accept(self, token_id: int) -> bool:
        """Advance by a sampled token. False, with the state unchanged, when the grammar does not
        allow it (which a token sampled from masked logits never is)."""
        t = int(token_id)
        if self._terminated:
            return False
        # validate_tokens does not count a stop token; one is allowed exactly when the document is complete
        allowed = self._m.is_accepting() if t in self.stop_token_ids else self._m.validate_tokens([t]) == 1
        if not allowed:
            return False
        if not self._m.consume_token(t):  # cannot happen after validate_tokens; be loud if it does
            raise RuntimeError(f"grammar engine refused a validated token: {_one_line(self._m.get_error())}")
        if t in self.stop_token_ids:
            self._terminated = True
        return True

    def accept_text(self, text: str) -> bool:
        """Advance by text, tokenized the tokenizer's way (a forced prefix; tests). False, with
        the state unchanged, unless the grammar allows all of it."""
        ids = self._lltok.tokenize_str(text)
        if self._terminated or self._m.validate_tokens(ids) != len(ids):
            return False
        return all(self.accept(t) for t in ids)

    def fill_bitmask(self, bitmask: "torch.Tensor", row: int = 0) -> None:
        """Write the allowed-token bits into `bitmask[row]` (int32 on the host, bit t%32 of word t//32)."""
        import torch

        if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or bitmask.dim() != 2 \
                or bitmask.shape[1] != bitmask_words(self.vocab_size) or not 0 <= row < bitmask.shape[0]:
            raise ValueError(f"bitmask must be int32 [rows, {bitmask_words(self.vocab_size)}] on the host "
                             f"(got {tuple(bitmask.shape)} {bitmask.dtype} on {bitmask.device}, row {row})")
        v = bitmask[row]
        if not v.is_contiguous():
            raise ValueError("bitmask rows must be contiguous")
        # llguidance writes the row through the pointer; the checks above keep it inside the tensor.
        self._m.unsafe_compute_mask_ptr(v.data_ptr(), v.numel() * 4)

    def allowed_tokens(self) -> "torch.Tensor":
        """bool [vocab_size]: which tokens may come next (for tests and debugging)."""
        bm = allocate_bitmask(1, self.vocab_size, pin=False)
        self.fill_bitmask(bm, 0)
        return unpack_bitmask(bm)[0, : self.vocab_size]

    @property
    def is_terminated(self) -> bool:
        """A stop token was accepted: nothing more may be generated."""
        return self._terminated

    @property
    def is_completed(self) -> bool:
        """The text so far is a complete document (a stop token may come next)."""
        return bool(self._m.is_accepting())

    def rollback(self, num_tokens: int = 1) -> None:
        if num_tokens > 0:
            self._m.rollback(int(num_tokens))
            self._terminated = False

    def fork(self) -> "GrammarMatcher":
        """An independent copy at the same position (n > 1 samples sharing one prompt)."""
        f = GrammarMatcher(self._m.deep_copy(), self._lltok, self.spec, self.vocab_size, self.stop_token_ids)
        f._terminated = self._terminated
        return f


class GrammarCompiler:
    """Compiles GrammarSpecs against one tokenizer, with an LRU cache of compiled grammars.

    `vocab_size` is the model's logits width (lm_head rows), which may exceed the tokenizer's
    size (padded vocabularies, and VLMs whose image-placeholder ids sit past the text vocabulary):
    ids past the tokenizer are never allowed. It may also be below it (Llama 3.2 Vision: `<|image|>`
    is a token past the LM head): the grammar engine still covers every tokenizer id, and the masks
    are `mask_size` bits wide (`apply_bitmask` keeps the logits' columns). `stop_token_ids` are the
    ids that end a turn (the engine's EOS ids). The tokenizer's special tokens (image placeholders, <|im_start|>...) are
    never allowed inside a document. Thread-safe: the server compiles in a worker thread (a
    400 for a bad schema before the request is queued) while the engine thread makes matchers.
    """

    def __init__(self, tokenizer, *, vocab_size: int | None = None, stop_token_ids: Sequence[int] | None = None,
                 cache_size: int = 128):
        llg = _engine()
        import transformers

        if not isinstance(tokenizer, transformers.PreTrainedTokenizerFast):
            raise BackendUnavailableError(f"structured outputs need a fast (Rust) tokenizer; this checkpoint's is "
                                          f"{type(tokenizer).__name__}")
        tok_size = max(len(tokenizer), max(tokenizer.get_vocab().values()) + 1)
        self.vocab_size = int(vocab_size or tok_size)
        # llguidance needs every tokenizer id in its vocabulary; ids past the logits are never sampled
        self.mask_size = max(self.vocab_size, tok_size)
        stops = [int(t) for t in (stop_token_ids if stop_token_ids is not None else [tokenizer.eos_token_id])
                 if t is not None]
        if not stops:
            raise InputError("structured outputs need at least one stop token id (the tokenizer has no EOS)")
        self.stop_token_ids = tuple(dict.fromkeys(stops))
        self._llg = llg
        self._lltok = llg.hf.from_tokenizer(tokenizer, n_vocab=self.mask_size, eos_token=stops)
        self._cache: OrderedDict[GrammarSpec, Any] = OrderedDict()
        self._cache_size = cache_size
        self._lock = threading.Lock()
        self.hits = self.misses = 0

    def compile(self, spec: GrammarSpec):
        """The compiled grammar of `spec` (cached). InputError when the engine refuses the schema."""
        with self._lock:
            got = self._cache.get(spec)
            if got is not None:
                self._cache.move_to_end(spec)
                self.hits += 1
                return got
            self.misses += 1
        # Compile outside the lock: a big schema takes a while, and other specs need not wait.
        compiled = self._compile(spec)
        with self._lock:
            self._cache[spec] = compiled
            self._cache.move_to_end(spec)
            while len(self._cache) > self._cache_size:
                self._cache.popitem(last=False)
        return compiled

    def _compile(self, spec: GrammarSpec):
        LLMatcher = self._llg.LLMatcher
        if spec.kind == LARK:
            grammar = LLMatcher.grammar_from_lark(spec.schema)
            return self._matcher_template(grammar, "the tool-call grammar")
        if spec.kind == JSON_OBJECT:
            schema: Any = {"type": "object"}
        elif spec.kind == JSON_SCHEMA:
            schema = json.loads(spec.schema)
        else:
            raise InputError(f"unknown grammar kind {spec.kind!r}")
        try:
            # whitespace_flexible: JSON whitespace anywhere JSON allows it (a model's own formatting);
            # general unicode escapes: "\u00e9" as well as "é" (llguidance otherwise allows \u only for
            # control characters, and a model trained on json.dumps output writes both)
            grammar = LLMatcher.grammar_from_json_schema(
                schema, defaults={"whitespace_flexible": True, "json_allow_general_unicode_escapes": True})
        except ValueError as e:
            raise InputError(f"the JSON schema cannot be used for structured output: {_one_line(e)}") from None
        return self._matcher_template(grammar, "the JSON schema")

    def _matcher_template(self, grammar: str, what: str):
        LLMatcher = self._llg.LLMatcher
        failed, messages = LLMatcher.validate_grammar_with_warnings(grammar, self._lltok)
        if failed:
            raise InputError(f"{what} cannot be used for structured output: {_one_line(messages[0])}")
        # The compiled form is a matcher at the start; each request gets a copy of it.
        template = LLMatcher(self._lltok, grammar, log_level=0)
        if template.is_error():
            raise InputError(f"{what} cannot be used for structured output: {_one_line(template.get_error())}")
        return template

    def matcher(self, spec: GrammarSpec) -> GrammarMatcher:
        return GrammarMatcher(self.compile(spec).deep_copy(), self._lltok, spec, self.mask_size,
                              frozenset(self.stop_token_ids))

    @property
    def cache_len(self) -> int:
        return len(self._cache)


# ---- masks over a batch ---------------------------------------------------------------------------
def bitmask_words(vocab_size: int) -> int:
    return (int(vocab_size) + 31) // 32


def allocate_bitmask(rows: int, vocab_size: int, *, pin: bool | None = None) -> "torch.Tensor":
    """int32 [rows, ceil(V/32)] on the host, all bits set; pinned when CUDA is there (async copies)."""
    import torch

    if pin is None:
        pin = torch.cuda.is_available()
    return torch.full((rows, bitmask_words(vocab_size)), -1, dtype=torch.int32, pin_memory=pin)


_TABLES: dict = {}


def _bit_table(dtype, device):
    """[256, 8] additive table: byte value -> 0 for a set bit, -inf for a clear one (bit j at column j)."""
    import torch

    key = (dtype, str(device))
    t = _TABLES.get(key)
    if t is None:
        bits = (torch.arange(256)[:, None] >> torch.arange(8)) & 1
        t = torch.zeros(256, 8, dtype=dtype).masked_fill_(bits == 0, float("-inf")).to(device)
        _TABLES[key] = t
    return t


def unpack_bitmask(bitmask: "torch.Tensor") -> "torch.Tensor":
    """bool [rows, 32 * words]: bit t%32 of word t//32 (little-endian words)."""
    import torch

    rows = bitmask.shape[0]
    bytes_ = bitmask.contiguous().view(torch.uint8)
    return ((bytes_[:, :, None] >> torch.arange(8, dtype=torch.uint8, device=bitmask.device)) & 1).view(rows, -1).bool()


def apply_bitmask(logits: "torch.Tensor", bitmask: "torch.Tensor", rows: "torch.Tensor | Sequence[int]") -> "torch.Tensor":
    """logits[rows[i]] gets -inf wherever bit t of bitmask[i] is clear; other rows are untouched.

    `logits` [B, V] on any device and in any float dtype; `bitmask` int32 [>= len(rows), W] on the
    host (pinned: the copy is asynchronous) or the device. Columns past 32*W (a model vocabulary
    wider than the mask) are disallowed. In place; returns `logits`. Done as one gather from a
    byte -> 8 additive values table and an add into the rows (one index_add_ on CUDA): faster on a CPU than xgrammar's native
    kernel up to 32 rows (docs/structured-outputs.md), and plain torch ops on CUDA (no JIT kernel).
    """
    import torch

    if not isinstance(rows, torch.Tensor):
        rows = torch.tensor(list(rows), dtype=torch.long)
    k = int(rows.numel())
    if k == 0:
        return logits
    V = logits.shape[-1]
    dev = logits.device
    bm = bitmask[:k].to(dev, non_blocking=True).contiguous().view(torch.uint8)  # [k, 4W]
    add = _bit_table(logits.dtype, dev)[bm.to(torch.int32)].view(k, -1)  # [k, 32W]: 0 or -inf
    n = add.shape[1]
    if n >= V:
        add = add[:, :V]
    else:
        add = torch.nn.functional.pad(add, (0, V - n), value=float("-inf"))
    if dev.type == "cpu":
        # Row by row: index_add_ opens an OpenMP region that costs milliseconds on a busy CPU
        # (measured 3.5 ms against 6 us for one 49k row with 2 threads on a loaded 2-core machine).
        for j, r in enumerate(rows.tolist()):
            logits[r].add_(add[j])
    else:
        from .transfers import to_device

        logits.index_add_(0, to_device(rows.tolist(), torch.long, dev), add)
    return logits


# Below this many constrained rows one thread fills faster than llguidance's pool (measured:
# docs/structured-outputs.md).
PARALLEL_FILL_MIN = 8
_executor = None
_executor_lock = threading.Lock()


def _pool():
    global _executor
    with _executor_lock:
        if _executor is None:
            _executor = _engine().LLExecutor(num_threads=max(1, min(16, os.cpu_count() or 1)))
        return _executor


def fill_bitmasks(matchers: Sequence[GrammarMatcher | None], bitmask: "torch.Tensor") -> list[int]:
    """Fill bitmask rows 0..k-1 for the k constrained requests (those with a matcher), in order;
    returns their positions in `matchers` (the logits rows for `apply_bitmask`). Runs on the host,
    on a thread pool from PARALLEL_FILL_MIN rows: an engine can call it while the device computes
    the step's logits."""
    rows = [i for i, m in enumerate(matchers) if m is not None]
    if len(rows) < PARALLEL_FILL_MIN:
        for j, i in enumerate(rows):
            matchers[i].fill_bitmask(bitmask, j)
        return rows
    live = [matchers[i] for i in rows]
    words = bitmask_words(live[0].vocab_size)
    import torch

    if bitmask.dtype != torch.int32 or bitmask.device.type != "cpu" or not bitmask.is_contiguous() \
            or bitmask.dim() != 2 or bitmask.shape[1] != words or bitmask.shape[0] < len(live) \
            or any(m.vocab_size != live[0].vocab_size for m in live):
        raise ValueError(f"bitmask must be contiguous int32 [>= {len(live)}, {words}] on the host "
                         f"(got {tuple(bitmask.shape)} {bitmask.dtype} on {bitmask.device})")
    _pool().unsafe_compute_mask_ptr([(m._m, j) for j, m in enumerate(live)], bitmask.data_ptr(), words * 4,
                                    bitmask.shape[0])
    return rows


class MaskBuffer:
    """A reusable host bitmask for `apply_masks`, grown as the batch grows. The engine keeps one;
    a buffer is rewritten by the next call, which is safe because before it samples a step the engine
    waits for the previous step's tokens, whose copy follows this buffer's on the stream (also with
    async scheduling, where it waits for them after launching the step's forward)."""

    def __init__(self, vocab_size: int):
        self.vocab_size = int(vocab_size)
        self._buf = None

    def get(self, rows: int) -> "torch.Tensor":
        if self._buf is None or self._buf.shape[0] < rows:
            self._buf = allocate_bitmask(max(rows, 8), self.vocab_size)
        return self._buf


def apply_masks(logits: "torch.Tensor", matchers: Sequence[GrammarMatcher | None],
                buffer: MaskBuffer | None = None) -> "torch.Tensor":
    """Mask row i of `logits` [B, V] with matchers[i]'s allowed tokens; rows whose matcher is None
    (unconstrained requests) are not touched. Without any matcher this returns at once: no
    allocation, no copy, no sync. In place; returns `logits`."""
    live = [m for m in matchers if m is not None]
    if not live:
        return logits
    if len(matchers) != logits.shape[0]:
        raise ValueError(f"{len(matchers)} matchers for {logits.shape[0]} logits rows")
    vocab = live[0].vocab_size
    bitmask = (buffer or MaskBuffer(vocab)).get(len(live))
    rows = fill_bitmasks(matchers, bitmask)
    return apply_bitmask(logits, bitmask, rows)
