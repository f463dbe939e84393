"""W4A16 linears: 4-bit AWQ weights kept packed on the device, fp16/bf16 activations, fp32 accumulation.

This module runs `w4a16_linear` on the packed layout of `vlmctl.formats.w4a16` (whose names it
re-exports): Triton kernels on CUDA, a cached dequantize + F.linear reference elsewhere. It is not a
model layer and keeps no weights of its own (beyond a cache of dequantized weights on the reference
path). Dequantization in the kernels is exact in fp32 and rounds once to the activation dtype, so it
equals `dequantize(...).to(dtype)`.

Kernels (see `_w4a16_triton.py`): a reduction-form GEMV for batch 1 (and its half2 variant for fp16
activations, "gemv_h2", the fp16 default: `gemv_mode()`), a tensor-core kernel for
batches up to 64 and for mid-size prefill, and dequantize-to-scratch + cuBLAS for large prefill,
plus "mma", a CUDA kernel (`w4a16_mma.cu`, compiled at run time by NVRTC through `cuda_rtc`) for fp16
and bf16 decode batches where the tuned table picks it (on an H200: batches 2-32, see the table;
`VLMCTL_W4A16_MMA=0` turns it off), and from the same source a batch-1 GEMV ("gemv_cuda") and a GEMV
on the tensor cores for 2-16 rows ("mma_gemv": where the table names it, on an H200 the 7B decoder's linears
at batches 2-16, and by a rule at 2-8 rows elsewhere; `VLMCTL_W4A16_MMA_GEMV=0` turns it off),
with split-K reduced in-kernel (deterministic, no memset). Which runs is `select_config(M, N, K, G,
dtype)`: a measured table (`w4a16_tuned.json` beside this file, per GPU name, written by
`benchmarks/w4a16_gpu.py --table-out` and `benchmarks/w4a16_gemv_gpu.py`; `VLMCTL_W4A16_TABLE=FILE` reads another
table in its place, `=off` none) or else heuristics. Every launch is CUDA-graph capturable
once `warmup()` has compiled the kernels and sized the split-K workspace for the shapes in use.
"""

from __future__ import annotations

import json
import logging
import os
import weakref
from dataclasses import asdict, dataclass
from pathlib import Path

from ...errors import OptionError
from ...formats.w4a16 import (FORMAT, KEYS, ORDER, PACK, check_packed, dequantize, pack, repack_awq_gemm,
                              repack_gemm_tensors, unpack, weight_bytes)
from .compile_ahead import compiling_only, warm
from .compile_ahead import run as run_triton
from .settings import env_int

log = logging.getLogger("vlmctl.runtime")
MAGIC = 0x4B000000  # float32 2**23: OR a code into its mantissa to read it as 2**23 + code
MAGIC16 = 0x64006400  # two fp16 1024.0: OR a code into each half to read 1024 + code
# Prefill batches with at least this many rows dequantize to a scratch weight and call cuBLAS
# (an FP16 GEMM at M rows costs ~2*M*N*K flops against a fixed dequantize cost of writing N*K*2 bytes).
# Provisional until an H200 run of benchmarks/w4a16_gpu.py measures the crossover; a tuned table overrides it.
PREFILL_DEQUANT_MIN_M = env_int("VLMCTL_W4A16_DEQUANT_MIN_M", 1024, minimum=1)
TUNED_TABLE = Path(__file__).with_name("w4a16_tuned.json")

_WS: dict = {}  # device -> {"ws": fp32 split-K partials, "cnt": int32 tile counters, "deq": scratch weight}
# Buffers replaced by larger ones stay allocated: a CUDA graph captured earlier keeps their addresses
# (a prefill step with a larger M after capture must not free what the decode graphs read and write).
_RETIRED: list = []
_DEQ_CACHE: dict = {}  # id(q4weight) -> {(dtype, device): W}, dropped when q4weight is freed
_TUNED: dict = {}  # (device name, bucket, N, K, G, dtype name) -> Config
_TUNED_H2: dict = {}  # the same for the half2 GEMV ("variant": "h2" in the table), per gemv_mode()
_TUNED_CUDA: dict = {}  # and for the CUDA GEMV ("variant": "cuda"), where it can run
_TUNED_MMA_GEMV: dict = {}  # and for the tensor-core GEMV ("variant": "mma_gemv"), unless switched off
_TUNED_TC: dict = {}  # and for the batch-1 tensor-core GEMV ("variant": "tc"), where the CUDA GEMV can run
_TUNED_SOURCE: str | None = None  # the table file the tables above were loaded from ("" for none)
_TUNED_ENV: str | None = None  # the VLMCTL_W4A16_TABLE setting that source was resolved from
_VARIANT_TABLES = {"h2": _TUNED_H2, "cuda": _TUNED_CUDA, "mma_gemv": _TUNED_MMA_GEMV, "tc": _TUNED_TC}
_SM_COUNT: dict = {}


# ---------------------------------------------------------------------------------------------------
# reference


def _reference_linear(x2, packed, group_size, bias):
    """Dequantize once per (weight, dtype, device), cache while the weight lives, then F.linear."""
    import torch.nn.functional as F

    qw = packed["q4weight"]
    per = _DEQ_CACHE.get(id(qw))
    if per is None:
        # keyed by id (tensors compare elementwise, so they cannot be dict keys by value)
        per = _DEQ_CACHE[id(qw)] = {}
        weakref.finalize(qw, _DEQ_CACHE.pop, id(qw), None)
    key = (x2.dtype, x2.device)
    if key not in per:
        per[key] = dequantize(packed, group_size, x2.dtype).to(x2.device)
    return F.linear(x2, per[key], None if bias is None else bias.to(x2.dtype))


# ---------------------------------------------------------------------------------------------------
# configs


