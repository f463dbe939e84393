"""GPU kernels of the embedded runtime (Triton), each with a torch reference in `vlmctl.runtime.ops`.

Importing this package imports nothing heavy; each kernel module imports triton itself and is
loaded only on a CUDA device (or by tests under `TRITON_INTERPRET=1`).
"""
