"""Where a prompt step's time goes, the GPU's or the host's: one eager `TorchDecoder.forward` of a prompt chunk on
`decode_gpu.py`'s LLaVA-1.5-7B-shaped decoder (random weights), per KV pool and chunk.

A chunk is START:N (N new tokens after START cached ones; START > 0 is a continuation, the next turn of a chat or a
prompt's later chunk, which attends over the cache). For each: the forward's wall time with the GPU synchronized
before and after; its GPU time (CUDA events); the host's time to launch it, behind a sleep kernel long enough that the
host never waits for the GPU; medians of `--repeats` after 3 untimed. Then one forward under cProfile: the Python
functions and torch ops with the most host time of their own. When the host's launch time is above the GPU time,
the step is the host's.

A mode is a KV pool, optionally with environment settings for its runs: `auto` captures the engine's default steps
with prompt rows (those of up to `VLMCTL_STEP_GRAPH_ROWS`, 384, replay a CUDA graph), `auto+VLMCTL_STEP_GRAPH_ROWS=0`
runs every step eagerly, `int8+VLMCTL_STEP_GRAPH_ROWS=0+VLMCTL_CHUNK_ATTENTION_ROWS=512` eagerly with continuations'
attention by the paged prompt kernel. `--decode-rows N` puts N decode rows of
other sequences (512 cached positions each) beside each chunk, as a serving step admits a prompt beside running
requests. `--attention` first times one layer's attention of a continuation chunk apart from the decoder (7B
shape), the paged prompt kernel against the gathered context and SDPA, GPU µs behind a sleep kernel, and their
largest difference.

    python benchmarks/prompt_host_gpu.py [--chunks 0:92 1888:92 0:593] [--modes auto int8] [--layers 32] \
        [--decode-rows 0] [--attention 1888:92 8100:92 2048:512 2048:2048]
    python benchmarks/prompt_host_gpu.py --smoke       # tiny shapes on the CPU (host times only)
"""

from __future__ import annotations

import argparse
import cProfile
import json
import os
import pstats
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

sys.path.insert(0, str(Path(__file__).resolve().parent))

import decode_gpu as D  # noqa: E402


def log(*a):
    print(*a, flush=True)


def sync():
    if torch.cuda.is_available():
        torch.cuda.synchronize()


DECODE_CONTEXT = 512  # the cached positions of each decode row beside a chunk (`--decode-rows`)


