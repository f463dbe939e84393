"""AWQ 4-bit weight quantization (Lin et al., MLSys 2024) of a decoder, natively: the driver that walks
a plain Hugging Face causal LM layer by layer and writes its AutoAWQ GEMM checkpoint.

The algorithm is AutoAWQ's, layer by layer:
  1. run the decoder layer in float32 on the calibration activations, recording each linear's
     input and each inspected block's output; its output feeds the next layer (float, so errors
     do not compound);
  2. per AWQ group (linears sharing an input, from the family module), search 20 ratios r of
     s = mean|x|^r (optionally AutoAWQ's "duo" form mean|x|^r / mean|w|^(1-r)) for the scale that
     minimises the block's output error with weights Q(W*s)/s;
  3. fold 1/s into the preceding op (norm or linear) and s into the linears;
  4. search a clipping threshold per output channel and group (not for q/k);
  5. quantize asymmetrically to 4 bits with zero points, per group of input channels, and pack
     into AutoAWQ's GEMM format.

Differences from AutoAWQ that do not change the objective, only the cost:
  - a group that is a single linear measures ||X ΔWᵀ||² through the Gram matrix XᵀX instead of
    re-running the linear over every token for every grid point, and evaluates all grid points
    in one batched product;
  - the clip search also works from per-group Gram blocks, all shrink ratios at once;
  - the float outputs of the inspected blocks come from the one layer forward, not extra runs;
  - everything is computed in float32 (AutoAWQ quantizes in the checkpoint's fp16), and codes
    are rounded against the fp16 scale that is actually stored.

Memory: weights are read from the safetensors files one layer at a time (the whole float model
is never instantiated); beyond one layer's weights, the calibration activations and that layer's
recorded inputs, only the embedding matrix is held while the first layer's input is computed.

The pieces: awq_math.py (arithmetic and searches), awq_layer.py (one layer), this module (the
decoder), awq_vlm.py (workspaces, whole-VLM checkpoints and every source `vlmctl quantize` takes).
"""

from __future__ import annotations

import json
import time
from pathlib import Path

from .. import __version__
from ..checkpoint import ShardWriter, TensorReader, copy_side_files
from ..errors import CheckpointError, InputError
from ..formats.awq_gemm import AwqGemmConfig, quantization_method
from ..host import peak_rss_mib
from ..progress import Progress, ensure
from .awq_layer import LayerQuantizer, PerSample, check_group_size, fast_delta_dtype, float_output
from .awq_math import BITS

SHARD_BYTES = 1 << 30
FORWARD_BYTES = 16 << 20  # CPU: stays on the allocator's heap
FORWARD_BYTES_GPU = 256 << 20  # GPU: fewer, larger forwards (memory is not the constraint there)


def _skeleton(src_dir: Path, family):
    """(HF config, the causal LM on the meta device, name of its input-embedding weight)."""
    import torch
    import transformers

    hf_config = transformers.AutoConfig.from_pretrained(str(src_dir))
    hf_config._attn_implementation = "sdpa"  # causal attention with attention_mask=None
    cls = getattr(transformers, family.causal_lm_class)
    with torch.device("meta"):  # module structure without memory
        skeleton = cls(hf_config)
    embed_mod = skeleton.get_input_embeddings()
    embed_name = next(n for n, m in skeleton.named_modules() if m is embed_mod) + ".weight"
    return hf_config, skeleton, embed_name


def embedding_weight(llm_dir: Path):
    """The input-embedding matrix of the causal LM checkpoint in `llm_dir`."""
    from ..models.decoders import decoder_family

    cfg = json.loads((Path(llm_dir) / "config.json").read_text())
    _, _, name = _skeleton(Path(llm_dir), decoder_family(cfg.get("model_type", "")))
    return TensorReader(Path(llm_dir)).get(name)


def embedding_scale(llm_dir: Path) -> float:
    """What the decoder multiplies token embeddings by (1.0 for most; Gemma's sqrt(hidden))."""
    from ..models.decoders import decoder_spec

    scale = decoder_spec(json.loads((Path(llm_dir) / "config.json").read_text())).embed_scale
    return 1.0 if scale is None else scale


