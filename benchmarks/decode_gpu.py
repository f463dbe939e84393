"""Decode-step time of vlmctl's embedded decoder vs transformers, against the bandwidth bound (GPU).

Random weights with the LLaVA-1.5-7B language model's shape (Llama-2-7B: 32 layers, hidden 4096,
vocab 32064), made on the device, so no checkpoint is needed. The decoder runs as the engine runs
it by default: KV pool sized by `--gpu-memory-utilization` 0.9 in 16-token blocks, per-sequence
limit 2048 + 512 tokens, CUDA graphs captured per batch bucket up to 64, Triton kernels. Each
sequence first prefills a `--prompt-len` prompt (576 rows from a prompt-embedding table), then the
timed decode steps run at a growing context. The bound: weight bytes + the KV bytes the batch
attends, over the copy bandwidth measured in the same run.

    python benchmarks/decode_gpu.py --batches 1 8 64 --steps 64
    python benchmarks/decode_gpu.py --awq          # also the 4-bit AWQ decoder (W4A16 kernels)
    python benchmarks/decode_gpu.py --awq --batches 1 --without norms attention   # what those parts cost
"""

from __future__ import annotations

import argparse
import contextlib
import json
import os
import time

import numpy as np
import torch
from gpu_timing import copy_bandwidth  # also read as decode_gpu.copy_bandwidth (fused_step_gpu.py)

MAX_SEQ = 2048 + 512  # recipe defaults: max_input_len + max_output_len
DEV = "cuda"
ACT = torch.float16  # the decoders' activation dtype on the GPU (--dtype)
SHAPE = {"hidden_size": 4096, "intermediate_size": 11008, "num_attention_heads": 32, "vocab_size": 32064}
# --model: other decoders' shapes, as Llama decoders (what kernel choice and bandwidth depend on).
# Qwen2-VL-7B's language model: GQA with 4 KV heads, 28 layers (its qkv bias and M-RoPE left out).
SHAPES = {"llava-1.5-7b": (SHAPE, 32),
          "qwen2-vl-7b": ({"hidden_size": 3584, "intermediate_size": 18944, "num_attention_heads": 28,
                           "num_key_value_heads": 4, "vocab_size": 152064}, 28),
          "mistral-7b": ({"hidden_size": 4096, "intermediate_size": 14336, "num_attention_heads": 32,
                          "num_key_value_heads": 8, "vocab_size": 32064}, 32),
          "llava-1.5-13b": ({"hidden_size": 5120, "intermediate_size": 13824, "num_attention_heads": 40,
                             "vocab_size": 32064}, 40)}
SMOKE = {"hidden_size": 256, "intermediate_size": 512, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 1000}


def llama7b_config(layers: int, shape: dict = SHAPE) -> dict:
    return {"model_type": "llama", "num_key_value_heads": shape["num_attention_heads"], **shape,
            "num_hidden_layers": layers, "rms_norm_eps": 1e-5,
            "max_position_embeddings": 4096, "rope_theta": 10000.0, "tie_word_embeddings": False,
            "hidden_act": "silu"}


def random_hf_state(cfg: dict, device, seed: int = 0) -> dict:
    g = torch.Generator(device=device).manual_seed(seed)
    dt = ACT if device == "cuda" else torch.float32
    h, i, v = cfg["hidden_size"], cfg["intermediate_size"], cfg["vocab_size"]
    kv = h // cfg["num_attention_heads"] * cfg["num_key_value_heads"]

    def w(*shape, std=0.02):
        return torch.randn(*shape, generator=g, device=device, dtype=dt) * std

    def ones():
        return torch.ones(h, device=device, dtype=dt)

    sd = {"model.embed_tokens.weight": w(v, h), "model.norm.weight": ones(), "lm_head.weight": w(v, h)}
    for layer in range(cfg["num_hidden_layers"]):
        p = f"model.layers.{layer}"
        for n, rows in (("q_proj", h), ("k_proj", kv), ("v_proj", kv), ("o_proj", h)):
            sd[f"{p}.self_attn.{n}.weight"] = w(rows, h)
        sd[f"{p}.mlp.gate_proj.weight"] = w(i, h)
        sd[f"{p}.mlp.up_proj.weight"] = w(i, h)
        sd[f"{p}.mlp.down_proj.weight"] = w(h, i)
        sd[f"{p}.input_layernorm.weight"] = ones()
        sd[f"{p}.post_attention_layernorm.weight"] = ones()
    return sd


def runtime_tensors(spec, sd: dict, dtype) -> dict:
    """The runtime's fused tensors from HF-named ones (what the loader does from a checkpoint)."""
    out = {}
    for template, sources in spec.tensor_sources.items():
        layers = range(spec.num_layers) if "{i}" in template else [None]
        for i in layers:
            parts = [s.format(i=i) if i is not None else s for s in sources]
            out[template.format(i=i) if i is not None else template] = torch.cat([sd[p] for p in parts]).to(dtype)
    return out



