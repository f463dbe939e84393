"""Producers of deployable artifacts: ONNX vision export, TensorRT engines, TensorRT-LLM builds."""
