"""The W4A16 kernels' packed layout of 4-bit AWQ linears, as stored in an engine's `weights.safetensors`.

An on-disk contract between `build-llm` (export/torch_decoder.py repacks AutoAWQ GEMM checkpoints
into it at build time) and the runtime (runtime/kernels/w4a16.py computes with it). Here: the
layout, its exact pack / unpack / repack from AutoAWQ's GEMM layout (formats/awq_gemm.py), and the
float32 reference dequantization. Not here: the kernels and their launch configurations.

Packed layout (a dict of three tensors; W is the nn.Linear weight [N, K] = [out, in], group size G):
  q4weight  int32 [N, K/8]   word (n, j) holds the codes of W[n, 8j .. 8j+7]: the code of
                             k = 8j + 2t + e in bits 4t+16e .. 4t+16e+3 (t = 0..3, e = 0..1), i.e.
                             nibble i holds k = 8j + ORDER[i], ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
  q4scales  fp16  [N, K/G]   per-group scale
  q4zeros   uint8 [N, K/G]   per-group zero point (0..15)
  W[n, k] = (code[n, k] - q4zeros[n, k // G]) * q4scales[n, k // G]

Why this layout: a row's K runs contiguously, so a GEMV program streams whole lines along K for
each of its rows; words never straddle a group (G is a multiple of 8), so scales and zero points are
loaded once per (row, group) and applied to whole words. The nibble order inside a word is
AutoAWQ's interleave, applied along K instead of N: `(word >> 4t) & 0x000F000F` puts the codes of
one consecutive pair of k into the two 16-bit halves, which OR 0x64006400 turns into two fp16
numbers (1024 + code) for packed half2 arithmetic. Row-major [N, ...] for all three tensors
means fused linears (qkv, gate_up) are plain concatenations along dim 0, as in AutoAWQ's layout.
Zero points stay integer codes rather than a pre-multiplied fp16 `-zero*scale`: the kernels convert
codes to floats with a magic-number OR and one subtraction (no int->float instruction), and folding
the zero point into that subtraction costs nothing, while an fp16 `-zero*scale` would add a
rounding (it is not exact) and take 2 bytes per group instead of 1.
The layout's name, for engine metadata, is `FORMAT`.
"""

from __future__ import annotations

