"""Triton's own reading of a model repository, for tests: configs parsed with the `model_config`
protobuf from `tritonclient`, and an ensemble checked by the rules of Triton core's
`ValidateEnsembleConfig` / `ValidateTensorMapping` / `ValidateTensorConsistency`
(src/ensemble_scheduler/ensemble_utils.cc, read at the commit in
tests/data/tensorrtllm_backend-1.2/sources.json), plus one rule Triton leaves to run time: every
tensor a step reads is an ensemble input or some step's output, and the steps form no cycle.

Nothing here is used by vlmctl itself.
"""

from __future__ import annotations

from pathlib import Path

from google.protobuf import text_format
from tritonclient.grpc import model_config_pb2 as mc

WILDCARD = -1


def parse(path: Path) -> mc.ModelConfig:
    """A config.pbtxt through protobuf's text parser (unknown fields and enum values fail)."""
    return text_format.Parse(Path(path).read_text(), mc.ModelConfig())


def load_repo(repo: Path) -> dict[str, mc.ModelConfig]:
    return {p.parent.name: parse(p) for p in sorted(Path(repo).glob("*/config.pbtxt"))}


def _dims_match(a, b) -> bool:  # CompareDimsWithWildcard
    return len(a) == len(b) and all(x == WILDCARD or y == WILDCARD or x == y for x, y in zip(a, b))


class _Node:
    def __init__(self, model: str, batching: bool, dtype: int, dims):
        self.model, self.dtype, self.dims = model, dtype, list(dims)
        self.full = ([WILDCARD] if batching else []) + list(dims)


def _consistent(lhs: _Node, rhs: _Node, where: str) -> list[str]:
    if lhs.dtype != rhs.dtype:
        return [f"{where}: inconsistent data type: {mc.DataType.Name(lhs.dtype)} from {lhs.model} vs "
                f"{mc.DataType.Name(rhs.dtype)} from {rhs.model}"]
    if not _dims_match(lhs.dims, rhs.dims) and not _dims_match(lhs.full, rhs.full):
        return [f"{where}: inconsistent shape: {lhs.full} from {lhs.model} vs {rhs.full} from {rhs.model}"]
    return []


def ensemble_errors(configs: dict[str, mc.ModelConfig], ensemble: str = "ensemble") -> list[str]:
    """Every violation of Triton's ensemble rules (empty when the repository would load)."""
    ens = configs[ensemble]
    errors: list[str] = []
    batching = ens.max_batch_size > 0
    tensors: dict[str, _Node] = {}
    for t in ens.input:
        tensors[t.name] = _Node(ensemble, batching, t.data_type, t.reshape.shape if t.HasField("reshape") else t.dims)
    for t in ens.output:
        tensors[t.name] = _Node(ensemble, batching, t.data_type, t.reshape.shape if t.HasField("reshape") else t.dims)
    producers: dict[str, str] = {}
    reads: dict[str, set[str]] = {}
    for step in ens.ensemble_scheduling.step:
        name = step.model_name
        if name not in configs:
            errors.append(f"ensemble step {name}: no such model in the repository")
            continue
        cfg = configs[name]
        if cfg.max_batch_size != 0 and cfg.max_batch_size < ens.max_batch_size:
            errors.append(f"{name}: max batch size {cfg.max_batch_size} below the ensemble's {ens.max_batch_size}")
        step_batching = cfg.max_batch_size > 0
        inputs = {t.name: t for t in cfg.input}
        outputs = {t.name: t for t in cfg.output}
        for key, value in step.input_map.items():
            if key not in inputs:
                errors.append(f"{name}: ensemble tensor {value} maps to non-existing input {key}")
        for t in cfg.input:
            mapped = [v for k, v in step.input_map.items() if k == t.name]
            if not mapped and not t.optional:
                errors.append(f"{name}: required input {t.name} is not mapped to any ensemble tensor")
            for v in mapped:
                node = _Node(name, step_batching, t.data_type, t.dims)
                if v in tensors:
                    errors += _consistent(tensors[v], node, f"{name}.{t.name} <- {v}")
                else:
                    tensors[v] = node
                reads.setdefault(v, set()).add(name)
        seen: set[str] = set()
        for key, value in step.output_map.items():
            if key not in outputs:
                errors.append(f"{name}: ensemble tensor {value} is mapped from non-existing output {key}")
                continue
            if value in seen:
                errors.append(f"{name}: several outputs map to {value}")
            seen.add(value)
            if value in producers:
                errors.append(f"{value} is produced by both {producers[value]} and {name}")
            producers[value] = name
            node = _Node(name, step_batching, outputs[key].data_type, outputs[key].dims)
            if value in tensors:
                errors += _consistent(tensors[value], node, f"{name}.{key} -> {value}")
            else:
                tensors[value] = node
    inputs = {t.name for t in ens.input}
    for tensor, readers in reads.items():
        if tensor not in inputs and tensor not in producers:
            errors.append(f"{tensor} (read by {sorted(readers)}) is neither an ensemble input nor a step output")
    for t in ens.output:
        if t.name not in producers:
            errors.append(f"ensemble output {t.name} is produced by no step")
    # No cycle: a step may read only what is available before it runs.
    deps = {s.model_name: {producers[v] for v in s.input_map.values() if v in producers}
            for s in ens.ensemble_scheduling.step}
    done: set[str] = set()
    while len(done) < len(deps):
        ready = [m for m, d in deps.items() if m not in done and d <= done]
        if not ready:
            errors.append(f"the steps {sorted(set(deps) - done)} wait on each other")
            break
        done.update(ready)
    return errors


def provenance(ens: mc.ModelConfig) -> dict[tuple[str, str], tuple[str, str]]:
    """(step model, its input) -> where the tensor comes from: ("input", ensemble input) or (model, output)."""
    made = {v: (s.model_name, k) for s in ens.ensemble_scheduling.step for k, v in s.output_map.items()}
    inputs = {t.name for t in ens.input}
    return {(s.model_name, k): (("input", v) if v in inputs else made.get(v, ("?", v)))
            for s in ens.ensemble_scheduling.step for k, v in s.input_map.items()}
