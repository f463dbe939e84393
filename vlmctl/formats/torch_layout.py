"""The embedded decoder's engine layout: `build-llm/config.json` and where its weights live.

This is an on-disk contract between `build-llm` (vlmctl.export.torch_decoder writes it) and the
runtime (vlmctl.runtime.decoder reads it). `config.json` holds a typed `DecoderSpec`: the
decoder's shape and variants (activation, norm, rotary incl. M-RoPE sections, embedding scale,
q/k norms, sandwich norms, sliding-window layers with their own rotary, logit softcapping, image
attention, gated cross-attention layers) and, per runtime tensor, the Hugging Face tensors it is
made of. Runtime tensor names (i = layer index):

  embed, norm, lm_head (absent when tied)
  layers.i.input_norm, layers.i.post_norm               the norms before attention and before the MLP
  layers.i.{gate_up,down}.weight                       the MLP; gate|up fused
  self-attention layers ("full", "sliding"):
  layers.i.attn_out_norm, layers.i.mlp_out_norm         sandwich norms of the attention / MLP outputs
  layers.i.q_norm, layers.i.k_norm                      per-head q/k norms [head_dim] (qk_norm)
  layers.i.{qkv,o}.weight                              float linears [out, in]; q|k|v fused
  layers.i.qkv.bias                                     when the decoder has q/k/v biases
  cross-attention layers ("cross_attention"):
  layers.i.cross_q.weight, layers.i.cross_o.weight      the query (reads the hidden states) and output
  layers.i.cross_kv.weight                             k|v fused: they read the image states, not the text
  layers.i.cross_q_norm, layers.i.cross_k_norm          per-head q/k norms [head_dim]
  layers.i.cross_attn_gate, layers.i.cross_mlp_gate     [1]: the attention / MLP outputs times tanh(gate)
  any linear as {name}.{q4weight,q4scales,q4zeros}      4-bit AWQ in the W4A16 kernel's layout

A template "layers.{i}.NAME" stands for the layers that have NAME: every layer, or the layers of
one kind for the kind-specific names above (`DecoderSpec.layers_with`).

Weights come from one of two places (`weights.kind`):
- "hf": a float decoder is read from the Hugging Face checkpoint `convert` wrote (`weights.dir`,
  relative to the engine directory), fused into the runtime tensors while it is copied to the
  device. The engine keeps one float copy of the decoder, not two.
- "packed": `weights.safetensors` in the layout directory holds the runtime tensors themselves
  (AWQ engines: the int4 weights repacked at build time for the kernel).
"""

from __future__ import annotations

import json
from dataclasses import asdict, dataclass, field
from pathlib import Path

from ..checkpoint import TensorReader
from ..errors import CheckpointError, EngineError

FORMAT = "vlmctl-torch-decoder"
DTYPE_NAMES = ("float32", "float16", "bfloat16")
FORMAT_VERSION = 2
WEIGHTS = "weights.safetensors"
CONFIG = "config.json"


def torch_dtype(name: str):
    import torch

    if name not in DTYPE_NAMES:
        raise EngineError(f"unknown dtype {name!r} (expected one of {', '.join(DTYPE_NAMES)})")
    return getattr(torch, name)


NORMS = ("rms", "rms_one_plus")
ACTIVATIONS = ("silu", "gelu_tanh")
# "cross_attention": a gated cross-attention block (Flamingo / Llama 3.2 Vision): no self-attention and
# no self-attention KV; its queries attend to the request's image states, whose keys and values are
# computed once per request (`vlmctl.runtime.cross_kv`). Tokens that see no image yet attend to every
# image row and have their MLP output zeroed; a request without images skips these layers.
LAYER_TYPES = ("full", "sliding", "cross_attention")
CROSS = "cross_attention"
# Runtime tensors only layers of one kind have (first name component); the others: every layer.
SELF_ONLY = ("qkv", "o", "q_norm", "k_norm", "attn_out_norm", "mlp_out_norm")
CROSS_ONLY = ("cross_q", "cross_kv", "cross_o", "cross_q_norm", "cross_k_norm", "cross_attn_gate", "cross_mlp_gate")
IMAGE_ATTENTION = ("causal", "bidirectional")


