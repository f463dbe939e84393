"""Where the "wgmma" W4A16 kernel's time goes (one sm_90 GPU): per-call times of shapes that isolate its parts.

    python benchmarks/w4a16_wgmma_probe.py [--layout | --tma [--pfix] | --modes | --ncu | --ncu-unit]

Default (session 15):
- one tile per block: N = 132 x 256 rows, K = 4096 (32 units a block, no stream-K parts), so time / 32 is the
  main loop's time per unit; the same with K = 1024 and 16384 gives the fixed cost per launch by difference;
- the 7B qkv shape (12288 x 4096) at M = 64 for comparison (11.6 units a block, parts on every tile).
- the one-tile-per-block shape again, built with W4A16_WGMMA_MODE 1 (no wgmma issued), 2 (no
  dequantization), 3 (no proxy fence), 4 (no x copies) and 5 (no weight copies): what the loop costs
  without each.
--layout (session 16): the one-tile-per-block shape at K = 4096 and 16384 as built, with the weights repacked
  unit-contiguous (mode 6, results checked equal), without copies (7), with L2-resident weights (8), without
  copies or wgmma (10), without copies or dequantization (11); then the decoder's four linears at M = 64 as
  built, without the stream-K fix-up (9) and without copies (7), against cuBLAS on the dense weight.
--tma (session 16): the kernel as built (W4A16_WGMMA_TMA 1: TMA copies) against the cp.async build and the
  shipped selection: correctness, per call, and the 128 linears of a step as one graph at M = 64 and 32;
  with --pfix also the build with the parallel stream-K fix-up (W4A16_WGMMA_PFIX 1).
--modes (session 17): the TMA build's loop on the one-tile-a-block shape without its block barrier, its scale loads
  and stores, and the wgmmas or the dequantization (W4A16_WGMMA_MODE 12-16), and with a 6-deep ring; the
  barrier-free pipeline build (W4A16_WGMMA_PIPE 1): checked bit-equal to the default build, per call and a step's
  128 linears as one graph, each with the serial and the parallel fix-up.
--ncu: launches one qkv call for Nsight Compute to catch (kernel name w4a16_wgmma), and nothing else.
--ncu-unit: one launch of the one-tile-per-block shape (K = 16384), for Nsight Compute's source view.
"""
import os
import sys

sys.path.insert(0, os.path.dirname(os.path.dirname(os.path.abspath(__file__))))
import torch  # noqa: E402

from gpu_timing import graph_median_ms as time_graph  # noqa: E402
from gpu_weights import random_packed  # noqa: E402
from vlmctl.runtime.kernels import w4a16 as W  # noqa: E402

dev = torch.device("cuda")
sms = torch.cuda.get_device_properties(0).multi_processor_count


def cfg(nwg, bm, stages):
    return W.Config("wgmma", block_n=64 * nwg, block_k=128, block_m=bm, split_k=1, num_warps=4 * nwg,
                    num_stages=stages)


if "--ncu" in sys.argv:
    p = random_packed(12288, 4096, 128, 0)
    x = torch.randn(64, 4096, device=dev, dtype=torch.float16)
    for c in (cfg(4, 64, 6), cfg(4, 64, 5), cfg(2, 64, 5)):
        W.launch(x, p, 128, c)
    torch.cuda.synchronize()
    sys.exit(0)

from vlmctl.runtime.kernels import cuda_rtc  # noqa: E402


