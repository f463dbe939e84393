"""The CUDA batch-1 W4A16 GEMV ("gemv_cuda", runtime/kernels/w4a16_mma.cu) on one GPU: correctness,
config sweep against the half2 Triton GEMV and cuBLAS, and a step graph of a decoder's linears.

    OUT=results python benchmarks/w4a16_gemv_gpu.py [--models llava-1.5-7b qwen2-vl-7b ...] [--quick]
        [--all-shapes-in-table] [--behind-norm]

1. correctness: shapes with odd N and K (K = 96 .. 11008, groups 32, 64 and 128) x M 1 and 3 x bias x
   every swept config, against x @ dequantize(W)^T in fp32 (relative Frobenius error; the half2 GEMV's
   error on the same inputs beside it), run twice (bit-identical), and one CUDA-graph replay.
2. sweep: per linear of each model and every config of `gemv_cuda_candidate_configs`, CUDA graphs of 8
   launches over distinct weights (more bytes than L2 keeps), median of 15 replays; against what the
   shipped table selects with the CUDA GEMV off (the half2 GEMV) and cuBLAS on the dense fp16 weight.
   --behind-norm also times each config as the step runs qkv and gate_up: each launch behind the residual add +
   RMSNorm that writes its x (PDL lets the GEMV load its first weights while that short kernel runs; graphs of
   8 such pairs, the norms alone subtracted), gate_up with its act·mul epilogue; qkv's and gate_up's best (and
   table entry) are then taken from those times. It does not settle every config: Qwen2-VL-7B's qkv ranks 2 rows x
   1 chunk first alone and behind a norm, yet its step is 3-4 % slower than at 4 rows x 2 chunks, a difference that
   comes from the decode attention after qkv launching early under PDL (docs/benchmarks.md, session 32).
3. step graph: 32 layers x 4 linears (distinct weights) as one CUDA graph at M = 1: the sweep's best CUDA
   config per shape, the untuned rule (`heuristic_gemv_cuda_config`), the half2 GEMV, cuBLAS dense.
Selection takes the CUDA GEMV by default (VLMCTL_W4A16_GEMV_CUDA=0 turns it off); in the decode step:
`python benchmarks/decode_gpu.py --batches 1 --awq --env-ab VLMCTL_W4A16_GEMV_CUDA=0,1`.
Writes $OUT/gemv_cuda.json and $OUT/w4a16_tuned.json (the shipped table plus, per swept 7B shape, the
best CUDA config where it beat the half2 GEMV). Those are per-call bests: confirm a table in the decode step
before shipping it (`decode_gpu.py --model M --awq --batches 1 --env-variants awq --env-cases
"VLMCTL_W4A16_TABLE=" "VLMCTL_W4A16_TABLE=$OUT/w4a16_tuned.json"`, interleaved): in session 31 a qkv's per-call best
(21 % faster a call) made its step 2 % slower (docs/benchmarks.md).
"""
import json
import os
import sys
import time

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from gpu_timing import graph_median_ms  # noqa: E402
from gpu_weights import random_packed  # noqa: E402
from vlmctl.runtime.kernels import cuda_rtc, pdl  # noqa: E402
from vlmctl.runtime.kernels import w4a16 as W  # noqa: E402
from vlmctl.runtime.kernels.fused import add_rms_norm  # noqa: E402

OUT = os.environ.get("OUT", "/tmp")
os.environ.setdefault("VLMCTL_CACHE_DIR", "/var/tmp/vlmctl-cache")
dev = torch.device("cuda")
DT = torch.float16
T0 = time.perf_counter()
# (N, K) of qkv, o, gate_up, down for Llama-style decoders
MODELS = {
    "llava-1.5-7b": {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)},
    "qwen2-vl-7b": {"qkv": (4608, 3584), "o": (3584, 3584), "gate_up": (37888, 3584), "down": (3584, 18944)},
    "mistral-7b": {"qkv": (6144, 4096), "o": (4096, 4096), "gate_up": (28672, 4096), "down": (4096, 14336)},
    "llava-1.5-13b": {"qkv": (15360, 5120), "o": (5120, 5120), "gate_up": (27648, 5120), "down": (5120, 13824)},
}
args = sys.argv[1:]
models = args[args.index("--models") + 1:] if "--models" in args else ["llava-1.5-7b"]
models = [m for m in models if not m.startswith("--")]
QUICK = "--quick" in args
BEHIND_NORM = "--behind-norm" in args
NORMED = ("qkv", "gate_up")  # the linears whose step predecessor is the residual add + RMSNorm
res = {"correct": [], "sweep": {}, "step": {}}


