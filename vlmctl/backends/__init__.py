"""Probes and sessions of optional native packages (ONNX Runtime, TensorRT, TensorRT-LLM).

What it is: the floor that both `export/` (stage bodies) and `runtime/` import from, so neither
reaches into the other for "is TensorRT here, which version, give me a session". Each module
imports its package lazily, inside functions.

What it is not: stage logic (engine builds live in `export/`) or serving logic (`runtime/`).
"""
