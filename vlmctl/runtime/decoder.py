"""The embedded decoder: a Llama-style transformer (and its variants, e.g. Gemma 3's) over a paged KV cache.

A forward pass takes a flat batch of token chunks from several sequences (whole or chunked
prompts, single decode tokens, recomputation after preemption) and returns logits for the chunks
that end a sequence's known tokens. K/V go straight into the block pool at each token's slot;
attention reads them back through the sequence's block table. Ids >= vocab_size index the
prompt-embedding table (TensorRT-LLM's prompt-tuning contract, `vlmctl.formats.prompt_table`).

On CUDA, a batch of decode rows (one new token per sequence) replays a CUDA graph captured per
batch-size bucket; where `capture_step_graphs` ran, a step with prompt rows replays one captured per
row bucket (`vlmctl.runtime.step_graphs`); the small operations run as fused Triton kernels (`vlmctl.runtime.ops`);
on the CPU the same code runs the torch references. What the decoder is (shape, variants, tensor
names) comes from its `DecoderSpec`; this module knows no model by name. Variants it runs: the norm
kind, the MLP activation, an embedding scale, q/k norms before rotary, sandwich norms around
attention and MLP, the softmax scale, sliding-window layers with their own rotary table (the window
holds in prefill and decode), rows of one image attending to each other during prefill, a final
logit softcap, and gated cross-attention layers.

Cross-attention layers (Llama 3.2 Vision) read a request's image states instead of prompt rows.
Their keys and values are computed once per request (`write_cross_kv`, at admission) into a second
paged pool, `[cross layers, blocks, block_size, kv heads, head dim]`, through the request's own
cross block table; they have no self-attention and no slice of the self-attention pool. A chunk
that sees images carries `CrossRows`: per row, the range of the request's image rows it attends
(`vlmctl.runtime.cross_kv` orders them so that it is one range) and whether its MLP output counts.
Rows of requests without images skip these layers, as transformers skips them for text-only
prompts: the eager forward computes them for the rows that see images only; a captured decode step
computes them for every row and multiplies the others' outputs by 0 (exact). A decode batch without
any image request replays a graph captured without them.
"""

from __future__ import annotations

import logging
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch
import torch.nn.functional as F

from ..errors import EngineError
from ..formats.torch_layout import DecoderSpec, read_layout, torch_dtype, weights_location
from ..host import cuda_graphs_allowed
from . import kv_quant, ops
from .transfers import to_device


class Linear:
    """A float linear [out, in] (+ bias). gemv: run one-row calls through the Triton GEMV
    (`kernels.gemv`; the decoder sets it on CUDA where `kernels.gemv.preferred` says so); gemv_silu (a
    down_proj): the GEMV that reads silu(gate) * up from the gate_up row itself is the one measured faster."""

    gemv = False
    gemv_silu = False

    def __init__(self, weight: torch.Tensor, bias: torch.Tensor | None = None):
        self.weight, self.bias = weight, bias
        self.out_features = weight.shape[0]

    def __call__(self, x):
        if self.gemv and x.dim() == 2 and x.shape[0] == 1:
            from .kernels.gemv import gemv

            return gemv(x, self.weight, self.bias)
        return F.linear(x, self.weight, self.bias)

    def silu_mul(self, gate_up):
        """self(silu(gate) * up) from a gate_up output [T, 2I]: one-row calls with `gemv` fuse the
        SiLU·mul into the GEMV (no separate kernel, no intermediate)."""
        if self.gemv_silu and gate_up.dim() == 2 and gate_up.shape[0] == 1:
            from .kernels.gemv import gemv

            return gemv(gate_up, self.weight, self.bias, silu=True)
        return self(ops.act_mul(gate_up, "silu"))

    def act_mul(self, x, activation: str):
        """act(gate) * up of this gate_up linear's output [T, 2I] -> [T, I]."""
        return ops.act_mul(self(x), activation)

    def tensors(self):
        yield self.weight
        if self.bias is not None:
            yield self.bias


class W4A16Linear:
    """A 4-bit AWQ linear kept packed on the GPU (`vlmctl.runtime.kernels.w4a16`)."""

    def __init__(self, packed: dict, group_size: int, bias: torch.Tensor | None = None):
        self.packed, self.group_size, self.bias = packed, group_size, bias
        self.out_features = packed["q4weight"].shape[0]

    def __call__(self, x):
        from .kernels.w4a16 import w4a16_linear

        return w4a16_linear(x, self.packed, self.group_size, self.bias)

    def act_mul(self, x, activation: str):
        """act(gate) * up of this gate_up linear's output: in the GEMV's epilogue where
        `w4a16_act_mul` can (batch-1 decode), else the linear and then the act·mul kernel."""
        from .kernels.w4a16 import w4a16_act_mul

        y = w4a16_act_mul(x, self.packed, self.group_size, activation, self.bias)
        return y if y is not None else ops.act_mul(self(x), activation)

    def tensors(self):
        yield from self.packed.values()
        if self.bias is not None:
            yield self.bias


def awq_linear(tensors: dict, prefix: str, spec: DecoderSpec, dtype, device, bias=None):
    """An AWQ linear from the engine's packed tensors: kept packed for the W4A16 kernels on a GPU,
    dequantized once at load elsewhere (the CPU computes in the engine's float dtype)."""
    from .kernels.w4a16 import KEYS, dequantize

    group = (spec.quantization or {})["group_size"]
    packed = {k: tensors.pop(f"{prefix}.{k}") for k in KEYS}
    if device.type == "cuda" and dtype in (torch.float16, torch.bfloat16) and ops.triton_available():
        return W4A16Linear({k: v.to(device) for k, v in packed.items()}, group, bias)
    return Linear(dequantize(packed, group, dtype).to(device).contiguous(), bias)


@dataclass
class Layer:
    input_norm: torch.Tensor
    post_norm: torch.Tensor
    qkv: Linear | None  # None in a cross-attention layer
    o: Linear | None
    gate_up: Linear
    down: Linear
    q_norm: torch.Tensor | None = None
    k_norm: torch.Tensor | None = None
    attn_out_norm: torch.Tensor | None = None
    mlp_out_norm: torch.Tensor | None = None
    window: int | None = None  # sliding-window layer: keys at most this many positions back, itself included
    cos_sin: torch.Tensor | None = None  # its rotary table (float32 [P, d])
    cache_index: int | None = None  # its slice of the self-attention KV pool (None: a cross-attention layer)
    cross: "CrossLayer | None" = None


@dataclass
class CrossLayer:
    """The cross-attention parts of a gated cross-attention layer (its norms and MLP are the Layer's)."""

    q: Linear
    kv: Linear  # k|v, applied to image states at admission
    o: Linear
    q_norm: torch.Tensor
    k_norm: torch.Tensor
    attn_gate: torch.Tensor  # tanh(gate) in the model dtype, [1]
    mlp_gate: torch.Tensor
    cache_index: int  # its slice of the cross-attention KV pool


@dataclass
class CrossRows:
    """How the rows of one chunk see their request's image states (see `vlmctl.runtime.cross_kv`):
    row r attends image rows [lo[r], hi[r]) of the request's cross KV (`block_table` into the cross
    pool); `mlp[r]` False: the row sees no image yet, its cross-attention MLP output is zeroed."""

    block_table: list[int]
    lo: np.ndarray
    hi: np.ndarray
    mlp: np.ndarray


