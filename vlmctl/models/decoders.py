"""Decoder (language-model) families: the causal LMs that the VLMs wrap (Llama, Mistral, Qwen2, Gemma 3,
Llama 3.2 Vision's text model with its cross-attention layers).

What this module knows per decoder family: how a Hugging Face config maps to the embedded
runtime's `DecoderSpec` (shape and every variant: norm kind, activation, embedding scale, q/k and
sandwich norms, sliding-window layers and their rotary, softcapping, cross-attention layers), the
tensor names of one layer (fused into the runtime layout at build time), the AWQ layer groups
(which linears share an input, which op absorbs the inverse scale; per layer kind) and what the
AWQ calibration pass feeds each layer.
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

    @property
    def scaled(self) -> bool:
        """False for linears no op of the layer feeds (a cross-attention layer's k/v read the image
        states): nothing can absorb 1/s, so they are quantized (clipped) without a scale search."""
        return bool(self.prev_op)


# HF activation names -> the runtime's. GELU's tanh approximation is torch's own (not "gelu_new", which
# transformers computes with its own formula and rounds differently).
HF_ACTIVATIONS = {"silu": "silu", "swish": "silu", "gelu_pytorch_tanh": "gelu_tanh"}
# HF layer types -> the runtime's
HF_LAYER_TYPES = {"full_attention": "full", "sliding_attention": "sliding"}
CROSS_ATTENTION = "cross_attention"  # the DecoderSpec's layer type of a gated cross-attention layer


@dataclass(frozen=True)
class DecoderFamily:
    model_types: tuple[str, ...]
    qkv_bias: bool = False
    layer_prefix: str = "model.layers"
    awq_groups: tuple[AwqGroup, ...] = field(default_factory=tuple)
    # HF causal-LM class name, used to load a decoder checkpoint with transformers.
    causal_lm_class: str = "LlamaForCausalLM"
    decoder_layer_class: str = "LlamaDecoderLayer"
    hf_module: str | None = None  # transformers.models.<this> when it is not named after the model_type

    # Names of one layer's tensors in the HF checkpoint (relative to the layer).
    q: str = "self_attn.q_proj"
    k: str = "self_attn.k_proj"
    v: str = "self_attn.v_proj"
    o: str = "self_attn.o_proj"
    gate: str = "mlp.gate_proj"
    up: str = "mlp.up_proj"
    down: str = "mlp.down_proj"
    input_norm: str = "input_layernorm"
    post_norm: str = "post_attention_layernorm"  # the norm before the MLP
    attn_out_norm: str | None = None  # sandwich norms: on the attention / MLP output before the residual add
    mlp_out_norm: str | None = None
    q_norm: str | None = None  # per-head q/k norms before rotary
    k_norm: str | None = None

    # Variants (see DecoderSpec): how the config's values become the spec's.
    norm: str = "rms"
    activation_key: str = "hidden_act"  # the config key naming the MLP activation
    embed_scale_sqrt_hidden: bool = False  # token embeddings times sqrt(hidden_size)
    attention_scalar_key: str | None = None  # config key s: softmax scale s ** -0.5 instead of head_dim ** -0.5
    layer_types: bool = False  # per-layer full / sliding attention (config layer_types), rotary per layer type
    final_softcap_key: str | None = None  # config key of the final logit softcap
    rotary_class: str | None = None  # transformers' rotary class when not named after decoder_layer_class
    extra_embed_rows: int = 0  # token-embedding rows beyond vocab_size (ids the LM head never produces)

    # Gated cross-attention layers (layer type "cross_attention"): the config key listing them, and the
    # HF names of one such layer's tensors. Their MLP and norms use the names above.
    cross_layers_key: str | None = None
    cross_q: str = "cross_attn.q_proj"
    cross_k: str = "cross_attn.k_proj"
    cross_v: str = "cross_attn.v_proj"
    cross_o: str = "cross_attn.o_proj"
    cross_q_norm: str = "cross_attn.q_norm"
    cross_k_norm: str = "cross_attn.k_norm"
    cross_attn_gate: str = "cross_attn_attn_gate"
    cross_mlp_gate: str = "cross_attn_mlp_gate"
    cross_awq_groups: tuple[AwqGroup, ...] = field(default_factory=tuple)

    def clip_skip(self) -> tuple[str, ...]:
        """Linears AWQ's clip search leaves alone (q/k: their outputs meet in a softmax)."""
        return (self.q, self.k, self.cross_q, self.cross_k)

    def groups_for(self, layer_type: str) -> tuple[AwqGroup, ...]:
        """AWQ groups of a layer of this spec layer type."""
        return self.cross_awq_groups if layer_type == CROSS_ATTENTION else self.awq_groups

    @property
    def norm_gain_offset(self) -> float:
        """The norm multiplies by (offset + w): what AWQ must keep when it folds a scale into w."""
        return 1.0 if self.norm == "rms_one_plus" else 0.0


