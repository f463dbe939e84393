"""GPU kernels of the embedded runtime, one module per kernel family; importing this package is free.

  w4a16   4-bit AWQ weights x fp16/bf16 activations: the packed on-device layout, the repack from
          AutoAWQ's GEMM layout, and the linear (Triton on CUDA, a torch reference elsewhere)

Each module imports torch and triton inside its functions, so CPU hosts without triton keep working.
"""
