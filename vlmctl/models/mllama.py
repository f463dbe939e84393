"""Llama 3.2 Vision (`MllamaForConditionalGeneration`: Llama-3.2-11B/90B-Vision(-Instruct)).

A tiled ViT (a local encoder, then a gated global encoder over all tiles of an image; the output
concatenates the last hidden state with intermediate layers' states) and a linear projector turn
each image into `max_num_tiles * (patches + 1)` rows of the text model's width (4 x 1601 on the hub).
Those rows are not placed in the prompt: the text model's cross-attention layers read them. The
prompt keeps one `<|image|>` token per image (its id is the first of 8 token-embedding rows beyond
the vocabulary), and which images each token sees follows transformers' `cross_attention_mask`
(MllamaProcessor): a token sees the image(s) of the nearest image token(s) before it - a run of
consecutive image tokens is seen together from its last one on, and each image token of the run
sees the images up to itself - only their real tiles; tokens before the first image see none (the
model then attends to every row, padding tiles included, and zeroes the MLP output: the runtime
follows that, `vlmctl.runtime.cross_kv`).

The image processor resizes an image to the best canvas of at most `max_image_tiles` tiles for its
aspect ratio, pads and splits it; images always carry `max_num_tiles` tiles (zeros past the real
ones) because the tower's tile-position embeddings and its global attention are defined over all of
them, and the padding tiles' states do reach the real ones (transformers' aspect-ratio mask only
keeps padding from attending to padding). The ONNX graph takes every image's tiles along one
dynamic `tiles` axis (images x max_num_tiles), with `aspect_ratio_ids` [images] and
`aspect_ratio_mask` [images, max_num_tiles].

Everything vlmctl knows about Llama 3.2 Vision as a VLM lives here: tensor names (current and the
hub's), the vision graph, the image rows, and the cross-attention mask. Preprocessing is
transformers' own PIL image processor (MllamaImageProcessorPil); the text model is the decoder
family "mllama_text_model" (models/decoders.py).
"""

from __future__ import annotations

from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, InputError, UnsupportedModelError
from ..formats.awq_gemm import without_quantization
from .base import (CrossAttention, EncodedPrompt, FamilyProcessor, ImageItem, VisionAxis, VLMFamily,
                   read_json)

_VISION_PREFIXES = ("vision_model.", "multi_modal_projector.")
# The hub's (transformers 4.x) tensor names -> transformers 5's module names.
_LEGACY_PREFIXES = (
    ("language_model.lm_head.", "lm_head."),
    ("language_model.model.", "model.language_model."),
    ("vision_model.", "model.vision_model."),
    ("multi_modal_projector.", "model.multi_modal_projector."),
)
IMAGE_TOKEN = "<|image|>"


