"""Perplexity of a causal LM over consecutive windows of a token stream.

The protocol is the common WikiText one (AutoAWQ's and GPTQ's evaluation): cut the tokenized
text into non-overlapping windows of `seq_len` tokens, score every token after the first of each
window given the ones before it, and report exp(mean negative log-likelihood).

`perplexity` takes any `logits_fn(ids[B, T]) -> logits[B, T, V]`; `load_logits_fn` builds one for
a float or AWQ checkpoint, a workspace or an engine directory using vlmctl's own torch decoder.
"""

from __future__ import annotations

import json
import math
from pathlib import Path
from typing import Callable

from ..errors import CheckpointError, InputError
from ..progress import Progress, ensure
from ..formats.torch_layout import FORMAT as LAYOUT_FORMAT


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
    return math.exp(total_nll / count)


def find_decoder_dir(model: Path) -> tuple[Path, Path]:
    """(directory the decoder loads from, directory holding its tokenizer) for any accepted input.

    Accepted, in this order: an engine / work directory (its build-llm/ torch layout, else
    quantize/llm, else convert/llm), a conversion workspace or quantize output (its llm/), or a
    Hugging Face causal-LM directory (float or AWQ GEMM).
    """
    model = Path(model)
    if not model.is_dir():
        raise InputError(f"{model}: no such model directory")
    processor = model / "convert" / "processor"
    layout = model / "build-llm" / "config.json"
    if layout.exists() and json.loads(layout.read_text()).get("format") == LAYOUT_FORMAT:
        return model / "build-llm", processor
    for sub in ("quantize/llm", "convert/llm"):
        d = model / sub
        if (d / "config.json").exists():
            return d, d if _has_tokenizer(d) else processor
    if (model / "llm" / "config.json").exists():
        d = model / "llm"
        return d, d if _has_tokenizer(d) else model / "processor"
    if (model / "config.json").exists():
        return model, model
    raise CheckpointError(f"{model}: neither a Hugging Face causal-LM directory (config.json), a workspace (llm/) "
                          "nor an engine directory (build-llm/)")


def _is_whole_vlm(cfg: dict) -> bool:
    """A config.json of a whole VLM (a registered family's architecture), not of a plain decoder."""
    from ..models.decoders import DECODER_FAMILIES
    from ..models.registry import detect_family

    if cfg.get("model_type") in {t for f in DECODER_FAMILIES.values() for t in f.model_types}:
        return False
    detect_family(cfg)  # UnsupportedModelError (exit 4) for anything else
    return True


def _has_tokenizer(d: Path) -> bool:
    return any((d / n).exists() for n in ("tokenizer.json", "tokenizer.model", "vocab.json"))


def load_logits_fn(model: Path, dtype: str = "float32", device: str = "cpu") -> tuple[Callable, Path, dict]:
    """(logits_fn, tokenizer directory, description) for `model` (see `find_decoder_dir`)."""
    from ..runtime.decoder import TorchDecoder

    d, tok_dir = find_decoder_dir(model)
    cfg = json.loads((d / "config.json").read_text())
    if cfg.get("format") == LAYOUT_FORMAT:
        dec = TorchDecoder.load(d, device=device, max_seq=16)
        kind = "engine"
        quant = (cfg.get("decoder", {}).get("quantization") or {}).get("method", "none")
    elif _is_whole_vlm(cfg):  # e.g. the vlm/ checkpoint `vlmctl quantize` writes: score its decoder
        from ..convert import read_vlm_decoder

        text_cfg, tensors, q = read_vlm_decoder(d)
        dec = TorchDecoder.from_hf_tensors({**text_cfg, "quantization_config": q} if q else text_cfg, tensors,
                                           dtype=dtype, device=device, max_seq=16)
        quant = (q or {}).get("quant_method", "none")
        kind = "hf-vlm"
    else:
        dec = TorchDecoder.from_hf_dir(d, dtype=dtype, device=device, max_seq=16)
        quant = (cfg.get("quantization_config") or {}).get("quant_method", "none")
        kind = "hf"
    if not _has_tokenizer(tok_dir):
        raise CheckpointError(f"{model}: no tokenizer found (looked in {tok_dir})")
    return dec.logits, tok_dir, {"kind": kind, "decoder_dir": str(d), "quantization": quant}


def evaluate_perplexity(model: Path, data: str, seq_len: int = 512, samples: int | None = None,
                        dtype: str = "float32", device: str = "cpu", base_dir: Path | None = None,
                        progress: Progress | None = None) -> dict:
    """Library entry point of `vlmctl eval ppl`."""
    from transformers import AutoTokenizer

    from .calibration import load_eval_tokens

    logits_fn, tok_dir, info = load_logits_fn(model, dtype=dtype, device=device)
    tokenizer = AutoTokenizer.from_pretrained(str(tok_dir))
    ids = load_eval_tokens(data, tokenizer, base_dir)
    n_windows = ids.numel() // seq_len if samples is None else min(samples, ids.numel() // seq_len)
    ppl = perplexity(logits_fn, ids, seq_len, samples, progress=progress)
    return {"perplexity": ppl, "model": str(model), "data": data, "seq_len": seq_len, "samples": n_windows,
            "tokens": n_windows * (seq_len - 1), **info}
