"""Sampling extras applied to a batch of logits: logit_bias, repetition / presence / frequency
penalties and min_p, with per-request token counts kept on the logits' device.

What it is: `LogitsParams` (one request's settings, validated with the OpenAI/vLLM field names)
and `LogitsProcessor` (the engine keeps one: requests that use a penalty or a bias are registered
with their prompt, the processor updates their counts from each step's sampled tokens and adjusts
their rows of the next step's logits; requests that use none of it are never registered and cost
nothing), plus `apply_min_p`, which needs the request's temperature. Everything is batched tensor
work on the logits' device: no host sync, no per-row Python loop over the vocabulary.

Semantics (each tested against its reference in tests/test_logits_processing.py):
  logit_bias          OpenAI: bias[token] is added to the logits, -100..100.
  repetition_penalty  transformers' RepetitionPenaltyLogitsProcessor (vLLM's too): every token seen in
                      the prompt or the output so far has its logit divided by the penalty when it
                      is >= 0 and multiplied by it when < 0; 1 is off.
  presence_penalty    OpenAI: logit -= presence_penalty if the token occurs in the output so far.
  frequency_penalty   OpenAI: logit -= frequency_penalty * (times the token occurs in the output).
  min_p               transformers' MinPLogitsWarper after the temperature: tokens whose probability
                      is below min_p times the top token's are removed; 0 is off.
Order, as vLLM and transformers apply them: logit_bias, repetition, presence/frequency (all before
the temperature), then min_p (after it), then the sampler's top-k/top-p.

What it is not: the sampler (runtime/sampling.py: temperature, top-k, top-p, the draw) or the
structured-output mask (runtime/grammar.py).
"""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from typing import TYPE_CHECKING, Hashable, Sequence

from ..errors import InputError
from .transfers import to_device

if TYPE_CHECKING:
    import torch

BIAS_LIMIT = 100.0
PENALTY_LIMIT = 2.0


def _finite(name: str, v) -> float:
    if isinstance(v, bool) or not isinstance(v, (int, float)) or not math.isfinite(v):
        raise InputError(f"{name} must be a finite number (got {v!r})", param=name)
    return float(v)


@dataclass(frozen=True)
class LogitsParams:
    """One request's extras. The defaults switch everything off."""

    presence_penalty: float = 0.0
    frequency_penalty: float = 0.0
    repetition_penalty: float = 1.0
    min_p: float = 0.0
    logit_bias: dict[int, float] = field(default_factory=dict)

    @classmethod
    def from_request(cls, *, presence_penalty=None, frequency_penalty=None, repetition_penalty=None, min_p=None,
                     logit_bias=None, vocab_size: int) -> "LogitsParams":
        """From OpenAI request fields (None: not sent; logit_bias keys are token ids as strings, as
        JSON objects have them), validated: InputError naming the field otherwise."""
        bias: dict[int, float] = {}
        if logit_bias is not None:
            if not isinstance(logit_bias, dict):
                raise InputError("logit_bias must be an object mapping token ids to biases", param="logit_bias")
            for k, v in logit_bias.items():
                try:
                    tid = int(k)
                except (TypeError, ValueError):
                    raise InputError(f"logit_bias: {k!r} is not a token id", param="logit_bias") from None
                if isinstance(k, float) or str(tid) != str(k).strip():
                    raise InputError(f"logit_bias: {k!r} is not a token id", param="logit_bias")
                if not 0 <= tid < vocab_size:
                    raise InputError(f"logit_bias: token id {tid} is outside this model's vocabulary "
                                     f"(0..{vocab_size - 1})", param="logit_bias")
                b = _finite("logit_bias", v)
                if not -BIAS_LIMIT <= b <= BIAS_LIMIT:
                    raise InputError(f"logit_bias: the bias of token {tid} must be between -100 and 100 (got {v})",
                                     param="logit_bias")
                if b != 0.0:
                    bias[tid] = b
        return cls(presence_penalty=0.0 if presence_penalty is None else presence_penalty,
                   frequency_penalty=0.0 if frequency_penalty is None else frequency_penalty,
                   repetition_penalty=1.0 if repetition_penalty is None else repetition_penalty,
                   min_p=0.0 if min_p is None else min_p, logit_bias=bias).validate()

    def validate(self) -> "LogitsParams":
        for name in ("presence_penalty", "frequency_penalty"):
            v = _finite(name, getattr(self, name))
            if not -PENALTY_LIMIT <= v <= PENALTY_LIMIT:
                raise InputError(f"{name} must be between -2 and 2 (got {v:g})", param=name)
        rp = _finite("repetition_penalty", self.repetition_penalty)
        if rp <= 0:
            raise InputError(f"repetition_penalty must be greater than 0 (got {rp:g}); 1 means no penalty",
                             param="repetition_penalty")
        mp = _finite("min_p", self.min_p)
        if not 0 <= mp <= 1:
            raise InputError(f"min_p must be between 0 and 1 (got {mp:g})", param="min_p")
        return self

    @property
    def uses_counts(self) -> bool:
        """Whether the request needs per-token state (penalties) or a bias: LogitsProcessor's business."""
        return bool(self.presence_penalty or self.frequency_penalty or self.repetition_penalty != 1.0
                    or self.logit_bias)


