"""The batch-1 decode step's RMSNorms folded into the CUDA GEMVs around them (`w4a16_mma.cu`).

A plain decoder layer at one row runs norm -> qkv, attention, o, add + norm -> gate_up (act·mul), down, add +
norm. Each norm is a kernel of its own on one SM, and the GEMV after it cannot start its x loads before that
kernel ends: a latency-bound link in the chain of dependent kernels that a batch-1 step is
(docs/benchmarks.md, sessions 33 and 35: the 65 norms added 0.07-0.17 ms to a ~2 ms AWQ step). Folded:

- o and down add their output into the residual stream in their epilogue (`w4a16_gemv<..., ADD = 1>`: the
  output rounded to fp16, then the sum rounded, as the norm kernel's residual add rounds them), and
- qkv and gate_up (with its act·mul epilogue) normalize the residual row themselves, each block its own copy in
  shared memory (`w4a16_gemv_norm`), rounded as `kernels/fused.py`'s norm kernel rounds; only the order of the
  sum of squares differs.

So a batch-1 step has no norm kernels but the final one. `VLMCTL_NORM_FOLD=0` keeps the norm kernels (for A/B
runs). Where any of a decoder's batch-1 linears is not the CUDA GEMV (bf16, no NVRTC, a tuned table that picks
another kernel), the decoder keeps them too (`fold_configs` returns None).
"""

from __future__ import annotations

import os

import torch

from ...errors import OptionError
from . import w4a16 as W

# dynamic shared memory a block may use without opting in; the row and the norm's weight take 4 K bytes
_SHARED_DEFAULT = 48 * 1024


def enabled() -> bool:
    """`VLMCTL_NORM_FOLD` (default 1): fold the batch-1 step's RMSNorms into its GEMVs where the decoder can."""
    v = os.environ.get("VLMCTL_NORM_FOLD", "1").strip().lower()
    if v not in ("0", "1", "on", "off", "true", "false"):
        raise OptionError(f"VLMCTL_NORM_FOLD={v!r}: expected 1 (the default) or 0")
    return v in ("1", "on", "true")


def shared_bytes(k: int, config: W.Config) -> int:
    """`w4a16_gemv_norm`'s dynamic shared memory: the row and the norm's weight (fp16), the warps' sums."""
    return 4 * k + 4 * config.num_warps


def fold_config(packed: dict, group_size: int, device, act: str | None = None) -> W.Config | None:
    """The CUDA GEMV config that a one-row call of this linear selects (with `act`: the fused gate_up's), or None
    where selection picks another kernel or the folded kernel cannot take it."""
    qw = packed["q4weight"]
    n, k = qw.shape[0], qw.shape[1] * W.PACK
    c = W.select_config(1, n, k, group_size, torch.float16, device, act_mul=act is not None)
    if c.kernel != "gemv_cuda" or not c.valid_for(n, k, group_size) or k % 8:
        return None
    if act is not None and (n % 2 or not W._act_mul_tiles(c)):
        return None
    if shared_bytes(k, c) > _SHARED_DEFAULT:
        return None
    return c


def norm_kernel_name(config: W.Config, group_size: int, act: str | None = None, one_plus: bool = False) -> str:
    from .fused import ACTIVATIONS

    rpw = config.block_n // config.num_warps
    a = ACTIVATIONS[act] if act is not None else -1
    return (f"w4a16_gemv_norm<{rpw}, {config.num_warps}, {config.num_stages}, {group_size}, {a}, "
            f"{int(one_plus)}>")


def add_kernel_name(config: W.Config, group_size: int) -> str:
    rpw = config.block_n // config.num_warps
    return f"w4a16_gemv<{rpw}, {config.num_warps}, {config.num_stages}, {group_size}, -1, 1>"


def _check_row(x: torch.Tensor, k: int) -> None:
    if x.dim() != 2 or x.shape[1] != k or x.dtype != torch.float16 or x.stride(1) != 1 or x.stride(0) % 8 \
            or x.data_ptr() % 16:
        raise ValueError(f"expected fp16 rows [M, {k}] with 16-byte aligned rows, not {tuple(x.shape)} {x.dtype}")


def norm_linear(x: torch.Tensor, packed: dict, group_size: int, config: W.Config, norm_weight: torch.Tensor,
                eps: float, one_plus: bool = False, bias: torch.Tensor | None = None, act: str | None = None,
                out: torch.Tensor | None = None) -> torch.Tensor:
    """linear(RMSNorm(x)) for fp16 rows x [M, K] (the residual stream, left as it is) -> [M, N], or with `act`
    (a gate_up weight) act(gate) * up [M, N / 2]; `config` from `fold_config`."""
    from . import cuda_rtc, pdl

    qw, s, z = (packed[key] for key in W.KEYS)
    m, k = x.shape
    n = qw.shape[0]
    _check_row(x, k)
    n_out, rows = (n // 2, config.block_n // 2) if act is not None else (n, config.block_n)
    y = out if out is not None else torch.empty(m, n_out, dtype=x.dtype, device=x.device)
    if W.compiling_only():
        return y  # (the compile pass: `precompile` builds it)
    kern = cuda_rtc.load_kernel(W.mma_source(), norm_kernel_name(config, group_size, act, one_plus), x.device)
    kern.launch((W.triton_cdiv(n_out, rows), m, 1), (32 * config.num_warps, 1, 1), shared_bytes(k, config),
                [x, qw, s, z, bias, y, n, k, x.stride(0), int(bias is not None), norm_weight, float(eps)], x.device,
                pdl=pdl.enabled(x.device))
    return y


def add_linear(x: torch.Tensor, packed: dict, group_size: int, config: W.Config, residual: torch.Tensor,
               bias: torch.Tensor | None = None) -> torch.Tensor:
    """residual += linear(x) (fp16: the linear's output rounded, then the sum) for rows x [M, K], residual [M, N]
    contiguous; `config` from `fold_config`. Returns residual."""
    from . import cuda_rtc, pdl

    qw, s, z = (packed[key] for key in W.KEYS)
    m, k = x.shape
    n = qw.shape[0]
    _check_row(x, k)
    if residual.shape != (m, n) or not residual.is_contiguous() or residual.dtype != torch.float16:
        raise ValueError(f"the residual must be contiguous fp16 [{m}, {n}], not {tuple(residual.shape)}")
    if W.compiling_only():
        return residual
    kern = cuda_rtc.load_kernel(W.mma_source(), add_kernel_name(config, group_size), x.device)
    kern.launch((W.triton_cdiv(n, config.block_n), m, 1), (32 * config.num_warps, 1, 1), 0,
                [x, qw, s, z, bias, residual, n, k, x.stride(0), int(bias is not None)], x.device,
                pdl=pdl.enabled(x.device))
    return residual


def precompile(names, device) -> int:
    """Compile these kernels (`norm_kernel_name`, `add_kernel_name`) into NVRTC's on-disk cache, several at a
    time; returns how many."""
    from . import cuda_rtc

    device = torch.device(device)
    if device.type != "cuda" or not cuda_rtc.available() or not names:
        return 0
    major, minor = W._capability(device)
    return cuda_rtc.precompile(W.mma_source(), sorted(set(names)), f"sm_{major}{minor}")