@dataclass
class Chunk:
    """Tokens of one sequence to run in this forward pass.

    `start` is the cache index of the first token (tokens before it are already in the cache);
    `positions` are their rotary positions, [n] or, for multimodal rotary, [3, n]."""

    ids: np.ndarray
    positions: np.ndarray
    start: int
    block_table: list[int]
    table: torch.Tensor | None = None  # the sequence's prompt-embedding rows (fake ids index it)
    want_logits: bool = True
    cross: CrossRows | None = None  # for a sequence with image states in cross-attention layers

    @property
    def n(self) -> int:
        return len(self.ids)

    @property
    def is_decode(self) -> bool:
        return self.n == 1 and self.start > 0


def cos_sin_table(inv_freq: torch.Tensor, scaling: float, positions: torch.Tensor) -> torch.Tensor:
    """float32 [P, d]: cos | sin halves of the rotary angles at `positions` ([P] or [3, P] per section)."""
    freqs = positions[..., None].float() * inv_freq
    return torch.cat((freqs.cos() * scaling, freqs.sin() * scaling), -1)


def image_blocks(ids: np.ndarray, vocab_size: int) -> np.ndarray | None:
    """Per row of a chunk: the index of its run of consecutive image rows (ids >= vocab_size), -1 for
    other rows; None without image rows. A run is one image (transformers' Gemma 3 groups image
    tokens the same way: consecutive ones form a block)."""
    img = ids >= vocab_size
    if not img.any():
        return None
    starts = img & ~np.concatenate(([False], img[:-1]))
    return np.where(img, np.cumsum(starts) - 1, -1)


class _CrossBatch:
    """One forward's rows that see image states: `rows` (None: every row), `mlp_mask` [t, 1] (0: the
    row's MLP output is zeroed), `row_scale` [t, 1] or None (0: the row's attention output is
    discarded too), `attend(cross layer index, q [t, Hq, d]) -> [t, Hq, d]`."""

    rows: torch.Tensor | None = None
    mlp_mask: torch.Tensor
    row_scale: torch.Tensor | None = None
    attend = None


