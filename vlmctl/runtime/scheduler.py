"""The token-budget scheduler: which requests compute how many tokens in the next step.

Every step it first gives each running request its next tokens (one for a decoding request, the
rest of its prompt, up to the budget, for one still in prefill), allocating KV blocks as they are
needed; when the pool is out of blocks it preempts the newest running request, which frees its
blocks and goes back to the head of the queue to be recomputed later (its full blocks usually
remain in the prefix cache, so the recompute is short). Then it admits waiting requests in
arrival order while the token budget, the sequence limit and free blocks allow; a prompt longer
than what is left of the budget is prefilled in chunks over several steps, interleaved with the
decode tokens of the running requests, so a burst of new prompts never stalls running streams.

For decoders whose image rows attend to each other during prefill (`keep_images_whole`), a chunk
never ends inside an image: every image row must be computed together with the image's later
rows. Such a chunk ends before the image instead, or, when the image is where the chunk starts,
takes the rest of it whole even beyond the step's budget (by less than one image), so a prompt
always advances. A chunk may start inside an image when the prefix cache holds its first rows:
those were computed with the whole image in view.

Parallel samples of one prompt (n > 1) are one leader and its siblings: a sibling is not admitted
while its leader is still prefilling, so once admitted it finds the prompt's full blocks in the
prefix cache and computes only the last, partial block (and the leader's image features are in the
feature cache). Without prefix caching, or for a prompt shorter than a block, siblings do not wait.

Requests whose images are read by cross-attention layers also hold blocks of a second pool, the
cross-attention pool, from admission to the end (or to a preemption, which gives them back: the
K/V are recomputed from the image features at the next admission). They are taken at admission,
all at once; a request waits in the queue while they are not free. Their prefix-cache chain starts
from the images' hash, since every token's K/V depends on every image.

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
    def __init__(self, pool: BlockPool, *, max_num_seqs: int, max_num_batched_tokens: int,
                 keep_images_whole: bool = False, cross_pool: BlockPool | None = None):
        self.pool = pool
        self.cross_pool = cross_pool
        self.block_size = pool.block_size
        self.max_num_seqs = max_num_seqs
        self.max_num_batched_tokens = max_num_batched_tokens
        self.keep_images_whole = keep_images_whole
        self.waiting: deque[Request] = deque()
        self.running: list[Request] = []
        self.preemptions = 0

    # ---- queue -------------------------------------------------------------------------------
    def add(self, req: Request) -> None:
        req.status = WAITING
        self.waiting.append(req)

    def finish(self, req: Request) -> None:
        """Take a request out (finished, aborted or failed) and give its blocks back."""
        self.finish_many([req])

    def finish_many(self, reqs: list[Request]) -> None:
        """`finish` for many at once, in one pass over each queue: a client that drops a request of a
        thousand sequences must not cost a thousand scans of the waiting queue."""
        gone = {id(r) for r in reqs}
        if any(r.status == RUNNING for r in reqs):
            self.running = [r for r in self.running if id(r) not in gone]
        if any(r.status == WAITING for r in reqs):
            self.waiting = deque(r for r in self.waiting if id(r) not in gone)
        for req in reqs:
            req.status = FINISHED
            self._free(req)

    def has_work(self) -> bool:
        return bool(self.waiting or self.running)

    def _free(self, req: Request) -> None:
        self.pool.release(req.block_ids)
        req.block_ids = []
        if req.cross_blocks:
            self.cross_pool.release(req.cross_blocks)
            req.cross_blocks = []
        req.cross_ready = False

    def _take_cross(self, req: Request) -> bool:
        """The cross-attention blocks of a request being admitted (True when it needs none)."""
        if req.cross is None or req.cross_blocks:
            return True
        if self.cross_pool is None:
            raise RuntimeError("a request with cross-attention images but no cross-attention pool")
        got = self.cross_pool.allocate(-(-req.cross.rows // self.block_size))
        if got is None:
            return False
        req.cross_blocks = got
        return True

    # ---- one step ----------------------------------------------------------------------------
    def _chunk_len(self, req: Request, budget: int) -> int:
        """Tokens of `req` to compute now under `budget` (see the module docstring for images)."""
        start = req.num_computed
        n = min(req.num_tokens - start, budget)
        if not self.keep_images_whole or start + n == req.num_tokens:
            return n
        end = start + n
        for first, rows in req.image_spans:
            if first < end < first + rows:
                end = first if first > start else first + rows
                break
        return end - start

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
            parent = req.block_hashes[-1] if req.block_hashes else req.hash_seed
            req.block_hashes.extend(block_hashes(toks, bs, len(req.block_hashes), parent))
        hit = self.pool.lookup(req.block_hashes[:full])
        req.block_ids = hit
        req.num_computed = len(hit) * bs
        req.num_committed = len(hit)
        self.pool.queried_tokens += req.num_tokens
        self.pool.hit_tokens += req.num_computed
        if req.preemptions == 0:
            req.num_cached_tokens = req.num_computed

    def _waits_for_leader(self, req: Request) -> bool:
        lead = req.leader
        if lead is None:
            return False
        if (self.pool.enable_prefix_caching and lead.status == RUNNING and lead.num_computed < lead.prompt_len
                and (req.num_tokens - 1) // self.block_size > 0):
            return True
        req.leader = None  # decided once: after a preemption nobody waits (the leader may be queued behind)
        return False

    def schedule(self) -> tuple[list[Scheduled], list[Request]]:
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        preempted: list[Request] = []
        i = 0
        while i < len(self.running) and budget > 0:
            req = self.running[i]
            n = self._chunk_len(req, budget)
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
        self._admit(out, budget)
        return out, preempted

    def schedule_ahead(self, in_flight: dict[int, bool]) -> list[Scheduled] | None:
        """The next step, planned while the step before is still computing its tokens (async scheduling).
        `in_flight` maps id(request) of each request with a token in flight to whether it gets a row: that
        token is at position num_tokens, not known to the host yet, and its row (Scheduled(req, num_tokens,
        1)) takes it as input on the device; False leaves out a request whose token in flight is its last.
        Every other running request must be prefilling: its next chunk follows, then admissions, as
        `schedule` does. None when the step needs the host's tokens first (a running request with nothing
        to compute, a row that finds no block without preempting, too small a budget): the requests keep
        any blocks taken here, and the engine schedules again once it has read the tokens."""
        budget = self.max_num_batched_tokens
        out: list[Scheduled] = []
        prefilling = []
        for req in self.running:
            row = in_flight.get(id(req))
            if row is None:
                if req.num_computed >= req.num_tokens:
                    return None
                prefilling.append(req)
            elif row:
                if budget <= 0 or not self._grow(req, req.num_tokens + 1):
                    return None
                out.append(Scheduled(req, req.num_tokens, 1))
                budget -= 1
        for req in prefilling:  # decode rows first: a burst of prompts never stalls running streams
            if budget <= 0:
                break
            n = self._chunk_len(req, budget)
            if not self._grow(req, req.num_computed + n):
                return None
            out.append(Scheduled(req, req.num_computed, n))
            budget -= n
        self._admit(out, budget)
        return out

    def _admit(self, out: list[Scheduled], budget: int) -> None:
        """Admit waiting requests in arrival order while the budget, the sequence limit and free blocks
        allow, appending their first chunks to `out`."""
        while self.waiting and budget > 0 and len(self.running) < self.max_num_seqs:
            req = self.waiting[0]
            if self._waits_for_leader(req):
                break  # first come, first served: the queue behind it waits the leader's last prefill step
            self._prefix_hit(req)
            n = self._chunk_len(req, budget)
            if not self._grow(req, req.num_computed + n) or not self._take_cross(req):
                self._free(req)
                req.num_computed = req.num_committed = 0
                break
            self.waiting.popleft()
            req.status = RUNNING
            self.running.append(req)
            out.append(Scheduled(req, req.num_computed, n))
            budget -= n

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
                parent = req.block_hashes[-1] if req.block_hashes else req.hash_seed
                req.block_hashes.extend(block_hashes(toks, bs, len(req.block_hashes), parent))
            for j in range(req.num_committed, full):
                self.pool.commit(req.block_ids[j], req.block_hashes[j])
            req.num_committed = full
