"""Idefics3 (`Idefics3ForConditionalGeneration`: Idefics3-8B-Llama3, SmolVLM-256M/500M/2.2B-Instruct) and
SmolVLM (`SmolVLMForConditionalGeneration`: SmolVLM2). transformers implements both with the same code.

SigLIP-style tower over square crops -> pixel shuffle (scale_factor x scale_factor neighbouring
patches folded into channels) -> one linear -> Llama decoder. The image processor resizes an
image so its longest edge is `size.longest_edge`, rounds both sides up to multiples of the crop size
(`max_image_size.longest_edge`, the tower's `image_size`), cuts that into a rows x cols grid of crops
and appends the whole image resized to one crop (the "global image"); with splitting off, or when
the resized image is a single crop, only that global crop is used. Every crop becomes
`image_seq_len` feature rows. In the prompt an image's `<image>` becomes, per grid crop,
`<fake_token_around_image><row_R_col_C>` + `<image>` x image_seq_len (a newline after each grid
row), then `\\n<fake_token_around_image><global-img>` + `<image>` x image_seq_len +
`<fake_token_around_image>`; without a grid only the global part (without the leading newline).

Everything vlmctl knows about these models lives here: tensor names, the crop position ids, the
pixel shuffle, the crop and token counts, and the placeholder expansion. Preprocessing is
transformers' own PIL image processor (Idefics3ImageProcessorPil; SmolVLM's is the same code);
the combined SmolVLMProcessor is not used because it refuses to load without torchvision (its
video processor) and num2words.

The vision ONNX graph takes crops on its dynamic batch axis: [crops, 3, S, S] ->
[crops, image_seq_len, decoder hidden]; an image's rows are its crops' rows in prompt order (grid
row-major, then the global crop). Crops are always full S x S images here (transformers 5's
processor resizes every crop to the crop size), so the tower's patch mask is all ones and the
patch position ids are one constant table, computed once by transformers' own embedding code.

Not supported: video inputs (SmolVLM2's `<video>`).
"""

from __future__ import annotations

import importlib
from pathlib import Path
from typing import Any

import numpy as np

from ..errors import CheckpointError, InputError, UnsupportedModelError
from ..formats.awq_gemm import without_quantization
from .base import FamilyProcessor, ImageItem, VisionAxis, VLMFamily, read_json

_VISION_PREFIXES = ("vision_model.", "connector.")
# Idefics3Processor's default when processor_config.json has no image_seq_len.
DEFAULT_IMAGE_SEQ_LEN = 169
# The image processor's default `size` is 4 crops along the longest edge: a 4 x 4 grid + the global crop.
DEFAULT_MAX_CROPS = 4 * 4 + 1
# Placeholder strings: the processors' names for them and their defaults. Idefics3Processor uses the
# defaults as is; SmolVLMProcessor takes tokenizer attributes of these names when the tokenizer has them.
_TOKENS = {"fake_image_token": "<fake_token_around_image>", "image_token": "<image>",
           "global_image_token": "<global-img>"}


def expand_image(rows: int, cols: int, image_seq_len: int, fake: str, image: str, global_img: str) -> str:
    """The text an image's placeholder becomes: Idefics3Processor / SmolVLMProcessor `replace_image_token`."""
    glob = f"{fake}{global_img}{image * image_seq_len}{fake}"
    if rows == 0 and cols == 0:
        return glob
    grid = "".join("".join(f"{fake}<row_{r + 1}_col_{c + 1}>{image * image_seq_len}" for c in range(cols)) + "\n"
                   for r in range(rows))
    return f"{grid}\n{glob}"