class _Entry:
    __slots__ = ("row", "params", "bias_ids", "bias_vals")

    def __init__(self, row, params, bias_ids, bias_vals):
        self.row, self.params, self.bias_ids, self.bias_vals = row, params, bias_ids, bias_vals


class LogitsProcessor:
    """Per-request penalty state for a running batch, on one device.

    State lives in two pooled tensors, one row per registered request: `counts` int32 [rows, V]
    (how often each token occurs in the output) and `seen` bool [rows, V] (prompt or output, for
    repetition_penalty). Rows are reused as requests finish; the pool doubles when full.

        proc.add(req_id, params, prompt_ids)      # at admission (no-op when params use nothing here)
        proc.apply(logits, [req_id, ...])         # each step, before temperature; rows in batch order
        proc.update([req_id, ...], tokens)        # after sampling (tokens may stay on the device)
        proc.remove(req_id)                       # when the request ends

    Keys are any hashable (the engine's request id); a key that was not added is left alone, so
    the engine can pass its whole batch. Not thread-safe: the engine thread owns it.
    """

    def __init__(self, vocab_size: int, device="cpu", initial_rows: int = 8):
        import torch

        self.vocab_size = int(vocab_size)
        self.device = torch.device(device)
        self._counts = torch.zeros(initial_rows, self.vocab_size, dtype=torch.int32, device=self.device)
        self._seen = torch.zeros(initial_rows, self.vocab_size, dtype=torch.bool, device=self.device)
        self._free = list(range(initial_rows - 1, -1, -1))
        self._entries: dict[Hashable, _Entry] = {}

    def __len__(self) -> int:
        return len(self._entries)

    def __contains__(self, key) -> bool:
        return key in self._entries

    def _grow(self) -> None:
        import torch

        old = self._counts.shape[0]
        pad = (0, 0, 0, old)
        self._counts = torch.nn.functional.pad(self._counts, pad)
        self._seen = torch.nn.functional.pad(self._seen, pad)
        self._free.extend(range(2 * old - 1, old - 1, -1))

    def add(self, key: Hashable, params: LogitsParams, prompt_ids: Sequence[int] | "torch.Tensor" = ()) -> bool:
        """Register a request; returns whether it uses anything here (if not, nothing is kept).

        `prompt_ids`: the prompt as the tokenizer made it (image placeholders as their placeholder
        id, as transformers sees them); ids >= vocab_size (vlmctl's prompt-table ids) are ignored."""
        import torch

        if key in self._entries:
            raise ValueError(f"request {key!r} is already registered")
        if not params.uses_counts:
            return False
        if not self._free:
            self._grow()
        row = self._free.pop()
        self._counts[row].zero_()
        self._seen[row].zero_()
        if params.repetition_penalty != 1.0:
            ids = torch.as_tensor(prompt_ids, dtype=torch.long).to(self.device).flatten()
            ids = ids[(ids >= 0) & (ids < self.vocab_size)]
            self._seen[row, ids] = True
        bias_ids = bias_vals = None
        if params.logit_bias:
            bias_ids = torch.tensor(list(params.logit_bias), dtype=torch.long, device=self.device)
            bias_vals = torch.tensor(list(params.logit_bias.values()), dtype=torch.float32, device=self.device)
        self._entries[key] = _Entry(row, params, bias_ids, bias_vals)
        return True

    def remove(self, key: Hashable) -> None:
        e = self._entries.pop(key, None)
        if e is not None:
            self._free.append(e.row)

    def update(self, keys: Sequence[Hashable], tokens: "torch.Tensor | Sequence[int]") -> None:
        """Count the step's sampled tokens: tokens[i] was sampled for keys[i]. Stop tokens count as
        well (harmless: the request ends with them). Ids outside the vocabulary are ignored."""
        import torch

        pos = [(i, e.row) for i, k in enumerate(keys) if (e := self._entries.get(k)) is not None]
        if not pos:
            return
        tokens = torch.as_tensor(tokens).to(self.device, non_blocking=True)
        idx = to_device([i for i, _ in pos], torch.long, self.device)
        rows = to_device([r for _, r in pos], torch.long, self.device)
        toks = tokens.reshape(-1).index_select(0, idx).long()
        # an id outside the vocabulary adds nothing (masked by value, not by selection: selecting rows by a
        # mask would read the mask back from the device, and the engine samples without waiting for it)
        ok = (toks >= 0) & (toks < self.vocab_size)
        toks = toks.clamp(0, self.vocab_size - 1)
        self._counts.index_put_((rows, toks), ok.to(torch.int32), accumulate=True)
        self._seen.index_put_((rows, toks), self._seen[rows, toks] | ok)  # one token a row: no index repeats

    def output_counts(self, key: Hashable) -> "torch.Tensor":
        """int32 [V]: the request's output token counts (a copy; for tests and debugging)."""
        return self._counts[self._entries[key].row].clone()

    def apply(self, logits: "torch.Tensor", keys: Sequence[Hashable | None]) -> "torch.Tensor":
        """logits [B, V'] (V' >= V; columns past V are left alone), keys[i] the request of row i.
        Adds the biases, then applies repetition, presence and frequency penalties, to the rows of
        registered requests only. In place; returns `logits`."""
        import torch

        if len(keys) != logits.shape[0]:
            raise ValueError(f"{len(keys)} keys for {logits.shape[0]} logits rows")
        sel = [(i, e) for i, k in enumerate(keys) if k is not None and (e := self._entries.get(k)) is not None]
        if not sel:
            return logits
        dev = logits.device
        V = self.vocab_size
        if logits.shape[1] < V:
            raise ValueError(f"logits have {logits.shape[1]} columns, fewer than the vocabulary ({V})")
        li = to_device([i for i, _ in sel], torch.long, dev)
        pool_rows = to_device([e.row for _, e in sel], torch.long, self.device)
        sub = logits.index_select(0, li)[:, :V]  # [k, V] copy, logits' dtype
        # logit_bias: one scatter for every biased row of the batch
        biased = [(j, e) for j, (_, e) in enumerate(sel) if e.bias_ids is not None]
        if biased:
            r = torch.cat([torch.full_like(e.bias_ids, j) for j, e in biased]).to(dev)
            c = torch.cat([e.bias_ids for _, e in biased]).to(dev)
            v = torch.cat([e.bias_vals for _, e in biased]).to(dev, sub.dtype)
            sub.index_put_((r, c), v, accumulate=True)
        ps = [e.params for _, e in sel]
        if any(p.repetition_penalty != 1.0 for p in ps):
            pen = to_device([p.repetition_penalty for p in ps], sub.dtype, dev)[:, None]
            seen = self._seen.index_select(0, pool_rows).to(dev)
            # transformers: a negative logit is multiplied by the penalty, any other divided by it
            sub = torch.where(seen, torch.where(sub < 0, sub * pen, sub / pen), sub)
        if any(p.presence_penalty or p.frequency_penalty for p in ps):
            counts = self._counts.index_select(0, pool_rows).to(dev)
            freq = to_device([p.frequency_penalty for p in ps], torch.float32, dev)[:, None]
            pres = to_device([p.presence_penalty for p in ps], torch.float32, dev)[:, None]
            # computed in float32 (a count times a penalty can lose digits in half precision)
            sub = (sub.float() - counts * freq - (counts > 0) * pres).to(sub.dtype)
        logits[li, :V] = sub
        return logits