class TorchDecoder:
    def __init__(self, spec: DecoderSpec, tensors: dict, *, dtype: torch.dtype, device="cpu", max_seq: int = 2048):
        self.spec = spec
        self.dtype = dtype
        self.device = torch.device(device)
        self.vocab_size = spec.vocab_size
        self.table_base = spec.table_base  # ids from here on index the prompt-embedding table
        self.n_layers, self.n_heads, self.n_kv, self.head_dim = (spec.num_layers, spec.num_heads,
                                                                 spec.num_kv_heads, spec.head_dim)
        self.q_size, self.kv_size = spec.q_size, spec.kv_size
        self.eps = spec.rms_norm_eps
        spec.validate()
        self.scale = spec.attention_scale if spec.attention_scale is not None else spec.head_dim ** -0.5
        self.cross_scale = spec.head_dim ** -0.5
        self.one_plus = spec.norm == "rms_one_plus"
        self.activation = spec.activation
        self.bidirectional_images = spec.image_attention == "bidirectional"
        self.final_softcap = spec.final_logit_softcap
        self.max_seq = max_seq
        t = dict(tensors)
        self.embed = t.pop("embed")
        # transformers multiplies by the scale after casting it to the weights' dtype
        self.embed_scale = (None if spec.embed_scale is None else
                            torch.tensor(spec.embed_scale, dtype=torch.float32).to(self.embed.dtype).to(self.device))
        self.norm = t.pop("norm")
        self.lm_head = self.embed[:spec.vocab_size] if spec.tie_word_embeddings else t.pop("lm_head")
        self.inv_freq = torch.tensor(spec.rope_inv_freq, dtype=torch.float32, device=self.device)
        self.mrope_section = spec.mrope_section
        # cos|sin for every 1-D position a sequence can reach (M-RoPE prompt rows are computed per step)
        n_pos = max(max_seq, spec.max_position_embeddings) + 1
        self.cos_sin = cos_sin_table(self.inv_freq, spec.rope_attention_scaling,
                                     torch.arange(n_pos, device=self.device))
        self.cos_sin_local = self.cos_sin
        if spec.rope_local_inv_freq:
            local = torch.tensor(spec.rope_local_inv_freq, dtype=torch.float32, device=self.device)
            self.cos_sin_local = cos_sin_table(local, spec.rope_local_attention_scaling,
                                               torch.arange(n_pos, device=self.device))
        self.layers = []
        n_self = n_cross = 0
        for i in range(spec.num_layers):
            p = f"layers.{i}"

            def lin(name, bias=None):
                # AWQ engines may keep some layers float (e.g. cross-attention layers by recipe)
                if f"{p}.{name}.q4weight" in t:
                    return awq_linear(t, f"{p}.{name}", spec, dtype, self.device, bias)
                return Linear(t.pop(f"{p}.{name}.weight"), bias)

            mlp = (lin("gate_up"), lin("down"))
            if spec.is_cross(i):
                gates = [torch.tanh(t.pop(f"{p}.cross_{g}_gate")) for g in ("attn", "mlp")]
                cross = CrossLayer(lin("cross_q"), lin("cross_kv"), lin("cross_o"), t.pop(f"{p}.cross_q_norm"),
                                   t.pop(f"{p}.cross_k_norm"), *gates, cache_index=n_cross)
                n_cross += 1
                self.layers.append(Layer(t.pop(f"{p}.input_norm"), t.pop(f"{p}.post_norm"), None, None, *mlp,
                                         cross=cross))
                continue
            bias = t.pop(f"{p}.qkv.bias", None)
            sliding = spec.is_sliding(i)
            # a window no sequence of this engine can outgrow masks nothing: those layers attend in full (the
            # unmasked kernels); the local rotary, where a family has one, stays theirs
            windowed = sliding and spec.sliding_window < max_seq
            layer = Layer(t.pop(f"{p}.input_norm"), t.pop(f"{p}.post_norm"), lin("qkv", bias), lin("o"), *mlp,
                          window=spec.sliding_window if windowed else None,
                          cos_sin=self.cos_sin_local if sliding else self.cos_sin, cache_index=n_self)
            n_self += 1
            if spec.qk_norm:
                layer.q_norm, layer.k_norm = t.pop(f"{p}.q_norm"), t.pop(f"{p}.k_norm")
            if spec.sandwich_norms:
                layer.attn_out_norm, layer.mlp_out_norm = t.pop(f"{p}.attn_out_norm"), t.pop(f"{p}.mlp_out_norm")
            self.layers.append(layer)
        if t:
            raise EngineError(f"decoder weights hold tensors the runtime does not use: {sorted(t)[:3]}")
        self.n_self_layers, self.n_cross_layers = n_self, n_cross
        self.inter = spec.intermediate_size
        self.k_cache = self.v_cache = None
        self.kv_cache_dtype = "auto"  # "fp8", "int8": 8-bit rows, a scale each (kv_quant); before allocate_cache
        self.k_scale = self.v_scale = None  # an 8-bit pool's scales, [layers, blocks, block_size, kv heads] float32
        self.xk_cache = self.xv_cache = None  # the cross-attention pool (always in the model dtype)
        self.block_size = 0
        self.max_cross_rows = 0  # most image rows one sequence's cross KV holds
        self.use_graphs = self.device.type == "cuda" and cuda_graphs_allowed()
        self._graphs: dict[tuple[int, bool], tuple] = {}
        self._graph_pool = None
        self._step_graphs = None  # steps with prompt rows, captured per row bucket (capture_step_graphs)
        self._fused = False  # the fused batch-1 step: not built yet (see _fused_step)
        self.fused_step_reason = None if self.device.type == "cuda" else "not on a GPU"
        self._num_sms = (torch.cuda.get_device_properties(self.device).multi_processor_count
                         if self.device.type == "cuda" else 1)
        # batch-1 float linears run the Triton GEMV where it was measured faster (kernels.gemv.preferred;
        # VLMCTL_GEMV overrides), down_proj with the SiLU·mul fused where that form was the one measured
        # faster, else after the act·mul kernel; W4A16 linears pick their half2 GEMV the same way
        # (kernels.w4a16.select_config)
        self._fuse_silu_down = self.activation == "silu"
        if self.device.type == "cuda":
            from .kernels.gemv import preferred

            for layer in self.layers:
                for lin in self._linears(layer):
                    if isinstance(lin, Linear):
                        lin.gemv_silu = self._fuse_silu_down and lin is layer.down and preferred(lin.weight, silu=True)
                        lin.gemv = lin.gemv_silu or preferred(lin.weight)

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, layout_dir: Path, *, device="cpu", max_seq: int | None = None) -> "TorchDecoder":
        from ..formats.torch_layout import load_hf_weights, load_packed_weights

        layout = read_layout(layout_dir)
        dtype = torch_dtype(layout.dtype)
        src = weights_location(layout_dir, layout)
        if layout.weights["kind"] == "hf":
            tensors = load_hf_weights(src, layout.decoder, device, dtype)
        else:
            tensors = load_packed_weights(src, device)
            tensors = {k: (v.to(dtype) if v.is_floating_point() and not k.endswith((".scales", ".q4scales")) else v)
                       for k, v in tensors.items()}
        limits = layout.extra.get("limits", {})
        max_seq = max_seq or limits.get("max_input_len", 2048) + limits.get("max_output_len", 512)
        return cls(layout.decoder, tensors, dtype=dtype, device=device, max_seq=max_seq)

    @classmethod
    def from_hf_dir(cls, llm_dir: Path, *, dtype: str = "float32", device="cpu", max_seq: int = 2048) -> "TorchDecoder":
        """A float or AWQ-GEMM Hugging Face causal-LM directory (tests, perplexity)."""
        from ..checkpoint import TensorReader, read_config_json

        llm_dir = Path(llm_dir)
        return cls._from_reader(read_config_json(llm_dir), TensorReader(llm_dir), dtype=dtype, device=device,
                                max_seq=max_seq)

    @classmethod
    def from_hf_tensors(cls, text_cfg: dict, tensors: dict, *, dtype: str = "float32", device="cpu",
                        max_seq: int = 2048) -> "TorchDecoder":
        """A decoder from a HF text config and its tensors by causal-LM name, already in memory (the
        decoder part of a whole-VLM checkpoint); float or AWQ GEMM per the config's quantization_config."""
        from ..checkpoint import DictTensorReader

        return cls._from_reader(text_cfg, DictTensorReader(tensors), dtype=dtype, device=device, max_seq=max_seq)

    @classmethod
    def _from_reader(cls, cfg: dict, reader, *, dtype: str, device, max_seq: int) -> "TorchDecoder":
        from ..formats.awq_gemm import AwqGemmConfig
        from ..formats.torch_layout import awq_tensors, load_hf_weights
        from ..models.decoders import decoder_spec

        awq = AwqGemmConfig.from_config(cfg, str(reader.dir / "config.json"))
        spec = decoder_spec(cfg, awq)
        dt = torch_dtype(dtype)
        if awq is None:
            tensors = load_hf_weights(reader, spec, device, dt)
        else:
            from .kernels.w4a16 import repack_gemm_tensors

            spec, tensors = repack_gemm_tensors(spec, awq_tensors(reader, spec, reader.dir, dt))
            tensors = {k: v.to(device) for k, v in tensors.items()}
        return cls(spec, tensors, dtype=dt, device=device, max_seq=max_seq)

    # ---- KV cache ----------------------------------------------------------------------------
    def kv_bytes_per_token(self) -> int:
        """Bytes of self-attention KV per token (cross-attention layers hold none); an 8-bit pool holds one
        byte a value and a float32 scale a row."""
        if self.kv_cache_dtype != "auto":
            return 2 * self.n_self_layers * (self.kv_size + 4 * self.n_kv)
        return 2 * self.n_self_layers * self.kv_size * torch.tensor([], dtype=self.dtype).element_size()

    def cross_kv_bytes_per_row(self) -> int:
        """Bytes of cross-attention KV per image row (0 without cross-attention layers)."""
        return 2 * self.n_cross_layers * self.kv_size * torch.tensor([], dtype=self.dtype).element_size()

    def allocate_cache(self, num_blocks: int, block_size: int) -> None:
        """The block pool: K and V of every self-attention layer, [layers, blocks, block_size, kv heads, head dim]."""
        shape = (self.n_self_layers, num_blocks, block_size, self.n_kv, self.head_dim)
        storage = kv_quant.STORAGE.get(self.kv_cache_dtype)  # None: the model dtype
        self.k_cache = torch.zeros(shape, dtype=storage or self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=storage or self.dtype, device=self.device)
        self.k_scale = torch.ones(shape[:4], dtype=torch.float32, device=self.device) if storage else None
        self.v_scale = torch.ones(shape[:4], dtype=torch.float32, device=self.device) if storage else None
        self.block_size = block_size
        self.num_blocks = num_blocks
        # graphs captured on the old pools would write into freed memory; once they are gone their memory pool is
        # released too, and torch refuses a capture into a released pool: the next capture takes a new one
        self._graphs.clear()
        self._step_graphs = None
        self._graph_pool = None

    def allocate_cross_cache(self, num_blocks: int, max_rows: int) -> None:
        """The cross-attention pool (same block size as the self-attention pool, allocated first):
        K and V of every cross-attention layer; `max_rows`: the most image rows one sequence holds."""
        if not self.block_size:
            raise EngineError("allocate the self-attention KV cache before the cross-attention one")
        shape = (self.n_cross_layers, num_blocks, self.block_size, self.n_kv, self.head_dim)
        self.xk_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)  # block 0 stays zeros
        self.xv_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.max_cross_rows = max_rows
        self._graphs.clear()

    @torch.inference_mode()
    def write_cross_kv(self, states: torch.Tensor, block_table: list[int]) -> None:
        """K (k_norm'ed) and V of every cross-attention layer for one sequence's image states [R, hidden],
        written to its cross blocks; computed once, read by every later step of the sequence."""
        if self.xk_cache is None:
            raise EngineError("the cross-attention KV cache is not allocated")
        R = states.shape[0]
        bs = self.block_size
        if len(block_table) * bs < R:
            raise EngineError(f"{R} image rows do not fit {len(block_table)} cross blocks of {bs}")
        idx = torch.arange(R, device=self.device)
        slots = to_device(block_table, torch.long, self.device)[idx // bs] * bs + idx % bs
        x = states.to(self.device, self.dtype)
        for layer in self.layers:
            c = layer.cross
            if c is None:
                continue
            kv = c.kv(x)
            k = self._norm(kv[:, :self.kv_size].reshape(R * self.n_kv, self.head_dim), c.k_norm)
            v = kv[:, self.kv_size:].reshape(R, self.n_kv, self.head_dim)
            self.xk_cache[c.cache_index].view(-1, self.n_kv, self.head_dim).index_copy_(
                0, slots, k.view(R, self.n_kv, self.head_dim))
            self.xv_cache[c.cache_index].view(-1, self.n_kv, self.head_dim).index_copy_(0, slots, v)

    # ---- pieces ----------------------------------------------------------------------------
    def _embed(self, ids: torch.Tensor, fake_rows: torch.Tensor | None, table_rows: torch.Tensor | None,
               table: torch.Tensor | None) -> torch.Tensor:
        x = self._embed_tokens(ids.clamp(max=self.table_base - 1))
        if fake_rows is not None:  # image rows are taken as they are (never scaled)
            x.index_copy_(0, fake_rows, table.index_select(0, table_rows).to(x.dtype))
        return x

    def _embed_tokens(self, ids: torch.Tensor) -> torch.Tensor:
        x = F.embedding(ids, self.embed)
        return x if self.embed_scale is None else x * self.embed_scale

    def _norm(self, x, weight, residual=None):
        return ops.rms_norm(x, weight, self.eps, residual, one_plus=self.one_plus)

    def _layers(self, x: torch.Tensor, attend, cross=None) -> tuple[torch.Tensor, torch.Tensor]:
        """Run every layer; `attend(li, qkv) -> [T, Hq, d]` does rotary, the KV append and attention
        (on q/k already normed where the spec has q/k norms). `cross`: the rows that see image states in
        cross-attention layers (`_CrossBatch`); None: no row does, and those layers are skipped.
        Returns (residual, last MLP output)."""
        residual, h_out = x, None
        T = x.shape[0]
        for li, layer in enumerate(self.layers):
            if layer.cross is not None:
                if cross is not None:
                    residual, h_out = self._cross_layer(layer, residual, h_out, cross)
                continue
            h = self._norm(x, layer.input_norm) if h_out is None else self._norm(h_out, layer.input_norm, residual)
            qkv = layer.qkv(h)
            if layer.q_norm is not None:
                ops.qk_norm(qkv, layer.q_norm, layer.k_norm, self.n_heads, self.n_kv, self.head_dim, self.eps,
                            self.one_plus)
            a = layer.o(attend(li, qkv).reshape(T, self.q_size))
            if layer.attn_out_norm is not None:
                a = self._norm(a, layer.attn_out_norm)
            h = self._norm(a, layer.post_norm, residual)
            h_out = (layer.down.silu_mul(layer.gate_up(h)) if self._fuse_silu_down and isinstance(layer.down, Linear)
                     else layer.down(layer.gate_up.act_mul(h, self.activation)))
            if layer.mlp_out_norm is not None:
                h_out = self._norm(h_out, layer.mlp_out_norm)
        return residual, h_out

    def _cross_layer(self, layer: Layer, residual: torch.Tensor, h_out: torch.Tensor | None, cross: "_CrossBatch"):
        """A gated cross-attention layer over the rows in `cross` (the others pass through unchanged):
        x += tanh(g_attn) * o(attention(q_norm(q(norm(x))), image K/V)); x += tanh(g_mlp) * mask * MLP(norm(x)),
        the products in the order transformers takes them."""
        c = layer.cross
        h = self._norm(residual, layer.input_norm) if h_out is None else \
            self._norm(h_out, layer.input_norm, residual)
        rows = cross.rows
        hs = h if rows is None else h.index_select(0, rows)
        res = residual if rows is None else residual.index_select(0, rows)
        t = hs.shape[0]
        q = self._norm(c.q(hs).view(t * self.n_heads, self.head_dim), c.q_norm).view(t, self.n_heads, self.head_dim)
        a = c.o(cross.attend(c.cache_index, q).reshape(t, self.q_size))
        if cross.row_scale is not None:  # rows computed only to be discarded (a captured step's text rows)
            a = a * cross.row_scale
        h2 = self._norm(a * c.attn_gate, layer.post_norm, res)
        m = layer.down(layer.gate_up.act_mul(h2, self.activation))
        m = (m * cross.mlp_mask) * c.mlp_gate
        if rows is None:
            return res, m
        residual.index_copy_(0, rows, res)
        return residual, torch.zeros_like(residual).index_copy_(0, rows, m)

    def _final(self, residual: torch.Tensor, h_out: torch.Tensor, rows: torch.Tensor | None) -> torch.Tensor:
        if rows is not None:
            residual, h_out = residual.index_select(0, rows), h_out.index_select(0, rows)
        h = (self._norm(residual, self.norm) if h_out is None else
             self._norm(h_out.contiguous(), self.norm, residual.contiguous()))
        logits = F.linear(h, self.lm_head)
        if self.final_softcap is not None:  # in the model dtype, as transformers does
            logits = torch.tanh(logits / self.final_softcap) * self.final_softcap
        return logits.float()

    def _scales(self, cache_index: int) -> tuple:
        """(K scales, V scales) of one self-attention layer's 8-bit pool, or (None, None) for a 16-bit pool."""
        if self.k_scale is None:
            return None, None
        return self.k_scale[cache_index], self.v_scale[cache_index]

    def _split(self, qkv: torch.Tensor, rows: slice, n: int):
        k = qkv[rows, self.q_size:self.q_size + self.kv_size].view(n, self.n_kv, self.head_dim)
        v = qkv[rows, self.q_size + self.kv_size:].view(n, self.n_kv, self.head_dim)
        return k, v

    def _mrope_cos_sin(self, positions: np.ndarray) -> torch.Tensor:
        """cos|sin rows [T, d] of 3-D positions: each frequency section takes its own position component."""
        pos = to_device(positions, None, self.device)
        full = cos_sin_table(self.inv_freq, self.spec.rope_attention_scaling, pos)  # [3, T, d]
        half = self.head_dim // 2
        comp = torch.cat([torch.full((s,), i % 3, dtype=torch.long) for i, s in enumerate(self.mrope_section)])
        comp = torch.cat((comp, comp)).to(self.device)  # the same sections for the cos and the sin half
        assert comp.numel() == 2 * half
        return full.gather(0, comp[None, None, :].expand(1, full.shape[1], -1))[0]

    # ---- the general forward (prefill chunks and decode rows, eager) -------------------------
    @torch.inference_mode()
    def forward(self, chunks: list[Chunk], device_ids: torch.Tensor | None = None) -> torch.Tensor:
        """Run the chunks; logits [k, V] (float32) for the chunks with want_logits, in their order.
        `device_ids`: the input ids of the first len(device_ids) chunks, decode rows whose token is still on the
        device (a step launched before the host read it); their `ids` are placeholders."""
        if self.k_cache is None:
            raise EngineError("the KV cache is not allocated")
        if device_ids is not None and not all(c.is_decode for c in chunks[:len(device_ids)]):
            raise EngineError("ids on the device are for decode rows only")
        order = sorted(range(len(chunks)), key=lambda i: not chunks[i].is_decode)  # decode rows first
        cs = [chunks[i] for i in order]
        bs = self.block_size
        dev = self.device
        ids = np.concatenate([c.ids for c in cs]).astype(np.int64)
        T = len(ids)
        slots = np.empty(T, np.int64)
        fake_rows, table_rows, tables = [], [], []
        offset, row = 0, 0
        for c in cs:
            idx = c.start + np.arange(c.n)
            bt = np.asarray(c.block_table, np.int64)
            slots[row:row + c.n] = bt[idx // bs] * bs + idx % bs
            fake = np.nonzero(c.ids >= self.table_base)[0]
            if len(fake):
                if c.table is None:
                    raise EngineError("prompt has image tokens but no prompt-embedding table")
                fake_rows.append(fake + row)
                table_rows.append(c.ids[fake] - self.table_base + offset)
                tables.append(c.table)
                offset += c.table.shape[0]
            row += c.n
        # the last row of each chunk that wants logits, in the caller's chunk order
        ends, row = {}, 0
        for i, c in zip(order, cs):
            row += c.n
            ends[i] = row - 1
        want = [ends[i] for i in range(len(chunks)) if chunks[i].want_logits]
        graphed = self._step_graphs is not None and self._step_graphs.takes(cs, T)
        mrope = any(c.positions.ndim == 2 for c in cs)
        mrope_cos_sin = pos_1d = None
        if mrope:
            pos3 = np.concatenate([c.positions if c.positions.ndim == 2 else np.broadcast_to(c.positions, (3, c.n))
                                   for c in cs], 1)
            mrope_cos_sin = self._mrope_cos_sin(np.ascontiguousarray(pos3))
            rope_tables = [mrope_cos_sin] * self.n_layers
        else:
            rope_tables = [layer.cos_sin for layer in self.layers]
            pos_1d = np.concatenate([c.positions for c in cs]).astype(np.int64)
        ids_t = to_device(ids, None, dev)
        if device_ids is not None:  # decode rows come first, in the caller's order (the sort is stable)
            ids_t[:len(device_ids)] = device_ids
        if fake_rows:
            fr = to_device(np.concatenate(fake_rows), None, dev)
            tr = to_device(np.concatenate(table_rows), None, dev)
            table = torch.cat([t.to(dev) for t in tables]) if len(tables) > 1 else tables[0].to(dev)
        else:
            fr = tr = table = None
        if graphed:
            return self._step_graphs.run(cs, self._embed(ids_t, fr, tr, table), pos_1d, mrope_cos_sin, slots, want)
        positions = torch.arange(T, device=dev) if mrope else to_device(pos_1d, None, dev)
        slot_t = to_device(slots, None, dev)
        n_dec = sum(1 for c in cs if c.is_decode)
        if n_dec:
            maxb = max(len(c.block_table) for c in cs[:n_dec])
            bt_dec = to_device([c.block_table + [0] * (maxb - len(c.block_table)) for c in cs[:n_dec]],
                               torch.int32, dev)
            lens_dec = to_device([c.start + 1 for c in cs[:n_dec]], torch.int32, dev)
            splits = self._splits(n_dec)
        prefill, paged, paged_tables = [], [], []
        # continuation chunks the paged prompt kernel takes: all of them in one launch a layer
        limit = ops.chunk_attention_rows() if dev.type == "cuda" else 0
        row = n_dec
        for c in cs[n_dec:]:
            blocks = image_blocks(c.ids, self.table_base) if self.bidirectional_images else None
            if c.start and blocks is None and c.n <= limit:
                paged.append((len(paged_tables), row, c.n, c.start))
                paged_tables.append(c.block_table)
            else:
                prefill.append((slice(row, row + c.n), c.start, c.n,
                                to_device(c.block_table, torch.long, dev) if c.start else None,
                                None if blocks is None else to_device(blocks, None, dev)))
            row += c.n
        if paged:
            from .kernels import paged_prefill as pp

            maxb = max(len(t) for t in paged_tables)
            paged_bt = to_device([t + [0] * (maxb - len(t)) for t in paged_tables], torch.int32, dev)
            paged_splits = pp.max_splits(T, self.n_heads, self.head_dim)
            tile_rows = pp.tile_table(paged, pp.tiles(self.head_dim)[0], max_splits=paged_splits, heads=self.n_heads,
                                      sms=self._num_sms)
            paged_tiles = to_device(tile_rows, None, dev)
            paged_split_rows = pp.split_rows_of(tile_rows)
            paged_ws = pp.split_workspace(T if paged_split_rows else 1, self.n_heads, self.head_dim, paged_splits, dev)

        kc_all, vc_all = self.k_cache, self.v_cache

        def attend(li, qkv):
            ci = self.layers[li].cache_index
            kc, vc = kc_all[ci], vc_all[ci]
            ks, vs = self._scales(ci)
            cos_sin, window = rope_tables[li], self.layers[li].window
            out = torch.empty((T, self.n_heads, self.head_dim), dtype=qkv.dtype, device=dev)
            if n_dec:
                out[:n_dec] = ops.paged_decode_rope(qkv[:n_dec], cos_sin, positions[:n_dec], slot_t[:n_dec], kc, vc,
                                                    bt_dec, lens_dec, self.scale, self.n_heads, self.n_kv,
                                                    self.head_dim, num_splits=splits, window=window, k_scale=ks,
                                                    v_scale=vs)
            if n_dec == T:
                return out
            ops.rope_and_cache(qkv[n_dec:], cos_sin, positions[n_dec:], self.n_heads, self.n_kv, self.head_dim, kc, vc,
                               slot_t[n_dec:], ks, vs)
            q = qkv[:, :self.q_size].view(T, self.n_heads, self.head_dim)
            for rows, start, n, bt, blocks in prefill:
                if start == 0:  # with an 8-bit pool rope_and_cache left qkv's k and v as stored (kv_quant)
                    k, v = self._split(qkv, rows, n)
                else:  # the context (this chunk's rows included) is in the pool
                    k, v = ops.gather_kv(kc, vc, bt, start + n, ks, vs, qkv.dtype)
                out[rows] = ops.prefill_attention(q[rows], k, v, self.scale, window, blocks)
            if paged:
                ops.prompt_attention(q, kc, vc, paged_bt, paged_tiles, self.scale, window, ks, vs, out, paged_splits,
                                     paged_ws, paged_split_rows)
            return out

        x = self._embed(ids_t, fr, tr, table)
        with ops.attention_backends(dev):
            residual, h_out = self._layers(x, attend, self._cross_batch(cs, T))
        if not want:
            return torch.empty((0, self.vocab_size), dtype=torch.float32, device=dev)
        return self._final(residual, h_out, to_device(want, torch.long, dev))

    def _cross_batch(self, cs: list[Chunk], T: int) -> "_CrossBatch | None":
        """The rows of these chunks (in forward's order) that see image states, and how; None if none do."""
        if not self.n_cross_layers or all(c.cross is None for c in cs):
            return None
        if self.xk_cache is None:
            raise EngineError("the cross-attention KV cache is not allocated")
        dev = self.device
        rows, mlp, dec, pre = [], [], [], []
        row = sub = 0
        for c in cs:
            x = c.cross
            if x is not None:
                if len(x.lo) != c.n or len(x.hi) != c.n or len(x.mlp) != c.n:
                    raise EngineError("a chunk's cross-attention rows do not match its tokens")
                if c.is_decode and x.lo[0] == 0:  # the paged decode kernel reads [0, hi) in place
                    dec.append((sub, x))
                else:
                    bt = to_device(x.block_table, torch.long, dev)
                    pre.append((slice(sub, sub + c.n), bt, int(x.hi.max()), to_device(x.lo, None, dev),
                                to_device(x.hi, None, dev)))
                rows.extend(range(row, row + c.n))
                mlp.append(x.mlp)
                sub += c.n
            row += c.n
        xb = _CrossBatch()
        xb.rows = None if len(rows) == T else to_device(rows, torch.long, dev)
        xb.mlp_mask = to_device(np.concatenate(mlp).astype(np.float32), None, dev).to(self.dtype)[:, None]
        dec_bt = dec_lens = dec_idx = None
        if dec:
            maxb = max(len(x.block_table) for _, x in dec)
            dec_bt = to_device([x.block_table + [0] * (maxb - len(x.block_table)) for _, x in dec], torch.int32, dev)
            dec_lens = to_device([int(x.hi[0]) for _, x in dec], torch.int32, dev)
            dec_idx = to_device([i for i, _ in dec], torch.long, dev)
        splits = self._cross_splits(len(dec))
        xk, xv, scale = self.xk_cache, self.xv_cache, self.cross_scale

        def attend(ci, q):
            out = torch.empty_like(q)
            if dec:
                out.index_copy_(0, dec_idx, ops.paged_decode(q.index_select(0, dec_idx), xk[ci], xv[ci], dec_bt,
                                                             dec_lens, scale, splits))
            for sl, bt, length, lo, hi in pre:
                k = ops.gather_context(xk[ci], bt, length)
                v = ops.gather_context(xv[ci], bt, length)
                out[sl] = ops.cross_attention(q[sl], k, v, lo, hi, scale)
            return out

        xb.attend = attend
        return xb

    def _cross_splits(self, batch: int) -> int:
        if self.device.type != "cuda" or batch == 0:
            return 1
        from .kernels.paged_attention import choose_splits

        return choose_splits(batch, self.n_kv, max(self.max_cross_rows, 1), self._num_sms)

    # ---- decode rows (CUDA graphs per batch bucket) --------------------------------------------
    def _decode_body(self, ids, positions, slots, block_tables, context_lens, splits: int, workspace,
                     cross=None):
        """`cross`: (cross block tables [B, maxcb], image rows per row [B] (0: none), splits, workspace) when
        some row sees image states; rows with 0 compute the cross layers over the zero block 0 and have
        both outputs multiplied by 0, which leaves them exactly as if the layers were skipped."""

        def attend(li, qkv):
            layer = self.layers[li]
            ci = layer.cache_index
            ks, vs = self._scales(ci)
            return ops.paged_decode_rope(qkv, layer.cos_sin, positions, slots, self.k_cache[ci], self.v_cache[ci],
                                         block_tables, context_lens, self.scale, self.n_heads, self.n_kv,
                                         self.head_dim, num_splits=splits, workspace=workspace, window=layer.window,
                                         k_scale=ks, v_scale=vs)

        xb = None
        if cross is not None:
            xbt, xlens, xsplits, xws = cross
            flag = (xlens > 0).to(self.dtype)[:, None]
            lens = xlens.clamp(min=1)  # a text row reads one row of the never-written block 0
            xb = _CrossBatch()
            xb.mlp_mask = xb.row_scale = flag

            def cross_attend(ci, q):
                return ops.paged_decode(q, self.xk_cache[ci], self.xv_cache[ci], xbt, lens, self.cross_scale,
                                        xsplits, None, xws)

            xb.attend = cross_attend
        x = self._embed_tokens(ids)
        fused = self._fused_step() if xb is None and x.shape[0] == 1 else None
        if fused is not None:  # every layer in one persistent kernel (kernels/fused_step.py)
            return self._final(fused.run(x, positions, slots, block_tables, context_lens), None, None)
        residual, h_out = self._layers(x, attend, xb)
        return self._final(residual, h_out, None)

    def _fused_step(self):
        """The fused batch-1 step where this decoder can run it (built on first use; None where not, with
        the reason in `fused_step_reason`)."""
        if self._fused is False:
            from .kernels.flow_step import build_step

            self._fused = build_step(self) if self.device.type == "cuda" else None
        return self._fused

    @torch.inference_mode()
    def decode(self, ids: np.ndarray, positions: np.ndarray, slots: np.ndarray, block_tables: list[list[int]],
               context_lens: np.ndarray, cross_tables: list[list[int]] | None = None,
               cross_lens: np.ndarray | None = None) -> torch.Tensor:
        """One new token for each of b sequences -> logits [b, V]. `ids` may be a tensor on the device (the
        previous step's sampled tokens, not yet read by the host). `positions` are 1-D rotary positions,
        `slots` the cache slot of each new token, `context_lens` the tokens to attend (the new one included).
        `cross_tables` / `cross_lens`: each sequence's cross block table and the image rows its token
        attends ([0, n) of its cross KV; 0 and [] for a sequence without images)."""
        b = len(ids)
        on_device = isinstance(ids, torch.Tensor)
        with_cross = bool(self.n_cross_layers and cross_lens is not None and np.any(cross_lens > 0))
        if not self.use_graphs:
            dev = self.device
            maxb = max(len(t) for t in block_tables)
            bt = to_device([t + [0] * (maxb - len(t)) for t in block_tables], torch.int32, dev)
            cross = None
            if with_cross:
                maxcb = max(1, max(len(t) for t in cross_tables))
                xbt = to_device([t + [0] * (maxcb - len(t)) for t in cross_tables], torch.int32, dev)
                cross = (xbt, to_device(np.asarray(cross_lens, dtype=np.int32), None, dev), self._cross_splits(b), None)
            ids = ids.to(dev) if on_device else to_device(ids, None, dev)
            return self._decode_body(ids, to_device(positions, None, dev), to_device(slots, None, dev), bt,
                                     to_device(context_lens.astype(np.int32), None, dev), self._splits(b), None, cross)
        B = self.bucket(b)
        entry = self._graphs.get((B, with_cross)) or self._capture(B, with_cross)
        graph, st, out = entry
        copied = st.setdefault("copied", torch.cuda.Event())
        # the pinned buffer's last copy may still be queued (a step launched before the previous one's tokens
        # were read): it must have left before the buffer is rewritten (a no-op for an event never recorded)
        copied.synchronize()
        self._fill_graph_inputs(st, np.zeros(b, dtype=np.int64) if on_device else ids, positions, slots,
                                block_tables, context_lens, cross_tables, cross_lens)
        st["dev"].copy_(st["host"], non_blocking=True)
        if on_device:
            st["dev"][0:b].copy_(ids)
        copied.record()
        graph.replay()
        return out[:b]

    @staticmethod
    def _fill_graph_inputs(st: dict, ids, positions, slots, block_tables, context_lens, cross_tables=None,
                           cross_lens=None) -> None:
        """Write a step's inputs into a captured bucket's host buffer (one pinned buffer, one copy):
        ids | positions | slots | lens | block tables [| image rows | cross block tables]. Padding rows
        read and write block 0, which the pools never hand out, and see no image."""
        B, maxb, maxcb = st["B"], st["maxb"], st["maxcb"]
        b = len(ids)
        host = st["host"]
        host.zero_()
        h = host.numpy()
        h[0:b] = ids
        h[B:B + b] = positions
        h[2 * B:2 * B + b] = slots
        h[3 * B:3 * B + B] = 1
        h[3 * B:3 * B + b] = context_lens
        o = 4 * B
        tabs = h[o:o + B * maxb].reshape(B, maxb)
        for i, t in enumerate(block_tables):
            tabs[i, :len(t)] = t
        if st["with_cross"]:
            o += B * maxb
            h[o:o + b] = cross_lens
            xtabs = h[o + B:o + B + B * maxcb].reshape(B, maxcb)
            for i, t in enumerate(cross_tables):
                if len(t) > maxcb:
                    raise EngineError(f"{len(t)} cross-attention blocks exceed the captured {maxcb}")
                xtabs[i, :len(t)] = t

    def _splits(self, batch: int) -> int:
        """Context splits of the decode attention for a batch (the same rule eager and captured)."""
        if self.device.type != "cuda":
            return 1
        from .kernels.paged_attention import choose_splits

        return choose_splits(batch, self.n_kv, self.max_seq, self._num_sms)

    def buckets(self, max_batch: int) -> list[int]:
        sizes = [1, 2, 4, 8] + list(range(16, max_batch + 16, 16))
        return sorted({min(s, max_batch) for s in sizes})

    def bucket(self, b: int) -> int:
        for s in self._bucket_sizes:
            if s >= b:
                return s
        raise EngineError(f"decode batch {b} exceeds the captured maximum {self._bucket_sizes[-1]}")

    def _packed_per_shape(self):
        """(linears, gate_ups, group size) of the packed linears, or None without any: linears holds one
        (packed weight, has a bias) per distinct (shape, bias or not), gate_ups the same for the gate_up
        weights (their one-row calls fuse the activation). A kernel specializes on the bias, so the warm-ups
        compile only the variants the decoder calls."""
        packed = [lin for layer in self.layers for lin in self._linears(layer) if isinstance(lin, W4A16Linear)]
        if not packed:
            return None

        def per_shape(lins):
            out = {}
            for lin in lins:
                out.setdefault((tuple(lin.packed["q4weight"].shape), lin.bias is not None), lin.packed)
            return [(p, has_bias) for (_, has_bias), p in out.items()]

        gate_up = [lyr.gate_up for lyr in self.layers if isinstance(lyr.gate_up, W4A16Linear)]
        return per_shape(packed), per_shape(gate_up), packed[0].group_size

    def warm_prefill(self, max_rows: int) -> None:
        """Compile the packed linears' kernels for the row counts a step with prompt rows (up to max_rows, the
        step's token budget) can select beyond the decode buckets, at load rather than at a first request of
        that size: on a cold kernel cache a 7B AWQ engine's bench stalled 0.94 s in one such step (H200,
        docs/benchmarks.md, session 18). Call after `capture_graphs`."""
        packed = self._packed_per_shape()
        if not packed or self.device.type != "cuda":
            return
        from .kernels.w4a16 import prefill_buckets, warmup

        shapes, _, group_size = packed
        warmup([p for p, _ in shapes], group_size, prefill_buckets(max_rows, self._bucket_sizes), self.dtype,
               self.device, biased=[b for _, b in shapes])

    def warm_forward(self, max_batch: int) -> None:
        """Run, at load, the steps whose kernels no captured graph compiles: prompt rows (their rotary and
        KV append), a continuation chunk, and decode rows beside them (eager decode attention, as without
        graphs or for rows a graph cannot take, with and without context splits: one row and `max_batch`
        rows). Everything reads and writes block 0, which the pools never hand out. A Triton kernel compiled
        at first use stalls every running request: on fresh H200s one prompt step of a 7B engine's bench
        took 447-593 ms before this, none since (docs/benchmarks.md, session 19). CUDA only; call after
        `capture_graphs`."""
        if self.device.type != "cuda" or self.k_cache is None:
            return
        with torch.inference_mode():
            for chunks in self.warm_steps(max_batch):
                self.forward(chunks)
        torch.cuda.synchronize(self.device)

    def warm_steps(self, max_batch: int) -> list[list[Chunk]]:
        """`warm_forward`'s steps: 1 and `max_batch` decode rows, each beside a prompt chunk and a continuation
        chunk, all on block 0."""
        bs = self.block_size
        zeros = [0] * (max(bs, 4) // bs + 1)  # positions 0..max(bs, 4), every one in block 0
        token = np.array([min(1, self.table_base - 1)], np.int64)
        prompt = [Chunk(ids=np.repeat(token, 3), positions=np.arange(3), start=0, block_table=zeros),
                  Chunk(ids=np.repeat(token, 2), positions=np.arange(3, 5), start=3, block_table=zeros)]
        return [[Chunk(ids=token, positions=np.array([bs]), start=bs, block_table=zeros, want_logits=False)
                 for _ in range(n)] + prompt for n in sorted({1, max(1, max_batch)})]

    def compile_kernels(self, max_batch: int, max_rows: int) -> bool:
        """Compile at once, on a thread pool (`kernels.compile_ahead`), the Triton kernels that `capture_graphs`,
        `warm_prefill` and `warm_forward` would otherwise compile one after another, with the packed linears'
        NVRTC kernels alongside; those phases then find every kernel compiled. It runs their linears'
        warm-ups, each bucket's decode step and the warm steps with every Triton launch reduced to its
        compile (whatever they compute is garbage and unused; the warm steps write block 0 only). CUDA only;
        returns whether anything was compiled ahead (not under Triton's interpreter, or with
        `VLMCTL_COMPILE_WORKERS=1`). max_rows: the step's token budget, as for `warm_prefill`."""
        if self.device.type != "cuda" or self.k_cache is None:
            return False
        import threading

        from .kernels import compile_ahead

        buckets = self.buckets(max_batch)
        nvrtc = None
        packed = self._packed_per_shape()
        if packed and compile_ahead.available():
            from .kernels.w4a16 import PACK, precompile_selected, prefill_buckets, untuned_device_note

            if (note := untuned_device_note(self.device)) is not None:
                logging.getLogger("vlmctl.runtime").info("%s", note)
            shapes, gate_up, group_size = packed
            dims = {(p["q4weight"].shape[0], p["q4weight"].shape[1] * PACK) for p, _ in shapes}
            gate_up_dims = {(p["q4weight"].shape[0], p["q4weight"].shape[1] * PACK) for p, _ in gate_up}
            rows = buckets + prefill_buckets(max_rows, buckets)

            def precompile():  # NVRTC runs outside the GIL, beside the Triton compiles below
                try:
                    precompile_selected(dims, group_size, rows, self.dtype, self.device, act_mul_shapes=gate_up_dims,
                                        activation=self.activation)
                except Exception:  # the warm-ups compile whatever this did not, and raise there
                    pass

            nvrtc = threading.Thread(target=precompile, name="vlmctl-nvrtc", daemon=True)
            nvrtc.start()
        ahead = False
        try:
            with compile_ahead.parallel_compiles() as ahead, torch.inference_mode():
                if ahead:
                    self._warm_linears(buckets, max_rows)
                    for B in buckets:
                        for with_cross in self._graph_variants():
                            self._graph_inputs(B, with_cross)[1]()
                    for chunks in self.warm_steps(max_batch):
                        self.forward(chunks)
                    if self.use_graphs:  # the steps with prompt rows that `capture_step_graphs` will capture
                        self._step_graphs_for(max_batch, max_rows).compile_only()
        except Exception as e:  # only a speed-up: the phases after it compile what it did not, or raise there
            logging.getLogger("vlmctl.runtime").warning("the parallel compile pass stopped (%s: %s); the kernels "
                                                        "it missed compile one by one", type(e).__name__, e)
            ahead = False
        finally:
            if nvrtc is not None:
                nvrtc.join()
        torch.cuda.synchronize(self.device)
        return ahead

    def _warm_linears(self, buckets: list[int], max_rows: int = 0) -> None:
        """The packed linears' and the Triton GEMV's warm-ups for these decode buckets (and, with max_rows, the
        packed linears' prefill buckets): kernels compiled, shared buffers sized. One weight per shape and bias
        or not."""
        packed = self._packed_per_shape()
        if packed and self.device.type == "cuda":
            from .kernels.w4a16 import prefill_buckets, warmup

            shapes, gate_up, group_size = packed
            warmup([p for p, _ in shapes], group_size, buckets, self.dtype, self.device,
                   act_mul=[p for p, _ in gate_up], activation=self.activation, biased=[b for _, b in shapes],
                   act_mul_biased=[b for _, b in gate_up])
            if max_rows:
                warmup([p for p, _ in shapes], group_size, prefill_buckets(max_rows, buckets), self.dtype,
                       self.device, biased=[b for _, b in shapes])
        dense = [lin for layer in self.layers for lin in self._linears(layer) if isinstance(lin, Linear) and lin.gemv]
        if dense:
            from .kernels import gemv

            shapes = {(tuple(lin.weight.shape), lin.bias is not None): lin.weight for lin in dense if not lin.gemv_silu}
            down = {(tuple(lin.weight.shape), lin.bias is not None): lin.weight for lin in dense if lin.gemv_silu}
            gemv.warmup(list(shapes.values()), [1], self.dtype, self.device, silu_weights=list(down.values()),
                        biased=[b for _, b in shapes], silu_biased=[b for _, b in down])

    def _graph_variants(self) -> tuple[bool, ...]:
        """Per bucket, the decode graphs: with cross-attention layers only where requests can have images."""
        return (False, True) if self.xk_cache is not None and self.max_cross_rows > 0 else (False,)

    def capture_graphs(self, max_batch: int) -> None:
        """Capture the decode step for every batch bucket up to `max_batch` (CUDA only); a decoder with
        cross-attention layers gets a second graph per bucket that runs them."""
        self._bucket_sizes = self.buckets(max_batch)
        # compile the linears' kernels and size their buffers outside the graphs
        self._warm_linears(self._bucket_sizes)
        if self.use_graphs:
            for B in reversed(self._bucket_sizes):  # largest first: later captures reuse its memory pool
                for with_cross in self._graph_variants():
                    self._capture(B, with_cross)

    def capture_step_graphs(self, max_batch: int, max_rows: int, limit: int | None = None) -> list[int]:
        """Capture steps with prompt rows, one graph per row bucket up to `limit` rows (`VLMCTL_STEP_GRAPH_ROWS`
        where None; capped at `max_rows`, the step's token budget), after `capture_graphs` (`step_graphs`). Where this
        decoder replays no graphs the same static-shape steps run eagerly. Returns the buckets (none where the limit
        is 0)."""
        graphs = self._step_graphs_for(max_batch, max_rows, limit)
        self._step_graphs = None  # the old steps' graphs go first; with no decode graph left their pool goes too
        if not self._graphs:
            self._graph_pool = None
        self._step_graphs = graphs if graphs.sizes and self.k_cache is not None else None
        if self._step_graphs is not None:
            graphs.capture()
        return graphs.sizes if self._step_graphs is not None else []

    def _step_graphs_for(self, max_batch: int, max_rows: int, limit: int | None = None):
        """The steps with prompt rows for up to min(limit, max_rows) rows (`VLMCTL_STEP_GRAPH_ROWS` where limit is
        None), not built yet."""
        from .step_graphs import StepGraphs, step_graph_rows

        return StepGraphs(self, max_batch, min(step_graph_rows() if limit is None else limit, max_rows))

    @staticmethod
    def _linears(layer: Layer):
        out = [layer.qkv, layer.o, layer.gate_up, layer.down]
        if layer.cross is not None:
            out += [layer.cross.q, layer.cross.kv, layer.cross.o]
        return [lin for lin in out if lin is not None]

    def _graph_inputs(self, B: int, with_cross: bool):
        """(state, body) of a decode bucket: the host/device input buffers and the step that reads them."""
        dev = self.device
        maxb = -(-self.max_seq // self.block_size)
        maxcb = -(-self.max_cross_rows // self.block_size) if with_cross else 0
        # int32 throughout: embedding, rotary, cache slots and block tables all take it
        n_cross = (B + B * maxcb) if with_cross else 0
        host = torch.zeros(4 * B + B * maxb + n_cross, dtype=torch.int32, pin_memory=dev.type == "cuda")
        d = torch.zeros_like(host, device=dev)
        st = {"host": host, "dev": d, "B": B, "maxb": maxb, "maxcb": maxcb, "with_cross": with_cross}
        splits = self._splits(B)
        ws = self._workspace(B, splits)
        cross = None
        if with_cross:
            o = 4 * B + B * maxb
            xsplits = self._cross_splits(B)
            cross = (d[o + B:o + B + B * maxcb].view(B, maxcb), d[o:o + B], xsplits, self._workspace(B, xsplits))

        def body():
            return self._decode_body(d[0:B], d[B:2 * B], d[2 * B:3 * B], d[4 * B:4 * B + B * maxb].view(B, maxb),
                                     d[3 * B:4 * B], splits, ws, cross)

        # A graph keeps raw pointers, not tensors: the attention's split workspaces, allocated here outside
        # the graph's pool, must live as long as the graph does, or the allocator hands their memory to
        # later tensors that the graph's replays then overwrite.
        st["workspaces"] = (ws, cross)

        d[3 * B:4 * B].fill_(1)
        return st, body

    def _capture(self, B: int, with_cross: bool = False):
        dev = self.device
        st, body = self._graph_inputs(B, with_cross)
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph: kernel compilation, cuBLAS workspaces
                body()
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        # thread-local: the vision worker's CUDA calls on its own stream do not invalidate this capture
        with torch.cuda.graph(graph, pool=self._graph_pool, capture_error_mode="thread_local"):
            out = body()
        if self._graph_pool is None:
            self._graph_pool = graph.pool()
        entry = (graph, st, out)
        self._graphs[(B, with_cross)] = entry
        return entry

    def _workspace(self, B: int, splits: int):
        if splits <= 1:
            return None
        from .kernels.paged_attention import split_workspace

        return split_workspace(B, self.n_heads, self.head_dim, splits, self.device)

    # ---- full causal forward without the cache ---------------------------------------------------
    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """[B, T] -> [B, T, V] logits of a plain causal forward (perplexity, tests); with an 8-bit `kv_cache_dtype`
        attention reads K/V rounded as the pool stores them. Cross-attention
        layers are skipped, as for a prompt without images."""
        B, T = input_ids.shape
        dev = self.device
        ids = input_ids.to(dev).reshape(-1)
        fake = (ids >= self.table_base).nonzero()[:, 0]
        fr = tr = None
        if fake.numel():
            if table is None:
                raise EngineError("prompt has image tokens but no prompt-embedding table")
            fr, tr = fake, ids[fake] - self.table_base
        positions = torch.arange(T, device=dev).repeat(B)
        blocks = [None] * B
        if self.bidirectional_images and fake.numel():
            ids_np = input_ids.cpu().numpy()
            blocks = [None if (b := image_blocks(ids_np[i], self.table_base)) is None else torch.from_numpy(b).to(dev)
                      for i in range(B)]

        storage = kv_quant.STORAGE.get(self.kv_cache_dtype)  # an 8-bit pool's element type, or None

        def attend(li, qkv):
            layer = self.layers[li]
            ops.rope_and_cache(qkv, layer.cos_sin, positions, self.n_heads, self.n_kv, self.head_dim)
            q = qkv[:, :self.q_size].view(B * T, self.n_heads, self.head_dim)
            out = torch.empty_like(q)
            for b in range(B):
                rows = slice(b * T, (b + 1) * T)
                k, v = self._split(qkv, rows, T)
                if storage is not None:  # as an 8-bit pool would hold them (serving's prefill reads them so)
                    k = kv_quant.dequantize(*kv_quant.quantize(k, storage), k.dtype)
                    v = kv_quant.dequantize(*kv_quant.quantize(v, storage), v.dtype)
                out[rows] = ops.prefill_attention(q[rows], k, v, self.scale, layer.window, blocks[b])
            return out

        x = self._embed(ids, fr, tr, table.to(dev) if table is not None else None)
        with ops.attention_backends(x.device):
            residual, h_out = self._layers(x, attend)
        return self._final(residual, h_out, None).view(B, T, -1)
