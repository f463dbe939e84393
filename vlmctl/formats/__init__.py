"""On-disk contracts, one module each: what a directory or file holds and how it is written and read.

workdir (the work/engine directory: every stage path, `classify`), artifacts (stage manifests,
hashing, atomic publication, verification), awq_gemm (AutoAWQ GEMM checkpoints), w4a16 (the W4A16
kernels' packed layout), torch_layout (the embedded decoder's engine layout), trtllm_engine (the
TensorRT-LLM decoder's record), prompt_table (the fake-id contract), triton_config (config.pbtxt).

This floor imports only the bottom one (`vlmctl.errors`, `vlmctl.progress`, `vlmctl.checkpoint`, the
version); stage bodies, the runtime and the CLI all read and write these formats through it.
"""
