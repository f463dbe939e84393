"""Sampling parameters and the batched sampler (greedy, temperature, top-k, top-p, per-request seeds)."""

from __future__ import annotations

from dataclasses import dataclass, field

import torch

from ..errors import InputError


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

    def validate(self) -> "SamplingParams":
        if self.max_tokens < 1:
            raise InputError(f"max_tokens must be at least 1 (got {self.max_tokens})")
        if not 0 <= self.temperature <= 100:
            raise InputError(f"temperature must be between 0 and 100 (got {self.temperature})")
        if not 0 < self.top_p <= 1:
            raise InputError(f"top_p must be in (0, 1] (got {self.top_p})")
        if self.top_k < 0:
            raise InputError(f"top_k must be >= 0 (got {self.top_k})")
        if self.logprobs is not None and not 0 <= self.logprobs <= 20:
            raise InputError(f"top_logprobs must be between 0 and 20 (got {self.logprobs})")
        return self


def make_generator(seed: int | None, device) -> torch.Generator | None:
    if seed is None:
        return None
    g = torch.Generator(device=device)
    g.manual_seed(int(seed) & 0xFFFF_FFFF_FFFF_FFFF)
    return g


def sample(logits: torch.Tensor, params: list[SamplingParams], generators: list[torch.Generator | None]):
    """logits [b, V] (float32) -> (token ids [b], chosen logprobs [b] or None, top logprobs or None).

    Filtering is vectorized over the batch; only the draw itself is per row (each request may
    carry its own seeded generator)."""
    b, V = logits.shape
    device = logits.device
    temps = torch.tensor([p.temperature for p in params], device=device, dtype=torch.float32)
    greedy = temps == 0
    tokens = logits.argmax(-1)
    if not bool(greedy.all()):
        scaled = logits / torch.where(greedy, torch.ones_like(temps), temps)[:, None]
        top_k = torch.tensor([p.top_k if p.top_k > 0 else V for p in params], device=device)
        if bool((top_k < V).any()):
            kth = scaled.sort(-1, descending=True).values.gather(1, (top_k.clamp(max=V) - 1)[:, None])
            scaled = scaled.masked_fill(scaled < kth, float("-inf"))
        top_p = torch.tensor([p.top_p for p in params], device=device)
        if bool((top_p < 1).any()):
            sorted_logits, idx = scaled.sort(-1, descending=True)
            probs = sorted_logits.softmax(-1)
            # keep the smallest prefix whose mass reaches top_p (the first token always stays)
            remove = probs.cumsum(-1) - probs >= top_p[:, None]
            sorted_logits = sorted_logits.masked_fill(remove, float("-inf"))
            scaled = torch.full_like(scaled, float("-inf")).scatter(1, idx, sorted_logits)
        probs = scaled.softmax(-1)
        for i in range(b):
            if not bool(greedy[i]):
                tokens[i] = torch.multinomial(probs[i], 1, generator=generators[i])[0]
    want = [p.logprobs for p in params]
    if all(w is None for w in want):
        return tokens, None, None
    logp = logits.log_softmax(-1)
    chosen = logp.gather(1, tokens[:, None])[:, 0]
    k = max((w or 0) for w in want)
    top = logp.topk(k, -1) if k > 0 else None
    return tokens, chosen, top
