"""AWQ's arithmetic and searches: group-wise asymmetric 4-bit quantization, the candidate scales and
their output-error losses, and the clipping search. Pure tensor functions (float32), no model and no
files; the layer quantizer (awq_layer.py) and tests call them.
"""

from __future__ import annotations

import math

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


def valid_group_sizes(in_features: list[int]) -> list[int]:
    g = 0
    for n in in_features:
        g = math.gcd(g, n)
    return [d for d in range(8, g + 1, 8) if g % d == 0]
