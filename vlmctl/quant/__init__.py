"""AWQ quantization of the language part: calibration data, scale and clip search, GEMM packing, perplexity.

Submodules import torch lazily; importing this package is cheap.
"""
