"""The batch-1 decode step of an AWQ decoder as one persistent kernel whose stages are ordered by counters in
memory instead of kernel ends (`decode_flow.cu`; the file's header says why and how).

One block per SM runs its share of each linear's rows, its warps loading their first tasks' weights before the
stage's input is ready; attention runs as warp tasks over the grid. It covers what
`fused_step.unsupported_reason` allows and is selected with VLMCTL_FUSED_STEP=flow (off by default: correct,
slower so far, docs/benchmarks.md, session 50). VLMCTL_FLOW_WARPS sets the warps a block (8: at 12 and more the
7B kernel spills registers); VLMCTL_FLOW_OPTS selects variants for measurements. Its bit 32 (RING) runs
decode_flow.cu's ring variant: a producer warp a block streams the weights through shared-memory slots
(VLMCTL_FLOW_SLOT_KB) with bulk copies, and VLMCTL_FLOW_WARPS counts its consumer warps (7 fit the registers).
That is correct and about as slow: the GEMV arithmetic holds both (docs/benchmarks.md, session 51).
"""

from __future__ import annotations

import math
from pathlib import Path

import torch

from ...errors import OptionError
from .fused_step import FusedStep, _bits, linear_table, mode
from .settings import env_int

SOURCE = Path(__file__).with_name("decode_flow.cu")
_TEXT: dict = {}  # by the source it extends (one per build of the A/B switches)
SYNC_WORDS = 5  # a layer's stage counters before its KV heads' tickets (decode_flow.cu's FS_SYNC)
# Block 0's marks a layer (decode_flow.cu, `trace`): each linear's stage start, its input's wait done, the input
# staged, the block's tasks done and the block done; after qkv's, the end of the attention tasks.
TRACE_MARKS = ("qkv start", "qkv waited", "qkv staged", "qkv computed", "qkv done", "attention done",
               "o start", "o waited", "o staged", "o computed", "o done",
               "gate_up start", "gate_up waited", "gate_up staged", "gate_up computed", "gate_up done",
               "down start", "down waited", "down staged", "down computed", "down done")


def source() -> str:
    """w4a16_mma.cu and decode_step.cu (whose helpers the step uses), then decode_flow.cu."""
    from .fused_step import source as ring_source

    ring = ring_source()
    if ring not in _TEXT:
        _TEXT[ring] = ring + "\n" + SOURCE.read_text()
    return _TEXT[ring]


