"""The exact bytes of a vocabulary token, for the `bytes` of OpenAI's chat logprobs.

OpenAI's `bytes` lets a client join the bytes of consecutive tokens to rebuild a character that is
split across them, so it must be the token's own bytes, not the UTF-8 of the token decoded alone
(a token holding part of a character decodes to U+FFFD). Where the bytes come from depends on the
tokenizer family, told from the tokenizer's decoder:

- byte-level BPE (GPT-2, SmolLM2, Qwen2, Llama 3): every character of a vocabulary token stands
  for one byte through GPT-2's `bytes_to_unicode` alphabet ('Ġ' is a space, 'Ã' 0xC3);
- SentencePiece style (Llama 2, Mistral, Gemma; a Metaspace or Replace('▁', ' ') decoder): '▁' is
  a space, and with byte fallback a token '<0xE2>' is the one byte 0xE2;
- added and special tokens are their text; any other token is the UTF-8 of its decode.

The tokenizer is inspected once and each id's bytes are computed on first use and kept (one table
per tokenizer object). What it is not: detokenization of outputs (runtime/stopping.py).
"""

from __future__ import annotations

import json
import re
import weakref

_BYTE_TOKEN = re.compile(r"<0x([0-9A-Fa-f]{2})>")


def _bytes_to_unicode() -> dict[int, str]:
    """GPT-2's byte -> character map: printable Latin-1 bytes are themselves, the rest are shifted
    to U+0100 onwards."""
    bs = [*range(ord("!"), ord("~") + 1), *range(ord("¡"), ord("¬") + 1), *range(ord("®"), ord("ÿ") + 1)]
    cs = bs[:]
    n = 0
    for b in range(256):
        if b not in bs:
            bs.append(b)
            cs.append(256 + n)
            n += 1
    return {b: chr(c) for b, c in zip(bs, cs)}


_UNICODE_TO_BYTE = {c: b for b, c in _bytes_to_unicode().items()}


def _decoder_specs(tokenizer) -> list[dict]:
    """The decoder of a `tokenizers`-backed tokenizer as a flat list of its parts' JSON specs."""
    dec = getattr(getattr(tokenizer, "backend_tokenizer", None), "decoder", None)
    if dec is None:
        return []
    try:
        spec = json.loads(dec.__getstate__())
    except Exception:  # a decoder that does not serialize: treated as unknown
        return []
    out, todo = [], [spec]
    while todo:
        d = todo.pop()
        if isinstance(d, dict):
            out.append(d)
            todo.extend(d.get("decoders") or [])
    return out


class TokenBytes:
    """id -> the token's bytes, for one tokenizer."""

    def __init__(self, tokenizer):
        self.tokenizer = tokenizer
        specs = _decoder_specs(tokenizer)
        types = {d.get("type") for d in specs}
        model = getattr(getattr(tokenizer, "backend_tokenizer", None), "model", None)
        sp_model = getattr(tokenizer, "sp_model", None)  # a slow SentencePiece tokenizer
        self.byte_level = "ByteLevel" in types or hasattr(tokenizer, "byte_decoder")
        self.space = None  # the character that stands for a space (SentencePiece's '▁')
        for d in specs:
            if d.get("type") == "Metaspace":
                self.space = d.get("replacement", "\u2581")
            elif d.get("type") == "Replace" and d.get("content") == " " and \
                    (d.get("pattern") or {}).get("String") == "\u2581":
                self.space = "\u2581"
        if sp_model is not None and self.space is None and not self.byte_level:
            self.space = "\u2581"
        self.byte_fallback = ("ByteFallback" in types or bool(getattr(model, "byte_fallback", False))
                              or sp_model is not None)
        try:
            added = tokenizer.added_tokens_decoder
        except Exception:  # a tokenizer without added-token bookkeeping: none
            added = {}
        self.added = {int(i): str(getattr(t, "content", t)) for i, t in added.items()}
        self._cache: dict[int, bytes] = {}

    def __call__(self, tid: int) -> bytes:
        got = self._cache.get(tid)
        if got is None:
            got = self._cache[tid] = self._compute(tid)
        return got

    def _decoded(self, tid: int) -> bytes:
        return self.tokenizer.decode([tid]).encode("utf-8")

    def _compute(self, tid: int) -> bytes:
        try:
            piece = self.tokenizer.convert_ids_to_tokens(tid)
        except Exception:  # an id the tokenizer cannot name (past its vocabulary): decoded instead
            piece = None
        if not isinstance(piece, str):
            return self._decoded(tid)
        if self.byte_fallback and (m := _BYTE_TOKEN.fullmatch(piece)):
            return bytes([int(m.group(1), 16)])
        if tid in self.added:
            return self.added[tid].encode("utf-8")
        if self.byte_level:
            try:
                return bytes(_UNICODE_TO_BYTE[c] for c in piece)
            except KeyError:  # not in the byte alphabet: a token the byte-level model does not own
                return self._decoded(tid)
        if self.space is not None:
            return piece.replace(self.space, " ").encode("utf-8")
        return self._decoded(tid)


_tables: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def token_bytes_of(tokenizer) -> TokenBytes:
    """The (cached) TokenBytes of `tokenizer`."""
    try:
        table = _tables.get(tokenizer)
        if table is None:
            table = _tables[tokenizer] = TokenBytes(tokenizer)
        return table
    except TypeError:  # not weakly referenceable or not hashable: no cache across calls
        return TokenBytes(tokenizer)