@dataclass(frozen=True)
class Config:
    """One launch choice. kernel: "gemv" (reduction form, one x row per program), "gemv_h2" (the same
    for fp16 x with half2 dequantization and fp16 runs of run_words packed words, i.e. 8 * run_words
    products, summed in fp16 before fp32), "dot" (tensor cores, block_m rows per program) or
    "dequant_mm" (dequantize to a scratch weight + cuBLAS), or "mma" (the CUDA kernel of `w4a16_mma.cu`,
    compiled at run time by NVRTC: fp16 or bf16 x, mma.sync with the weights dequantized in registers;
    block_m rows per tile, num_warps warps as warps_m along M by num_warps // warps_m along N, K chunks
    of block_k (64, 128 or 256) in a num_stages-deep cp.async ring), or "gemv_cuda" (the batch-1 GEMV of
    the same source, fp16 x: block_n weight rows per block, block_n // num_warps per warp, each lane
    reading num_stages 16-byte chunks of every row per batch, the next batch loaded while one is
    computed; block_k and split_k unused), or "mma_gemv" (the same source's GEMV on the tensor cores for
    2-16 rows, fp16 or bf16 x: 16 weight rows per block (block_n 16), block_m = 8 or 16 batch rows per
    block, num_warps warps taking the 128-k chunks in turn, each loading num_stages chunks ahead; needs
    K % 128 == 0 and groups of a multiple of 32), or "wgmma" (`w4a16_wgmma.cu`, sm_90 only, M <= block_m:
    warpgroup MMA on block_n = 128 or 256 weight rows per block (num_warps = block_n // 16: a warpgroup per
    64 rows) by block_m = 32 or 64 batch rows, K in units of block_k = 128 through a num_stages-deep ring; a
    persistent grid of one block per SM (split_k = 1) cuts the (tile, K unit) space stream-K), or "gemv_tc"
    (the batch-1 GEMV on the tensor cores, fp16 x, where the table names it: `gemv_tc_mode`; block_n = 16 T
    weight rows a block, T 16-row tiles a warp, num_warps warps splitting K in runs of num_stages 128-k chunks;
    needs K and the group size multiples of 128 and N of block_n (with act·mul, N / 2 is then a multiple of its
    block_n / 2 gate rows); compiled for each K; block_m 8: `w4a16_gemv_tc8`, the same for 2-8 rows of x, B's
    columns the rows, no act·mul; `gemv_tc_batch_mode`).
    num_stages: Triton's software pipelining for "dot"; for the GEMVs, 2 means the kernel loads the
    next K block into registers while computing the current one, 1 that it does not."""

    kernel: str
    block_n: int = 0
    block_k: int = 0
    block_m: int = 0
    split_k: int = 1
    num_warps: int = 4
    num_stages: int = 2
    run_words: int = 0  # gemv_h2 only (1 or 2)
    k_major: bool = False  # GEMVs with split_k > 1: launch the K slices of a row tile side by side
    warps_m: int = 1  # "mma" only: warps along M (num_warps // warps_m along N)

    def valid_for(self, n: int, k: int, group_size: int) -> bool:
        if self.kernel == "dequant_mm":
            return True
        if self.kernel == "mma":
            wm = self.warps_m
            if wm < 1 or self.num_warps % wm or self.block_m % (16 * wm):
                return False
            nt, rem = divmod(self.block_n, 8 * (self.num_warps // wm))
            mt = self.block_m // (16 * wm)
            bk = self.block_k
            return (1 <= mt <= 4 and mt * nt <= 16 and rem == 0 and nt in (1, 2, 4, 8) and bk in (64, 128, 256)
                    and self.num_warps in (1, 2, 4, 8, 16) and 2 <= self.num_stages <= 8 and self.split_k >= 1
                    and group_size % 64 == 0 and (group_size % bk == 0 or bk % group_size == 0)
                    and k % max(bk, group_size) == 0 and n % 8 == 0)
        if self.kernel == "wgmma":
            return (self.block_n in (128, 256) and self.num_warps == self.block_n // 16
                    and self.block_m in (32, 64) and self.block_k == 128 and 5 <= self.num_stages <= 8
                    and self.split_k == 1 and group_size % 64 == 0 and (group_size % 128 == 0 or group_size == 64)
                    and k % 128 == 0 and k % group_size == 0
                    and wgmma_shared_bytes(self, group_size) <= MMA_MAX_SHARED)
        if self.kernel == "mma_gemv":
            return (self.block_n == 16 and self.block_m in (8, 16) and self.num_warps in (1, 2, 4, 8, 16)
                    and 1 <= self.num_stages <= 4 and self.split_k == 1 and group_size % 32 == 0
                    and k % 128 == 0 and k % group_size == 0)
        if self.kernel == "gemv_tc":
            tiles, rem = divmod(self.block_n, 16)
            return (rem == 0 and tiles in (1, 2, 4) and self.num_warps in (1, 2, 4, 8, 16) and self.block_m in (0, 8)
                    and self.num_stages in (1, 2, 4) and tiles * self.num_stages <= 4 and self.split_k == 1
                    and group_size % 128 == 0 and k % 128 == 0 and k % group_size == 0 and n % self.block_n == 0)
        if self.kernel == "gemv_cuda":
            rpw, rem = divmod(self.block_n, max(1, self.num_warps))
            return (self.num_warps in (1, 2, 4, 8, 16) and rem == 0 and rpw in (1, 2, 4, 8)
                    and self.num_stages in (1, 2, 4) and self.split_k == 1 and group_size % 32 == 0
                    and k % group_size == 0)
        if self.kernel not in ("gemv", "gemv_h2", "dot") or not _pow2(self.block_n) or self.split_k < 1:
            return False
        if self.kernel == "gemv_h2":
            wpg = min(self.block_k, group_size) // PACK  # packed words of one row in one group of the block
            if self.run_words not in (1, 2) or not _block_k_ok(self.block_k, k, group_size) or wpg % self.run_words:
                return False
        if self.kernel == "dot" and not (_pow2(self.block_m) and self.block_m >= 16 and self.block_n >= 16):
            return False  # tl.dot needs every dimension >= 16
        return _block_k_ok(self.block_k, k, group_size) and (self.kernel == "gemv" or self.block_k >= 16)


def _pow2(v: int) -> bool:
    return v > 0 and v & (v - 1) == 0


def _block_k_ok(bk: int, k: int, g: int) -> bool:
    """A K block must tile K, hold whole words, and either sit inside one group or cover a power of two of them."""
    if not _pow2(bk) or bk < PACK or k % bk:
        return False
    return g % bk == 0 or (bk % g == 0 and _pow2(bk // g))


def _fit_block_k(want: int, k: int, g: int) -> int:
    bk = want
    while bk >= PACK and not _block_k_ok(bk, k, g):
        bk //= 2
    if bk < PACK:
        raise ValueError(f"no K block fits K={k} with group size {g}")
    return bk


def bucket(m: int) -> int:
    """The M bucket a config is chosen for: the next power of two, capped at 4096."""
    return min(1 << max(0, (m - 1).bit_length()), 4096)


def _sm_count(device) -> int:
    import torch

    if device is None or getattr(device, "type", "cpu") != "cuda" or not torch.cuda.is_available():
        return 132  # an H200; only matters for the interpreter, which has no SMs
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _SM_COUNT:
        _SM_COUNT[idx] = torch.cuda.get_device_properties(idx).multi_processor_count
    return _SM_COUNT[idx]


def _split_for(tiles: int, k_iters: int, sms: int, ctas_per_sm: float, cap: int = 64) -> int:
    """Smallest power-of-two split-K (at most `cap`) giving about ctas_per_sm * sms programs, keeping
    >= 2 K blocks each."""
    split = 1
    while tiles * split < ctas_per_sm * sms and split * 2 <= max(1, k_iters // 2) and split < cap:
        split *= 2
    return split


# Reasoning behind the defaults (sm_90 SASS of the kernels, compiled without a GPU; not yet timed):
# the GEMV issues ~4.0 instructions per weight with 128 rows x 64 k per one-warp program (16 rows per
# thread share each activation load and conversion) against ~4.6 at 32-64 rows; a batch-1 GEMV at
# 4.26 TB/s needs ~32 weights per clock per SM, i.e. at most ~4 instructions per weight. One-warp
# programs are small, so split-K aims at ~8 of them per SM to keep enough loads in flight. The
# tensor-core kernel issues ~5.2 per weight for fp16 (half2 dequantization) and ~7.6 for bf16
# (exact fp32 dequantization), independent of M up to its block, so it takes over from M = 2.
_GEMV_SHAPES = ((128, 64, 1), (64, 64, 1), (64, 128, 1), (128, 128, 2), (64, 128, 2), (32, 128, 1),
                (32, 256, 2), (128, 256, 4))  # (block_n, block_k, num_warps)
_DOT_SHAPES = ((64, 128, 4, 3), (128, 64, 4, 3), (64, 64, 4, 4), (128, 128, 4, 3), (64, 256, 4, 2),
               (128, 64, 8, 3), (32, 128, 4, 3), (256, 64, 8, 3))  # (block_n, block_k, num_warps, stages)
_GEMM_SHAPES = ((128, 64, 64, 4, 3), (128, 64, 128, 8, 3), (128, 128, 64, 8, 3), (64, 64, 128, 4, 4),
                (128, 64, 128, 8, 4), (256, 64, 128, 8, 3))  # (block_n, block_k, block_m, num_warps, stages)


def heuristic_config(m: int, n: int, k: int, group_size: int, sms: int = 132, mma: bool = False,
                     dtype="float16") -> Config:
    """The choice where the tuned table has no entry. With `mma` (the CUDA kernel can run: `select_config`
    decides), batches of 2-16 rows take `heuristic_mma_config` where it fits; otherwise, and elsewhere,
    the Triton kernels: at batch 1 the GEMV in the block shape the H200 sweeps chose for the tuned 7B
    decoder's linears (32 rows, 256-wide K blocks, 2 warps, ~4 programs per SM), else configs reasoned
    from instruction counts."""
    b = bucket(m)
    if b >= PREFILL_DEQUANT_MIN_M:
        return Config("dequant_mm")
    if mma and 2 <= b <= 16 and (c := heuristic_mma_config(n, k, group_size, sms, dtype)).valid_for(n, k, group_size):
        return c
    if b == 1:
        bn, bk = 32, _fit_block_k(256, k, group_size)
        return Config("gemv", bn, bk, 1, _split_for(-(-n // bn), k // bk, sms, 4), 2, 2)
    if b <= 64:
        bn, bk, bm = 64, _fit_block_k(128, k, group_size), max(16, b)
        c = Config("dot", bn, bk, bm, _split_for(-(-n // bn), k // bk, sms, 2), 4, 3)
    else:
        bn, bk, bm = 128, _fit_block_k(64, k, group_size), 64 if b <= 128 else 128
        c = Config("dot", bn, bk, bm, _split_for(-(-n // bn) * -(-m // bm), k // bk, sms, 1), 8, 3)
    # a group size like 24 leaves K blocks of 8, too small for tl.dot
    return c if c.valid_for(n, k, group_size) else Config("dequant_mm")


def heuristic_mma_gemv_config(n: int, k: int, group_size: int) -> Config:
    """The "mma_gemv" config for 1-8 rows at shapes the tuned table does not hold (selection takes it there
    for batches 2-8, and for batch 1 in bf16, where neither the CUDA nor the half2 GEMV runs): the H200 sweeps of
    a 7B decoder's linears (docs/benchmarks.md, session 12) chose 8 batch rows and 8 warps everywhere,
    one chunk in flight per warp for the large N (qkv, gate_up) and three for the small (o, down)."""
    return Config("mma_gemv", block_n=16, block_m=8, num_warps=8, num_stages=1 if n >= 8192 else 3)


def heuristic_mma_config(n: int, k: int, group_size: int, sms: int = 132, dtype="float16",
                         block_m: int = 16) -> Config:
    """The "mma" config for 2-16 rows at shapes the tuned table does not hold, from H200 sweeps over the
    linears of four decoders (hidden 3584 to 5120, with and without GQA; docs/benchmarks.md, session 8):
    16-row tiles, a 4-deep ring of 64-wide K chunks, and a split-K aiming at ~2.5 blocks per SM that
    leaves each split at least ~768 of K. fp16: 128 weight rows on 8 warps, or 64 on 4 where that
    gives fewer than ~1.5 blocks per SM (small N); bf16, whose dequantization costs a fifth more
    instructions, always 64 on 4."""
    shapes = ((64, 4),) if _dtype_name(dtype) == "bfloat16" else ((128, 8), (64, 4))
    for bn, warps in shapes:
        blocks = -(-n // bn)
        split = _split_for(blocks, k // 384, sms, 2.5)
        if blocks * split >= 1.5 * sms:
            break
    return Config("mma", block_n=bn, block_k=64, block_m=block_m, split_k=split, num_warps=warps, num_stages=4)


GEMV_MODES = ("auto", "triton", "cublas")


def gemv_mode() -> str:
    """`VLMCTL_GEMV`, the switch of the batch-1 Triton GEMVs (the fp16 dense GEMV in `kernels.gemv` and
    the half2 W4A16 GEMV "gemv_h2"): "auto" (default) runs the dense GEMV for the shapes this GPU's
    tuned table holds, where it was measured faster than cuBLAS, and the half2 GEMV for every fp16
    W4A16 linear (the table's config, else `heuristic_h2_config`, measured on an H200 at four models'
    shapes: docs/benchmarks.md); "triton" both everywhere, with heuristic configs where the tables
    have no entry; "cublas" neither (cuBLAS, and the fp32-unpack GEMV for W4A16)."""
    mode = os.environ.get("VLMCTL_GEMV", "auto").strip().lower() or "auto"
    if mode not in GEMV_MODES:
        raise OptionError(f"VLMCTL_GEMV={mode!r}: expected one of {', '.join(GEMV_MODES)}")
    return mode


# (block_n, block_k, num_warps, run_words), the heuristic's order of preference: first the block the H200
# sweeps picked for the 7B shapes, then the others a sweep tries. SASS instructions per weight on sm_90
# (compiled without a GPU, main loop): 64x128/1 warp/runs of 2 words 2.96, 32x256/2 warps 3.05,
# 128x128/4 3.12; the fp32 GEMV's best is 4.28 (128x64, 1 warp).
_H2_SHAPES = ((32, 256, 2, 2), (64, 128, 1, 2), (128, 64, 1, 2), (64, 128, 2, 2), (128, 128, 4, 2),
              (64, 128, 1, 1), (16, 256, 1, 2), (8, 256, 1, 2), (16, 128, 1, 2))


def heuristic_h2_config(m: int, n: int, k: int, group_size: int, sms: int = 132) -> Config | None:
    """The untuned half2 GEMV choice for a batch of <= 4 rows (None where no block fits): the block the
    H200 sweeps chose for three of the tuned 7B decoder's four linears (32 rows, 256-wide K blocks, 2 warps,
    runs of 2 words, register prefetch, K slices side by side) with a split-K aiming at ~4 programs per
    SM and at least ~1,024 of K per split (their splits: qkv 2, o 4, down 8); other block shapes where
    that one does not fit."""
    if bucket(m) > 4:
        return None
    for bn, bk, warps, run in _H2_SHAPES:
        c = Config("gemv_h2", bn, bk, 1, 1, warps, 2, run)
        if c.valid_for(n, k, group_size):
            split = _split_for(-(-n // bn) * m, k // 512, sms, 4)
            return Config("gemv_h2", bn, bk, 1, split, warps, 2, run, k_major=split > 1)
    return None


# Warps of the CUDA GEMV one SM holds, set by its registers a thread (sm_90, NVRTC 13: 4 rows x 2 chunks in
# flight 255 registers, 2 rows x 1 chunk 96; `benchmarks/w4a16_gemv_ablate_gpu.py --compile-only` prints them).
_GEMV_CUDA_WARPS_PER_SM = {(4, 2): 8, (2, 1): 20}


def _gemv_cuda_idle_chunks(k: int, chunks_in_flight: int) -> int:
    """32-k chunks a lane's last batch leaves empty: a batch is 32 lanes x `chunks_in_flight` chunks of a row."""
    batch = 32 * chunks_in_flight
    return -(k // 32) % batch


def heuristic_gemv_cuda_config(n: int, k: int, group_size: int, sms: int = 132) -> Config:
    """The CUDA GEMV's config where the tuned table has none (4 warps a block), chosen by waves of resident warps.
    4 rows x 2 chunks in flight (255 registers, 8 warps an SM) where its N / 4 warps fit one wave: o and down of
    7B-class models. Else 2 rows x 1 chunk (20 warps an SM) where N / 2 warps fit one wave: a second, partial wave
    of the first config made a 13B decoder's o and down (N 5120) 12-26 % slower a call, and its AWQ batch-1 step 6 %.
    Else (qkv of 7B and larger models: several waves either way) 4 rows, with 1 chunk in flight where 2 would
    leave more of the last batch empty (K = 5120: 13B's qkv) and 2 otherwise. Measured in the AWQ batch-1 decode
    step on an H100, and within 7 % of the fastest config a call at every qkv, o and down of an H200 sweep
    (docs/benchmarks.md, session 31). Its one known miss is a qkv of N 4608 by K 3584 (the second branch): the
    fastest a call alone, but that step is 2 % slower with it than with 4 rows x 2 chunks on both cards, which the
    tuned table names: only 4 x 2 gains from the decode attention after it starting early under PDL (session 32)."""
    if -(-n // 4) <= _GEMV_CUDA_WARPS_PER_SM[(4, 2)] * sms:
        return Config("gemv_cuda", block_n=16, num_warps=4, num_stages=2)
    if -(-n // 2) <= _GEMV_CUDA_WARPS_PER_SM[(2, 1)] * sms:
        return Config("gemv_cuda", block_n=8, num_warps=4, num_stages=1)
    chunks = 1 if _gemv_cuda_idle_chunks(k, 2) > _gemv_cuda_idle_chunks(k, 1) else 2
    return Config("gemv_cuda", block_n=16, num_warps=4, num_stages=chunks)


def heuristic_gemv_cuda_act_mul_config() -> Config:
    """The CUDA GEMV's config for a gate_up fused with its act·mul where the tuned table has none: 4 rows a warp
    (2 gate rows and their up rows), 2 warps a block, 1 chunk in flight. In the AWQ batch-1 decode step on an
    H100 with no table it was 3-5 % faster than the half2 Triton GEMV at gate_ups of 22016 x 4096 and 37888 x 3584
    and level at 28672 x 4096 and 27648 x 5120, where `heuristic_gemv_cuda_config` (2 chunks in flight at most of
    those shapes) was level or slower; 1 chunk is also what the per-call sweeps put in all 7 tuned gate_up
    entries of both cards (docs/benchmarks.md, session 32)."""
    return Config("gemv_cuda", block_n=8, num_warps=2, num_stages=1)


def gemv_cuda_candidate_configs(n: int, k: int, group_size: int) -> list[Config]:
    """What a sweep tries for the CUDA GEMV: rows per warp x warps x chunks in flight (at most 8 rows x
    chunks a lane, which keeps a lane's two batches of registers under the 255-register limit)."""
    out = []
    for rpw in (1, 2, 4, 8):
        for warps in (2, 4, 8):
            for ks in (1, 2, 4):
                c = Config("gemv_cuda", block_n=rpw * warps, num_warps=warps, num_stages=ks)
                if rpw * ks <= 8 and c.valid_for(n, k, group_size):
                    out.append(c)
    return out


def h2_candidate_configs(m: int, n: int, k: int, group_size: int, sms: int = 132) -> list[Config]:
    """What a tuning sweep tries for the half2 GEMV: block shapes x register prefetch x split-K."""
    out = []
    for bn, bk, warps, run in _H2_SHAPES:
        for prefetch in (1, 2):
            c = Config("gemv_h2", bn, bk, 1, 1, warps, prefetch, run)
            if not c.valid_for(n, k, group_size):
                continue
            base = _split_for(-(-n // bn) * bucket(m), k // bk, sms, 8 / warps)
            for split in sorted({1, max(1, base // 2), base, min(64, base * 2)}):
                if split <= max(1, k // bk):
                    out.append(Config("gemv_h2", bn, bk, 1, split, warps, prefetch, run))
                    if split > 1:
                        out.append(Config("gemv_h2", bn, bk, 1, split, warps, prefetch, run, k_major=True))
    return list(dict.fromkeys(out))


def candidate_configs(m: int, n: int, k: int, group_size: int, sms: int = 132) -> list[Config]:
    """What a tuning sweep tries for one (M bucket, N, K, G): block shapes x split-K around the
    parallelism target (split-K is a runtime argument, so it costs timing, not compilation)."""
    b = bucket(m)
    out: list[Config] = []

    def add(kind, bn, bk, bm, warps, stages, per_sm):
        if not _block_k_ok(bk, k, group_size):
            return
        tiles = -(-n // bn) * (-(-m // bm) if kind == "dot" else m)
        base = _split_for(tiles, k // bk, sms, per_sm)
        splits = {max(1, base // 2), base, min(64, base * 2)}
        if b > 64:  # prefill: the split-K workspace (split * M * N floats) would be large; little to gain
            splits = {base} | ({2 * base} if tiles * base < sms else set())
        for split in sorted(splits):
            if split <= max(1, k // bk):
                out.append(Config(kind, bn, bk, bm, split, warps, stages))
                if split > 1 and b <= 64:
                    out.append(Config(kind, bn, bk, bm, split, warps, stages, k_major=True))

    if b <= 4:
        for bn, bk, warps in _GEMV_SHAPES if b == 1 else _GEMV_SHAPES[:3]:
            for prefetch in (2, 1):
                add("gemv", bn, bk, 1, warps, prefetch, 8 / warps)
    if b <= 64:
        for bn, bk, warps, stages in _DOT_SHAPES:
            add("dot", bn, bk, max(16, b), warps, stages, 2)
    else:
        for bn, bk, bm, warps, stages in _GEMM_SHAPES:
            add("dot", bn, bk, bm, warps, stages, 1)
        out.append(Config("dequant_mm"))
    return list(dict.fromkeys(out))


def _dtype_name(dtype) -> str:
    return str(dtype).replace("torch.", "")


_DEVICE_NAME: dict = {}
_CAPABILITY: dict = {}


def _device_name(device) -> str:
    import torch

    if getattr(device, "type", "cpu") != "cuda" or not torch.cuda.is_available():
        return "cpu"
    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _DEVICE_NAME:
        _DEVICE_NAME[idx] = torch.cuda.get_device_name(idx)
    return _DEVICE_NAME[idx]


def tuned_table_source() -> str:
    """The table file selection reads: `VLMCTL_W4A16_TABLE` (a path; "off", "none" or "0": no table, the rules
    only), else the shipped `w4a16_tuned.json`; "" for none. A table measured on a GPU model the shipped one
    lacks (`benchmarks/w4a16_gemv_gpu.py` writes one) can be used this way without touching the install."""
    env = os.environ.get("VLMCTL_W4A16_TABLE", "").strip()
    if env.lower() in ("off", "none", "0"):
        return ""
    if env:
        if not Path(env).is_file():
            raise OptionError(f"VLMCTL_W4A16_TABLE={env!r} is not a file (a tuned W4A16 table, or off)")
        return env
    return str(TUNED_TABLE) if TUNED_TABLE.is_file() else ""


def _load_tuned_table() -> None:
    """Load the table `tuned_table_source` names, once per setting of VLMCTL_W4A16_TABLE (selection runs on every
    eager launch, so an unchanged setting costs one dictionary lookup): when the source changes, the tables (and
    any `set_config` pins) are replaced by the new one's entries."""
    global _TUNED_SOURCE, _TUNED_ENV
    env = os.environ.get("VLMCTL_W4A16_TABLE")
    if _TUNED_SOURCE is not None and env == _TUNED_ENV:
        return
    source = tuned_table_source()
    _TUNED_ENV = env
    if source == _TUNED_SOURCE:
        return
    for table in (_TUNED, *_VARIANT_TABLES.values()):
        table.clear()
    _TUNED_SOURCE = source
    if source:
        try:
            load_tuned(source)
        except (ValueError, KeyError, TypeError) as e:  # a file that is not such a table (JSON errors are ValueErrors)
            for table in (_TUNED, *_VARIANT_TABLES.values()):
                table.clear()
            _TUNED_SOURCE = _TUNED_ENV = None  # asked again next time, and refused again
            what = f"VLMCTL_W4A16_TABLE={source!r}" if env and env.strip() else f"the shipped table {source}"
            raise OptionError(f"{what} is not a W4A16 tuned table ({type(e).__name__}: {e})") from None


def tuned_devices() -> set:
    """The GPU names (as torch reports them) that the tuned table in use holds entries for."""
    _load_tuned_table()
    return {key[0] for table in (_TUNED, *_VARIANT_TABLES.values()) for key in table}


def untuned_device_note(device) -> str | None:
    """One line for an engine's load log where the table in use holds nothing for this GPU (the rules then pick
    every config, timed on other cards), else None."""
    if getattr(device, "type", "cpu") != "cuda":
        return None
    name = _device_name(device)
    if name == "cpu" or name in tuned_devices():
        return None
    source = tuned_table_source()
    if not source:
        return "W4A16 kernels: no tuned table (VLMCTL_W4A16_TABLE=off); the rules pick every config"
    return (f"W4A16 kernels: {source} has no entries measured on {name!r}; the rules timed on H100/H200 pick the "
            f"configs (docs/awq.md, 'The W4A16 kernel': a source checkout's benchmarks tune a GPU)")


def load_tuned(path) -> int:
    """Merge a tuned table (JSON written by `save_tuned`) into the one in use; return how many entries it held."""
    _load_tuned_table()  # first, so that loading the table in use later does not drop these entries
    data = json.loads(Path(path).read_text())
    if not isinstance(data, dict) or data.get("format") != FORMAT:
        raise ValueError(f"{path}: format {data.get('format') if isinstance(data, dict) else None!r}, "
                         f"expected {FORMAT!r}")
    for e in data.get("entries", []):
        key = (e["device"], int(e["bucket"]), int(e["n"]), int(e["k"]), int(e["group_size"]), e["dtype"])
        _VARIANT_TABLES.get(e.get("variant"), _TUNED)[key] = Config(**e["config"])
    return len(data.get("entries", []))


def save_tuned(path) -> None:
    """Write every pinned config; the half2 GEMV's entries carry "variant": "h2" and the CUDA GEMV's
    "variant": "cuda" (both used at batch 1 in fp16 unless VLMCTL_GEMV=cublas: `gemv_mode`; the CUDA
    GEMV's first, where it can run), so that each keeps the entry measured for the kernel after it."""
    entries = [{"device": d, "bucket": b, "n": n, "k": k, "group_size": g, "dtype": t, "config": asdict(c)}
               for (d, b, n, k, g, t), c in sorted(_TUNED.items())]
    for variant, table in _VARIANT_TABLES.items():
        entries += [{"device": d, "bucket": b, "n": n, "k": k, "group_size": g, "dtype": t, "variant": variant,
                     "config": asdict(c)} for (d, b, n, k, g, t), c in sorted(table.items())]
    Path(path).write_text(json.dumps({"format": FORMAT, "entries": entries}, indent=1) + "\n")


def set_config(m: int, n: int, k: int, group_size: int, dtype, config: Config, device=None) -> None:
    """Pin the config used for (bucket(m), N, K, G, dtype) on this device's GPU model."""
    if not config.valid_for(n, k, group_size):
        raise ValueError(f"{config} does not fit N={n} K={k} G={group_size}")
    _load_tuned_table()  # first, so that loading the table in use later does not drop the pin
    table = {"gemv_h2": _TUNED_H2, "gemv_cuda": _TUNED_CUDA, "mma_gemv": _TUNED_MMA_GEMV,
             "gemv_tc": _TUNED_TC}.get(config.kernel, _TUNED)
    table[(_device_name(device), bucket(m), n, k, group_size, _dtype_name(dtype))] = config


def select_config(m: int, n: int, k: int, group_size: int, dtype, device=None, *,
                  act_mul: bool = False) -> Config:
    """The config for y = x W^T at this shape: measured entries, then the untuned rules. act_mul: the call is a
    gate_up fused with its act·mul, whose CUDA GEMV rule is `heuristic_gemv_cuda_act_mul_config`."""
    _load_tuned_table()
    key = (_device_name(device), bucket(m), n, k, group_size, _dtype_name(dtype))
    half2 = bucket(m) == 1 and _dtype_name(dtype) == "float16" and gemv_mode() != "cublas"
    cuda_gemv = half2 and _gemv_cuda_ok(device)
    # a forced batch-1 tensor-core GEMV; measured entries (the batch-1 tensor-core GEMV's, the CUDA GEMV's, the
    # half2 GEMV's, the tensor-core GEMV's for 2-16 rows, then any other kernel's); then the untuned rules
    if (17 <= m <= 64 and _wgmma_ok(dtype, device) and (c := heuristic_wgmma_config(m)).valid_for(n, k, group_size)
            and (wgmma_mode() == "1" or triton_cdiv(n, c.block_n) >= 32)):
        return c
    if cuda_gemv and (tc := gemv_tc_config(n, k, group_size, act_mul)) is not None:
        return tc
    # 2-8 fp16 rows: w4a16_gemv_tc8 where forced or where the table names it (no act·mul: batched steps do not fuse)
    tc8_ok = 2 <= bucket(m) <= 8 and _dtype_name(dtype) == "float16" and not act_mul and _gemv_cuda_ok(device)
    if tc8_ok and (tc := gemv_tc_batch_config(n, k, group_size)) is not None:
        return tc
    mma_gemv = _TUNED_MMA_GEMV.get(key) if _mma_gemv_ok(dtype, device) else None
    tc = _TUNED_TC.get(key) if cuda_gemv and gemv_tc_mode() == "auto" else None
    if tc is not None and act_mul and not _act_mul_tiles(tc):
        tc = None  # (a gate_up entry must pair gate tiles with up tiles to fuse its act·mul)
    if tc8_ok and gemv_tc_batch_mode() == "auto" and (c := _TUNED_TC.get(key)) is not None and c.block_m == 8:
        tc = c
    if tc is not None and tc.block_m != (8 if bucket(m) > 1 else 0):
        tc = None  # (an entry for the other kernel: batch 1 is w4a16_gemv_tc's, 2-8 rows w4a16_gemv_tc8's)
    measured = (tc, (_TUNED_CUDA.get(key) if cuda_gemv else None),
                (_TUNED_H2.get(key) if half2 else None), mma_gemv, _TUNED.get(key))
    for c in measured:
        if c is not None and c.valid_for(n, k, group_size):
            return c
    if cuda_gemv and (c := (heuristic_gemv_cuda_act_mul_config() if act_mul else
                            heuristic_gemv_cuda_config(n, k, group_size, _sm_count(device)))).valid_for(n, k, group_size):
        return c
    if half2 and (c := heuristic_h2_config(m, n, k, group_size, _sm_count(device))) is not None \
            and c.valid_for(n, k, group_size):
        return c
    few_rows = 2 <= bucket(m) <= 8 or (bucket(m) == 1 and _dtype_name(dtype) == "bfloat16")
    if few_rows and _mma_gemv_ok(dtype, device) \
            and (c := heuristic_mma_gemv_config(n, k, group_size)).valid_for(n, k, group_size):
        return c
    return heuristic_config(m, n, k, group_size, _sm_count(device), mma=_mma_heuristic_ok(dtype, device),
                            dtype=dtype)


def _gemv_cuda_ok(device) -> bool:
    """Whether fp16 batch-1 linears may take the CUDA GEMV: `gemv_cuda_enabled`, on a CUDA device of
    compute capability 8.0+ (its PTX: f16x2 FMA, L1::no_allocate) where NVRTC is found."""
    if getattr(device, "type", None) != "cuda" or not gemv_cuda_enabled():
        return False
    from . import cuda_rtc

    return _capability(device) >= (8, 0) and cuda_rtc.available()


def _capability(device) -> tuple[int, int]:
    import torch

    idx = device.index if device.index is not None else torch.cuda.current_device()
    if idx not in _CAPABILITY:
        _CAPABILITY[idx] = torch.cuda.get_device_capability(idx)
    return _CAPABILITY[idx]


def _mma_gemv_ok(dtype, device) -> bool:
    """Whether "mma_gemv" may be selected (table entries or rule): `mma_gemv_enabled`, fp16/bf16 on a GPU
    with mma.sync m16n8k16 (compute capability 8.0+) where NVRTC is found."""
    if not mma_gemv_enabled() or _dtype_name(dtype) not in ("float16", "bfloat16"):
        return False
    return getattr(device, "type", None) == "cuda" and _capability(device) >= (8, 0) and mma_available()


def _wgmma_ok(dtype, device) -> bool:
    """Whether "wgmma" may be selected: `wgmma_enabled`, fp16/bf16 on an sm_90 GPU where NVRTC is found."""
    if not wgmma_enabled() or _dtype_name(dtype) not in ("float16", "bfloat16"):
        return False
    return getattr(device, "type", None) == "cuda" and _capability(device) == (9, 0) and mma_available()


def _mma_heuristic_ok(dtype, device) -> bool:
    """Whether untabled shapes may take the "mma" kernel: fp16/bf16 on a GPU with mma.sync m16n8k16
    (compute capability 8.0+) where NVRTC is found. `VLMCTL_W4A16_MMA_HEURISTIC=0` keeps them on Triton."""
    if os.environ.get("VLMCTL_W4A16_MMA_HEURISTIC", "1").strip() in ("0", "off", "false"):
        return False
    if _dtype_name(dtype) not in ("float16", "bfloat16") or getattr(device, "type", None) != "cuda":
        return False
    return _capability(device) >= (8, 0) and mma_available()


# ---------------------------------------------------------------------------------------------------
# launching


def triton_available() -> bool:
    try:
        import triton  # noqa: F401
    except Exception:
        return False
    return True


def _interpreting() -> bool:
    return os.environ.get("TRITON_INTERPRET", "0") not in ("", "0")


def _triton_kernels():
    from . import _w4a16_triton

    return _w4a16_triton


def _capturing(device) -> bool:
    import torch

    return device.type == "cuda" and torch.cuda.is_current_stream_capturing()


def _buffer(device, name: str, numel: int, dtype, zero: bool = False):
    """A per-device buffer of at least numel elements; grown only outside CUDA-graph capture."""
    import torch

    bufs = _WS.setdefault(str(device), {})
    t = bufs.get(name)
    if t is None or t.numel() < numel:
        if _capturing(device):
            raise RuntimeError(f"w4a16: the {name} buffer must grow to {numel} elements during CUDA-graph "
                               "capture; call warmup() with these shapes before capturing")
        if t is not None:
            _RETIRED.append(t)
        t = (torch.zeros if zero else torch.empty)(max(numel, 1), dtype=dtype, device=device)
        bufs[name] = t
    return t


def launch(x2, packed: dict, group_size: int, config: Config, bias=None, out=None, act: str | None = None):
    """Run one config on x2 [M, K] (contiguous rows) -> [M, N] in x2's dtype. Under TRITON_INTERPRET=1
    this runs on CPU tensors too (tests); `w4a16_linear` is the entry point for callers.
    act ("silu" or "gelu_tanh", Triton GEMV configs only): W is a gate_up weight (gate rows, then up
    rows) and the result is act(gate) * up [M, N / 2], computed in the GEMV's epilogue."""
    import torch

    kern = _triton_kernels()
    qw, s, z = (packed[key] for key in KEYS)
    m, k = x2.shape
    n = qw.shape[0]
    if not config.valid_for(n, k, group_size):
        raise ValueError(f"{config} does not fit N={n} K={k} G={group_size}")
    if act is not None and (config.kernel not in ACT_MUL_KERNELS or n % 2 or not _act_mul_tiles(config)):
        raise ValueError(f"act·mul runs in the epilogue of {ACT_MUL_KERNELS} configs with an even block_n "
                         "(the CUDA GEMV: even rows per warp), "
                         f"on an even N; not {describe(config)} with N={n}")
    if bias is not None and bias.dtype != x2.dtype:
        bias = bias.to(x2.dtype)
    if config.kernel == "dequant_mm":
        w = _buffer(x2.device, f"deq_{_dtype_name(x2.dtype)}", n * k, x2.dtype)[: n * k].view(n, k)
        dequantize_into(packed, group_size, w)
        if compiling_only():  # (the warm-up's compile pass: cuBLAS needs no compile)
            return out if out is not None else torch.empty(m, n, dtype=x2.dtype, device=x2.device)
        if out is None:
            return torch.nn.functional.linear(x2, w, bias)
        torch.mm(x2, w.t(), out=out)
        return out.add_(bias) if bias is not None else out
    n_out, rows_per_tile = (n // 2, config.block_n // 2) if act is not None else (n, config.block_n)
    y = out if out is not None else torch.empty(m, n_out, dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return y
    if compiling_only() and config.kernel in ("wgmma", "mma", "mma_gemv", "gemv_cuda", "gemv_tc"):
        return y  # NVRTC kernels: `precompile_selected` compiles them, several at a time
    if config.kernel == "wgmma":
        if not wgmma_runs(x2, qw):
            raise ValueError("the wgmma kernel needs fp16 or bf16 x on an sm_90 GPU with 16-byte aligned rows and "
                             "weights, K a multiple of 128, and NVRTC")
        _launch_wgmma(x2, packed, group_size, config, bias, y)
        return y
    if config.kernel in ("mma", "mma_gemv"):
        if not mma_runs(x2, qw):
            raise ValueError(f"the {config.kernel} kernel needs fp16 or bf16 x on CUDA with 16-byte aligned rows "
                             "and weights, and NVRTC")
        (_launch_mma if config.kernel == "mma" else _launch_mma_gemv)(x2, packed, group_size, config, bias, y)
        return y
    if config.kernel in ("gemv_cuda", "gemv_tc"):
        if not gemv_cuda_runs(x2, qw):
            raise ValueError(f"the {config.kernel} kernel needs fp16 x on CUDA with 16-byte aligned rows and "
                             "weights, and NVRTC")
        _launch_gemv_cuda(x2, packed, group_size, config, bias, y, act)
        return y
    bk = config.block_k
    ngb, wpg = (bk // group_size, group_size // PACK) if bk >= group_size else (1, bk // PACK)
    grid_n = triton_cdiv(n_out, rows_per_tile)
    gemv = config.kernel in ("gemv", "gemv_h2")
    if config.kernel == "gemv_h2" and x2.dtype != torch.float16:
        raise ValueError(f"the half2 GEMV takes fp16 activations, not {x2.dtype}")
    grid_m = m if gemv else triton_cdiv(m, config.block_m)
    split = max(1, min(config.split_k, k // bk))
    # sized for the whole M bucket, so that any batch size sharing this config fits what warmup allocated
    mb = max(m, bucket(m))
    ws = _buffer(x2.device, "ws", split * mb * n if split > 1 else 1, torch.float32)
    cnt = _buffer(x2.device, "cnt", grid_n * (mb if gemv else triton_cdiv(mb, config.block_m))
                  if split > 1 else 1, torch.int32, zero=True)
    has_bias = bias is not None
    b = bias if has_bias else y  # a dummy pointer when there is no bias
    grid = (grid_n, grid_m, split)
    from .pdl import l2_prefetch_blocks, launch_kwargs

    common = dict(G=group_size, BN=config.block_n, BK=bk, NGB=ngb, WPG=wpg, HAS_BIAS=has_bias,
                  EVEN_N=n_out % rows_per_tile == 0, num_warps=config.num_warps)
    if act is not None:
        from .fused import ACTIVATIONS

        common["ACT"] = ACTIVATIONS[act]
    # PDL for the GEMVs only: with the tensor-core kernel launched with it too, AWQ batch-64 steps were
    # slower (H200: 11.23 vs 10.76 ms with PDL off everywhere; batch 8 unchanged; docs/benchmarks.md)
    if gemv:
        common.update(launch_kwargs(x2.device))
        if common["PDL"] and k % 32 == 0 and bk % 32 == 0 and qw.data_ptr() % 16 == 0:
            common["L2PF"] = l2_prefetch_blocks("int4")  # (the bulk L2 prefetch: 16-byte aligned rows and sizes)
    if config.kernel == "dot":
        common.update(ASM=not _interpreting(), num_stages=config.num_stages)
    else:  # the GEMV's stages are its own register prefetch (Triton does not pipeline non-dot loads)
        common.update(PREFETCH=config.num_stages >= 2, num_stages=1)
    if config.k_major and split > 1 and grid_n <= 65535:  # grid dimension 2 holds at most 65535
        grid = (split, grid_m, grid_n)
        common["KMAJOR"] = True
    args = (x2, qw, s, z, b, y, ws, cnt, m, n, k, x2.stride(0), split, MAGIC, MAGIC16)
    if config.kernel == "gemv":
        run_triton(kern._gemv_kernel, grid, *args, **common)
    elif config.kernel == "gemv_h2":
        run_triton(kern._gemv_h2_kernel, grid, *args, RUNW=config.run_words, ASM=not _interpreting(), **common)
    elif config.kernel == "dot":
        run_triton(kern._dot_kernel, grid, *args, BM=config.block_m, **common)
    else:
        raise ValueError(f"unknown kernel {config.kernel!r}")
    return y


ACT_MUL_KERNELS = ("gemv", "gemv_h2", "gemv_cuda", "gemv_tc")  # the kernels whose epilogue can apply act(gate) * up


def _act_mul_tiles(config: Config) -> bool:
    """Whether `config`'s tiles pair gate rows with their up rows: an even block_n (the CUDA GEMV: an even
    number of rows per warp)."""
    if config.kernel == "gemv_cuda":
        return (config.block_n // config.num_warps) % 2 == 0
    if config.kernel == "gemv_tc":
        return (config.block_n // 16) % 2 == 0
    return config.block_n % 2 == 0


def act_mul_fusion_enabled() -> bool:
    """Whether `w4a16_act_mul` fuses (default on; `VLMCTL_W4A16_ACT_MUL=0` runs the linear, then the
    act·mul kernel, to compare)."""
    return os.environ.get("VLMCTL_W4A16_ACT_MUL", "1").strip().lower() not in ("0", "off", "false")


def w4a16_act_mul(x, packed: dict, group_size: int, activation: str, bias=None):
    """act(gate) * up of y = x @ W^T (+ bias) for a gate_up weight W [2I, K] (gate rows, then up rows)
    -> [..., I], computed in the GEMV's epilogue: no [.., 2I] intermediate and no act·mul kernel. Only
    for one row (batch-1 decode) on a GPU, where selection picks one of the Triton GEMVs (or, where the table
    names it, the CUDA GEMV); None elsewhere (checked before any
    selection, so batched steps pay nothing), and the caller runs the linear and the act·mul kernel.
    The Triton GEMVs' results equal that pair's bit for bit (the epilogue rounds gate and up to x's dtype
    first, as the plain GEMV's output is); the CUDA GEMV's may differ by one rounding of the activation
    (its exp and division are IEEE, Triton's approximate)."""
    import torch

    qw = packed["q4weight"]
    n, k = qw.shape[0], qw.shape[1] * PACK
    if (x.device.type != "cuda" or x.dtype not in (torch.float16, torch.bfloat16) or x.shape[-1] != k
            or x.numel() != k or n % 2 or not act_mul_fusion_enabled() or not triton_available()):
        return None
    x2 = x.reshape(-1, k)
    if x2.stride(-1) != 1:
        x2 = x2.contiguous()
    cfg = _act_mul_config(x2, qw, group_size)
    if cfg.kernel not in ACT_MUL_KERNELS or not _act_mul_tiles(cfg):
        return None
    return launch(x2, packed, group_size, cfg, bias, act=activation).reshape(*x.shape[:-1], n // 2)


def _act_mul_config(x2, qw, group_size: int) -> Config:
    """The config of a fused gate_up call: the table's, else the act·mul rules (session 10 had found the plain
    CUDA GEMV rule of that time 4-5 % slower than the half2 GEMV on a 13B gate_up; session 32 measured the act·mul
    rule now used against both)."""
    n, k = qw.shape[0], qw.shape[1] * PACK
    return select_config(x2.shape[0], n, k, group_size, x2.dtype, x2.device, act_mul=True)


MMA_SOURCE = Path(__file__).with_name("w4a16_mma.cu")
_MMA_TEXT: dict = {}
MMA_MAX_SHARED = 227 * 1024  # dynamic shared memory one block may opt into on sm_80 / sm_90


def mma_source() -> str:
    """`w4a16_mma.cu`, built by three A/B switches (each kept for measuring it again; outputs are the same bits
    except for SCALE_PER_RUN=0): `VLMCTL_W4A16_GEMV_SCALE_PER_RUN=0`, the batch-1 CUDA GEMV's arithmetic before
    session 29 (each weight dequantized to fp16 before its product, instead of each group's scale applied once a run
    of products); `VLMCTL_W4A16_GEMV_PRELOAD=2`, the batch-1 GEMVs (CUDA and tensor-core) load two batches of weights
    before their PDL wait instead of one (opt-in: slower on an H100); `VLMCTL_W4A16_DEQUANT_MASK=constant`, the
    batched kernels' dequantization (dequant2: mma, mma_gemv, wgmma, the fused steps) with its nibble mask read from
    constant memory instead of built as an immediate (session 56: fewer instructions; opt-in until a GPU measures
    it).
    Called on every launch: one string object per setting, so that `cuda_rtc.load_kernel`'s key hashes it once."""
    knob = os.environ.get("VLMCTL_W4A16_GEMV_SCALE_PER_RUN", "").strip().lower()
    knob = {"off": "0", "false": "0", "on": "1", "true": "1"}.get(knob, knob)  # the other switches' words
    preload = os.environ.get("VLMCTL_W4A16_GEMV_PRELOAD", "").strip() or "1"
    mask = os.environ.get("VLMCTL_W4A16_DEQUANT_MASK", "").strip().lower() or "immediate"
    text = _MMA_TEXT.get((knob, preload, mask))
    if text is None:
        if knob not in ("", "0", "1"):
            raise OptionError(f"VLMCTL_W4A16_GEMV_SCALE_PER_RUN={knob!r}: expected 1 (the default), 0, on or off")
        if preload not in ("1", "2"):
            raise OptionError(f"VLMCTL_W4A16_GEMV_PRELOAD={preload!r}: expected 1 (the default) or 2")
        if mask not in ("constant", "immediate"):
            raise OptionError(f"VLMCTL_W4A16_DEQUANT_MASK={mask!r}: expected immediate (the default) or constant")
        text = MMA_SOURCE.read_text()
        if knob == "0":
            text = "#define W4A16_GEMV_SCALE_PER_RUN 0\n" + text
        if preload == "2":
            text = "#define W4A16_GEMV_PRELOAD 2\n" + text
        if mask == "constant":
            text = "#define W4A16_DEQUANT_MASK_CONSTANT\n" + text
        _MMA_TEXT[(knob, preload, mask)] = text
    return text


def mma_available() -> bool:
    """Whether the CUDA "mma" kernel can be compiled here (NVRTC found; `VLMCTL_W4A16_MMA=0` turns it off)."""
    if os.environ.get("VLMCTL_W4A16_MMA", "1").strip() in ("0", "off", "false"):
        return False
    from . import cuda_rtc

    return cuda_rtc.available()


def mma_runs(x2, qw) -> bool:
    """The "mma" kernel's preconditions on the inputs (16-byte cp.async of x rows and weight rows)."""
    import torch

    return (x2.device.type == "cuda" and x2.dtype in (torch.float16, torch.bfloat16) and x2.stride(-1) == 1
            and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0 and qw.data_ptr() % 16 == 0 and mma_available())


def mma_kernel_name(config: Config, group_size: int, dtype="float16") -> str:
    """The template instance of `w4a16_mma.cu` that runs `config` on `dtype` (fp16 or bf16) activations."""
    wm = config.warps_m
    wn = config.num_warps // wm
    bf16 = {"float16": 0, "bfloat16": 1}[_dtype_name(dtype)]
    return (f"w4a16_mma<{config.block_m // (16 * wm)}, {config.block_n // (8 * wn)}, {wm}, {wn}, "
            f"{config.num_stages}, {group_size}, {config.block_k}, {bf16}>")


def gemv_cuda_enabled() -> bool:
    """Whether selection may pick the CUDA batch-1 GEMV (default on; `VLMCTL_W4A16_GEMV_CUDA=0` turns it
    off). H200, a 7B decoder's shapes (docs/benchmarks.md, sessions 9 and 10): its 128 linears alone take
    1.50 ms as a CUDA graph against the half2 GEMV's 1.63; in the AWQ decode step at batch 1 it was 2.6-4.3 %
    faster in all five off/on pairs of two session-10 machines and in two of four session-9 runs, level
    in one and 1-8 % slower in the first."""
    return os.environ.get("VLMCTL_W4A16_GEMV_CUDA", "1").strip().lower() not in ("0", "off", "false")


def gemv_cuda_runs(x2, qw) -> bool:
    """The CUDA GEMV's preconditions: fp16 x on CUDA with 16-byte aligned rows, aligned weights, NVRTC."""
    import torch

    from . import cuda_rtc

    return (x2.device.type == "cuda" and x2.dtype == torch.float16 and x2.stride(-1) == 1
            and x2.stride(0) % 8 == 0 and x2.data_ptr() % 16 == 0 and qw.data_ptr() % 16 == 0
            and cuda_rtc.available())


def gemv_cuda_kernel_name(config: Config, group_size: int, act: str | None = None) -> str:
    """The template instance of `w4a16_mma.cu`'s w4a16_gemv that runs `config`; act ("silu", "gelu_tanh"): the
    one with the gate_up epilogue."""
    rpw = config.block_n // config.num_warps
    tail = ""
    if act is not None:
        from .fused import ACTIVATIONS

        tail = f", {ACTIVATIONS[act]}"
    return f"w4a16_gemv<{rpw}, {config.num_warps}, {config.num_stages}, {group_size}{tail}>"


def gemv_tc_kernel_name(config: Config, group_size: int, k: int, act: str | None = None) -> str:
    """The template instance of `w4a16_mma.cu`'s w4a16_gemv_tc that runs `config` at this K (act: with the
    gate_up epilogue), or for block_m 8 its w4a16_gemv_tc8 (2-8 rows, no act·mul)."""
    shape = f"{config.block_n // 16}, {config.num_warps}, {config.num_stages}, {group_size}, {k}"
    if config.block_m == 8:
        if act is not None:
            raise ValueError("w4a16_gemv_tc8 has no act·mul epilogue")
        return f"w4a16_gemv_tc8<{shape}>"
    tail = ""
    if act is not None:
        from .fused import ACTIVATIONS

        tail = f", {ACTIVATIONS[act]}"
    return f"w4a16_gemv_tc<{shape}{tail}>"


def gemv_tc_mode() -> str | tuple[int, int, int]:
    """`VLMCTL_W4A16_GEMV_TC`: "auto" (the default) gives fp16 batch-1 linears the tensor-core GEMV
    (`w4a16_gemv_tc`) where this card's tuned table names it ("variant": "tc"), the CUDA GEMV elsewhere; "0"
    ("off") never; "1" ("on") everywhere it fits, with its rule's config; "T:W:S" everywhere it fits, with that
    config (T 16-row tiles a warp, W warps, S chunks a run; a gate_up with its act·mul takes T rounded up to even)."""
    return _tc_mode("VLMCTL_W4A16_GEMV_TC")


def gemv_tc_batch_mode() -> str | tuple[int, int, int]:
    """`VLMCTL_W4A16_GEMV_TC_BATCH`: the same words for fp16 linears of 2-8 rows and `w4a16_gemv_tc8`: "auto" (the
    default) where the tuned table names it (a "tc" entry of bucket 2-8 with block_m 8; none is shipped, so by
    default those rows keep mma_gemv until a GPU has measured it), "0" never, "1" or "T:W:S" everywhere it fits."""
    return _tc_mode("VLMCTL_W4A16_GEMV_TC_BATCH")


def _tc_mode(variable: str) -> str | tuple[int, int, int]:
    v = os.environ.get(variable, "auto").strip().lower()
    if v in ("", "auto"):
        return "auto"
    if v in ("0", "off", "false"):
        return "off"
    if v in ("1", "on", "true"):
        return "on"
    try:
        tiles, warps, stages = (int(p) for p in v.split(":"))
    except ValueError:
        tiles = warps = stages = 0
    if not Config("gemv_tc", block_n=16 * tiles, num_warps=warps, num_stages=stages).valid_for(128, 128, 128):
        raise OptionError(f"{variable}={v!r}: expected auto, 0, 1 or T:W:S (T 1, 2 or 4 tiles a warp, "
                          "W 1-16 warps, S 1, 2 or 4 chunks a run, T x S <= 4)")
    return tiles, warps, stages


def heuristic_gemv_tc_config(n: int, k: int, group_size: int, act_mul: bool = False) -> Config:
    """The tensor-core GEMV's config where `VLMCTL_W4A16_GEMV_TC=1`: 2 tiles a warp (x loaded once for 32 rows),
    8 warps splitting K, 1 chunk a run: the fastest of those the 7B decoder's four linears all took on an H100,
    and the fastest alone for gate_up with its act·mul (docs/benchmarks.md, session 52)."""
    return Config("gemv_tc", block_n=32, num_warps=8, num_stages=1)


def gemv_tc_config(n: int, k: int, group_size: int, act_mul: bool = False) -> Config | None:
    """The "gemv_tc" config `VLMCTL_W4A16_GEMV_TC` forces at this shape ("1" or "T:W:S"), or None (auto: the
    table decides; off; or the shape does not fit)."""
    mode = gemv_tc_mode()
    if mode in ("auto", "off"):
        return None
    if mode == "on":
        c = heuristic_gemv_tc_config(n, k, group_size, act_mul)
    else:
        tiles, warps, stages = mode
        if act_mul and tiles % 2:
            tiles += 1
        c = Config("gemv_tc", block_n=16 * tiles, num_warps=warps, num_stages=stages)
    return c if c.valid_for(n, k, group_size) else None


def gemv_tc_batch_config(n: int, k: int, group_size: int) -> Config | None:
    """The `w4a16_gemv_tc8` config `VLMCTL_W4A16_GEMV_TC_BATCH` forces at this shape, or None (auto: the table
    decides; off; or the shape does not fit). "1" takes the batch-1 rule's 2 tiles, 8 warps, 1 chunk a run."""
    mode = gemv_tc_batch_mode()
    if mode in ("auto", "off"):
        return None
    tiles, warps, stages = (2, 8, 1) if mode == "on" else mode
    c = Config("gemv_tc", block_n=16 * tiles, block_m=8, num_warps=warps, num_stages=stages)
    return c if c.valid_for(n, k, group_size) else None


def _launch_gemv_cuda(x2, packed: dict, group_size: int, config: Config, bias, y, act: str | None = None) -> None:
    """The CUDA GEMV or (config.kernel "gemv_tc") the tensor-core GEMV. act: a gate_up weight whose epilogue
    stores act(gate) * up (y [M, N / 2]; each warp's rows, or each block's tiles, are gate rows and their up rows,
    so a block covers half as many output rows)."""
    from . import cuda_rtc, pdl

    qw, s, z = (packed[key] for key in KEYS)
    m, k = x2.shape
    n = qw.shape[0]
    if config.kernel == "gemv_tc" and config.block_m == 8:
        kern = cuda_rtc.load_kernel(mma_source(), gemv_tc_kernel_name(config, group_size, k, act), x2.device)
        kern.launch((triton_cdiv(n, config.block_n), triton_cdiv(m, 8), 1), (32 * config.num_warps, 1, 1), 0,
                    [x2, qw, s, z, bias, y, m, n, x2.stride(0), int(bias is not None)], x2.device,
                    pdl=pdl.enabled(x2.device))
        return
    if config.kernel == "gemv_tc":
        kern = cuda_rtc.load_kernel(mma_source(), gemv_tc_kernel_name(config, group_size, k, act), x2.device)
        rows = (n // 2, config.block_n // 2) if act is not None else (n, config.block_n)
        kern.launch((triton_cdiv(*rows), m, 1), (32 * config.num_warps, 1, 1), 0,
                    [x2, qw, s, z, bias, y, n, x2.stride(0), int(bias is not None)], x2.device,
                    pdl=pdl.enabled(x2.device))
        return
    kern = cuda_rtc.load_kernel(mma_source(), gemv_cuda_kernel_name(config, group_size, act), x2.device)
    rows = (n // 2, config.block_n // 2) if act is not None else (n, config.block_n)
    # PDL as for the Triton GEMVs: the kernel reads only weights, scales and zero points before its wait
    kern.launch((triton_cdiv(*rows), m, 1), (32 * config.num_warps, 1, 1), 0,
                [x2, qw, s, z, bias, y, n, k, x2.stride(0), int(bias is not None)], x2.device,
                pdl=pdl.enabled(x2.device))


def _launch_mma(x2, packed: dict, group_size: int, config: Config, bias, y) -> None:
    import torch

    from . import cuda_rtc

    qw, s, z = (packed[key] for key in KEYS)
    m, k = x2.shape
    n = qw.shape[0]
    kern = cuda_rtc.load_kernel(mma_source(), mma_kernel_name(config, group_size, x2.dtype), x2.device)
    unit = max(config.block_k, group_size)  # the kernel walks K (and splits it) in whole chunks and groups
    split = max(1, min(config.split_k, k // unit))
    grid = (triton_cdiv(n, config.block_n), split, triton_cdiv(m, config.block_m))
    mb = max(m, bucket(m))
    ws = _buffer(x2.device, "ws", split * mb * n if split > 1 else 1, torch.float32)
    cnt = _buffer(x2.device, "cnt", grid[0] * triton_cdiv(mb, config.block_m) if split > 1 else 1, torch.int32,
                  zero=True)
    max_groups = triton_cdiv(k // unit, split) * (unit // group_size)
    smem = mma_shared_bytes(config, max_groups)
    if smem > MMA_MAX_SHARED:
        raise ValueError(f"{describe(config)} needs {smem} bytes of shared memory at K={k} (at most {MMA_MAX_SHARED}); "
                         "a larger split_k or fewer stages fit")
    kern.launch(grid, (32 * config.num_warps, 1, 1), smem,
                [x2, qw, s, z, bias, y, ws, cnt, m, n, k, x2.stride(0), int(bias is not None), max_groups],
                x2.device, pdl=mma_pdl(x2.device))


def mma_gemv_enabled() -> bool:
    """Whether selection may take the tuned table's "mma_gemv" entries and its rule for untabled shapes
    (default on; `VLMCTL_W4A16_MMA_GEMV=0` falls back to the table's other entries and rules)."""
    return os.environ.get("VLMCTL_W4A16_MMA_GEMV", "1").strip().lower() not in ("0", "off", "false")


def mma_gemv_kernel_name(config: Config, group_size: int, dtype="float16") -> str:
    """The template instance of `w4a16_mma.cu`'s w4a16_mma_gemv that runs `config` on `dtype` activations."""
    bf16 = {"float16": 0, "bfloat16": 1}[_dtype_name(dtype)]
    return (f"w4a16_mma_gemv<{config.num_warps}, {config.block_m // 8}, {config.num_stages}, {group_size}, "
            f"{bf16}>")


def _launch_mma_gemv(x2, packed: dict, group_size: int, config: Config, bias, y) -> None:
    from . import cuda_rtc, pdl

    qw, s, z = (packed[key] for key in KEYS)
    m, k = x2.shape
    n = qw.shape[0]
    kern = cuda_rtc.load_kernel(mma_source(), mma_gemv_kernel_name(config, group_size, x2.dtype), x2.device)
    # PDL as for the GEMVs: the kernel reads only weights, scales and zero points before its wait
    kern.launch((triton_cdiv(n, 16), triton_cdiv(m, config.block_m), 1), (32 * config.num_warps, 1, 1), 0,
                [x2, qw, s, z, bias, y, m, n, k, x2.stride(0), int(bias is not None)], x2.device,
                pdl=pdl.enabled(x2.device))


def mma_pdl(device) -> bool:
    """Whether "mma" launches use programmatic dependent launch: only with `VLMCTL_W4A16_MMA_PDL=1`, and
    where `pdl.enabled` (VLMCTL_PDL). Off by default because it was measured slower (H200, 7B decoder
    shapes, docs/benchmarks.md session 7): a step graph of the 128 linears at M = 8 took 3.03 ms with it
    and 2.55 without, the AWQ decode step at batch 8 4.74 vs 4.22 ms; the kernel keeps the PDL contract
    (only weights read before its wait) either way, and a GPU test checks it with the switch on."""
    from . import pdl

    if os.environ.get("VLMCTL_W4A16_MMA_PDL", "0").strip() not in ("1", "on", "true"):
        return False
    return pdl.enabled(device)


WGMMA_SOURCE = Path(__file__).with_name("w4a16_wgmma.cu")
_WGMMA_TEXT: dict = {}


def wgmma_source(defines: str = "") -> str:
    """`w4a16_wgmma.cu` after the source of `w4a16_mma.cu` (as `mma_source` builds it now), whose helpers it uses,
    after `defines` (its build options). One string object per build: the kernel cache hashes it on every launch,
    and a str caches its hash."""
    mma = mma_source()
    text = _WGMMA_TEXT.get((mma, defines))
    if text is None:
        text = _WGMMA_TEXT.setdefault((mma, defines), defines + mma + "\n" + WGMMA_SOURCE.read_text())
    return text


def wgmma_mode() -> str:
    """`VLMCTL_W4A16_WGMMA`: "1" (the default: selection takes the "wgmma" kernel for 17-64 rows on sm_90),
    "wide" (only where N has 32 or more tiles of 256 rows, the shapes that gain even with the serial stream-K
    fix-up), or "0" (never). With the parallel fix-up the 7B AWQ decode step was 1.5-11 % faster than fp16 or
    bf16 weights at batches 32-64 and 5-12 % faster than without the kernel (H200, docs/benchmarks.md,
    session 17)."""
    v = os.environ.get("VLMCTL_W4A16_WGMMA", "1").strip().lower()
    return "0" if v in ("0", "off", "false") else "wide" if v == "wide" else "1"


def wgmma_parallel_fixup() -> bool:
    """`VLMCTL_W4A16_WGMMA_FIXUP`: "parallel" (the default) builds the "wgmma" kernel with W4A16_WGMMA_PFIX (the
    blocks that end in a tile sum slices of its stream-K parts together; a cooperative launch), "serial" lets the
    tile's last block sum every part alone (7-14 us a call where few tiles are split over many blocks: o and
    down of a 7B at 64 rows). Both give the same bits."""
    return os.environ.get("VLMCTL_W4A16_WGMMA_FIXUP", "parallel").strip().lower() != "serial"


def wgmma_pipeline() -> bool:
    """`VLMCTL_W4A16_WGMMA_PIPE=1`: the "wgmma" kernel built with W4A16_WGMMA_PIPE (no block barrier a unit:
    stages released per warp on mbarriers, scales loaded per thread). Off by default: correct, but no faster than
    the default build in the decode step (H200, session 17 r9-r10)."""
    return os.environ.get("VLMCTL_W4A16_WGMMA_PIPE", "0").strip().lower() in ("1", "on", "true")


def wgmma_build_defines(parallel: bool | None = None) -> str:
    """The build options (#defines before `wgmma_source`) the launcher compiles the "wgmma" kernel with;
    parallel: the fix-up to build (default: `wgmma_parallel_fixup`)."""
    parallel = wgmma_parallel_fixup() if parallel is None else parallel
    return (("#define W4A16_WGMMA_PFIX 1\n" if parallel else "")
            + ("#define W4A16_WGMMA_PIPE 1\n" if wgmma_pipeline() else ""))


# devices (indices) whose driver refused the parallel fix-up's cooperative launch: they run the serial one
_COOPERATIVE_REFUSED: set = set()


def wgmma_cooperative_refused(device) -> bool:
    """Whether the parallel fix-up fell back to the serial one on this device (see `_launch_wgmma`)."""
    return _device_index(device) in _COOPERATIVE_REFUSED


def _wgmma_parallel(device) -> bool:
    """Whether the "wgmma" kernel runs the parallel fix-up on this device: asked for, and not refused there."""
    return wgmma_parallel_fixup() and _device_index(device) not in _COOPERATIVE_REFUSED


def _device_index(device) -> int:
    import torch

    device = torch.device(device)
    return device.index if device.index is not None else torch.cuda.current_device()


def wgmma_enabled() -> bool:
    """Whether selection may take the "wgmma" kernel (`wgmma_mode`)."""
    return wgmma_mode() != "0"


def wgmma_runs(x2, qw) -> bool:
    """The "wgmma" kernel's preconditions: those of "mma", an sm_90 GPU (warpgroup MMA), K % 128 == 0."""
    return mma_runs(x2, qw) and _capability(x2.device) == (9, 0) and x2.shape[1] % 128 == 0


def wgmma_kernel_name(config: Config, group_size: int, dtype="float16") -> str:
    """The template instance of `w4a16_wgmma.cu` that runs `config` on `dtype` activations."""
    bf16 = {"float16": 0, "bfloat16": 1}[_dtype_name(dtype)]
    return (f"w4a16_wgmma<{config.block_n // 64}, {config.block_m}, {config.num_stages}, {group_size}, "
            f"{bf16}>")


def wgmma_shared_bytes(config: Config, group_size: int) -> int:
    """Dynamic shared memory of one "wgmma" block: num_stages x (an x tile of block_m x 128 halfs, block_n
    weight rows of 16 words, and a word of scale and zero point per row and group of the 128-k unit, rounded
    up to 1 KB), and 1 KB to start the ring on a 1024-byte boundary (the TMA's swizzle atoms)."""
    groups = max(1, 128 // group_size)
    stage = config.block_m * 128 * 2 + config.block_n * 16 * 4 + config.block_n * groups * 4
    return config.num_stages * (-(-stage // 1024) * 1024) + 1024


def heuristic_wgmma_config(m: int) -> Config:
    """The "wgmma" config for 17-64 rows: four warpgroups (256 weight rows) per block, one block per SM, a
    5-deep ring (the shallowest its scale staging allows; deeper rings were slower in the H200 sweeps)."""
    bm = 32 if bucket(m) <= 32 else 64
    return Config("wgmma", block_n=256, block_k=128, block_m=bm, split_k=1, num_warps=16, num_stages=5)


def wgmma_tensor_maps(x2, qw, config: Config) -> tuple[bytes, bytes]:
    """The "wgmma" kernel's two TMA descriptors (its last parameters): x [M, K] in boxes of block_m rows x 64
    halfs, 128-byte swizzled (the layout wgmma's B operand reads), and the packed weights [N, K / 8] in boxes of
    block_n rows x 16 words, 64-byte swizzled; rows past M or N read as zero."""
    from . import cuda_rtc

    m, k = x2.shape
    tmx = cuda_rtc.tensor_map_2d(x2.data_ptr(), cuda_rtc.TMAP_UINT16, k, m, x2.stride(0) * 2, 64, config.block_m,
                                 cuda_rtc.TMAP_SWIZZLE_128B)
    tmw = cuda_rtc.tensor_map_2d(qw.data_ptr(), cuda_rtc.TMAP_UINT32, k // 8, qw.shape[0], k // 2, 16,
                                 config.block_n, cuda_rtc.TMAP_SWIZZLE_64B)
    return tmx, tmw


def _launch_wgmma(x2, packed: dict, group_size: int, config: Config, bias, y) -> None:
    import torch

    from . import cuda_rtc

    qw, s, z = (packed[key] for key in KEYS)
    m, k = x2.shape
    n = qw.shape[0]
    if m > config.block_m:
        raise ValueError(f"{describe(config)} takes at most {config.block_m} rows, not {m}")
    parallel = _wgmma_parallel(x2.device)
    kern = cuda_rtc.load_kernel(wgmma_source(wgmma_build_defines(parallel)),
                                wgmma_kernel_name(config, group_size, x2.dtype), x2.device, arch_suffix="a")
    tiles = triton_cdiv(n, config.block_n)
    # every block gets >= 1 unit; the parallel fix-up's blocks wait for each other, so all must be resident
    # (one block per SM: split_k 1)
    blocks = min(tiles * (k // 128), (1 if parallel else config.split_k) * _sm_count(x2.device))
    ws = _buffer(x2.device, "ws", blocks * 2 * config.block_n * config.block_m, torch.float32)
    # a ticket per tile for the stream-K fix-up (the parallel one: and a done count per tile); each launch
    # leaves them zero
    cnt = _buffer(x2.device, "cnt2" if parallel else "cnt", (2 if parallel else 1) * tiles, torch.int32, zero=True)
    tmx, tmw = wgmma_tensor_maps(x2, qw, config)
    try:
        kern.launch((blocks, 1, 1), (32 * config.num_warps, 1, 1), wgmma_shared_bytes(config, group_size),
                    [x2, qw, s, z, bias, y, ws, cnt, m, n, k, x2.stride(0), int(bias is not None), tmx, tmw],
                    x2.device, cooperative=parallel)
    except cuda_rtc.RtcError as e:
        if not parallel or e.code != cuda_rtc.COOPERATIVE_LAUNCH_TOO_LARGE:
            raise
        # Fewer SMs than the device reports are ours (an MPS client's share, a partitioned GPU): the serial
        # fix-up needs no block resident with another and gives the same bits. The engine's warm-up launches
        # run eagerly before any graph is captured, so this happens outside a capture.
        _COOPERATIVE_REFUSED.add(_device_index(x2.device))
        log.warning("W4A16 kernel: the driver refused a cooperative launch of %d blocks (%s); using the serial "
                    "stream-K fix-up on this device from now on (VLMCTL_W4A16_WGMMA_FIXUP=serial does so from "
                    "the start)", blocks, e)
        _launch_wgmma(x2, packed, group_size, config, bias, y)


def mma_shared_bytes(config: Config, max_groups: int) -> int:
    """Dynamic shared memory of one "mma" block: the cp.async ring (x rows of block_k + 8 halfs, weight
    rows of block_k / 8 + 4 words), then the block's scales and zero points."""
    xs, wsw = mma_strides(config.block_k)
    ring = config.num_stages * (config.block_m * xs * 2 + config.block_n * wsw * 4)
    return ring + config.block_n * max_groups * 3


def mma_strides(block_k: int) -> tuple[int, int]:
    """Halfs per x row and words per weight row of one stage in shared memory (the .cu's XS and WSW)."""
    return block_k + 8, block_k // 8 + 4


def triton_cdiv(a: int, b: int) -> int:
    return -(-a // b)


def dequantize_into(packed: dict, group_size: int, w, block_n: int = 64, block_k: int = 128) -> None:
    """Triton dequantize of the packed weight into w [N, K] (fp16/bf16/fp32), same values as `dequantize`."""
    kern = _triton_kernels()
    qw, s, z = (packed[key] for key in KEYS)
    n, k = qw.shape[0], qw.shape[1] * PACK
    bk = _fit_block_k(block_k, k, group_size)
    ngb, wpg = (bk // group_size, group_size // PACK) if bk >= group_size else (1, bk // PACK)
    run_triton(kern._dequant_kernel, (triton_cdiv(n, block_n), k // bk),
               qw, s, z, w, n, k, MAGIC, MAGIC16, G=group_size, BN=block_n, BK=bk, NGB=ngb, WPG=wpg,
               ASM=not _interpreting(), num_warps=4)


def w4a16_linear(x, packed: dict, group_size: int, bias=None):
    """y = x @ W^T (+ bias) for x [..., K] with W packed; y has x's dtype and device.

    CUDA with triton and fp16/bf16 x: the Triton kernels, config per `select_config`. Otherwise the
    torch reference (dequantized once per weight, dtype and device, then cached).
    """
    qw = packed["q4weight"]
    n, k = qw.shape[0], qw.shape[1] * PACK
    if x.shape[-1] != k:
        raise ValueError(f"x has {x.shape[-1]} features, the weight expects {k}")
    x2 = x.reshape(-1, k)
    import torch

    if x2.device.type != "cuda" or x2.dtype not in (torch.float16, torch.bfloat16) or not triton_available():
        y = _reference_linear(x2, packed, group_size, bias)
    else:
        if x2.stride(-1) != 1:
            x2 = x2.contiguous()
        cfg = select_config(x2.shape[0], n, k, group_size, x2.dtype, x2.device)
        if cfg.kernel in ("mma", "mma_gemv", "wgmma") and not (wgmma_runs if cfg.kernel == "wgmma" else mma_runs)(x2, qw):  # no NVRTC, or unaligned views: Triton
            cfg = heuristic_config(x2.shape[0], n, k, group_size, _sm_count(x2.device), mma=False)
        elif cfg.kernel in ("gemv_cuda", "gemv_tc") and not gemv_cuda_runs(x2, qw):  # unaligned: the half2 GEMV
            cfg = (heuristic_h2_config(x2.shape[0], n, k, group_size, _sm_count(x2.device))
                   or heuristic_config(x2.shape[0], n, k, group_size, _sm_count(x2.device), mma=False))
        y = launch(x2, packed, group_size, cfg, bias)
    return y.reshape(*x.shape[:-1], n)


def prefill_buckets(max_rows: int, decode_buckets=()) -> list[int]:
    """Row counts whose kernels a step of up to max_rows rows (prompt chunks beside decode rows) can select
    and the decode buckets do not cover: one per M bucket up to the dequantize-and-cuBLAS threshold, where
    every larger step takes that one path."""
    covered = {bucket(d) for d in decode_buckets}  # selection depends on M only through its bucket
    out, b = [], 1
    while b <= min(bucket(max_rows), PREFILL_DEQUANT_MIN_M):
        if b not in covered:
            out.append(b)
        b *= 2
    return out


def cuda_build(config: Config, group_size: int, dtype, device, k: int = 0) -> tuple[str, str, str] | None:
    """(source, template instance, arch suffix) of the NVRTC kernel that runs `config` (at this K: "gemv_tc" is
    compiled for each), or None where a Triton kernel or cuBLAS does."""
    if config.kernel == "gemv_cuda":
        return mma_source(), gemv_cuda_kernel_name(config, group_size), ""
    if config.kernel == "gemv_tc":
        return mma_source(), gemv_tc_kernel_name(config, group_size, k), ""
    if config.kernel == "mma":
        return mma_source(), mma_kernel_name(config, group_size, dtype), ""
    if config.kernel == "mma_gemv":
        return mma_source(), mma_gemv_kernel_name(config, group_size, dtype), ""
    if config.kernel == "wgmma":
        return (wgmma_source(wgmma_build_defines(_wgmma_parallel(device))), wgmma_kernel_name(config, group_size, dtype),
                "a")
    return None


def precompile_selected(shapes, group_size: int, m_values, dtype, device, *, act_mul_shapes=(),
                        activation: str = "silu") -> int:
    """Compile (into the on-disk cache, several NVRTC compilations at a time) the CUDA kernels that selection
    picks for these (N, K) shapes and row counts, and for the gate_up shapes `act_mul_shapes` the kernel with the
    `activation` epilogue that `w4a16_act_mul` runs at one row; returns how many there were. On a cold cache a 7B
    decoder's kernels compiled one by one at their first calls (serially, ~0.2-1 s each)."""
    import torch

    from . import cuda_rtc

    device = torch.device(device)
    if device.type != "cuda" or not cuda_rtc.available():
        return 0
    major, minor = _capability(device)
    builds: dict = {}
    for n, k in shapes:
        for m in m_values:
            b = cuda_build(select_config(m, n, k, group_size, dtype, device), group_size, dtype, device, k)
            if b is not None:
                builds.setdefault((b[0], f"sm_{major}{minor}{b[2]}"), set()).add(b[1])
    if 1 in m_values:
        for n, k in act_mul_shapes:
            c = select_config(1, n, k, group_size, dtype, device, act_mul=True)
            if c.kernel in ("gemv_cuda", "gemv_tc") and _act_mul_tiles(c) and n % 2 == 0:
                name = (gemv_tc_kernel_name(c, group_size, k, activation) if c.kernel == "gemv_tc"
                        else gemv_cuda_kernel_name(c, group_size, activation))
                builds.setdefault((mma_source(), f"sm_{major}{minor}"), set()).add(name)
    return sum(cuda_rtc.precompile(src, names, arch) for (src, arch), names in builds.items())


def warmup(packed_list, group_size: int, m_values, dtype, device=None, *, act_mul=(), activation="silu",
           biased=None, act_mul_biased=None) -> None:
    """Compile every kernel the given batch sizes select and size the shared buffers, so that later calls
    (and CUDA-graph capture) neither compile nor allocate beyond their outputs. `packed_list`: the packed
    weights (or one per distinct (N, K)) that will be called; `act_mul`: the gate_up weights that will also
    be called through `w4a16_act_mul` with `activation`. `biased` / `act_mul_biased`: for each of those,
    whether its calls pass a bias (a kernel specializes on it); None compiles both variants.
    The NVRTC kernels compile first, several at a time, then the Triton kernels (`compile_ahead`), then
    every call runs once. Triton specializes on 16-byte alignment of the pointers: inputs in graphs should
    be allocations (or views starting at such an offset), as the warm-up's are."""
    import torch

    def variants(flags, items):
        return [(False, True)] * len(items) if flags is None else [(bool(f),) for f in flags]

    calls, seen = [], set()
    for packed, bias_flags in zip(packed_list, variants(biased, packed_list)):
        qw = packed["q4weight"]
        dev = torch.device(device) if device is not None else qw.device
        n, k = qw.shape[0], qw.shape[1] * PACK
        for m in m_values:
            for has_bias in bias_flags:
                if (n, k, m, has_bias) not in seen:
                    seen.add((n, k, m, has_bias))
                    calls.append((w4a16_linear, packed, n, k, m, has_bias, dev))
    if 1 in m_values:  # `w4a16_act_mul` fuses one-row calls only
        for packed, bias_flags in zip(act_mul, variants(act_mul_biased, act_mul)):
            qw = packed["q4weight"]
            dev = torch.device(device) if device is not None else qw.device
            calls += [(w4a16_act_mul, packed, qw.shape[0], qw.shape[1] * PACK, 1, hb, dev) for hb in bias_flags]

    def call(fn, packed, n, k, m, has_bias, dev):
        x = torch.zeros(m, k, dtype=dtype, device=dev)
        bias = torch.zeros(n, dtype=dtype, device=dev) if has_bias else None
        if fn is w4a16_act_mul:
            return fn(x, packed, group_size, activation, bias)
        return fn(x, packed, group_size, bias)

    def precompile():  # the NVRTC kernels, 16 at a time (inside a compile pass, its own thread does this)
        if packed_list:
            dev0 = torch.device(device) if device is not None else packed_list[0]["q4weight"].device
            precompile_selected({(p["q4weight"].shape[0], p["q4weight"].shape[1] * PACK) for p in packed_list},
                                group_size, m_values, dtype, dev0, activation=activation,
                                act_mul_shapes={(p["q4weight"].shape[0], p["q4weight"].shape[1] * PACK)
                                                for p in act_mul})

    warm(calls, call, gpu=any(c[-1].type == "cuda" for c in calls), prepare=precompile)
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def tune(packed: dict, group_size: int, m_values, dtype, *, configs=None, warmup_ms: int = 5, rep_ms: int = 20,
         verbose=None, timer=None) -> dict:
    """Time the candidate configs for each M on this GPU (median, L2 flushed between runs by
    triton.testing.do_bench), pin the fastest with `set_config`, and return {M: [(config, ms), ...]}.
    `timer(fn) -> ms` replaces do_bench (the CPU smoke run uses a wall clock)."""
    import torch

    if timer is None:
        from triton.testing import do_bench

        def timer(fn):
            return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")

    qw = packed["q4weight"]
    n, k = qw.shape[0], qw.shape[1] * PACK
    dev = qw.device
    sms = _sm_count(dev)
    results = {}
    for m in m_values:
        x = torch.randn(m, k, dtype=dtype, device=dev)
        timed = []
        for cfg in (configs or candidate_configs(m, n, k, group_size, sms)):
            try:
                launch(x, packed, group_size, cfg)
                ms = timer(lambda: launch(x, packed, group_size, cfg))
            except Exception as e:  # a config that does not compile or run here is skipped, not fatal
                if verbose:
                    verbose(f"  skip {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            timed.append((cfg, ms))
        timed.sort(key=lambda t: t[1])
        if timed:
            set_config(m, n, k, group_size, dtype, timed[0][0], dev)
        results[m] = timed
    return results


def describe(config: Config) -> str:
    if config.kernel == "dequant_mm":
        return "dequant_mm"
    bm = f" bm{config.block_m}" if config.kernel in ("dot", "mma") else ""
    run = f" r{config.run_words}" if config.kernel == "gemv_h2" else ""
    km = " kmajor" if config.k_major else ""
    if config.kernel in ("gemv_cuda", "gemv_tc"):
        bm = " bm8" if config.kernel == "gemv_tc" and config.block_m == 8 else ""
        return f"{config.kernel}{bm} bn{config.block_n} w{config.num_warps} s{config.num_stages}"
    if config.kernel == "wgmma":  # a persistent grid of one block per SM, stream-K
        return f"wgmma bn{config.block_n} bm{config.block_m} s{config.num_stages}"
    if config.kernel == "mma_gemv":  # 16 weight rows a block, no K blocking or split
        return f"mma_gemv bm{config.block_m} w{config.num_warps} s{config.num_stages}"
    if config.kernel == "mma" and config.warps_m > 1:
        km += f" wm{config.warps_m}"
    return (f"{config.kernel} bn{config.block_n} bk{config.block_k}{bm} sk{config.split_k} "
            f"w{config.num_warps} s{config.num_stages}{run}{km}")


__all__ = ["FORMAT", "KEYS", "ORDER", "PACK", "PREFILL_DEQUANT_MIN_M", "Config", "bucket", "candidate_configs",
           "cuda_build", "precompile_selected", "prefill_buckets",
           "check_packed", "dequantize", "dequantize_into", "describe", "gemv_mode", "h2_candidate_configs",
           "gemv_cuda_candidate_configs", "gemv_cuda_enabled", "heuristic_config",
           "heuristic_gemv_cuda_config", "heuristic_h2_config", "heuristic_mma_config", "heuristic_mma_gemv_config",
           "launch", "load_tuned",
           "pack", "repack_awq_gemm", "repack_gemm_tensors", "save_tuned", "select_config", "set_config",
           "triton_available", "tune", "tuned_table_source", "unpack", "w4a16_linear", "warmup", "weight_bytes"]
