"""Dense GEMV for decode: y = x @ W^T (+ bias) for a float W [N, K] and a few rows of x (M <= 4),
optionally with x = silu(gate) * up read straight from a gate_up output row (down_proj without the
separate SiLU·mul kernel). Triton on CUDA (`_gemv_triton.py`), a torch reference elsewhere.

The decoder uses it for batch-1 float linears on CUDA whose shape this GPU's tuned table holds
(`preferred()`; measured faster than cuBLAS there), or for all of them with `VLMCTL_GEMV=triton`,
or for none with `VLMCTL_GEMV=cublas` (`w4a16.gemv_mode`). Split-K is reduced inside the kernel (no separate reduce kernel, deterministic), so
every launch is CUDA-graph capturable once `warmup()` has compiled it and sized the shared split-K
workspace (the W4A16 kernels' buffers, `w4a16._buffer`). Which config runs is a measured table
(`gemv_tuned.json` beside this file, written by `benchmarks/gemv_gpu.py --table-out`) or else
`heuristic_config`. This module holds no weights.
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass
from pathlib import Path

from .compile_ahead import warm
from .compile_ahead import run as run_triton
from .w4a16 import _device_name, _dtype_name, _interpreting, _pow2, _split_for  # shared with the W4A16 kernels

MAX_M = 4  # rows per call; the kernel runs one program per row and re-reads W for each (from L2)
TUNED_TABLE = Path(__file__).with_name("gemv_tuned.json")
FORMAT = "gemv/1"
_TUNED: dict = {}  # (device name, N, K, dtype name, silu) -> Config
_TUNED_LOADED = False


def preferred(weight, *, silu: bool = False) -> bool:
    """Whether batch-1 calls with this weight (on its device) take the GEMV: see `w4a16.gemv_mode`."""
    from .w4a16 import gemv_mode

    mode = gemv_mode()
    if mode == "cublas" or getattr(weight.device, "type", "cpu") != "cuda":
        return False
    if mode == "triton":
        return True
    _load_table()
    n, k = weight.shape[0], weight.shape[1]
    return (_device_name(weight.device), n, k, _dtype_name(weight.dtype), bool(silu)) in _TUNED


@dataclass(frozen=True)
class Config:
    """block_n rows x block_k columns per program and K step; split_k programs per row tile (reduced
    in-kernel); prefetch: load the next K block into registers while computing this one."""

    block_n: int = 16
    block_k: int = 256
    split_k: int = 1
    num_warps: int = 4
    prefetch: bool = True

    def valid(self) -> bool:
        return _pow2(self.block_n) and _pow2(self.block_k) and self.block_k >= 8 and self.split_k >= 1 \
            and self.num_warps in (1, 2, 4, 8)


# (block_n, block_k, num_warps): every thread reads 16 bytes (8 halves) of a row per load; the tile
# holds block_n * block_k / (32 * num_warps) fp32 partial sums per thread (32-64 registers).
_SHAPES = ((16, 256, 4), (8, 512, 4), (32, 256, 4), (16, 512, 8), (8, 256, 2), (32, 128, 4), (64, 128, 8),
           (16, 128, 2))


def heuristic_config(m: int, n: int, k: int, sms: int = 132) -> Config:
    """Untuned (reasoned, not measured): 16 x 256 tiles, 4 warps, split-K up to ~4 programs per SM."""
    bn, bk = 16, 256
    while bk > 8 and bk > k:
        bk //= 2
    return Config(bn, bk, _split_for(-(-n // bn) * m, -(-k // bk), sms, 4, cap=32), 4, True)


def candidate_configs(m: int, n: int, k: int, sms: int = 132) -> list[Config]:
    out = []
    for bn, bk, warps in _SHAPES:
        if bk > max(8, k):
            continue
        base = _split_for(-(-n // bn) * m, -(-k // bk), sms, 8 / warps * 2, cap=32)
        for split in sorted({max(1, base // 2), base, base * 2}):
            if split <= -(-k // bk):
                for prefetch in (True, False):
                    out.append(Config(bn, bk, split, warps, prefetch))
    return list(dict.fromkeys(out))


def load_tuned(path) -> int:
    data = json.loads(Path(path).read_text())
    for e in data.get("entries", []):
        _TUNED[(e["device"], int(e["n"]), int(e["k"]), e["dtype"], bool(e["silu"]))] = Config(**e["config"])
    return len(data.get("entries", []))


def save_tuned(path) -> None:
    entries = [{"device": d, "n": n, "k": k, "dtype": t, "silu": s, "config": asdict(c)}
               for (d, n, k, t, s), c in sorted(_TUNED.items())]
    Path(path).write_text(json.dumps({"format": FORMAT, "entries": entries}, indent=1) + "\n")


def set_config(n: int, k: int, dtype, config: Config, *, silu: bool = False, device=None) -> None:
    if not config.valid():
        raise ValueError(f"invalid GEMV config {config}")
    _TUNED[(_device_name(device), n, k, _dtype_name(dtype), bool(silu))] = config


def _load_table() -> None:
    global _TUNED_LOADED
    if not _TUNED_LOADED:
        _TUNED_LOADED = True
        if TUNED_TABLE.is_file():
            load_tuned(TUNED_TABLE)


def select_config(m: int, n: int, k: int, dtype, *, silu: bool = False, device=None) -> Config:
    _load_table()
    c = _TUNED.get((_device_name(device), n, k, _dtype_name(dtype), bool(silu)))
    if c is not None:
        return c
    from .w4a16 import _sm_count

    return heuristic_config(m, n, k, _sm_count(device))


# ---------------------------------------------------------------------------------------------------
# reference and launch


def reference(x2, weight, bias=None, *, silu: bool = False):
    """The torch form: [M, K] (or [M, 2K] gate | up with silu) -> [M, N] in x2's dtype."""
    import torch.nn.functional as F

    if silu:
        g, u = x2.chunk(2, -1)
        x2 = F.silu(g) * u
    return F.linear(x2, weight, bias)


