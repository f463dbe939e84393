"""GPU kernels of the embedded runtime (Triton), one module per kernel family; importing this package
is free. Each kernel has a torch reference that the CPU runs and the tests compare against.

  fused            residual add + RMSNorm, rotary + KV append, SiLU·mul (references: runtime.ops)
  paged_attention  decode attention over the paged KV cache, optionally with the new token's rotary
                   and KV append folded in (references: runtime.ops)
  gemv             dense GEMV for batch-1 decode (split-K in-kernel, optional SiLU·mul prologue),
                   used where the tuned table has the shape (w4a16.gemv_mode; reference: F.linear)
  w4a16            4-bit AWQ weights x fp16/bf16 activations: the packed on-device layout, the repack
                   from AutoAWQ's GEMM layout, and the linear (Triton on CUDA, a torch reference elsewhere)
  pdl              programmatic dependent launch of the step's kernels (sm_90+): the switch, the
                   wait / release helpers every step kernel calls, and the GEMVs' bulk L2 prefetch

Kernel modules import triton themselves and are loaded only on a CUDA device, or by tests under
`TRITON_INTERPRET=1`, so CPU hosts without triton keep working.
"""