def cp_async_shared_bytes(c, g=128):
    """Dynamic shared memory of the cp.async build (W4A16_WGMMA_TMA 0): padded 20-word weight rows."""
    return c.num_stages * (c.block_m * 256 + c.block_n * 80 + c.block_n * max(1, 128 // g) * 4)


def launch_mode(mode, x, p, c, y, smem=None):
    """(kernel, grid, block, shared bytes, args) of config c in the cp.async build (W4A16_WGMMA_TMA 0, the
    session-15 kernel) in measurement mode `mode` (wrong results but for 0, and 6 on a unit-contiguous tensor)."""
    m, k = x.shape
    n = p["q4weight"].shape[0]
    kern = cuda_rtc.load_kernel(f"#define W4A16_WGMMA_TMA 0\n#define W4A16_WGMMA_MODE {mode}\n" + W.wgmma_source(),
                                W.wgmma_kernel_name(c, 128, x.dtype), dev, arch_suffix="a")
    tiles = -(-n // c.block_n)
    blocks = min(tiles * (k // 128), sms)
    ws = torch.empty(blocks * 2 * c.block_n * c.block_m, device=dev)
    cnt = torch.zeros(tiles, device=dev, dtype=torch.int32)
    return kern, (blocks, 1, 1), (32 * c.num_warps, 1, 1), smem or cp_async_shared_bytes(c), \
        [x, p["q4weight"], p["q4scales"], p["q4zeros"], None, y, ws, cnt, m, n, k, x.stride(0), 0]


def unit_contiguous(p, bn):
    """p's packed weights as qw[tile][unit][bn rows][16 words] (mode 6's layout); N a multiple of bn."""
    q = p["q4weight"]
    n, kw = q.shape
    return dict(p, q4weight=q.view(n // bn, bn, kw // 16, 16).permute(0, 2, 1, 3).contiguous().view(n, kw))


if "--ncu-unit" in sys.argv:  # one launch of the one-tile-per-block shape (K = 16384) for Nsight Compute's source view
    c = cfg(4, 64, 5)
    p = random_packed(sms * c.block_n, 16384, 128, 0)
    x = torch.randn(64, 16384, device=dev, dtype=torch.float16)
    W.launch(x, p, 128, c)
    torch.cuda.synchronize()
    sys.exit(0)

def pfix_call(x, p, c, g, y, mode=0, pfix=1, pipe=0):
    """A launch (a callable) of config c in the TMA build: with the parallel stream-K fix-up (W4A16_WGMMA_PFIX 1,
    launched cooperatively with two counters a tile) unless pfix=0, in measurement mode `mode`, with the
    barrier-free pipeline (W4A16_WGMMA_PIPE) if pipe=1."""
    m, k = x.shape
    n = p["q4weight"].shape[0]
    kern = cuda_rtc.load_kernel(f"#define W4A16_WGMMA_PFIX {pfix}\n#define W4A16_WGMMA_MODE {mode}\n"
                                f"#define W4A16_WGMMA_PIPE {pipe}\n" + W.wgmma_source(),
                                W.wgmma_kernel_name(c, g, x.dtype), dev, arch_suffix="a")
    tiles = -(-n // c.block_n)
    blocks = min(tiles * (k // 128), sms)
    ws = torch.empty(blocks * 2 * c.block_n * c.block_m, device=dev)
    cnt = torch.zeros(2 * tiles, device=dev, dtype=torch.int32)
    tmx, tmw = W.wgmma_tensor_maps(x, p["q4weight"], c)
    args = [x, p["q4weight"], p["q4scales"], p["q4zeros"], None, y, ws, cnt, m, n, k, x.stride(0), 0, tmx, tmw]
    return lambda: kern.launch((blocks, 1, 1), (32 * c.num_warps, 1, 1), W.wgmma_shared_bytes(c, g), args, dev,
                               cooperative=bool(pfix))


if "--modes" in sys.argv:
    # session 17: the TMA build's loop without its parts (results wrong but in mode 0): one tile a block, K = 16384
    # (128 units a block), so time / 128 is the loop's time a unit
    names = {0: "as built", 1: "no wgmma", 2: "no dequantization", 12: "no block barrier a unit",
             13: "no scale loads/stores in the loop", 14: "neither barrier nor scales",
             15: "neither, and no wgmma", 16: "neither, and no dequantization"}
    k = 16384
    for m in (64, 32):
        for c in (cfg(4, m, 5), cfg(4, m, 6)):
            n = sms * c.block_n
            ps = [random_packed(n, k, 128, i) for i in range(4)]
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            y = torch.empty(m, n, device=dev, dtype=torch.float16)
            for mode in names if c.num_stages == 5 else (0,):
                for pfix in (0, 1) if mode == 0 else (0,):
                    t = time_graph([pfix_call(x, p, c, 128, y, mode, pfix) for p in ps]) * 1e3 / 4
                    print(f"M {m} {W.describe(c)} mode {mode:2d} ({names[mode]}{', parallel fix-up build' if pfix else ''}):"
                          f" {t:7.1f} us, {t / 128:5.3f} us a unit", flush=True)
            if c.num_stages == 5:  # the barrier-free pipeline (W4A16_WGMMA_PIPE 1), serial and parallel fix-up
                for pfix in (0, 1):
                    t = time_graph([pfix_call(x, p, c, 128, y, 0, pfix, 1) for p in ps]) * 1e3 / 4
                    print(f"M {m} {W.describe(c)} pipeline build{', parallel fix-up' if pfix else ''}: {t:7.1f} us, "
                          f"{t / 128:5.3f} us a unit", flush=True)
    # the pipeline build: bit-equal to the default build (same sums in the same order), per call and the step graph
    bad = 0
    for (n, k), g, dt in (((12288, 4096), 128, torch.float16), ((4096, 11008), 128, torch.float16),
                          ((1000, 384), 128, torch.float16), ((4096, 4096), 64, torch.bfloat16),
                          ((22016, 4096), 128, torch.bfloat16)):
        p = random_packed(n, k, g, 3)
        ref_w = W.dequantize(p, g, torch.float32)
        for m in (64, 37, 17):
            c = W.heuristic_wgmma_config(m)
            x = torch.randn(m, k, device=dev, dtype=dt)
            ys = []
            for pfix, pipe in ((0, 0), (0, 1), (1, 1)):
                y = torch.empty(m, n, device=dev, dtype=dt)
                f = pfix_call(x, p, c, g, y, 0, pfix, pipe)
                f()
                f()  # twice: the counters must be left zero
                ys.append(y)
            torch.cuda.synchronize()
            ref = x.float() @ ref_w.t()
            err = ((ys[1].float() - ref).norm() / ref.norm()).item()
            same = [bool(torch.equal(ys[0], v)) for v in ys[1:]]
            bad += not all(same)
            print(f"pipeline check N {n:5d} K {k:5d} g {g} {str(dt)[6:]} M {m}: rel err {err:.2e}, equal to the "
                  f"default build (serial / parallel fix-up) {same}", flush=True)
    print(f"pipeline correctness: {bad} bad", flush=True)
    shapes = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
    for m in (64, 32):
        c = W.heuristic_wgmma_config(m)
        for name, (n, k) in shapes.items():
            ps8 = [random_packed(n, k, 128, i) for i in range(8)]
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            y = torch.empty(m, n, device=dev, dtype=torch.float16)
            row = [time_graph([pfix_call(x, p, c, 128, y, 0, pfix, pipe) for p in ps8]) * 1e3 / 8
                   for pfix, pipe in ((0, 0), (1, 0), (0, 1), (1, 1))]
            shipped = W.select_config(m, n, k, 128, torch.float16, dev)
            t_ship = time_graph([lambda p=p: W.launch(x, p, 128, shipped, out=y) for p in ps8]) * 1e3 / 8
            print(f"{name:8s} M {m}: default build {row[0]:6.1f} us, parallel fix-up {row[1]:6.1f}, pipeline "
                  f"{row[2]:6.1f}, pipeline + parallel fix-up {row[3]:6.1f} | selection {t_ship:6.1f} "
                  f"({W.describe(shipped)})", flush=True)
        layers = [{nm: random_packed(n, k, 128, 1000 * i + j) for j, (nm, (n, k)) in enumerate(shapes.items())}
                  for i in range(32)]
        xs = {nm: torch.randn(m, k, device=dev, dtype=torch.float16) for nm, (n, k) in shapes.items()}
        ys = {nm: torch.empty(m, n, device=dev, dtype=torch.float16) for nm, (n, k) in shapes.items()}
        res = []
        for pfix, pipe in ((0, 0), (1, 0), (0, 1), (1, 1)):
            res.append(time_graph([pfix_call(xs[nm], L[nm], c, 128, ys[nm], 0, pfix, pipe)
                                   for L in layers for nm in shapes]))
        fs = [lambda L=L, nm=nm, cs=W.select_config(m, *shapes[nm], 128, torch.float16, dev):
              W.launch(xs[nm], L[nm], 128, cs, out=ys[nm]) for L in layers for nm in shapes]
        dense = {nm: torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02 for nm, (n, k) in shapes.items()}
        fc = [lambda nm=nm: torch.mm(xs[nm], dense[nm].t(), out=ys[nm]) for _ in range(32) for nm in shapes]
        print(f"step graph M {m}: default build {res[0]:.3f} ms, parallel fix-up {res[1]:.3f}, pipeline {res[2]:.3f}, "
              f"pipeline + parallel fix-up {res[3]:.3f} | selection {time_graph(fs):.3f}, cuBLAS fp16 dense (one "
              f"weight set) {time_graph(fc):.3f}", flush=True)
        del layers
    sys.exit(0)


if "--tma" in sys.argv:
    # the kernel as built (TMA) against the session-15 cp.async build and the shipped selection (--pfix: and the
    # parallel fix-up build):
    # correctness against the fp32 reference and the cp.async build, per-call times, the step graph at M = 64.
    shapes = {"qkv": (12288, 4096), "o": (4096, 4096), "gate_up": (22016, 4096), "down": (4096, 11008)}
    bad = 0
    for (n, k), g, dt in (((sms * 256, 4096), 128, torch.float16), ((12288, 4096), 128, torch.float16),
                          ((4096, 11008), 128, torch.float16), ((1000, 384), 128, torch.float16),
                          ((12288, 4096), 64, torch.bfloat16), ((4096, 11008), 128, torch.bfloat16)):
        p = random_packed(n, k, g, 7)
        ref_w = W.dequantize(p, g, torch.float32)
        for m in (64, 37, 32, 17):
            c = W.heuristic_wgmma_config(m)
            x = torch.randn(m, k, device=dev, dtype=dt)
            y = torch.empty(m, n, device=dev, dtype=dt)
            W.launch(x, p, g, c, out=y)
            y2 = torch.empty_like(y)
            if g == 128:  # the cp.async build's launch here takes group 128
                a = launch_mode(0, x, p, c, y2)
                a[0].launch(*a[1:], dev)
            else:
                y2.copy_(y)
            yp = torch.empty_like(y)
            if "--pfix" in sys.argv:
                pfix_call(x, p, c, g, yp)()
            torch.cuda.synchronize()
            ref = x.float() @ ref_w.t()
            err = ((y.float() - ref).norm() / ref.norm()).item()
            same = bool(torch.equal(y, y2))
            ok = err < (2e-3 if dt == torch.float16 else 8e-3)
            bad += not ok
            pf = f", parallel fix-up equal {bool(torch.equal(yp, y))}" if "--pfix" in sys.argv else ""
            bad += "--pfix" in sys.argv and not torch.equal(yp, y)
            print(f"check N {n:6d} K {k:6d} g {g:3d} {str(dt)[6:]:8s} M {m:2d}: rel err {err:.2e}, "
                  f"equal to cp.async build {same}{pf}{'' if ok else '  BAD'}", flush=True)
    print(f"correctness: {bad} bad", flush=True)
    for name, (n, k) in [("one tile a block", (sms * 256, 16384))] + list(shapes.items()):
        ps8 = [random_packed(n, k, 128, i) for i in range(8)]
        for m in (64, 32):
            c = W.heuristic_wgmma_config(m)
            x = torch.randn(m, k, device=dev, dtype=torch.float16)
            y = torch.empty(m, n, device=dev, dtype=torch.float16)
            calls = [launch_mode(0, x, p, c, y) for p in ps8]
            t_tma = time_graph([lambda p=p: W.launch(x, p, 128, c, out=y) for p in ps8]) * 1e3 / 8
            t_cpa = time_graph([lambda a=a: a[0].launch(*a[1:], dev) for a in calls]) * 1e3 / 8
            shipped = W.select_config(m, n, k, 128, torch.float16, dev)
            t_ship = time_graph([lambda p=p: W.launch(x, p, 128, shipped, out=y) for p in ps8]) * 1e3 / 8
            if "--pfix" in sys.argv:
                t_pf = time_graph([pfix_call(x, p, c, 128, y) for p in ps8]) * 1e3 / 8
                t_ship = f"{t_ship:6.1f}, TMA + parallel fix-up {t_pf:6.1f}"
            else:
                t_ship = f"{t_ship:6.1f}"
            cut = (", no fix-up (cp.async build, mode 9) "
                   f"{time_graph([lambda a=a: a[0].launch(*a[1:], dev) for a in [launch_mode(9, x, p, c, y) for p in ps8]]) * 1e3 / 8:6.1f}")
            print(f"{name:16s} M {m}: TMA {t_tma:6.1f} us, cp.async {t_cpa:6.1f}, shipped {t_ship} "
                  f"({W.describe(shipped)}){cut}", flush=True)
    for m in (64, 32):
        layers = [{nm: random_packed(n, k, 128, 1000 * i + j) for j, (nm, (n, k)) in enumerate(shapes.items())}
                  for i in range(32)]
        xs = {nm: torch.randn(m, k, device=dev, dtype=torch.float16) for nm, (n, k) in shapes.items()}
        ys = {nm: torch.empty(m, n, device=dev, dtype=torch.float16) for nm, (n, k) in shapes.items()}
        c = W.heuristic_wgmma_config(m)
        ft, fs, fc, fp = [], [], [], []
        for L in layers:
            for nm, (n, k) in shapes.items():
                ft.append(lambda L=L, nm=nm: W.launch(xs[nm], L[nm], 128, c, out=ys[nm]))
                if "--pfix" in sys.argv:
                    fp.append(pfix_call(xs[nm], L[nm], c, 128, ys[nm]))
                cs = W.select_config(m, n, k, 128, torch.float16, dev)
                fs.append(lambda L=L, nm=nm, cs=cs: W.launch(xs[nm], L[nm], 128, cs, out=ys[nm]))
        dense = {nm: torch.randn(n, k, device=dev, dtype=torch.float16) * 0.02 for nm, (n, k) in shapes.items()}
        fc = [lambda nm=nm: torch.mm(xs[nm], dense[nm].t(), out=ys[nm]) for _ in range(32) for nm in shapes]
        pf = f", TMA + parallel fix-up {time_graph(fp):.3f}" if fp else ""
        print(f"step graph M {m}: TMA {time_graph(ft):.3f} ms{pf}, shipped {time_graph(fs):.3f}, "
              f"cuBLAS fp16 dense (one weight set) {time_graph(fc):.3f}", flush=True)
        del layers
    sys.exit(0)

if "--layout" in sys.argv:
    # Does the weights' access pattern (64 bytes of each of 256 rows a unit, rows K / 2 bytes apart) bound the loop?
    # Mode 6 reads the same weights repacked unit-contiguous (16 KB a unit); mode 8 reads tile 0's in every block;
    # mode 7 copies nothing. (Session 16 also remapped the x pieces to conflict-free shared-memory writes, commit
    # f109b2c: no change, 2.32 vs 2.31-2.33 us a unit; not kept.)
    c = cfg(4, 64, 5)
    n = sms * c.block_n
    for k in (4096, 16384):
        ps = [random_packed(n, k, 128, i) for i in range(4)]
        pu = [unit_contiguous(p, c.block_n) for p in ps]
        x = torch.randn(64, k, device=dev, dtype=torch.float16)
        units = k // 128
        ref = None
        for name, mode, pp in (("full", 0, ps), ("unit-contiguous weights", 6, pu), ("no copies", 7, ps),
                               ("tile 0's weights (L2)", 8, ps), ("no copies, no wgmma", 10, ps),
                               ("no copies, no dequantization", 11, ps), ("full again", 0, ps)):
            y = torch.empty(64, n, device=dev, dtype=torch.float16)
            calls = [launch_mode(mode, x, p, c, y) for p in pp]
            calls[0][0].launch(*calls[0][1:], dev)
            torch.cuda.synchronize()
            if ref is None:
                ref = y.clone()
            same = "" if mode in (7, 8, 10, 11) else f", equal to full: {bool(torch.equal(y, ref))}"
            t = time_graph([lambda a=a: a[0].launch(*a[1:], dev) for a in calls]) * 1e3 / 4
            print(f"K {k:6d} {name:30s}: {t:7.1f} us, {t / units:5.2f} us a unit, "
                  f"{n * k / 2 / t / 1e6:.2f} TB/s int4{same}", flush=True)
    # the decoder's four linears at M = 64 (stream-K parts on most tiles): as built, without the parts' fix-up
    # (mode 9), without copies (7); the units a block runs say what the loop alone would take
    for name, n, k in (("qkv", 12288, 4096), ("o", 4096, 4096), ("gate_up", 22016, 4096), ("down", 4096, 11008)):
        ps4 = [random_packed(n, k, 128, i) for i in range(8)]
        x4 = torch.randn(64, k, device=dev, dtype=torch.float16)
        wd = W.dequantize(ps4[0], 128, torch.float16)
        y = torch.empty(64, n, device=dev, dtype=torch.float16)
        tc = time_graph([lambda: torch.mm(x4, wd.t(), out=y)]) * 1e3
        for c4 in (cfg(4, 64, 5), cfg(2, 64, 5)):
            units = -(-n // c4.block_n) * (k // 128) / min(sms, -(-n // c4.block_n) * (k // 128))
            row = []
            for mode in (0, 9, 7):
                calls = [launch_mode(mode, x4, p, c4, y) for p in ps4]
                row.append(time_graph([lambda a=a: a[0].launch(*a[1:], dev) for a in calls]) * 1e3 / len(calls))
            print(f"{name:8s} {W.describe(c4):22s} {units:5.1f} units a block: as built {row[0]:6.1f} us, "
                  f"no fix-up {row[1]:6.1f}, no copies {row[2]:6.1f} | cuBLAS dense {tc:6.1f}", flush=True)
    sys.exit(0)

c = cfg(4, 64, 5)
for mode in (0, 1, 2, 3, 4, 5):
    n, k = sms * c.block_n, 16384
    ps = [random_packed(n, k, 128, i) for i in range(4)]
    x = torch.randn(64, k, device=dev, dtype=torch.float16)
    y = torch.empty(64, n, device=dev, dtype=torch.float16)
    calls = [launch_mode(mode, x, p, c, y) for p in ps]
    t = time_graph([lambda a=a: a[0].launch(*a[1:], dev) for a in calls]) * 1e3 / 4
    print(f"mode {mode} ({['full', 'no wgmma', 'no dequantization', 'no proxy fence', 'no x copies', 'no weight copies'][mode]}) {W.describe(c)} N {n} K {k}: "
          f"{t:7.1f} us, {t / 128:5.2f} us a unit", flush=True)

# the same kernel with more dynamic shared memory than it uses: does the L1 left beside it matter?
for c, smem in ((cfg(4, 64, 5), None), (cfg(4, 64, 5), 227 * 1024), (cfg(2, 64, 5), None), (cfg(2, 64, 5), 110 * 1024),
                (cfg(2, 64, 5), 227 * 1024)):
    n, k = sms * c.block_n, 16384
    ps = [random_packed(n, k, 128, i) for i in range(4)]
    x = torch.randn(64, k, device=dev, dtype=torch.float16)
    y = torch.empty(64, n, device=dev, dtype=torch.float16)
    calls = [launch_mode(0, x, p, c, y, smem) for p in ps]
    t = time_graph([lambda a=a: a[0].launch(*a[1:], dev) for a in calls]) * 1e3 / 4
    print(f"{W.describe(c)} shared memory {calls[0][3] // 1024} KB: {t:7.1f} us, {t / 128:5.2f} us a unit", flush=True)

# the same weights every launch, small enough for L2 (17 MB int4): the loop without DRAM's access pattern
c = cfg(4, 64, 5)
n, k = sms * c.block_n, 1024
p = random_packed(n, k, 128, 0)
x = torch.randn(64, k, device=dev, dtype=torch.float16)
y = torch.empty(64, n, device=dev, dtype=torch.float16)
t = time_graph([lambda: W.launch(x, p, 128, c, out=y)] * 4) * 1e3 / 4
print(f"L2-resident weights {W.describe(c)} N {n} K {k}: {t:7.1f} us, {t / 8:5.2f} us a unit", flush=True)

for c in (cfg(4, 64, 5), cfg(4, 64, 6), cfg(2, 64, 5)):
    bn = c.block_n
    for n, k in ((sms * bn, 1024), (sms * bn, 4096), (sms * bn, 16384), (12288, 4096)):
        ps = [random_packed(n, k, 128, i) for i in range(4)]
        x = torch.randn(64, k, device=dev, dtype=torch.float16)
        y = torch.empty(64, n, device=dev, dtype=torch.float16)
        t = time_graph([lambda p=p: W.launch(x, p, 128, c, out=y) for p in ps]) * 1e3 / 4
        units = -(-n // bn) * (k // 128) / min(sms, -(-n // bn) * (k // 128))
        wd = W.dequantize(ps[0], 128, torch.float16)
        tc = time_graph([lambda: torch.mm(x, wd.t(), out=y)]) * 1e3
        print(f"{W.describe(c):34s} N {n:6d} K {k:6d}: {t:7.1f} us, {units:5.1f} units a block, "
              f"{t / units:5.2f} us a unit, {n * k / 2 / t / 1e6:.2f} TB/s int4 | cuBLAS dense {tc:6.1f} us", flush=True)
