"""AutoAWQ "GEMM" checkpoints: the format transformers, vLLM, TensorRT-LLM and AutoAWQ itself read.

Two halves of one contract, both here:
- the `quantization_config` of config.json, read and written only through `AwqGemmConfig`;
- the packing of 4-bit weights into int32 words holding 8 nibbles, in AutoAWQ's nibble order.

Layout (nn.Linear weight W is [out, in], group size g):
  qweight int32 [in, out/8]    word (i, j) holds W's integer codes for input i, outputs 8j..8j+7
  qzeros  int32 [in/g, out/8]  the same packing of the per-group zero points
  scales  fp16  [in/g, out]
and W[o, i] = (code[o, i] - zero[o, i // g]) * scale[i // g, o].

Inside a word, nibble k (bits 4k..4k+3) holds output column 8j + ORDER[k] with
ORDER = (0, 2, 4, 6, 1, 3, 5, 7): the interleave AutoAWQ's CUDA kernels expect. Each run of 8
output columns is packed on its own, so packed linears can be concatenated along the output axis.

Not here: the runtime kernel's own packed layout (formats/w4a16.py), the quantizer (quant/).
"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CheckpointError

BITS = 4


def quantization_method(config: dict) -> str | None:
    """The `quant_method` a HF config declares for its weights (None: a float checkpoint; "?" when the
    config has a quantization_config without a method)."""
    q = config.get("quantization_config")
    if not q:
        return None
    return str(q.get("quant_method", "?")) if isinstance(q, dict) else "?"


def without_quantization(config: dict) -> dict:
    """A config dict minus its `quantization_config`: an AWQ whole-VLM config describes the decoder's
    packing, not the architecture that transformers' config classes parse."""
    return {k: v for k, v in config.items() if k != "quantization_config"}


@dataclass(frozen=True)
class AwqGemmConfig:
    bits: int
    group_size: int
    zero_point: bool = True
    modules_to_not_convert: tuple[str, ...] = ()

    @classmethod
    def from_config(cls, config: dict, where: str = "config.json") -> "AwqGemmConfig | None":
        """The AWQ settings of a HF config dict; None for a float checkpoint; CheckpointError otherwise."""
        q = config.get("quantization_config")
        if q is None:
            return None
        if q.get("quant_method") != "awq":
            raise CheckpointError(f"{where}: quantization {q.get('quant_method')!r} is not supported (only awq)")
        if str(q.get("version", "gemm")).lower() != "gemm":
            raise CheckpointError(f"{where}: AWQ version {q.get('version')!r} is not supported (only gemm)")
        bits = int(q.get("bits", q.get("w_bit", BITS)))
        if bits != BITS:
            raise CheckpointError(f"{where}: AWQ with {bits} bits is not supported (only {BITS})")
        return cls(bits=bits, group_size=int(q.get("group_size", q.get("q_group_size", 128))),
                   zero_point=bool(q.get("zero_point", True)),
                   modules_to_not_convert=tuple(q.get("modules_to_not_convert") or ()))

    def to_config(self) -> dict:
        """The `quantization_config` dict, as AutoAWQ writes it (`modules_to_not_convert` null when empty)."""
        return {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size, "zero_point": self.zero_point,
                "version": "gemm", "modules_to_not_convert": list(self.modules_to_not_convert) or None}

    def apply_to(self, config: dict) -> dict:
        """A copy of a HF config dict that declares these AWQ settings."""
        return {**config, "quantization_config": self.to_config()}


# ---- nibble packing ------------------------------------------------------------------------------
# nibble k of a word holds column ORDER[k] of its 8-column run
ORDER = (0, 2, 4, 6, 1, 3, 5, 7)
PACK = 8  # 4-bit values per int32


def _check_bits(bits: int) -> None:
    if bits != 4:
        raise ValueError(f"only 4-bit packing is supported (got bits={bits})")


def _pack_cols(values):
    """int tensor [rows, cols] with values in [0, 15] -> int32 [rows, cols/8]."""
    import torch

    rows, cols = values.shape
    if cols % PACK:
        raise ValueError(f"cannot pack {cols} columns: not a multiple of {PACK}")
    v = values.to(torch.int64).view(rows, cols // PACK, PACK)[:, :, list(ORDER)]
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=values.device)
    words = (v << shifts).sum(-1)  # < 2**32, fits in int64
    # reinterpret the unsigned 32-bit value as int32 (two's complement)
    words = torch.where(words >= 1 << 31, words - (1 << 32), words)
    return words.to(torch.int32)


def _unpack_cols(words):
    """int32 [rows, n] -> int64 [rows, n*8] nibbles in column order."""
    import torch

    rows, n = words.shape
    shifts = torch.arange(0, 32, 4, dtype=torch.int64, device=words.device)
    nib = (words.to(torch.int64)[:, :, None] >> shifts) & 0xF  # nibble k at [..., k]
    inverse = [ORDER.index(c) for c in range(PACK)]  # column c lives in nibble inverse[c]
    return nib[:, :, inverse].reshape(rows, n * PACK)


def pack_gemm(intweight, zeros, bits: int = 4):
    """(codes [out, in], zero points [out, in/g]) -> (qweight int32 [in, out/8], qzeros int32 [in/g, out/8])."""
    _check_bits(bits)
    if intweight.dim() != 2 or zeros.dim() != 2 or intweight.shape[0] != zeros.shape[0]:
        raise ValueError(f"expected codes [out, in] and zeros [out, in/g], got {tuple(intweight.shape)} "
                         f"and {tuple(zeros.shape)}")
    for name, t in (("codes", intweight), ("zeros", zeros)):
        if t.numel() and (int(t.min()) < 0 or int(t.max()) > 15):
            raise ValueError(f"{name} must lie in [0, 15] for 4-bit packing")
    return _pack_cols(intweight.t().contiguous()), _pack_cols(zeros.t().contiguous())


def unpack_gemm(qweight, qzeros, bits: int = 4):
    """Inverse of `pack_gemm`: -> (codes int64 [out, in], zeros int64 [out, in/g])."""
    _check_bits(bits)
    return _unpack_cols(qweight).t().contiguous(), _unpack_cols(qzeros).t().contiguous()


def dequantize_gemm(qweight, qzeros, scales, bits: int = 4, group_size: int = 128):
    """Float weight [out, in] (nn.Linear layout, float32) of a packed GEMM linear.

    The products (code - zero) * scale are exact in float32 (4-bit integer times an fp16 scale);
    `.half()` of the result equals AutoAWQ's own fp16 dequantization bit for bit.
    """
    import torch

    _check_bits(bits)
    codes = _unpack_cols(qweight)  # [in, out]
    zeros = _unpack_cols(qzeros)  # [in/g, out]
    n_in = codes.shape[0]
    if n_in % group_size or zeros.shape[0] * group_size != n_in or scales.shape != zeros.shape:
        raise ValueError(f"inconsistent GEMM tensors: qweight {tuple(qweight.shape)}, qzeros {tuple(qzeros.shape)}, "
                         f"scales {tuple(scales.shape)} with group size {group_size}")
    diff = (codes.view(n_in // group_size, group_size, -1) - zeros[:, None, :]).to(torch.float32)
    w = diff * scales.to(torch.float32)[:, None, :]
    return w.reshape(n_in, -1).t().contiguous()
