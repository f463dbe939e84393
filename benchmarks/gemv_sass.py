"""SASS instructions per weight in the main loop of the batch-1 GEMV kernels, compiled for sm_90 on
any machine (no GPU: Triton's bundled ptxas and nvdisasm).

    python benchmarks/gemv_sass.py            # prints one line per (kernel, config)

Per thread, one K-loop iteration issues the counted instructions and covers block_n * block_k /
(32 * num_warps) weights; the count is their ratio. Pointers, K, N and row strides are compiled as
divisible by 16, as Triton's JIT specializes them at these shapes (so loads vectorize as on the GPU).
Kernels: the fp32-unpack W4A16 GEMV ("gemv"), the half2 W4A16 GEMV ("gemv_h2", inline PTX), and the
dense fp16 GEMV (with and without the SiLU·mul prologue). Loop = the largest backward branch's body.
"""

from __future__ import annotations

import os
import re
import subprocess
import sys
import tempfile
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

W4_SIG = {"x_ptr": "*fp16", "qw_ptr": "*i32", "s_ptr": "*fp16", "z_ptr": "*u8", "bias_ptr": "*fp16",
          "y_ptr": "*fp16", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32",
          "stride_xm": "i32", "SPLIT_K": "i32", "MAGIC": "i32", "MAGIC16": "i32"}
F16_SIG = {"x_ptr": "*fp16", "w_ptr": "*fp16", "bias_ptr": "*fp16", "y_ptr": "*fp16", "ws_ptr": "*fp32",
           "cnt_ptr": "*i32", "M": "i32", "N": "i32", "K": "i32", "stride_xm": "i32", "stride_wn": "i32",
           "SPLIT_K": "i32"}
CONFIGS = [  # (kernel, block_n, block_k, num_warps, prefetch, extra)
    ("gemv", 128, 64, 1, False, {}), ("gemv", 128, 64, 1, True, {}), ("gemv", 32, 256, 2, False, {}),
    ("gemv", 32, 256, 2, True, {}),
    ("gemv_h2", 64, 128, 1, False, {"RUNW": 2}), ("gemv_h2", 64, 128, 1, True, {"RUNW": 2}),
    ("gemv_h2", 128, 64, 1, False, {"RUNW": 2}), ("gemv_h2", 32, 256, 2, False, {"RUNW": 2}),
    ("gemv_h2", 64, 128, 1, False, {"RUNW": 1}),
    ("f16", 16, 256, 4, True, {"SILU": False}), ("f16", 16, 256, 4, True, {"SILU": True}),
    ("f16", 8, 512, 4, True, {"SILU": False}), ("f16", 32, 256, 4, False, {"SILU": False}),
]


def compile_sass(fn, signature: dict, constexprs: dict, num_warps: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    sig = dict(signature, **{k: "constexpr" for k in constexprs})
    names = list(sig)
    div16 = [a for a in signature if signature[a].startswith("*") or a in ("N", "K", "stride_xm", "stride_wn")]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in div16}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=constexprs, attrs=attrs)
    c = triton.compile(src, target=GPUTarget("cuda", 90, 32), options={"num_warps": num_warps, "num_stages": 1})
    nvdisasm = Path(triton.__file__).parent / "backends" / "nvidia" / "bin" / "nvdisasm"
    with tempfile.NamedTemporaryFile(suffix=".cubin", delete=False) as f:
        f.write(c.asm["cubin"])
    try:
        return subprocess.run([str(nvdisasm), "-c", f.name], capture_output=True, text=True, check=True).stdout
    finally:
        os.unlink(f.name)


def main_loop(sass: str) -> list[str]:
    ins, labels, loops = [], {}, []
    for line in sass.splitlines():
        m = re.match(r"\s*(\.L_x_\d+):", line)
        if m:
            labels[m.group(1)] = len(ins)
            continue
        m = re.match(r"\s*/\*([0-9a-f]{4,})\*/\s+(.*?);", line)
        if m:
            ins.append(m.group(2).strip())
    for i, text in enumerate(ins):
        m = re.search(r"BRA\s.*?(\.L_x_\d+)", text)
        if m and labels.get(m.group(1), i + 1) <= i:
            loops.append(ins[labels[m.group(1)]:i + 1])
    return max(loops, key=len)


def main() -> None:
    from vlmctl.runtime.kernels import _gemv_triton as GK
    from vlmctl.runtime.kernels import _w4a16_triton as K

    g = 128
    for kind, bn, bk, warps, prefetch, extra in CONFIGS:
        if kind == "f16":
            fn, sig = GK._gemv_f16_kernel, F16_SIG
            ce = dict(BN=bn, BK=bk, HAS_BIAS=False, EVEN_K=True, PREFETCH=prefetch, **extra)
        else:
            ngb, wpg = (bk // g, g // 8) if bk >= g else (1, bk // 8)
            fn, sig = (K._gemv_kernel if kind == "gemv" else K._gemv_h2_kernel), W4_SIG
            ce = dict(G=g, BN=bn, BK=bk, NGB=ngb, WPG=wpg, HAS_BIAS=False, EVEN_N=True, PREFETCH=prefetch, **extra)
            if kind == "gemv_h2":
                ce["ASM"] = True
        loop = main_loop(compile_sass(fn, sig, ce, warps))
        per_thread = bn * bk / (32 * warps)
        ex = " ".join(f"{k}={v}" for k, v in extra.items())
        print(f"{kind:8s} bn{bn:<4d} bk{bk:<4d} w{warps} {'prefetch' if prefetch else 'no-prefetch':11s} {ex:10s} "
              f"loop {len(loop):5d} instructions / {per_thread:5.0f} weights per thread = "
              f"{len(loop) / per_thread:.2f} per weight", flush=True)


if __name__ == "__main__":
    import warnings

    warnings.filterwarnings("ignore")
    main()
