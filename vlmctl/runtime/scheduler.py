"""The token-budget scheduler: which requests compute how many tokens in the next step.

Every step it first gives each running request its next tokens (one for a decoding request, the
rest of its prompt, up to the budget, for one still in prefill), allocating KV blocks as they are
needed; when the pool is out of blocks it preempts the newest running request, which frees its
blocks and goes back to the head of the queue to be recomputed later (its full blocks usually
remain in the prefix cache, so the recompute is short). Then it admits waiting requests in
arrival order while the token budget, the sequence limit and free blocks allow; a prompt longer
than what is left of the budget is prefilled in chunks over several steps, interleaved with the
decode tokens of the running requests, so a burst of new prompts never stalls running streams.

It decides only; the engine runs the chunks and then calls `advance`.
"""

from __future__ import annotations

from collections import deque
from dataclasses import dataclass

import numpy as np

from .kv_cache import BlockPool, block_hashes
from .request import FINISHED, RUNNING, WAITING, Request


@dataclass
class Scheduled:
    request: Request
    start: int  # first token index (== request.num_computed when scheduled)
    n: int  # tokens to compute

    @property
    def completes(self) -> bool:
        """After this chunk every known token is computed: sample the next one."""
        return self.start + self.n == self.request.num_tokens


class Scheduler:
    def __init__(self, pool: BlockPool, *, max_num_seqs: int, max_num_batched_tokens: int):
        self.pool = pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    # ---- queue -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = WAITING
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Take a request out (finished, aborted or failed) and give its blocks back."""
        if req.status == RUNNING:
            self.running.remove(req)
        elif req.status == WAITING:
            try:
                self.waiting.remove(req)
            except ValueError:
                pass
        req.status = FINISHED
        self._free(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _free(self, req: Request) -> None:
        self.pool.release(req.block_ids)
        req.block_ids = []

    # ---- one step ----------------------------------------------------------------------------
    def _grow(self, req: Request, upto: int) -> bool:
        need = -(-upto // self.block_size) - len(req.block_ids)
        if need <= 0:
            return True
        got = self.pool.allocate(need)
        if got is None:
            return False
        req.block_ids.extend(got)
        return True

    def _preempt(self, req: Request) -> None:
        self.running.remove(req)
        self._free(req)
        req.num_computed = 0
        req.num_committed = 0
        req.status = WAITING
        req.preemptions += 1
        self.preemptions += 1
        self.waiting.appendleft(req)

    def _prefix_hit(self, req: Request) -> None:
        """Take the cached blocks of the request's longest known prefix (never all of it: the last token
        must be computed to have logits)."""
        bs = self.block_size
        full = (req.num_tokens - 1) // bs
        if len(req.block_hashes) < full:
            toks = np.asarray(req.hash_tokens[:full * bs], dtype=np.int64)
            parent = req.block_hashes[-1] if req.block_hashes else b""
            req.block_hashes.extend(block_hashes(toks, bs, len(req.block_hashes), parent))
        hit = self.pool.lookup(req.block_hashes[:full])
        req.block_ids = hit
        req.num_computed = len(hit) * bs
        req.num_committed = len(hit)
        self.pool.queried_tokens += req.num_tokens
        self.pool.hit_tokens += req.num_computed
        if req.preemptions == 0:
            req.num_cached_tokens = req.num_computed

    def schedule(self) -> tuple[list[Scheduled], list[Request]]:
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = min(req.num_tokens - req.num_computed, budget)
            while not self._grow(req, req.num_computed + n):
                victim = self.running[-1]
                self._preempt(victim)
                preempted.append(victim)
                if victim is req:
                    break
            if req.status != RUNNING:
                break
            out.append(Scheduled(req, req.num_computed, n))
            budget -= n
            i += 1
        if preempted:
            return out, preempted
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            self._prefix_hit(req)
            n = min(req.num_tokens - req.num_computed, budget)
            if not self._grow(req, req.num_computed + n):
                self._free(req)
                req.num_computed = req.num_committed = 0
                break
            self.waiting.popleft()
            req.status = RUNNING
            self.running.append(req)
            out.append(Scheduled(req, req.num_computed, n))
            budget -= n
        return out, preempted

    def advance(self, done: list[Scheduled]) -> None:
        """After the step ran: the chunks' tokens are in the cache; record newly full blocks for reuse."""
        bs = self.block_size
        for s in done:
            req = s.request
            if req.status != RUNNING:
                continue
            req.num_computed = s.start + s.n
            full = req.num_computed // bs
            if full <= req.num_committed or not self.pool.enable_prefix_caching:
                req.num_committed = max(req.num_committed, full)
                continue
            if len(req.block_hashes) < full:
                toks = np.asarray(req.hash_tokens[:full * bs], dtype=np.int64)
                parent = req.block_hashes[-1] if req.block_hashes else b""
                req.block_hashes.extend(block_hashes(toks, bs, len(req.block_hashes), parent))
            for j in range(req.num_committed, full):
                self.pool.commit(req.block_ids[j], req.block_hashes[j])
            req.num_committed = full
