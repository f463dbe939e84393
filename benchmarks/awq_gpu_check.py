"""AWQ on the GPU, on a real model: the W4A16 kernel path against the same AWQ weights dequantized to
fp16 (cuBLAS), for SmolLM2-135M-Instruct quantized by `vlmctl quantize` (group 64).

- kernel error: every linear of the model at M = 1, 8 and 512 against x @ dequantize(W)^T in float32
  (relative Frobenius error; fp16 accumulation-order tolerance is ~1e-3);
- greedy tokens: the dequantized path generates 1,000 tokens (2 prompts alone, then 8 as one
  batch: the GEMV and the tensor-core kernels); the kernel path, fed the same tokens through the
  paged KV cache and captured decode graphs, must pick the same token at >= 95% of the positions;
- perplexity on WikiText-2 test windows, both paths (within 0.5 %).

    python benchmarks/awq_gpu_check.py AWQ_DIR --data test.txt [--windows 40] [--out result.json]
"""

from __future__ import annotations

import argparse
import json
import math
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))


def load_pair(awq_dir: Path, device: str):
    from vlmctl.runtime.decoder import Linear, TorchDecoder, W4A16Linear
    from vlmctl.runtime.kernels.w4a16 import dequantize

    dtype = "float16" if device == "cuda" else "float32"
    kern = TorchDecoder.from_hf_dir(awq_dir, dtype=dtype, device=device, max_seq=2048)
    ref = TorchDecoder.from_hf_dir(awq_dir, dtype=dtype, device=device, max_seq=2048)
    for layer in ref.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            if isinstance(lin, W4A16Linear):
                setattr(layer, name, Linear(dequantize(lin.packed, lin.group_size, ref.dtype).contiguous(), lin.bias))
    return kern, ref


def kernel_errors(kern) -> dict:
    from vlmctl.runtime.decoder import W4A16Linear
    from vlmctl.runtime.kernels.w4a16 import dequantize

    errs = {1: [], 8: [], 512: []}
    g = torch.Generator(device=kern.device).manual_seed(0)
    for layer in kern.layers:
        for name in ("qkv", "o", "gate_up", "down"):
            lin = getattr(layer, name)
            if not isinstance(lin, W4A16Linear):
                continue
            w = dequantize(lin.packed, lin.group_size)  # float32 reference weight
            for m in errs:
                x = torch.randn(m, w.shape[1], generator=g, device=kern.device).to(kern.dtype)
                y = lin(x).double()
                ref = (x.double() @ w.double().t()) + (lin.bias.double() if lin.bias is not None else 0)
                errs[m].append(float((y - ref).norm() / ref.norm()))
    return {f"M={m}": {"max": max(v), "mean": sum(v) / len(v)} for m, v in errs.items() if v}


