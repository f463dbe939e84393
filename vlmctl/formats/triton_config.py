"""Triton Inference Server's `config.pbtxt`: a small typed model of the fields vlmctl writes, and
its protobuf text form.

What it is: `Tensor`, `Step` and `ModelConfig` (the subset of Triton's `inference.ModelConfig`
message that a model repository of Python, C++-backend and ensemble models needs) and
`ModelConfig.to_pbtxt()`, which writes protobuf text format (the message's field names, enum
values unquoted, strings quoted). Tests parse every file with the `model_config_pb2` message
from `tritonclient`, so a misspelt field or enum fails there.

What it is not: which models and tensors a repository holds (export/triton_repo.py).
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field

# inference.DataType values vlmctl uses (model_config.proto).
DATA_TYPES = ("TYPE_BOOL", "TYPE_UINT8", "TYPE_INT32", "TYPE_INT64", "TYPE_UINT64", "TYPE_FP16", "TYPE_FP32",
              "TYPE_BF16", "TYPE_STRING")


@dataclass(frozen=True)
class Tensor:
    name: str
    data_type: str
    dims: tuple[int, ...]
    optional: bool = False
    reshape: tuple[int, ...] | None = None  # () is the scalar reshape the TensorRT-LLM backend takes
    allow_ragged_batch: bool = False

    def __post_init__(self):
        if self.data_type not in DATA_TYPES:
            raise ValueError(f"{self.name}: unknown data type {self.data_type}")


@dataclass
class Step:
    model_name: str
    input_map: dict[str, str]  # the model's input name -> ensemble tensor
    output_map: dict[str, str]  # the model's output name -> ensemble tensor


@dataclass
class ModelConfig:
    name: str
    max_batch_size: int
    inputs: list[Tensor]
    outputs: list[Tensor]
    backend: str | None = None
    platform: str | None = None
    parameters: dict[str, str] = field(default_factory=dict)
    instance_count: int | None = 1  # one KIND_CPU instance group; None writes no instance_group
    dynamic_batching: dict | None = None  # field -> value; {} writes an empty block
    decoupled: bool | None = None
    steps: list[Step] = field(default_factory=list)

    def to_pbtxt(self) -> str:
        out = [f"name: {_q(self.name)}"]
        if self.platform:
            out.append(f"platform: {_q(self.platform)}")
        if self.backend:
            out.append(f"backend: {_q(self.backend)}")
        out.append(f"max_batch_size: {int(self.max_batch_size)}")
        if self.decoupled is not None:
            out.append(f"model_transaction_policy {{\n  decoupled: {str(self.decoupled).lower()}\n}}")
        if self.dynamic_batching is not None:
            body = "".join(f"  {k}: {_value(v)}\n" for k, v in self.dynamic_batching.items())
            out.append("dynamic_batching {\n" + body + "}")
        out.append(_tensors("input", self.inputs))
        out.append(_tensors("output", self.outputs))
        if self.instance_count is not None:
            out.append(f"instance_group [\n  {{\n    count: {int(self.instance_count)}\n    kind: KIND_CPU\n  }}\n]")
        for key, value in self.parameters.items():
            out.append(f"parameters {{\n  key: {_q(key)}\n  value: {{\n    string_value: {_q(str(value))}\n  }}\n}}")
        if self.steps:
            steps = []
            for s in self.steps:
                lines = [f"      model_name: {_q(s.model_name)}", "      model_version: -1"]
                lines += [f"      input_map {{\n        key: {_q(k)}\n        value: {_q(v)}\n      }}"
                          for k, v in s.input_map.items()]
                lines += [f"      output_map {{\n        key: {_q(k)}\n        value: {_q(v)}\n      }}"
                          for k, v in s.output_map.items()]
                steps.append("    {\n" + "\n".join(lines) + "\n    }")
            out.append("ensemble_scheduling {\n  step [\n" + ",\n".join(steps) + "\n  ]\n}")
        return "\n".join(out) + "\n"


def _q(s: str) -> str:
    # JSON string escaping is a subset protobuf's text format reads back unchanged.
    return json.dumps(s)


def _value(v) -> str:
    if isinstance(v, bool):
        return str(v).lower()
    if isinstance(v, (list, tuple)):
        return "[ " + ", ".join(str(int(x)) for x in v) + " ]"
    return str(int(v))


def _tensors(kind: str, tensors: list[Tensor]) -> str:
    blocks = []
    for t in tensors:
        lines = [f"    name: {_q(t.name)}", f"    data_type: {t.data_type}",
                 "    dims: [ " + ", ".join(str(int(d)) for d in t.dims) + " ]"]
        if t.reshape is not None:
            lines.append("    reshape: { shape: [ " + ", ".join(str(int(d)) for d in t.reshape) + " ] }")
        if t.optional and kind == "input":
            lines.append("    optional: true")
        if t.allow_ragged_batch and kind == "input":
            lines.append("    allow_ragged_batch: true")
        blocks.append("  {\n" + "\n".join(lines) + "\n  }")
    return f"{kind} [\n" + ",\n".join(blocks) + "\n]"
