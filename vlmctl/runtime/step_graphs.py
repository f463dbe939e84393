"""Steps with prompt rows replayed from CUDA graphs, one per row bucket (`TorchDecoder.forward`'s captured path).

An eager forward of a 7B decoder costs its host ~10.5 ms of launches whatever its length, so up to a few hundred
rows (a short prompt, a chat's next turn after a prefix-cache hit, a prompt chunk beside decode rows) the step is the
host's, with the GPU idle half of it (docs/benchmarks.md, session 44). Decode steps have replayed graphs since the
start; a step with prompt rows could not, because its attention took each chunk's length on the host. Here every
row, decode rows included, attends through the paged prompt kernel (`kernels.paged_prefill`), which reads which rows
belong to which sequence, and where, from a tile table in device memory: a step's shapes are then its row bucket's,
and its varying parts (positions, cache slots, tiles, block tables, the rows that want logits) are one pinned buffer
copied before the replay.

Outside the graph: the embedding (image rows from the prompt table vary in number) and, for multimodal rotary, the
step's cos|sin rows; both are copied into the graph's static inputs. Padding rows (a step shorter than its bucket)
are zero, write no cache slot (-1) and are in no tile. Steps the graph cannot take run eagerly: more rows than the
largest bucket, rows that see image states through cross-attention, or image rows that attend to each other.

`VLMCTL_STEP_GRAPH_ROWS` (default `STEP_GRAPH_ROWS`; 0: off) is the largest bucket. The graphs share the decode
graphs' memory pool; the buckets up to 384 rows reserved 318-356 MB for a 7B decoder on an H100 (docs/benchmarks.md,
session 47), inside the 2 GiB of slack the engine leaves beside the KV pool (`Engine._kv_blocks`).
"""

from __future__ import annotations

import weakref

import numpy as np
import torch

from . import ops
from .transfers import to_device

# On an H100 a captured step of up to 384 rows beat the eager forward at every size measured, 512 rows tied it and
# could lose once padded (docs/benchmarks.md, session 46); larger steps are the GPU's, and run eagerly.
STEP_GRAPH_ROWS = 384
# every 64 rows from 128 to 512: a step pays for its bucket's rows, ~13 µs a row for a 7B on an H100, and a 300-row
# step padded to 512 took longer than its eager forward (session 46)
_SIZES = (16, 32, 64, 128, 192, 256, 320, 384, 448, 512, 1024, 2048)


def step_graph_rows() -> int:
    """The largest captured step, in rows (`VLMCTL_STEP_GRAPH_ROWS`; 0: steps with prompt rows run eagerly)."""
    from .kernels.settings import env_int

    return env_int("VLMCTL_STEP_GRAPH_ROWS", STEP_GRAPH_ROWS)


def buckets(limit: int) -> list[int]:
    """The row buckets up to `limit`: 16, 32, 64, then every 64 rows to 512, powers of two beyond, and `limit`."""
    if limit <= 0:
        return []
    return [s for s in _SIZES if s < limit] + [limit]


