"""The interface every VLM family module implements.

A family module is the only place that knows a model: how its checkpoint splits into vision
and decoder, how the vision part is wrapped for export, how images are preprocessed and how many
feature rows each becomes, how the chat template and image placeholders expand, and which
decoder family runs the language part. Generic code (convert, export, runtime, serve) only
talks to this interface.
"""

from __future__ import annotations

import json
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

# Roles of a tensor in the source checkpoint.
VISION = "vision"
DECODER = "decoder"


@dataclass
class ImageItem:
    """One preprocessed image (or video), ready for the vision runner. A video whose vision work is
    split (see `FamilyProcessor.vision_parts`) keeps its parts in `meta["parts"]`."""

    inputs: dict[str, np.ndarray]  # ONNX feed for this image (batch axis of size 1 or #crops)
    num_tokens: int  # feature rows it becomes in the prompt (0 where cross-attention layers read it)
    meta: dict[str, Any] = field(default_factory=dict)  # what postprocess_features needs
    content_hash: str = ""
    features: np.ndarray | None = None  # filled by the engine: [feature rows, hidden]
    cross_rows: int = 0  # feature rows of an image read by cross-attention layers (not in the prompt)

    @property
    def feature_rows(self) -> int:
        return self.cross_rows or self.num_tokens


@dataclass(frozen=True)
class TritonStock:
    """How the stock Python models of tensorrtllm_backend 1.2 (`preprocessing`,
    `multimodal_encoders`) serve a family: they branch on `model_type`, vlmctl's word for nothing.

    `client_pixels`: the stock preprocessing does not process this family's images; clients send
    the image processor's pixels (`image_input`, float16) and the prompt gets the image rows in
    front of it. Otherwise raw images (`image_bytes_input` / `image_url_input`) go through the
    checkpoint's own HF processor inside the stock preprocessing (its `hf_model_path`).
    `max_images`: images per request the stock path takes (None: the engine's limit)."""

    model_type: str
    client_pixels: bool
    max_images: int | None = None


@dataclass
class CrossAttention:
    """How a prompt's tokens see its images when the decoder reads them in cross-attention layers
    instead of prompt rows (transformers' `cross_attention_mask`, per token).

    Image k's features have `image_rows[k]` rows; a token that sees it sees the first
    `visible_rows[k]` (its real tiles; the rest pad it to the tower's tile count). Token t sees
    images `token_images[t, 0]` up to (not including) `token_images[t, 1]`; an empty range before the
    first image (transformers lets such a token attend to every row of every image, padding
    included, and zeroes its cross-attention MLP output). Generated tokens see what the last prompt
    token sees."""

    image_rows: list[int]
    visible_rows: list[int]
    token_images: np.ndarray  # int64 [prompt tokens, 2]


@dataclass
class EncodedPrompt:
    """A tokenized prompt whose image placeholders are already expanded.

    `token_ids` holds ordinary ids plus, for item k, `images[k].num_tokens` copies of its placeholder
    id (`image_placeholder_id`, or `video_placeholder_id` for a video); the runtime swaps them for
    fake ids >= vocab_size in order. `images` lists the prompt's images and videos in prompt order.
    A family whose decoder reads images in cross-attention layers puts no rows in the prompt and says
    in `cross` which images each token sees.
    """

    token_ids: list[int]
    images: list[ImageItem]
    image_placeholder_id: int
    text: str = ""
    video_placeholder_id: int = -1
    cross: CrossAttention | None = None

    @property
    def placeholder_ids(self) -> tuple[int, ...]:
        """Every id whose positions are feature rows (images, and videos where the family has them)."""
        return tuple(i for i in (self.image_placeholder_id, self.video_placeholder_id) if i >= 0)