def chunks_of(dec, start: int, n: int, seed: int, decode_rows: int = 0) -> list:
    """A chunk of n new tokens after `start` cached ones, after `decode_rows` decode rows of other sequences
    (DECODE_CONTEXT cached positions each), each sequence on its own blocks."""
    from vlmctl.runtime.decoder import Chunk

    g = np.random.default_rng(seed)
    bs = dec.block_size
    first = 1 + -(-(start + n) // bs)  # the chunk's blocks come first
    per_row = DECODE_CONTEXT // bs + 1
    rows = [Chunk(g.integers(0, dec.vocab_size, 1), np.array([DECODE_CONTEXT]), DECODE_CONTEXT,
                  list(range(first + i * per_row, first + (i + 1) * per_row))) for i in range(decode_rows)]
    ids = g.integers(0, dec.vocab_size, n)
    return rows + [Chunk(ids, np.arange(start, start + n), start, list(range(1, first)))]


def pool_blocks(dec, chunks: list[str], decode_rows: int) -> int:
    longest = max(sum(int(v) for v in spec.split(":")) for spec in chunks)
    return 1 + -(-longest // 16) + decode_rows * (DECODE_CONTEXT // 16 + 1)


def time_forward(dec, chunks: list, repeats: int) -> dict:
    run = lambda: dec.forward(chunks)  # noqa: E731
    for _ in range(3):
        run()
    sync()
    wall, gpu, host = [], [], []
    cuda = torch.cuda.is_available()
    for _ in range(repeats):
        t0 = time.perf_counter()
        run()
        sync()
        wall.append(1000 * (time.perf_counter() - t0))
        if cuda:
            a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
            a.record()
            run()
            b.record()
            b.synchronize()
            gpu.append(a.elapsed_time(b))
            torch.cuda._sleep(200_000_000)  # ~0.1 s of GPU work queued first: the launches below never wait
            t0 = time.perf_counter()
            run()
            host.append(1000 * (time.perf_counter() - t0))
            sync()
    med = lambda xs: round(statistics.median(xs), 3) if xs else None  # noqa: E731
    return {"wall_ms": med(wall), "gpu_ms": med(gpu), "host_launch_ms": med(host)}


def host_profile(dec, chunks: list, top: int) -> list:
    """(function, own host µs, calls) of one forward, the `top` with the most own time."""
    prof = cProfile.Profile()
    prof.enable()
    dec.forward(chunks)
    prof.disable()
    sync()
    st = pstats.Stats(prof)
    rows = []
    for (file, line, name), (_, calls, own, _, _) in st.stats.items():
        where = name if file == "~" else f"{Path(file).name}:{line}:{name}"
        rows.append((where[:80], round(1e6 * own), calls))
    rows.sort(key=lambda r: -r[1])
    return rows[:top]


def gpu_us(fn, reps: int = 30) -> float:
    """Median GPU µs of fn(), its launches queued behind a sleep kernel."""
    fn()
    times = []
    for _ in range(reps):
        a, b = torch.cuda.Event(enable_timing=True), torch.cuda.Event(enable_timing=True)
        torch.cuda._sleep(2_000_000)
        a.record()
        fn()
        b.record()
        b.synchronize()
        times.append(1000 * a.elapsed_time(b))
    return statistics.median(times)


def attention_times(cases: list[str]) -> list[dict]:
    """One layer's continuation attention (7B shape: 32 heads of 128), the paged prompt kernel against the
    gathered context and SDPA (the eager forward's path without it), per pool."""
    from vlmctl.runtime import kv_quant, ops
    from vlmctl.runtime.kernels.paged_prefill import (SPLIT_WORKSPACE_BYTES, prompt_attention, split_workspace,
                                                      tile_table, tiles)
    from vlmctl.runtime.kernels.paged_prefill import split_tiles as split_tiles_of

    H, d, bs, rows = 32, 128, 16, []
    sms = torch.cuda.get_device_properties(0).multi_processor_count
    for spec in cases:
        start, n = (int(v) for v in spec.split(":"))
        L = start + n
        nb = -(-L // bs)
        table = torch.randperm(2 * nb, device="cuda")[:nb]
        tiles_t = torch.from_numpy(tile_table([(0, 0, n, start)], tiles(d)[0])).cuda()
        # the same tiles with their contexts split as VLMCTL_PROMPT_SPLITS=16 would allow
        most = max(1, min(16, SPLIT_WORKSPACE_BYTES // (n * H * d * 4)))
        split_t = tile_table([(0, 0, n, start)], tiles(d)[0], max_splits=most, heads=H, sms=sms)
        ws = split_workspace(n, H, d, most, "cuda")
        split_tiles = torch.from_numpy(split_t).cuda()
        whole_tiles = split_tiles.clone()
        whole_tiles[:, 4] = 1
        captured_rows = min(len(split_t), split_tiles_of(H, sms))  # as StepGraphs launches the combine
        k16 = torch.randn(2 * nb, bs, H, d, device="cuda", dtype=torch.float16)
        v16 = torch.randn_like(k16)
        q = torch.randn(n, 3 * H, d, device="cuda", dtype=torch.float16)[:, :H]
        pools = {"fp16": (k16, v16, None, None)}
        kq, ksc = kv_quant.quantize(k16, kv_quant.STORAGE["int8"])
        vq, vsc = kv_quant.quantize(v16, kv_quant.STORAGE["int8"])
        pools["int8"] = (kq, vq, ksc, vsc)
        for pool, (kc, vc, ks, vs) in pools.items():
            def gathered():
                k, v = ops.gather_kv(kc, vc, table, L, ks, vs, q.dtype)
                return ops.prefill_attention(q, k, v, d ** -0.5)

            kernel = lambda: prompt_attention(q, kc, vc, table.int()[None], tiles_t, d ** -0.5, None, ks, vs)  # noqa: E731
            split = lambda: prompt_attention(q, kc, vc, table.int()[None], split_tiles, d ** -0.5, None, ks, vs,  # noqa: E731
                                             None, most, ws, captured_rows)
            # what the split variant costs where no tile splits: with the split programs and the combine a captured
            # step launches for its first split_tiles rows, and without either
            idle = lambda rows: prompt_attention(q, kc, vc, table.int()[None], whole_tiles, d ** -0.5, None, ks,  # noqa: E731
                                                 vs, None, most, ws, rows)
            r = {"start": start, "n": n, "pool": pool, "kernel_us": round(gpu_us(kernel), 1),
                 "split_kernel_us": round(gpu_us(split), 1), "splits": split_t[:, 4].tolist(),
                 "split_variant_none_split_us": round(gpu_us(lambda: idle(captured_rows)), 1) if most > 1 else None,
                 "split_variant_no_split_programs_us": round(gpu_us(lambda: idle(0)), 1) if most > 1 else None,
                 "gather_sdpa_us": round(gpu_us(gathered), 1),
                 "max_abs_diff": float((kernel().float() - gathered().float()).abs().max()),
                 "split_max_abs_diff": float((split().float() - gathered().float()).abs().max())}
            rows.append(r)
            log(json.dumps(r))
    return rows


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    ap.add_argument("--chunks", nargs="+", default=["0:92", "1888:92", "0:593"], metavar="START:N")
    ap.add_argument("--modes", nargs="+", default=["auto", "int8"], help="KV pools (--kv-cache-dtype values)")
    ap.add_argument("--layers", type=int, default=32)
    ap.add_argument("--repeats", type=int, default=20)
    ap.add_argument("--top", type=int, default=25, help="rows of the cProfile table")
    ap.add_argument("--attention", nargs="*", default=[], metavar="START:N")
    ap.add_argument("--decode-rows", type=int, default=0, help="decode rows of other sequences beside each chunk")
    ap.add_argument("--smoke", action="store_true", help="tiny shapes on the CPU")
    ap.add_argument("--out", type=Path)
    args = ap.parse_args()
    if args.smoke or not torch.cuda.is_available():
        D.DEV, shape, args.layers, args.repeats = "cpu", D.SMOKE, 2, 3
        args.chunks = ["0:12", "20:6"]
    else:
        shape = D.SHAPE
    attn = attention_times(args.attention) if D.DEV == "cuda" and args.attention else []
    cfg = D.llama7b_config(args.layers, shape)
    sd = D.random_hf_state(cfg, D.DEV)
    dec = D.make_decoder(cfg, sd, None)
    del sd
    rows = []
    for mode in args.modes:
        pool, *settings = mode.split("+")
        for kv in settings:
            os.environ[kv.split("=")[0]] = kv.split("=", 1)[1]
        dec.kv_cache_dtype = pool
        dec.allocate_cache(pool_blocks(dec, args.chunks, args.decode_rows), 16)
        # captured steps as the mode's VLMCTL_STEP_GRAPH_ROWS asks (the engine's default where it is unset)
        if D.DEV == "cuda":  # what the old pools and steps left cached would otherwise count against the capture
            torch.cuda.empty_cache()
        before = torch.cuda.memory_reserved() if D.DEV == "cuda" else 0
        graphed = dec.capture_step_graphs(max(args.decode_rows + 1, 16), 2048)
        graph_mb = round((torch.cuda.memory_reserved() - before) / 2**20) if D.DEV == "cuda" else 0
        for i, spec in enumerate(args.chunks):
            start, n = (int(v) for v in spec.split(":"))
            chunks = chunks_of(dec, start, n, i, args.decode_rows)
            r = {"mode": mode, "start": start, "n": n, "decode_rows": args.decode_rows, "step_graphs": graphed,
                 "step_graphs_reserved_mb": graph_mb,
                 **time_forward(dec, chunks, args.repeats),
                 "host_profile_us_calls": host_profile(dec, chunks, args.top)}
            rows.append(r)
            log(json.dumps({k: v for k, v in r.items() if k != "host_profile_us_calls"}))
        for kv in settings:
            os.environ.pop(kv.split("=")[0])
    log(f"device: {torch.cuda.get_device_name() if D.DEV == 'cuda' else 'cpu'}; {args.layers} layers")
    if attn:
        log("| cached | new | pool | paged prompt kernel, GPU µs a layer | gathered context + SDPA | max abs diff |")
        log("| ---: | ---: | --- | ---: | ---: | ---: |")
        for r in attn:
            log(f"| {r['start']} | {r['n']} | {r['pool']} | {r['kernel_us']} | {r['gather_sdpa_us']} | "
                f"{r['max_abs_diff']:.2g} |")
    log(f"decode rows beside each chunk: {args.decode_rows}")
    log("| KV pool | cached | new | wall ms | GPU ms | host ms to launch | MB reserved by the step graphs |")
    log("| --- | ---: | ---: | ---: | ---: | ---: | ---: |")
    for r in rows:
        log(f"| {r['mode']} | {r['start']} | {r['n']} | {r['wall_ms']} | {r['gpu_ms']} | {r['host_launch_ms']} | "
            f"{r['step_graphs_reserved_mb']} |")
    for r in rows:
        log(f"\nown host time of one forward ({r['mode']}, {r['start']}:{r['n']}), µs and calls:")
        for name, us, calls in r["host_profile_us_calls"]:
            log(f"  {us:>7} {calls:>5}  {name}")
    if args.out:
        args.out.write_text(json.dumps({"attention": attn, "forwards": rows}, indent=1))


if __name__ == "__main__":
    main()