class StepGraphs:
    """The captured steps of one decoder, a bucket each (`capture`); on a device without graphs (the CPU tests) the
    same static-shape steps run eagerly."""

    def __init__(self, dec, max_batch: int, limit: int):
        """`dec`: the `TorchDecoder` whose steps these are (its pools allocated)."""
        from .kernels import paged_prefill  # Triton: imported where steps are built

        # weakly: the decoder holds these steps, and their closures would otherwise keep it (its weights, KV pool and
        # graphs) alive after its last user let go, until Python's cycle collector happened to run
        self.dec = weakref.proxy(dec)
        self.sizes = buckets(limit)
        self.max_batch = max_batch
        self.block_m = paged_prefill.tiles(dec.head_dim)[0]
        self.max_blocks = -(-dec.max_seq // dec.block_size)
        self._prefill = paged_prefill
        self.sms = dec._num_sms
        # the buckets' split partials, one allocation for all of them (a step runs one bucket at a time); the CPU's
        # torch reference splits nothing
        splits = {b: paged_prefill.max_splits(b, dec.n_heads, dec.head_dim) for b in self.sizes}
        self.splits = splits
        most = max((b * s for b, s in splits.items() if s > 1), default=0)
        self._workspace = paged_prefill.split_workspace(most, dec.n_heads, dec.head_dim, 1, dec.device) \
            if most and dec.device.type == "cuda" else None
        self.entries: dict[int, dict] = {}

    # ---- which steps ---------------------------------------------------------------------------
    def bucket(self, rows: int) -> int | None:
        return next((s for s in self.sizes if s >= rows), None)

    def sequences(self, bucket: int) -> int:
        """The most chunks a bucket's step holds (one per running request)."""
        return min(bucket, self.max_batch)

    def takes(self, cs: list, rows: int) -> bool:
        """Whether a step of these chunks (`rows` rows in all) can replay a captured step."""
        b = self.bucket(rows)
        dec = self.dec
        return (b is not None and len(cs) <= self.sequences(b)
                and all(c.cross is None and len(c.block_table) <= self.max_blocks for c in cs)
                and not (dec.bidirectional_images and any((c.ids >= dec.table_base).any() for c in cs)))

    # ---- capture -------------------------------------------------------------------------------
    def capture(self) -> None:
        """Build every bucket's step: captured into the decoder's graph pool where it replays graphs (largest
        first, so that later captures reuse its memory), else kept to run eagerly."""
        with torch.inference_mode():
            for b in reversed(self.sizes):
                self.entries[b] = self._build(b, self.dec.use_graphs)

    def compile_only(self) -> None:
        """Run each bucket's step once, uncaptured, inside `compile_ahead.parallel_compiles` (its launches only
        submit their kernels' compiles): `capture` then finds them compiled."""
        with torch.inference_mode():
            for b in self.sizes:
                self._build(b, False)["body"]()

    def _build(self, B: int, capture: bool) -> dict:
        dec = self.dec
        dev = dec.device
        S = self.sequences(B)
        NT = self._prefill.max_tiles(B, S, self.block_m)
        F = self._prefill.TILE_FIELDS
        mrope = dec.mrope_section is not None
        # int32: positions | slots | rows wanting logits | tiles | block tables
        n = 2 * B + S + F * NT + S * self.max_blocks
        host = torch.zeros(n, dtype=torch.int32, pin_memory=dev.type == "cuda")
        d = torch.zeros_like(host, device=dev)
        st = {"B": B, "S": S, "NT": NT, "host": host, "dev": d, "mrope": mrope,
              "x": torch.zeros((B, dec.embed.shape[1]), dtype=dec.dtype, device=dev),
              "attn": torch.zeros((B, dec.n_heads, dec.head_dim), dtype=dec.dtype, device=dev),
              "cos_sin": torch.zeros((B, dec.cos_sin.shape[1]), dtype=torch.float32, device=dev) if mrope else None,
              "arange": torch.arange(B, dtype=torch.int32, device=dev)}
        self._clear(st)
        d.copy_(host)
        positions = st["arange"] if mrope else d[0:B]
        slots, want = d[B:2 * B], d[2 * B:2 * B + S]
        o = 2 * B + S
        tiles_t = d[o:o + F * NT].view(NT, F)
        tables = d[o + F * NT:].view(S, self.max_blocks)
        splits = self.splits[B]
        split_rows = min(NT, self._prefill.split_tiles(dec.n_heads, self.sms))  # rows past these never split
        ws = None
        if splits > 1 and self._workspace is not None:  # views shaped as split_workspace(B, heads, d, splits)
            n_part = B * dec.n_heads * splits
            ws = (self._workspace[0][:n_part], self._workspace[1][:n_part])

        def attend(li, qkv):
            layer = dec.layers[li]
            ci = layer.cache_index
            kc, vc = dec.k_cache[ci], dec.v_cache[ci]
            ks, vs = dec._scales(ci)
            ops.rope_and_cache(qkv, st["cos_sin"] if mrope else layer.cos_sin, positions, dec.n_heads, dec.n_kv,
                               dec.head_dim, kc, vc, slots, ks, vs)
            q = qkv[:, :dec.q_size].view(B, dec.n_heads, dec.head_dim)
            return ops.prompt_attention(q, kc, vc, tables, tiles_t, dec.scale, layer.window, ks, vs, st["attn"],
                                        splits, ws, split_rows)

        def body():
            residual, h_out = dec._layers(st["x"], attend, None)
            return dec._final(residual, h_out, want)

        st["body"] = body
        st["graph"] = None
        if capture:
            side = torch.cuda.Stream(dev)
            side.wait_stream(torch.cuda.current_stream(dev))
            with torch.cuda.stream(side):
                for _ in range(2):  # outside the graph: kernel compilation, cuBLAS workspaces
                    body()
            torch.cuda.current_stream(dev).wait_stream(side)
            graph = torch.cuda.CUDAGraph()
            with torch.cuda.graph(graph, pool=dec._graph_pool, capture_error_mode="thread_local"):
                st["out"] = body()
            if dec._graph_pool is None:
                dec._graph_pool = graph.pool()
            st["graph"] = graph
            st["copied"] = torch.cuda.Event()
        return st

    def _clear(self, st: dict) -> None:
        """A step with no rows: slots -1 (nothing written), no tiles, every table on block 0."""
        B = st["B"]
        h = st["host"].numpy()
        h[:] = 0
        h[B:2 * B] = -1

    # ---- a step ----------------------------------------------------------------------------------
    def run(self, cs: list, x: torch.Tensor, positions: np.ndarray | None, cos_sin: torch.Tensor | None,
            slots: np.ndarray, want: list[int]) -> torch.Tensor:
        """Run a step that `takes` accepted: `cs` in the forward's row order, x its embedded rows [T, hidden],
        `positions` [T] 1-D rotary positions (None with multimodal rotary, whose rows `cos_sin` [T, d] are given
        instead), `slots` [T] cache slots, `want` the rows whose logits are returned, in order -> [len(want), V]
        float32, valid until the next step."""
        T = x.shape[0]
        st = self.entries[self.bucket(T)]
        B, S, NT = st["B"], st["S"], st["NT"]
        if st["graph"] is not None:
            # the pinned buffer's last copy may still be queued (a step launched before the previous one's tokens
            # were read): it must have left before the buffer is rewritten
            st["copied"].synchronize()
        self._clear(st)
        h = st["host"].numpy()
        if positions is not None:
            h[0:T] = positions
        h[B:B + T] = slots
        h[2 * B:2 * B + len(want)] = want
        o = 2 * B + S
        F = self._prefill.TILE_FIELDS
        chunks, row = [], 0
        tables = h[o + F * NT:].reshape(S, self.max_blocks)
        for i, c in enumerate(cs):
            chunks.append((i, row, c.n, c.start))
            tables[i, :len(c.block_table)] = c.block_table
            row += c.n
        h[o:o + F * NT] = self._prefill.tile_table(chunks, self.block_m, NT, max_splits=self.splits[B],
                                                   heads=self.dec.n_heads, sms=self.sms).ravel()
        d = st["dev"]
        d.copy_(st["host"], non_blocking=True)
        if st["graph"] is not None:
            st["copied"].record()
        st["x"][:T].copy_(x)
        st["x"][T:].zero_()
        if cos_sin is not None:
            st["cos_sin"][:T].copy_(cos_sin)
        elif st["mrope"]:  # 1-D positions in a multimodal-rotary model: every section at the same position
            torch.index_select(self.dec.cos_sin, 0, to_device(positions, None, x.device), out=st["cos_sin"][:T])
        if st["graph"] is None:
            return st["body"]()[:len(want)]
        st["graph"].replay()
        return st["out"][:len(want)]
