"""AWQ 4-bit weight quantization (Lin et al., MLSys 2024) of a Llama-family decoder, natively.

The algorithm is AutoAWQ's, layer by layer:
  1. run the decoder layer in float32 on the calibration activations, recording each linear's
     input and each inspected block's output; its output feeds the next layer (float, so errors
     do not compound);
  2. per AWQ group (linears sharing an input, from the family module), search 20 ratios r of
     s = mean|x|^r (optionally AutoAWQ's "duo" form mean|x|^r / mean|w|^(1-r)) for the scale that
     minimises the block's output error with weights Q(W*s)/s;
  3. fold 1/s into the preceding op (norm or linear) and s into the linears;
  4. search a clipping threshold per output channel and group (not for q/k);
  5. quantize asymmetrically to 4 bits with zero points, per group of input channels, and pack
     into AutoAWQ's GEMM format.

Differences from AutoAWQ that do not change the objective, only the cost:
  - a group that is a single linear measures ||X ΔWᵀ||² through the Gram matrix XᵀX instead of
    re-running the linear over every token for every grid point, and evaluates all grid points
    in one batched product;
  - the clip search also works from per-group Gram blocks, all shrink ratios at once;
  - the float outputs of the inspected blocks come from the one layer forward, not extra runs;
  - everything is computed in float32 (AutoAWQ quantizes in the checkpoint's fp16), and codes
    are rounded against the fp16 scale that is actually stored.

Memory: weights are read from the safetensors files one layer at a time (the whole float model
is never instantiated); beyond one layer's weights, the calibration activations and that layer's
recorded inputs, only the embedding matrix is held while the first layer's input is computed.
"""

from __future__ import annotations

import inspect
import json
import math
import os
import resource
import shutil
import time
from pathlib import Path

from ..checkpoint import ShardWriter, weight_files
from ..errors import CheckpointError, InputError, StageError
from ..progress import Progress, ensure

BITS = 4
N_GRID = 20
CLIP_GRID = 20
CLIP_MAX_SHRINK = 0.5
CLIP_TOKENS = 512
# Working-set budget of one batched grid computation (bytes): bounds the temporaries. On a GPU
# up to a quarter of the free memory (at most 4 GiB): with 64 MiB a 7B layer's block search
# evaluated one candidate per pass and re-ran the float32 reference forward for each (18 s per
# layer on an H200).
CHUNK_BYTES = 64 << 20
CHUNK_BYTES_GPU_MAX = 4 << 30
SHARD_BYTES = 1 << 30
FORWARD_BYTES = 16 << 20  # CPU: stays on the allocator's heap
FORWARD_BYTES_GPU = 256 << 20  # GPU: fewer, larger forwards (memory is not the constraint there)
WEIGHT_SUFFIXES = (".safetensors", ".safetensors.index.json", ".bin", ".pt")
SKIP_FILES = ("config.json", "manifest.json")


# ---- quantization arithmetic -----------------------------------------------------------------
def group_params(w, group_size: int, bits: int = BITS):
    """Asymmetric per-group (scale, zero) of w [..., out, in] -> both [..., out, in/g]."""
    import torch

    wg = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    qmax = 2 ** bits - 1
    mx, mn = wg.amax(-1), wg.amin(-1)
    scale = (mx - mn).clamp(min=1e-5) / qmax
    zero = torch.clamp(-torch.round(mn / scale), 0, qmax)
    return scale, zero


