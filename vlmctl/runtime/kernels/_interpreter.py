"""Fixes for two bf16 bugs of Triton's CPU interpreter (TRITON_INTERPRET=1), for tests and smoke runs only.

The interpreter keeps bf16 values as uint16 bit patterns; its tl.dot multiplies those patterns as
integers, and its float32 -> bf16 cast truncates instead of rounding to nearest even as compiled
Triton does on a GPU. `patch()` gives tl.dot floats and rounds the cast with torch. Nothing in the
runtime calls this; compiled kernels are unaffected.
"""

from __future__ import annotations

_PATCHED = False


def patch() -> None:
    global _PATCHED
    if _PATCHED:
        return
    import numpy as np
    import torch
    import triton.language as tl
    from triton.runtime import interpreter

    builder = interpreter.InterpreterBuilder
    dot, cast = builder.create_dot, builder.cast_impl

    def up(h):
        if h.dtype.scalar == tl.bfloat16 and h.data.dtype == np.uint16:
            f = interpreter._convert_float(h.data, tl.bfloat16, tl.float32, None).view(np.float32)
            return interpreter.TensorHandle(f, tl.float32)
        return h

    def fixed_dot(self, a, b, d, *args, **kw):
        return dot(self, up(a), up(b), d, *args, **kw)

    def fixed_cast(self, src, dst_type):
        if src.dtype.scalar == tl.float32 and dst_type.scalar == tl.bfloat16:
            rounded = torch.from_numpy(np.ascontiguousarray(src.data)).to(torch.bfloat16).view(torch.int16)
            return interpreter.TensorHandle(rounded.numpy().view(np.uint16), tl.bfloat16)
        return cast(self, src, dst_type)

    builder.create_dot = fixed_dot
    builder.cast_impl = fixed_cast  # float32 -> bf16 `.to()` reaches it through create_fp_trunc
    _PATCHED = True
