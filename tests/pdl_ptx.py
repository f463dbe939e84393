"""Compile the decode step's Triton kernels for sm_90 (no GPU needed: Triton's bundled ptxas) with
programmatic dependent launch on, and report where each kernel's PTX waits for the previous kernel.
Run in a subprocess by tests/test_pdl.py, because the tests' interpreter mode (TRITON_INTERPRET=1)
turns @triton.jit functions into interpreted ones, which cannot be compiled.

    python tests/pdl_ptx.py    # one JSON object: kernel -> facts about its PTX
"""

from __future__ import annotations

import json
import os
import re
import sys
from pathlib import Path

sys.path.insert(0, str(Path(__file__).resolve().parents[1]))

POINTERS = {"qw_ptr": "*i32", "z_ptr": "*u8", "ws_ptr": "*fp32", "cnt_ptr": "*i32", "part_ptr": "*fp32",
            "ml_ptr": "*fp32", "bt_ptr": "*i32", "lens_ptr": "*i32", "pos_ptr": "*i32", "slot_ptr": "*i32",
            "cos_sin_ptr": "*fp32"}
FLOATS = {"eps", "scale_log2"}
_VARYING = {"stride_bt"}  # the block table's width varies from step to step: left unspecialized
FP8_POOL = {"k_ptr": "*fp8e4nv", "v_ptr": "*fp8e4nv", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}
INT8_POOL = {"k_ptr": "*i8", "v_ptr": "*i8", "ks_ptr": "*fp32", "vs_ptr": "*fp32"}


def kernels():
    from vlmctl.runtime.kernels import _gemv_triton, _w4a16_triton, fused, paged_attention

    w4 = dict(G=128, BN=32, BK=256, NGB=2, WPG=16, HAS_BIAS=False, EVEN_N=True)
    return {  # name: (kernel, constexprs, num_warps, whether it reads weights before the wait)
        "gemv_f16": (_gemv_triton._gemv_f16_kernel,
                     dict(BN=16, BK=256, HAS_BIAS=False, EVEN_K=True, SILU=False, PREFETCH=True, L2PF=2), 4, True),
        "gemv_f16_silu": (_gemv_triton._gemv_f16_kernel,
                          dict(BN=64, BK=128, HAS_BIAS=False, EVEN_K=True, SILU=True, PREFETCH=True, L2PF=2), 8, True),
        "gemv_w4a16": (_w4a16_triton._gemv_kernel, dict(w4, PREFETCH=True, L2PF=2), 2, True),
        "gemv_w4a16_h2": (_w4a16_triton._gemv_h2_kernel,
                          dict(w4, PREFETCH=True, RUNW=2, ASM=True, KMAJOR=True, L2PF=2), 2, True),
        "add_rms_norm": (fused._add_rms_norm_kernel, dict(HAS_RES=True, BLOCK=4096), 8, True),
        "act_mul": (fused._act_mul_kernel, dict(BLOCK=1024, ACT=0), 4, False),
        # the folded combine's counter atomics come after the wait
        "decode_rope": (paged_attention._decode_rope_kernel,
                        dict(HEAD_DIM=128, block_size=16, BLOCK_G=16, BLOCK_N=64, SPLIT=True, HAS_WINDOW=False,
                             COMBINE=True, BLOCK_S=32, QUANT=False), 4, False),
        # VLMCTL_ATTN_PREFETCH=1: the step's inputs read and the first tile's K/V rows asked of L2 before the wait
        "decode_rope_prefetch": (paged_attention._decode_rope_kernel,
                                 dict(HEAD_DIM=128, block_size=16, BLOCK_G=16, BLOCK_N=64, SPLIT=True,
                                      HAS_WINDOW=False, COMBINE=True, BLOCK_S=32, QUANT=False, PREFETCH=1,
                                      ROW_BYTES=256), 4, True),
        # VLMCTL_ATTN_EARLY_TILE=1: the first tile's K/V loaded into registers before the wait (16-bit and int8 pools)
        "decode_rope_early": (paged_attention._decode_rope_kernel,
                              dict(HEAD_DIM=128, block_size=16, BLOCK_G=16, BLOCK_N=64, SPLIT=True,
                                   HAS_WINDOW=False, COMBINE=True, BLOCK_S=32, QUANT=False, EARLY=True), 4, True),
        "decode_rope_int8_early": (paged_attention._decode_rope_kernel,
                                   dict(HEAD_DIM=128, block_size=16, BLOCK_G=16, BLOCK_N=128, SPLIT=True,
                                        HAS_WINDOW=False, COMBINE=True, BLOCK_S=32, QUANT=True, ASM=True,
                                        _pointers=INT8_POOL, _stages=1, EARLY=True), 4, True),
        # the 8-bit KV caches' variants (`--kv-cache-dtype fp8 | int8`) as an fp16 model runs them: 8-bit pools and
        # their float32 scales, tiles widened where they are loaded (ASM) in one pipeline stage; with
        # VLMCTL_ATTN_KV8_WIDEN=0 cast after shared memory in two (decode_rope_fp8_cast)
        "decode_rope_fp8_cast": (paged_attention._decode_rope_kernel,
                                 dict(HEAD_DIM=128, block_size=16, BLOCK_G=16, BLOCK_N=128, SPLIT=True,
                                      HAS_WINDOW=False, COMBINE=True, BLOCK_S=32, QUANT=True, ASM=False,
                                      _pointers=FP8_POOL), 4, False),
        "decode_rope_fp8": (paged_attention._decode_rope_kernel,
                            dict(HEAD_DIM=128, block_size=16, BLOCK_G=16, BLOCK_N=128, SPLIT=True, HAS_WINDOW=False,
                                 COMBINE=True, BLOCK_S=32, QUANT=True, ASM=True, _pointers=FP8_POOL, _stages=1),
                            4, False),
        "decode_rope_int8": (paged_attention._decode_rope_kernel,
                             dict(HEAD_DIM=128, block_size=16, BLOCK_G=16, BLOCK_N=128, SPLIT=True, HAS_WINDOW=False,
                                  COMBINE=True, BLOCK_S=32, QUANT=True, ASM=True, _pointers=INT8_POOL, _stages=1),
                             4, False),
        "rope_cache_fp8": (fused._rope_cache_kernel,
                           dict(HEAD_DIM=128, HALF=64, WRITE_CACHE=True, QUANT=True,
                                _pointers={"k_cache_ptr": "*fp8e4nv", "v_cache_ptr": "*fp8e4nv",
                                           "k_scale_ptr": "*fp32", "v_scale_ptr": "*fp32"}), 1, False),
        "combine": (paged_attention._combine_kernel, dict(HEAD_DIM=128, D_PAD=128, BLOCK_S=32), 4, False),
    }