def pseudo_quantize(w, group_size: int, bits: int = BITS):
    """Quantize-dequantize w [..., out, in] per group of `group_size` input channels."""
    import torch

    scale, zero = group_params(w, group_size, bits)
    wg = w.reshape(*w.shape[:-1], w.shape[-1] // group_size, group_size)
    s, z = scale[..., None], zero[..., None]
    q = (torch.clamp(torch.round(wg / s) + z, 0, 2 ** bits - 1) - z) * s
    return q.reshape(w.shape)


def quantize_weight(w, group_size: int, bits: int = BITS):
    """w [out, in] -> (codes [out, in] int64, zeros [out, in/g] int64, scales fp16 [out, in/g]).

    The scale is rounded to fp16 first (that is what is stored) and codes are rounded against it.
    """
    import torch

    scale, _ = group_params(w, group_size, bits)
    scale16 = scale.to(torch.float16).clamp(min=torch.finfo(torch.float16).tiny)
    s = scale16.to(torch.float32)
    qmax = 2 ** bits - 1
    wg = w.reshape(w.shape[0], -1, group_size)
    zero = torch.clamp(-torch.round(wg.amin(-1) / s), 0, qmax)
    codes = torch.clamp(torch.round(wg / s[..., None]) + zero[..., None], 0, qmax)
    return codes.reshape(w.shape).to(torch.int64), zero.to(torch.int64), scale16


# ---- searches -----------------------------------------------------------------------------------
def grid_scales(x_mean, w_mean=None, n_grid: int = N_GRID):
    """[n_grid, in] candidate scales for ratios 0, 1/n, ..., (n-1)/n (AutoAWQ's formula)."""
    import torch

    ratios = torch.arange(n_grid, dtype=torch.float32, device=x_mean.device)[:, None] / n_grid
    if w_mean is None:
        s = x_mean[None].pow(ratios).clamp(min=1e-4)
    else:
        s = (x_mean[None].pow(ratios) / (w_mean[None].pow(1 - ratios) + 1e-4)).clamp(min=1e-4)
    s = s / (s.amax(1, keepdim=True) * s.amin(1, keepdim=True)).sqrt()
    return torch.nan_to_num(s, nan=1.0, posinf=1.0, neginf=1.0)


def weight_mean(weights, group_size: int):
    """Mean over output rows of |w| normalised by its group's max (AutoAWQ's duo-scaling term)."""
    import torch

    w = torch.cat(weights, 0)
    wg = w.reshape(-1, group_size).abs()
    wg = wg / (wg.amax(1, keepdim=True) + 1e-6)
    return wg.reshape(w.shape).mean(0)


def gram(x, chunk_rows: int = 4096):
    """XᵀX of x [..., in] in float32, accumulated over row chunks."""
    import torch

    x = x.reshape(-1, x.shape[-1])
    g = torch.zeros(x.shape[1], x.shape[1], dtype=torch.float32, device=x.device)
    for i in range(0, x.shape[0], chunk_rows):
        c = x[i:i + chunk_rows].float()
        g.addmm_(c.t(), c)
    return g


def _grid_budget(device) -> int:
    import torch

    device = torch.device(device)
    if device.type != "cuda":
        return CHUNK_BYTES
    free, _ = torch.cuda.mem_get_info(device)
    return max(CHUNK_BYTES, min(CHUNK_BYTES_GPU_MAX, free // 4))


def _grid_chunk(per_point_bytes: int, n: int, device="cpu") -> int:
    return max(1, min(n, _grid_budget(device) // max(1, per_point_bytes)))


def linear_grid_losses(weights, g, scales, group_size: int):
    """Output MSE sum of Q(W*s)/s vs W for every candidate s, from the input Gram matrix g.

    ||X (Wq - W)ᵀ||² = Σ_rows d G dᵀ, exactly the loss AutoAWQ measures on the linear's output.
    """
    import torch

    losses = torch.zeros(scales.shape[0], dtype=torch.float64, device=scales.device)
    for w in weights:
        step = _grid_chunk(4 * w.numel() * 8, scales.shape[0], w.device)  # ~8 weight-sized temporaries per point
        for i in range(0, scales.shape[0], step):
            s = scales[i:i + step][:, None, :]
            d = pseudo_quantize(w[None] * s, group_size) / s - w[None]
            losses[i:i + step] += ((d @ g) * d).sum((1, 2)).double()
    return losses


def clip_thresholds(w, x, group_size: int, n_grid: int = CLIP_GRID, max_shrink: float = CLIP_MAX_SHRINK,
                    n_tokens: int = CLIP_TOKENS):
    """Best max |w| per (output channel, group) [out, in/g, 1], AutoAWQ's clip search.

    For each shrink ratio the weights are clamped to ±ratio·max|w|, quantized, and the output
    error on `n_tokens` evenly strided calibration tokens is measured per group, through each
    group's Gram block.
    """
    import torch

    out_f, in_f = w.shape
    ng = in_f // group_size
    x = x.reshape(-1, in_f)
    x = x[:: max(1, x.shape[0] // n_tokens)].float()
    xg = x.view(x.shape[0], ng, group_size).permute(1, 0, 2)  # [ng, M, g]
    gb = xg.transpose(1, 2) @ xg  # [ng, g, g]
    wg = w.view(out_f, ng, group_size)
    org_max = wg.abs().amax(-1, keepdim=True)  # [out, ng, 1]
    n_steps = int(max_shrink * n_grid)
    errs = []
    step = _grid_chunk(4 * w.numel() * 8, n_steps, w.device)
    for i in range(0, n_steps, step):
        ratios = 1 - torch.arange(i, min(n_steps, i + step), dtype=torch.float32, device=w.device) / n_grid
        mv = org_max[None] * ratios[:, None, None, None]  # [S, out, ng, 1]
        q = pseudo_quantize(torch.maximum(torch.minimum(wg[None], mv), -mv), group_size)
        d = (q - wg[None]).transpose(1, 2)  # [S, ng, out, g]
        errs.append(((d @ gb) * d).sum(-1).transpose(1, 2))  # [S, out, ng]
    best = torch.cat(errs).argmin(0)  # first minimum, as AutoAWQ's strict '<'
    ratios = 1 - best.to(torch.float32) / n_grid
    return org_max * ratios[..., None]


# ---- one decoder layer --------------------------------------------------------------------------
class PerSample:
    """A layer keyword argument with one entry per calibration sample (axis 0), e.g. the image states a
    cross-attention layer reads: each forward over samples [lo, hi) gets rows [lo, hi) of it."""

    def __init__(self, tensor):
        self.tensor = tensor


def _call_kwargs(module, kwargs: dict) -> dict:
    params = inspect.signature(module.forward).parameters
    return {k: v for k, v in kwargs.items() if k in params}


def _rows(kw: dict, lo: int, hi: int) -> dict:
    """`kw` for samples [lo, hi): PerSample values sliced, the rest as they are."""
    return {k: (v.tensor[lo:hi] if isinstance(v, PerSample) else v) for k, v in kw.items()}


def _first(out):
    return out[0] if isinstance(out, tuple) else out


def _sq_err(out, ref):
    """Sum of squared differences, as a 0-d float64 tensor on their device (no host sync)."""
    import torch

    d = (out - ref).float().reshape(-1)
    return torch.dot(d, d).double()


def _recording_forward(m, cache: dict):
    import torch.nn.functional as F

    def forward(inp):
        out = F.linear(inp, m.weight, m.bias)
        cache[id(m)] = (inp, out)
        return out

    return forward


def _delta_forward(ref_in, ref_out, ref_in_fast, dw, weight_fast, fast):
    """out = ref_out + ref_in·ΔWᵀ + (x - ref_in)·W'ᵀ, the two changes in low precision."""
    import torch
    import torch.nn.functional as F

    def forward(inp):
        out = ref_out
        if dw is not None:
            out = torch.add(out, F.linear(ref_in_fast, dw))
        if not (inp.data_ptr() == ref_in.data_ptr() and inp.shape == ref_in.shape):
            out = torch.add(out, F.linear((inp - ref_in).to(fast), weight_fast()))
        return out

    return forward


def fast_delta_dtype(device) -> object:
    """bfloat16 when its matmul is clearly faster than float32 here (AMX CPUs, GPUs), else None."""
    import torch

    device = torch.device(device)
    if os.environ.get("VLMCTL_AWQ_EXACT"):
        return None
    if device.type == "cuda":
        return torch.bfloat16 if torch.cuda.is_bf16_supported() else None
    a, b = torch.randn(2048, 1024), torch.randn(1024, 1024)
    times = {}
    for dt in (torch.float32, torch.bfloat16):
        x, y = a.to(dt), b.to(dt)
        for _ in range(2):  # warm-up: the first calls pick kernels
            x @ y
        t = time.perf_counter()
        for _ in range(3):
            x @ y
        times[dt] = time.perf_counter() - t
    return torch.bfloat16 if times[torch.bfloat16] * 1.5 < times[torch.float32] else None


class LayerQuantizer:
    """Runs AWQ on one decoder layer module (float32), in place, and returns its packed linears."""

    def __init__(self, family, group_size: int, duo_scaling: bool, layer_kwargs: dict, chunk: int,
                 delta_dtype=None, groups=None):
        self.family = family
        self.delta_dtype = delta_dtype
        self.groups = family.awq_groups if groups is None else groups  # a layer kind's (DecoderFamily.groups_for)
        self.group_size = group_size
        self.duo = duo_scaling
        self.kwargs = layer_kwargs
        self.chunk = chunk  # calibration samples per forward
        names: list[str] = []
        for g in self.groups:
            names += [n for n in g.linears if n not in names]
        self.linear_names = names

    def forward_record(self, layer, x):
        """Float layer output for x [n, T, H], and the input of every linear.

        Inputs are written into buffers allocated once per distinct input tensor (q/k/v share
        one), so the recording never holds a second copy of the chunks.
        """
        import torch

        n = x.shape[0]
        buffers: dict[str, object] = {}
        by_ptr: dict[int, object] = {}
        state = {"lo": 0}

        def record(name, t):
            lo = state["lo"]
            key = (t.data_ptr(), tuple(t.shape), tuple(t.stride()))
            if key in by_ptr:  # the same tensor as an earlier linear's in this chunk (q/k/v)
                buf = by_ptr[key][1]
            else:
                buf = buffers.get(name)  # a later chunk: this linear's buffer
                if buf is None:
                    buf = torch.empty((n,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device)
                buf[lo:lo + t.shape[0]].copy_(t)
                by_ptr[key] = (t, buf)  # holding t: its address cannot be reused within the chunk
            buffers[name] = buf

        hooks = [layer.get_submodule(nm).register_forward_pre_hook(lambda m, args, nm=nm: record(nm, args[0]))
                 for nm in self.linear_names]
        kw = _call_kwargs(layer, self.kwargs)
        out = torch.empty_like(x)
        try:
            for lo, hi in self._chunks(x):
                state["lo"] = lo
                by_ptr.clear()
                out[lo:hi] = _first(layer(x[lo:hi], **_rows(kw, lo, hi)))
        finally:
            for h in hooks:
                h.remove()
        return out, buffers

    def search_scale(self, layer, group, x):
        """Best scale [in] for one group, given the input x [n, T, in] its linears share."""
        import torch

        lins = [layer.get_submodule(n) for n in group.linears]
        weights = [m.weight.data for m in lins]
        x_mean = torch.zeros(x.shape[-1], dtype=torch.float64, device=x.device)
        flat = x.reshape(-1, x.shape[-1])
        for i in range(0, flat.shape[0], 2048):  # small chunks: no large temporaries
            x_mean += flat[i:i + 2048].abs().sum(0).double()
        x_mean = (x_mean / flat.shape[0]).float()
        w_mean = weight_mean(weights, self.group_size) if self.duo else None
        scales = grid_scales(x_mean, w_mean)
        if group.module is None:
            losses = linear_grid_losses(weights, gram(x), scales, self.group_size)
        else:
            losses = self._block_grid_losses(layer.get_submodule(group.module), lins, weights, x, scales)
        if not torch.isfinite(losses).any():
            raise StageError(f"AWQ scale search for {', '.join(group.linears)} produced no finite loss "
                             "(non-finite activations in the calibration run?)")
        losses = torch.nan_to_num(losses, nan=math.inf)
        return scales[int(torch.argmin(losses))]

    def _block_grid_losses(self, block, lins, weights, x, scales):
        """Sum of squared block-output errors for every candidate scale.

        With a fast low-precision matmul (`self.delta_dtype`), each linear in the block computes
        its output as the float32 reference output plus the *change* (x·ΔWᵀ for a quantized weight,
        Δx·Wᵀ for a changed input) in bfloat16 with float32 accumulation. The change is a few
        percent of the output, so its bf16 rounding is far below the differences the search ranks;
        nonlinear parts (norms, softmax, activations) stay in float32.
        """
        import torch
        import torch.nn.functional as F

        n_grid = scales.shape[0]
        losses = torch.zeros(n_grid, dtype=torch.float64, device=x.device)  # summed on the device
        fast = self.delta_dtype
        if fast is None:  # exact float32 path: swap the weights, run the block
            kw = _call_kwargs(block, self.kwargs)
            ref = self._block_reference(block, x, kw)
            try:
                for k in range(n_grid):
                    s = scales[k][None]
                    for m, w in zip(lins, weights):
                        m.weight.data = pseudo_quantize(w * s, self.group_size) / s
                    for i, (lo, hi) in enumerate(self._chunks(x)):
                        losses[k] += _sq_err(_first(block(x[lo:hi], **_rows(kw, lo, hi))), ref[i])
            finally:
                for m, w in zip(lins, weights):
                    m.weight.data = w
            return losses.cpu()

        kw = _call_kwargs(block, self.kwargs)
        all_lins = [m for m in block.modules() if isinstance(m, torch.nn.Linear)]
        varying = {id(m): w for m, w in zip(lins, weights)}
        per_point = sum(w.numel() for w in weights) * 2
        step = _grid_chunk(per_point, n_grid, x.device)
        w_fast = {id(m): m.weight.data.to(fast) for m in all_lins if id(m) not in varying}
        try:
            for g0 in range(0, n_grid, step):
                g1 = min(n_grid, g0 + step)
                deltas = {}
                for m, w in zip(lins, weights):
                    d = []
                    for k in range(g0, g1):
                        s = scales[k][None]
                        d.append((pseudo_quantize(w * s, self.group_size) / s - w).to(fast))
                    deltas[id(m)] = d
                for lo, hi in self._chunks(x):
                    xc = x[lo:hi]
                    kwc = _rows(kw, lo, hi)
                    cache = {}
                    for m in all_lins:
                        m.forward = _recording_forward(m, cache)
                    ref = _first(block(xc, **kwc))
                    cast = {}
                    for m in all_lins:
                        inp = cache[id(m)][0]
                        if id(m) in varying and inp.data_ptr() not in cast:
                            cast[inp.data_ptr()] = inp.to(fast)
                    for j, k in enumerate(range(g0, g1)):
                        for m in all_lins:
                            ref_in, ref_out = cache[id(m)]
                            if id(m) in varying:
                                dw = deltas[id(m)][j]
                                m.forward = _delta_forward(ref_in, ref_out, cast[ref_in.data_ptr()], dw,
                                                           lambda m=m, dw=dw: (m.weight.data + dw.float()).to(fast), fast)
                            else:
                                wf = w_fast[id(m)]
                                m.forward = _delta_forward(ref_in, ref_out, None, None, lambda wf=wf: wf, fast)
                        losses[k] += _sq_err(_first(block(xc, **kwc)), ref)
                    del cache, cast
        finally:
            for m in all_lins:
                m.__dict__.pop("forward", None)
        return losses.cpu()

    def _chunks(self, x):
        return [(i, min(x.shape[0], i + self.chunk)) for i in range(0, x.shape[0], self.chunk)]

    def _block_reference(self, block, x, kw):
        return [_first(block(x[lo:hi], **_rows(kw, lo, hi))) for lo, hi in self._chunks(x)]

    @staticmethod
    def apply_scale(layer, group, scale, norm_offset: float = 0.0):
        """Fold 1/s into the op before the group and s into the group's linears (exact in float).
        `norm_offset`: a norm before the group multiplies by (norm_offset + w) (Gemma's 1 + w)."""
        import torch

        prev = layer.get_submodule(group.prev_op)
        if isinstance(prev, torch.nn.Linear):
            prev.weight.data[-scale.numel():].div_(scale[:, None])
            if prev.bias is not None:
                prev.bias.data[-scale.numel():].div_(scale)
        elif getattr(prev, "weight", None) is not None and prev.weight.dim() == 1 and prev.weight.numel() == scale.numel():
            # an RMSNorm / LayerNorm gain; a norm that multiplies by (offset + w) keeps its offset
            prev.weight.data.add_(norm_offset).div_(scale).sub_(norm_offset)
            if getattr(prev, "bias", None) is not None:
                prev.bias.data.div_(scale)
        else:
            raise StageError(f"AWQ cannot fold a scale into {group.prev_op} ({type(prev).__name__})")
        for n in group.linears:
            layer.get_submodule(n).weight.data.mul_(scale[None])

    def quantize(self, layer, x):
        """AWQ on `layer` (in place). Returns (float output for the next layer, {linear: (qweight, qzeros, scales)})."""
        import torch

        from .packing import pack_gemm

        out, inputs = self.forward_record(layer, x)
        chosen = []
        for g in self.groups:
            if not g.scaled:  # nothing in the layer feeds these linears (image states): no scale to fold
                continue
            if g.requires_equal_shapes:
                prev = layer.get_submodule(g.prev_op)
                if tuple(prev.weight.shape) != tuple(layer.get_submodule(g.linears[0]).weight.shape):
                    continue  # e.g. o_proj after v_proj under grouped-query attention
            chosen.append((g, self.search_scale(layer, g, inputs[g.linears[0]])))
        scaled_inputs = dict(inputs)
        for g, s in chosen:
            self.apply_scale(layer, g, s, self.family.norm_gain_offset)
            xs = inputs[g.linears[0]] / s
            for n in g.linears:
                scaled_inputs[n] = xs
        skip = set(self.family.clip_skip())
        for n in self.linear_names:
            if n in skip:
                continue
            lin = layer.get_submodule(n)
            w = lin.weight.data
            mx = clip_thresholds(w, scaled_inputs[n], self.group_size)
            wg = w.view(w.shape[0], -1, self.group_size)
            lin.weight.data = torch.maximum(torch.minimum(wg, mx), -mx).reshape(w.shape)
        packed = {}
        for n in self.linear_names:
            w = layer.get_submodule(n).weight.data
            codes, zeros, scales16 = quantize_weight(w, self.group_size)
            qweight, qzeros = pack_gemm(codes.cpu(), zeros.cpu())
            packed[n] = (qweight, qzeros, scales16.t().contiguous().cpu())
        return out, packed


# ---- the whole decoder --------------------------------------------------------------------------
class _Tensors:
    """Lazy access to a checkpoint's tensors by name (safetensors, memory-mapped).

    `release()` closes the files: pages of a memory-mapped file that were read stay resident (and
    count as this process's memory) until the mapping goes, so the quantizer releases them after
    every layer instead of accumulating the whole checkpoint.
    """

    def __init__(self, ckpt_dir: Path):
        self.where: dict[str, Path] = {}
        self.handles: dict[Path, object] = {}
        for f in weight_files(ckpt_dir):
            for k in self._open(f).keys():
                self.where[k] = f

    @staticmethod
    def _open(f: Path):
        from safetensors import safe_open

        try:
            return safe_open(str(f), framework="pt")
        except Exception as e:  # also when a file changed or vanished between layers
            raise CheckpointError(f"{f}: not a valid safetensors file ({e})") from None

    def names(self) -> list[str]:
        return list(self.where)

    def get(self, name: str):
        if name not in self.where:
            raise CheckpointError(f"tensor {name!r} is missing from the checkpoint")
        f = self.where[name]
        if f not in self.handles:
            self.handles[f] = self._open(f)
        return self.handles[f].get_tensor(name)

    def release(self) -> None:
        self.handles.clear()


def _skeleton(src_dir: Path, family):
    """(HF config, the causal LM on the meta device, name of its input-embedding weight)."""
    import torch
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(str(src_dir))
    hf_config._attn_implementation = "sdpa"  # causal attention with attention_mask=None
    cls = getattr(transformers, family.causal_lm_class)
    with torch.device("meta"):  # module structure without memory
        skeleton = cls(hf_config)
    embed_mod = skeleton.get_input_embeddings()
    embed_name = next(n for n, m in skeleton.named_modules() if m is embed_mod) + ".weight"
    return hf_config, skeleton, embed_name


def embedding_weight(llm_dir: Path):
    """The input-embedding matrix of the causal LM checkpoint in `llm_dir`."""
    from ..models.decoders import decoder_family

    cfg = json.loads((Path(llm_dir) / "config.json").read_text())
    _, _, name = _skeleton(Path(llm_dir), decoder_family(cfg.get("model_type", "")))
    return _Tensors(Path(llm_dir)).get(name)


def embedding_scale(llm_dir: Path) -> float:
    """What the decoder multiplies token embeddings by (1.0 for most; Gemma's sqrt(hidden))."""
    from ..models.decoders import decoder_spec

    scale = decoder_spec(json.loads((Path(llm_dir) / "config.json").read_text())).embed_scale
    return 1.0 if scale is None else scale


def valid_group_sizes(in_features: list[int]) -> list[int]:
    g = 0
    for n in in_features:
        g = math.gcd(g, n)
    return [d for d in range(8, g + 1, 8) if g % d == 0]


def check_group_size(layer, family, group_size: int, layer_name: str, groups=None) -> None:
    import torch

    ins = {}
    for g in family.awq_groups if groups is None else groups:
        for n in g.linears:
            m = layer.get_submodule(n)
            if not isinstance(m, torch.nn.Linear):
                raise StageError(f"{layer_name}.{n} is {type(m).__name__}, not a linear layer")
            ins[n] = (m.in_features, m.out_features)
    valid = valid_group_sizes([i for i, _ in ins.values()])
    for n, (i, o) in ins.items():
        if i % group_size:
            sizes = ", ".join(map(str, valid)) if valid else "none"
            raise InputError(f"group size {group_size} does not divide the {i} input features of {layer_name}.{n}; "
                             f"valid group sizes for this model: {sizes}")
        if o % 8:
            raise InputError(f"{layer_name}.{n} has {o} output features; AWQ GEMM packing needs a multiple of 8")


def _trim_heap() -> None:
    """Give freed heap memory back to the OS between layers (glibc), so fragmentation from one
    layer's temporaries does not add up over the layers. A no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def peak_rss_mib() -> float:
    """This process's peak resident memory in MiB.

    Linux's VmHWM is the high-water mark of the current address space; getrusage's ru_maxrss also
    counts the parent's memory at fork/exec time, which makes a child look as big as its parent.
    """
    try:
        for line in Path("/proc/self/status").read_text().splitlines():
            if line.startswith("VmHWM:"):
                return int(line.split()[1]) / 1024.0
    except (OSError, ValueError, IndexError):
        pass
    return resource.getrusage(resource.RUSAGE_SELF).ru_maxrss / 1024.0


def _load_tokenizer(src_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(src_dir))
    except Exception as e:
        raise CheckpointError(f"{src_dir}: cannot load the tokenizer for calibration ({str(e).splitlines()[0][:200]})") from None


def quantize_causal_lm(src_dir: Path, out_dir: Path, settings, base_dir: Path | None = None,
                       progress: Progress | None = None, *, device: str | None = None, calib_ids=None,
                       calib_embeds=None, calib_cross: dict | None = None) -> dict:
    """AWQ-quantize the plain HF causal LM in `src_dir` into an AutoAWQ GEMM checkpoint in `out_dir`.

    `settings` is a `QuantizationSettings`; `calib_ids` (LongTensor [n, T]) overrides its calibration
    data, and `calib_embeds` (float [n, T, hidden], e.g. with image features) replaces the embedding
    lookup altogether. Returns a summary (timings, peak memory, sizes) for the manifest.

    Decoders with cross-attention layers: `calib_cross` (from `vlm_calibration.cross_attention_calibration`)
    holds what those layers read per sample - the image states and transformers' masks; without it the
    calibration is text, which those layers never see (transformers skips them), so they pass it on
    unchanged and must stay float (`settings.cross_attention`). Float cross-attention layers are
    copied as they are and listed in `modules_to_not_convert`.
    """
    import torch

    from ..models.decoders import calibration_layer_kwargs, decoder_family, decoder_spec
    from .calibration import load_calibration

    t0 = time.perf_counter()
    progress = ensure(progress)
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
    cfg_path = src_dir / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{src_dir}: no config.json (not a Hugging Face checkpoint directory)")
    config_dict = json.loads(cfg_path.read_text())
    if config_dict.get("quantization_config"):
        raise CheckpointError(f"{src_dir}: already quantized "
                              f"({config_dict['quantization_config'].get('quant_method', '?')}); give a float checkpoint")
    if settings.bits != 4 or not settings.zero_point:
        raise InputError("AWQ GEMM output supports bits=4 with zero_point=true only")
    family = decoder_family(config_dict.get("model_type", ""))
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    group_size = settings.group_size
    spec = decoder_spec(config_dict)
    kinds = [spec.layer_types[i] if spec.layer_types else "full" for i in range(spec.num_layers)]
    cross_mode = getattr(settings, "cross_attention", "float")
    quantize_cross = cross_mode == "quantize"
    if spec.cross_layers and quantize_cross and calib_cross is None:
        raise InputError("quantization.cross_attention quantize needs image-text calibration data (a .jsonl whose "
                         "records name images): only image states reach the cross-attention layers; or keep them "
                         "float (quantization.cross_attention: float)")

    hf_config, skeleton, embed_name = _skeleton(src_dir, family)
    layers = skeleton.get_submodule(family.layer_prefix)
    n_layers = len(layers)
    parent = skeleton.get_submodule(family.layer_prefix.rsplit(".", 1)[0]) if "." in family.layer_prefix else skeleton
    for kind in dict.fromkeys(kinds):  # one layer of each kind that gets quantized, before any real work
        i = kinds.index(kind)
        if kind != "cross_attention" or quantize_cross:
            check_group_size(layers[i], family, group_size, f"{family.layer_prefix}.{i}", family.groups_for(kind))

    tokens = calib_ids
    cal = settings.calibration
    if calib_embeds is not None:
        tokens = torch.zeros(calib_embeds.shape[:2], dtype=torch.long)  # shape only
    elif tokens is None:
        if cal.seq_len > int(config_dict.get("max_position_embeddings", 1 << 30)):
            raise InputError(f"calibration seq_len {cal.seq_len} exceeds the model's max_position_embeddings")
        tokens = load_calibration(cal.data, _load_tokenizer(src_dir), cal.samples, cal.seq_len, base_dir)
        if tokens.shape[0] < cal.samples:
            progress.log(f"calibration data gave {tokens.shape[0]} block(s) of {cal.seq_len} tokens "
                         f"(asked for {cal.samples})")
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n_samples, seq_len = tokens.shape


    tensors = _Tensors(src_dir)
    with torch.inference_mode():
        if calib_embeds is not None:
            x = calib_embeds.to(dev, torch.float32)
        else:
            x = torch.nn.functional.embedding(tokens, tensors.get(embed_name).to(torch.float32)).to(dev)
            scale = decoder_spec(config_dict).embed_scale
            if scale is not None:  # e.g. Gemma's sqrt(hidden)
                x = x * scale
        rotary = type(parent.rotary_emb)(config=hf_config).to(dev)
        pos = torch.arange(seq_len, device=dev)[None]
        per_layer = calibration_layer_kwargs(family, hf_config, rotary, x, pos)
    width = max(hf_config.hidden_size, getattr(hf_config, "intermediate_size", 0) or 0)
    # Samples per forward: on a CPU, intermediates of ~16 MiB stay on the allocator's heap (larger
    # ones are mmapped and page-faulted afresh on every use, which made the search ~30% slower); a
    # GPU gets fewer, larger kernels.
    budget = FORWARD_BYTES if dev.type == "cpu" else FORWARD_BYTES_GPU
    chunk = max(1, min(n_samples, budget // (seq_len * width * 4)))

    layer_prefix = family.layer_prefix + "."
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out_dir, max_bytes=SHARD_BYTES)
    for name in tensors.names():  # everything outside the decoder layers, unchanged
        if not name.startswith(layer_prefix):
            writer.add(name, tensors.get(name))
    delta_dtype = fast_delta_dtype(dev)
    cross_kw = {}
    if calib_cross is not None:
        cross_kw = {k: PerSample(calib_cross[v].to(dev, torch.float32)) for k, v in
                    (("cross_attention_states", "states"), ("cross_attention_mask", "mask"),
                     ("full_text_row_masked_out_mask", "rowmask"))}
    float_modules: list[str] = []
    task = progress.task(f"awq: quantizing {n_layers} decoder layers", total=n_layers)
    n_linears = 0
    with torch.inference_mode():
        for i in range(n_layers):
            prefix = f"{layer_prefix}{i}."
            names = [n for n in tensors.names() if n.startswith(prefix)]
            src = {n[len(prefix):]: tensors.get(n) for n in names}
            cross = kinds[i] == "cross_attention"
            groups = family.groups_for(kinds[i])
            if cross and not quantize_cross:
                for n in names:  # kept float, byte for byte
                    writer.add(n, tensors.get(n))
                # module names as transformers 5 (a suffix) and vLLM (a substring) both match them
                float_modules += [f"layers.{i}.{lin}" for g in groups for lin in g.linears
                                  if f"layers.{i}.{lin}" not in float_modules]
                if calib_cross is not None:  # the next layer's input: this layer's float output
                    x = _float_forward(layers[i], src, dev, x, {**per_layer[i], **cross_kw}, chunk, src_dir, i)
                layers[i] = torch.nn.Identity()
                tensors.release()
                task.advance()
                continue  # without image states transformers skips it: x passes unchanged
            layer = layers[i]
            try:
                layer.load_state_dict({k: v.to(dev, torch.float32) for k, v in src.items()}, strict=True, assign=True)
            except RuntimeError as e:
                raise CheckpointError(f"{src_dir}: layer {i} tensors do not match the config "
                                      f"({str(e).splitlines()[0][:200]})") from None
            quantizer = LayerQuantizer(family, group_size, settings.duo_scaling, per_layer[i], chunk, delta_dtype,
                                       groups)
            if cross:
                quantizer.kwargs = {**per_layer[i], **cross_kw}  # the image states and masks, per sample
            x, packed = quantizer.quantize(layer, x)
            state = layer.state_dict()
            for k, v in state.items():
                mod = k.rsplit(".", 1)[0]
                if mod in packed and k.endswith(".weight"):
                    continue
                writer.add(prefix + k, v.detach().to("cpu", src[k].dtype).clone())
            for mod, (qw, qz, sc) in packed.items():
                writer.add(f"{prefix}{mod}.qweight", qw)
                writer.add(f"{prefix}{mod}.qzeros", qz)
                writer.add(f"{prefix}{mod}.scales", sc)
            n_linears += len(packed)
            layers[i] = torch.nn.Identity()  # drop this layer's weights
            del layer, state, src, packed
            tensors.release()
            _trim_heap()
            task.advance()
    task.done()
    writer.close()

    cfg_out = dict(config_dict)
    cfg_out["quantization_config"] = awq_config(group_size, float_modules or None)
    (out_dir / "config.json").write_text(json.dumps(cfg_out, indent=2))
    copy_side_files(src_dir, out_dir)
    summary = {}
    if spec.cross_layers:
        summary["cross_attention"] = {"layers": list(spec.cross_layers), "mode": cross_mode,
                                      "calibrated_with_images": calib_cross is not None}
    return {
        "backend": "vlmctl-awq", "backend_version": _version(),
        "method": "awq", "impl": "vlmctl", "bits": BITS, "group_size": group_size, "zero_point": True,
        "duo_scaling": settings.duo_scaling, "layers": n_layers, "quantized_linears": n_linears, **summary,
        "calibration": {"data": cal.data if calib_ids is None else "(given tokens)", "samples": int(n_samples),
                        "seq_len": int(seq_len), "image_text": calib_embeds is not None},
        "device": str(dev), "search_delta_dtype": str(delta_dtype).replace("torch.", "") if delta_dtype else "float32",
        "wall_s": round(time.perf_counter() - t0, 2), "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def _float_forward(layer, src: dict, dev, x, kwargs: dict, chunk: int, src_dir: Path, i: int):
    """The float output of a decoder layer kept unquantized (its input for the next layer)."""
    import torch

    try:
        layer.load_state_dict({k: v.to(dev, torch.float32) for k, v in src.items()}, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"{src_dir}: layer {i} tensors do not match the config "
                              f"({str(e).splitlines()[0][:200]})") from None
    kw = _call_kwargs(layer, kwargs)
    out = torch.empty_like(x)
    for lo in range(0, x.shape[0], chunk):
        hi = min(x.shape[0], lo + chunk)
        out[lo:hi] = _first(layer(x[lo:hi], **_rows(kw, lo, hi)))
    return out


def awq_config(group_size: int, modules_to_not_convert: list[str] | None = None) -> dict:
    """`quantization_config` of an AutoAWQ GEMM checkpoint (as transformers and vLLM read it)."""
    return {"quant_method": "awq", "bits": BITS, "group_size": group_size, "zero_point": True, "version": "gemm",
            "modules_to_not_convert": modules_to_not_convert}


def copy_side_files(src_dir: Path, out_dir: Path) -> None:
    """Tokenizer, generation config, chat template...: every non-weight file but config.json."""
    for p in Path(src_dir).iterdir():
        if p.is_file() and not p.name.endswith(WEIGHT_SUFFIXES) and p.name not in SKIP_FILES:
            shutil.copy2(p, out_dir / p.name)


def _version() -> str:
    from .. import __version__

    return __version__


# ---- workspaces and whole-VLM checkpoints -------------------------------------------------------
def write_vlm_checkpoint(workspace: Path, quantized_llm: Path, out_dir: Path, progress: Progress | None = None) -> dict:
    """A whole-VLM AWQ checkpoint from a conversion workspace and its quantized decoder.

    Vision tensors are copied byte for byte from the workspace's vision/; decoder tensors come from
    `quantized_llm` (GEMM format). Names are the VLM's (the family's `join_key`), and
    `quantization_config.modules_to_not_convert` lists the family's vision modules.
    """
    from ..checkpoint import iter_tensors
    from ..models.base import DECODER, VISION
    from ..models.registry import get_family

    progress = ensure(progress)
    workspace, quantized_llm, out_dir = Path(workspace), Path(quantized_llm), Path(out_dir)
    info = json.loads((workspace / "family.json").read_text())
    family = get_family(info["family"])
    llm_cfg = json.loads((quantized_llm / "config.json").read_text())
    quant = llm_cfg.get("quantization_config") or {}
    if quant.get("quant_method") != "awq":
        raise CheckpointError(f"{quantized_llm}: not an AWQ checkpoint")
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out_dir, max_bytes=SHARD_BYTES)
    counts = {VISION: 0, DECODER: 0}
    task = progress.task("awq: writing the whole-VLM checkpoint")
    for part, src in ((VISION, workspace / "vision"), (DECODER, quantized_llm)):
        for name, t, _ in iter_tensors(src):
            writer.add(family.join_key(part, name), t)
            counts[part] += 1
            task.advance()
    writer.close()
    task.done()
    cfg = json.loads((workspace / "vision" / "config.json").read_text())
    # the vision modules, and any decoder linears the quantized decoder kept float
    cfg["quantization_config"] = awq_config(int(quant["group_size"]), list(family.vision_module_names())
                                            + list(quant.get("modules_to_not_convert") or []))
    (out_dir / "config.json").write_text(json.dumps(cfg, indent=2))
    proc = workspace / "processor"
    if proc.is_dir():
        copy_side_files(proc, out_dir)
    return {"vision_tensors": counts[VISION], "decoder_tensors": counts[DECODER]}


def quantize_workspace(workspace: Path, out_dir: Path, settings, base_dir: Path | None = None,
                       progress: Progress | None = None) -> dict:
    """Quantize a conversion workspace's decoder: out_dir/llm (decoder) and out_dir/vlm (whole VLM)."""
    workspace, out_dir = Path(workspace), Path(out_dir)
    if not (workspace / "llm" / "config.json").exists():
        raise CheckpointError(f"{workspace}: not a conversion workspace (no llm/config.json)")
    from .vlm_calibration import cross_attention_calibration, image_text_embeddings, read_image_text_records

    cal = settings.calibration
    records = read_image_text_records(cal.data, base_dir)
    if settings.impl == "autoawq":
        if records is not None:
            raise InputError("image-text calibration runs with --impl vlmctl only (AutoAWQ takes text)")
        from .autoawq_impl import quantize_with_autoawq

        summary = quantize_with_autoawq(workspace / "llm", out_dir / "llm", settings, base_dir, progress)
    else:
        embeds = cross = None
        if records is not None:
            if not (workspace / "vision").is_dir():
                raise InputError(f"{cal.data}: image-text calibration needs a VLM workspace (vision/ is missing)")
            from ..models.registry import get_family

            family = get_family(json.loads((workspace / "family.json").read_text())["family"])
            if family.image_input == "cross_attention":
                embeds, cross = cross_attention_calibration(workspace, records, cal.samples, cal.seq_len,
                                                            progress=progress)
            else:
                embeds = image_text_embeddings(workspace, records, cal.samples, cal.seq_len, progress=progress)
        summary = quantize_causal_lm(workspace / "llm", out_dir / "llm", settings, base_dir, progress,
                                     calib_embeds=embeds, calib_cross=cross)
    if (workspace / "vision").is_dir() and (workspace / "family.json").exists():
        summary["vlm"] = write_vlm_checkpoint(workspace, out_dir / "llm", out_dir / "vlm", progress)
    return summary


def quantize_path(src: Path, out_dir: Path, settings, base_dir: Path | None = None,
                  progress: Progress | None = None, dtype: str = "float16") -> dict:
    """`vlmctl quantize --awq SRC -o OUT` for any accepted SRC.

    - a conversion workspace (family.json + llm/) or a work directory (convert/ inside):
      OUT/llm and OUT/vlm;
    - a VLM checkpoint: converted first (in `dtype`) into OUT/.convert, then as a workspace;
    - a plain causal LM: OUT is the AWQ checkpoint.
    """
    from ..models.decoders import DECODER_FAMILIES

    src = Path(src)
    out_dir = Path(out_dir)
    if not src.is_dir():
        raise InputError(f"{src}: no such directory")
    if (src / "convert" / "family.json").exists():
        src = src / "convert"
    if (src / "family.json").exists() and (src / "llm").is_dir():
        return quantize_workspace(src, out_dir, settings, base_dir, progress)
    cfg_path = src / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{src}: neither a checkpoint (config.json) nor a vlmctl workspace")
    cfg = json.loads(cfg_path.read_text())
    decoder_types = {t for f in DECODER_FAMILIES.values() for t in f.model_types}
    if cfg.get("model_type") in decoder_types:
        if settings.impl == "autoawq":
            from .autoawq_impl import quantize_with_autoawq

            return quantize_with_autoawq(src, out_dir, settings, base_dir, progress)
        return quantize_causal_lm(src, out_dir, settings, base_dir, progress)
    from ..convert import convert_checkpoint
    from ..models.registry import detect_family

    detect_family(cfg, where=str(cfg_path))  # a clear error for unsupported models
    ws = out_dir / ".convert"
    if ws.exists():
        shutil.rmtree(ws)
    try:
        convert_checkpoint(src, ws, dtype, progress)
        return quantize_workspace(ws, out_dir, settings, base_dir, progress)
    finally:
        shutil.rmtree(ws, ignore_errors=True)


def threads_note() -> str:
    import torch

    return f"torch {torch.__version__}, {torch.get_num_threads()} threads, {os.cpu_count()} CPUs"