class Idefics3VisionWrapper:
    """Factory for the export module (a function so torch is imported lazily)."""

    @staticmethod
    def build(config, kind: str):
        import torch
        from torch import nn

        mod = importlib.import_module(f"transformers.models.{kind.lower()}.modeling_{kind.lower()}")
        tower_cls = getattr(mod, f"{kind}VisionTransformer")
        connector_cls = getattr(mod, f"{kind}Connector")
        vc = config.vision_config

        class Wrapper(nn.Module):
            """get_image_features for full crops as a plain module: pixel_values -> projected rows."""

            def __init__(self):
                super().__init__()
                self.vision_model = tower_cls._from_config(vc)
                self.connector = connector_cls(config)
                # A full crop's patch position ids, from transformers' own (bucketized, fractional)
                # computation: read off the ids its embedding module looks up.
                emb = self.vision_model.embeddings
                if emb.patch_embedding.weight.is_meta:
                    # built without weights (vision_module_with_weights assigns them next): the probe below
                    # needs real storage, whatever it holds (the ids depend on the patch mask alone)
                    emb.to_empty(device="cpu")
                side = int(vc.image_size) // int(vc.patch_size)
                seen = []
                hook = emb.position_embedding.register_forward_pre_hook(lambda _m, args: seen.append(args[0]))
                try:
                    with torch.no_grad():
                        emb(torch.zeros(1, vc.num_channels, vc.image_size, vc.image_size),
                            torch.ones(1, side, side, dtype=torch.bool))
                finally:
                    hook.remove()
                self.register_buffer("position_ids", seen[0].detach().clone(), persistent=False)

            def forward(self, pixel_values):
                vm = self.vision_model
                # Idefics3VisionTransformer.forward for an all-ones patch mask (no attention mask at
                # all), without the output-capturing hooks, which do not trace.
                emb = vm.embeddings
                x = emb.patch_embedding(pixel_values.to(emb.patch_embedding.weight.dtype)).flatten(2).transpose(1, 2)
                x = x + emb.position_embedding(self.position_ids)
                x = vm.encoder(inputs_embeds=x).last_hidden_state
                return self.connector(vm.post_layernorm(x))

        return Wrapper()