_LLAMA_GROUPS = (
    AwqGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    AwqGroup("self_attn.v_proj", ("self_attn.o_proj",), None, requires_equal_shapes=True),
    AwqGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    AwqGroup("mlp.up_proj", ("mlp.down_proj",), None),
)

# Gemma 3: the MLP's input norm is pre_feedforward_layernorm (post_attention_layernorm normalizes the
# attention output itself). AWQ folds 1/s into (1 + w) of the (1 + w) norms (AutoAWQ's Gemma rule).
_GEMMA3_GROUPS = (
    AwqGroup("input_layernorm", ("self_attn.q_proj", "self_attn.k_proj", "self_attn.v_proj"), "self_attn"),
    AwqGroup("self_attn.v_proj", ("self_attn.o_proj",), None, requires_equal_shapes=True),
    AwqGroup("pre_feedforward_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    AwqGroup("mlp.up_proj", ("mlp.down_proj",), None),
)

# A gated cross-attention layer (Llama 3.2 Vision): q reads the normed hidden states; k and v read the
# image states, which no op of the decoder feeds, so they get no scale (clipped and quantized as they
# are); o after v as in self-attention; the MLP as Llama's.
_MLLAMA_CROSS_GROUPS = (
    AwqGroup("input_layernorm", ("cross_attn.q_proj",), None),
    AwqGroup("", ("cross_attn.k_proj", "cross_attn.v_proj"), None),
    AwqGroup("cross_attn.v_proj", ("cross_attn.o_proj",), None, requires_equal_shapes=True),
    AwqGroup("post_attention_layernorm", ("mlp.gate_proj", "mlp.up_proj"), "mlp"),
    AwqGroup("mlp.up_proj", ("mlp.down_proj",), None),
)

DECODER_FAMILIES: dict[str, DecoderFamily] = {
    "llama": DecoderFamily(("llama",), awq_groups=_LLAMA_GROUPS),
    "mistral": DecoderFamily(("mistral",), awq_groups=_LLAMA_GROUPS, causal_lm_class="MistralForCausalLM",
                             decoder_layer_class="MistralDecoderLayer"),
    "qwen2": DecoderFamily(("qwen2",), qkv_bias=True, awq_groups=_LLAMA_GROUPS, causal_lm_class="Qwen2ForCausalLM",
                           decoder_layer_class="Qwen2DecoderLayer"),
    # Gemma 3's text decoder (transformers' Gemma3ForCausalLM / Gemma3TextModel). Its config's
    # attn_logit_softcapping is not read: transformers 5's Gemma3Attention never applies it.
    "gemma3_text": DecoderFamily(("gemma3_text",), awq_groups=_GEMMA3_GROUPS, causal_lm_class="Gemma3ForCausalLM",
                                 decoder_layer_class="Gemma3DecoderLayer", hf_module="gemma3",
                                 post_norm="pre_feedforward_layernorm", attn_out_norm="post_attention_layernorm",
                                 mlp_out_norm="post_feedforward_layernorm", q_norm="self_attn.q_norm",
                                 k_norm="self_attn.k_norm", norm="rms_one_plus", activation_key="hidden_activation",
                                 embed_scale_sqrt_hidden=True, attention_scalar_key="query_pre_attn_scalar",
                                 layer_types=True, final_softcap_key="final_logit_softcapping"),
    # Llama 3.2 Vision's text model (transformers' MllamaForCausalLM): Llama self-attention layers with
    # gated cross-attention layers at config.cross_attention_layers; 8 token-embedding rows beyond the
    # vocabulary (`<|image|>` is the first).
    "mllama_text_model": DecoderFamily(("mllama_text_model",), awq_groups=_LLAMA_GROUPS,
                                       causal_lm_class="MllamaForCausalLM",
                                       decoder_layer_class="MllamaSelfAttentionDecoderLayer", hf_module="mllama",
                                       rotary_class="MllamaRotaryEmbedding", extra_embed_rows=8,
                                       cross_layers_key="cross_attention_layers",
                                       cross_awq_groups=_MLLAMA_CROSS_GROUPS),
}


def decoder_family(model_type: str) -> DecoderFamily:
    for fam in DECODER_FAMILIES.values():
        if model_type in fam.model_types:
            return fam
    known = ", ".join(t for f in DECODER_FAMILIES.values() for t in f.model_types)
    raise UnsupportedModelError(f"unsupported decoder model_type {model_type!r} (supported: {known})")


def is_decoder_config(config: dict) -> bool:
    """Whether a config.json is a plain decoder's (a causal LM of a supported decoder family) rather than a
    whole VLM's."""
    return config.get("model_type") in {t for f in DECODER_FAMILIES.values() for t in f.model_types}


def decoder_spec(text_cfg: dict, awq=None):
    """The runtime's `DecoderSpec` of a Hugging Face decoder config (plain dict); `awq`: its AwqGemmConfig."""
    from ..formats.torch_layout import DecoderSpec

    fam = decoder_family(text_cfg.get("model_type", ""))
    hidden = text_cfg["hidden_size"]
    heads = text_cfg["num_attention_heads"]
    head_dim = text_cfg.get("head_dim") or hidden // heads
    act = text_cfg.get(fam.activation_key, "silu")
    if act not in HF_ACTIVATIONS:
        raise UnsupportedModelError(f"decoder activation {act!r} is not supported "
                                    f"(supported: {', '.join(HF_ACTIVATIONS)})")
    if text_cfg.get("use_bidirectional_attention"):
        raise UnsupportedModelError("decoders with bidirectional text attention (use_bidirectional_attention) are "
                                    "embedding models, not generators")
    # transformers' attention_bias (Llama, Gemma 3) puts a bias on o_proj as well as on q/k/v, and mlp_bias one on
    # every MLP linear: the runtime has neither (only the q/k/v bias Qwen2 always has). Refused here, as an
    # unsupported variant, rather than later as a checkpoint with tensors the runtime does not use.
    for key, what in (("attention_bias", "biases on the attention linears, o_proj included"),
                      ("mlp_bias", "biases on the MLP linears")):
        if text_cfg.get(key):
            raise UnsupportedModelError(f"decoder {key}=true ({what}) is not supported")
    qkv_bias = fam.qkv_bias
    tie = bool(text_cfg.get("tie_word_embeddings", False))
    rope = text_cfg.get("rope_parameters") or text_cfg.get("rope_scaling") or {}
    mrope = rope.get("mrope_section")
    variants: dict = {}
    if fam.layer_types:
        hf_cfg = hf_text_config(text_cfg)
        kinds = [HF_LAYER_TYPES.get(t) for t in hf_cfg.layer_types]
        if None in kinds:
            raise UnsupportedModelError(f"decoder layer types {sorted(set(hf_cfg.layer_types))} are not supported "
                                        f"(supported: {', '.join(HF_LAYER_TYPES)})")
        inv_freq, scaling = rotary_tables(text_cfg, "full_attention")
        variants["layer_types"] = tuple(kinds)
        if "sliding" in kinds:
            local, local_scaling = rotary_tables(text_cfg, "sliding_attention")
            variants.update(sliding_window=int(hf_cfg.sliding_window),
                            rope_local_inv_freq=tuple(float(x) for x in local.tolist()),
                            rope_local_attention_scaling=local_scaling)
    else:
        inv_freq, scaling = rotary_tables(text_cfg)
        variants.update(sliding_window_layers(text_cfg))
    cross = sorted(set(text_cfg.get(fam.cross_layers_key) or [])) if fam.cross_layers_key else []
    if cross:
        n_layers = text_cfg["num_hidden_layers"]
        if cross[0] < 0 or cross[-1] >= n_layers:
            raise UnsupportedModelError(f"decoder {fam.cross_layers_key} {cross} name layers outside 0..{n_layers - 1}")
        variants["layer_types"] = tuple(CROSS_ATTENTION if i in cross else "full" for i in range(n_layers))
    if fam.extra_embed_rows:
        variants["embed_rows"] = text_cfg["vocab_size"] + fam.extra_embed_rows
    if fam.embed_scale_sqrt_hidden:
        variants["embed_scale"] = hidden ** 0.5  # transformers' own expression (a Python float)
    if fam.attention_scalar_key:
        variants["attention_scale"] = text_cfg[fam.attention_scalar_key] ** -0.5
    if fam.final_softcap_key and text_cfg.get(fam.final_softcap_key) is not None:
        variants["final_logit_softcap"] = float(text_cfg[fam.final_softcap_key])
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
    if fam.attn_out_norm:
        sources["layers.{i}.attn_out_norm"] = (f"{lp}.{fam.attn_out_norm}.weight",)
        sources["layers.{i}.mlp_out_norm"] = (f"{lp}.{fam.mlp_out_norm}.weight",)
    if fam.q_norm:
        sources["layers.{i}.q_norm"] = (f"{lp}.{fam.q_norm}.weight",)
        sources["layers.{i}.k_norm"] = (f"{lp}.{fam.k_norm}.weight",)
    if qkv_bias:
        sources["layers.{i}.qkv.bias"] = tuple(f"{lp}.{n}.bias" for n in (fam.q, fam.k, fam.v))
    if cross:
        sources.update({
            "layers.{i}.cross_q.weight": (f"{lp}.{fam.cross_q}.weight",),
            "layers.{i}.cross_kv.weight": (f"{lp}.{fam.cross_k}.weight", f"{lp}.{fam.cross_v}.weight"),
            "layers.{i}.cross_o.weight": (f"{lp}.{fam.cross_o}.weight",),
            "layers.{i}.cross_q_norm": (f"{lp}.{fam.cross_q_norm}.weight",),
            "layers.{i}.cross_k_norm": (f"{lp}.{fam.cross_k_norm}.weight",),
            "layers.{i}.cross_attn_gate": (f"{lp}.{fam.cross_attn_gate}",),
            "layers.{i}.cross_mlp_gate": (f"{lp}.{fam.cross_mlp_gate}",),
        })
    spec = DecoderSpec(
        model_type=text_cfg["model_type"], hidden_size=hidden, intermediate_size=text_cfg["intermediate_size"],
        num_layers=text_cfg["num_hidden_layers"], num_heads=heads,
        num_kv_heads=text_cfg.get("num_key_value_heads") or heads, head_dim=head_dim,
        vocab_size=text_cfg["vocab_size"], rms_norm_eps=text_cfg.get("rms_norm_eps", 1e-6),
        max_position_embeddings=text_cfg.get("max_position_embeddings", 4096), tie_word_embeddings=tie,
        qkv_bias=qkv_bias, activation=HF_ACTIVATIONS[act], norm=fam.norm,
        rope_inv_freq=tuple(float(x) for x in inv_freq.tolist()), rope_attention_scaling=scaling,
        mrope_section=tuple(mrope) if mrope else None, qk_norm=fam.q_norm is not None,
        sandwich_norms=fam.attn_out_norm is not None, tensor_sources=sources,
        quantization=None if awq is None else {"method": "awq", "bits": awq.bits, "group_size": awq.group_size,
                                               "layout": "awq-gemm"}, **variants)
    spec.validate()
    return spec


def sliding_window_layers(text_cfg: dict) -> dict:
    """DecoderSpec variants (layer_types, sliding_window) of a decoder whose config class has a sliding window
    (Mistral, Qwen2), as transformers applies it; {} for full attention everywhere. Mistral's model puts every
    layer in the window when `sliding_window` is set (its config class defaults it to 4096); Qwen2's config
    class derives per-layer `layer_types` (use_sliding_window, max_window_layers). Both keep one rotary."""
    cfg = hf_text_config(text_cfg)
    window = getattr(cfg, "sliding_window", None)
    if not window:
        return {}
    hf_types = getattr(cfg, "layer_types", None) or ["sliding_attention"] * cfg.num_hidden_layers
    kinds = tuple(HF_LAYER_TYPES.get(t) for t in hf_types)
    if None in kinds or len(kinds) != cfg.num_hidden_layers:
        raise UnsupportedModelError(f"decoder layer types {sorted(set(hf_types))} are not supported "
                                    f"(supported: {', '.join(HF_LAYER_TYPES)})")
    if "sliding" not in kinds:
        return {}
    if int(window) <= 0:
        raise UnsupportedModelError(f"decoder sliding_window {window} is not a positive number of positions")
    return {"layer_types": kinds, "sliding_window": int(window)}


def hf_text_config(text_cfg: dict):
    """The transformers config object of a decoder config dict (its own class fills derived values)."""
    import transformers

    rope = text_cfg.get("rope_parameters")
    if isinstance(rope, dict) and "mrope_section" in rope:
        # M-RoPE only regroups the same frequencies per position component; the decoder's own config
        # class does not know the key and would warn about it.
        text_cfg = {**text_cfg, "rope_parameters": {k: v for k, v in rope.items() if k != "mrope_section"}}
    cfg_cls = transformers.AutoConfig.for_model(**{**text_cfg, "model_type": text_cfg["model_type"]}).__class__
    return cfg_cls(**{k: v for k, v in text_cfg.items() if k != "model_type"})


def rotary_tables(text_cfg: dict, layer_type: str | None = None):
    """(inv_freq, attention_scaling) computed by transformers' own rotary class for this config
    (`layer_type`: the table of that HF layer type, for decoders with one rotary per layer type).

    Using transformers' implementation keeps every rope_scaling variant (llama3, yarn, linear)
    exactly as the reference computes it.
    """
    import importlib

    import torch

    fam = decoder_family(text_cfg["model_type"])
    cfg = hf_text_config(text_cfg)
    name = fam.hf_module or text_cfg["model_type"]
    mod = importlib.import_module(f"transformers.models.{name}.modeling_{name}")
    rotary_cls = getattr(mod, fam.rotary_class or fam.decoder_layer_class.replace("DecoderLayer", "RotaryEmbedding"))
    rot = rotary_cls(config=cfg)
    prefix = f"{layer_type}_" if layer_type else ""
    inv_freq = getattr(rot, f"{prefix}inv_freq").detach().to(torch.float32).clone()
    scaling = float(getattr(rot, f"{prefix}attention_scaling", 1.0))
    return inv_freq, scaling


def rotary_position_limit(text_cfg: dict) -> int | None:
    """Positions up to which `rotary_tables`' one table is what transformers computes, for rope types whose
    frequencies depend on the sequence's length (transformers switches tables once a sequence passes this:
    `dynamic` NTK past max_position_embeddings, `longrope` past original_max_position_embeddings); None where
    the table never changes."""
    cfg = hf_text_config(text_cfg)
    rope = getattr(cfg, "rope_parameters", None) or getattr(cfg, "rope_scaling", None) or {}
    kind = rope.get("rope_type") or rope.get("type")
    if kind == "dynamic":
        return int(cfg.max_position_embeddings)
    if kind == "longrope":
        return int(rope.get("original_max_position_embeddings")
                   or getattr(cfg, "original_max_position_embeddings", None) or cfg.max_position_embeddings)
    return None


def calibration_layer_kwargs(family: DecoderFamily, hf_config, rotary, x, positions) -> list[dict]:
    """Keyword arguments of each HF decoder layer in AWQ's calibration pass over x [n, T, H] at 1-D
    `positions` [1, T]: rotary cos/sin (per layer type where the family has several) and, for
    sliding-window layers shorter than T, their window as a boolean mask; None: causal."""
    import torch

    T = x.shape[1]

    def window_mask(window):  # boolean [1, 1, T, T], True where a query may look; None: causal
        if window is None or window >= T:
            return None
        i = torch.arange(T, device=x.device)
        return ((i[None] <= i[:, None]) & (i[None] > i[:, None] - window))[None, None]

    if not family.layer_types:  # one rotary; Mistral's and Qwen2's sliding windows per layer, as in the runtime
        cos, sin = rotary(x[:1], positions)
        sliding = sliding_window_layers(hf_config.to_dict())
        masks = {"full": None, "sliding": window_mask(sliding.get("sliding_window"))}
        kinds = sliding.get("layer_types") or ("full",) * hf_config.num_hidden_layers
        return [{"position_embeddings": (cos, sin), "attention_mask": masks[k], "position_ids": positions}
                for k in kinds]
    out, tables = [], {}
    for t in hf_config.layer_types:
        if t not in tables:
            window = hf_config.sliding_window if t == "sliding_attention" else None
            tables[t] = {"position_embeddings": rotary(x[:1], positions, t), "attention_mask": window_mask(window),
                         "position_ids": positions}
        out.append(tables[t])
    return out