class VLMFamily:
    """Base class. Subclasses set the class attributes and override what differs."""

    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]
    # Supported features, shown in `vlmctl models` and the README table.
    multi_image: ClassVar[bool] = True
    # Takes videos (`encode(..., videos=[media.video.Video])`); families without it refuse them.
    video: ClassVar[bool] = False
    # Served by tensorrtllm_backend 1.2's stock multimodal Python models (export-triton), or None.
    triton_stock: ClassVar[TritonStock | None] = None
    # How the decoder attends among an image's rows during prefill: "causal" (like text), or
    # "bidirectional" (the rows of one image see each other; the decoder spec carries it to the runtime).
    image_attention: ClassVar[str] = "causal"
    # How image features reach the decoder: "prompt_table" (rows of the prompt, the prompt-embedding
    # table contract) or "cross_attention" (read by the decoder's cross-attention layers).
    image_input: ClassVar[str] = "prompt_table"

    # ---- detection -------------------------------------------------------------------------
    @classmethod
    def matches(cls, config: dict) -> bool:
        return any(a in cls.architectures for a in config.get("architectures") or [])

    # ---- conversion ------------------------------------------------------------------------
    def hf_config(self, config_dict: dict):
        """The transformers config object for the whole VLM."""
        raise NotImplementedError

    def hf_model_class(self):
        raise NotImplementedError

    # (old prefix, current prefix) pairs for checkpoints saved in an older transformers layout.
    legacy_prefixes: ClassVar[tuple[tuple[str, str], ...]] = ()

    def canonical_key(self, key: str) -> str:
        """Map a checkpoint tensor name (any historical layout) to the current transformers name."""
        if key.startswith(("model.", "lm_head.")):
            return key
        for old, new in self.legacy_prefixes:
            if key.startswith(old):
                return new + key[len(old):]
        return key

    def split_key(self, key: str) -> tuple[str, str]:
        """(VISION or DECODER, name inside that part) for a canonical tensor name."""
        raise NotImplementedError

    def join_key(self, part: str, name: str) -> str:
        """Inverse of `split_key`: the whole-VLM tensor name of `name` inside `part` (AWQ's VLM checkpoint)."""
        raise NotImplementedError

    def text_config_dict(self, config_dict: dict) -> dict:
        """config.json of the standalone decoder (a plain HF causal LM)."""
        raise NotImplementedError

    def vision_module_names(self) -> list[str]:
        """Module prefixes of the vision part in the whole-VLM checkpoint (AWQ's modules_to_not_convert)."""
        raise NotImplementedError

    def ties_lm_head(self, config_dict: dict) -> bool:
        """Whether transformers ties this VLM's lm_head to its word embedding: the *top-level* flag of the
        VLM config decides (the whole model's `_tied_weights_keys` are read against it), after the config
        class's own back-compat handling (LLaVA's and Qwen2-VL's lift a text-config `true` to the top).
        A text config that says false does not untie. Even when tied, transformers keeps a separate
        lm_head that the checkpoint contains; `convert` does the same."""
        return bool(getattr(self.hf_config(config_dict), "tie_word_embeddings", False))

    # ---- vision ----------------------------------------------------------------------------
    @staticmethod
    def load_vision_weights(module, vision_dir: Path, skip: tuple[str, ...] = ()) -> None:
        """Load convert's vision/ weights into the export wrapper; any mismatch is a checkpoint error."""
        from safetensors.torch import load_file

        from ..checkpoint import weight_files
        from ..errors import CheckpointError

        state = {}
        for f in weight_files(Path(vision_dir)):
            state.update(load_file(str(f)))
        for name in skip:
            state.pop(name, None)
        missing, unexpected = module.load_state_dict(state, strict=False)
        if missing or unexpected:
            raise CheckpointError(f"{vision_dir}: vision weights do not match the config "
                                  f"(missing {missing[:3]}, unexpected {unexpected[:3]})")

    def build_vision_module(self, vision_dir: Path, dtype):
        """torch module: ONNX inputs -> image features [batch, rows, decoder hidden]."""
        raise NotImplementedError

    def onnx_io(self, vision_config: dict) -> tuple[list[str], list[str], dict[str, dict[int, str]]]:
        """ONNX input names, output names and dynamic axes."""
        return ["pixel_values"], ["image_features"], {"pixel_values": {0: "batch"}, "image_features": {0: "batch"}}

    def example_vision_inputs(self, vision_config: dict, batch: int, dtype, seed: int = 0) -> dict[str, Any]:
        raise NotImplementedError

    def hf_image_features(self, model, inputs: dict[str, Any]):
        """Image features through transformers' own path (reference for validation tests)."""
        raise NotImplementedError

    # ---- prompt & images -------------------------------------------------------------------
    def load_processor(self, processor_dir: Path) -> "FamilyProcessor":
        raise NotImplementedError

    def max_image_tokens(self, config_dict: dict) -> int:
        """Upper bound of feature rows one image becomes (sizes the prompt-embedding table)."""
        raise NotImplementedError

    def engine_image_tokens(self, config_dict: dict, processor_dir: Path) -> int:
        """`max_image_tokens` under the engine's processor settings (dynamic-resolution families read
        their max_pixels there)."""
        return self.max_image_tokens(config_dict)

    def apply_image_settings(self, processor_dir: Path, settings: dict) -> None:
        """Write a recipe's `image:` settings (min/max pixels) into the engine's processor config."""
        from ..errors import RecipeError

        raise RecipeError(f"image.{next(iter(settings))}: the {self.name} family has no such setting "
                          "(only dynamic-resolution models take min_pixels / max_pixels)")

    def vision_profile(self, config_dict: dict, processor_dir: Path, limits: dict) -> dict | None:
        """TensorRT optimization-profile (min, opt, max) shapes per vision input, for graphs whose
        dynamic axis is not a batch of images; None: axis 0 is a batch of 1..max images."""
        return None

    def triton_vision_files(self, vision_dir: Path, dest: Path) -> list[str]:
        """Files the stock `multimodal_encoders` model reads beside the vision engine (names written)."""
        return []

    # ---- decoder ---------------------------------------------------------------------------
    def decoder_model_type(self, config_dict: dict) -> str:
        return self.text_config_dict(config_dict)["model_type"]


