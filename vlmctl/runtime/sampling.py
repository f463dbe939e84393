"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, per-request seeds).

`SamplingParams` also carries a request's logits extras (penalties, logit_bias, min_p: applied by
runtime/logits_processing.py) and its structured-output grammar (a runtime/grammar.GrammarSpec);
the engine applies those to the rows that use them before `sample` draws.

Every value the schema lets through must sample, because one request's parameters share a step
with other requests: temperatures below `GREEDY_BELOW` act as greedy (dividing logits by 1e-39
overflows float32), a top-k at or above the vocabulary size means no filter (and is clamped before it
becomes a tensor: 2**63 does not fit in int64), top-p always keeps the most likely token (a top-p that
rounds to 0 in float32 would otherwise remove every token), and non-finite values are refused.
The sampler itself also survives logits with NaN (treated as impossible tokens).
"""

from __future__ import annotations

import math
import numbers
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Any

import torch

if TYPE_CHECKING:
    from .grammar import GrammarSpec
    from .logits_processing import LogitsParams

from ..errors import InputError
from .transfers import to_device

# Below this a temperature cannot be told from greedy in float32 (logits / 1e-5 is still finite for
# any logit the models produce; 1e-39 is not), so it is greedy.
GREEDY_BELOW = 1e-5


@dataclass
class SamplingParams:
    max_tokens: int = 256
    temperature: float = 1.0  # 0 means greedy
    top_p: float = 1.0
    top_k: int = 0  # 0: no top-k filter
    seed: int | None = None
    stop: list[str] = field(default_factory=list)
    stop_token_ids: list[int] = field(default_factory=list)
    ignore_eos: bool = False
    logprobs: int | None = None  # None: none; 0: the chosen token's; k: plus the top k
    # logits extras (runtime/logits_processing.py; the defaults switch them off)
    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)
    grammar: "GrammarSpec | None" = None  # structured output: the output must match it

    def logits_params(self) -> "LogitsParams":
        from .logits_processing import LogitsParams

        return LogitsParams(presence_penalty=self.presence_penalty, frequency_penalty=self.frequency_penalty,
                            repetition_penalty=self.repetition_penalty, min_p=self.min_p,
                            logit_bias=dict(self.logit_bias))

    @property
    def extras(self) -> list[str]:
        """The names of the extras this request uses (beyond temperature / top-k / top-p)."""
        out = [n for n, off in (("presence_penalty", 0.0), ("frequency_penalty", 0.0), ("repetition_penalty", 1.0),
                                ("min_p", 0.0)) if getattr(self, n) != off]
        if self.logit_bias:
            out.append("logit_bias")
        return out

    def replace(self, **changes: Any) -> "SamplingParams":
        """A copy with `changes` (n > 1 samples: the same parameters, each its own seed)."""
        import dataclasses

        stop = [self.stop] if isinstance(self.stop, str) else list(self.stop)  # one string is one stop string
        return dataclasses.replace(self, stop=stop, stop_token_ids=list(self.stop_token_ids),
                                   logit_bias=dict(self.logit_bias), **changes)

    def validate(self) -> "SamplingParams":
        if isinstance(self.stop, str):  # OpenAI's `stop: "\n\n"` is one stop string, not one per character
            self.stop = [self.stop]
        self._check_types()
        if self.max_tokens < 1:
            raise InputError(f"max_tokens must be at least 1 (got {self.max_tokens})")
        for name in ("temperature", "top_p"):
            if not math.isfinite(getattr(self, name)):
                raise InputError(f"{name} must be a finite number (got {getattr(self, name)})")
        if not 0 <= self.temperature <= 100:
            raise InputError(f"temperature must be between 0 and 100 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (got {self.top_k})")
        if any(not isinstance(t, int) or t < 0 for t in self.stop_token_ids):
            raise InputError("stop_token_ids must be non-negative integers")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InputError(f"top_logprobs must be between 0 and 20 (got {self.logprobs})")
        self.logits_params().validate()
        for tid, bias in self.logit_bias.items():
            if isinstance(tid, bool) or not isinstance(tid, int) or tid < 0:
                raise InputError(f"logit_bias: {tid!r} is not a token id", param="logit_bias")
            if isinstance(bias, bool) or not isinstance(bias, (int, float)) or not -100 <= bias <= 100:
                raise InputError(f"logit_bias: the bias of token {tid} must be a number between -100 and 100 "
                                 f"(got {bias!r})", param="logit_bias")
        if self.seed is not None and not SEED_MIN <= self.seed <= SEED_MAX:
            # a larger one would wrap onto another seed (2**64 draws what 0 draws)
            raise InputError(f"seed must be a 64-bit integer, {SEED_MIN}..{SEED_MAX} (got {self.seed})", param="seed")
        if self.grammar is not None and self.ignore_eos:
            # a document ends with EOS; past it the grammar allows nothing
            raise InputError("ignore_eos cannot be combined with structured output (response_format or a forced "
                             "tool call): the grammar ends the output with EOS", param="ignore_eos")
        return self

    def _check_types(self) -> None:
        """Each field's type, so a wrong one is an InputError naming the field, never a TypeError from a
        comparison or a failure inside a later step's sampling (top_k 1.5 would reach a tensor index)."""
        def is_int(v):
            return isinstance(v, numbers.Integral) and not isinstance(v, bool)

        for name in ("max_tokens", "top_k"):
            if not is_int(getattr(self, name)):
                raise InputError(f"{name} must be an integer (got {getattr(self, name)!r})", param=name)
        for name in ("seed", "logprobs"):
            v = getattr(self, name)
            if v is not None and not is_int(v):
                raise InputError(f"{name} must be an integer or None (got {v!r})", param=name)
        for name in ("temperature", "top_p", "presence_penalty", "frequency_penalty", "repetition_penalty", "min_p"):
            v = getattr(self, name)
            if isinstance(v, bool) or not isinstance(v, numbers.Real):
                raise InputError(f"{name} must be a number (got {v!r})", param=name)
        if not isinstance(self.stop, (list, tuple)) or not all(isinstance(s, str) for s in self.stop):
            raise InputError(f"stop must be a string or a list of strings (got {self.stop!r})", param="stop")
        if not isinstance(self.stop_token_ids, (list, tuple)):
            raise InputError(f"stop_token_ids must be a list of token ids (got {self.stop_token_ids!r})",
                             param="stop_token_ids")
        if any(isinstance(t, bool) for t in self.stop_token_ids):
            raise InputError("stop_token_ids must be non-negative integers", param="stop_token_ids")
        if not isinstance(self.logit_bias, dict):
            raise InputError(f"logit_bias must be a dict of token id -> bias (got {self.logit_bias!r})",
                             param="logit_bias")