def patches_per_tile(vision_config) -> int:
    """Rows of one tile: its patch grid plus the class embedding."""
    return (int(vision_config.image_size) // int(vision_config.patch_size)) ** 2 + 1


class MllamaVisionWrapper:
    """Factory for the export module (a function so torch is imported lazily)."""

    @staticmethod
    def build(config):
        from torch import nn
        from transformers.models.mllama.modeling_mllama import MllamaVisionModel

        tiles = int(config.vision_config.max_num_tiles)
        hidden = int(config.text_config.hidden_size)

        class Wrapper(nn.Module):
            """The vision model and projector as MllamaModel runs them, one image per "media":
            pixel_values [images * tiles, 3, S, S], aspect_ratio_ids [images], aspect_ratio_mask
            [images, tiles] -> cross-attention states [images, tiles * rows per tile, text hidden]."""

            def __init__(self):
                super().__init__()
                self.vision_model = MllamaVisionModel(config.vision_config)
                self.multi_modal_projector = nn.Linear(config.vision_config.vision_output_dim, hidden, bias=True)

            def forward(self, pixel_values, aspect_ratio_ids, aspect_ratio_mask):
                s = pixel_values.shape
                pv = pixel_values.reshape(-1, 1, tiles, s[1], s[2], s[3])
                n = pv.shape[0]
                out = self.vision_model(pixel_values=pv, aspect_ratio_ids=aspect_ratio_ids.reshape(n, 1),
                                        aspect_ratio_mask=aspect_ratio_mask.reshape(n, 1, tiles)).last_hidden_state
                return self.multi_modal_projector(out).reshape(n, -1, hidden)

        return Wrapper()


class MllamaFamily(VLMFamily):
    name = "mllama"
    architectures = ("MllamaForConditionalGeneration",)
    vision_prefixes = _VISION_PREFIXES
    multi_image = True
    image_input = "cross_attention"
    supports_trtllm = False
    trtllm_refusal = ("it reads its images in cross-attention layers, and vlmctl builds only TensorRT-LLM "
                      "prompt-table engines (TensorRT-LLM's own encoder-feature path is not built by vlmctl; "
                      "docs/tensorrt-llm.md)")
    legacy_prefixes = _LEGACY_PREFIXES

    def hf_config(self, config_dict: dict):
        from transformers import MllamaConfig

        cfg = MllamaConfig.from_dict(without_quantization(config_dict))
        vc = cfg.vision_config
        if int(vc.image_size) % int(vc.patch_size):
            raise UnsupportedModelError(f"Llama 3.2 Vision: image_size {vc.image_size} is not a multiple of "
                                        f"patch_size {vc.patch_size}")
        if int(cfg.image_token_index) != int(cfg.text_config.vocab_size):
            # the runtime looks <|image|> up in the token embedding's rows past the vocabulary
            raise UnsupportedModelError(f"Llama 3.2 Vision: image_token_index {cfg.image_token_index} is not the first "
                                        f"id past the vocabulary ({cfg.text_config.vocab_size})")
        return cfg

    def hf_model_class(self):
        from transformers import MllamaForConditionalGeneration

        return MllamaForConditionalGeneration

    def ties_lm_head(self, config_dict: dict) -> bool:
        # MllamaForConditionalGeneration declares no tied weights: its LM head (vocab_size rows) never
        # shares the token embedding (vocab_size + 8 rows), whatever the config's flag says
        return False

    def text_config_dict(self, config_dict: dict) -> dict:
        text = self.standalone_text_config(config_dict)
        text["tie_word_embeddings"] = False
        return text

    def vision_module_names(self) -> list[str]:
        return ["vision_model", "multi_modal_projector"]

    # ---- vision ----------------------------------------------------------------------------
    def build_vision_module(self, vision_dir: Path, dtype):
        config = self.hf_config(read_json(Path(vision_dir) / "config.json"))
        wrapper = self.vision_module_with_weights(lambda: MllamaVisionWrapper.build(config), vision_dir)
        return wrapper.to(dtype).eval().requires_grad_(False)

    def onnx_io(self, vision_config: dict):
        return (["pixel_values", "aspect_ratio_ids", "aspect_ratio_mask"], ["image_features"],
                {"pixel_values": {0: "tiles"}, "aspect_ratio_ids": {0: "images"}, "aspect_ratio_mask": {0: "images"},
                 "image_features": {0: "images"}})

    def example_vision_inputs(self, vision_config: dict, batch: int, dtype, seed: int = 0) -> dict[str, Any]:
        """`batch` images with random pixels and random aspect ratios (their tiles past the ratio's are
        zeros, as the processor pads them)."""
        import torch

        vc = self.hf_config(vision_config).vision_config
        tiles, size = int(vc.max_num_tiles), int(vc.image_size)
        g = torch.Generator().manual_seed(seed)
        ratios = [tuple(r) for r in vc.supported_aspect_ratios]
        ids = torch.randint(1, len(ratios) + 1, (batch,), generator=g)
        used = torch.tensor([ratios[int(i) - 1][0] * ratios[int(i) - 1][1] for i in ids])
        mask = (torch.arange(tiles)[None] < used[:, None]).long()
        pv = torch.randn(batch, tiles, int(vc.num_channels), size, size, generator=g) * mask[:, :, None, None, None]
        return {"pixel_values": pv.reshape(batch * tiles, int(vc.num_channels), size, size).to(dtype),
                "aspect_ratio_ids": ids, "aspect_ratio_mask": mask}

    def hf_image_features(self, model, inputs: dict[str, Any]):
        """transformers' own path (MllamaModel.forward): vision_model, then multi_modal_projector."""
        m = model.model
        vc = m.vision_model.config
        ids = inputs["aspect_ratio_ids"]
        n, tiles = ids.shape[0], int(vc.max_num_tiles)
        pv = inputs["pixel_values"].reshape(n, 1, tiles, *inputs["pixel_values"].shape[1:])
        states = m.vision_model(pixel_values=pv, aspect_ratio_ids=ids.reshape(n, 1),
                                aspect_ratio_mask=inputs["aspect_ratio_mask"].reshape(n, 1, tiles)).last_hidden_state
        return m.multi_modal_projector(states).reshape(n, -1, m.hidden_size)

    def vision_axis(self, config_dict: dict, processor_dir: Path) -> VisionAxis:
        """The graph's first axis is tiles (images x max_num_tiles: every image carries all of them),
        beside per-image aspect-ratio ids and masks; TensorRT tunes for 4 images."""
        vc = self.hf_config(config_dict).vision_config
        tiles, size, ch = int(vc.max_num_tiles), int(vc.image_size), int(vc.num_channels)
        return VisionAxis(max_rows=tiles, opt_rows=4 * tiles, min_rows=tiles,
                          trailing={"pixel_values": (ch, size, size), "aspect_ratio_ids": (),
                                    "aspect_ratio_mask": (tiles,)},
                          per_image=("aspect_ratio_ids", "aspect_ratio_mask"))

    # ---- prompt ----------------------------------------------------------------------------
    def image_rows(self, config_dict: dict) -> int:
        """Cross-attention rows of one image: every tile (padding ones too) times its rows."""
        vc = self.hf_config(config_dict).vision_config
        return int(vc.max_num_tiles) * patches_per_tile(vc)

    def max_image_tokens(self, config_dict: dict, processor_dir: Path | None = None) -> int:
        # no prompt rows: this is what one image's features are, which sizes the cross-attention KV
        return self.image_rows(config_dict)

    def load_processor(self, processor_dir: Path, vision_dir: Path | None = None) -> "MllamaProcessorAdapter":
        return MllamaProcessorAdapter(self, Path(processor_dir))


def token_images(ids: list[int], image_token_id: int) -> np.ndarray:
    """[T, 2]: the images (first, end) each token sees, as MllamaProcessor's cross_attention_mask says.

    Image k is seen from its token up to the next image token; an image whose token is immediately
    followed by another image token is seen as long as the image after it (a run of image tokens is
    seen together after its last token, and each of its tokens sees the run's images up to itself)."""
    ids = np.asarray(ids)
    locs = np.nonzero(ids == image_token_id)[0]
    out = np.zeros((len(ids), 2), np.int64)
    if len(locs) == 0:
        return out
    ends = np.append(locs[1:], len(ids))  # image k is seen over [locs[k], ends[k])
    for k in range(len(locs) - 2, -1, -1):  # consecutive image tokens: seen until the next image's end
        if ends[k] == locs[k] + 1:
            ends[k] = ends[k + 1]
    # a token sees images k with locs[k] <= t < ends[k]: a run of consecutive indices
    for t in range(locs[0], len(ids)):
        seen = np.nonzero((locs <= t) & (t < ends))[0]
        out[t] = (seen[0], seen[-1] + 1)
    return out


def load_image_processor(processor_dir: Path):
    """transformers' PIL image processor with the engine's saved settings (the hub names the
    torchvision class, which would only fall back to this one with a warning)."""
    from transformers.models.mllama.image_processing_pil_mllama import MllamaImageProcessorPil

    return MllamaImageProcessorPil.from_pretrained(str(processor_dir))


class MllamaProcessorAdapter(FamilyProcessor):
    """Chat template + Mllama's PIL image processor + MllamaProcessor's cross-attention mask. The
    template's `<|image|>` stays one token (its image's rows go to the cross-attention layers, not
    the prompt); `make_prompt` says which images each token sees."""

    placeholder = IMAGE_TOKEN

    def __init__(self, family: MllamaFamily, processor_dir: Path):
        from transformers.models.mllama.image_processing_pil_mllama import get_all_supported_aspect_ratios

        super().__init__(family, processor_dir)
        cfg = family.hf_config(self.config)
        vc = cfg.vision_config
        self.image_token_id = int(cfg.image_token_index)
        if self.require_token(IMAGE_TOKEN) != self.image_token_id:
            raise CheckpointError(f"{processor_dir}: the tokenizer's {IMAGE_TOKEN} is not image_token_index "
                                  f"{self.image_token_id}")
        self.tiles = int(vc.max_num_tiles)
        if int(self.image_processor.max_image_tiles) != self.tiles:
            raise CheckpointError(f"{processor_dir}: the image processor splits into up to "
                                  f"{self.image_processor.max_image_tiles} tiles, the vision tower takes {self.tiles}")
        if len(get_all_supported_aspect_ratios(self.tiles)) != len(vc.supported_aspect_ratios):
            raise CheckpointError(f"{processor_dir}: the vision config's supported_aspect_ratios do not match "
                                  f"{self.tiles} tiles")
        size = self.image_processor.size or {}
        tile = int(vc.image_size)
        if (size.get("height"), size.get("width")) != (tile, tile):
            raise CheckpointError(f"{processor_dir}: the image processor's tiles are {dict(size)}, the vision tower "
                                  f"takes {tile}x{tile}")
        self.rows_per_tile = patches_per_tile(vc)

    def load_image_processor(self):
        return load_image_processor(self.processor_dir)

    def preprocess(self, image) -> tuple[dict[str, np.ndarray], int]:
        """One image -> (its ONNX feed: max_num_tiles tiles, ratio id, tile mask; its real tile count)."""
        try:
            out = self.image_processor(images=[[image]], return_tensors="np")
        except (ValueError, OSError, ZeroDivisionError) as e:  # degenerate sizes, unreadable pixel data
            raise InputError(f"the image processor rejected a {image.size[0]}x{image.size[1]} image: {e}") from None
        pv = np.ascontiguousarray(out["pixel_values"], dtype=np.float32)
        if pv.shape[:3] != (1, 1, self.tiles):
            raise InputError(f"the image processor made inputs of shape {pv.shape} for one image")
        feed = {"pixel_values": pv.reshape(self.tiles, *pv.shape[3:]),
                "aspect_ratio_ids": np.asarray(out["aspect_ratio_ids"], dtype=np.int64).reshape(1),
                "aspect_ratio_mask": np.asarray(out["aspect_ratio_mask"], dtype=np.int64).reshape(1, self.tiles)}
        return feed, int(out["num_tiles"][0][0])

    def collate(self, items: list[ImageItem]) -> tuple[dict[str, np.ndarray], list[int]]:
        feed, _ = super().collate(items)
        return feed, [1] * len(items)  # one output row (of all its tiles) per image

    # ---- the prompt ---------------------------------------------------------------------------
    def image_item(self, image, content_hash: str) -> ImageItem:
        feed, n_tiles = self.preprocess(image.convert("RGB"))
        # no prompt rows; a token that sees the image sees the rows of its real tiles
        return ImageItem(inputs=feed, num_tokens=0, cross_rows=self.tiles * self.rows_per_tile,
                         meta={"num_tiles": n_tiles, "visible_rows": n_tiles * self.rows_per_tile},
                         content_hash=content_hash)

    def image_text(self, item: ImageItem) -> str:
        return IMAGE_TOKEN  # MllamaProcessor does not expand it

    def tokenize(self, text: str) -> list[int]:
        from transformers.models.mllama.processing_mllama import build_string_from_input

        tok = self.tokenizer
        bos = tok.bos_token
        # as ProcessorMixin.apply_chat_template + MllamaProcessor: no second BOS when the template wrote one;
        # a BOS after any leading image tokens when the text has none
        add_special = not (bos and text.startswith(bos))
        full = build_string_from_input(text, bos, IMAGE_TOKEN) if bos else text
        return list(tok(full, add_special_tokens=add_special)["input_ids"])

    def make_prompt(self, ids: list[int], text: str, items: list[ImageItem], image_items: list[ImageItem],
                    video_items: list[ImageItem]) -> EncodedPrompt:
        """One `<|image|>` token per image, and the cross-attention plan of the prompt's tokens."""
        if sum(1 for t in ids if t == self.image_token_id) != len(image_items):
            raise CheckpointError(f"the tokenizer does not keep {IMAGE_TOKEN!r} as one token")
        cross = None
        if items:
            cross = CrossAttention(image_rows=[it.cross_rows for it in items],
                                   visible_rows=[it.meta["visible_rows"] for it in items],
                                   token_images=token_images(ids, self.image_token_id))
        return EncodedPrompt(token_ids=ids, images=items, image_placeholder_id=-1, text=text, cross=cross)

    def num_image_tokens(self, size: tuple[int, int]) -> int:
        """The rows an image's features are, whatever its size: every tile (padding ones too). They sit
        in the cross-attention K/V, not in the prompt (which holds one `<|image|>` token per image)."""
        return self.tiles * self.rows_per_tile
