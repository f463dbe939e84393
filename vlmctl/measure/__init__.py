"""Measurements of built models: perplexity (`vlmctl eval ppl`) and serving benchmarks (`vlmctl bench`).

They sit above the runtime and the stage bodies and below the CLI; torch and the engine are imported
inside functions, so importing this package is cheap.
"""