@dataclass(frozen=True)
class DecoderSpec:
    """What the runtime needs to know about a decoder; made by `vlmctl.models.decoders`.

    The defaults are a Llama decoder; every other decoder states its variants here, so the runtime
    runs any of them from this description alone (it never asks which model it is)."""

    model_type: str
    hidden_size: int
    intermediate_size: int
    num_layers: int
    num_heads: int
    num_kv_heads: int
    head_dim: int
    vocab_size: int
    rms_norm_eps: float
    max_position_embeddings: int
    tie_word_embeddings: bool = False
    qkv_bias: bool = False
    activation: str = "silu"  # gated MLP: act(gate) * up; "silu" | "gelu_tanh" (GELU, tanh approximation)
    # "rms": w * round(x / rms(x)) (Llama); "rms_one_plus": round(x / rms(x) * (1 + w)), all in float32 (Gemma)
    norm: str = "rms"
    rope_inv_freq: tuple[float, ...] = ()  # float32 values, computed by transformers' rotary class
    rope_attention_scaling: float = 1.0
    mrope_section: tuple[int, ...] | None = None  # multimodal rotary: frequency sections of (t, h, w)
    embed_scale: float | None = None  # token embeddings times this (rounded to the model dtype); image rows not
    qk_norm: bool = False  # per-head norm (of kind `norm`) of q and k before rotary
    sandwich_norms: bool = False  # attention and MLP outputs are normed before their residual add
    attention_scale: float | None = None  # softmax scale of q.k; None: head_dim ** -0.5
    layer_types: tuple[str, ...] = ()  # per layer "full" | "sliding" | "cross_attention"; empty: every layer full
    sliding_window: int | None = None  # keys a sliding layer's query sees, itself included
    rope_local_inv_freq: tuple[float, ...] = ()  # rotary of the sliding layers; empty: the global one
    rope_local_attention_scaling: float = 1.0
    # "bidirectional": during prefill the rows of one image (a run of prompt-table rows) see each other
    image_attention: str = "causal"
    final_logit_softcap: float | None = None  # logits = cap * tanh(logits / cap)
    # rows of the token embedding when it has more than the LM head's vocab_size (Llama 3.2 Vision: + 8,
    # `<|image|>` among them); ids below it are tokens, prompt-table fake ids start at it
    embed_rows: int | None = None
    quantization: dict | None = None  # {"method": "awq", "bits": 4, "group_size": g}
    # runtime tensor name ("{i}" = layer) -> the HF tensors concatenated (along the output axis) into it
    tensor_sources: dict[str, tuple[str, ...]] = field(default_factory=dict)

    def to_json(self) -> dict:
        return asdict(self)

    @classmethod
    def from_json(cls, d: dict) -> "DecoderSpec":
        known = set(cls.__dataclass_fields__)
        unknown = sorted(set(d) - known)
        if unknown:
            raise EngineError(f"decoder spec has unknown fields {unknown} (built by a newer vlmctl?)")
        d = dict(d)
        for key in ("rope_inv_freq", "rope_local_inv_freq", "layer_types"):
            d[key] = tuple(d.get(key) or ())
        if d.get("mrope_section") is not None:
            d["mrope_section"] = tuple(d["mrope_section"])
        d["tensor_sources"] = {k: tuple(v) for k, v in (d.get("tensor_sources") or {}).items()}
        spec = cls(**d)
        spec.validate()
        return spec

    def validate(self) -> None:
        """Variants this runtime runs; anything else is an engine built by another vlmctl."""
        for name, value, allowed in (("norm", self.norm, NORMS), ("activation", self.activation, ACTIVATIONS),
                                     ("image_attention", self.image_attention, IMAGE_ATTENTION)):
            if value not in allowed:
                raise EngineError(f"decoder spec: {name} {value!r} is not supported (expected one of "
                                  f"{', '.join(allowed)})")
        if self.layer_types:
            if len(self.layer_types) != self.num_layers or not set(self.layer_types) <= set(LAYER_TYPES):
                raise EngineError(f"decoder spec: layer_types must give {self.num_layers} values of "
                                  f"{', '.join(LAYER_TYPES)}")
            if "sliding" in self.layer_types and not (self.sliding_window and self.sliding_window > 0):
                raise EngineError("decoder spec: sliding layers need a positive sliding_window")
            if self.layer_types.count(CROSS) == self.num_layers:
                raise EngineError("decoder spec: a decoder of cross-attention layers only has no self-attention")
        if self.embed_rows is not None and self.embed_rows < self.vocab_size:
            raise EngineError(f"decoder spec: embed_rows {self.embed_rows} is below vocab_size {self.vocab_size}")
        if self.rope_local_inv_freq and len(self.rope_local_inv_freq) != len(self.rope_inv_freq):
            raise EngineError("decoder spec: rope_local_inv_freq and rope_inv_freq differ in size")
        if self.mrope_section is not None and self.rope_local_inv_freq:
            raise EngineError("decoder spec: multimodal rotary with a separate local rotary is not supported")

    def is_sliding(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == "sliding"

    def is_cross(self, layer: int) -> bool:
        return bool(self.layer_types) and self.layer_types[layer] == CROSS

    @property
    def cross_layers(self) -> tuple[int, ...]:
        return tuple(i for i in range(self.num_layers) if self.is_cross(i))

    @property
    def self_layers(self) -> tuple[int, ...]:
        """Layers with self-attention (and so with a slice of the paged KV cache), in order."""
        return tuple(i for i in range(self.num_layers) if not self.is_cross(i))

    @property
    def table_base(self) -> int:
        """The first prompt-table fake id: ids below it are looked up in the token embedding."""
        return self.embed_rows or self.vocab_size

    def layers_with(self, template: str) -> list[int]:
        """The layers a "layers.{i}.NAME" tensor template applies to (see the module docstring)."""
        head = template.split(".")[2]
        if head in CROSS_ONLY:
            return list(self.cross_layers)
        if head in SELF_ONLY:
            return list(self.self_layers)
        return list(range(self.num_layers))

    @property
    def q_size(self) -> int:
        return self.num_heads * self.head_dim

    @property
    def kv_size(self) -> int:
        return self.num_kv_heads * self.head_dim

    def runtime_names(self) -> list[str]:
        """Every runtime tensor a float decoder of this spec has, layer templates expanded."""
        out = []
        for name in self.tensor_sources:
            if "{i}" in name:
                out.extend(name.format(i=i) for i in self.layers_with(name))
            else:
                out.append(name)
        return out

    def expected_shape(self, name: str) -> tuple[int, ...] | None:
        """Shape of a float runtime tensor (None for names this spec does not size)."""
        H, I, V = self.hidden_size, self.intermediate_size, self.vocab_size
        qkv = self.q_size + 2 * self.kv_size
        tail = name.split(".", 2)[-1] if name.startswith("layers.") else name
        d = self.head_dim
        return {"embed": (self.embed_rows or V, H), "lm_head": (V, H), "norm": (H,), "input_norm": (H,),
                "post_norm": (H,), "attn_out_norm": (H,), "mlp_out_norm": (H,), "q_norm": (d,), "k_norm": (d,),
                "qkv.weight": (qkv, H), "qkv.bias": (qkv,), "o.weight": (H, self.q_size),
                "gate_up.weight": (2 * I, H), "down.weight": (H, I), "cross_q.weight": (self.q_size, H),
                "cross_kv.weight": (2 * self.kv_size, H), "cross_o.weight": (H, self.q_size), "cross_q_norm": (d,),
                "cross_k_norm": (d,), "cross_attn_gate": (1,), "cross_mlp_gate": (1,)}.get(tail)


@dataclass(frozen=True)
class LayoutConfig:
    """The whole `build-llm/config.json` of a torch-backend engine."""

    dtype: str
    decoder: DecoderSpec
    weights: dict  # {"kind": "hf", "dir": "convert/llm"} | {"kind": "packed", "file": WEIGHTS}
    extra: dict  # name, backend, limits, prompt-table sizing, eos ids (owned by the pipeline)

    def to_json(self) -> dict:
        return {"format": FORMAT, "format_version": FORMAT_VERSION, "dtype": self.dtype,
                "decoder": self.decoder.to_json(), "weights": self.weights, **self.extra}


def is_layout(cfg: dict) -> bool:
    return cfg.get("format") == FORMAT


def read_layout(layout_dir: Path) -> LayoutConfig:
    layout_dir = Path(layout_dir)
    try:
        cfg = json.loads((layout_dir / CONFIG).read_text())
    except (OSError, json.JSONDecodeError, UnicodeDecodeError) as e:
        raise EngineError(f"{layout_dir}: no readable decoder {CONFIG} ({type(e).__name__})") from None
    if not is_layout(cfg):
        raise EngineError(f"{layout_dir}: not a vlmctl torch decoder (format {cfg.get('format')!r})")
    if cfg.get("format_version") != FORMAT_VERSION:
        raise EngineError(f"{layout_dir}: decoder layout version {cfg.get('format_version')} is not "
                          f"{FORMAT_VERSION}; rebuild it with `vlmctl build-llm` (or `vlmctl build --force`)")
    try:
        spec = DecoderSpec.from_json(cfg["decoder"])
        extra = {k: v for k, v in cfg.items() if k not in ("format", "format_version", "dtype", "decoder", "weights")}
        return LayoutConfig(cfg["dtype"], spec, dict(cfg["weights"]), extra)
    except (KeyError, TypeError) as e:
        raise EngineError(f"{layout_dir}: decoder {CONFIG} is incomplete ({e})") from None


def write_layout(layout_dir: Path, layout: LayoutConfig) -> None:
    Path(layout_dir).mkdir(parents=True, exist_ok=True)
    (Path(layout_dir) / CONFIG).write_text(json.dumps(layout.to_json(), indent=2))


def weights_location(layout_dir: Path, layout: LayoutConfig) -> Path:
    """The directory (kind "hf") or file (kind "packed") the weights are read from."""
    kind = layout.weights.get("kind")
    if kind == "hf":
        # relative to the engine directory, the parent of build-llm/
        return Path(layout_dir).resolve().parent / layout.weights["dir"]
    if kind == "packed":
        return Path(layout_dir) / layout.weights.get("file", WEIGHTS)
    raise EngineError(f"{layout_dir}: unknown weights kind {kind!r} in {CONFIG}")


def check_hf_sources(reader: TensorReader, spec: DecoderSpec, where: Path) -> None:
    """Every runtime tensor's sources exist with the right shapes, and nothing is left over."""
    used: set[str] = set()
    for name, sources in spec.tensor_sources.items():
        layers = spec.layers_with(name) if "{i}" in name else [None]
        for i in layers:
            rt = name.format(i=i) if i is not None else name
            parts = [s.format(i=i) if i is not None else s for s in sources]
            missing = [p for p in parts if p not in reader]
            if missing:
                raise CheckpointError(f"{where}: decoder tensor {missing[0]!r} is missing")
            shapes = [reader.shape(p) for p in parts]
            fused = (sum(s[0] for s in shapes),) + shapes[0][1:]
            want = spec.expected_shape(rt)
            if want is not None and fused != want:
                raise CheckpointError(f"{where}: {rt} (from {', '.join(parts)}) has shape {fused}, expected {want}")
            used.update(parts)
    leftovers = sorted(set(reader.names()) - used - ({"lm_head.weight"} if spec.tie_word_embeddings else set()))
    if leftovers:
        raise CheckpointError(f"{where}: decoder has {len(leftovers)} tensor(s) the runtime does not use, "
                              f"e.g. {leftovers[:3]}")


def load_hf_weights(ckpt_dir: "Path | TensorReader", spec: DecoderSpec, device, dtype) -> dict:
    """Runtime tensors of a float decoder (a checkpoint directory, or a reader), fused while they are
    copied to `device`."""
    import torch

    reader = ckpt_dir if isinstance(ckpt_dir, TensorReader) else TensorReader(ckpt_dir)
    check_hf_sources(reader, spec, reader.dir)
    out = {}
    for name in spec.runtime_names():
        template = next(t for t in spec.tensor_sources if t == name or
                        ("{i}" in t and _matches(t, name)))
        i = _layer_of(name) if "{i}" in template else None
        parts = [s.format(i=i) if i is not None else s for s in spec.tensor_sources[template]]
        if len(parts) == 1:
            out[name] = reader.get(parts[0]).to(device=device, dtype=dtype)
            continue
        shapes = [reader.shape(p) for p in parts]
        t = torch.empty((sum(s[0] for s in shapes),) + shapes[0][1:], device=device, dtype=dtype)
        row = 0
        for p, s in zip(parts, shapes):
            t[row:row + s[0]].copy_(reader.get(p))
            row += s[0]
        out[name] = t
    return out


def _layer_of(name: str) -> int:
    return int(name.split(".")[1])


def _matches(template: str, name: str) -> bool:
    a, b = template.split("."), name.split(".")
    return len(a) == len(b) and all(x == y or x == "{i}" for x, y in zip(a, b))


def load_packed_weights(path: Path, device) -> dict:
    from safetensors.torch import load_file

    if not Path(path).is_file():
        raise EngineError(f"{path}: decoder weights are missing")
    try:
        return load_file(str(path), device=str(device))
    except Exception as e:
        raise EngineError(f"{path}: decoder weights cannot be read ({str(e).splitlines()[0][:200]})") from None


AWQ_PARTS = ("qweight", "qzeros", "scales")


def awq_tensors(reader: TensorReader, spec: DecoderSpec, where: Path, dtype, progress=None) -> dict:
    """Runtime tensors of an AWQ GEMM decoder: packed linears fused along the output axis (AutoAWQ packs
    each run of 8 output columns on its own, so concatenation is exact), float tensors cast to `dtype`."""
    import torch

    from ..progress import ensure

    progress = ensure(progress)
    out: dict = {}
    used: set[str] = set()

    def take(name):
        if name not in reader:
            raise CheckpointError(f"{where}: decoder tensor {name!r} is missing")
        used.add(name)
        return reader.get(name)

    task = progress.task("build-llm: packing AWQ decoder layers", total=spec.num_layers)
    for i in [None] + list(range(spec.num_layers)):
        for template, sources in spec.tensor_sources.items():
            if ("{i}" in template) != (i is not None) or (i is not None and i not in spec.layers_with(template)):
                continue
            rt = template.format(i=i)
            parts = [s.format(i=i) for s in sources]
            if rt.endswith(".weight") and f"{parts[0][:-len('.weight')]}.qweight" in reader:
                mods = [p[:-len(".weight")] for p in parts]
                for suffix in AWQ_PARTS:
                    t = torch.cat([take(f"{m}.{suffix}") for m in mods], 1)
                    out[f"{rt[:-len('.weight')]}.{suffix}"] = t.to(torch.float16 if suffix == "scales" else torch.int32)
            else:
                out[rt] = torch.cat([take(p) for p in parts], 0).to(dtype)
        if i is not None:
            task.advance()
    task.done()
    leftovers = sorted(set(reader.names()) - used - ({"lm_head.weight"} if spec.tie_word_embeddings else set()))
    if leftovers:
        raise CheckpointError(f"{where}: decoder has {len(leftovers)} tensor(s) the runtime does not use, "
                              f"e.g. {leftovers[:3]}")
    return out