SEED_MIN, SEED_MAX = -(2 ** 63), 2 ** 63 - 1  # a 64-bit seed, as the server's schema takes it


def make_generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    s = int(seed) & 0xFFFF_FFFF_FFFF_FFFF
    if g.device.type == "cpu":
        # torch's CPU generator (mt19937) keeps only the low 32 bits of its seed: fold the high ones in, so
        # seeds that differ only there (0, 2**32, -2**63) draw differently; a seed below 2**32 is unchanged
        s = (s ^ ((s >> 32) * 0x9E37_79B1)) & 0xFFFF_FFFF
    g.manual_seed(s)
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None],
           logprob_logits: torch.Tensor | None = None):
    """logits [b, V] (float32) -> (token ids [b], chosen logprobs [b] or None, top logprobs or None).

    Filtering is vectorized over the batch; only the draw itself is per row (each request may
    carry its own seeded generator). Log-probabilities are those of `logprob_logits` when given
    (the engine passes the model's logits from before penalties, bias, grammar mask and min_p),
    else of `logits`; never of the temperature-scaled or filtered distribution."""
    b, V = logits.shape
    device = logits.device
    logits = logits.float().nan_to_num(nan=float("-inf"))  # a NaN logit is an impossible token, not a crash
    # Python-side clamps first: values such as temperature 1e-39 or top_k 2**63 never reach a tensor.
    # Every decision is taken from the parameters on the host, never from a tensor: sampling must not wait
    # for the GPU, so the engine can launch the next step while this one's tokens are copied back.
    greedy_rows = [not (p.temperature >= GREEDY_BELOW) for p in params]
    tokens = logits.argmax(-1)
    draw = [i for i, g in enumerate(greedy_rows) if not g]
    if draw:
        temps = to_device([1.0 if g else float(p.temperature) for p, g in zip(params, greedy_rows)],
                           torch.float32, device)
        scaled = logits / temps[:, None]
        if any(0 < p.top_k < V for p in params):
            top_k = to_device([min(p.top_k, V) if p.top_k > 0 else V for p in params], torch.long, device)
            kth = scaled.sort(-1, descending=True).values.gather(1, (top_k - 1)[:, None])
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        cut = [min(max(float(p.top_p), 0.0), 1.0) for p in params]
        if any(c < 1 for c in cut):
            top_p = to_device(cut, torch.float32, device)
            sorted_logits, idx = scaled.sort(-1, descending=True)
            probs = sorted_logits.softmax(-1)
            # keep the smallest prefix whose mass reaches top_p; the first token always stays (a top_p
            # that rounds to 0 in float32 would otherwise remove them all)
            remove = probs.cumsum(-1) - probs >= top_p[:, None]
            remove[:, 0] = False
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter(1, idx, sorted_logits)
        probs = scaled.softmax(-1)
        # A row whose logits are all -inf (or overflowed) has no distribution: it keeps its argmax (it
        # draws from a one-hot stand-in, so that no tensor has to be read to skip it)
        bad = ~torch.isfinite(probs).all(-1) | (probs.sum(-1) <= 0)
        probs = torch.where(bad[:, None], torch.zeros_like(probs).scatter_(1, tokens[:, None], 1.0), probs)
        drawn = tokens.clone()
        shared = [i for i in draw if generators[i] is None]
        if shared:  # rows without a seed draw in one call
            rows = to_device(shared, torch.long, device)
            drawn[rows] = torch.multinomial(probs[rows], 1)[:, 0]
        for i in draw:
            if generators[i] is not None:
                drawn[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
        tokens = torch.where(bad, tokens, drawn)
    want = [p.logprobs for p in params]
    if all(w is None for w in want):
        return tokens, None, None
    src = logits if logprob_logits is None else logprob_logits.float().nan_to_num(nan=float("-inf"))
    logp = src.log_softmax(-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    k = max((w or 0) for w in want)
    top = logp.topk(k, -1) if k > 0 else None
    return tokens, chosen, top


class TokensInFlight:
    """A step's sampled tokens (and log-probabilities) on their way to the host, while the device moves on.

    The copies go into pinned memory behind the sampling on the same stream, and an event marks their end,
    so `read` waits for this step's sampling only, not for work queued after it (the next step's forward,
    which reads `tokens` on the device as its input ids)."""

    def __init__(self, tokens: torch.Tensor, chosen: torch.Tensor | None, top):
        self.tokens = tokens
        parts = [tokens, chosen] + ([top.values, top.indices] if top is not None else [])
        self._on_device = [p for p in parts if p is not None]
        self._layout = (chosen is not None, top is not None)
        self._ready = None
        if tokens.is_cuda:
            self._host = [torch.empty(p.shape, dtype=p.dtype, pin_memory=True) for p in self._on_device]
            for h, p in zip(self._host, self._on_device):
                h.copy_(p, non_blocking=True)
            self._ready = torch.cuda.Event()
            self._ready.record()
        else:
            self._host = self._on_device

    def read(self) -> tuple[list[int], list[float] | None, tuple[list, list] | None]:
        """(token ids, chosen log-probabilities or None, (top values, top indices) or None) as lists."""
        if self._ready is not None:
            self._ready.synchronize()
        host = iter(self._host)
        toks = next(host).tolist()
        has_chosen, has_top = self._layout
        chosen = next(host).tolist() if has_chosen else None
        top = (next(host).tolist(), next(host).tolist()) if has_top else None
        return toks, chosen, top
