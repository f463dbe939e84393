"""The fused batch-1 decode step (`vlmctl/runtime/kernels/fused_step.py`) against the decoder's
kernel-by-kernel step, on a GPU: correctness, then time.

    python benchmarks/fused_step_gpu.py                 # checks, then the 7B-shaped step timed
    python benchmarks/fused_step_gpu.py --skip-time
    python benchmarks/fused_step_gpu.py --skip-check --steps 64
    python benchmarks/fused_step_gpu.py --variant flow --warps 16 12 8   # the dataflow step (flow_step.py)
    VLMCTL_FLOW_OPTS=32 VLMCTL_FLOW_WARPS=7 python benchmarks/fused_step_gpu.py --variant flow --flow-configs 7:32
                                                                         # its ring kernel checked, then timed

Checks (random Llama decoders, round-to-nearest int4 in the W4A16 layout, fp16), per shape and group size:
the same decode steps run fused and unfused from the same cache (teacher-forced by the unfused tokens):
the logits' largest difference relative to their largest magnitude, how often the two argmaxes agree, and
the K/V rows each wrote for the new token; then free-running greedy tokens from the same prompt, fused
against unfused, and a captured CUDA graph of the fused step against its eager run. Shapes: a small GQA
decoder, and LLaVA-1.5-7B and Qwen2-VL-7B shapes with a few layers, at prompt lengths that end
mid-tile and on a tile boundary.

Timing: `decode_gpu.py`'s decoder (32 layers, prompt of 640, engine defaults, CUDA graphs), AWQ at batch 1
with the fused step off and on in the same process, and the fp16 decoder for reference.
"""

from __future__ import annotations

import argparse
import json
import os
import sys
import time

import numpy as np
import torch

sys.path.insert(0, os.path.dirname(__file__))
import decode_gpu as D  # noqa: E402

SMALL = {"hidden_size": 512, "intermediate_size": 1536, "num_attention_heads": 4, "num_key_value_heads": 2,
         "vocab_size": 2000}


