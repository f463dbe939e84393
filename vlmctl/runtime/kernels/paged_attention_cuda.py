"""The decode attention with rotary and KV append in CUDA (`decode_attention.cu`), for small decode batches:
`paged_attention.paged_decode_rope` runs it where `selected` says so, the Triton kernel elsewhere. Same
inputs, outputs and split workspace as the Triton kernel; what differs is when it reads: the step inputs
and the cached K/V tiles are requested before the PDL wait, so only the new token's q/k/v and the
kernel's own arithmetic follow the qkv GEMV (the .cu file says why and what that asks of the caller).

`VLMCTL_ATTN_CUDA`: "0" (default) never; "1" for decode batches up to `MAX_BATCH`; "all" for every batch
(measurements). `VLMCTL_ATTN_CUDA_EARLY`: "1" (default) reads ahead before the wait as described; "0" waits
first (the A/B measurement of reading ahead). Off by default because it has not yet run on a GPU: it was
written in a session without one (docs/benchmarks.md, session 25, says what is to be measured before it may
become the default). With "all" (the measurements' setting), tensors it cannot take are an error, not a
silent fallback, so that a measurement measures it; "1", the setting that would become the default, leaves
them to the Triton kernel (a GQA group above 8, a head size it has no instance for, no NVRTC).
"""

from __future__ import annotations

import os
from pathlib import Path

import torch

SOURCE = Path(__file__).with_name("decode_attention.cu")
_TEXT: list[str] = []
MODES = ("0", "1", "all")
# rows per step up to which "1" takes this kernel: the batches whose attention is a latency chain (at 8 and
# more the Triton kernel's tensor-core dots and fewer splits already read the KV at a good share of the bandwidth)
MAX_BATCH = 8
MAX_GROUP = 8  # q heads per KV head held in registers
MAX_SPLITS = 32  # as the .cu file's MAX_SPLITS (`paged_attention.choose_splits` gives at most 32)


def source() -> str:
    if not _TEXT:
        _TEXT.append(SOURCE.read_text())
    return _TEXT[0]


def mode() -> str:
    m = os.environ.get("VLMCTL_ATTN_CUDA", "0").strip().lower() or "0"
    m = {"off": "0", "on": "1", "false": "0", "true": "1"}.get(m, m)
    if m not in MODES:
        raise ValueError(f"VLMCTL_ATTN_CUDA={m!r}: expected 0, 1 or all")
    return m


def reads_early() -> bool:
    """`VLMCTL_ATTN_CUDA_EARLY`: whether the kernel reads its step inputs and starts its K/V copies before the PDL
    wait ("1", the default) or after it ("0"). Session 21 saw a Triton build that loaded its first tile before the
    wait slow the decode step down (its programs held SM slots the qkv GEMV's last blocks needed), so the
    measurement compares both."""
    v = os.environ.get("VLMCTL_ATTN_CUDA_EARLY", "1").strip()
    if v not in ("0", "1"):
        raise ValueError(f"VLMCTL_ATTN_CUDA_EARLY={v!r}: expected 0 or 1")
    return v == "1"


def kernel_name(head_dim: int, group: int, dtype: torch.dtype, early: bool | None = None) -> str:
    """The template instance for a head size (32, 64, 128 or 256), a GQA group (1-8), fp16/bf16 and where it
    waits (`reads_early`, from the environment unless given)."""
    gp = 1 << (group - 1).bit_length()
    early = reads_early() if early is None else early
    return f"decode_attention_rope<{head_dim // 32}, {gp}, {int(dtype == torch.bfloat16)}, {int(early)}>"


