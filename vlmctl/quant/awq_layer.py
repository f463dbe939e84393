"""The AWQ layer quantizer: runs AWQ on one decoder layer module in float32, in place (record the
linears' inputs, search and fold each group's scale, clip, quantize, pack to AutoAWQ GEMM).

What layers, groups and norms mean comes from the decoder family (models/decoders.py); the
arithmetic from awq_math.py; reading and writing checkpoints from awq.py, which drives this over
a whole decoder.
"""

from __future__ import annotations

import inspect
import math
import os
import time

from ..errors import InputError, StageError
from .awq_math import (_grid_chunk, clip_thresholds, grid_scales, gram, linear_grid_losses, pseudo_quantize,
                       quantize_weight, valid_group_sizes, weight_mean)


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
    if "cpu" not in _CPU_BF16:  # measured once a process
        _CPU_BF16["cpu"] = _cpu_bf16_is_fast()
    return torch.bfloat16 if _CPU_BF16["cpu"] else None


_CPU_BF16: dict = {}


def _cpu_bf16_is_fast() -> bool:
    """Whether a bf16 matmul beats float32 by 1.5x on this CPU. Without native bf16 (no AMX / AVX512-BF16) it is
    emulated, ~100x slower, and the first call says so: the probe then stops there. (It used 2048 x 1024
    matrices and five bf16 calls, ~22 s on a 2-core CPU, on every quantize.)"""
    import torch

    a, b = torch.randn(512, 512), torch.randn(512, 512)

    def timed(x, y):
        t = time.perf_counter()
        x @ y
        return time.perf_counter() - t

    x, y = a.float(), b.float()
    timed(x, y)  # warm-up: the first call picks kernels
    f32 = min(timed(x, y) for _ in range(3))
    x, y = a.bfloat16(), b.bfloat16()
    if timed(x, y) > 20 * f32:  # the warm-up already shows an emulated bf16: no need to time it further
        return False
    return min(timed(x, y) for _ in range(3)) * 1.5 < f32


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

        from ..formats.awq_gemm import pack_gemm

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


def float_output(layer, x, kwargs: dict, chunk: int):
    """The float output of `layer` for x [n, T, H], `chunk` samples per forward (a layer kept float:
    the next layer's input)."""
    import torch

    kw = _call_kwargs(layer, kwargs)
    out = torch.empty_like(x)
    for lo in range(0, x.shape[0], chunk):
        hi = min(x.shape[0], lo + chunk)
        out[lo:hi] = _first(layer(x[lo:hi], **_rows(kw, lo, hi)))
    return out


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