def ptx_of(fn, constexprs: dict, num_warps: int) -> str:
    import triton
    from triton.backends.compiler import GPUTarget

    constexprs = dict(constexprs)
    pointers = {**POINTERS, **constexprs.pop("_pointers", {})}  # a kernel's own pointer types (fp8 pools)
    stages = constexprs.pop("_stages", 2)  # as the runtime launches it
    for prm in fn.params:  # compile-time switches a case leaves out take their defaults, as a launch's do
        if prm.is_constexpr and prm.name not in constexprs and prm.name != "PDL" and prm.has_default:
            constexprs[prm.name] = prm.default
    sig = {}
    for name in fn.arg_names:
        if name in constexprs or name in ("PDL",):
            sig[name] = "constexpr"
        elif name.endswith("_ptr"):
            sig[name] = pointers.get(name, "*fp16")
        else:
            sig[name] = "fp32" if name in FLOATS else "i32"
    names = list(sig)
    # as the runtime specializes them for an engine: pointers and the pools' and rows' strides divisible by 16
    # (without that, the kernels' K/V loads compile to 2-byte scalar loads and far more integer work)
    divisible = [a for a in sig if sig[a].startswith("*") or (a.startswith("stride_") and a not in _VARYING)]
    attrs = {(names.index(a),): [["tt.divisibility", 16]] for a in divisible}
    src = triton.compiler.ASTSource(fn=fn, signature=sig, constexprs=dict(constexprs), attrs=attrs)
    return triton.compile(src, target=GPUTarget("cuda", 90, 32),
                          options={"num_warps": num_warps, "num_stages": stages}).asm["ptx"]


def facts(ptx: str) -> dict:
    lines = [ln.strip() for ln in ptx.splitlines()]
    waits = [i for i, ln in enumerate(lines) if ln.startswith("griddepcontrol.wait")]
    before = lines[:waits[0]] if waits else []
    return {
        "waits": len(waits),
        "releases": sum(ln.startswith("griddepcontrol.launch_dependents") for ln in lines),
        # global memory only: shared-memory stores before the wait (layout changes of loaded tiles) are
        # private to the program
        "stores_before_wait": sum(bool(re.match(r"(@%p\d+ )?(st\.global|atom\.|red\.)", ln)) for ln in before),
        "loads_before_wait": sum(bool(re.match(r"(@%p\d+ )?ld\.global", ln)) for ln in before),
        "l2_prefetches_before_wait": sum("cp.async.bulk.prefetch.L2" in ln for ln in before),
        # tensor-core operands brought from shared memory as 16-bit tiles, and unpacked int8 converts
        "ldmatrix": sum(ln.startswith("ldmatrix") for ln in lines),
        "s8_converts": sum(bool(re.match(r"(@%p\d+ )?cvt\.\w+\.f16\.s8", ln)) for ln in lines),
    }


def main() -> None:
    # compiled, not interpreted: set before any kernel module is imported (tests/test_pdl.py imports
    # this module for `kernels` only, and must keep its interpreter mode)
    os.environ["TRITON_INTERPRET"] = "0"
    out = {}
    for name, (fn, cx, warps, _) in kernels().items():
        out[name] = {"pdl": facts(ptx_of(fn, dict(cx, PDL=True), warps)),
                     "no_pdl": facts(ptx_of(fn, dict(cx, PDL=False), warps))}
    print(json.dumps(out))


if __name__ == "__main__":
    main()