FORMAT = "w4a16-nk/1"
KEYS = ("q4weight", "q4scales", "q4zeros")
PACK = 8  # codes per int32 word
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)  # nibble i of a word holds k offset ORDER[i]
_SHIFT = tuple(4 * (o // 2) + 16 * (o % 2) for o in range(PACK))  # bit position of k offset o
_REPACK_CHUNK_ELEMS = 1 << 22  # codes per repack chunk / 8: bounds its int64 intermediates to ~256 MB


def _check_group(k: int, group_size: int) -> None:
    if group_size <= 0 or group_size % PACK or k % group_size:
        raise ValueError(f"group size {group_size} must be a positive multiple of {PACK} that divides K={k}")


def _words_from_codes(codes):
    """int tensor [R, K] of 0..15 -> int32 [R, K/8] in the layout's nibble order."""
    import torch

    r, k = codes.shape
    shifts = torch.tensor(_SHIFT, dtype=torch.int64, device=codes.device)
    words = (codes.to(torch.int64).view(r, k // PACK, PACK) << shifts).sum(-1)
    # reinterpret the unsigned 32-bit value as int32 (two's complement)
    return torch.where(words >= 1 << 31, words - (1 << 32), words).to(torch.int32)


def _codes_from_words(words):
    """int32 [R, K/8] -> int32 [R, K] codes."""
    import torch

    shifts = torch.tensor(_SHIFT, dtype=torch.int32, device=words.device)
    return ((words[:, :, None] >> shifts) & 0xF).reshape(words.shape[0], -1)


def pack(codes, zeros, scales, group_size: int) -> dict:
    """Pack integer codes [N, K] (0..15), zero points [N, K/G] (0..15) and scales [N, K/G] into the layout."""
    import torch

    if codes.dim() != 2 or codes.shape[1] % PACK:
        raise ValueError(f"codes must be [N, K] with K a multiple of {PACK}, got {tuple(codes.shape)}")
    n, k = codes.shape
    _check_group(k, group_size)
    if tuple(zeros.shape) != (n, k // group_size) or tuple(scales.shape) != (n, k // group_size):
        raise ValueError(f"zeros {tuple(zeros.shape)} and scales {tuple(scales.shape)} must be {(n, k // group_size)}")
    for name, t in (("codes", codes), ("zeros", zeros)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > 15):
            raise ValueError(f"{name} must lie in [0, 15]")
    chunk = max(1, (1 << 24) // max(k, 1))  # bound the int64 intermediate to ~128 MB
    words = torch.cat([_words_from_codes(codes[i:i + chunk]) for i in range(0, n, chunk)]) if n else \
        torch.empty(0, k // PACK, dtype=torch.int32, device=codes.device)
    return {"q4weight": words.contiguous(), "q4scales": scales.to(torch.float16).contiguous(),
            "q4zeros": zeros.to(torch.uint8).contiguous()}


def unpack(packed: dict):
    """Inverse of `pack`: (codes int32 [N, K], zeros int32 [N, K/G], scales fp16 [N, K/G])."""
    import torch

    return _codes_from_words(packed["q4weight"]), packed["q4zeros"].to(torch.int32), packed["q4scales"]


def check_packed(packed: dict, group_size: int) -> tuple[int, int]:
    """Validate names, dtypes and shapes; return (N, K)."""
    import torch

    missing = [k for k in KEYS if k not in packed]
    if missing:
        raise ValueError(f"packed W4A16 weight lacks {missing}")
    qw, s, z = (packed[k] for k in KEYS)
    if qw.dtype != torch.int32 or qw.dim() != 2:
        raise ValueError(f"q4weight must be int32 [N, K/8], got {qw.dtype} {tuple(qw.shape)}")
    n, k = qw.shape[0], qw.shape[1] * PACK
    _check_group(k, group_size)
    if s.dtype != torch.float16 or tuple(s.shape) != (n, k // group_size):
        raise ValueError(f"q4scales must be float16 {(n, k // group_size)}, got {s.dtype} {tuple(s.shape)}")
    if z.dtype != torch.uint8 or tuple(z.shape) != (n, k // group_size):
        raise ValueError(f"q4zeros must be uint8 {(n, k // group_size)}, got {z.dtype} {tuple(z.shape)}")
    return n, k


def repack_awq_gemm(qweight, qzeros, scales, group_size: int) -> dict:
    """AutoAWQ GEMM tensors (qweight int32 [K, N/8], qzeros int32 [K/G, N/8], scales fp16 [K/G, N]) -> layout.

    Exact: `dequantize(result)` equals `awq_gemm.dequantize_gemm(...)` bit for bit. Works
    on any device (the CPU at build time). A fused linear whose AutoAWQ tensors were concatenated
    along the output axis repacks to the concatenation (along dim 0) of its parts' repacks.
    """
    import torch

    from .awq_gemm import unpack_gemm

    if qweight.dim() != 2 or qzeros.dim() != 2 or scales.dim() != 2:
        raise ValueError("AutoAWQ GEMM tensors must be 2-D")
    k, n = qweight.shape[0], qweight.shape[1] * PACK
    _check_group(k, group_size)
    if tuple(qzeros.shape) != (k // group_size, n // PACK) or tuple(scales.shape) != (k // group_size, n):
        raise ValueError(f"inconsistent AutoAWQ GEMM tensors: qweight {tuple(qweight.shape)}, qzeros "
                         f"{tuple(qzeros.shape)}, scales {tuple(scales.shape)} with group size {group_size}")
    out = {"q4weight": [], "q4zeros": []}
    step = max(1, _REPACK_CHUNK_ELEMS // max(k, 1)) * PACK  # output columns per chunk
    for c0 in range(0, n, step):
        w0, w1 = c0 // PACK, min(n, c0 + step) // PACK
        codes, zeros = unpack_gemm(qweight[:, w0:w1], qzeros[:, w0:w1])  # [cols, K], [cols, K/G]
        out["q4weight"].append(_words_from_codes(codes))
        out["q4zeros"].append(zeros.to(torch.uint8))
    empty = n == 0
    return {"q4weight": torch.cat(out["q4weight"]).contiguous() if not empty else
            torch.empty(0, k // PACK, dtype=torch.int32, device=qweight.device),
            "q4scales": scales.t().to(torch.float16).contiguous(),
            "q4zeros": torch.cat(out["q4zeros"]).contiguous() if not empty else
            torch.empty(0, k // group_size, dtype=torch.uint8, device=qweight.device)}


def dequantize(packed: dict, group_size: int, dtype=None):
    """Reference: the dense weight [N, K] (float32 unless `dtype`), exact before the final cast."""
    import torch

    n, k = check_packed(packed, group_size)
    qw, s, z = (packed[key] for key in KEYS)
    out = torch.empty(n, k, dtype=torch.float32, device=qw.device)
    chunk = max(1, (1 << 23) // max(k, 1))
    for r in range(0, n, chunk):
        codes = _codes_from_words(qw[r:r + chunk]).view(-1, k // group_size, group_size)
        zr = z[r:r + chunk].to(torch.float32)[:, :, None]
        sr = s[r:r + chunk].to(torch.float32)[:, :, None]
        out[r:r + chunk] = ((codes.to(torch.float32) - zr) * sr).view(-1, k)
    return out if dtype is None else out.to(dtype)


def repack_gemm_tensors(spec, tensors: dict):
    """(spec, runtime tensors) with every AutoAWQ GEMM linear (`.qweight/.qzeros/.scales`, fused along
    the output axis) repacked into this layout (`.q4weight/.q4scales/.q4zeros`); the spec records it.
    `spec` is a formats.torch_layout.DecoderSpec."""
    from dataclasses import replace

    group = spec.quantization["group_size"]
    out = {}
    for name, t in tensors.items():
        if name.endswith(".qweight"):
            base = name[:-len(".qweight")]
            packed = repack_awq_gemm(t, tensors[f"{base}.qzeros"], tensors[f"{base}.scales"], group)
            out.update({f"{base}.{k}": v for k, v in packed.items()})
        elif not name.endswith((".qzeros", ".scales")):
            out[name] = t
    return replace(spec, quantization={**spec.quantization, "layout": FORMAT}), out


def weight_bytes(n: int, k: int, group_size: int) -> int:
    """Bytes a linear's packed weight occupies (and a GEMV reads): codes, fp16 scales, uint8 zero points."""
    return n * k // 2 + n * (k // group_size) * 3
