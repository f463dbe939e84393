"""`--impl autoawq`: quantize with the `autoawq` package instead of vlmctl's own AWQ.

For users who trust the original implementation. The output is the same AutoAWQ GEMM format;
the calibration blocks are vlmctl's (the same tokens vlmctl's quantizer would see), handed to
AutoAWQ as token lists so both implementations calibrate on identical data.

AutoAWQ 0.2.9 is deprecated upstream (last tested with torch 2.6 / transformers 4.51). Two things
are worked around here, both without changing its algorithm:
- it imports `datasets` at module level even when handed tokens; when `datasets` is absent a stub
  module stands in (its `load_dataset` raises, and is never called on this path);
- on the CPU its scale search corrupts the weights: `_compute_best_scale` backs the block's
  weights up with `{k: v.cpu() ...}`, which on a CPU tensor is the tensor itself, and then scales
  the weights in place. With `duo_scaling` (its default) the first candidate scale is not all
  ones, so every candidate is evaluated on, and the layer is left with, weights multiplied by
  that first scale: the quantized model is broken (perplexity > 1e5 on SmolLM2-135M). On a GPU
  `.cpu()` copies and the bug does not show. `quantize_with_autoawq` passes AutoAWQ a quantizer
  subclass (its `quantizer_cls` extension point) whose backup is a real copy.
"""

from __future__ import annotations

import json
import sys
import time
import types
from pathlib import Path

from ..errors import BackendUnavailableError, CheckpointError, UnsupportedModelError
from ..formats.awq_gemm import AwqGemmConfig, quantization_method
from ..progress import Progress, ensure

TESTED_VERSION = "0.2.9"


def _stub_datasets() -> None:
    try:
        import datasets  # noqa: F401
    except ImportError:
        mod = types.ModuleType("datasets")

        def load_dataset(*args, **kwargs):
            raise BackendUnavailableError("AutoAWQ asked for a Hugging Face dataset but `datasets` is not installed")

        mod.load_dataset = load_dataset
        sys.modules["datasets"] = mod


def import_autoawq():
    """The `awq` module, or a BackendUnavailableError saying how to get it."""
    import warnings

    _stub_datasets()
    try:
        with warnings.catch_warnings():  # its import prints a long deprecation notice
            warnings.simplefilter("ignore", DeprecationWarning)
            import awq
            from awq import AutoAWQForCausalLM  # noqa: F401
    except ImportError as e:
        raise BackendUnavailableError(f"--impl autoawq needs the `autoawq` package ({e}); "
                                      f"pip install 'vlmctl[autoawq]' (autoawq=={TESTED_VERSION})") from None
    return awq


def fixed_quantizer_cls():
    """AutoAWQ's AwqQuantizer with the CPU weight-backup aliasing fixed (see the module docstring)."""
    from awq.quantize.quantizer import AwqQuantizer

    class CopyingBackupQuantizer(AwqQuantizer):
        def _compute_best_scale(self, x, w_mean, x_mean, module2inspect, linears2scale, fp16_output, kwargs={}):
            live = module2inspect.state_dict
            module2inspect.state_dict = lambda *a, **k: {n: t.clone() for n, t in live(*a, **k).items()}
            try:
                return super()._compute_best_scale(x, w_mean, x_mean, module2inspect, linears2scale, fp16_output,
                                                   kwargs)
            finally:
                del module2inspect.state_dict

    return CopyingBackupQuantizer


def autoawq_version() -> str | None:
    try:
        from importlib.metadata import version

        return version("autoawq")
    except Exception:
        return None