def chunks_per_lane(k: int) -> int:
    """The 32-k chunks of a K-long row each lane of a warp holds: ceil(K / 1024)."""
    return -(-k // 1024)


def flow_warps() -> int:
    """VLMCTL_FLOW_WARPS: warps a block, 1-32 (8 by default); a bad value is an OptionError, as every kernel
    setting's (not a silent fall-back to the kernel-by-kernel step)."""
    warps = env_int("VLMCTL_FLOW_WARPS", 8, minimum=1)
    if warps > 32:
        raise OptionError(f"VLMCTL_FLOW_WARPS={warps}: at most 32 warps a block")
    return warps


RING = 32  # VLMCTL_FLOW_OPTS bit: the weights through a ring of shared-memory slots a producer warp fills


def kernel_name(warps: int, group_size: int, d: int, attn_width: int, inter: int, opts: int = 0) -> str:
    return (f"decode_flow<{warps}, {group_size}, {chunks_per_lane(d)}, {chunks_per_lane(attn_width)}, "
            f"{chunks_per_lane(inter)}, {opts}>")


def ring_row_words(k: int, group_size: int) -> int:
    """A row's scale | zero-point words in the ring variant's array: K / G, padded to a multiple of 4 (16 bytes)."""
    return -(-(k // group_size) // 4) * 4


def ring_scales(packed: dict, group_size: int) -> torch.Tensor:
    """The ring variant's per-group words of one packed linear: fp16 scale bits | zero point << 16, int32
    [N, ring_row_words(K)] (the padding zero), so that a run of rows is one 16-byte-aligned bulk copy."""
    sc, zp = packed["q4scales"], packed["q4zeros"]
    n, kg = sc.shape
    out = torch.zeros(n, ring_row_words(kg * group_size, group_size), dtype=torch.int32, device=sc.device)
    out[:, :kg] = (sc.contiguous().view(torch.int16).to(torch.int32) & 0xFFFF) | (zp.to(torch.int32) << 16)
    return out


def ring_slot_bytes() -> int:
    """VLMCTL_FLOW_SLOT_KB: the ring variant's slot size (32 KiB by default; measurements)."""
    return 1024 * env_int("VLMCTL_FLOW_SLOT_KB", 32, minimum=8)


class FlowStep(FusedStep):
    """The dataflow batch-1 step of one decoder: its tables, per-layer buffers and kernel. `run` is CUDA-graph
    capturable."""

    def __init__(self, decoder):  # (not FusedStep's: no ring here)
        self.decoder = dec = decoder
        self.group = dec.layers[0].qkv.group_size
        self.D, self.I = dec.spec.hidden_size, dec.inter
        dev = dec.device
        self.warps = flow_warps()
        # measurements: bit 1 the first tasks' loads all before a stage's wait, bit 2 no block barrier at a stage's
        # end, bit 4 three tasks' weights a warp (else two), bit 16 the attention's V rows loaded where they are used
        # (not before the wait), bit 32 the ring variant (a producer warp streams the weights through shared memory;
        # VLMCTL_FLOW_WARPS then counts the consumer warps), bit 64 two of its units a warp at once, 128 and 256 its
        # ablations (nothing computed, nothing copied). Bit 8 (each warp's weights through its own cp.async slots,
        # twice as slow: session 50) was taken out in session 51.
        self.opts = env_int("VLMCTL_FLOW_OPTS", 0, minimum=0) & (511 & ~8)
        if self.I % 2:
            raise ValueError(f"an odd intermediate size {self.I}")
        self.ring = bool(self.opts & RING)
        if self.ring:
            # the table's zero-point field holds the scale | zero words and its last field their row length
            lins = linear_table(dec, lambda k: ring_row_words(k, self.group), ring_row_words(self.D, self.group))
            self.ring_sz = [ring_scales(lin.packed, self.group) for layer in dec.layers
                            for lin in (layer.qkv, layer.o, layer.gate_up, layer.down)]
            for row, sz in zip(lins, self.ring_sz):
                row[2] = sz.data_ptr()
        else:
            lins = linear_table(dec, lambda k: 0, 0)  # (no ring tiles here)
        self.lins = torch.tensor(lins, dtype=torch.int64, device=dev)
        self.layers = None  # (pointers into the KV pool: built by `bind_cache`)
        self.max_tiles = -(-dec.max_seq // 32)
        f16, nl = torch.float16, dec.n_layers
        self.attn_width = dec.n_heads * 128
        nq = (dec.n_heads + 2 * dec.n_kv) * 128
        self.h = torch.zeros(nl + 1, self.D, dtype=f16, device=dev)
        self.qkv = torch.zeros(nl, nq, dtype=f16, device=dev)
        self.attn = torch.zeros(nl, self.attn_width, dtype=f16, device=dev)
        self.hmid = torch.zeros(nl, self.D, dtype=f16, device=dev)
        self.act = torch.zeros(nl, self.I, dtype=f16, device=dev)
        self.part = torch.zeros(dec.n_heads * self.max_tiles * 132, dtype=torch.float32, device=dev)
        self.sync = torch.zeros(nl, SYNC_WORDS + dec.n_kv, dtype=torch.int32, device=dev)
        self.trace = None  # uint64 [n_layers, TRACE_MARKS]: block 0's stage marks (ns), for benchmarks
        self.num_blocks = torch.cuda.get_device_properties(dev).multi_processor_count
        self.scale_log2 = _bits(dec.scale * math.log2(math.e))
        self.eps = _bits(dec.eps)
        self.act_kind = {"silu": 0, "gelu_tanh": 1}[dec.activation]
        # the staged input of a stage, the warps' attention scratch, the norm's partial sums
        self.x_bytes = -(-2 * max(self.D, self.attn_width, self.I) // 128) * 128
        self.smem = self.x_bytes + self.warps * (dec.n_heads // dec.n_kv + 2) * 256 + 4 * self.warps + 4
        self.slot_bytes = self.nslot = 0
        if self.ring:
            # the longest unit must fit a slot: a down row, or a gate_up row pair
            unit = max(k // 2 + 4 * ring_row_words(k, self.group) for k in (self.D, self.attn_width, self.I))
            unit = max(unit, 2 * (self.D // 2 + 4 * ring_row_words(self.D, self.group)))
            self.slot_bytes = -(-max(ring_slot_bytes(), unit) // 128) * 128
            self.smem = -(-self.smem // 128) * 128
            self.nslot = (227 * 1024 - self.smem) // (self.slot_bytes + 16)
            if self.nslot < 2:
                raise ValueError(f"the flow step's ring has room for {self.nslot} slots of {self.slot_bytes} bytes")
            self.smem += self.nslot * (self.slot_bytes + 16)
        from . import cuda_rtc

        self.kernel = cuda_rtc.load_kernel(source(), kernel_name(self.warps, self.group, self.D, self.attn_width,
                                                                 self.I, self.opts), dev)

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor) -> torch.Tensor:
        """As FusedStep.run: x [1, D], the embedded token -> the residual stream after the last layer [1, D]."""
        dec = self.decoder
        if self.layers is None or self._cache_ptr != dec.k_cache.data_ptr():
            self.bind_cache()
        self.h[0].copy_(x.reshape(-1))
        self.sync.zero_()
        bt = block_tables[0] if block_tables.dim() == 2 else block_tables
        positions, slots, context_lens, bt = (t.to(torch.int32) for t in (positions, slots, context_lens, bt))
        args = [self.lins, self.layers, self.h, self.qkv, self.attn, self.hmid, self.act, self.part, self.sync,
                positions, slots, context_lens, bt, dec.cos_sin, dec.n_layers, self.D, self.I, dec.n_heads, dec.n_kv,
                dec.block_size, self.max_tiles, self.scale_log2, self.eps, self.act_kind, self.x_bytes,
                self.slot_bytes, self.nslot, self.trace]
        threads = (self.warps + self.ring) * 32  # (the ring variant's producer warp)
        self.kernel.launch((self.num_blocks, 1, 1), (threads, 1, 1), self.smem, args, dec.device, cooperative=True)
        return self.h[dec.n_layers].view(1, -1)


def build_step(decoder) -> FusedStep | None:
    """The fused batch-1 step VLMCTL_FUSED_STEP asks for (the ring step, or with `flow` this module's), or None
    with the reason in `decoder.fused_step_reason` (FusedStep.build)."""
    return (FlowStep if mode() == "flow" else FusedStep).build(decoder)