def launch(x2, weight, config: Config, bias=None, *, silu: bool = False, out=None):
    """Run one config: x2 [M, K] (silu: [M, 2K], gate then up) with contiguous rows, weight [N, K] with
    contiguous rows -> [M, N] in x2's dtype. Under TRITON_INTERPRET=1 this runs on CPU tensors (tests)."""
    import torch

    from . import _gemv_triton as kern
    from .pdl import l2_prefetch_blocks, launch_kwargs
    from .w4a16 import _buffer

    m = x2.shape[0]
    n, k = weight.shape
    if x2.shape[1] != (2 * k if silu else k):
        raise ValueError(f"x has {x2.shape[1]} features; the weight [N={n}, K={k}] expects "
                         f"{2 * k if silu else k}{' (gate | up)' if silu else ''}")
    if not config.valid():
        raise ValueError(f"invalid GEMV config {config}")
    if x2.stride(-1) != 1 or weight.stride(-1) != 1:
        raise ValueError("the GEMV needs rows with unit stride")
    y = out if out is not None else torch.empty(m, n, dtype=x2.dtype, device=x2.device)
    if m == 0 or n == 0:
        return y
    bk = config.block_k
    n_iter = -(-k // bk)
    split = max(1, min(config.split_k, n_iter))
    grid_n = -(-n // config.block_n)
    mb = max(m, MAX_M)  # sized for MAX_M rows so any batch up to it fits what warmup allocated
    ws = _buffer(x2.device, "ws", split * mb * n if split > 1 else 1, torch.float32)
    cnt = _buffer(x2.device, "cnt", grid_n * mb if split > 1 else 1, torch.int32, zero=True)
    if bias is not None and bias.dtype != x2.dtype:
        bias = bias.to(x2.dtype)
    pdl = launch_kwargs(x2.device)
    if pdl["PDL"] and k % bk == 0 and (weight.stride(0) * weight.element_size()) % 16 == 0 \
            and weight.data_ptr() % 16 == 0:  # the bulk L2 prefetch needs 16-byte aligned rows
        pdl["L2PF"] = l2_prefetch_blocks("fp16")
    run_triton(
        kern._gemv_f16_kernel, (grid_n, m, split),
        x2, weight, bias if bias is not None else y, y, ws, cnt, m, n, k, x2.stride(0), weight.stride(0), split,
        BN=config.block_n, BK=bk, HAS_BIAS=bias is not None, EVEN_K=k % bk == 0, SILU=silu,
        PREFETCH=config.prefetch, num_warps=config.num_warps, num_stages=1, **pdl)
    return y


def usable(x2, weight) -> bool:
    """Whether `gemv` runs the kernel for these tensors (CUDA, or any device in Triton's interpreter
    for tests; fp16/bf16; at most MAX_M rows)."""
    import torch

    return ((x2.device.type == "cuda" or _interpreting()) and x2.dim() == 2 and 0 < x2.shape[0] <= MAX_M
            and x2.dtype in (torch.float16, torch.bfloat16) and weight.dtype == x2.dtype
            and x2.stride(-1) == 1 and weight.stride(-1) == 1)


def gemv(x2, weight, bias=None, *, silu: bool = False):
    """y = x2 @ W^T (+ bias), or silu(gate) * up @ W^T with `silu`; the kernel where `usable`, else torch."""
    if not usable(x2, weight):
        return reference(x2, weight, bias, silu=silu)
    n, k = weight.shape
    return launch(x2, weight, select_config(x2.shape[0], n, k, x2.dtype, silu=silu, device=x2.device), bias,
                  silu=silu)


def warmup(weights, m_values, dtype, device=None, *, silu_weights=(), biased=None, silu_biased=None) -> None:
    """Compile the kernels the given batch sizes select and size the shared split-K buffers, so that later
    calls and CUDA-graph capture neither compile nor allocate beyond their outputs. weights: [N, K] tensors
    (one per distinct shape is enough); silu_weights: those called with the fused SiLU·mul prologue
    (down_proj); biased / silu_biased: for each, whether its calls pass a bias (the kernel specializes on
    it), None compiling both variants. The kernels compile several at a time first (`compile_ahead`)."""
    import torch

    calls, seen = [], set()
    for ws, flags, silu in ((weights, biased, False), (silu_weights, silu_biased, True)):
        for w, bias_flags in zip(ws, [(False, True)] * len(ws) if flags is None else [(bool(f),) for f in flags]):
            n, k = w.shape
            dev = torch.device(device) if device is not None else w.device
            for m in m_values:
                for has_bias in bias_flags:
                    if m <= MAX_M and (n, k, m, silu, has_bias) not in seen:
                        seen.add((n, k, m, silu, has_bias))
                        calls.append((w, m, silu, has_bias, dev))

    def call(w, m, silu, has_bias, dev):
        x = torch.zeros(m, 2 * w.shape[1] if silu else w.shape[1], dtype=dtype, device=dev)
        gemv(x, w.to(dtype), torch.zeros(w.shape[0], dtype=dtype, device=dev) if has_bias else None, silu=silu)

    warm(calls, call, gpu=any(c[-1].type == "cuda" for c in calls))
    if device is not None and torch.device(device).type == "cuda":
        torch.cuda.synchronize(device)


def tune(weight, m_values, dtype, *, silu: bool = False, configs=None, warmup_ms: int = 5, rep_ms: int = 20,
         verbose=None, timer=None) -> dict:
    """Time the candidate configs per M (do_bench median, L2 flushed), pin the fastest, return
    {M: [(config, ms), ...]} sorted. `timer(fn) -> ms` replaces do_bench (the CPU smoke run)."""
    import torch

    if timer is None:
        from triton.testing import do_bench

        def timer(fn):
            return do_bench(fn, warmup=warmup_ms, rep=rep_ms, return_mode="median")

    from .w4a16 import _sm_count

    n, k = weight.shape
    results = {}
    for m in m_values:
        x = torch.randn(m, 2 * k if silu else k, dtype=dtype, device=weight.device)
        timed = []
        for cfg in (configs or candidate_configs(m, n, k, _sm_count(weight.device))):
            try:
                launch(x, weight, cfg, silu=silu)
                ms = timer(lambda: launch(x, weight, cfg, silu=silu))
            except Exception as e:  # a config that does not compile or run here is skipped
                if verbose:
                    verbose(f"  skip {cfg}: {type(e).__name__}: {str(e).splitlines()[0][:120]}")
                continue
            timed.append((cfg, ms))
        timed.sort(key=lambda t: t[1])
        if timed and m == 1:
            set_config(n, k, dtype, timed[0][0], silu=silu, device=weight.device)
        results[m] = timed
    return results


def describe(c: Config) -> str:
    return f"bn{c.block_n} bk{c.block_k} sk{c.split_k} w{c.num_warps}{' pf' if c.prefetch else ''}"


__all__ = ["MAX_M", "Config", "candidate_configs", "describe", "gemv", "heuristic_config", "launch",
           "load_tuned", "preferred", "reference", "save_tuned", "select_config", "set_config", "tune", "usable", "warmup"]
