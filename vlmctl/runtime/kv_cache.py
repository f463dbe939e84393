"""Bookkeeping of the paged KV cache: a pool of fixed-size blocks with reference counts, and the
prefix cache that lets requests share full blocks.

The tensors live in the decoder (`TorchDecoder.allocate_cache`); this module only hands out block
ids. Block 0 is never handed out: padding rows of a captured decode step write there.

Prefix caching: a full block is keyed by a hash chained over every token before it and its own
tokens, where an image row counts as (image content hash, row) rather than its per-request fake
id. So a repeated system prompt, few-shot prefix or the same image in the next turn of a chat
finds its blocks already computed. A block whose last user leaves stays cached (evictable, least
recently used first) until the pool needs it.
"""

from __future__ import annotations

import hashlib
from collections import OrderedDict

import numpy as np

NULL_BLOCK = 0


def block_hashes(hash_tokens: np.ndarray, block_size: int, start: int = 0, parent: bytes = b"") -> list[bytes]:
    """Chained hashes of the full blocks of `hash_tokens` (int64) from block index `start` on."""
    out = []
    for b in range(start, len(hash_tokens) // block_size):
        h = hashlib.blake2b(parent + hash_tokens[b * block_size:(b + 1) * block_size].tobytes(), digest_size=16)
        parent = h.digest()
        out.append(parent)
    return out


def image_row_tokens(content_hash: str, rows: int) -> np.ndarray:
    """Stand-ins for an image's rows in block hashes: negative, so they never equal a token id."""
    base = int.from_bytes(hashlib.blake2b(content_hash.encode(), digest_size=7).digest(), "little") >> 2
    return -(1 + base + np.arange(rows, dtype=np.int64))


class BlockPool:
    def __init__(self, num_blocks: int, block_size: int, enable_prefix_caching: bool = True):
        if num_blocks < 2:
            raise ValueError("the KV cache needs at least 2 blocks")
        self.num_blocks, self.block_size = num_blocks, block_size
        self.enable_prefix_caching = enable_prefix_caching
        self.ref = [0] * num_blocks
        self.free: list[int] = list(range(num_blocks - 1, 0, -1))  # never-cached blocks (pop from the end)
        self.hash_of: dict[int, bytes] = {}
        self.cached: dict[bytes, int] = {}
        self.evictable: OrderedDict[int, None] = OrderedDict()  # cached blocks nobody holds, LRU first
        # statistics for /metrics
        self.queried_tokens = 0
        self.hit_tokens = 0

    @property
    def capacity(self) -> int:
        return self.num_blocks - 1

    def num_free(self) -> int:
        return len(self.free) + len(self.evictable)

    def num_used(self) -> int:
        return self.capacity - self.num_free()

    def allocate(self, n: int) -> list[int] | None:
        """n blocks (reference count 1), or None when the pool cannot supply them."""
        if n > self.num_free():
            return None
        out = []
        for _ in range(n):
            if self.free:
                b = self.free.pop()
            else:
                b, _ = self.evictable.popitem(last=False)
                del self.cached[self.hash_of.pop(b)]
            self.ref[b] = 1
            out.append(b)
        return out

    def release(self, blocks: list[int]) -> None:
        for b in reversed(blocks):  # tail blocks first, so a prefix's head stays cached longest
            self.ref[b] -= 1
            assert self.ref[b] >= 0, f"block {b} released twice"
            if self.ref[b] == 0:
                if b in self.hash_of:
                    self.evictable[b] = None
                else:
                    self.free.append(b)

    def lookup(self, hashes: list[bytes]) -> list[int]:
        """The cached blocks of the longest prefix of `hashes`, each now held (reference count +1)."""
        hit = []
        if self.enable_prefix_caching:
            for h in hashes:
                b = self.cached.get(h)
                if b is None:
                    break
                hit.append(b)
        for b in hit:
            if self.ref[b] == 0:
                self.evictable.pop(b, None)
            self.ref[b] += 1
        return hit

    def commit(self, block: int, h: bytes) -> None:
        """Record a block that has become full of computed tokens under its hash (first one wins)."""
        if self.enable_prefix_caching and h not in self.cached and block not in self.hash_of:
            self.cached[h] = block
            self.hash_of[block] = h

    def reset_prefix_cache(self) -> None:
        for b in list(self.evictable):
            self.free.append(b)
        self.evictable.clear()
        self.cached.clear()
        self.hash_of.clear()

    def hit_rate(self) -> float:
        return self.hit_tokens / self.queried_tokens if self.queried_tokens else 0.0