def log(*a):
    print(f"[{time.perf_counter() - T0:6.1f}s]", *a, flush=True)


def without_cuda_gemv(fn):  # what selection picks with the CUDA GEMV switched off (the half2 GEMV)
    old = os.environ.get("VLMCTL_W4A16_GEMV_CUDA")
    os.environ["VLMCTL_W4A16_GEMV_CUDA"] = "0"
    try:
        return fn()
    finally:
        if old is None:
            os.environ.pop("VLMCTL_W4A16_GEMV_CUDA")
        else:
            os.environ["VLMCTL_W4A16_GEMV_CUDA"] = old


def precompile(cfgs, gs):
    cap = torch.cuda.get_device_capability()
    t = time.perf_counter()
    n = cuda_rtc.precompile(W.mma_source(), [W.gemv_cuda_kernel_name(c, g) for c in cfgs for g in gs],
                            f"sm_{cap[0]}{cap[1]}")
    log(f"compiled {n} kernels in {time.perf_counter() - t:.1f}s")


log("nvrtc", cuda_rtc.nvrtc_version(), torch.__version__, torch.cuda.get_device_name(), "PDL", pdl.enabled(dev))
CANDS = W.gemv_cuda_candidate_configs(4096, 4096, 128)
if QUICK:
    CANDS = [c for c in CANDS if c.num_stages == 2]
precompile(CANDS + [W.heuristic_gemv_cuda_config(4096, 4096, 128)], (32, 64, 128))
if BEHIND_NORM:  # gate_up's candidates with the act·mul epilogue
    t = time.perf_counter()
    cap = torch.cuda.get_device_capability()
    n_act = cuda_rtc.precompile(W.mma_source(), [W.gemv_cuda_kernel_name(c, 128, "silu") for c in CANDS
                                                 if W._act_mul_tiles(c)], f"sm_{cap[0]}{cap[1]}")
    log(f"compiled {n_act} act·mul kernels in {time.perf_counter() - t:.1f}s")

# ------------------------------------------------------------------ correctness
cases = [(4096, 4096, 128), (4096, 11008, 128), (22016, 4096, 128), (203, 4096, 64), (72, 128, 128), (45, 96, 32), (1000, 3584, 128),
         (17, 4160, 64)]
worst = 0.0
bad = 0
for (n, k, g) in cases:
    p = random_packed(n, k, g, n + k)
    wdq = W.dequantize(p, g, DT).float()
    for m in (1, 3):
        x = torch.randn(m, k, device=dev, dtype=DT)
        for bias in (None, torch.randn(n, device=dev, dtype=DT)):
            ref = x.float() @ wdq.t() + (0 if bias is None else bias.float())
            h2 = W.heuristic_h2_config(m, n, k, g)
            e_h2 = float((W.launch(x, p, g, h2, bias).float() - ref).norm() / ref.norm()) if h2 else None
            for c in CANDS:
                if not c.valid_for(n, k, g):
                    continue
                y = W.launch(x, p, g, c, bias).float()
                y2 = W.launch(x, p, g, c, bias).float()
                e = float((y - ref).norm() / ref.norm())
                det = bool(torch.equal(y, y2))
                worst = max(worst, e)
                if e > 2e-3 or not det:
                    bad += 1
                    log(f"BAD n{n} k{k} g{g} m{m} bias{bias is not None} {W.describe(c)}: rel {e:.2e} det {det}"
                        f" (half2 {e_h2})")
                res["correct"].append(dict(n=n, k=k, g=g, m=m, bias=bias is not None, cfg=W.describe(c), rel=e,
                                           det=det, half2_rel=e_h2))