def unsupported(qkv: torch.Tensor, cos_sin: torch.Tensor, positions: torch.Tensor, slots: torch.Tensor,
                k_cache: torch.Tensor, v_cache: torch.Tensor, block_tables: torch.Tensor,
                context_lens: torch.Tensor, n_q: int, n_kv: int, num_splits: int = 1) -> str | None:
    """Why the kernel cannot take these tensors, or None where it can."""
    from . import cuda_rtc

    d = k_cache.shape[-1]
    if num_splits > MAX_SPLITS:
        return f"{num_splits} context splits (at most {MAX_SPLITS})"
    if qkv.device.type != "cuda":
        return "not a CUDA tensor"
    if torch.cuda.get_device_capability(qkv.device) < (8, 0):
        return "needs sm_80 or later (cp.async)"
    if not cuda_rtc.available():
        return "NVRTC not found"
    if qkv.dtype not in (torch.float16, torch.bfloat16) or k_cache.dtype != qkv.dtype or v_cache.dtype != qkv.dtype:
        return f"activations and caches in fp16 or bf16 (got {qkv.dtype}, {k_cache.dtype})"
    if d not in (32, 64, 128, 256):
        return f"head size {d}"
    if n_q % n_kv or n_q // n_kv > MAX_GROUP:
        return f"{n_q // max(n_kv, 1)} q heads per KV head (at most {MAX_GROUP})"
    if cos_sin.dtype != torch.float32 or cos_sin.stride(-1) != 1:
        return "a float32 rotary table with contiguous rows"
    if positions.dtype not in (torch.int32, torch.int64) or slots.dtype not in (torch.int32, torch.int64):
        return "int32 or int64 positions and slots"
    if any(t.dim() != 1 or (t.numel() > 1 and t.stride(0) != 1) for t in (positions, slots, context_lens)):
        return "contiguous 1-D positions, slots and context lengths"
    if block_tables.dtype != torch.int32 or context_lens.dtype != torch.int32 or block_tables.stride(-1) != 1:
        return "int32 block tables (contiguous rows) and context lengths"
    for name, t in (("k_cache", k_cache), ("v_cache", v_cache)):
        if t.stride(-1) != 1 or t.data_ptr() % 16 or any(s % 8 for s in t.stride()[:-1]):
            return f"{name} rows 16-byte aligned"
    if qkv.stride(-1) != 1 or qkv.data_ptr() % 16 or qkv.stride(0) % 8:
        return "qkv rows 16-byte aligned"
    return None


def selected(qkv: torch.Tensor, *tensors, n_q: int, n_kv: int, num_splits: int = 1) -> bool:
    """Whether `paged_decode_rope` takes this kernel for these tensors (`VLMCTL_ATTN_CUDA`); with "all" where it
    cannot run, an error; with "1", the Triton kernel."""
    m = mode()
    if m == "0" or (m == "1" and qkv.shape[0] > MAX_BATCH):
        return False
    why = unsupported(qkv, *tensors, n_q=n_q, n_kv=n_kv, num_splits=num_splits)
    if why is not None and m == "all":
        raise ValueError(f"VLMCTL_ATTN_CUDA=all, but the CUDA decode attention cannot run here: {why}")
    return why is None


def decode_rope(qkv, cos_sin, positions, slots, k_cache, v_cache, block_tables, context_lens, out, part, ml, cnt,
                scale: float, n_q: int, n_kv: int, num_splits: int, window: int | None) -> torch.Tensor:
    """Launch the kernel into `out` [B, n_q, d]; with num_splits > 1, part / ml / cnt are the split workspace
    (`paged_attention.split_workspace`: the counters zero before and after)."""
    from . import cuda_rtc, pdl
    from .compile_ahead import compiling_only

    B = qkv.shape[0]
    d = k_cache.shape[-1]
    group = n_q // n_kv
    kern = cuda_rtc.load_kernel(source(), kernel_name(d, group, qkv.dtype), qkv.device)
    if compiling_only() or B == 0:  # the load's compile pass: the kernel is compiled and loaded, not run
        return out
    split = num_splits > 1
    if split and cnt is None:
        raise ValueError("the CUDA decode attention combines its splits itself: pass the workspace with counters")
    gp = 1 << (group - 1).bit_length()
    ring = 4 * 16 * d * 2 * 2  # STAGES x T x d x (K, V) x 2 bytes
    merge = 4 * gp * d * 4 + 2 * 4 * gp * 4
    kern.launch((B, n_kv, num_splits), (128, 1, 1), max(ring, merge),
                [qkv, cos_sin, positions, slots, k_cache, v_cache, block_tables, context_lens, out,
                 part if split else None, ml if split else None, cnt if split else None,
                 qkv.stride(0), cos_sin.stride(0), k_cache.stride(0), k_cache.stride(1), k_cache.stride(2),
                 block_tables.stride(0), out.stride(0), out.stride(1), float(scale * 1.4426950408889634),
                 k_cache.shape[1], group, num_splits, n_q, n_kv, int(window or 0),
                 int(positions.dtype == torch.int64), int(slots.dtype == torch.int64)],
                qkv.device, pdl=pdl.enabled(qkv.device))
    return out


__all__ = ["MAX_BATCH", "decode_rope", "kernel_name", "mode", "reads_early", "selected", "source", "unsupported"]
