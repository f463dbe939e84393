"""The batch-1 decode step of an AWQ decoder as one persistent CUDA kernel (`decode_step.cu`).

Every layer (norms, the four W4A16 linears, rotary, the KV append, attention) runs in one launch of one
block per SM: a producer warp per block streams the block's share of all the step's packed weights
through a ring of shared-memory slots (cp.async.bulk), ahead of the consumer warps, which run the layer's
phases between grid-wide barriers. The file's header says why and how; docs/benchmarks.md (session 14)
has the measurements. The embedding before it and the final norm and lm_head after it stay as they are.

`FusedStep.build(decoder)` returns None, with the reason in `unsupported_reason`, for what it does not
cover: it needs an H100/H200-class GPU (sm_90: bulk copies and mbarrier transactions), fp16 activations,
every layer's qkv / o / gate_up / down packed W4A16 with one group size, RMSNorm, SiLU or GELU-tanh,
head size 128, no q/k norms, sandwich norms, sliding windows or cross-attention layers, and shapes whose
K is a multiple of 256 and N of 8.

It is off unless `VLMCTL_FUSED_STEP=1`: correct on an H200 (logits within 0.3 % of the kernel-by-kernel
step, the same greedy tokens, graph replays equal to eager runs) but slower there, 2.83 against 2.04 ms a
7B AWQ step, because the consumer warps compute the linears at ~17 GB/s per SM where the memory system
delivers ~50 (benchmarks/fused_step_gpu.py's phase trace; docs/benchmarks.md, session 14).
`VLMCTL_FUSED_STEP_SLOTS` caps the ring's slots (measurements).
"""

from __future__ import annotations

import math
import os
import struct
from pathlib import Path

import torch

from .settings import env_int

SOURCE = Path(__file__).with_name("decode_step.cu")
CONSUMER_WARPS = 8
SLOT_CAP = 48 * 1024  # a tile of 16 rows if it fits in this, else 8 rows
SMEM_MAX = 227 * 1024  # dynamic shared memory one block may opt into on sm_90
_TEXT: dict = {}  # by the source it extends (one per build of the A/B switches)


def mode() -> str:
    """Which fused step VLMCTL_FUSED_STEP asks for: "" (off, the default), "ring" (1: this module's
    decode_step.cu, slower than the kernel-by-kernel step on an H200, docs/benchmarks.md, session 14) or
    "flow" (flow_step.py's decode_flow.cu, the same step ordered by counters in memory)."""
    v = os.environ.get("VLMCTL_FUSED_STEP", "0").strip().lower()
    if v in ("1", "on", "true", "ring"):
        return "ring"
    return "flow" if v == "flow" else ""


def enabled() -> bool:
    return mode() != ""


def source() -> str:
    """w4a16_mma.cu (whose helpers the step uses; as `w4a16.mma_source` builds it now) followed by decode_step.cu."""
    from .w4a16 import mma_source

    mma = mma_source()
    if mma not in _TEXT:
        _TEXT[mma] = mma + "\n" + SOURCE.read_text()
    return _TEXT[mma]


# What block 0 finished at each trace mark of a layer (decode_step.cu's MARK()s).
TRACE_MARKS = ("barrier", "norm", "qkv", "barrier", "attention", "barrier", "combine", "barrier", "attn in",
               "o", "barrier", "norm", "gate_up", "barrier", "act in", "down")


def kernel_name(group_size: int) -> str:
    return f"decode_step<{CONSUMER_WARPS}, {group_size}>"


def _bits(f: float) -> int:
    return struct.unpack("<i", struct.pack("<f", f))[0]


def _row_bytes(k: int, group_size: int) -> int:
    return k // 2 + 3 * (k // group_size)  # words + fp16 scales + uint8 zero points of one row


def tile_rows(k: int, group_size: int) -> int:
    return 16 if 16 * _row_bytes(k, group_size) <= SLOT_CAP else 8