log(f"correctness: {len(res['correct'])} cases, worst rel err {worst:.2e}, bad {bad}")
res["worst_rel"] = worst

p = random_packed(4096, 4096, 128, 1)
x = torch.randn(1, 4096, device=dev, dtype=DT)
c = W.heuristic_gemv_cuda_config(4096, 4096, 128)
yref = W.launch(x, p, 128, c)
graph = torch.cuda.CUDAGraph()
side = torch.cuda.Stream()
side.wait_stream(torch.cuda.current_stream())
with torch.cuda.stream(side):
    W.launch(x, p, 128, c)
torch.cuda.current_stream().wait_stream(side)
with torch.cuda.graph(graph):
    yg = W.launch(x, p, 128, c)
graph.replay()
torch.cuda.synchronize()
res["graph_equal"] = bool(torch.equal(yg, yref))
log("graph replay equal:", res["graph_equal"])

# ------------------------------------------------------------------ sweep
NWS = 8  # weight sets per shape in each timed graph
best = {}
h2_pick = {}
for model in models:
    for name, (n, k) in MODELS[model].items():
        if (n, k) in best:
            continue
        ps = [random_packed(n, k, 128, n + i) for i in range(NWS)]
        x = torch.randn(1, k, device=dev, dtype=DT)
        y = torch.empty(1, n, device=dev, dtype=DT)

        def per_call(c):
            return graph_median_ms([lambda p=p: W.launch(x, p, 128, c, out=y) for p in ps]) * 1e3 / NWS

        hid = torch.randn(1, k, device=dev, dtype=DT)  # the norm's input and residual (the step's hidden state)
        res_in = torch.randn(1, k, device=dev, dtype=DT)
        norm_w = torch.rand(k, device=dev, dtype=DT) + 0.5
        act = "silu" if name == "gate_up" else None
        y_act = torch.empty(1, n // 2 if act else n, device=dev, dtype=DT)

        def norm():
            add_rms_norm(hid, norm_w, 1e-6, residual=res_in, out=x)

        t_norms = graph_median_ms([norm] * NWS) * 1e3 / NWS if BEHIND_NORM and name in NORMED else None

        def behind_norm(c):  # µs a call: (norm, GEMV) pairs less the norms alone
            def pair(p):
                norm()
                W.launch(x, p, 128, c, out=y_act, act=act)
            return graph_median_ms([lambda p=p: pair(p) for p in ps]) * 1e3 / NWS - t_norms

        hc = without_cuda_gemv(lambda: W.select_config(1, n, k, 128, DT, dev))
        h2_pick[(n, k)] = hc
        t_h2 = per_call(hc)
        wds = [W.dequantize(p, 128, DT) for p in ps[:2]] * (NWS // 2)  # two dense sets: 2 x the L2 already
        t_cub = graph_median_ms([lambda wd=wd: torch.mm(x, wd.t(), out=y) for wd in wds]) * 1e3 / NWS
        del wds
        timed = sorted(((per_call(c), c) for c in CANDS if c.valid_for(n, k, 128)), key=lambda t: t[0])
        rule = W.heuristic_gemv_cuda_config(n, k, 128)
        t_rule = per_call(rule)
        best[(n, k)] = timed[0][1]
        byt = n * k / 2 + n * k / 128 * 3
        res["sweep"][f"{model}:{name}"] = dict(n=n, k=k, half2=(W.describe(hc), t_h2), cublas=t_cub,
                                               rule=(W.describe(rule), t_rule),
                                               top=[(W.describe(c), t) for t, c in timed[:8]],
                                               all=[(W.describe(c), t) for t, c in timed])  # for rules across shapes
        if t_norms is not None:
            cands = [c for c in CANDS if c.valid_for(n, k, 128) and (act is None or W._act_mul_tiles(c))]
            normed = sorted(((behind_norm(c), c) for c in cands), key=lambda t: t[0])
            h2n = without_cuda_gemv(lambda: W.select_config(1, n, k, 128, DT, dev, act_mul=act is not None))
            t_h2n = behind_norm(h2n)
            best[(n, k)] = normed[0][1]
            res["sweep"][f"{model}:{name}"].update(norm_alone=t_norms, act=act, half2_behind_norm=(W.describe(h2n), t_h2n),
                                                   behind_norm=[(W.describe(c), t) for t, c in normed])
            log(f"{model:14s} {name:8s}: behind a norm ({t_norms:.1f} us alone{', act·mul' if act else ''}): "
                f"{', '.join(f'{W.describe(c)} {t:.1f}' for t, c in normed[:4])} | half2 {t_h2n:.1f}")
        log(f"{model:14s} {name:8s}: cuda {timed[0][0]:6.1f} us ({byt / timed[0][0] / 1e6:.2f} TB/s) "
            f"{W.describe(timed[0][1])} | rule {t_rule:6.1f} | half2 {t_h2:6.1f} ({byt / t_h2 / 1e6:.2f} TB/s, "
            f"{W.describe(hc)}) | cublas fp16 {t_cub:6.1f}")

# ------------------------------------------------------------------ step graphs at M = 1
for model in models:
    shapes = MODELS[model]
    layers = [{nm: random_packed(n, k, 128, 1000 * i + j) for j, (nm, (n, k)) in enumerate(shapes.items())}
              for i in range(32)]
    xs = {nm: torch.randn(1, k, device=dev, dtype=DT) for nm, (n, k) in shapes.items()}
    ys = {nm: torch.empty(1, n, device=dev, dtype=DT) for nm, (n, k) in shapes.items()}

    def graph_of(pick):
        return graph_median_ms([lambda L=L, nm=nm, c=pick(nm): W.launch(xs[nm], L[nm], 128, c, out=ys[nm])
                                for L in layers for nm in shapes])

    t_best = graph_of(lambda nm: best[shapes[nm]])
    t_rule = graph_of(lambda nm: W.heuristic_gemv_cuda_config(*shapes[nm], 128))
    t_h2 = graph_of(lambda nm: h2_pick[shapes[nm]])
    dense = [{nm: torch.randn(n, k, device=dev, dtype=DT) * 0.02 for nm, (n, k) in shapes.items()}
             for _ in range(32)]
    t_cub = graph_median_ms([lambda D=D, nm=nm: torch.mm(xs[nm], D[nm].t(), out=ys[nm]) for D in dense
                             for nm in shapes])
    del dense
    int4 = sum(n * k / 2 + n * k / 128 * 3 for n, k in shapes.values()) * 32
    res["step"][model] = dict(best=t_best, rule=t_rule, half2=t_h2, cublas=t_cub, int4_bytes=int4)
    log(f"{model} step graph M=1 (32 x 4 linears): cuda best {t_best:.3f} ms ({int4 / t_best / 1e9:.2f} TB/s), "
        f"cuda rule {t_rule:.3f}, half2 {t_h2:.3f} ({int4 / t_h2 / 1e9:.2f} TB/s), cuBLAS fp16 {t_cub:.3f}")
    torch.cuda.empty_cache()

# the table this run proposes: the best CUDA config for each swept 7B shape (every swept shape with
# --all-shapes-in-table) where it beat the half2 GEMV
for (n, k), c in best.items():
    sw = next(v for v in res["sweep"].values() if (v["n"], v["k"]) == (n, k))
    if (n, k) not in MODELS["llava-1.5-7b"].values() and "--all-shapes-in-table" not in args:
        continue
    ours, theirs = ((sw["behind_norm"][0][1], sw["half2_behind_norm"][1]) if "behind_norm" in sw
                    else (sw["top"][0][1], sw["half2"][1]))
    if ours < theirs:
        W.set_config(1, n, k, 128, DT, c, dev)
    else:  # no CUDA entry: the half2 GEMV's entry answers
        W._TUNED_CUDA.pop((W._device_name(dev), 1, n, k, 128, "float16"), None)
W.save_tuned(os.path.join(OUT, "w4a16_tuned.json"))
json.dump(res, open(os.path.join(OUT, "gemv_cuda.json"), "w"), indent=1)
log("done")
