"""A request's state inside the engine, and what the engine hands back (events, completions)."""

from __future__ import annotations

import time
from dataclasses import dataclass, field

import numpy as np
import torch

from ..models.base import EncodedPrompt
from .sampling import SamplingParams


@dataclass
class Completion:
    request_id: str
    text: str
    token_ids: list[int]
    prompt_tokens: int
    completion_tokens: int
    finish_reason: str
    logprobs: list[dict] | None = None

    def to_json(self) -> dict:
        return {"text": self.text, "token_ids": self.token_ids, "prompt_tokens": self.prompt_tokens,
                "completion_tokens": self.completion_tokens, "finish_reason": self.finish_reason}


@dataclass
class StepEvent:
    request: "Request"
    token_id: int
    text_delta: str
    finished: bool
    finish_reason: str | None
    logprob: float | None = None
    top_logprobs: list[tuple[int, float]] | None = None
    error: str | None = None  # set when the request failed (finish_reason "error")


WAITING, RUNNING, FINISHED = "waiting", "running", "finished"


@dataclass
class Request:
    id: str
    prompt: EncodedPrompt
    params: SamplingParams
    generator: torch.Generator | None = None
    # ---- what the decoder computes: prompt ids (image rows as fake ids >= vocab) + outputs so far
    all_ids: list[int] = field(default_factory=list)
    hash_tokens: list[int] = field(default_factory=list)  # all_ids with image rows as (image, row) stand-ins
    prompt_positions: np.ndarray | None = None  # [3, prompt_len] multimodal rotary positions, else None
    rope_delta: int = 0
    image_spans: list[tuple[int, int]] = field(default_factory=list)  # (first index, rows) per image
    table: torch.Tensor | None = None  # prompt-embedding rows of its images, on the decoder's device
    vision_job: "object | None" = None  # its images' runtime.vision.VisionJob, when encoded ahead of admission
    # ---- images read by cross-attention layers (runtime.cross_kv)
    cross: "object | None" = None  # its CrossPlan
    cross_blocks: list[int] = field(default_factory=list)  # its blocks of the cross-attention pool
    cross_ready: bool = False  # its cross K/V are in those blocks
    hash_seed: bytes = b""  # prefix-cache chain root: the images every token's K/V depends on
    # ---- scheduler state
    status: str = WAITING
    num_computed: int = 0  # leading tokens of all_ids whose K/V are in the cache
    block_ids: list[int] = field(default_factory=list)
    block_hashes: list[bytes] = field(default_factory=list)
    num_committed: int = 0  # leading blocks recorded in the prefix cache
    num_cached_tokens: int = 0  # prompt tokens found in the prefix cache at first admission
    preemptions: int = 0
    # n > 1: a sibling is admitted once its leader's prompt is computed, so the prompt's full
    # blocks come from the prefix cache instead of being prefilled once per sample
    leader: "Request | None" = None
    # ---- sampling extras (the engine thread's)
    grammar: "object | None" = None  # runtime/grammar.GrammarMatcher of a structured-output request
    extras_registered: bool = False  # held by the engine's LogitsProcessor (penalties, logit_bias)
    # ---- output
    output_ids: list[int] = field(default_factory=list)
    text: str = ""
    emitted: int = 0  # characters of `text` already handed out
    finished: bool = False
    finish_reason: str | None = None
    error: str | None = None
    detok: "object | None" = None  # stopping.TextStream, made at the first token
    arrival: float = field(default_factory=time.perf_counter)
    first_token_time: float | None = None
    finish_time: float | None = None
    logprobs: list[dict] = field(default_factory=list)

    @property
    def prompt_len(self) -> int:
        return len(self.prompt.token_ids)

    @property
    def num_tokens(self) -> int:
        return len(self.all_ids)

    def position_of(self, start: int, n: int) -> np.ndarray:
        """Rotary positions of tokens [start, start + n): [n], or [3, n] while inside an M-RoPE prompt."""
        idx = np.arange(start, start + n, dtype=np.int64)
        if self.prompt_positions is None:
            return idx
        P = self.prompt_positions.shape[1]
        if start >= P:
            return idx + self.rope_delta
        out = np.broadcast_to(idx + self.rope_delta, (3, n)).copy()
        k = min(n, P - start)
        out[:, :k] = self.prompt_positions[:, start:start + k]
        return out

    def completion(self) -> Completion:
        return Completion(self.id, self.text, list(self.output_ids), self.prompt_len, len(self.output_ids),
                          self.finish_reason or "abort", self.logprobs if self.params.logprobs is not None else None)
