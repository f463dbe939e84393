"""The embedded torch decoder: Llama-family transformer with a preallocated per-slot KV cache.

Batch-first: the KV cache holds `max_batch` slots of `max_seq` positions, allocated once.
A request is prefilled into a free slot; decode steps advance any set of slots together, each
at its own length. Ids >= vocab_size index the request's prompt-embedding table (TensorRT-LLM's
prompt-tuning contract). Positions may be 1-D, or 3-D for multimodal rotary (M-RoPE); a per-slot
`rope_delta` continues positions after the prompt as the reference models do.
"""

from __future__ import annotations

import json
import os
from pathlib import Path

import torch
import torch.nn.functional as F

from ..errors import EngineError
from .layout import FORMAT, WEIGHTS, _dtype, fuse_decoder, read_hf_decoder


class Linear:
    """A float or AWQ linear. AWQ weights are dequantized once at load on CPU (exact, simple);
    the packed form stays on disk for GPU kernels."""

    def __init__(self, tensors: dict, prefix: str, dtype, group_size: int | None, bias=None):
        if f"{prefix}.qweight" in tensors:
            from ..quant.packing import dequantize_gemm

            w = dequantize_gemm(tensors[f"{prefix}.qweight"], tensors[f"{prefix}.qzeros"], tensors[f"{prefix}.scales"],
                                4, group_size)
            self.weight = w.to(dtype).contiguous()
        else:
            self.weight = tensors[f"{prefix}.weight"]
        self.bias = bias

    def __call__(self, x):
        return F.linear(x, self.weight, self.bias)


def _rms_norm(x, weight, eps):
    dtype = x.dtype
    x32 = x.float()
    x32 = x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + eps)
    return weight * x32.to(dtype)


def _rotate_half(x):
    h = x.shape[-1] // 2
    return torch.cat((-x[..., h:], x[..., :h]), dim=-1)


