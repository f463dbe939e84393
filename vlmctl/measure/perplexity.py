"""Perplexity of a causal LM over consecutive windows of a token stream.

The protocol is the common WikiText one (AutoAWQ's and GPTQ's evaluation): cut the tokenized
text into non-overlapping windows of `seq_len` tokens, score every token after the first of each
window given the ones before it, and report exp(mean negative log-likelihood).

`perplexity` takes any `logits_fn(ids[B, T]) -> logits[B, T, V]`; `load_logits_fn` builds one for
a float or AWQ checkpoint, a workspace or an engine directory using vlmctl's own torch decoder.
Not here: the calibration and evaluation text (quant/calibration.py).
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from ..errors import CheckpointError, InputError, OptionError
from ..formats.awq_gemm import quantization_method
from ..formats.torch_layout import is_layout
from ..formats.workdir import QUANTIZED, WORKDIR, WORKSPACE, WorkDir, Workspace, classify, has_tokenizer
from ..progress import Progress, ensure


def perplexity(logits_fn: Callable, token_ids, seq_len: int, samples: int | None = None, batch_size: int = 1,
               progress: Progress | None = None) -> float:
    """exp(mean NLL) over the first `samples` windows of `seq_len` tokens (all windows when None)."""
    import torch
    import torch.nn.functional as F

    progress = ensure(progress)
    token_ids = torch.as_tensor(token_ids).view(-1)
    available = token_ids.numel() // seq_len
    if available == 0:
        raise InputError(f"evaluation text has {token_ids.numel()} tokens, fewer than one window of {seq_len}")
    n = available if samples is None else min(samples, available)
    if samples is not None and samples > available:
        progress.log(f"evaluation text holds only {available} windows of {seq_len} tokens (asked for {samples})")
    windows = token_ids[: n * seq_len].view(n, seq_len)
    total_nll, count = 0.0, 0
    task = progress.task("perplexity", total=n)
    with torch.inference_mode():
        for start in range(0, n, batch_size):
            batch = windows[start:start + batch_size]
            logits = logits_fn(batch).float()
            targets = batch[:, 1:].reshape(-1).to(logits.device)  # the model may run on a GPU
            nll = F.cross_entropy(logits[:, :-1].reshape(-1, logits.shape[-1]), targets, reduction="sum")
            total_nll += float(nll)
            count += batch[:, 1:].numel()
            task.advance(batch.shape[0])
    task.done()
    nll = total_nll / count
    # a NaN or an overflow here is no figure: exp() of it would be NaN (invalid in --json) or raise OverflowError
    if not math.isfinite(nll):
        raise CheckpointError("the model's logits are not finite (NaN or infinity): its weights are broken, or its "
                              "activations overflow the compute dtype (float16 ends at 65504)")
    try:
        return math.exp(nll)
    except OverflowError:
        raise CheckpointError(f"mean negative log-likelihood {nll:.1f} nats per token: the perplexity, e^{nll:.1f}, "
                              "is beyond any float (the model is broken)") from None


def find_decoder_dir(model: Path) -> tuple[Path, Path]:
    """(directory the decoder loads from, directory holding its tokenizer) for any accepted input.

    Accepted (`formats.workdir.classify`): an engine / work directory (its build-llm/ torch layout,
    else quantize/llm, else convert/llm), a conversion workspace or quantize output (its llm/), or a
    Hugging Face causal-LM or VLM directory (float or AWQ GEMM).
    """
    model = Path(model)
    if not model.is_dir():  # README: a missing directory is a checkpoint problem (exit 3), as convert says
        raise CheckpointError(f"{model}: no such model directory")
    kind = classify(model)
    if kind == WORKDIR:
        wd = WorkDir(model)
        processor = wd.convert.processor
        if wd.llm_config.exists() and is_layout(json.loads(wd.llm_config.read_text())):
            return wd.build_llm, processor
        for d in (wd.quantize.llm, wd.convert.llm):
            if (d / "config.json").exists():
                return d, d if has_tokenizer(d) else processor
        raise CheckpointError(f"{model}: this work directory has no decoder yet (build-llm/, quantize/llm or "
                              "convert/llm)")
    if kind in (WORKSPACE, QUANTIZED):
        d = Workspace(model).llm
        return d, d if has_tokenizer(d) else Workspace(model).processor
    return model, model


def _is_whole_vlm(cfg: dict) -> bool:
    """A config.json of a whole VLM (a registered family's architecture), not of a plain decoder."""
    from ..models.decoders import is_decoder_config
    from ..models.registry import detect_family

    if is_decoder_config(cfg):
        return False
    detect_family(cfg)  # UnsupportedModelError (exit 4) for anything else
    return True


def load_logits_fn(model: Path, dtype: str | None = None, device: str = "cpu",
                   kv_cache_dtype: str = "auto") -> tuple[Callable, Path, dict]:
    """(logits_fn, tokenizer directory, description) for `model` (see `find_decoder_dir`).

    `dtype` is the compute dtype of a Hugging Face directory (default float32). An engine's decoder runs in
    the dtype it was built in: another `dtype` is refused (OptionError), not silently ignored.
    `kv_cache_dtype` "fp8" / "int8": attention reads K/V as an 8-bit pool stores them (runtime/kv_quant.py), as
    serving with that `--kv-cache-dtype` does."""
    from ..runtime.decoder import TorchDecoder
    from ..runtime.kv_quant import check_kv_cache_dtype

    check_kv_cache_dtype(kv_cache_dtype)

    d, tok_dir = find_decoder_dir(model)
    cfg = json.loads((d / "config.json").read_text())
    if is_layout(cfg):
        built = cfg.get("dtype")
        if dtype is not None and dtype != built:
            raise OptionError(f"--dtype {dtype}: {model} is an engine built in {built}; --dtype applies to Hugging "
                              "Face directories only (drop it, or rebuild the engine with --set dtype=...)")
        dec = TorchDecoder.load(d, device=device, max_seq=16)
        kind = "engine"
        quant = (cfg.get("decoder", {}).get("quantization") or {}).get("method", "none")
    elif _is_whole_vlm(cfg):  # e.g. the vlm/ checkpoint `vlmctl quantize` writes: score its decoder
        from ..convert import read_vlm_decoder

        text_cfg, tensors = read_vlm_decoder(d)
        dec = TorchDecoder.from_hf_tensors(text_cfg, tensors, dtype=dtype or "float32", device=device, max_seq=16)
        quant = quantization_method(text_cfg) or "none"
        kind = "hf-vlm"
    else:
        dec = TorchDecoder.from_hf_dir(d, dtype=dtype or "float32", device=device, max_seq=16)
        quant = quantization_method(cfg) or "none"
        kind = "hf"
    if not has_tokenizer(tok_dir):
        raise CheckpointError(f"{model}: no tokenizer found (looked in {tok_dir})")
    dec.kv_cache_dtype = kv_cache_dtype
    return dec.logits, tok_dir, {"kind": kind, "decoder_dir": str(d), "quantization": quant,
                                 "kv_cache_dtype": kv_cache_dtype, "max_positions": dec.spec.max_position_embeddings}


def evaluate_perplexity(model: Path, data: str, seq_len: int = 512, samples: int | None = None,
                        dtype: str | None = None, device: str = "cpu", base_dir: Path | None = None,
                        progress: Progress | None = None, kv_cache_dtype: str = "auto") -> dict:
    """Library entry point of `vlmctl eval ppl`. `dtype`, `kv_cache_dtype`: as `load_logits_fn` takes them."""
    from transformers import AutoTokenizer

    from ..quant.calibration import load_eval_tokens

    logits_fn, tok_dir, info = load_logits_fn(model, dtype=dtype, device=device, kv_cache_dtype=kv_cache_dtype)
    most = info.pop("max_positions")
    if seq_len > most:  # positions past the model's own have no rotary angle (and were never trained)
        raise OptionError(f"--seq-len {seq_len}: longer than this model's {most} positions "
                          "(max_position_embeddings)")
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = load_eval_tokens(data, tokenizer, base_dir)
    n_windows = ids.numel() // seq_len if samples is None else min(samples, ids.numel() // seq_len)
    ppl = perplexity(logits_fn, ids, seq_len, samples, progress=progress)
    return {"perplexity": ppl, "model": str(model), "data": data, "seq_len": seq_len, "samples": n_windows,
            "tokens": n_windows * (seq_len - 1), **info}