def generate(dec, prompts: list[list[int]], steps: int) -> list[list[int]]:
    """Greedy tokens of a batch through the engine's path: chunked forward for the prompts, then
    decode steps (captured graphs on CUDA)."""
    from vlmctl.runtime.decoder import Chunk

    bs = dec.block_size
    per = -(-(max(map(len, prompts)) + steps + 2) // bs)
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(prompts))]
    first = dec.forward([Chunk(np.asarray(p), np.arange(len(p)), 0, t) for p, t in zip(prompts, tables)])
    toks = first.argmax(-1).cpu().numpy()
    out = [[int(t)] for t in toks]
    lens = np.array([len(p) for p in prompts], dtype=np.int64)
    for _ in range(steps - 1):
        slots = np.array([tables[i][lens[i] // bs] * bs + lens[i] % bs for i in range(len(prompts))], np.int64)
        logits = dec.decode(toks.astype(np.int64), lens.copy(), slots, tables, lens + 1)
        toks = logits.argmax(-1).cpu().numpy()
        for i, t in enumerate(toks):
            out[i].append(int(t))
        lens += 1
    return out


def forced_agreement(dec, prompts, ref_out) -> tuple[int, int]:
    """Feed the reference's tokens; count positions where this decoder's argmax equals the reference's."""
    from vlmctl.runtime.decoder import Chunk

    bs = dec.block_size
    steps = len(ref_out[0])
    per = -(-(max(map(len, prompts)) + steps + 2) // bs)
    tables = [list(range(1 + i * per, 1 + (i + 1) * per)) for i in range(len(prompts))]
    first = dec.forward([Chunk(np.asarray(p), np.arange(len(p)), 0, t) for p, t in zip(prompts, tables)])
    pred = [[int(t)] for t in first.argmax(-1).cpu().numpy()]
    lens = np.array([len(p) for p in prompts], dtype=np.int64)
    for s in range(steps - 1):
        toks = np.array([r[s] for r in ref_out], dtype=np.int64)
        slots = np.array([tables[i][lens[i] // bs] * bs + lens[i] % bs for i in range(len(prompts))], np.int64)
        got = dec.decode(toks, lens.copy(), slots, tables, lens + 1).argmax(-1).cpu().numpy()
        for i, t in enumerate(got):
            pred[i].append(int(t))
        lens += 1
    same = sum(a == b for p, r in zip(pred, ref_out) for a, b in zip(p, r))
    return same, sum(len(r) for r in ref_out)


def perplexity(dec, ids: torch.Tensor, seq_len: int, windows: int) -> float:
    nll, n = 0.0, 0
    for w in range(windows):
        x = ids[w * seq_len:(w + 1) * seq_len][None]
        logits = dec.logits(x).float()
        lp = torch.log_softmax(logits[0, :-1], -1)
        tgt = x[0, 1:].to(lp.device)
        nll -= float(lp.gather(1, tgt[:, None]).sum())
        n += seq_len - 1
    return math.exp(nll / n)


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("awq_dir", type=Path)
    ap.add_argument("--data", type=Path, required=True)
    ap.add_argument("--windows", type=int, default=40)
    ap.add_argument("--seq-len", type=int, default=512)
    ap.add_argument("--tokens", type=int, default=100, help="generated tokens per prompt (10 prompts)")
    ap.add_argument("--out")
    args = ap.parse_args()
    from transformers import AutoTokenizer

    dev = "cuda" if torch.cuda.is_available() else "cpu"
    tok = AutoTokenizer.from_pretrained(args.awq_dir)
    kern, ref = load_pair(args.awq_dir, dev)
    for d in (kern, ref):
        d.allocate_cache(2048, 16)
        d.capture_graphs(8)
    res = {"device": torch.cuda.get_device_name() if dev == "cuda" else "cpu", "model": str(args.awq_dir)}
    res["kernel_rel_error"] = kernel_errors(kern)
    print("kernel vs float32 reference:", json.dumps(res["kernel_rel_error"]), flush=True)
    lines = [ln.strip() for ln in args.data.read_text().splitlines() if len(ln.strip()) > 200][:10]
    prompts = [tok(ln)["input_ids"][:64] for ln in lines]
    t0 = time.perf_counter()
    ref_out = generate(ref, prompts[:1], args.tokens) + generate(ref, prompts[1:2], args.tokens) + \
        generate(ref, prompts[2:10], args.tokens)
    same = total = 0
    for sl in (slice(0, 1), slice(1, 2), slice(2, 10)):
        s, t = forced_agreement(kern, prompts[sl], ref_out[sl])
        same += s
        total += t
    free = generate(kern, prompts[2:10], args.tokens)
    free_same = sum(a == b for p, r in zip(free, ref_out[2:10]) for a, b in zip(p, r))
    res["greedy"] = {"tokens": total, "same_argmax_teacher_forced": same, "fraction": same / total,
                     "free_running_same_of_800": free_same, "seconds": time.perf_counter() - t0}
    print("greedy:", json.dumps(res["greedy"]), flush=True)
    ids = torch.tensor(tok(args.data.read_text())["input_ids"])
    p_kern = perplexity(kern, ids, args.seq_len, args.windows)
    p_ref = perplexity(ref, ids, args.seq_len, args.windows)
    res["perplexity"] = {"kernel": p_kern, "dequantized_fp16": p_ref, "rel_diff": abs(p_kern - p_ref) / p_ref,
                         "windows": args.windows, "seq_len": args.seq_len}
    print("perplexity:", json.dumps(res["perplexity"]), flush=True)
    if args.out:
        Path(args.out).write_text(json.dumps(res, indent=2))


if __name__ == "__main__":
    main()
