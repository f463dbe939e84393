"""ONNX Runtime sessions configured the way vlmctl runs them (not an exporter, not a runner)."""

from __future__ import annotations

from pathlib import Path


def ort_session(path: Path, providers: list[str] | None = None):
    import onnxruntime as ort

    opts = ort.SessionOptions()
    opts.log_severity_level = 3
    # ONNX Runtime's idle threads spin by default; beside torch's decode threads that steals the
    # cores the decoder needs (measured: 4x slower chat on 2 cores).
    opts.add_session_config_entry("session.intra_op.allow_spinning", "0")
    opts.add_session_config_entry("session.inter_op.allow_spinning", "0")
    from ..host import configured_threads

    if configured_threads():  # the CLI's --threads (or its default) holds for ONNX Runtime too
        opts.intra_op_num_threads = configured_threads()
    avail = ort.get_available_providers()
    if providers is None:
        providers = [p for p in ("CUDAExecutionProvider", "CPUExecutionProvider") if p in avail]
    return ort.InferenceSession(str(path), sess_options=opts, providers=providers)


def ort_version() -> str | None:
    try:
        import onnxruntime
    except Exception:
        return None
    return onnxruntime.__version__
