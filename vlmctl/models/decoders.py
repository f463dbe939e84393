"""Decoder (language-model) families: Llama-style causal LMs that the VLMs wrap.

What this module knows per decoder family: how a Hugging Face config maps to the embedded
runtime's config, the tensor names of one layer (fused into the runtime layout at build time),
and the AWQ layer groups (which linears share an input, which op absorbs the inverse scale).
"""

from __future__ import annotations

from dataclasses import dataclass, field

from ..errors import UnsupportedModelError


@dataclass(frozen=True)
class AwqGroup:
    """Linears that read the same input, and the op before them that absorbs 1/scale.

    Names are relative to one decoder layer. `module` is the block whose output measures the
    loss during the scale search (AutoAWQ's `module2inspect`); None means the single linear.
    """

    prev_op: str
    linears: tuple[str, ...]
    module: str | None
    # o_proj after v_proj only works when their shapes agree (not under grouped-query attention).
    requires_equal_shapes: bool = False


@dataclass(frozen=True)
class DecoderFamily:
    model_types: tuple[str, ...]
    qkv_bias: bool = False
    layer_prefix: str = "model.layers"
    awq_groups: tuple[AwqGroup, ...] = field(default_factory=tuple)
    # HF causal-LM class name, used to load a decoder checkpoint with transformers.
    causal_lm_class: str = "LlamaForCausalLM"
    decoder_layer_class: str = "LlamaDecoderLayer"

    # Names of one layer's tensors in the HF checkpoint (relative to the layer).
    q, k, v, o = "self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj", "self_attn.o_proj"
    gate, up, down = "mlp.gate_proj", "mlp.up_proj", "mlp.down_proj"
    input_norm, post_norm = "input_layernorm", "post_attention_layernorm"

    def clip_skip(self) -> tuple[str, ...]:
        """Linears AWQ's clip search leaves alone (q/k: their outputs meet in a softmax)."""
        return (self.q, self.k)


_LLAMA_GROUPS = (
    AwqGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    AwqGroup("self_attn.v_proj", ("self_attn.o_proj",), None, requires_equal_shapes=True),
    AwqGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    AwqGroup("mlp.up_proj", ("mlp.down_proj",), None),
)

DECODER_FAMILIES: dict[str, DecoderFamily] = {
    "llama": DecoderFamily(("llama",), awq_groups=_LLAMA_GROUPS),
    "mistral": DecoderFamily(("mistral",), awq_groups=_LLAMA_GROUPS, causal_lm_class="MistralForCausalLM",
                             decoder_layer_class="MistralDecoderLayer"),
    "qwen2": DecoderFamily(("qwen2",), qkv_bias=True, awq_groups=_LLAMA_GROUPS, causal_lm_class="Qwen2ForCausalLM",
                           decoder_layer_class="Qwen2DecoderLayer"),
}


def decoder_family(model_type: str) -> DecoderFamily:
    for fam in DECODER_FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    known = ", ".join(t for f in DECODER_FAMILIES.values() for t in f.model_types)
    raise UnsupportedModelError(f"unsupported decoder model_type {model_type!r} (supported: {known})")


def decoder_spec(text_cfg: dict, awq=None):
    """The runtime's `DecoderSpec` of a Hugging Face decoder config (plain dict); `awq`: its AwqGemmConfig."""
    from ..formats.torch_layout import DecoderSpec

    fam = decoder_family(text_cfg.get("model_type", ""))
    hidden = text_cfg["hidden_size"]
    heads = text_cfg["num_attention_heads"]
    head_dim = text_cfg.get("head_dim") or hidden // heads
    if text_cfg.get("hidden_act", "silu") not in ("silu", "swish"):
        raise UnsupportedModelError(f"decoder activation {text_cfg.get('hidden_act')!r} is not supported (only silu)")
    qkv_bias = fam.qkv_bias or bool(text_cfg.get("attention_bias", False))
    tie = bool(text_cfg.get("tie_word_embeddings", False))
    inv_freq, scaling = rotary_tables(text_cfg)
    rope = text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling") or {}
    mrope = rope.get("mrope_section")
    lp = fam.layer_prefix + ".{i}"
    sources = {"embed": ("model.embed_tokens.weight",), "norm": ("model.norm.weight",)}
    if not tie:
        sources["lm_head"] = ("lm_head.weight",)
    sources.update({
        "layers.{i}.input_norm": (f"{lp}.{fam.input_norm}.weight",),
        "layers.{i}.post_norm": (f"{lp}.{fam.post_norm}.weight",),
        "layers.{i}.qkv.weight": tuple(f"{lp}.{n}.weight" for n in (fam.q, fam.k, fam.v)),
        "layers.{i}.o.weight": (f"{lp}.{fam.o}.weight",),
        "layers.{i}.gate_up.weight": tuple(f"{lp}.{n}.weight" for n in (fam.gate, fam.up)),
        "layers.{i}.down.weight": (f"{lp}.{fam.down}.weight",),
    })
    if qkv_bias:
        sources["layers.{i}.qkv.bias"] = tuple(f"{lp}.{n}.bias" for n in (fam.q, fam.k, fam.v))
    return DecoderSpec(
        model_type=text_cfg["model_type"], hidden_size=hidden, intermediate_size=text_cfg["intermediate_size"],
        num_layers=text_cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=text_cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        vocab_size=text_cfg["vocab_size"], rms_norm_eps=text_cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=text_cfg.get("max_position_embeddings", 4096), tie_word_embeddings=tie,
        qkv_bias=qkv_bias, activation="silu", norm="rms", rope_inv_freq=tuple(float(x) for x in inv_freq.tolist()),
        rope_attention_scaling=scaling, mrope_section=tuple(mrope) if mrope else None, tensor_sources=sources,
        quantization=None if awq is None else {"method": "awq", "bits": awq.bits, "group_size": awq.group_size,
                                               "layout": "awq-gemm"})


def rotary_tables(text_cfg: dict):
    """(inv_freq, attention_scaling) computed by transformers' own rotary class for this config.

    Using transformers' implementation keeps every rope_scaling variant (llama3, yarn, linear)
    exactly as the reference computes it.
    """
    import importlib

    import torch
    import transformers

    fam = decoder_family(text_cfg["model_type"])
    rope = text_cfg.get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" in rope:
        # M-RoPE only regroups the same frequencies per position component; the decoder's own config
        # class does not know the key and would warn about it.
        text_cfg = {**text_cfg, "rope_parameters": {k: v for k, v in rope.items() if k != "mrope_section"}}
    cfg_cls = transformers.AutoConfig.for_model(**{**text_cfg, "model_type": text_cfg["model_type"]}).__class__
    cfg = cfg_cls(**{k: v for k, v in text_cfg.items() if k != "model_type"})
    mod = importlib.import_module(f"transformers.models.{text_cfg['model_type']}.modeling_{text_cfg['model_type']}")
    rotary_cls = getattr(mod, fam.decoder_layer_class.replace("DecoderLayer", "RotaryEmbedding"))
    rot = rotary_cls(config=cfg)
    inv_freq = rot.inv_freq.detach().to(torch.float32).clone()
    scaling = float(getattr(rot, "attention_scaling", 1.0))
    return inv_freq, scaling
