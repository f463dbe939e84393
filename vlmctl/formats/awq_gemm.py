"""AutoAWQ "GEMM" checkpoints: the `quantization_config` that transformers, vLLM and TensorRT-LLM
read, in one typed reader. (The nibble packing itself is `vlmctl.quant.packing`.)"""

from __future__ import annotations

from dataclasses import dataclass

from ..errors import CheckpointError


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
        bits = int(q.get("bits", q.get("w_bit", 4)))
        if bits != 4:
            raise CheckpointError(f"{where}: AWQ with {bits} bits is not supported (only 4)")
        return cls(bits=bits, group_size=int(q.get("group_size", q.get("q_group_size", 128))),
                   zero_point=bool(q.get("zero_point", True)),
                   modules_to_not_convert=tuple(q.get("modules_to_not_convert") or ()))

    def to_config(self) -> dict:
        out = {"quant_method": "awq", "bits": self.bits, "group_size": self.group_size, "zero_point": self.zero_point,
               "version": "gemm"}
        if self.modules_to_not_convert:
            out["modules_to_not_convert"] = list(self.modules_to_not_convert)
        return out