class FamilyProcessor:
    """Built from an engine's processor/ directory: turns chat messages and images into an EncodedPrompt."""

    def encode(self, messages: list[dict], images: list, tools: list[dict] | None = None) -> EncodedPrompt:
        """`tools`: OpenAI function tools (models/tool_calls.normalize_tools) for the template to show.
        Families with `video = True` also take `videos` (media.video.Video, in prompt order of the
        `{"type": "video"}` parts) and `video_limits` (media.video.VideoLimits)."""
        raise NotImplementedError

    def vision_parts(self, item: ImageItem) -> list[ImageItem] | None:
        """Items the vision runner encodes in place of `item`, whose rows, concatenated in order, are
        the item's rows (a video split into chunks of frames, so one vision call stays the size of an
        image's); None: the item is encoded whole."""
        return item.meta.get("parts")

    def batch_key(self, item: ImageItem) -> tuple:
        """Images with equal keys can share one vision call (default: equal input shapes)."""
        return tuple((k, v.shape[1:], v.dtype.str) for k, v in item.inputs.items())

    def collate(self, items: list[ImageItem]) -> tuple[dict[str, np.ndarray], list[int]]:
        """One vision feed for several images (same batch_key), and how many leading-axis rows of
        the vision output belong to each image (default: concatenate along the batch axis)."""
        names = list(items[0].inputs)
        feed = {n: np.concatenate([it.inputs[n] for it in items], 0) for n in names}
        return feed, [it.inputs[names[0]].shape[0] for it in items]

    def postprocess_features(self, features: np.ndarray, item: ImageItem) -> np.ndarray:
        """Vision runner output for one image -> [num_tokens, hidden] rows for the prompt table."""
        return features.reshape(-1, features.shape[-1])

    def position_ids(self, token_ids: list[int], prompt: EncodedPrompt):
        """None for ordinary 1-D positions; families with multi-dimensional rotary override."""
        return None


def expand_placeholders(ids: list[int], placeholder_id: int, items: list[ImageItem]) -> list[int]:
    """Each occurrence of the image placeholder id becomes `num_tokens` copies, image by image."""
    expanded: list[int] = []
    k = 0
    for t in ids:
        if t == placeholder_id:
            expanded.extend([t] * items[k].num_tokens)
            k += 1
        else:
            expanded.append(t)
    return expanded


def expand_media(ids: list[int], groups: dict[int, list[ImageItem]]) -> tuple[list[int], list[ImageItem]]:
    """Each occurrence of a placeholder id in `groups` becomes its next item's `num_tokens` copies;
    returns the expanded ids and the items in prompt order (images and videos interleaved)."""
    expanded: list[int] = []
    ordered: list[ImageItem] = []
    nxt = {pid: iter(items) for pid, items in groups.items()}
    for t in ids:
        if t in nxt:
            item = next(nxt[t])
            ordered.append(item)
            expanded.extend([t] * item.num_tokens)
        else:
            expanded.append(t)
    return expanded, ordered


def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)