class TorchDecoder:
    def __init__(self, config: dict, tensors: dict, *, device="cpu", max_batch: int = 1, max_seq: int = 2048):
        cfg = config["decoder"]
        self.cfg = cfg
        self.dtype = _dtype(config["dtype"])
        self.device = torch.device(device)
        self.vocab_size = cfg["vocab_size"]
        self.hidden = cfg["hidden_size"]
        self.n_layers = cfg["num_layers"]
        self.n_heads, self.n_kv, self.head_dim = cfg["num_heads"], cfg["num_kv_heads"], cfg["head_dim"]
        self.eps = cfg["rms_norm_eps"]
        self.scaling = cfg.get("attention_scaling", 1.0)
        self.mrope_section = cfg.get("mrope_section")
        group = (cfg.get("quantization") or {}).get("group_size")
        t = {k: v.to(self.device) for k, v in tensors.items()}
        self.embed = t["embed"].to(self.dtype)
        self.norm = t["norm"].to(self.dtype)
        self.lm_head = t["embed"].to(self.dtype) if cfg["tie_word_embeddings"] else t["lm_head"].to(self.dtype)
        self.inv_freq = t["inv_freq"].float()
        self.layers = []
        for i in range(self.n_layers):
            p = f"layers.{i}"
            bias = t.get(f"{p}.qkv.bias")
            self.layers.append({
                "input_norm": t[f"{p}.input_norm"].to(self.dtype), "post_norm": t[f"{p}.post_norm"].to(self.dtype),
                "qkv": Linear(t, f"{p}.qkv", self.dtype, group, bias.to(self.dtype) if bias is not None else None),
                "o": Linear(t, f"{p}.o", self.dtype, group), "gate_up": Linear(t, f"{p}.gate_up", self.dtype, group),
                "down": Linear(t, f"{p}.down", self.dtype, group),
            })
        self.inter = self.layers[0]["gate_up"].weight.shape[0] // 2 if self.layers else 0
        self.max_batch, self.max_seq = max_batch, max_seq
        # One extra slot: padding rows of a captured decode graph write there.
        self.scratch_slot = max_batch
        shape = (self.n_layers, max_batch + 1, self.n_kv, max_seq, self.head_dim)
        self.k_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.v_cache = torch.zeros(shape, dtype=self.dtype, device=self.device)
        self.use_graphs = self.device.type == "cuda" and os.environ.get("VLMCTL_CUDA_GRAPHS", "1") != "0"
        self._graphs: dict = {}
        self._graph_pool = None

    # ---- loading ---------------------------------------------------------------------------
    @classmethod
    def load(cls, layout_dir: Path, *, device="cpu", max_batch: int = 1, max_seq: int | None = None) -> "TorchDecoder":
        from safetensors.torch import load_file

        layout_dir = Path(layout_dir)
        try:
            config = json.loads((layout_dir / "config.json").read_text())
        except (OSError, json.JSONDecodeError) as e:
            raise EngineError(f"{layout_dir}: no readable decoder config.json ({e})") from None
        if config.get("format") != FORMAT:
            raise EngineError(f"{layout_dir}: not a vlmctl torch decoder (format {config.get('format')!r})")
        tensors = load_file(str(layout_dir / WEIGHTS), device=str(device) if str(device) != "cpu" else "cpu")
        limits = config.get("limits", {})
        max_seq = max_seq or limits.get("max_input_len", 2048) + limits.get("max_output_len", 512)
        return cls(config, tensors, device=device, max_batch=max_batch, max_seq=max_seq)

    @classmethod
    def from_hf_dir(cls, llm_dir: Path, *, dtype: str = "float32", device="cpu", max_batch: int = 1,
                    max_seq: int = 2048) -> "TorchDecoder":
        """A float or AWQ-GEMM Hugging Face causal-LM directory, fused in memory."""
        text_cfg, tensors, quant = read_hf_decoder(llm_dir)
        cfg, weights = fuse_decoder(text_cfg, tensors, quant, dtype)
        return cls({"dtype": dtype, "decoder": cfg}, weights, device=device, max_batch=max_batch, max_seq=max_seq)

    # ---- pieces ----------------------------------------------------------------------------
    def embed_ids(self, ids: torch.Tensor, table: torch.Tensor | None) -> torch.Tensor:
        """Ordinary ids from the word embedding, ids >= vocab_size from the prompt table."""
        fake = ids >= self.vocab_size
        x = F.embedding(ids.clamp(max=self.vocab_size - 1), self.embed)
        if fake.any():
            if table is None:
                raise EngineError("prompt has image tokens but no prompt-embedding table")
            rows = ids[fake] - self.vocab_size
            x[fake] = table.to(x.dtype)[rows]
        return x

    def _rope(self, positions: torch.Tensor):
        """cos/sin of shape [..., T, head_dim] from 1-D [T] (or [B, T]) or 3-D [3, T] positions."""
        if self.mrope_section and positions.dim() >= 2 and positions.shape[0] == 3:
            freqs = positions[..., None].float() * self.inv_freq  # [3, T, d/2]
            emb = torch.cat((freqs, freqs), -1)
            cos, sin = emb.cos() * self.scaling, emb.sin() * self.scaling
            sec = list(self.mrope_section) * 2
            cos = torch.cat([c[i % 3] for i, c in enumerate(cos.split(sec, dim=-1))], -1)
            sin = torch.cat([s[i % 3] for i, s in enumerate(sin.split(sec, dim=-1))], -1)
            return cos.to(self.dtype), sin.to(self.dtype)
        freqs = positions[..., None].float() * self.inv_freq
        emb = torch.cat((freqs, freqs), -1)
        return (emb.cos() * self.scaling).to(self.dtype), (emb.sin() * self.scaling).to(self.dtype)

    def _mlp(self, layer, x):
        gu = layer["gate_up"](x)
        g, u = gu.split(self.inter, -1)
        return layer["down"](F.silu(g) * u)

    def _qkv(self, layer, x, cos, sin):
        """x [B, T, H] -> q [B, h, T, d], k, v [B, kv, T, d] with rotary applied."""
        B, T, _ = x.shape
        qkv = layer["qkv"](_rms_norm(x, layer["input_norm"], self.eps))
        q, k, v = qkv.split([self.n_heads * self.head_dim, self.n_kv * self.head_dim, self.n_kv * self.head_dim], -1)
        q = q.view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = k.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        v = v.view(B, T, self.n_kv, self.head_dim).transpose(1, 2)
        cos, sin = cos.unsqueeze(-3), sin.unsqueeze(-3)  # broadcast over heads
        q = q * cos + _rotate_half(q) * sin
        k = k * cos + _rotate_half(k) * sin
        return q, k, v

    def _final(self, x):
        return F.linear(_rms_norm(x, self.norm, self.eps), self.lm_head).float()

    # ---- entry points ----------------------------------------------------------------------
    @torch.inference_mode()
    def prefill(self, slot: int, ids: torch.Tensor, table: torch.Tensor | None = None,
                positions: torch.Tensor | None = None) -> torch.Tensor:
        """Fill `slot`'s cache with the prompt `ids` [T]; return the last position's logits [V]."""
        T = ids.shape[0]
        if T > self.max_seq:
            raise EngineError(f"prompt of {T} tokens exceeds the KV cache ({self.max_seq})")
        ids = ids.to(self.device)
        if positions is None:
            positions = torch.arange(T, device=self.device)
        cos, sin = self._rope(positions.to(self.device))
        x = self.embed_ids(ids, table)[None]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            self.k_cache[li, slot, :, :T] = k[0]
            self.v_cache[li, slot, :, :T] = v[0]
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
            x = x + layer["o"](a.transpose(1, 2).reshape(1, T, -1))
            x = x + self._mlp(layer, _rms_norm(x, layer["post_norm"], self.eps))
        return self._final(x[:, -1])[0]

    @torch.inference_mode()
    def decode(self, slots: torch.Tensor, tokens: torch.Tensor, cache_lens: torch.Tensor,
               rope_deltas: torch.Tensor | None = None) -> torch.Tensor:
        """One token for each slot: tokens [b] at cache position cache_lens [b]; returns logits [b, V].

        Inputs are host tensors (the scheduler's bookkeeping), so choosing the attention length
        needs no device sync. On CUDA the step replays a captured graph per (batch, length) bucket."""
        need = int(cache_lens.max()) + 1
        if self.use_graphs:
            return self._decode_graphed(slots, tokens, cache_lens, rope_deltas, need)
        dev = self.device
        return self._decode_step(slots.to(dev), tokens.to(dev), cache_lens.to(dev),
                                 None if rope_deltas is None else rope_deltas.to(dev), need)

    def _decode_step(self, slots, tokens, cache_lens, rope_deltas, L: int) -> torch.Tensor:
        """The decode step on device tensors, attending over the first L cache positions (static shapes)."""
        b = slots.shape[0]
        pos = cache_lens if rope_deltas is None else cache_lens + rope_deltas
        if self.mrope_section:
            cos, sin = self._rope(pos[None].expand(3, b)[:, :, None])  # [3,b,1] -> [b,1,d]
        else:
            cos, sin = self._rope(pos[:, None])  # [b,1,d]
        mask = (torch.arange(L, device=self.device)[None] <= cache_lens[:, None])[:, None, None, :]  # [b,1,1,L]
        x = F.embedding(tokens, self.embed)[:, None]
        for li, layer in enumerate(self.layers):
            q, k, v = self._qkv(layer, x, cos, sin)
            self.k_cache[li, slots, :, cache_lens] = k[:, :, 0]
            self.v_cache[li, slots, :, cache_lens] = v[:, :, 0]
            kc = self.k_cache[li, slots, :, :L]
            vc = self.v_cache[li, slots, :, :L]
            a = F.scaled_dot_product_attention(q, kc, vc, attn_mask=mask, enable_gqa=self.n_kv != self.n_heads)
            x = x + layer["o"](a.transpose(1, 2).reshape(b, 1, -1))
            x = x + self._mlp(layer, _rms_norm(x, layer["post_norm"], self.eps))
        return self._final(x[:, 0])

    @staticmethod
    def _bucket(n: int, cap: int, floor: int = 1) -> int:
        b = floor
        while b < n:
            b *= 2
        return min(b, cap)

    def _decode_graphed(self, slots, tokens, cache_lens, rope_deltas, need: int) -> torch.Tensor:
        b = slots.shape[0]
        B = self._bucket(b, self.max_batch)
        L = self._bucket(need, self.max_seq, floor=128)
        key = (B, L)
        entry = self._graphs.get(key)
        if entry is None:
            entry = self._capture(B, L)
            self._graphs[key] = entry
        graph, st, out = entry
        # Padding rows decode into the scratch slot at position 0: harmless and never read.
        st["slots"].fill_(self.scratch_slot)
        st["lens"].zero_()
        st["tokens"].zero_()
        st["deltas"].zero_()
        st["slots"][:b].copy_(slots, non_blocking=True)
        st["tokens"][:b].copy_(tokens, non_blocking=True)
        st["lens"][:b].copy_(cache_lens, non_blocking=True)
        if rope_deltas is not None:
            st["deltas"][:b].copy_(rope_deltas, non_blocking=True)
        graph.replay()
        return out[:b]

    def _capture(self, B: int, L: int):
        dev = self.device
        st = {"slots": torch.full((B,), self.scratch_slot, dtype=torch.long, device=dev),
              "tokens": torch.zeros(B, dtype=torch.long, device=dev),
              "lens": torch.zeros(B, dtype=torch.long, device=dev),
              "deltas": torch.zeros(B, dtype=torch.long, device=dev)}
        side = torch.cuda.Stream(dev)
        side.wait_stream(torch.cuda.current_stream(dev))
        with torch.cuda.stream(side):
            for _ in range(2):  # warm-up outside the graph (kernel selection, workspace allocation)
                self._decode_step(st["slots"], st["tokens"], st["lens"], st["deltas"], L)
        torch.cuda.current_stream(dev).wait_stream(side)
        graph = torch.cuda.CUDAGraph()
        with torch.cuda.graph(graph, pool=self._graph_pool):
            out = self._decode_step(st["slots"], st["tokens"], st["lens"], st["deltas"], L)
        if self._graph_pool is None:
            self._graph_pool = graph.pool()
        return graph, st, out

    @torch.inference_mode()
    def logits(self, input_ids: torch.Tensor, table: torch.Tensor | None = None) -> torch.Tensor:
        """Full causal forward without the cache: [B, T] -> [B, T, V] (perplexity, tests)."""
        B, T = input_ids.shape
        input_ids = input_ids.to(self.device)
        cos, sin = self._rope(torch.arange(T, device=self.device))
        x = self.embed_ids(input_ids, table)
        for layer in self.layers:
            q, k, v = self._qkv(layer, x, cos, sin)
            a = F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=self.n_kv != self.n_heads)
            x = x + layer["o"](a.transpose(1, 2).reshape(B, T, -1))
            x = x + self._mlp(layer, _rms_norm(x, layer["post_norm"], self.eps))
        return self._final(x)
