"""Regenerate tests/data/trtllm-1.2/*.json from a real TensorRT-LLM 1.2.x install.

Run inside NVIDIA's TensorRT-LLM 1.2 container (or any environment where `import tensorrt_llm`
works), from the repository root:

    python tests/data/trtllm-1.2/regenerate.py

It introspects the installed package instead of its sources: the `trtllm-build` parser that
`tensorrt_llm.commands.build.parse_arguments()` returns, the nanobind signatures of the executor
classes (`__nb_signature__`, else the first line of `__doc__`), enum members, and
`inspect.signature` of the Python classes vlmctl calls. It writes the same files and keys the
tests read; a difference from the committed data is then a real interface change (or a
transcription error in the committed data) to act on. It has not run on vlmctl's machines.
"""

from __future__ import annotations

import argparse
import inspect
import json
import re
from pathlib import Path

HERE = Path(__file__).parent
EXECUTOR_CLASSES = ["SamplingConfig", "OutputConfig", "PromptTuningConfig", "Request", "KvCacheConfig",
                    "OrchestratorConfig", "ParallelConfig", "ExecutorConfig"]
EXECUTOR_ENUMS = ["FinishReason", "ModelType", "CommunicationType", "CommunicationMode", "CapacitySchedulerPolicy",
                  "ContextChunkingPolicy", "BatchingType", "RequestType"]


def _jsonable(v):
    if v is inspect.Parameter.empty:
        return "<required>"
    if v is None or isinstance(v, (bool, int, float, str)):
        return v
    return f"<{v!r}>"


def build_options() -> dict:
    from tensorrt_llm.commands.build import parse_arguments

    parser = parse_arguments()
    out = []
    for a in parser._actions:
        if isinstance(a, argparse._HelpAction):
            continue
        kind = "store_true" if isinstance(a, argparse._StoreTrueAction) else "store"
        typ = None if a.type is None else {str: "str", int: "int"}.get(a.type, getattr(a.type, "__qualname__", "callable"))
        d = {"flags": list(a.option_strings), "dest": a.dest, "action": kind, "type": typ,
             "default": "==SUPPRESS==" if a.default == argparse.SUPPRESS else _jsonable(a.default)}
        if a.choices is not None:
            d["choices"] = [c if c is not None else "disable" for c in a.choices]
        if a.nargs:
            d["nargs"] = a.nargs
        out.append(d)
    return {"command": "trtllm-build (python -m tensorrt_llm.commands.build)", "read_from": ["introspection"],
            "options": out}


_SIG = re.compile(r"\((.*)\)")


def _nb_params(func) -> list[dict]:
    """Parameters of a nanobind function from its signature text: `(self, a: int, *, b: X = ...)`."""
    text = getattr(func, "__nb_signature__", None)
    text = text[0][0] if text else (func.__doc__ or "").splitlines()[0]
    inner = _SIG.search(text).group(1)
    params, kw = [], False
    for part in [p.strip() for p in re.split(r",(?![^\[]*\])", inner) if p.strip()]:
        if part == "*":
            kw = True
            continue
        name = part.split(":")[0].split("=")[0].strip()
        if name == "self":
            continue
        p = {"name": name, "kw_only": kw}
        if "=" in part:
            p["default"] = part.split("=", 1)[1].strip()
        params.append(p)
    return params


def executor_bindings() -> dict:
    import tensorrt_llm.bindings.executor as tle

    classes = {c: {"init": _nb_params(getattr(tle, c).__init__)} for c in EXECUTOR_CLASSES}
    ex = tle.Executor
    classes["Executor"] = {"init_overloads": [_nb_params(ex.__init__)],
                           "methods": {m: [_nb_params(getattr(ex, m))] for m in
                                       ("shutdown", "enqueue_request", "await_responses", "cancel_request",
                                        "can_enqueue_requests")}}
    classes["Result"] = {"attributes": [a for a in dir(tle.Result) if not a.startswith("_")]}
    classes["Response"] = {"attributes": [a for a in dir(tle.Response) if not a.startswith("_")]}
    enums = {e: [m for m in getattr(tle, e).__members__] for e in EXECUTOR_ENUMS}
    return {"module": "tensorrt_llm.bindings.executor", "read_from": ["introspection"], "classes": classes,
            "enums": enums}


def models() -> dict:
    import dataclasses

    from tensorrt_llm.mapping import Mapping
    from tensorrt_llm.models import MODEL_MAP
    from tensorrt_llm.models.modeling_utils import QuantConfig
    from tensorrt_llm.quantization import QuantAlgo

    def params(f):
        return [{"name": n, "kw_only": p.kind is p.KEYWORD_ONLY, **({} if p.default is p.empty else
                                                                   {"default": _jsonable(p.default)})}
                for n, p in inspect.signature(f).parameters.items()
                if n not in ("self", "cls") and p.kind not in (p.VAR_KEYWORD, p.VAR_POSITIONAL)]

    wanted = {"LlamaForCausalLM", "MistralForCausalLM", "Qwen2ForCausalLM"}
    mm = {k: v.__name__ for k, v in MODEL_MAP.items() if k in wanted}
    fhf = {}
    for cls_name in set(mm.values()):
        cls = next(v for v in MODEL_MAP.values() if v.__name__ == cls_name)
        src = inspect.getsource(cls.from_hugging_face)
        fhf[cls_name] = {"params": params(cls.from_hugging_face),
                         "kwargs_popped": sorted(set(re.findall(r"kwargs\.pop\('(\w+)'", src))),
                         "kwargs_rest": "see source"}
    any_cls = next(iter(MODEL_MAP.values()))
    return {"MODEL_MAP": mm, "from_hugging_face": fhf, "save_checkpoint": {"params": params(any_cls.save_checkpoint)},
            "QuantConfig": {"module": "tensorrt_llm.models.modeling_utils",
                            "fields": [{"name": f.name, "kw_only": False,
                                        **({} if f.default is dataclasses.MISSING else {"default": _jsonable(f.default)})}
                                       for f in dataclasses.fields(QuantConfig)]},
            "QuantAlgo": {"module": "tensorrt_llm.quantization", "members_used_by_vlmctl": ["W4A16_GPTQ"],
                          "members_seen": list(QuantAlgo.__members__)},
            "Mapping": {"module": "tensorrt_llm.mapping", "init": params(Mapping.__init__)}}


if __name__ == "__main__":
    import tensorrt_llm

    for name, data in (("trtllm_build_options.json", build_options()), ("executor_bindings.json", executor_bindings())):
        (HERE / name).write_text(json.dumps(data, indent=1))
    old = json.loads((HERE / "models.json").read_text())
    (HERE / "models.json").write_text(json.dumps({**old, **models()}, indent=1))
    src = json.loads((HERE / "sources.json").read_text())
    src["regenerated_from"] = f"tensorrt_llm {tensorrt_llm.__version__} (introspection)"
    (HERE / "sources.json").write_text(json.dumps(src, indent=1))
    print("wrote", HERE)