class Idefics3Family(VLMFamily):
    name = "idefics3"
    architectures = ("Idefics3ForConditionalGeneration",)
    vision_prefixes = _VISION_PREFIXES
    text_prefix = "text_model."
    multi_image = True
    kind = "Idefics3"  # transformers' class-name prefix

    def hf_config(self, config_dict: dict):
        import transformers

        cfg = getattr(transformers, f"{self.kind}Config").from_dict(without_quantization(config_dict))
        self._check(cfg)
        return cfg

    def _check(self, cfg) -> None:
        vc = cfg.vision_config
        if not isinstance(vc.image_size, int) or not isinstance(vc.patch_size, int):
            raise UnsupportedModelError(f"{self.kind}: the vision tower needs square crops and patches "
                                        f"(image_size {vc.image_size}, patch_size {vc.patch_size})")
        side, scale = vc.image_size // vc.patch_size, int(cfg.scale_factor)
        # transformers' pixel shuffle needs the patch grid to divide by the scale factor.
        if scale < 1 or side % scale:
            raise UnsupportedModelError(f"{self.kind}: scale_factor {cfg.scale_factor} does not divide the "
                                        f"{side}x{side} patch grid")

    def hf_model_class(self):
        import transformers

        return getattr(transformers, f"{self.kind}ForConditionalGeneration")

    def text_config_dict(self, config_dict: dict) -> dict:
        text = self.standalone_text_config(config_dict)
        # transformers ties lm_head to the text model's embedding by the top-level flag alone
        # (`_tied_weights_keys` lives on the VLM class; the text config's flag is never read).
        text["tie_word_embeddings"] = self.ties_lm_head(config_dict)
        return text

    def vision_module_names(self) -> list[str]:
        return ["vision_model", "connector"]

    # ---- vision ----------------------------------------------------------------------------
    def build_vision_module(self, vision_dir: Path, dtype):
        config = self.hf_config(read_json(Path(vision_dir) / "config.json"))
        wrapper = self.vision_module_with_weights(lambda: Idefics3VisionWrapper.build(config, self.kind), vision_dir)
        return wrapper.to(dtype).eval().requires_grad_(False)

    def onnx_io(self, vision_config: dict) -> tuple[list[str], list[str], dict[str, dict[int, str]]]:
        return ["pixel_values"], ["image_features"], {"pixel_values": {0: "crops"}, "image_features": {0: "crops"}}

    def example_vision_inputs(self, vision_config: dict, batch: int, dtype, seed: int = 0) -> dict[str, Any]:
        import torch

        vc = self.hf_config(vision_config).vision_config
        g = torch.Generator().manual_seed(seed)
        return {"pixel_values": torch.randn(batch, vc.num_channels, vc.image_size, vc.image_size,
                                            generator=g).to(dtype)}

    def hf_image_features(self, model, inputs: dict[str, Any]):
        """transformers' get_image_features on one image's crops -> [crops, image_seq_len, hidden]."""
        pv = inputs["pixel_values"]
        out = model.model.get_image_features(pixel_values=pv[None])
        feats = out.pooler_output if hasattr(out, "pooler_output") else out
        feats = feats[0] if isinstance(feats, (list, tuple)) else feats
        return feats.reshape(pv.shape[0], -1, feats.shape[-1])

    # ---- prompt ----------------------------------------------------------------------------
    def rows_per_crop(self, config_dict: dict) -> int:
        """Feature rows per crop: Idefics3Model.image_seq_len."""
        cfg = self.hf_config(config_dict)
        vc = cfg.vision_config
        return (vc.image_size // vc.patch_size) ** 2 // int(cfg.scale_factor) ** 2

    def max_image_tokens(self, config_dict: dict, processor_dir: Path | None = None) -> int:
        # Without the engine's processor settings: the checkpoints' default 4 crops along the longest edge.
        crops = max_crops(load_image_processor(processor_dir)) if processor_dir is not None else DEFAULT_MAX_CROPS
        return crops * self.rows_per_crop(config_dict)

    def min_image_tokens(self, config_dict: dict) -> int:
        """An image is one crop at least: its global crop (the processor's splitting settings add more)."""
        return self.rows_per_crop(config_dict)

    def vision_axis(self, config_dict: dict, processor_dir: Path) -> VisionAxis:
        """The graph's batch axis counts crops: an image needs up to its most crops."""
        vc = self.hf_config(config_dict).vision_config
        per_image = max_crops(load_image_processor(processor_dir))
        return VisionAxis(max_rows=per_image, opt_rows=per_image,
                          trailing={"pixel_values": (vc.num_channels, vc.image_size, vc.image_size)})

    def placeholder_tokens(self, tokenizer) -> dict[str, str]:
        """fake / image / global-image strings, as this architecture's processor chooses them."""
        return dict(_TOKENS)

    def load_processor(self, processor_dir: Path, vision_dir: Path | None = None) -> "Idefics3ProcessorAdapter":
        return Idefics3ProcessorAdapter(self, Path(processor_dir))


class SmolVLMFamily(Idefics3Family):
    name = "smolvlm"
    architectures = ("SmolVLMForConditionalGeneration",)
    kind = "SmolVLM"

    def placeholder_tokens(self, tokenizer) -> dict[str, str]:
        # SmolVLMProcessor: `getattr(tokenizer, "fake_image_token", "<fake_token_around_image>")`, ...
        return {attr: getattr(tokenizer, attr, None) or default for attr, default in _TOKENS.items()}


def load_image_processor(processor_dir: Path):
    """transformers' PIL image processor with the engine's saved settings (the hub names the
    torchvision class, which would only fall back to this one with a warning)."""
    from transformers import Idefics3ImageProcessorPil

    ip = Idefics3ImageProcessorPil.from_pretrained(str(processor_dir))
    if "longest_edge" not in (ip.size or {}) or "longest_edge" not in (ip.max_image_size or {}):
        raise CheckpointError(f"{processor_dir}: the image processor's size and max_image_size need a longest_edge "
                              f"(got {dict(ip.size)}, {dict(ip.max_image_size)})")
    return ip


def max_crops(ip) -> int:
    """Most crops one image becomes under these settings: a square image fills the largest grid."""
    n = ip.size["longest_edge"]
    patches = int(ip.get_number_of_image_patches(n, n, {})[0])
    return max(patches, 1)


class Idefics3ProcessorAdapter(FamilyProcessor):
    """Chat template + the PIL image processor, expanding `<image>` as Idefics3Processor / SmolVLMProcessor
    do (see `expand_image`), then tokenizing the whole text as they do."""

    def __init__(self, family: Idefics3Family, processor_dir: Path):
        super().__init__(family, processor_dir)
        tokens = family.placeholder_tokens(self.tokenizer)
        self.fake_token, self.placeholder, self.global_token = (tokens["fake_image_token"], tokens["image_token"],
                                                                 tokens["global_image_token"])
        # The global-image and row/column tags may be plain text (Idefics3-8B's tokenizer spells them
        # out); the image and fake tokens must be tokens (the processor would add the fake token as a
        # new id the embedding table does not have).
        for tok in (self.fake_token, self.placeholder):
            self.require_token(tok)
        self.image_token_id = self.config_token_id("image_token_id")
        if self.tokenizer.convert_tokens_to_ids(self.placeholder) != self.image_token_id:
            raise CheckpointError(f"{processor_dir}: the tokenizer's {self.placeholder!r} is not config.json's "
                                  f"image_token_id {self.image_token_id}")
        proc_cfg = self.processor_dir / "processor_config.json"
        seq = read_json(proc_cfg).get("image_seq_len") if proc_cfg.exists() else None
        self.rows_per_crop = int(seq) if seq is not None else DEFAULT_IMAGE_SEQ_LEN
        rows = family.rows_per_crop(self.config)
        if self.rows_per_crop != rows:
            raise CheckpointError(f"{processor_dir}: the processor's image_seq_len {self.rows_per_crop} disagrees "
                                  f"with the vision config ({rows} rows per crop)")
        crop = int(self.image_processor.max_image_size["longest_edge"])
        tower = int(family.hf_config(self.config).vision_config.image_size)
        if crop != tower:
            raise CheckpointError(f"{processor_dir}: the image processor's crops are {crop} px but the vision tower "
                                  f"takes {tower} px images")

    def load_image_processor(self):
        return load_image_processor(self.processor_dir)

    def preprocess(self, image) -> tuple[np.ndarray, int, int]:
        """One image -> (pixel_values [crops, 3, S, S] (grid row-major, then the global crop), rows, cols)."""
        try:
            out = self.image_processor(images=[[image]], return_tensors="np", return_row_col_info=True)
        except (ValueError, OSError, ZeroDivisionError) as e:  # degenerate sizes, unreadable pixel data
            raise InputError(f"the image processor rejected a {image.size[0]}x{image.size[1]} image: {e}") from None
        pv = np.ascontiguousarray(out["pixel_values"][0], dtype=np.float32)
        rows, cols = int(out["rows"][0][0]), int(out["cols"][0][0])
        if pv.shape[0] != (rows * cols + 1 if rows or cols else 1):
            raise InputError("the image processor returned an inconsistent number of crops")
        mask = out.get("pixel_attention_mask")
        if mask is not None and not np.all(mask):
            # transformers 5 resizes every crop to the full crop size; a padded crop would need
            # the tower's patch mask, which the exported graph does not take.
            raise UnsupportedModelError("the image processor produced padded crops, which vlmctl's vision graph "
                                        "does not support")
        return pv, rows, cols

    def image_item(self, image, content_hash: str) -> ImageItem:
        pv, rows, cols = self.preprocess(image)
        return ImageItem(inputs={"pixel_values": pv}, num_tokens=pv.shape[0] * self.rows_per_crop,
                         meta={"crops": pv.shape[0], "rows": rows, "cols": cols}, content_hash=content_hash)

    def image_text(self, item: ImageItem) -> str:
        return expand_image(item.meta["rows"], item.meta["cols"], self.rows_per_crop, self.fake_token,
                            self.placeholder, self.global_token)

    def num_image_tokens(self, size: tuple[int, int]) -> int:
        width, height = size
        crops = int(self.image_processor.get_number_of_image_patches(height, width, {})[0])
        return max(crops, 1) * self.rows_per_crop
