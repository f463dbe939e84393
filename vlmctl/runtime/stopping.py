"""Per-request output text: incremental detokenization and stop strings.

`TextStream.append(token_id)` turns one more generated token into the text that can be handed to
the client now, and says whether a stop string ended the request. Work per token is bounded by the
token's own text, never by the text generated so far:

- detokenization decodes a small window of recent tokens (the last emitted piece as context, so
  tokenizers that drop a leading space at the start of a decode keep it) instead of the whole
  output; a window whose text ends in U+FFFD (half a UTF-8 character) waits for the next token;
- stop strings are matched by one Aho-Corasick automaton over all of a request's stop strings, fed
  only the new characters (amortized constant work per character, however many stop strings);
  its state is also the longest stop-string prefix at the end of the text, which is held back
  until it either completes (and is cut) or cannot any more.

The engine caps how many stop strings a request may give (`max_stop_sequences`). This module does
not know about EOS or stop token ids (the engine decides those before a token reaches the text),
nor about max_tokens.
"""

from __future__ import annotations

REPLACEMENT = "\ufffd"


def fast_decoder(tokenizer):
    """`decode(ids, skip_special_tokens)` straight through the Rust `tokenizers` object where that is
    what transformers' `decode` ends in (a TokenizersBackend that overrides neither `decode` nor
    `_decode` and does no clean-up of spaces), else transformers' own. Per token the engine decodes
    twice; transformers' wrapper costs ~9x the Rust decode itself (its argument normalisation walks
    the ids in Python), measured on an H200 host under cProfile at batch 64."""
    try:
        from transformers.tokenization_utils_base import PreTrainedTokenizerBase
        from transformers.tokenization_utils_tokenizers import TokenizersBackend
    except ImportError:
        TokenizersBackend = None
    cls = type(tokenizer)
    if (TokenizersBackend is not None and isinstance(tokenizer, TokenizersBackend)
            and cls._decode is TokenizersBackend._decode and cls.decode is PreTrainedTokenizerBase.decode
            and not getattr(tokenizer, "clean_up_tokenization_spaces", False)):
        backend = tokenizer.backend_tokenizer
        return lambda ids, skip: backend.decode(ids, skip_special_tokens=skip)
    return lambda ids, skip: tokenizer.decode(ids, skip_special_tokens=skip)


class _StopAutomaton:
    """Aho-Corasick matcher of several stop strings over a character stream."""

    __slots__ = ("goto", "fail", "depth", "longest", "state")

    def __init__(self, stops: list[str]):
        goto: list[dict[str, int]] = [{}]
        depth, terminal = [0], [0]
        for s in stops:
            node = 0
            for c in s:
                nxt = goto[node].get(c)
                if nxt is None:
                    nxt = len(goto)
                    goto[node][c] = nxt
                    goto.append({})
                    depth.append(depth[node] + 1)
                    terminal.append(0)
                node = nxt
            terminal[node] = len(s)
        fail = [0] * len(goto)
        # longest[n]: the longest stop string ending at node n (itself or along its fail chain), 0 if none
        longest = list(terminal)
        queue = list(goto[0].values())
        for node in queue:  # breadth first: a node's fail target is shallower, hence done
            for c, child in goto[node].items():
                f = fail[node]
                while f and c not in goto[f]:
                    f = fail[f]
                fail[child] = goto[f].get(c, 0) if goto[f].get(c, 0) != child else 0
                longest[child] = terminal[child] or longest[fail[child]]
                queue.append(child)
        self.goto, self.fail, self.depth, self.longest, self.state = goto, fail, depth, longest, 0

    def step(self, c: str) -> int:
        """Feed one character; the length of the longest stop string that ends here (0: none)."""
        goto, fail, node = self.goto, self.fail, self.state
        while node and c not in goto[node]:
            node = fail[node]
        node = goto[node].get(c, 0)
        self.state = node
        return self.longest[node]

    @property
    def pending(self) -> int:
        """Characters at the end of the text that could still start a stop string."""
        return self.depth[self.state]


class TextStream:
    """One request's generated text. `append` per token; `flush` once when the request ends otherwise."""

    def __init__(self, tokenizer, stop: list[str] | tuple[str, ...] = (), skip_special_tokens: bool = True):
        self._decode_ids = fast_decoder(tokenizer)
        self._skip = skip_special_tokens
        self._ids: list[int] = []
        self._prefix = 0  # first token of the decode window (context for the next piece)
        self._read = 0  # tokens before this one have their text in `text`
        stops = [s for s in stop if s]
        self._stops = _StopAutomaton(stops) if stops else None
        self._emitted = 0  # characters of `text` handed out
        self.text = ""  # the output text (cut before the stop string once one matched)
        self.stopped = False

    # ---- detokenization ----------------------------------------------------------------------
    def _decode(self, ids: list[int]) -> str:
        return self._decode_ids(ids, self._skip) if ids else ""

    def _next_piece(self, final: bool) -> str:
        """Text of the tokens not yet read, decoded with the previous piece as context."""
        before = self._decode(self._ids[self._prefix:self._read])
        after = self._decode(self._ids[self._prefix:])
        if len(after) <= len(before) or (after.endswith(REPLACEMENT) and not final):
            return ""  # nothing new yet (a skipped special token, or half a UTF-8 character)
        self._prefix, self._read = self._read, len(self._ids)
        return after[len(before):]

    # ---- stop strings ------------------------------------------------------------------------
    def _add(self, piece: str) -> str | None:
        """Append `piece` to the text; 'stop' when a stop string completed (the text is cut before it)."""
        start = len(self.text)
        self.text += piece
        if self._stops is None:
            return None
        step = self._stops.step
        for i, c in enumerate(piece):
            n = step(c)
            if n:  # the earliest stop string to complete; of those ending here, the longest
                self.text = self.text[:start + i + 1 - n]
                self.stopped = True
                return "stop"
        return None

    def _take(self, upto: int) -> str:
        delta = self.text[self._emitted:upto] if upto > self._emitted else ""
        self._emitted = max(self._emitted, upto)
        return delta

    # ---- API ---------------------------------------------------------------------------------
    def append(self, token_id: int) -> tuple[str, str | None]:
        """(text that can be handed out now, 'stop' when a stop string ended the request, else None)."""
        if self.stopped:
            return "", "stop"
        self._ids.append(int(token_id))
        piece = self._next_piece(final=False)
        if not piece:
            return "", None
        if self._add(piece) == "stop":
            return self._take(len(self.text)), "stop"
        held = self._stops.pending if self._stops is not None else 0  # a stop string may be starting here
        return self._take(len(self.text) - held), None

    def flush(self) -> str:
        """The request ended for another reason (EOS, length, abort): the text still held back."""
        if not self.stopped and self._read < len(self._ids):
            self._add(self._next_piece(final=True))
        return self._take(len(self.text))
