"""Engine events -> OpenAI response objects, one choice at a time, streamed or whole.

`ChatChoice` and `CompletionChoice` each follow one engine request (one choice of the response):
`delta(events)` gives the chunk choices a batch of its events allows (streaming), `final()` the
whole choice once it has finished. A chat choice with tools runs its text through
models/tool_calls.ToolCallStreamParser, so its calls stream as OpenAI streams them (a header
delta per call, then the arguments piece by piece) and the whole message says the same. What it
is not: the SSE transport (streaming.py) or the request side (openai_request.py).
"""

from __future__ import annotations

from . import schema as S
from .async_engine import token_appended
from .token_bytes import token_bytes_of


def usage_of(requests) -> S.Usage:
    """OpenAI's usage of a response: each distinct prompt counted once (n samples of one prompt share
    it), completion tokens summed over the choices."""
    prompts = {id(r.prompt): r.prompt_len for r in requests}
    p, c = sum(prompts.values()), sum(len(r.output_ids) for r in requests)
    return S.Usage(prompt_tokens=p, completion_tokens=c, total_tokens=p + c)


class _Choice:
    def __init__(self, index: int, request, engine):
        self.index, self.request, self.engine = index, request, engine
        self.events: list = []

    def record(self, events) -> None:
        """Events of a response that is not streamed (`final` renders them)."""
        self.events.extend(events)

    def _token(self, tid: int) -> str:
        """The token's text: its own bytes as UTF-8 (U+FFFD for part of a character, as OpenAI's). Not
        decode([tid]), which drops a SentencePiece token's leading space: the tokens would not join
        back into the text."""
        return bytes(token_bytes_of(self.engine.tokenizer)(tid)).decode("utf-8", errors="replace")

    def _bytes(self, tid: int) -> list[int]:
        """The token's own bytes (token_bytes.py), which for part of a UTF-8 character are not the
        UTF-8 of its decoded text (U+FFFD)."""
        return list(token_bytes_of(self.engine.tokenizer)(tid))

    def _appended(self, events) -> list:
        return [ev for ev in events if token_appended(ev, self.engine.eos_ids)]


class ChatChoice(_Choice):
    def __init__(self, index: int, request, engine, *, logprobs: bool, tools=None):
        super().__init__(index, request, engine)
        self.logprobs, self.tools = logprobs, tools
        self.parser = None
        if tools is not None:
            from ..models.tool_calls import ToolCallStreamParser

            self.parser = ToolCallStreamParser(tools.fmt, tools.names)

    def _logprob(self, ev) -> S.TokenLogprob:
        # `token` is the token decoded alone (U+FFFD for part of a character, as OpenAI's); `bytes` is
        # exact, so that a client can join consecutive tokens' bytes into the characters they split.
        # top_logprobs is the top k only: the sampled token is this entry's own token/logprob.
        tops = [S.TopLogprob(token=self._token(i), logprob=lp, bytes=self._bytes(i))
                for i, lp in (ev.top_logprobs or [])]
        return S.TokenLogprob(token=self._token(ev.token_id), logprob=ev.logprob, bytes=self._bytes(ev.token_id),
                              top_logprobs=tops)

    def _finish_reason(self, has_calls: bool) -> str | None:
        reason = self.request.finish_reason
        return "tool_calls" if has_calls and reason == "stop" else reason

    def _keep(self, delta: dict) -> dict | None:
        """parallel_tool_calls false: only the first call is sent (auto calls cannot be forced)."""
        if self.tools is None or self.tools.parallel or "tool_calls" not in delta:
            return delta
        calls = [tc for tc in delta["tool_calls"] if tc["index"] == 0]
        return {"tool_calls": calls} if calls else None

    def first(self) -> S.ChatChunkChoice:
        # with tools the message may turn out to be calls only, whose content is null, as OpenAI's
        return S.ChatChunkChoice(index=self.index, delta=S.DeltaMessage(role="assistant",
                                                                        content="" if self.tools is None else None))

    def delta(self, events) -> list[S.ChatChunkChoice]:
        self.events.extend(events)
        last = events[-1]
        text = "".join(ev.text_delta for ev in events)
        if self.parser is None:
            deltas = [{"content": text}] if text else []
        else:
            deltas = self.parser.feed(text) + (self.parser.finish() if last.finished else [])
            deltas = [d for d in map(self._keep, deltas) if d]
        lps = None
        if self.logprobs:
            entries = [self._logprob(ev) for ev in self._appended(events)]
            lps = S.ChoiceLogprobs(content=entries) if entries else None
        out = [S.ChatChunkChoice(index=self.index, delta=S.DeltaMessage(**d)) for d in deltas]
        if lps is not None or (last.finished and not out):
            out = out or [S.ChatChunkChoice(index=self.index, delta=S.DeltaMessage())]
        if out and lps is not None:
            out[0].logprobs = lps
        if last.finished:
            out[-1].finish_reason = self._finish_reason(self.parser is not None and self.parser.has_calls)
        return out

    def final(self) -> S.ChatChoice:
        from ..models.tool_calls import parse_tool_calls

        req = self.request
        content, calls = req.text, []
        if self.tools is not None:
            content, calls = parse_tool_calls(req.text, self.tools.fmt, self.tools.names)
            if not self.tools.parallel:
                calls = calls[:1]
        logprobs = None
        if self.logprobs:
            logprobs = S.ChoiceLogprobs(content=[self._logprob(ev) for ev in self._appended(self.events)])
        msg = S.AssistantMessage(content=content, tool_calls=[S.ToolCallOut(**c.to_openai()) for c in calls] or None)
        return S.ChatChoice(index=self.index, message=msg, logprobs=logprobs,
                            finish_reason=self._finish_reason(bool(calls)))