def apply_min_p(logits: "torch.Tensor", min_p: Sequence[float] | "torch.Tensor",
                temperature: Sequence[float] | "torch.Tensor") -> "torch.Tensor":
    """Remove (-inf) the tokens of row i whose probability at temperature[i] is below min_p[i] times
    the top token's: transformers' MinPLogitsWarper on logits / temperature, computed without the
    softmax as logit < max_logit + temperature * ln(min_p). Rows with min_p 0 or temperature 0
    (greedy: the top token is kept anyway) are untouched. `logits` are the unscaled ones (this can
    run before or after the temperature division, which does not move the kept set). In place."""
    import torch

    mp = [float(x) for x in (min_p.tolist() if isinstance(min_p, torch.Tensor) else min_p)]
    tp = [float(x) for x in (temperature.tolist() if isinstance(temperature, torch.Tensor) else temperature)]
    if len(mp) != logits.shape[0] or len(tp) != logits.shape[0]:
        raise ValueError("min_p and temperature need one value per logits row")
    rows = [i for i in range(len(mp)) if mp[i] > 0 and tp[i] > 0]
    if not rows:
        return logits
    dev = logits.device
    idx = to_device(rows, torch.long, dev)
    sub = logits.index_select(0, idx).float()
    # ln(min_p) is -inf at 0 (excluded above) and 0 at 1 (only the top tokens stay)
    margin = to_device([tp[i] * math.log(mp[i]) for i in rows], torch.float32, dev)[:, None]
    top = sub.max(dim=-1, keepdim=True).values
    drop = sub < top + margin
    logits[idx] = logits.index_select(0, idx).masked_fill(drop, float("-inf"))
    return logits