def quantize_with_autoawq(src_dir: Path, out_dir: Path, settings, base_dir: Path | None = None,
                          progress: Progress | None = None, *, calib_ids=None, dtype: str = "float16",
                          fix_cpu_backup: bool = True) -> dict:
    """Run AutoAWQ on the plain causal LM in `src_dir`; write its GEMM checkpoint to `out_dir`.

    `dtype` is the dtype AutoAWQ loads the model in (its default, float16). `fix_cpu_backup=False`
    runs AutoAWQ's own quantizer unpatched (to reproduce its CPU behaviour).
    """
    import torch
    from transformers import AutoTokenizer

    from ..checkpoint import copy_side_files
    from ..host import peak_rss_mib
    from .calibration import load_calibration

    progress = ensure(progress)
    t0 = time.perf_counter()
    import_autoawq()
    from awq import AutoAWQForCausalLM

    src_dir, out_dir = Path(src_dir), Path(out_dir)
    base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
    cfg = json.loads((src_dir / "config.json").read_text())
    if quantization_method(cfg):
        raise CheckpointError(f"{src_dir}: already quantized; give a float checkpoint")
    from awq.models.auto import AWQ_CAUSAL_LM_MODEL_MAP

    if cfg.get("model_type") not in AWQ_CAUSAL_LM_MODEL_MAP:  # e.g. Gemma 3 (AutoAWQ 0.2.9 stops at Gemma 2)
        raise UnsupportedModelError(f"AutoAWQ {autoawq_version()} has no {cfg.get('model_type')!r} decoder; use "
                                    "quantization.impl: vlmctl")
    tokenizer = AutoTokenizer.from_pretrained(str(src_dir))
    cal = settings.calibration
    tokens = calib_ids if calib_ids is not None else load_calibration(cal.data, tokenizer, cal.samples, cal.seq_len,
                                                                     base_dir)
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    task = progress.task("awq (AutoAWQ): quantizing", total=None)
    model = AutoAWQForCausalLM.from_pretrained(str(src_dir), torch_dtype=getattr(torch, dtype), device_map=None)
    quant_config = {"zero_point": True, "q_group_size": settings.group_size, "w_bit": settings.bits, "version": "GEMM"}
    try:
        model.quantize(tokenizer, quant_config=quant_config, calib_data=tokens.tolist(),
                       max_calib_samples=tokens.shape[0], max_calib_seq_len=tokens.shape[1],
                       duo_scaling=settings.duo_scaling,
                       **({"quantizer_cls": fixed_quantizer_cls()} if fix_cpu_backup else {}))
    except AssertionError as e:  # AutoAWQ asserts on shapes it cannot take (its clip search: outputs in 64s)
        where = e.__traceback__
        while where.tb_next is not None:
            where = where.tb_next
        raise UnsupportedModelError(f"AutoAWQ {autoawq_version()} cannot quantize this model's shapes (its check at "
                                    f"{Path(where.tb_frame.f_code.co_filename).name}:{where.tb_lineno} failed); use "
                                    "quantization.impl: vlmctl") from None
    out_dir.mkdir(parents=True, exist_ok=True)
    model.save_quantized(str(out_dir))
    task.done()
    copy_side_files(src_dir, out_dir) if not (out_dir / "tokenizer_config.json").exists() else None
    saved = json.loads((out_dir / "config.json").read_text())
    try:
        written = AwqGemmConfig.from_config(saved, str(out_dir / "config.json"))
    except CheckpointError:
        written = None
    if written is None:
        raise CheckpointError(f"{out_dir}: AutoAWQ wrote an unexpected quantization_config "
                              f"{saved.get('quantization_config')}")
    return {
        "backend": "autoawq", "backend_version": autoawq_version(),
        "method": "awq", "impl": "autoawq", "bits": settings.bits, "group_size": settings.group_size,
        "zero_point": True, "duo_scaling": settings.duo_scaling, "autoawq_dtype": dtype,
        "autoawq_cpu_backup_fix": fix_cpu_backup,
        "calibration": {"data": cal.data if calib_ids is None else "(given tokens)", "samples": int(tokens.shape[0]),
                        "seq_len": int(tokens.shape[1])},
        "wall_s": round(time.perf_counter() - t0, 2),
        "peak_rss_mib": round(peak_rss_mib(), 1),
    }