class CompletionChoice(_Choice):
    def __init__(self, index: int, request, engine, *, logprobs: int | None):
        super().__init__(index, request, engine)
        self.logprobs = logprobs
        self._offset = 0  # characters of the text before the next event's

    def _add(self, lp: S.CompletionLogprobs, events) -> None:
        for ev in events:
            if token_appended(ev, self.engine.eos_ids):
                tok = self._token(ev.token_id)
                lp.tokens.append(tok)
                lp.token_logprobs.append(ev.logprob)
                lp.text_offset.append(self._offset)
                if self.logprobs is not None:  # 0 too: the sampled token alone
                    # OpenAI's completions always report the sampled token here too: up to k + 1
                    # entries. Two ids that decode alike share a key: the likelier (first) one keeps it.
                    tops = list(ev.top_logprobs or [])
                    if all(i != ev.token_id for i, _ in tops):
                        tops.append((ev.token_id, ev.logprob))
                    top: dict[str, float] = {}
                    for i, v in tops:
                        top.setdefault(self._token(i), v)
                    lp.top_logprobs = lp.top_logprobs or []
                    lp.top_logprobs.append(top)
            self._offset += len(ev.text_delta)

    def delta(self, events) -> list[S.CompletionChoice]:
        self.events.extend(events)
        last = events[-1]
        lp = None
        if self.logprobs is not None:
            lp = S.CompletionLogprobs()
            self._add(lp, events)
            lp = lp if lp.tokens else None
        text = "".join(ev.text_delta for ev in events)
        if not text and lp is None and not last.finished:
            return []  # held-back tokens (half a UTF-8 character, a stop-string prefix)
        return [S.CompletionChoice(index=self.index, text=text, logprobs=lp,
                                   finish_reason=self.request.finish_reason if last.finished else None)]

    def final(self) -> S.CompletionChoice:
        lp = None
        if self.logprobs is not None:
            lp, self._offset = S.CompletionLogprobs(), 0
            self._add(lp, self.events)
        return S.CompletionChoice(index=self.index, text=self.request.text, logprobs=lp,
                                  finish_reason=self.request.finish_reason)