def prefill(dec, prompt_len: int, seed: int):
    from vlmctl.runtime.decoder import Chunk

    ids = np.random.default_rng(seed).integers(0, dec.vocab_size, prompt_len)
    table = list(range(1, 1 + -(-(prompt_len + 200) // dec.block_size)))
    logits = dec.forward([Chunk(ids, np.arange(prompt_len), 0, table)])
    return int(logits.argmax(-1)[0]), table


def step(dec, tok, n, table, fused):
    dec._fused = fused
    bs = dec.block_size
    slot = table[n // bs] * bs + n % bs
    logits = dec.decode(np.array([tok]), np.array([n]), np.array([slot]), [table], np.array([n + 1]))
    kv = (dec.k_cache[:, slot // bs, slot % bs].clone(), dec.v_cache[:, slot // bs, slot % bs].clone())
    return logits.float(), kv


def check(name, cfg, group, prompt_len, steps, seed=0) -> dict:
    from vlmctl.runtime.kernels.flow_step import build_step

    sd = D.random_hf_state(cfg, "cuda", seed)
    dec = D.make_decoder(cfg, sd, group)
    dec.allocate_cache(1 + -(-(prompt_len + 200) // 16) + 8, 16)
    dec.use_graphs = False
    fused = build_step(dec)
    assert fused is not None, dec.fused_step_reason
    tok, table = prefill(dec, prompt_len, seed)
    worst, agree, kv_worst = 0.0, 0, 0.0
    for i in range(steps):
        n = prompt_len + i
        la, kva = step(dec, tok, n, table, None)
        lb, kvb = step(dec, tok, n, table, fused)
        worst = max(worst, float((la - lb).abs().max() / la.abs().max()))
        agree += int(la.argmax() == lb.argmax())
        kv_worst = max(kv_worst, max(float((a.float() - b.float()).abs().max() / a.float().abs().max().clamp_min(1e-6))
                                     for a, b in zip(kva, kvb)))
        tok = int(la.argmax())
    # free-running greedy, each path from the same prompt (the cache rows past the prompt are rewritten)
    runs = []
    for f in (None, fused):
        t, out = prefill(dec, prompt_len, seed)[0], []
        for i in range(steps):
            logits, _ = step(dec, t, prompt_len + i, table, f)
            t = int(logits.argmax())
            out.append(t)
        runs.append(out)
    same = sum(a == b for a, b in zip(*runs))
    # a captured graph of the fused step against its eager run (bucket 1)
    dec.use_graphs = True
    dec._fused = False
    dec.capture_graphs(1)
    t = prefill(dec, prompt_len, seed)[0]
    lg, _ = step(dec, t, prompt_len, table, dec._fused)
    dec.use_graphs = False
    le, _ = step(dec, t, prompt_len, table, fused)
    graph_equal = bool(torch.equal(lg, le))
    r = {"shape": name, "group": group, "prompt_len": prompt_len, "steps": steps, "max_rel_logit_diff": worst,
         "argmax_agree": agree, "max_rel_kv_diff": kv_worst, "greedy_same": same, "graph_equals_eager": graph_equal,
         "variant": os.environ.get("VLMCTL_FUSED_STEP"), "slots": getattr(fused, "nslot", None),
         "slot_bytes": getattr(fused, "slot_bytes", None), "warps": getattr(fused, "warps", None)}
    print(json.dumps(r), flush=True)
    del dec, fused
    torch.cuda.empty_cache()
    return r


def trace_phases(dec, prompt_len: int) -> dict:
    """Block 0's time in each phase of a layer (median over layers 1.. and 5 eager steps), microseconds."""
    from vlmctl.runtime.kernels.fused_step import TRACE_MARKS

    fused = dec._fused
    prev = dec.use_graphs
    fused.trace = torch.zeros(16 * dec.n_layers, dtype=torch.int64, device="cuda")
    dec.use_graphs = False
    t, table = prefill(dec, prompt_len, 0)
    per = []
    for i in range(6):
        step(dec, t, prompt_len + i, table, fused)
        torch.cuda.synchronize()
        tr = fused.trace.cpu().numpy().astype(np.int64).reshape(dec.n_layers, 16)
        flat = tr.reshape(-1)
        d = np.diff(flat).reshape(-1)
        if i:
            per.append(np.concatenate([[0], d]).reshape(dec.n_layers, 16)[1:])
    fused.trace = None
    dec.use_graphs = prev
    per = np.concatenate(per)
    med = np.median(per, 0) / 1000
    out = {f"{j:02d} {m}": round(float(v), 2) for j, (m, v) in enumerate(zip(TRACE_MARKS, med))}
    out["layer"] = round(float(np.median(per.sum(1)) / 1000), 2)
    print("  trace (block 0, us per layer):", json.dumps(out), flush=True)
    return out


def flow_trace(dec, prompt_len: int) -> dict:
    """The flow step's block 0: the time from each mark to the next (decode_flow.cu's marks, flow_step.TRACE_MARKS;
    "x -> y" is y's time minus x's), median over layers 1.. and 5 eager steps, microseconds."""
    from vlmctl.runtime.kernels.flow_step import TRACE_MARKS

    fused = dec._fused
    prev = dec.use_graphs
    n = len(TRACE_MARKS)
    fused.trace = torch.zeros(n * dec.n_layers, dtype=torch.int64, device="cuda")
    dec.use_graphs = False
    t, table = prefill(dec, prompt_len, 0)
    per = []
    for i in range(6):
        step(dec, t, prompt_len + i, table, fused)
        torch.cuda.synchronize()
        tr = fused.trace.cpu().numpy().astype(np.int64)
        if i:
            d = np.diff(tr)  # mark k+1 minus mark k, across layers in order
            per.append(np.concatenate([d, [0]]).reshape(dec.n_layers, n)[1:])
    fused.trace = None
    dec.use_graphs = prev
    per = np.concatenate(per)
    med = np.median(per, 0) / 1000
    names = list(TRACE_MARKS) + ["next qkv start"]
    out = {f"{names[k]} -> {names[k + 1]}": round(float(v), 2) for k, v in enumerate(med)}
    out["layer"] = round(float(np.median(per.sum(1)) / 1000), 2)
    print("  flow trace (block 0, us per layer):", json.dumps(out), flush=True)
    return out


def modes(prompt_len: int, layers: int, profile: bool) -> None:
    """The 7B-shaped fused step's phases as they are, computing on stale slots with no weights copied (mode 1),
    and waiting for the weights without computing (mode 2); with --ncu-once, one step for a profiler to catch."""
    cfg = D.llama7b_config(layers)
    dec = D.make_decoder(cfg, D.random_hf_state(cfg, "cuda"), 128)
    D.size_cache(dec, 1)
    from vlmctl.runtime.kernels.flow_step import build_step

    fused = build_step(dec)  # (--variant flow: the flow step, for --ncu-once)
    assert fused is not None, dec.fused_step_reason
    dec._fused = fused
    dec.use_graphs = False
    if profile:
        t, table = prefill(dec, prompt_len, 0)
        for i in range(3):
            step(dec, t, prompt_len + i, table, fused)
        torch.cuda.synchronize()
        return
    for mode in [int(m) for m in os.environ.get("FUSED_MODES", "0,1,2,3").split(",")]:
        fused.mode = mode
        print(f"-- mode {mode}", flush=True)
        trace_phases(dec, prompt_len)
    fused.mode = 0


def timing(steps: int, prompt_len: int, slots=(), variant: str = "1", warps=(), opts=(), configs=()) -> list:
    """fp16 (kernel by kernel), then AWQ kernel by kernel and fused, twice each in turn; then the ring step with
    each of `slots`, or the flow step with each of `warps`, each of `opts` and each (warps, opts) of `configs`."""
    cfg = D.llama7b_config(32)
    sd = D.random_hf_state(cfg, "cuda")
    bw = D.copy_bandwidth()
    rows = []
    for name, group in (("fp16", None), ("awq", 128)):
        dec = D.make_decoder(cfg, sd, group)
        D.size_cache(dec, 1)
        values = ["0", variant] if group else ["0"]
        if variant == "flow":
            extra = ([[("VLMCTL_FLOW_WARPS", w)] for w in warps] + [[("VLMCTL_FLOW_OPTS", o)] for o in opts]
                     + [[("VLMCTL_FLOW_WARPS", c[0]), ("VLMCTL_FLOW_OPTS", c[1])]
                        + ([("VLMCTL_FLOW_SLOT_KB", c[2])] if len(c) > 2 else []) for c in configs])
        else:
            extra = [[("VLMCTL_FUSED_STEP_SLOTS", n)] for n in slots]
        for value in values + (values if group else []) + ([variant] * len(extra) if group else []):
            for knob in ("VLMCTL_FUSED_STEP_SLOTS", "VLMCTL_FLOW_WARPS", "VLMCTL_FLOW_OPTS", "VLMCTL_FLOW_SLOT_KB"):
                os.environ.pop(knob, None)
            os.environ["VLMCTL_FUSED_STEP"] = value
            if group and len(rows) >= 5:
                for knob, v in extra[len(rows) - 5]:
                    os.environ[knob] = str(v)
                print("--", " ".join(f"{k}={v}" for k, v in extra[len(rows) - 5]), flush=True)
            dec._fused = False
            dec._graphs.clear()
            dec._graph_pool = None
            D.sync()
            dec.capture_graphs(1)
            r = D.bench_vlmctl(dec, 1, prompt_len, steps, True)
            r.update(variant=name, fused=value != "0" and dec._fused not in (None, False), step=value,
                     warps=getattr(dec._fused, "warps", None), opts=getattr(dec._fused, "opts", None),
                     slot_bytes=getattr(dec._fused, "slot_bytes", None), nslot=getattr(dec._fused, "nslot", None),
                     reason=dec.fused_step_reason)
            if r["fused"] and value == "flow" and (len(rows) >= 5 or not any(x.get("trace") for x in rows)):
                r["trace"] = flow_trace(dec, prompt_len)
            if (r["fused"] and value == "1"
                    and (len(rows) >= 5 or not any(x.get("trace") for x in rows))):
                r["trace"] = trace_phases(dec, prompt_len)
            rows.append(r)
            print(f"{name:<6} fused={r['fused']!s:<6} warps={r['warps']} opts={r['opts']} slots={r['nslot']}x"
                  f"{r['slot_bytes']} "
                  f"{r['ms_per_step']:.3f} ms/step (GPU {r['gpu_ms_per_step']:.3f}), "
                  f"{r['tok_s']:.0f} tok/s", flush=True)
        del dec
        torch.cuda.empty_cache()
    print(f"copy bandwidth {bw / 1e12:.2f} TB/s", flush=True)
    return rows


def main():
    ap = argparse.ArgumentParser()
    ap.add_argument("--skip-check", action="store_true")
    ap.add_argument("--skip-time", action="store_true")
    ap.add_argument("--steps", type=int, default=32)
    ap.add_argument("--prompt-len", type=int, default=640)
    ap.add_argument("--slots", type=int, nargs="*", default=[], help="also time the fused step with this many ring "
                    "slots (VLMCTL_FUSED_STEP_SLOTS)")
    ap.add_argument("--variant", default="1", choices=["1", "flow"],
                    help="the fused step checked and timed: 1 the ring step (decode_step.cu), flow decode_flow.cu")
    ap.add_argument("--warps", type=int, nargs="*", default=[], help="with --variant flow: also time it with "
                    "this many warps a block (VLMCTL_FLOW_WARPS)")
    ap.add_argument("--opts", type=int, nargs="*", default=[], help="with --variant flow: also time it with "
                    "each of these VLMCTL_FLOW_OPTS (bit 1: the first tasks' loads all before the wait; bit 2: no "
                    "block barrier at a stage's end; bit 4: three tasks' weights a warp; 16: the attention's V rows loaded where used; 32: the ring kernel, a producer "
                    "warp streaming the weights through shared memory)")
    ap.add_argument("--flow-configs", nargs="*", default=[], metavar="WARPS:OPTS[:SLOT_KB]",
                    help="with --variant flow: also time it with each VLMCTL_FLOW_WARPS, VLMCTL_FLOW_OPTS (and "
                    "VLMCTL_FLOW_SLOT_KB) together")
    ap.add_argument("--modes", type=int, metavar="LAYERS", help="only the phase trace per mode (see modes())")
    ap.add_argument("--ncu-once", action="store_true", help="with --modes: three eager steps, for ncu")
    ap.add_argument("--out")
    args = ap.parse_args()
    os.environ["VLMCTL_FUSED_STEP"] = args.variant  # the fused step is opt-in; the checks build it
    print(f"device {torch.cuda.get_device_name()}, torch {torch.__version__}", flush=True)
    if args.modes:
        return modes(args.prompt_len, args.modes, args.ncu_once)
    out = {"checks": [], "timing": []}
    if not args.skip_check:
        cases = [("small-gqa", D.llama7b_config(3, SMALL), 64, 37, 40),
                 ("small-gqa", D.llama7b_config(3, SMALL), 128, 64, 40),
                 ("small-gqa", D.llama7b_config(3, SMALL), 32, 200, 40),
                 ("llava-1.5-7b", D.llama7b_config(2, D.SHAPE), 128, 640, 24),
                 ("qwen2-vl-7b", D.llama7b_config(2, D.SHAPES["qwen2-vl-7b"][0]), 128, 301, 24)]
        for name, cfg, group, plen, steps in cases:
            t = time.time()
            out["checks"].append(check(name, cfg, group, plen, steps))
            print(f"  ({time.time() - t:.1f} s)", flush=True)
    if not args.skip_time:
        configs = [tuple(int(v) for v in c.split(":")) for c in args.flow_configs]
        out["timing"] = timing(args.steps, args.prompt_len, args.slots, args.variant, args.warps, args.opts, configs)
    if args.out:
        with open(args.out, "w") as f:
            json.dump(out, f, indent=2)


if __name__ == "__main__":
    main()
