"""Re-derive the recorded stock-model interfaces from a real tensorrtllm_backend 1.2 install.

Run inside NVIDIA's Triton TensorRT-LLM 1.2 container (which has the stock models at
/app/all_models and tritonclient):

    python3 regenerate.py [/app/all_models] > stock_models.regenerated.json

It prints, per stock model, the template's inputs and outputs (name, data type, dims, optional,
reshape; `${key}` data types kept as written) and what its Python file looks up by name (input
and output configs, tensors, parameters, builder_config keys), and lists on stderr every name that
differs from stock_models.json beside it. Where the two disagree, the regenerated data wins. It
has not run (no such container here).
"""

from __future__ import annotations

import ast
import json
import re
import sys
from pathlib import Path

MODELS = {"preprocessing": "inflight_batcher_llm/preprocessing", "postprocessing": "inflight_batcher_llm/postprocessing",
          "tensorrt_llm": "inflight_batcher_llm/tensorrt_llm", "multimodal_encoders": "multimodal/multimodal_encoders"}
LOOKUPS = {"get_input_tensor_by_name": "inputs", "get_input_config_by_name": "input_configs",
           "get_output_config_by_name": "output_configs"}


def template_io(path: Path) -> dict:
    from google.protobuf import text_format
    from tritonclient.grpc import model_config_pb2 as mc

    text = path.read_text()
    typed = dict(re.findall(r'name:\s*"([^"]+)"\s*data_type:\s*(\$\{\w+\})', text))
    text = re.sub(r"data_type:\s*\$\{\w+\}", "data_type: TYPE_FP16", text)
    text = re.sub(r"\$\{\w+\}", "1", text)  # numbers and strings alike parse as placeholders
    cfg = text_format.Parse(text, mc.ModelConfig())

    def one(t, is_input):
        d = {"name": t.name, "data_type": typed.get(t.name, mc.DataType.Name(t.data_type)), "dims": list(t.dims)}
        if is_input and t.optional:
            d["optional"] = True
        if t.HasField("reshape"):
            d["reshape"] = list(t.reshape.shape)
        return d

    return {"input": [one(t, True) for t in cfg.input], "output": [one(t, False) for t in cfg.output]}


def python_reads(path: Path) -> dict:
    out: dict[str, set] = {k: set() for k in (*LOOKUPS.values(), "outputs", "parameters", "builder_config")}
    for node in ast.walk(ast.parse(path.read_text())):
        if isinstance(node, ast.Call):
            fn = node.func.attr if isinstance(node.func, ast.Attribute) else getattr(node.func, "id", "")
            strs = [a.value for a in node.args if isinstance(a, ast.Constant) and isinstance(a.value, str)]
            if fn in LOOKUPS and strs:
                out[LOOKUPS[fn]].add(strs[0])
            elif fn in ("Tensor", "from_dlpack") and strs:
                out["outputs"].add(strs[0])
            elif fn == "get" and isinstance(node.func, ast.Attribute) and strs:
                base = node.func.value
                if isinstance(base, ast.Subscript) and getattr(base.slice, "value", None) == "parameters":
                    out["parameters"].add(strs[0])
        elif isinstance(node, ast.Subscript) and isinstance(node.slice, ast.Constant):
            base = node.value
            if isinstance(base, ast.Subscript) and isinstance(base.slice, ast.Constant):
                if base.slice.value == "parameters":
                    out["parameters"].add(node.slice.value)
                elif base.slice.value == "builder_config":
                    out["builder_config"].add(node.slice.value)
    return {k: sorted(v) for k, v in out.items()}


def main(root: str = "/app/all_models") -> None:
    root_p = Path(root)
    data = {}
    for name, rel in MODELS.items():
        entry = {"template": template_io(root_p / rel / "config.pbtxt")}
        model_py = root_p / rel / "1" / "model.py"
        if name != "tensorrt_llm" and model_py.exists():
            entry["reads"] = python_reads(model_py)
        data[name] = entry
    data["ensemble"] = template_io(root_p / "multimodal" / "ensemble" / "config.pbtxt")
    print(json.dumps(data, indent=1))
    recorded = json.loads((Path(__file__).parent / "stock_models.json").read_text())
    for name, entry in data.items():
        rec = recorded["ensemble"] if name == "ensemble" else recorded["models"][name]["template"]
        tmpl = entry if name == "ensemble" else entry["template"]
        for kind in ("input", "output"):
            have = {t["name"]: t for t in tmpl[kind]}
            for t in rec[kind]:
                if have.get(t["name"]) != t:
                    print(f"{name}.{kind}.{t['name']}: recorded {t}, installed {have.get(t['name'])}", file=sys.stderr)


if __name__ == "__main__":
    main(*sys.argv[1:])
