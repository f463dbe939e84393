"""Qwen2-VL (`Qwen2VLForConditionalGeneration`) and Qwen2.5-VL (`Qwen2_5_VLForConditionalGeneration`).

Native-resolution ViT over 14x14 patches (two frames per temporal patch, an image repeats its
frame) -> 2x2 patch merger -> Qwen2 decoder with multimodal rotary positions (M-RoPE).
Everything vlmctl knows about these models lives here:

- tensor names (the hub's `visual.*` / `model.layers.*` and transformers 5's `model.visual.*` /
  `model.language_model.*`);
- image preprocessing with the checkpoint's own image processor (dynamic resolution within its
  min/max pixels); an image becomes `t*h*w / merge**2` tokens, `<|image_pad|>` expands to that;
- the vision graph for export. Everything that depends on an image's grid is computed on the host
  and fed as inputs, so the ONNX graph has one dynamic axis (patches) and no data-dependent control
  flow: 2-D rotary positions per patch, and per-patch segment ids from which the graph builds
  block-diagonal attention masks (one block per image frame; for 2.5 also one per attention window).
  Qwen2.5-VL's window order is applied on the host as well: patches enter the graph already grouped
  by window, and the merged rows come back in window order and are put back in raster order in
  `postprocess_features`;
- the decoder's 3-D M-RoPE positions for a prompt, as `get_rope_index` computes them.

The language model is a Qwen2 decoder whose rotary positions are 3-D; `llm/` holds it as a plain
`Qwen2ForCausalLM` checkpoint that keeps `mrope_section` in `rope_parameters` (with equal 1-D
positions, as for text, M-RoPE is ordinary RoPE).

Videos (`<|video_pad|>`) go through the same graph: frames sampled by the video processor's rule
(`qwen_frame_indices`: `fps` frames a second within min/max frames, rounded down to whole temporal
patches), resized together to one `smart_resize` size, and patchified with two consecutive frames per
temporal patch, so a video is a grid (t, h, w) whose frames attend only within themselves. Its vision
work is split into chunks of temporal patches (`vision_parts`), each no larger than the largest
image, since the graph's dense masks cost the square of a call's patches. Its M-RoPE positions put
temporal patch k at time k (Qwen2-VL) or at int(k * tokens_per_second * second_per_grid_t)
(Qwen2.5-VL, second_per_grid_t = temporal_patch_size / the sampled frame rate); text after an image
or a video continues at its start plus its larger merged side, as transformers 5 computes it (4.x
continued after the largest position, which differs where a video's time runs past its side).

Not supported: decoders with sliding-window attention.
"""

from __future__ import annotations

import hashlib
import uuid
from dataclasses import dataclass
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, InputError, LimitError, UnsupportedModelError
from ..formats.awq_gemm import without_quantization
from .base import EncodedPrompt, FamilyProcessor, ImageItem, VisionAxis, VLMFamily, read_json
from .video import FrameTransform, video_processor_config

IMAGE_TOKEN = "<|image_pad|>"
VIDEO_TOKEN = "<|video_pad|>"
# transformers' image-processor defaults, used when a checkpoint's preprocessor_config.json omits them.
DEFAULT_MIN_PIXELS = 56 * 56
DEFAULT_MAX_PIXELS = 28 * 28 * 1280
# Qwen2VLVideoProcessor's class defaults, for what a checkpoint's files leave out.
VIDEO_DEFAULT_SIZE = {"shortest_edge": 128 * 28 * 28, "longest_edge": 768 * 28 * 28}
VIDEO_DEFAULT_MIN_FRAMES = 4
VIDEO_DEFAULT_MAX_FRAMES = 768
VIDEO_DEFAULT_MAX_TOKENS = 128000
# transformers leaves the sampling rate unset (every frame given is used); vlmctl samples at the rate
# Qwen's own qwen-vl-utils uses, unless the checkpoint's video processor names `fps` or `num_frames`.
DEFAULT_VIDEO_FPS = 2.0


# ---- host-side grid computations (numpy; each mirrors one transformers function) -----------------
def smart_resize(height: int, width: int, factor: int, min_pixels: int, max_pixels: int) -> tuple[int, int]:
    """The resized (height, width) of an image: transformers' `qwen2_vl` `smart_resize`."""
    import math

    if max(height, width) / min(height, width) > 200:
        raise InputError(f"image aspect ratio {max(height, width) / min(height, width):.0f}:1 is beyond 200:1")
    h_bar = round(height / factor) * factor
    w_bar = round(width / factor) * factor
    if h_bar * w_bar > max_pixels:
        beta = math.sqrt((height * width) / max_pixels)
        h_bar = max(factor, math.floor(height / beta / factor) * factor)
        w_bar = max(factor, math.floor(width / beta / factor) * factor)
    elif h_bar * w_bar < min_pixels:
        beta = math.sqrt(min_pixels / (height * width))
        h_bar = math.ceil(height * beta / factor) * factor
        w_bar = math.ceil(width * beta / factor) * factor
    return h_bar, w_bar


