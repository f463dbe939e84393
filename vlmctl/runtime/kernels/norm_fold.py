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

So a batch-1 step has no norm kernels but the final one. `VLMCTL_NORM_FOLD=1` folds them so, `2` the other way
(`mode`); the default, 0, keeps the norm kernels: folded, the step measured slower so far. Where any of a decoder's batch-1 linears is not the CUDA GEMV (bf16, no NVRTC, a tuned table that picks
another kernel), the decoder keeps them too (`fold_configs` returns None).
"""

from __future__ import annotations

import os

import torch

from ...errors import OptionError
from . import w4a16 as W

# dynamic shared memory a block may use without opting in; the row and the norm's weight take 4 K bytes
_SHARED_DEFAULT = 48 * 1024


def mode() -> str:
    """`VLMCTL_NORM_FOLD`: "0" (the default) the norm kernels; "1" each folded GEMV block normalizes the row in shared
    memory; "2" the GEMV before a norm prepares the next one's input (w4a16_gemv_add / w4a16_gemv_scaled). Off by
    default: the first GPU run of "1" made the AWQ batch-1 step slower (docs/benchmarks.md, session 36)."""
    v = os.environ.get("VLMCTL_NORM_FOLD", "0").strip().lower()
    v = {"on": "1", "true": "1", "off": "0", "false": "0"}.get(v, v)
    if v not in ("0", "1", "2"):
        raise OptionError(f"VLMCTL_NORM_FOLD={v!r}: expected 0 (the default), 1 or 2")
    return v


def enabled() -> bool:
    """Whether the batch-1 step's RMSNorms are folded into its GEMVs where the decoder can (`mode`)."""
    return mode() != "0"


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


def add_prepare_kernel_name(config: W.Config, group_size: int, one_plus: bool = False) -> str:
    rpw = config.block_n // config.num_warps
    return f"w4a16_gemv_add<{rpw}, {config.num_warps}, {config.num_stages}, {group_size}, {int(one_plus)}>"


def scaled_kernel_name(config: W.Config, group_size: int, act: str | None = None) -> str:
    from .fused import ACTIVATIONS

    rpw = config.block_n // config.num_warps
    a = ACTIVATIONS[act] if act is not None else -1
    return f"w4a16_gemv_scaled<{rpw}, {config.num_warps}, {config.num_stages}, {group_size}, {a}>"


def partial_count(config: W.Config, n: int) -> int:
    """How many partial sums of squares `add_prepare` writes a row: one per warp."""
    return W.triton_cdiv(n, config.block_n) * config.num_warps


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


def add_prepare(x: torch.Tensor, packed: dict, group_size: int, config: W.Config, residual: torch.Tensor,
                norm_weight: torch.Tensor, u: torch.Tensor, part: torch.Tensor, one_plus: bool = False,
                bias: torch.Tensor | None = None) -> None:
    """`add_linear`, and for the norm after it: u = residual * norm_weight (fp16; `one_plus`: * (1 + w)) and
    `partial_count` partial sums of residual^2 a row into part (float32)."""
    from . import cuda_rtc, pdl

    qw, s, z = (packed[key] for key in W.KEYS)
    m, k = x.shape
    n = qw.shape[0]
    _check_row(x, k)
    if residual.shape != (m, n) or not residual.is_contiguous() or u.shape != (m, n) or not u.is_contiguous():
        raise ValueError(f"the residual and u must be contiguous fp16 [{m}, {n}]")
    if part.dtype != torch.float32 or part.numel() < m * partial_count(config, n):
        raise ValueError(f"part must hold {m * partial_count(config, n)} float32")
    if W.compiling_only():
        return
    kern = cuda_rtc.load_kernel(W.mma_source(), add_prepare_kernel_name(config, group_size, one_plus), x.device)
    kern.launch((W.triton_cdiv(n, config.block_n), m, 1), (32 * config.num_warps, 1, 1), 0,
                [x, qw, s, z, bias, residual, n, k, x.stride(0), int(bias is not None), norm_weight, u, part],
                x.device, pdl=pdl.enabled(x.device))


def scaled_linear(u: torch.Tensor, packed: dict, group_size: int, config: W.Config, part: torch.Tensor, count: int,
                  eps: float, bias: torch.Tensor | None = None, act: str | None = None,
                  out: torch.Tensor | None = None) -> torch.Tensor:
    """linear(u) * rsqrt(sum of the `count` partial sums a row in part / K + eps) (+ bias; `act`: act(gate) * up of
    a gate_up weight): the linear after a norm whose input `add_prepare` (or `prepare`) made."""
    from . import cuda_rtc, pdl

    qw, s, z = (packed[key] for key in W.KEYS)
    m, k = u.shape
    n = qw.shape[0]
    _check_row(u, k)
    n_out, rows = (n // 2, config.block_n // 2) if act is not None else (n, config.block_n)
    y = out if out is not None else torch.empty(m, n_out, dtype=u.dtype, device=u.device)
    if W.compiling_only():
        return y
    kern = cuda_rtc.load_kernel(W.mma_source(), scaled_kernel_name(config, group_size, act), u.device)
    kern.launch((W.triton_cdiv(n_out, rows), m, 1), (32 * config.num_warps, 1, 1), 0,
                [u, qw, s, z, bias, y, n, k, u.stride(0), int(bias is not None), part, count, float(eps)], u.device,
                pdl=pdl.enabled(u.device))
    return y


def prepare(x: torch.Tensor, norm_weight: torch.Tensor, u: torch.Tensor, part: torch.Tensor,
            one_plus: bool = False) -> None:
    """What `add_prepare` leaves for the first layer's norm, from the embedding rows x: u = x * w, and one partial
    sum of squares a row (torch ops, once a step)."""
    xf = x.float()
    torch.mul(xf, (1.0 + norm_weight.float()) if one_plus else norm_weight.float(), out=xf)
    u.copy_(xf)
    part[:x.shape[0]].copy_(x.float().square().sum(-1))


def precompile(names, device) -> int:
    """Compile these kernels (`norm_kernel_name`, `add_kernel_name`) into NVRTC's on-disk cache, several at a
    time; returns how many."""
    from . import cuda_rtc

    device = torch.device(device)
    if device.type != "cuda" or not cuda_rtc.available() or not names:
        return 0
    major, minor = W._capability(device)
    return cuda_rtc.precompile(W.mma_source(), sorted(set(names)), f"sm_{major}{minor}")