def _trim_heap() -> None:
    """Give freed heap memory back to the OS between layers (glibc), so fragmentation from one
    layer's temporaries does not add up over the layers. A no-op elsewhere."""
    try:
        import ctypes

        ctypes.CDLL("libc.so.6").malloc_trim(0)
    except (OSError, AttributeError):
        pass


def _load_tokenizer(src_dir: Path):
    from transformers import AutoTokenizer

    try:
        return AutoTokenizer.from_pretrained(str(src_dir))
    except Exception as e:
        raise CheckpointError(f"{src_dir}: cannot load the tokenizer for calibration ({str(e).splitlines()[0][:200]})") from None


def quantize_causal_lm(src_dir: Path, out_dir: Path, settings, base_dir: Path | None = None,
                       progress: Progress | None = None, *, device: str | None = None, calib_ids=None,
                       calib_embeds=None, calib_cross: dict | None = None) -> dict:
    """AWQ-quantize the plain HF causal LM in `src_dir` into an AutoAWQ GEMM checkpoint in `out_dir`.

    `settings` is a `QuantizationSettings`; `calib_ids` (LongTensor [n, T]) overrides its calibration
    data, and `calib_embeds` (float [n, T, hidden], e.g. with image features) replaces the embedding
    lookup altogether. Returns a summary (timings, peak memory, sizes) for the manifest.

    Decoders with cross-attention layers: `calib_cross` (from `vlm_calibration.cross_attention_calibration`)
    holds what those layers read per sample - the image states and transformers' masks; without it the
    calibration is text, which those layers never see (transformers skips them), so they pass it on
    unchanged and must stay float (`settings.cross_attention`). Float cross-attention layers are
    copied as they are and listed in `modules_to_not_convert`.
    """
    import torch

    from ..models.decoders import calibration_layer_kwargs, decoder_family, decoder_spec
    from .calibration import load_calibration

    t0 = time.perf_counter()
    progress = ensure(progress)
    src_dir, out_dir = Path(src_dir), Path(out_dir)
    base_dir = Path(base_dir) if base_dir is not None else Path.cwd()
    cfg_path = src_dir / "config.json"
    if not cfg_path.exists():
        raise CheckpointError(f"{src_dir}: no config.json (not a Hugging Face checkpoint directory)")
    config_dict = json.loads(cfg_path.read_text())
    if quantization_method(config_dict):
        raise CheckpointError(f"{src_dir}: already quantized ({quantization_method(config_dict)}); give a float "
                              "checkpoint")
    if settings.bits != 4 or not settings.zero_point:
        raise InputError("AWQ GEMM output supports bits=4 with zero_point=true only")
    family = decoder_family(config_dict.get("model_type", ""))
    dev = torch.device(device or ("cuda" if torch.cuda.is_available() else "cpu"))
    group_size = settings.group_size
    spec = decoder_spec(config_dict)
    kinds = [spec.layer_types[i] if spec.layer_types else "full" for i in range(spec.num_layers)]
    cross_mode = getattr(settings, "cross_attention", "float")
    quantize_cross = cross_mode == "quantize"
    if spec.cross_layers and quantize_cross and calib_cross is None:
        raise InputError("quantization.cross_attention quantize needs image-text calibration data (a .jsonl whose "
                         "records name images): only image states reach the cross-attention layers; or keep them "
                         "float (quantization.cross_attention: float)")

    hf_config, skeleton, embed_name = _skeleton(src_dir, family)
    layers = skeleton.get_submodule(family.layer_prefix)
    n_layers = len(layers)
    parent = skeleton.get_submodule(family.layer_prefix.rsplit(".", 1)[0]) if "." in family.layer_prefix else skeleton
    _check_layer_group_sizes(family, layers, kinds, group_size, quantize_cross)  # before any real work

    tokens = calib_ids
    cal = settings.calibration
    if calib_embeds is not None:
        tokens = torch.zeros(calib_embeds.shape[:2], dtype=torch.long)  # shape only
    elif tokens is None:
        if cal.seq_len > int(config_dict.get("max_position_embeddings", 1 << 30)):
            raise InputError(f"calibration seq_len {cal.seq_len} exceeds the model's max_position_embeddings")
        tokens = load_calibration(cal.data, _load_tokenizer(src_dir), cal.samples, cal.seq_len, base_dir)
        if tokens.shape[0] < cal.samples:
            progress.log(f"calibration data gave {tokens.shape[0]} block(s) of {cal.seq_len} tokens "
                         f"(asked for {cal.samples})")
    tokens = torch.as_tensor(tokens, dtype=torch.long)
    n_samples, seq_len = tokens.shape

    tensors = TensorReader(src_dir)
    with torch.inference_mode():
        if calib_embeds is not None:
            x = calib_embeds.to(dev, torch.float32)
        else:
            x = torch.nn.functional.embedding(tokens, tensors.get(embed_name).to(torch.float32)).to(dev)
            scale = spec.embed_scale
            if scale is not None:  # e.g. Gemma's sqrt(hidden)
                x = x * scale
        rotary = type(parent.rotary_emb)(config=hf_config).to(dev)
        pos = torch.arange(seq_len, device=dev)[None]
        per_layer = calibration_layer_kwargs(family, hf_config, rotary, x, pos)
    width = max(hf_config.hidden_size, getattr(hf_config, "intermediate_size", 0) or 0)
    # Samples per forward: on a CPU, intermediates of ~16 MiB stay on the allocator's heap (larger
    # ones are mmapped and page-faulted afresh on every use, which made the search ~30% slower); a
    # GPU gets fewer, larger kernels.
    budget = FORWARD_BYTES if dev.type == "cpu" else FORWARD_BYTES_GPU
    chunk = max(1, min(n_samples, budget // (seq_len * width * 4)))

    layer_prefix = family.layer_prefix + "."
    out_dir.mkdir(parents=True, exist_ok=True)
    writer = ShardWriter(out_dir, max_bytes=SHARD_BYTES)
    for name in tensors.names():  # everything outside the decoder layers, unchanged
        if not name.startswith(layer_prefix):
            writer.add(name, tensors.get(name))
    delta_dtype = fast_delta_dtype(dev)
    cross_kw = {}
    if calib_cross is not None:
        cross_kw = {k: PerSample(calib_cross[v].to(dev, torch.float32)) for k, v in
                    (("cross_attention_states", "states"), ("cross_attention_mask", "mask"),
                     ("full_text_row_masked_out_mask", "rowmask"))}
    float_modules: list[str] = []
    task = progress.task(f"awq: quantizing {n_layers} decoder layers", total=n_layers)
    n_linears = 0
    with torch.inference_mode():
        for i in range(n_layers):
            prefix = f"{layer_prefix}{i}."
            names = [n for n in tensors.names() if n.startswith(prefix)]
            src = {n[len(prefix):]: tensors.get(n) for n in names}
            cross = kinds[i] == "cross_attention"
            groups = family.groups_for(kinds[i])
            if cross and not quantize_cross:
                for n in names:  # kept float, byte for byte
                    writer.add(n, tensors.get(n))
                # module names as transformers 5 (a suffix) and vLLM (a substring) both match them
                float_modules += [f"layers.{i}.{lin}" for g in groups for lin in g.linears
                                  if f"layers.{i}.{lin}" not in float_modules]
                if calib_cross is not None:  # the next layer's input: this layer's float output
                    x = _float_forward(layers[i], src, dev, x, {**per_layer[i], **cross_kw}, chunk, src_dir, i)
                layers[i] = torch.nn.Identity()
                tensors.release()
                task.advance()
                continue  # without image states transformers skips it: x passes unchanged
            layer = layers[i]
            try:
                layer.load_state_dict({k: v.to(dev, torch.float32) for k, v in src.items()}, strict=True, assign=True)
            except RuntimeError as e:
                raise CheckpointError(f"{src_dir}: layer {i} tensors do not match the config "
                                      f"({str(e).splitlines()[0][:200]})") from None
            # rotary table and window of this layer's type; a cross-attention layer's image states and
            # masks, per sample
            quantizer = LayerQuantizer(family, group_size, settings.duo_scaling,
                                       {**per_layer[i], **cross_kw} if cross else per_layer[i], chunk, delta_dtype,
                                       groups)
            x, packed = quantizer.quantize(layer, x)
            state = layer.state_dict()
            for k, v in state.items():
                mod = k.rsplit(".", 1)[0]
                if mod in packed and k.endswith(".weight"):
                    continue
                writer.add(prefix + k, v.detach().to("cpu", src[k].dtype).clone())
            for mod, (qw, qz, sc) in packed.items():
                writer.add(f"{prefix}{mod}.qweight", qw)
                writer.add(f"{prefix}{mod}.qzeros", qz)
                writer.add(f"{prefix}{mod}.scales", sc)
            n_linears += len(packed)
            layers[i] = torch.nn.Identity()  # drop this layer's weights
            del layer, state, src, packed
            tensors.release()
            _trim_heap()
            task.advance()
    task.done()
    writer.close()

    cfg_out = AwqGemmConfig(BITS, group_size, modules_to_not_convert=tuple(float_modules)).apply_to(config_dict)
    (out_dir / "config.json").write_text(json.dumps(cfg_out, indent=2))
    copy_side_files(src_dir, out_dir)
    summary = {}
    if spec.cross_layers:
        summary["cross_attention"] = {"layers": list(spec.cross_layers), "mode": cross_mode,
                                      "calibrated_with_images": calib_cross is not None}
    return {
        "backend": "vlmctl-awq", "backend_version": __version__,
        "method": "awq", "impl": "vlmctl", "bits": BITS, "group_size": group_size, "zero_point": True,
        "duo_scaling": settings.duo_scaling, "layers": n_layers, "quantized_linears": n_linears, **summary,
        "calibration": {"data": cal.data if calib_ids is None else "(given tokens)", "samples": int(n_samples),
                        "seq_len": int(seq_len), "image_text": calib_embeds is not None},
        "device": str(dev), "search_delta_dtype": str(delta_dtype).replace("torch.", "") if delta_dtype else "float32",
        "wall_s": round(time.perf_counter() - t0, 2), "peak_rss_mib": round(peak_rss_mib(), 1),
    }


def _check_layer_group_sizes(family, layers, kinds: list[str], group_size: int, quantize_cross: bool) -> None:
    """`check_group_size` on one layer of each kind that gets quantized (InputError naming the linear)."""
    for kind in dict.fromkeys(kinds):
        i = kinds.index(kind)
        if kind != "cross_attention" or quantize_cross:
            check_group_size(layers[i], family, group_size, f"{family.layer_prefix}.{i}", family.groups_for(kind))


def check_group_size_for_config(text_cfg: dict, settings) -> None:
    """The group-size check `quantize_causal_lm` makes, from the decoder's config alone (a causal LM's
    config.json, or a VLM family's `text_config_dict`): on the layers of a skeleton on the meta device,
    so nothing is read or allocated. Lets a caller fail before converting a whole VLM first."""
    import torch
    import transformers

    from ..models.decoders import decoder_family, decoder_spec, hf_text_config

    family = decoder_family(text_cfg.get("model_type", ""))
    spec = decoder_spec(text_cfg)
    kinds = [spec.layer_types[i] if spec.layer_types else "full" for i in range(spec.num_layers)]
    with torch.device("meta"):
        skeleton = getattr(transformers, family.causal_lm_class)(hf_text_config(text_cfg))
    _check_layer_group_sizes(family, skeleton.get_submodule(family.layer_prefix), kinds, settings.group_size,
                             getattr(settings, "cross_attention", "float") == "quantize")


def _float_forward(layer, src: dict, dev, x, kwargs: dict, chunk: int, src_dir: Path, i: int):
    """The float output of a decoder layer kept unquantized (its input for the next layer)."""
    import torch

    try:
        layer.load_state_dict({k: v.to(dev, torch.float32) for k, v in src.items()}, strict=True, assign=True)
    except RuntimeError as e:
        raise CheckpointError(f"{src_dir}: layer {i} tensors do not match the config "
                              f"({str(e).splitlines()[0][:200]})") from None
    return float_output(layer, x, kwargs, chunk)