def vision_position_ids(grid_thw, merge: int) -> np.ndarray:
    """[patches, 2] (row, column) of every patch in the processor's patch order (merge blocks
    row-major, patches within a block row-major): `vision_utils.get_vision_position_ids`."""
    out = []
    for t, h, w in grid_thw:
        hpos, wpos = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
        shape = (h // merge, merge, w // merge, merge)
        hpos = hpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        wpos = wpos.reshape(shape).transpose(0, 2, 1, 3).reshape(-1)
        out.append(np.tile(np.stack([hpos, wpos], -1), (t, 1)))
    return np.concatenate(out, 0).astype(np.int64)


def frame_segments(grid_thw) -> np.ndarray:
    """[patches] attention-block id: every frame of every image attends only within itself (cu_seqlens)."""
    segs, k = [], 0
    for t, h, w in grid_thw:
        for _ in range(t):
            segs.append(np.full(h * w, k, np.int64))
            k += 1
    return np.concatenate(segs)


def window_index(grid_thw, merge: int, window_size: int, patch_size: int) -> tuple[np.ndarray, np.ndarray]:
    """(permutation of merged units into window order, units per non-empty window):
    `vision_utils.get_vision_window_index` without its cumulative sums."""
    ws = window_size // merge // patch_size
    order, lengths, base = [], [], 0
    for t, h, w in grid_thw:
        lh, lw = h // merge, w // merge
        index = np.arange(t * lh * lw).reshape(t, lh, lw)
        pad_h, pad_w = ws - lh % ws, ws - lw % ws
        nh, nw = (lh + pad_h) // ws, (lw + pad_w) // ws
        padded = np.pad(index, ((0, 0), (0, pad_h), (0, pad_w)), constant_values=-100)
        padded = padded.reshape(t, nh, ws, nw, ws).transpose(0, 1, 3, 2, 4).reshape(t, nh * nw, ws * ws)
        counts = (padded != -100).sum(-1).reshape(-1)
        flat = padded.reshape(-1)
        order.append(flat[flat != -100] + base)
        lengths.append(counts[counts > 0])  # empty (all-padding) windows vanish, as unique_consecutive drops them
        base += t * lh * lw
    return np.concatenate(order).astype(np.int64), np.concatenate(lengths).astype(np.int64)


def mrope_positions(token_ids: list[int], placeholder_ids, grids: list, merge: int,
                    time_intervals: list | None = None) -> np.ndarray:
    """[3, T] M-RoPE positions of an expanded prompt: `get_rope_index` for images and videos.

    Text advances all three components by one per token; an image's or video's tokens get (t, row,
    column) offsets from the position where it starts, and the text after it continues at that start
    plus its larger merged side. `placeholder_ids`: the id (or ids) of the rows; `grids`: each item's
    (t, h, w) in prompt order; `time_intervals`: per item, None for temporal offsets 0, 1, ... or the
    float32 step of Qwen2.5-VL's videos (offsets truncated after the multiplication, as transformers does).
    """
    T = len(token_ids)
    pos = np.zeros((3, T), np.int64)
    ids = np.asarray(token_ids)
    rows = np.isin(ids, np.asarray(placeholder_ids, dtype=np.int64).reshape(-1))
    i, cur, k = 0, 0, 0
    while i < T:
        if not rows[i]:
            pos[:, i] = cur
            cur += 1
            i += 1
            continue
        t, h, w = (int(x) for x in grids[k])
        lh, lw = h // merge, w // merge
        n = t * lh * lw
        step = time_intervals[k] if time_intervals is not None else None
        tpos = np.arange(t) if step is None else (np.arange(t, dtype=np.float32) * np.float32(step)).astype(np.int64)
        tt, hh, ww = np.meshgrid(tpos, np.arange(lh), np.arange(lw), indexing="ij")
        pos[:, i:i + n] = np.stack([tt.reshape(-1), hh.reshape(-1), ww.reshape(-1)]) + cur
        cur += max(lh, lw)
        i += n
        k += 1
    return pos


# ---- videos: transformers' Qwen2VLVideoProcessor, without torchvision ------------------------------
@dataclass(frozen=True)
class QwenVideoSettings:
    min_pixels: int
    max_pixels: int
    min_frames: int
    max_frames: int
    fps: float | None
    num_frames: int | None
    cap_pixels_per_frame: bool
    max_video_tokens: int

    @classmethod
    def from_config(cls, cfg: dict) -> "QwenVideoSettings":
        """The settings Qwen2VLVideoProcessor(**cfg) ends up with (min/max_pixels override `size`)."""
        size = dict(cfg.get("size") or VIDEO_DEFAULT_SIZE)
        if cfg.get("min_pixels") is not None:
            size["shortest_edge"] = cfg["min_pixels"]
        if cfg.get("max_pixels") is not None:
            size["longest_edge"] = cfg["max_pixels"]
        if not size.get("shortest_edge") or not size.get("longest_edge"):
            raise CheckpointError(f"the video processor's size {size} needs shortest_edge and longest_edge")
        fps, num_frames = cfg.get("fps"), cfg.get("num_frames")
        if fps is not None and num_frames is not None:
            raise CheckpointError("the video processor sets both fps and num_frames (they are mutually exclusive)")
        return cls(min_pixels=int(size["shortest_edge"]), max_pixels=int(size["longest_edge"]),
                   min_frames=int(cfg.get("min_frames") or VIDEO_DEFAULT_MIN_FRAMES),
                   max_frames=int(cfg.get("max_frames") or VIDEO_DEFAULT_MAX_FRAMES),
                   fps=float(fps) if fps is not None else (None if num_frames is not None else DEFAULT_VIDEO_FPS),
                   num_frames=int(num_frames) if num_frames is not None else None,
                   cap_pixels_per_frame=bool(cfg.get("cap_pixels_per_frame") or False),
                   max_video_tokens=int(cfg.get("max_video_tokens") or VIDEO_DEFAULT_MAX_TOKENS))


def qwen_frame_indices(total: int, video_fps: float | None, s: QwenVideoSettings, temporal: int,
                       frame_cap: int, what: str = "video") -> np.ndarray:
    """Frame numbers to sample: `Qwen2VLVideoProcessor.sample_frames`, with the frames capped by the
    engine's `frame_cap`. Where transformers would fail (fewer frames than one temporal patch, or
    `num_frames` beyond the video) the video's frames are taken as they are, up to the cap."""
    import math

    import torch

    cap = min(frame_cap, total)
    if s.num_frames is not None:
        n = round(s.num_frames / temporal) * temporal
        if n > cap:
            n = cap // temporal * temporal
    else:
        if not video_fps:
            raise InputError(f"{what}: the container gives no frame rate, which sampling at {s.fps:g} frames a "
                             "second needs")
        max_frames = math.floor(min(s.max_frames, cap) / temporal) * temporal
        n = total / video_fps * s.fps
        n = min(max(n, s.min_frames), max_frames, total)
        n = math.floor(n / temporal) * temporal
    if n <= 0:
        return np.arange(cap, dtype=np.int64)
    idx = torch.arange(0, total, total / n).int().numpy().astype(np.int64)  # float steps, truncated
    return idx[:frame_cap]


def qwen_video_size(height: int, width: int, frames: int, s: QwenVideoSettings, factor: int,
                    temporal: int) -> tuple[int, int]:
    """(height, width) every frame is resized to (the video processor's `resize`)."""
    max_pixels = s.max_pixels
    if s.cap_pixels_per_frame:  # an even share of a whole-video pixel budget, as qwen-vl-utils bounds it
        total_pixels = int(s.max_video_tokens * factor * factor * 0.9)
        max_pixels = max(min(max_pixels, total_pixels * temporal // frames), int(s.min_pixels * 1.05))
    return smart_resize(height, width, factor, s.min_pixels, max_pixels)


def qwen_video_patches(pixels: np.ndarray, temporal: int, patch: int, merge: int) -> tuple[np.ndarray, tuple]:
    """[n, C, H, W] normalized frames -> ([t*h*w, C*temporal*patch*patch] rows, (t, h, w)): the video
    processor's `patchify` (the last frame repeated to fill the last temporal patch)."""
    n, c, H, W = pixels.shape
    if n % temporal:
        pixels = np.concatenate([pixels, np.repeat(pixels[-1:], temporal - n % temporal, 0)], 0)
    t, gh, gw = pixels.shape[0] // temporal, H // patch, W // patch
    x = pixels.reshape(t, temporal, c, gh // merge, merge, patch, gw // merge, merge, patch)
    x = x.transpose(0, 3, 6, 4, 7, 2, 1, 5, 8)  # (t, h-blocks, w-blocks, merge rows, merge cols, C, T, p, p)
    return np.ascontiguousarray(x.reshape(t * gh * gw, c * temporal * patch * patch), dtype=np.float32), (t, gh, gw)


# ---- the vision graph ----------------------------------------------------------------------------
class QwenVisionWrapper:
    """Factory for the export module (a function, to import torch lazily)."""

    @staticmethod
    def build(config, windowed: bool):
        import torch
        import torch.nn.functional as F
        from torch import nn

        if windowed:
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import (
                Qwen2_5_VisionTransformerPretrainedModel as Tower,
            )
            from transformers.models.qwen2_5_vl.modeling_qwen2_5_vl import apply_rotary_pos_emb_vision
        else:
            from transformers.models.qwen2_vl.modeling_qwen2_vl import Qwen2VisionTransformerPretrainedModel as Tower
            from transformers.models.qwen2_vl.modeling_qwen2_vl import apply_rotary_pos_emb_vision

        vc = config.vision_config

        class Wrapper(nn.Module):
            """(pixel_values [P, C*T*p*p], vision_pos_ids [P, 2], attention_segments [P]
            [, window_segments [P]]) -> image features [P / merge**2, decoder hidden]."""

            def __init__(self):
                super().__init__()
                self.visual = Tower._from_config(vc)
                rot = self.visual.rotary_pos_emb
                # Kept as Python numbers: a float32 constant in the graph even when the weights are fp16.
                self.inv_freq = [float(x) for x in rot.inv_freq.float()]
                self.rope_scaling = float(getattr(rot, "attention_scaling", 1.0))
                self.full_blocks = set(vc.fullatt_block_indexes) if windowed else set(range(vc.depth))
                self.windowed = windowed

            def _attention(self, attn, x, cos, sin, mask):
                P = x.shape[0]
                q, k, v = attn.qkv(x).reshape(P, 3, attn.num_heads, -1).permute(1, 0, 2, 3).unbind(0)
                q, k = apply_rotary_pos_emb_vision(q, k, cos, sin)
                q, k, v = (y.transpose(0, 1)[None] for y in (q, k, v))  # [1, heads, P, d]
                o = F.scaled_dot_product_attention(q, k, v, attn_mask=mask, scale=attn.scaling)
                return attn.proj(o[0].transpose(0, 1).reshape(P, -1))

            @staticmethod
            def _mask(segments, dtype):
                """Additive [1, 1, P, P] mask in the activations' dtype: 0 within a segment, a large negative
                number across (a boolean mask would be exported with float32 constants into an fp16 graph)."""
                same = segments[:, None] == segments[None, :]
                zero = torch.zeros((), dtype=dtype)
                neg = torch.full((), torch.finfo(dtype).min, dtype=dtype)
                return torch.where(same, zero, neg)[None, None]

            def forward(self, pixel_values, vision_pos_ids, attention_segments, window_segments=None):
                x = self.visual.patch_embed(pixel_values)
                inv = torch.tensor(self.inv_freq, dtype=torch.float32)
                freqs = vision_pos_ids[..., None].float() * inv  # [P, 2, d/4]
                hw = torch.cat([freqs[:, 0], freqs[:, 1]], -1)
                emb = torch.cat([hw, hw], -1)
                cos, sin = emb.cos() * self.rope_scaling, emb.sin() * self.rope_scaling
                full = self._mask(attention_segments, x.dtype)
                win = self._mask(window_segments, x.dtype) if self.windowed else full
                for i, blk in enumerate(self.visual.blocks):
                    x = x + self._attention(blk.attn, blk.norm1(x), cos, sin, full if i in self.full_blocks else win)
                    x = x + blk.mlp(blk.norm2(x))
                return self.visual.merger(x)

        return Wrapper()


# ---- the family ----------------------------------------------------------------------------------
class Qwen2VLFamily(VLMFamily):
    name = "qwen2_vl"
    architectures = ("Qwen2VLForConditionalGeneration",)
    vision_prefixes = ("visual.",)
    multi_image = True
    video = True
    windowed = False  # Qwen2.5-VL's window attention
    timed_video = False  # Qwen2.5-VL: video temporal positions in seconds (tokens_per_second)
    supports_trtllm = False
    trtllm_refusal = ("its decoder uses multimodal rotary positions (M-RoPE), which vlmctl's TensorRT-LLM flow (a "
                      "prompt-table engine with 1-D positions) does not drive")

    def hf_config(self, config_dict: dict):
        from transformers import Qwen2VLConfig

        return Qwen2VLConfig.from_dict(without_quantization(config_dict))

    def hf_model_class(self):
        from transformers import Qwen2VLForConditionalGeneration

        return Qwen2VLForConditionalGeneration

    def canonical_key(self, key: str) -> str:
        # The hub's checkpoints (transformers 4.x layout): visual.*, model.layers.*, lm_head.
        if key.startswith("visual."):
            return "model." + key
        if key.startswith("model.") and not key.startswith(("model.visual.", "model.language_model.")):
            return "model.language_model." + key[len("model."):]
        return key

    def text_config_dict(self, config_dict: dict) -> dict:
        """The decoder as a plain Qwen2 causal LM; `rope_parameters.mrope_section` stays for the runtime."""
        from transformers import Qwen2Config

        cfg = self.hf_config(config_dict)
        tc = cfg.text_config
        if tc.use_sliding_window:
            raise UnsupportedModelError(f"{self.architectures[0]} with use_sliding_window=true is not supported")
        rope = dict(tc.rope_parameters or {})
        if not rope.get("mrope_section"):
            raise CheckpointError("config.json: the text config has no rope_parameters.mrope_section")
        head_dim = tc.hidden_size // tc.num_attention_heads
        if 2 * sum(rope["mrope_section"]) != head_dim:
            raise CheckpointError(f"config.json: mrope_section {rope['mrope_section']} does not cover half the "
                                  f"head dimension ({head_dim // 2})")
        keys = ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers", "num_attention_heads",
                "num_key_value_heads", "hidden_act", "max_position_embeddings", "initializer_range", "rms_norm_eps",
                "attention_dropout", "bos_token_id", "eos_token_id", "pad_token_id")
        kwargs = {k: getattr(tc, k) for k in keys if getattr(tc, k, None) is not None}
        plain_rope = {k: v for k, v in rope.items() if k != "mrope_section"}  # what Qwen2Config validates
        q = Qwen2Config(**kwargs, use_sliding_window=False, rope_parameters=plain_rope,
                        tie_word_embeddings=bool(cfg.tie_word_embeddings))
        text = q.to_dict()
        text["rope_parameters"] = rope  # mrope_section included, for the runtime
        text["architectures"] = ["Qwen2ForCausalLM"]
        for k in ("_name_or_path", "transformers_version", "dtype", "id2label", "label2id"):
            text.pop(k, None)
        return text

    def decoder_model_type(self, config_dict: dict) -> str:
        return "qwen2"

    def vision_module_names(self) -> list[str]:
        return ["visual"]  # tower and merger both live under `visual` (AutoAWQ's and vLLM's name for Qwen2-VL)

    # ---- vision ----------------------------------------------------------------------------
    def build_vision_module(self, vision_dir: Path, dtype):
        config = self.hf_config(read_json(Path(vision_dir) / "config.json"))
        wrapper = self.vision_module_with_weights(lambda: QwenVisionWrapper.build(config, self.windowed), vision_dir)
        return wrapper.to(dtype).eval().requires_grad_(False)

    def vision_geometry(self, config_dict: dict) -> dict:
        vc = self.hf_config(config_dict).vision_config
        g = {"patch_size": vc.patch_size, "temporal_patch_size": vc.temporal_patch_size, "merge": vc.spatial_merge_size,
             "in_channels": vc.in_channels}
        if self.windowed:
            g["window_size"] = vc.window_size
        return g

    def onnx_io(self, vision_config: dict) -> tuple[list[str], list[str], dict[str, dict[int, str]]]:
        ins = ["pixel_values", "vision_pos_ids", "attention_segments"] + (["window_segments"] if self.windowed else [])
        dyn = {n: {0: "patches"} for n in ins}
        dyn["image_features"] = {0: "tokens"}
        return ins, ["image_features"], dyn

    def example_vision_inputs(self, vision_config: dict, batch: int, dtype, seed: int = 0) -> dict[str, Any]:
        """`batch` images of different grids (so export and validation see different patch counts)."""
        import torch

        g = self.vision_geometry(vision_config)
        m = g["merge"]
        grids = [(1, m * (2 + (i + seed) % 3), m * (3 + (2 * i + seed) % 4)) for i in range(batch)]
        rng = np.random.default_rng(seed)
        dim = g["in_channels"] * g["temporal_patch_size"] * g["patch_size"] ** 2
        items = [ImageItem(inputs=self._vision_inputs(rng.standard_normal((t * h * w, dim)).astype(np.float32),
                                                      (t, h, w), g), num_tokens=t * h * w // m ** 2)
                 for t, h, w in grids]
        feed, _ = collate_vision(items)
        return {k: (torch.from_numpy(v).to(dtype) if v.dtype.kind == "f" else torch.from_numpy(v))
                for k, v in feed.items()}

    def _vision_inputs(self, pixel_values: np.ndarray, grid, g: dict) -> dict[str, np.ndarray]:
        """One image's feed, in the graph's patch order (window order for Qwen2.5-VL)."""
        m = g["merge"]
        pos = vision_position_ids([grid], m)
        segs = frame_segments([grid])
        inputs = {"pixel_values": np.ascontiguousarray(pixel_values, dtype=np.float32)}
        if not self.windowed:
            inputs.update(vision_pos_ids=pos, attention_segments=segs)
            return inputs
        order, lengths = window_index([grid], m, g["window_size"], g["patch_size"])
        unit = m * m
        perm = (order[:, None] * unit + np.arange(unit)).reshape(-1)
        inputs["pixel_values"] = np.ascontiguousarray(inputs["pixel_values"][perm])
        inputs.update(vision_pos_ids=np.ascontiguousarray(pos[perm]), attention_segments=segs[perm],
                      window_segments=np.repeat(np.arange(len(lengths)), lengths * unit).astype(np.int64))
        return inputs

    def hf_image_features(self, model, inputs: dict[str, Any]):
        """transformers' own image features for `pixel_values` + `image_grid_thw` (the processor's output)."""
        import torch

        out = model.model.get_image_features(pixel_values=inputs["pixel_values"],
                                             image_grid_thw=inputs["image_grid_thw"])
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        return torch.cat(list(feats), 0) if isinstance(feats, (list, tuple)) else feats

    def hf_video_features(self, model, inputs: dict[str, Any]):
        """transformers' own video features for `pixel_values_videos` + `video_grid_thw`."""
        import torch

        out = model.model.get_video_features(pixel_values_videos=inputs["pixel_values_videos"],
                                             video_grid_thw=inputs["video_grid_thw"])
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        return torch.cat(list(feats), 0) if isinstance(feats, (list, tuple)) else feats

    def vision_axis(self, config_dict: dict, processor_dir: Path) -> VisionAxis:
        """The patch axis: one vision call holds the images of one request (see `batch_key`), each
        at most max_pixels, or one part of a video alone (at most one image's patches, or one temporal
        patch of frames at the video processor's max_pixels); patches come in whole merge units."""
        g = self.vision_geometry(config_dict)
        _, max_pixels = processor_pixels(processor_dir)
        unit = g["merge"] ** 2
        per_image = max(unit, max_pixels // g["patch_size"] ** 2 // unit * unit)
        video_pixels = QwenVideoSettings.from_config(video_processor_config(processor_dir)).max_pixels
        part = max(per_image, video_pixels // g["patch_size"] ** 2 // unit * unit)
        dim = g["in_channels"] * g["temporal_patch_size"] * g["patch_size"] ** 2
        trailing = {"pixel_values": (dim,), "vision_pos_ids": (2,), "attention_segments": (), "window_segments": ()}
        names, _, _ = self.onnx_io(config_dict)
        return VisionAxis(max_rows=per_image, opt_rows=max(unit, per_image // 4 // unit * unit),
                          trailing={n: trailing[n] for n in names}, min_rows=unit, across_requests=False,
                          part_rows=part)

    # ---- prompt ----------------------------------------------------------------------------
    def max_image_tokens(self, config_dict: dict, processor_dir: Path | None = None) -> int:
        # Without the processor's settings: transformers' default max_pixels.
        g = self.vision_geometry(config_dict)
        max_pixels = processor_pixels(processor_dir)[1] if processor_dir is not None else DEFAULT_MAX_PIXELS
        return max_pixels // (g["patch_size"] * g["merge"]) ** 2

    def apply_image_settings(self, processor_dir: Path, settings: dict) -> None:
        """min_pixels / max_pixels as top-level keys of preprocessor_config.json (as the hub's files
        have them); the image processor lets them override its `size`."""
        import json

        from ..errors import RecipeError

        unknown = sorted(set(settings) - {"min_pixels", "max_pixels"})
        if unknown:
            raise RecipeError(f"image.{unknown[0]}: not a setting of the {self.name} image processor")
        path = Path(processor_dir) / "preprocessor_config.json"
        cfg = read_json(path) if path.exists() else {}
        cfg.update({k: int(v) for k, v in settings.items()})
        path.write_text(json.dumps(cfg, indent=2))
        lo, hi = processor_pixels(processor_dir)
        if lo > hi:
            raise RecipeError(f"image: min_pixels {lo} is larger than max_pixels {hi} (with the checkpoint's values)")

    def load_processor(self, processor_dir: Path, vision_dir: Path | None = None) -> "QwenProcessorAdapter":
        return QwenProcessorAdapter(self, Path(processor_dir))


class Qwen2_5_VLFamily(Qwen2VLFamily):
    name = "qwen2_5_vl"
    architectures = ("Qwen2_5_VLForConditionalGeneration",)
    windowed = True
    timed_video = True

    def hf_config(self, config_dict: dict):
        from transformers import Qwen2_5_VLConfig

        return Qwen2_5_VLConfig.from_dict(without_quantization(config_dict))

    def hf_model_class(self):
        from transformers import Qwen2_5_VLForConditionalGeneration

        return Qwen2_5_VLForConditionalGeneration


def processor_pixels(processor_dir: Path) -> tuple[int, int]:
    """(min_pixels, max_pixels) of an engine's image processor, read as the processor reads them:
    top-level min/max_pixels win over `size` (shortest_edge / longest_edge), else the defaults."""
    path = Path(processor_dir) / "preprocessor_config.json"
    cfg = read_json(path) if path.exists() else {}
    size = cfg.get("size") or {}
    lo = cfg.get("min_pixels") or size.get("shortest_edge") or DEFAULT_MIN_PIXELS
    hi = cfg.get("max_pixels") or size.get("longest_edge") or DEFAULT_MAX_PIXELS
    return int(lo), int(hi)


def collate_vision(items: list[ImageItem]) -> tuple[dict[str, np.ndarray], list[int]]:
    """Several images -> one feed: patches concatenated, segment ids offset so that each image (and
    each window) stays its own attention block; returns the feature rows of each image."""
    names = list(items[0].inputs)
    feed: dict[str, list] = {n: [] for n in names}
    offsets = {n: 0 for n in names if n.endswith("_segments")}
    for it in items:
        for n in names:
            v = it.inputs[n]
            if n in offsets:
                feed[n].append(v + offsets[n])
                offsets[n] += int(v.max()) + 1 if v.size else 0
            else:
                feed[n].append(v)
    return {n: np.concatenate(vs, 0) for n, vs in feed.items()}, [it.num_tokens for it in items]


class QwenProcessorAdapter(FamilyProcessor):
    """Chat template + the checkpoint's image processor, expanding `<|image_pad|>` as Qwen2VLProcessor does."""

    placeholder = IMAGE_TOKEN
    video_placeholder = VIDEO_TOKEN

    def __init__(self, family: Qwen2VLFamily, processor_dir: Path):
        super().__init__(family, processor_dir)
        self.image_token_id = self.config_token_id("image_token_id")
        if self.tokenizer.convert_ids_to_tokens(self.image_token_id) != IMAGE_TOKEN:
            raise CheckpointError(f"{processor_dir}/config.json: image_token_id does not name {IMAGE_TOKEN}")
        self.geometry = family.vision_geometry(self.config)
        ip = self.image_processor
        if (ip.patch_size, ip.merge_size, ip.temporal_patch_size) != (
                self.geometry["patch_size"], self.geometry["merge"], self.geometry["temporal_patch_size"]):
            raise CheckpointError(f"{processor_dir}: the image processor's patch/merge sizes disagree with config.json")
        size = getattr(ip, "size", None) or {}
        get = size.get if isinstance(size, dict) else (lambda k, d=None: getattr(size, k, None) or d)
        self.min_pixels = int(get("shortest_edge", None) or DEFAULT_MIN_PIXELS)
        self.max_pixels = int(get("longest_edge", None) or DEFAULT_MAX_PIXELS)
        # Videos: the video processor's settings (its own file, else the image processor's), the video token.
        vcfg = video_processor_config(processor_dir)
        for key, geo in (("patch_size", "patch_size"), ("merge_size", "merge"),
                         ("temporal_patch_size", "temporal_patch_size")):
            if key in vcfg and int(vcfg[key]) != self.geometry[geo]:
                raise CheckpointError(f"{processor_dir}: the video processor's {key} {vcfg[key]} disagrees with "
                                      f"config.json ({self.geometry[geo]})")
        self.video_settings = QwenVideoSettings.from_config(vcfg)
        self.frames = FrameTransform(vcfg)
        self.video_token_id = int(self.config.get("video_token_id", -1))
        if self.video_token_id >= 0 and self.tokenizer.convert_ids_to_tokens(self.video_token_id) != VIDEO_TOKEN:
            self.video_token_id = -1  # a checkpoint without the video token takes no videos
        self.tokens_per_second = getattr(family.hf_config(self.config).vision_config, "tokens_per_second", None) \
            if family.timed_video else None

    def num_image_tokens(self, size: tuple[int, int]) -> int:
        """Rows an image of (width, height) becomes (dynamic resolution within min/max pixels)."""
        width, height = size
        factor = self.geometry["patch_size"] * self.geometry["merge"]
        h, w = smart_resize(height, width, factor, self.min_pixels, self.max_pixels)
        return (h // self.geometry["patch_size"]) * (w // self.geometry["patch_size"]) // self.geometry["merge"] ** 2

    def image_items(self, images: list, hashes: list[str]) -> list[ImageItem]:
        m = self.geometry["merge"]
        request = uuid.uuid4().hex  # images of one request share a vision call (see batch_key)
        items = []
        for img, content_hash in zip(images, hashes):
            out = self.image_processor(images=[img.convert("RGB")], return_tensors="np")
            grid = tuple(int(x) for x in out["image_grid_thw"][0])
            n = grid[0] * grid[1] * grid[2] // m ** 2
            inputs = self.family._vision_inputs(out["pixel_values"], grid, self.geometry)
            meta: dict[str, Any] = {"grid_thw": grid, "request": request}
            if self.family.windowed:
                order, _ = window_index([grid], m, self.geometry["window_size"], self.geometry["patch_size"])
                meta["restore"] = np.argsort(order)
            items.append(ImageItem(inputs=inputs, num_tokens=n, meta=meta, content_hash=content_hash))
        return items

    def image_text(self, item: ImageItem) -> str:
        return IMAGE_TOKEN * item.num_tokens

    # ---- videos ----------------------------------------------------------------------------
    def video_items(self, videos: list, limits) -> list[ImageItem]:
        request = uuid.uuid4().hex  # each part of a video is its own vision call (see batch_key)
        budget, items = limits.max_pixels, []
        for k, video in enumerate(videos):
            item, used = self.video_item(video, limits, budget, f"{request}:video{k}")
            items.append(item)
            budget -= used
        return items

    def video_text(self, item: ImageItem) -> str:
        return VIDEO_TOKEN * item.num_tokens

    def video_item(self, video, limits, pixel_budget: int, key: str) -> tuple[ImageItem, int]:
        """One video (media.video.Video) -> its prompt item, with its vision work split into parts of
        whole temporal patches; returns the item and the pixels its sampled frames take."""
        g, s = self.geometry, self.video_settings
        T, p, m = g["temporal_patch_size"], g["patch_size"], g["merge"]
        info = video.info
        chosen: dict[str, Any] = {}

        def choose(total: int, fps):
            return qwen_frame_indices(total, fps, s, T, limits.max_frames, video.what)

        def transform(n: int):
            size = qwen_video_size(info.height, info.width, n, s, p * m, T)
            if n * size[0] * size[1] > pixel_budget:
                raise LimitError(f"{video.what}: {n} frames of {size[1]}x{size[0]} pixels after resizing; a request's "
                                 f"videos may take at most {limits.max_pixels} pixels")
            chosen["size"] = size
            return lambda frame: self.frames.resize(frame, size)

        sampled = video.sample(choose, limits, transform)
        patches, grid = qwen_video_patches(self.frames.normalize(sampled.frames), T, p, m)
        t, gh, gw = grid
        meta: dict[str, Any] = {"grid_thw": grid, "video": True, "frames": sampled.indices.tolist()}
        if self.family.timed_video and self.tokens_per_second is not None:
            # transformers: second_per_grid_ts = temporal_patch_size / sampled fps, a float32 tensor
            # (VideoMetadata.sampled_fps; 24 where the container gives no rate, as transformers assumes)
            sampled_fps = len(sampled.indices) / sampled.total_frames * sampled.fps if sampled.fps else 24.0
            meta["second_per_grid_t"] = T / sampled_fps
            meta["time_interval"] = float(np.float32(self.tokens_per_second) * np.float32(meta["second_per_grid_t"]))
        # Parts: whole temporal patches, each call at most the largest image's patches (or one patch).
        per_t = gh * gw
        step = max(1, (self.max_pixels // p ** 2) // per_t)
        parts = []
        for k0 in range(0, t, step):
            tc = min(step, t - k0)
            sub = (tc, gh, gw)
            part_meta: dict[str, Any] = {"grid_thw": sub, "request": f"{key}:{k0}"}
            if self.family.windowed:
                order, _ = window_index([sub], m, g["window_size"], p)
                part_meta["restore"] = np.argsort(order)
            parts.append(ImageItem(inputs=self.family._vision_inputs(patches[k0 * per_t:(k0 + tc) * per_t], sub, g),
                                   num_tokens=tc * per_t // m ** 2, meta=part_meta))
        meta["parts"] = parts
        h = hashlib.sha256(f"{video.content_hash}:{meta['frames']}:{chosen['size']}".encode()).hexdigest()
        n_pixels = len(sampled.indices) * chosen["size"][0] * chosen["size"][1]
        return ImageItem(inputs={}, num_tokens=t * per_t // m ** 2, meta=meta, content_hash=f"video:{h}"), n_pixels

    def batch_key(self, item: ImageItem) -> tuple:
        # The masks are dense [patches, patches]: a joint call costs the square of the total, so only the
        # images of one request go together (block-diagonal), never the images of a whole batch.
        return ("request", item.meta.get("request", item.content_hash))

    def collate(self, items: list[ImageItem]) -> tuple[dict[str, np.ndarray], list[int]]:
        return collate_vision(items)

    def postprocess_features(self, features: np.ndarray, item: ImageItem) -> np.ndarray:
        features = features.reshape(-1, features.shape[-1])
        restore = item.meta.get("restore")
        return features[restore] if restore is not None else features

    def position_ids(self, token_ids: list[int], prompt: EncodedPrompt):
        if not prompt.images:
            return None
        return mrope_positions(token_ids, prompt.placeholder_ids, [it.meta["grid_thw"] for it in prompt.images],
                               self.geometry["merge"], [it.meta.get("time_interval") for it in prompt.images])