def make_decoder(cfg, sd, awq_group: int | None):
    from vlmctl.models.decoders import decoder_spec
    from vlmctl.runtime.decoder import TorchDecoder

    spec = decoder_spec(cfg)
    tensors = runtime_tensors(spec, sd, ACT if DEV == "cuda" else torch.float32)
    if awq_group:
        from dataclasses import replace

        from vlmctl.runtime.kernels.w4a16 import FORMAT

        spec = replace(spec, quantization={"method": "awq", "bits": 4, "group_size": awq_group, "layout": FORMAT})
        tensors = rtn_w4a16(tensors, awq_group)
    return TorchDecoder(spec, tensors, dtype=ACT if DEV == "cuda" else torch.float32, device=DEV,
                        max_seq=MAX_SEQ)


def rtn_w4a16(tensors: dict, group: int) -> dict:
    """Round-to-nearest asymmetric int4 of every layer linear, in the W4A16 kernel's layout (the
    arithmetic of a real AWQ engine; calibration would only change which codes are stored)."""
    from vlmctl.runtime.kernels.w4a16 import pack

    out = {}
    for name, w in tensors.items():
        if not (name.startswith("layers.") and name.endswith(".weight")):
            out[name] = w
            continue
        n, k = w.shape
        g = w.float().view(n, k // group, group)
        lo, hi = g.amin(-1), g.amax(-1)
        scale = (hi - lo).clamp_min(1e-6) / 15
        zero = (-lo / scale).round().clamp(0, 15)
        codes = ((g / scale[..., None]).round() + zero[..., None]).clamp(0, 15).view(n, k)
        base = name[:-len(".weight")]
        out.update({f"{base}.{key}": v for key, v in pack(codes.to(torch.int32), zero.to(torch.int32), scale,
                                                          group).items()})
    return out


def size_cache(dec, max_batch: int, budget: int = 2048, util: float = 0.9, block: int = 16) -> int:
    """The engine's default KV sizing (Engine._kv_blocks)."""
    if DEV != "cuda":
        dec.allocate_cache(max_batch * MAX_SEQ // block + 1, block)
        return dec.num_blocks
    free, total = torch.cuda.mem_get_info()
    spec = dec.spec
    act = budget * (4 * spec.hidden_size + 2 * spec.intermediate_size + spec.q_size + 2 * spec.kv_size) * 4
    reserve = act + max(max_batch, 64) * spec.vocab_size * 8 + (2 << 30)
    blocks = (int(total * util) - (total - free) - reserve) // (block * dec.kv_bytes_per_token()) + 1
    dec.allocate_cache(int(blocks), block)
    return int(blocks)


def bench_vlmctl(dec, batch: int, prompt_len: int, steps: int, graphs: bool) -> dict:
    from vlmctl.runtime.decoder import Chunk

    dec.use_graphs = graphs and DEV == "cuda"
    bs = dec.block_size
    V = dec.vocab_size
    per_seq = -(-(prompt_len + steps + 8) // bs)
    tables = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(batch)]
    assert tables[-1][-1] < dec.num_blocks
    rows = max(0, min(576, prompt_len - 16))  # LLaVA-1.5's 576 image rows, fewer in a shorter prompt
    table = torch.randn(rows, dec.spec.hidden_size, device=DEV, dtype=dec.dtype) * 0.02
    ids = np.random.default_rng(0).integers(0, V, prompt_len)
    ids[1:1 + rows] = V + np.arange(rows)
    sync()
    t0 = time.perf_counter()
    first = []
    for s in range(0, batch, 4):  # prefill 4 sequences per forward, as the scheduler batches them
        chunks = [Chunk(ids, np.arange(prompt_len), 0, tables[q], table) for q in range(s, min(batch, s + 4))]
        first.extend(dec.forward(chunks).argmax(-1).tolist())
    sync()
    t_prefill = time.perf_counter() - t0
    toks = np.array(first, dtype=np.int64)
    lens = np.full(batch, prompt_len, dtype=np.int64)
    times, gpu = [], []
    for step in range(steps + 3):
        slots = np.array([tables[q][lens[q] // bs] * bs + lens[q] % bs for q in range(batch)], dtype=np.int64)
        t = time.perf_counter()
        ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)] if DEV == "cuda" else None
        if ev:
            ev[0].record()
        logits = dec.decode(toks, lens.copy(), slots, tables, lens + 1)
        if ev:
            ev[1].record()
        toks = logits.argmax(-1).cpu().numpy()  # one device->host copy per step, as the engine does
        times.append(time.perf_counter() - t)
        if ev:
            gpu.append(ev[0].elapsed_time(ev[1]))
        lens += 1
    ms = 1000 * float(np.median(times[3:]))
    return {"impl": "vlmctl" if graphs else "vlmctl-eager", "batch": batch, "prefill_s": t_prefill,
            "ms_per_step": ms, "tok_s": batch * 1000 / ms, "context": int(prompt_len + steps / 2),
            "gpu_ms_per_step": float(np.median(gpu[3:])) if gpu else None,
            "prefill_tok_s": batch * prompt_len / t_prefill}


def _attention_inputs(b: int, ctx: int, heads: int, d: int) -> tuple:
    """One decode step's attention inputs for `b` sequences of `ctx` tokens in 16-token blocks (a cache of
    `blocks` blocks holds them, block 0 unused): (blocks, block tables, lengths, qkv rows, rotary table,
    positions, slots of the new tokens)."""
    bs, nb = 16, -(-ctx // 16)
    blocks = 1 + b * nb
    bt = (1 + torch.randperm(blocks - 1, device="cuda")[:b * nb]).view(b, nb).to(torch.int32)
    lens = torch.full((b,), ctx, dtype=torch.int32, device="cuda")
    qkv = torch.randn(b, 3 * heads * d, device="cuda", dtype=torch.float16)
    f = torch.arange(4096, device="cuda").float()[:, None] / (10000 ** (torch.arange(0, d, 2, device="cuda") / d))
    cs = torch.cat((f.cos(), f.sin()), -1)
    pos = lens.long() - 1
    slots = (bt[:, -1].long() * bs + (ctx - 1) % bs)
    return blocks, bt, lens, qkv, cs, pos, slots


def bench_attention(bw: float, batches=(1, 8, 64), contexts=(640, 2048), heads: int = 32, d: int = 128) -> list:
    """Decode attention alone (one layer, fp16): the Triton paged kernel (with and without the fused
    rotary + append) vs torch (gather the blocks, then SDPA), against reading the KV once."""
    import triton.testing

    from vlmctl.runtime import ops
    from vlmctl.runtime.kernels.paged_attention import choose_splits, paged_decode, paged_decode_rope

    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for ctx in contexts:
        for b in batches:
            blocks, bt, lens, qkv, cs, pos, slots = _attention_inputs(b, ctx, heads, d)
            kc = torch.randn(blocks, 16, heads, d, device="cuda", dtype=torch.float16)
            vc = torch.randn_like(kc)
            q = qkv[:, :heads * d].view(b, heads, d)
            s = choose_splits(b, heads, MAX_SEQ, sms)
            bound = 2 * b * ctx * heads * d * 2 / bw * 1e3
            t_tri = triton.testing.do_bench(lambda: paged_decode(q, kc, vc, bt, lens, d ** -0.5, s), return_mode="median")
            t_fused = triton.testing.do_bench(lambda: paged_decode_rope(qkv, cs, pos, slots, kc, vc, bt, lens, d ** -0.5,
                                                                        heads, heads, s), return_mode="median")
            t_ref = triton.testing.do_bench(lambda: ops.paged_decode_reference(q, kc, vc, bt, lens, d ** -0.5),
                                            return_mode="median")
            rows.append({"batch": b, "context": ctx, "splits": s, "bound_us": bound * 1e3, "triton_us": t_tri * 1e3,
                         "triton_fused_us": t_fused * 1e3, "torch_gather_sdpa_us": t_ref * 1e3})
            print(f"attention b={b:<3} ctx={ctx:<5} splits={s:<3} bound {bound * 1e3:7.1f} us  triton {t_tri * 1e3:7.1f}"
                  f"  triton+rope+append {t_fused * 1e3:7.1f}  torch gather+sdpa {t_ref * 1e3:8.1f}", flush=True)
    return rows


def bench_attention_graph(bw: float, batches=(1, 8), contexts=(656, 2048), splits_list=(1, 2, 4, 8, 17, 32),
                          env_cases=("",), layers: int = 32, heads: int = 32, d: int = 128) -> list:
    """The decode attention as a step runs it: `layers` calls of the fused kernel (rotary, KV append,
    attention, the splits' combine), each on its own layer's cache, captured in one CUDA graph (no Python
    launch cost, each call after the one before), per split count and environment case (e.g.
    'VLMCTL_ATTN_COMBINE=0'). µs per call, against reading the KV once."""
    from vlmctl.runtime.kernels.paged_attention import choose_splits, paged_decode_rope, split_workspace

    rows = []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for ctx in contexts:
        for b in batches:
            blocks, bt, lens, qkv, cs, pos, slots = _attention_inputs(b, ctx, heads, d)
            caches = [(torch.randn(blocks, 16, heads, d, device="cuda", dtype=torch.float16),
                       torch.randn(blocks, 16, heads, d, device="cuda", dtype=torch.float16)) for _ in range(layers)]
            bound = 2 * b * ctx * heads * d * 2 / bw * 1e6
            shipped = choose_splits(b, heads, MAX_SEQ, sms)
            for s, case in [(s, c) for s in sorted(set(splits_list) | {shipped}) for c in env_cases]:
                saved = dict(os.environ)
                os.environ.update(dict(kv.split("=", 1) for kv in case.split()))
                ws = split_workspace(b, heads, d, s, "cuda") if s > 1 else None

                def chain():
                    for kc, vc in caches:
                        paged_decode_rope(qkv, cs, pos, slots, kc, vc, bt, lens, d ** -0.5, heads, heads, s, workspace=ws)

                chain()
                torch.cuda.synchronize()
                g = torch.cuda.CUDAGraph()
                with torch.cuda.graph(g):
                    chain()
                for _ in range(3):
                    g.replay()
                ev = [torch.cuda.Event(enable_timing=True) for _ in range(2)]
                ev[0].record()
                for _ in range(20):
                    g.replay()
                ev[1].record()
                torch.cuda.synchronize()
                us = ev[0].elapsed_time(ev[1]) * 1e3 / 20 / layers
                os.environ.clear()
                os.environ.update(saved)
                rows.append({"batch": b, "context": ctx, "splits": s, "shipped": s == shipped, "bound_us": bound,
                             "env": case, "graph_us_per_call": us})
                print(f"attention in a graph b={b:<3} ctx={ctx:<5} splits={s:<3}{' (shipped)' if s == shipped else '':11}"
                      f" bound {bound:6.1f} us  {us:6.1f} us a call  [{case or 'defaults'}]", flush=True)
                g = ws = None  # the graph's memory goes before the next count's
            caches = None
            torch.cuda.empty_cache()
    return rows


@contextlib.contextmanager
def splits_rounded_up():
    """Measurement only: the split rule before session 21 (enough splits for 4 programs per SM, rounded up)."""
    import triton

    from vlmctl.runtime.kernels import paged_attention

    real = paged_attention.choose_splits

    def before(batch, n_kv_heads, max_context, num_sms, block_n=64):
        programs = batch * n_kv_heads
        if programs >= 2 * num_sms:
            return 1
        return max(1, min(triton.cdiv(4 * num_sms, programs), triton.cdiv(max_context, block_n), 32))

    paged_attention.choose_splits = before
    try:
        yield
    finally:
        paged_attention.choose_splits = real


@contextlib.contextmanager
def splits_at_most(n: int):
    """Measurement only: the decoders' decode attention split at most `n` ways (the shipped rule otherwise)."""
    from vlmctl.runtime.kernels import paged_attention

    real = paged_attention.choose_splits
    paged_attention.choose_splits = lambda *a, **k: min(real(*a, **k), n)
    try:
        yield
    finally:
        paged_attention.choose_splits = real


def profile_step(dec, batch: int, prompt_len: int, top: int = 25) -> None:
    """Kernel times of eager decode steps (the graph replays the same kernels): where a step goes."""
    from torch.profiler import ProfilerActivity, profile

    bench_vlmctl(dec, batch, prompt_len, 4, graphs=False)  # warm
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        bench_vlmctl(dec, batch, prompt_len, 8, graphs=False)
    print(f"--- kernels of eager steps at batch {batch} (8 decode steps + prefill; CUDA time) ---")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))


def profile_graph_steps(dec, batch: int, prompt_len: int, top: int = 30) -> None:
    """Kernel times inside replayed decode-step graphs (what a served step runs). With PDL a kernel's
    time includes its wait for the one before, so the kernel times then overlap."""
    from torch.profiler import ProfilerActivity, profile

    bench_vlmctl(dec, batch, prompt_len, 4, graphs=True)  # warm (and captured)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        bench_vlmctl(dec, batch, prompt_len, 8, graphs=True)
    print(f"--- kernels of graphed steps at batch {batch} (11 decode steps + prefill; CUDA time) ---")
    print(prof.key_averages().table(sort_by="cuda_time_total", row_limit=top, max_name_column_width=60))


def chain_contributions(kernels: list[tuple[str, float, float]]) -> list[float]:
    """What each kernel of one step adds to the step's span, for kernels (name, start, end) in launch order:
    the first its duration, each later one how far its end passes the latest end before it (0 when it ends
    inside another's time). With programmatic dependent launch a kernel starts before the one it waits for
    ends, so its own duration overstates what it costs the step; these sum to the step's span."""
    out, frontier = [], None
    for _, start, end in kernels:
        out.append(end - start if frontier is None else max(0.0, end - frontier))
        frontier = end if frontier is None else max(frontier, end)
    return out


def split_steps(kernels: list[tuple[str, float, float]], gap: float) -> list[list[tuple[str, float, float]]]:
    """Kernels sorted by start, cut into steps wherever nothing runs for more than `gap` (the caller
    synchronizes and idles between steps)."""
    steps, frontier = [], None
    for k in sorted(kernels, key=lambda k: k[1]):
        if frontier is None or k[1] - frontier > gap:
            steps.append([])
        steps[-1].append(k)
        frontier = k[2] if frontier is None else max(frontier, k[2])
    return steps


def timeline(dec, batch: int, prompt_len: int, steps: int = 12) -> dict:
    """Kernel start/end times of replayed decode-step graphs (torch.profiler's trace) and what each kernel adds
    to the step's span (`chain_contributions`), by kernel name and for one layer in the middle. The profiler may
    slow the step a little; the figures are shares, read beside the step's timed figure."""
    import tempfile

    from torch.profiler import ProfilerActivity, profile

    bench_vlmctl(dec, batch, prompt_len, 4, graphs=True)  # captured and warm
    bs = dec.block_size
    per_seq = -(-(prompt_len + 8) // bs)
    tables = [list(range(1 + s * per_seq, 1 + (s + 1) * per_seq)) for s in range(batch)]
    toks = np.zeros(batch, dtype=np.int64)
    lens = np.full(batch, prompt_len, dtype=np.int64)
    slots = np.array([tables[q][prompt_len // bs] * bs + prompt_len % bs for q in range(batch)], dtype=np.int64)
    with profile(activities=[ProfilerActivity.CUDA]) as prof:
        for _ in range(steps):
            dec.decode(toks, lens.copy(), slots, tables, lens + 1)
            sync()
            time.sleep(0.002)  # a gap that cuts the trace into steps
    with tempfile.TemporaryDirectory() as tmp:
        prof.export_chrome_trace(f"{tmp}/trace.json")
        with open(f"{tmp}/trace.json") as f:
            events = json.load(f)["traceEvents"]
    kernels = [(e["name"], float(e["ts"]), float(e["ts"]) + float(e["dur"])) for e in events
               if e.get("cat") == "kernel"]
    runs = [r for r in split_steps(kernels, gap=500.0) if len(r) > 8][1:]  # the first replay may be cold
    if not runs:
        raise SystemExit(f"--timeline: the profiler's trace held {len(kernels)} kernel events, not {steps} steps' "
                         "worth; nothing to attribute")
    n = min(len(r) for r in runs)
    runs = [r[:n] for r in runs if len(r) == n]
    contrib = [chain_contributions(r) for r in runs]
    span = float(np.median([r[-1][2] - r[0][1] for r in runs]))
    by_name: dict = {}
    for r, c in zip(runs, contrib):
        for (name, start, end), ci in zip(r, c):
            row = by_name.setdefault(name, [0, 0.0, 0.0])
            row[0] += 1
            row[1] += end - start
            row[2] += ci
    k = len(runs)
    names = sorted(by_name, key=lambda nm: -by_name[nm][2])
    print(f"--- timeline of graphed steps at batch {batch}: {k} steps of {n} kernels, span {span:.1f} us ---")
    print(f"{'kernel':<60}{'calls':>7}{'own us':>10}{'adds us':>10}  (per step)")
    for nm in names:
        calls, own, add = by_name[nm]
        print(f"{nm[:59]:<60}{calls / k:>7.0f}{own / k:>10.1f}{add / k:>10.1f}")
    norms = [i for i, kk in enumerate(runs[0]) if "rms_norm" in kk[0]]
    layer = []
    if len(norms) >= 4:
        mid = (len(norms) // 4) * 2  # an input norm in the middle layer: its layer runs to the norm two after
        lo, hi = norms[mid], norms[mid + 2]
        for i in range(lo, hi):
            own = float(np.median([r[i][2] - r[i][1] for r in runs]))
            add = float(np.median([c[i] for c in contrib]))
            layer.append({"kernel": runs[0][i][0], "own_us": own, "adds_us": add})
        print("--- one layer in the middle, median over steps ---")
        for row in layer:
            print(f"{row['kernel'][:59]:<60}{row['own_us']:>10.1f}{row['adds_us']:>10.1f}")
    return {"batch": batch, "steps": k, "kernels_per_step": n, "span_us": span, "layer": layer,
            "by_name": {nm: {"calls": by_name[nm][0] / k, "own_us": by_name[nm][1] / k, "adds_us": by_name[nm][2] / k}
                        for nm in names}}


WITHOUT = {
    # every RMSNorm (the 2 per layer and the final one): the norm's input passes through, nothing launched
    "norms": "the RMSNorms",
    # each layer's decode attention (rotary, KV append, attention): o reads q as it came out of qkv
    "attention": "the decode attention",
    # the attention's work but not its place in the chain: a PDL kernel between qkv and o that copies q to o's
    # input, so that "without attention-work" less "without attention" is what the boundary alone costs
    "attention-work": "the decode attention's work",
}


try:  # the kernel of `--without attention-work` (GPU only)
    import triton
    import triton.language as tl

    from vlmctl.runtime.kernels import pdl as _pdl

    @triton.jit
    def _pass_q_kernel(src, dst, stride, D: tl.constexpr, PDL: tl.constexpr = False):
        _pdl.release(PDL)
        _pdl.wait(PDL)
        b, h = tl.program_id(0), tl.program_id(1)
        offs = tl.arange(0, D)
        tl.store(dst + (b * tl.num_programs(1) + h) * D + offs, tl.load(src + b * stride + h * D + offs))
except ImportError:
    _pass_q_kernel = None


def _pass_q(qkv, n_q: int, d: int):
    """Measurement only: q of qkv [B, (n_q + 2 n_kv) * d] copied to a new [B, n_q, d] by a kernel launched as the
    decode attention is (programmatic dependent launch where the attention uses it), one program per q head."""
    from vlmctl.runtime.kernels import paged_attention

    if qkv.device.type != "cuda":
        return qkv[:, :n_q * d].reshape(qkv.shape[0], n_q, d).clone()
    out = torch.empty((qkv.shape[0], n_q, d), dtype=qkv.dtype, device=qkv.device)
    _pass_q_kernel[(qkv.shape[0], n_q)](qkv, out, qkv.stride(0), D=d, **paged_attention._decode_launch_kwargs(qkv.device))
    return out


@contextlib.contextmanager
def left_out(dec, part: str):
    """Measurement only: the decoder with one part of its step left out (see WITHOUT)."""
    from vlmctl.runtime import ops

    if part == "norms":
        dec._norm = lambda x, weight, residual=None: x  # an instance attribute over the method
        try:
            yield
        finally:
            del dec._norm
    elif part == "attention":
        real = ops.paged_decode_rope
        nq, d = dec.n_heads, dec.head_dim
        ops.paged_decode_rope = lambda qkv, *a, **k: qkv[:, :nq * d].view(qkv.shape[0], nq, d)
        try:
            yield
        finally:
            ops.paged_decode_rope = real
    elif part == "attention-work":
        real = ops.paged_decode_rope
        ops.paged_decode_rope = lambda qkv, *a, **k: _pass_q(qkv, dec.n_heads, dec.head_dim)
        try:
            yield
        finally:
            ops.paged_decode_rope = real
    else:
        raise ValueError(part)


def sync():
    if DEV == "cuda":
        torch.cuda.synchronize()


def bench_hf(cfg, sd, batch: int, prompt_len: int, steps: int) -> dict:
    from transformers import LlamaConfig, LlamaForCausalLM

    torch.set_default_dtype(ACT)
    with torch.device("cuda"):
        model = LlamaForCausalLM(LlamaConfig(**{k: v for k, v in cfg.items() if k != "model_type"}))
    torch.set_default_dtype(torch.float32)
    model.load_state_dict(sd, strict=False)
    model = model.eval()
    ids = torch.randint(0, cfg["vocab_size"], (batch, prompt_len), device="cuda")
    with torch.inference_mode():
        model.generate(ids[:, :16], max_new_tokens=4, do_sample=False, min_new_tokens=4)
        torch.cuda.synchronize()
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=1, do_sample=False, min_new_tokens=1)
        torch.cuda.synchronize()
        t_prefill = time.perf_counter() - t0
        t0 = time.perf_counter()
        model.generate(ids, max_new_tokens=steps + 1, do_sample=False, min_new_tokens=steps + 1)
        torch.cuda.synchronize()
        t_all = time.perf_counter() - t0
    del model
    torch.cuda.empty_cache()
    ms = 1000 * max(t_all - t_prefill, 1e-9) / steps
    return {"impl": "transformers", "batch": batch, "prefill_s": t_prefill, "ms_per_step": ms,
            "tok_s": batch * 1000 / ms, "context": int(prompt_len + steps / 2)}


def time_measurement_variants(dec, name: str, args, rows: list) -> None:
    """The measurement-only variants of the step (--attn-splits, --attn-splits-rounded-up, --without), each
    captured and timed in its own graphs. A function of its own, so that nothing it builds outlives it: in
    session 33 a `--without` lambda left in main() kept the fp16 decoder and its KV pool alive, and on an H200 the
    AWQ decoder's build then ran out of memory."""
    measured = [(f"decode attention split at most {n} ways", lambda n=n: splits_at_most(n),
                 {"attn_splits_at_most": n}) for n in args.attn_splits]
    if args.attn_splits_rounded_up:
        measured.append(("decode attention split by the rule before session 21", splits_rounded_up,
                         {"attn_splits_at_most": "rounded up"}))
    measured += [(f"without {part} (measurement only: the step's output is wrong)",
                  lambda part=part: left_out(dec, part), {"without": part}) for part in args.without]
    for label, make, tag in measured:
        with make():
            dec._graphs.clear()
            dec._graph_pool = None
            sync()
            dec.capture_graphs(max(args.batches))
            print(f"-- {label}", flush=True)
            for b in args.batches:
                r = bench_vlmctl(dec, b, args.prompt_len, args.steps, True)
                r.update(variant=name, splits=dec._splits(b), **tag)
                rows.append(r)
                print(f"{r['impl'] + '-' + name:<14}{b:>6}{r['ms_per_step']:>9.2f}{r['gpu_ms_per_step'] or 0:>8.2f}"
                      f"{r['tok_s']:>9.0f}  splits {r['splits']}", flush=True)
        dec._graphs.clear()
        dec._graph_pool = None


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--model", choices=list(SHAPES), default="llava-1.5-7b", help="decoder shape")
    ap.add_argument("--layers", type=int, help="default: the model's")
    ap.add_argument("--batches", type=int, nargs="+", default=[1, 8, 64])
    ap.add_argument("--prompt-len", type=int, default=640)
    ap.add_argument("--steps", type=int, default=64)
    ap.add_argument("--hf-batches", type=int, nargs="*", default=[1, 64])
    ap.add_argument("--eager", action="store_true", help="also time the eager (uncaptured) step")
    ap.add_argument("--awq", type=int, nargs="?", const=128, default=None, help="also the AWQ decoder (group size)")
    ap.add_argument("--attention", action="store_true", help="also time decode attention alone")
    ap.add_argument("--profile", type=int, nargs="*", default=[], help="batch sizes to profile (kernel table)")
    ap.add_argument("--timeline", type=int, nargs="*", default=[],
                    help="batch sizes whose graphed steps to trace: what each kernel adds to the step's span "
                    "(with PDL a kernel's own time overlaps the one before it); after the timings, as the profiles")
    ap.add_argument("--graph-profile", type=int, nargs="*", default=[],
                    help="batch sizes whose graphed steps to profile (kernel table), after every timing of a "
                    "decoder and under its last --env-cases case")
    ab = ap.add_mutually_exclusive_group()
    ab.add_argument("--env-ab", metavar="VAR=V1,V2", help="time each decoder once per value of an environment "
                    "switch (e.g. VLMCTL_PDL=0,auto), recapturing the graphs for each")
    ab.add_argument("--env-cases", nargs="+", metavar="'VAR=V [VAR2=V2]'",
                    help="like --env-ab, one run per case, a case setting one or more variables "
                    "(e.g. 'VLMCTL_W4A16_WGMMA=0' 'VLMCTL_W4A16_WGMMA=1 VLMCTL_W4A16_WGMMA_FIXUP=parallel')")
    ap.add_argument("--env-variants", nargs="+", metavar="NAME",
                    help="the decoders (fp16/bf16, awq) that --env-ab/--env-cases apply to (default: all); the "
                    "others run once, under the environment as given")
    ap.add_argument("--dtype", choices=["float16", "bfloat16"], default="float16",
                    help="activations and dense weights (AWQ scales stay fp16, as in the engine)")
    ap.add_argument("--attention-graph", action="store_true",
                    help="also time 32 chained decode-attention calls in a CUDA graph per split count")
    ap.add_argument("--attention-graph-batches", type=int, nargs="+", default=[1, 8])
    ap.add_argument("--attention-graph-splits", type=int, nargs="+", default=[1, 2, 4, 8, 17, 32])
    ap.add_argument("--attention-graph-env", nargs="+", default=[""], metavar="'VAR=V'",
                    help="environment cases of --attention-graph, e.g. VLMCTL_ATTN_COMBINE=1 VLMCTL_ATTN_COMBINE=0")
    ap.add_argument("--attn-splits", type=int, nargs="+", default=[],
                    help="measurement only: also time the step with the decode attention split at most N ways")
    ap.add_argument("--attn-splits-rounded-up", action="store_true",
                    help="measurement only: also time the step with the split rule before session 21")
    ap.add_argument("--without", nargs="+", default=[], choices=list(WITHOUT),
                    help="measurement only: also time the step with this part left out (its output is wrong), "
                         "one part at a time, to see what it costs in the step")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU (checks the script runs)")
    ap.add_argument("--out")
    args = ap.parse_args()
    for text in ([args.env_ab] if args.env_ab else []) + [a for case in args.env_cases or [] for a in case.split()]:
        if "=" not in text or not text.split("=", 1)[0]:
            ap.error(f"an environment setting is VAR=VALUE, not {text!r}")
    global DEV, ACT
    ACT = getattr(torch, args.dtype)
    if args.smoke:
        DEV = "cpu"
        args.layers, args.prompt_len, args.steps, args.hf_batches = 2, 600, 4, []
    shape, layers = SHAPES[args.model]
    cfg = llama7b_config(args.layers or layers, SMOKE if args.smoke else shape)
    sd = random_hf_state(cfg, DEV)
    bw = copy_bandwidth() if DEV == "cuda" else 20e9
    device_name = torch.cuda.get_device_name() if DEV == "cuda" else "cpu (smoke)"
    print(f"device {device_name}, torch {torch.__version__}, copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    rows = []
    if args.attention and DEV == "cuda":
        rows.extend({"attention": r} for r in bench_attention(bw))
    if args.attention_graph and DEV == "cuda":
        rows.extend({"attention_graph": r} for r in bench_attention_graph(
            bw, args.attention_graph_batches, splits_list=args.attention_graph_splits, env_cases=args.attention_graph_env))
    dense_name = "fp16" if ACT == torch.float16 else "bf16"
    variants = [(dense_name, None)] + ([("awq", args.awq)] if args.awq else [])
    # the environment every case starts from: what the command line set, never what an earlier case or variant
    # left behind (before session 27 the second decoder's cases started from the first's last case)
    all_cases = [dict(a.split("=", 1) for a in case.split()) for case in args.env_cases or []]
    if args.env_ab:
        all_cases.append({args.env_ab.split("=", 1)[0]: ""})
    saved = {k: os.environ.get(k) for case in all_cases for k in case}

    def restore_environment():
        for k, v in saved.items():
            if v is None:
                os.environ.pop(k, None)
            else:
                os.environ[k] = v

    for name, group in variants:
        restore_environment()
        dec = make_decoder(cfg, sd, group)
        weight_bytes = sum(t.numel() * t.element_size() for t in _decoder_tensors(dec))
        blocks = size_cache(dec, max(args.batches))
        dec.capture_graphs(max(args.batches))
        print(f"[{name}] weights {weight_bytes / 1e9:.2f} GB, KV pool {blocks} blocks "
              f"({blocks * 16 * dec.kv_bytes_per_token() / 1e9:.1f} GB)", flush=True)
        print(f"{'impl':<14}{'batch':>6}{'ms/step':>9}{'gpu ms':>8}{'tok/s':>9}{'bound ms':>10}{'% bound':>9}"
              f"{'prefill tok/s':>14}", flush=True)
        if args.env_variants and name not in args.env_variants:
            cases = [None]
        elif args.env_ab:
            var, values = args.env_ab.split("=", 1)
            cases = [{var: v} for v in values.split(",")]
        else:
            cases = [dict(a.split("=", 1) for a in case.split()) for case in args.env_cases or []] or [None]
        for case in cases:
            if case is not None:
                restore_environment()  # what an earlier case set does not carry over
                os.environ.update(case)
                dec._fused = False  # the fused batch-1 step is chosen again (VLMCTL_FUSED_STEP)
                dec._graphs.clear()
                dec._graph_pool = None  # a fresh pool: the old graphs' pool is released with them
                sync()
                dec.capture_graphs(max(args.batches))
                print("-- " + " ".join(f"{k}={v}" for k, v in case.items()), flush=True)
            for b in args.batches:
                runs = [True] + ([False] if args.eager else [])
                for graphs in runs:
                    r = bench_vlmctl(dec, b, args.prompt_len, args.steps, graphs)
                    kv = b * r["context"] * dec.kv_bytes_per_token()
                    r.update(variant=name, weight_bytes=weight_bytes, bound_ms=1000 * (weight_bytes + kv) / bw)
                    r["pct_bound"] = 100 * r["bound_ms"] / r["ms_per_step"]
                    if case is not None:
                        r["env"] = dict(case)
                    rows.append(r)
                    print(f"{r['impl'] + '-' + name:<14}{b:>6}{r['ms_per_step']:>9.2f}"
                          f"{r['gpu_ms_per_step'] or 0:>8.2f}{r['tok_s']:>9.0f}{r['bound_ms']:>10.2f}"
                          f"{r['pct_bound']:>8.0f}%{r['prefill_tok_s']:>14.0f}", flush=True)
        time_measurement_variants(dec, name, args, rows)
        # the profiles come last: in session 33 the variants timed after a graph profile in the same process ran
        # 0.1-0.2 ms a step slower than without one before them (not taken apart; the profiler's CUPTI is suspect)
        for b in args.timeline:
            rows.append({"impl": "timeline", "variant": name, **timeline(dec, b, args.prompt_len)})
        for b in args.graph_profile:
            profile_graph_steps(dec, b, args.prompt_len)
        for b in args.profile:
            profile_step(dec, b, args.prompt_len)
        del dec  # with its KV pool, before the next decoder is built
        if DEV == "cuda":
            torch.cuda.empty_cache()
    for b in args.hf_batches:
        r = bench_hf(cfg, sd, b, args.prompt_len, args.steps)
        r["variant"] = dense_name
        rows.append(r)
        print(f"{'transformers':<14}{b:>6}{r['ms_per_step']:>9.2f}{r['tok_s']:>9.0f}", flush=True)
    if args.out:
        with open(args.out, "w") as f:
            json.dump({"device": device_name, "torch": torch.__version__, "copy_bw": bw,
                       "args": vars(args), "rows": rows}, f, indent=2)


def _decoder_tensors(dec):
    """What one decode step reads in full (the embedding only gathers b rows, unless it is the lm_head too)."""
    yield dec.norm
    yield dec.lm_head
    for layer in dec.layers:
        yield layer.input_norm
        yield layer.post_norm
        for lin in (layer.qkv, layer.o, layer.gate_up, layer.down):
            yield from lin.tensors()


if __name__ == "__main__":
    main()