def unsupported_reason(decoder) -> str | None:
    """Why `decoder` cannot run its batch-1 step fused, or None if it can."""
    from . import cuda_rtc

    if not enabled():
        return "off (VLMCTL_FUSED_STEP=1 or =flow turns it on)"
    if decoder.device.type != "cuda" or torch.cuda.get_device_capability(decoder.device) < (9, 0):
        return "needs a CUDA GPU of compute capability 9.0 or later"
    if decoder.dtype != torch.float16:
        return "fp16 activations only"
    if decoder.kv_cache_dtype != "auto":
        return "a 16-bit KV cache only (not --kv-cache-dtype fp8 or int8)"
    if not cuda_rtc.available():
        return "NVRTC is not installed"
    if decoder.n_cross_layers or decoder.one_plus or decoder.activation not in ("silu", "gelu_tanh"):
        return "cross-attention layers, (1 + w) norms or this activation"
    if decoder.head_dim != 128 or decoder.n_heads % decoder.n_kv or decoder.n_heads // decoder.n_kv > 8:
        return "head size 128 and at most 8 query heads per KV head only"
    D, I = decoder.spec.hidden_size, decoder.inter
    groups = set()
    for layer in decoder.layers:
        lins = (layer.qkv, layer.o, layer.gate_up, layer.down)
        # a packed W4A16 linear (runtime.decoder.W4A16Linear; not imported: the decoder imports this module)
        if not all(getattr(lin, "packed", None) is not None for lin in lins):
            return "every layer's linears must be W4A16"
        if (layer.q_norm is not None or layer.attn_out_norm is not None or layer.window is not None
                or layer.cos_sin is not decoder.cos_sin):
            return "q/k norms, sandwich norms, sliding windows or local rotary"
        if any(lin.bias is not None for lin in lins[1:]):
            return "biases other than the qkv projection's"
        shapes = [tuple(lin.packed["q4weight"].shape) for lin in lins]
        want = [((decoder.n_heads + 2 * decoder.n_kv) * 128, D), (D, decoder.n_heads * 128), (2 * I, D), (D, I)]
        if [(n, w * 8) for n, w in shapes] != want:
            return f"unexpected linear shapes {shapes}"
        for lin in lins:
            g = lin.group_size
            groups.add(g)
            n, k = lin.packed["q4weight"].shape[0], lin.packed["q4weight"].shape[1] * 8
            if k % 256 or n % 8 or g % 32 or (k // g) % 2 or any(t.data_ptr() % 16 for t in lin.packed.values()):
                return f"shape {n}x{k} with group {g} (needs K % 256, N % 8, an even K / G, 16-byte alignment)"
    if len(groups) != 1:
        return "one group size for every linear"
    return None


def linear_table(decoder, tile_rows_of, gate_up_tile_rows: int) -> list:
    """decode_step.cu's and decode_flow.cu's StepLinear rows, four a layer (qkv, o, gate_up, down): the packed
    weights', scales' and zero points' addresses, the bias's (or 0), rows N, K, the row where gate_up's up half
    starts (0 otherwise) and the rows a ring tile holds (tile_rows_of(K); gate_up's gate_up_tile_rows). gate_up's
    N counts gate rows: the up row of gate row r is N + r."""
    lins = []
    for layer in decoder.layers:
        for i, lin in enumerate((layer.qkv, layer.o, layer.gate_up, layer.down)):
            p = lin.packed
            n, k = p["q4weight"].shape[0], p["q4weight"].shape[1] * 8
            bias = lin.bias.data_ptr() if lin.bias is not None else 0
            ptrs = [p["q4weight"].data_ptr(), p["q4scales"].data_ptr(), p["q4zeros"].data_ptr(), bias]
            if i == 2:
                lins.append(ptrs + [n // 2, k, n // 2, gate_up_tile_rows])
            else:
                lins.append(ptrs + [n, k, 0, tile_rows_of(k)])
    return lins


class FusedStep:
    """The fused batch-1 step of one decoder: its tables, buffers and kernel. `run` is CUDA-graph capturable."""

    def __init__(self, decoder):
        self.decoder = decoder
        dec = decoder
        self.group = dec.layers[0].qkv.group_size
        self.D, self.I = dec.spec.hidden_size, dec.inter
        dev = dec.device
        ks = [self.D, dec.n_heads * 128, self.I]
        rows = {k: tile_rows(k, self.group) for k in ks}
        # gate_up tiles are 8 pairs (16 rows) always
        self.slot_bytes = -(-max(max(rows[k] * _row_bytes(k, self.group) for k in ks),
                                 16 * _row_bytes(self.D, self.group)) // 128) * 128
        grp = dec.n_heads // dec.n_kv
        self.x_bytes = -(-max(2 * max(ks), CONSUMER_WARPS * (grp + 2) * 256) // 256) * 256
        misc = (2 * CONSUMER_WARPS * 16 + CONSUMER_WARPS) * 4 + CONSUMER_WARPS * 64 + 8
        self.nslot = min(8, (SMEM_MAX - self.x_bytes - misc - 16 * 8) // self.slot_bytes)
        # VLMCTL_FUSED_STEP_SLOTS, for measurements: fewer slots, less of the step read ahead
        self.nslot = min(self.nslot, env_int("VLMCTL_FUSED_STEP_SLOTS", self.nslot, minimum=1))
        if self.nslot < 1:
            raise ValueError(f"a {self.slot_bytes}-byte tile does not fit in shared memory beside the x buffer")
        self.smem = self.nslot * self.slot_bytes + self.x_bytes + misc + 16 * self.nslot
        lins = linear_table(dec, lambda k: rows[k], 16)
        self.lins = torch.tensor(lins, dtype=torch.int64, device=dev)
        self.layers = None  # (pointers into the KV pool: built by `bind_cache`)
        self.max_tiles = -(-dec.max_seq // 32)
        f16 = torch.float16
        self.resid = torch.zeros(self.D, dtype=f16, device=dev)
        self.qkv = torch.zeros((dec.n_heads + 2 * dec.n_kv) * 128, dtype=f16, device=dev)
        self.attn = torch.zeros(dec.n_heads * 128, dtype=f16, device=dev)
        self.act = torch.zeros(self.I, dtype=f16, device=dev)
        self.part = torch.zeros(dec.n_heads * self.max_tiles * 132, dtype=torch.float32, device=dev)
        self.bar = torch.zeros(1, dtype=torch.int32, device=dev)
        self.trace = None  # uint64 [16 * layers]: block 0's phase-boundary times (ns), for benchmarks
        self.mode = 0  # measurements only: 1 computes on stale slots (no weights copied), 2 waits without computing
        self.num_blocks = torch.cuda.get_device_properties(dev).multi_processor_count
        self.scale_log2 = _bits(dec.scale * math.log2(math.e))
        self.eps = _bits(dec.eps)
        self.act_kind = {"silu": 0, "gelu_tanh": 1}[dec.activation]
        from . import cuda_rtc

        self.kernel = cuda_rtc.load_kernel(source(), kernel_name(self.group), dev)

    @classmethod
    def build(cls, decoder) -> "FusedStep | None":
        """The fused step, or None (the decoder then runs kernel by kernel) with the reason in
        `decoder.fused_step_reason`: what it does not cover, no room for its ring, or a kernel that NVRTC or
        the driver refused."""
        from .cuda_rtc import RtcError

        reason = unsupported_reason(decoder)
        step = None
        if reason is None:
            try:
                step = cls(decoder)
            except (ValueError, RtcError) as e:
                reason = str(e)
        decoder.fused_step_reason = reason
        return step

    def bind_cache(self) -> None:
        """The per-layer table: norm weights and this layer's K and V pools (after `allocate_cache`)."""
        dec = self.decoder
        rows = [[layer.input_norm.data_ptr(), layer.post_norm.data_ptr(), dec.k_cache[layer.cache_index].data_ptr(),
                 dec.v_cache[layer.cache_index].data_ptr()] for layer in dec.layers]
        self.layers = torch.tensor(rows, dtype=torch.int64, device=dec.device)
        self._cache_ptr = dec.k_cache.data_ptr()

    def run(self, x: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor, block_tables: torch.Tensor,
            context_lens: torch.Tensor) -> torch.Tensor:
        """x [1, D]: the embedded token -> the residual stream after the last layer [1, D] (before the final
        norm). positions / slots / context_lens: int32 [1] on the device; block_tables int32 [1, max blocks]."""
        dec = self.decoder
        if self.layers is None or self._cache_ptr != dec.k_cache.data_ptr():
            self.bind_cache()
        self.resid.copy_(x.reshape(-1))
        self.bar.zero_()
        bt = block_tables[0] if block_tables.dim() == 2 else block_tables
        # the kernel reads int32 (a captured step's buffers already are; an eager step's may come as int64)
        positions, slots, context_lens, bt = (t.to(torch.int32) for t in (positions, slots, context_lens, bt))
        self.kernel.launch((self.num_blocks, 1, 1), ((CONSUMER_WARPS + 1) * 32, 1, 1), self.smem,
                           [self.lins, self.layers, self.resid, self.qkv, self.attn, self.act, self.part, self.bar,
                            positions, slots, context_lens, bt, dec.cos_sin, dec.n_layers, self.D, dec.n_heads,
                            dec.n_kv, dec.block_size, self.max_tiles, self.scale_log2, self.eps, self.nslot,
                            self.slot_bytes, self.x_bytes, self.act_kind, self.trace, self.mode], dec.device,
                           cooperative=True)
        return self.resid.view(1, -1)
