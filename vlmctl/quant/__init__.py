"""The quantize stage body: AWQ of the language part. awq_math.py (arithmetic and searches),
awq_layer.py (one decoder layer), awq.py (a whole decoder), awq_vlm.py (workspaces, the whole-VLM
checkpoint, every accepted source), calibration.py and vlm_calibration.py (text and image-text
calibration data), autoawq_impl.py (the `autoawq` package instead of vlmctl's AWQ).

The AutoAWQ GEMM format itself is formats/awq_gemm.py. Submodules import torch lazily; importing
this package is cheap.
"""
