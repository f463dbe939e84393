"""The contract every VLM family module implements: `VLMFamily` and its `FamilyProcessor`.

A family module is the only place that knows a model: how its checkpoint splits into vision
and decoder, how the vision part is wrapped for export, how images are preprocessed and how many
feature rows each becomes, how the chat template and image placeholders expand, and which
decoder family runs the language part. Generic code (convert, export, runtime, serve) only
talks to this interface.

Both classes are abstract: a family that leaves out a required hook cannot be instantiated (the
registry test instantiates every one). What families share is written here once: the processor's
set-up (config, tokenizer, chat template, image processor) and `FamilyProcessor.encode`, a
template method; a family supplies the image items and the text each image placeholder becomes
(and, where it takes videos, the video items and the text each video placeholder becomes).
"""

from __future__ import annotations

import abc
import contextlib
import hashlib
import json
import threading
from dataclasses import dataclass, field
from pathlib import Path
from typing import Any, ClassVar

import numpy as np

_META = threading.local()  # .depth: this thread is inside parameters_on_meta()
_META_LOCK = threading.Lock()
_META_USERS = 0  # threads inside parameters_on_meta(): the patch stays installed while any is
_REAL_REGISTER = None


def _register_parameter(module, name, param):
    import torch

    if param is not None and getattr(_META, "depth", 0) and param.device.type != "meta":
        param = torch.nn.Parameter(param.to("meta"), requires_grad=param.requires_grad)
    _REAL_REGISTER(module, name, param)


@contextlib.contextmanager
def parameters_on_meta():
    """Modules this thread builds inside get their parameters on the meta device: no memory, and their
    random initialization costs nothing. Other threads' modules are built as usual."""
    global _META_USERS, _REAL_REGISTER
    import torch

    with _META_LOCK:
        if _META_USERS == 0:
            _REAL_REGISTER = torch.nn.Module.register_parameter
            torch.nn.Module.register_parameter = _register_parameter
        _META_USERS += 1
    _META.depth = getattr(_META, "depth", 0) + 1
    try:
        yield
    finally:
        _META.depth -= 1
        with _META_LOCK:
            _META_USERS -= 1
            if _META_USERS == 0:
                torch.nn.Module.register_parameter = _REAL_REGISTER


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


@dataclass(frozen=True)
class VisionAxis:
    """How images fill the vision graph's dynamic axis 0 when it is not simply a batch of images
    (crops, tiles or patches): the family's per-image facts, from which export/tensorrt.py computes
    the TensorRT optimization profile.

    `max_rows`: the most axis rows one image needs (its most crops, or patches); `opt_rows`: the
    rows TensorRT tunes for; `min_rows`: the fewest rows of one vision call; `trailing`: every graph
    input's shape after axis 0; `across_requests`: whether one vision call batches the images of
    several requests (the processor's `batch_key`), or only those of one request; `part_rows`: the
    most rows of a vision call that holds one part of a video alone (`FamilyProcessor.vision_parts`),
    where that can exceed what the images of one call take (0: no such call); `per_image`: inputs
    whose axis 0 counts images instead (a family whose every image is `max_rows` rows, e.g. tiles
    beside per-image aspect ratios: their range is the rows' divided by `max_rows`)."""

    max_rows: int
    opt_rows: int
    trailing: dict[str, tuple[int, ...]]
    min_rows: int = 1
    across_requests: bool = True
    part_rows: int = 0
    per_image: tuple[str, ...] = ()


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


def image_hash(image) -> str:
    """An image's content hash (mode, size and pixels): the vision feature cache's key."""
    h = hashlib.sha256()
    h.update(f"{image.mode}:{image.size}".encode())
    h.update(image.tobytes())
    return h.hexdigest()


class VLMFamily(abc.ABC):
    """Base class. Subclasses set the class attributes and implement the abstract hooks."""

    name: ClassVar[str]
    architectures: ClassVar[tuple[str, ...]]  # the HF architectures it reads (models/registry.py maps them here)
    # Supported features, shown in `vlmctl models` and the README table.
    multi_image: ClassVar[bool] = True
    # Takes videos (`encode(..., videos=[media.video.Video])`); families without it refuse them.
    video: ClassVar[bool] = False
    # Served by tensorrtllm_backend 1.2's stock multimodal Python models (export-triton), or None.
    triton_stock: ClassVar[TritonStock | None] = None
    # How the decoder attends among an image's rows during prefill: "causal" (like text), or
    # "bidirectional" (the rows of one image see each other; the decoder spec carries it to the runtime).
    image_attention: ClassVar[str] = "causal"
    # Whether TensorRT-LLM's prompt-table engine (causal attention, 1-D positions) computes this VLM's
    # decoder as the reference does; when not, `trtllm_refusal` says why and the decoder runs on torch.
    supports_trtllm: ClassVar[bool] = True
    trtllm_refusal: ClassVar[str] = ""
    # How image features reach the decoder: "prompt_table" (rows of the prompt, the prompt-embedding
    # table contract) or "cross_attention" (read by the decoder's cross-attention layers).
    image_input: ClassVar[str] = "prompt_table"
    # Whether the runtime may replay the torch vision module as a CUDA graph per batch bucket: its
    # forward has static shapes for a given input shape, no host synchronization, uses the default
    # `collate` (images batched along axis 0) and computes each image independently of the others
    # in its batch (so padding a batch with zero images leaves the real rows' features unchanged).
    graph_vision: ClassVar[bool] = False

    # ---- conversion ------------------------------------------------------------------------
    @abc.abstractmethod
    def hf_config(self, config_dict: dict):
        """The transformers config object for the whole VLM."""

    def load_hf_config(self, config_dict: dict, where: str = "config.json"):
        """`hf_config`, with what transformers refuses in the values of a checkpoint's config (a hidden size
        its heads do not divide, a string where an int goes, an unknown sub-config model type) as one
        CheckpointError naming `where`. Every family's source config goes through here before anything
        else reads it (convert.load_source_config)."""
        from ..errors import CheckpointError

        try:
            return self.hf_config(config_dict)
        except config_refusals() as e:
            raise CheckpointError(f"{where}: transformers refuses this {self.architectures[0]} config "
                                  f"({refusal_text(e)})") from e

    @abc.abstractmethod
    def hf_model_class(self):
        """transformers' class of the whole VLM (the reference, and the tensor inventory convert checks)."""

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

    # transformers 5's VLM layout: model.<a vision prefix>..., model.<text_prefix>... and lm_head.
    vision_prefixes: ClassVar[tuple[str, ...]] = ()
    text_prefix: ClassVar[str] = "language_model."

    def split_key(self, key: str) -> tuple[str, str]:
        """(VISION or DECODER, name inside that part) for a canonical tensor name."""
        from ..errors import CheckpointError

        if self.vision_prefixes and key.startswith(tuple("model." + p for p in self.vision_prefixes)):
            return VISION, key[len("model."):]
        text = "model." + self.text_prefix
        if key.startswith(text):
            return DECODER, "model." + key[len(text):]
        if key.startswith("lm_head."):
            return DECODER, key
        raise CheckpointError(f"tensor {key!r} belongs to no known part of this {self.architectures[0]} checkpoint")

    def join_key(self, part: str, name: str) -> str:
        """Inverse of `split_key`: the whole-VLM tensor name of `name` inside `part` (AWQ's VLM checkpoint)."""
        from ..errors import CheckpointError

        if part == VISION and self.vision_prefixes and name.startswith(self.vision_prefixes):
            return "model." + name
        if part == DECODER and name.startswith("model."):
            return "model." + self.text_prefix + name[len("model."):]
        if part == DECODER and name.startswith("lm_head."):
            return name
        raise CheckpointError(f"tensor {name!r} of the {part} part has no place in this {self.architectures[0]} "
                              f"checkpoint")

    @abc.abstractmethod
    def text_config_dict(self, config_dict: dict) -> dict:
        """config.json of the standalone decoder (a plain HF causal LM)."""

    @abc.abstractmethod
    def vision_module_names(self) -> list[str]:
        """Module prefixes of the vision part in the whole-VLM checkpoint (AWQ's modules_to_not_convert)."""

    def ties_lm_head(self, config_dict: dict) -> bool:
        """Whether transformers ties this VLM's lm_head to its word embedding: the *top-level* flag of the
        VLM config decides (the whole model's `_tied_weights_keys` are read against it), after the config
        class's own back-compat handling (LLaVA's and Qwen2-VL's lift a text-config `true` to the top).
        A text config that says false does not untie. Even when tied, transformers keeps a separate
        lm_head that the checkpoint contains; `convert` does the same."""
        return bool(getattr(self.hf_config(config_dict), "tie_word_embeddings", False))

    def standalone_text_config(self, config_dict: dict) -> dict:
        """The VLM's text config as a plain causal LM's config.json: its decoder family's causal-LM class as
        `architectures`, the source path dropped. `text_config_dict` adds what its family's VLM computes
        differently from that causal LM."""
        from .decoders import decoder_family

        text = self.hf_config(config_dict).text_config.to_dict()
        text["architectures"] = [decoder_family(text["model_type"]).causal_lm_class]
        text.pop("_name_or_path", None)
        return text

    def decoder_model_type(self, config_dict: dict) -> str:
        return self.text_config_dict(config_dict)["model_type"]

    # ---- vision ----------------------------------------------------------------------------
    @staticmethod
    def vision_module_with_weights(build, vision_dir: Path, skip: tuple[str, ...] = ()):
        """`build()` the export wrapper with its parameters on the meta device, then give it convert's
        vision/ weights by assignment; any mismatch is a checkpoint error. Building for real would allocate
        every parameter and initialize it at random only to overwrite it: ~10 s for a CLIP ViT-L on a
        2-core CPU, most of the vision phase of an engine load. Buffers are built for real (position ids,
        rotary tables: values the weights do not hold). `skip`: file tensors the wrapper does not take."""
        from safetensors.torch import load_file

        from ..checkpoint import weight_files
        from ..errors import CheckpointError

        with parameters_on_meta():
            module = build()
        state = {}
        for f in weight_files(Path(vision_dir)):
            state.update(load_file(str(f)))
        for name in skip:
            state.pop(name, None)
        missing, unexpected = module.load_state_dict(state, strict=False, assign=True)
        if missing or unexpected:
            raise CheckpointError(f"{vision_dir}: vision weights do not match the config "
                                  f"(missing {missing[:3]}, unexpected {unexpected[:3]})")
        return module

    @abc.abstractmethod
    def build_vision_module(self, vision_dir: Path, dtype):
        """torch module: ONNX inputs -> image features [batch, rows, decoder hidden]."""

    def onnx_io(self, vision_config: dict) -> tuple[list[str], list[str], dict[str, dict[int, str]]]:
        """ONNX input names, output names and dynamic axes."""
        return ["pixel_values"], ["image_features"], {"pixel_values": {0: "batch"}, "image_features": {0: "batch"}}

    @abc.abstractmethod
    def example_vision_inputs(self, vision_config: dict, batch: int, dtype, seed: int = 0) -> dict[str, Any]:
        """Random graph inputs for `batch` images (export and ONNX validation)."""

    @abc.abstractmethod
    def hf_image_features(self, model, inputs: dict[str, Any]):
        """Image features through transformers' own path (reference for validation tests)."""

    def vision_axis(self, config_dict: dict, processor_dir: Path) -> VisionAxis | None:
        """How images fill the graph's dynamic axis under the engine's processor settings; None when
        axis 0 is a batch of whole images (one graph row per image)."""
        return None

    def triton_vision_files(self, vision_dir: Path, dest: Path) -> list[str]:
        """Files the stock `multimodal_encoders` model reads beside the vision engine (names written)."""
        return []

    # ---- prompt & images -------------------------------------------------------------------
    @abc.abstractmethod
    def load_processor(self, processor_dir: Path, vision_dir: Path | None = None) -> "FamilyProcessor":
        """The prompt and image processor of an engine or workspace: from its processor/ directory, and
        for families whose host-side packing reads a vision tensor, from its vision/ part."""

    @abc.abstractmethod
    def max_image_tokens(self, config_dict: dict, processor_dir: Path | None = None) -> int:
        """Upper bound of the feature rows one image becomes (sizes the prompt-embedding table), under
        the processor settings saved in `processor_dir` (dynamic-resolution families read their pixel or
        crop limits there), or the checkpoints' usual settings without it."""

    def min_image_tokens(self, config_dict: dict) -> int:
        """A lower bound of the prompt rows any one image becomes, from the config alone (a fixed count, or one
        crop or tile where images are cut into several); 0 where a family has none (sizes set by the processor's
        pixel limits, or images read in cross-attention). build-llm refuses a max_input_len with no room beside it."""
        return 0

    def apply_image_settings(self, processor_dir: Path, settings: dict) -> None:
        """Write a recipe's `image:` settings (min/max pixels) into the engine's processor config."""
        from ..errors import RecipeError

        raise RecipeError(f"image.{next(iter(settings))}: the {self.name} family has no such setting "
                          "(only dynamic-resolution models take min_pixels / max_pixels)")


class FamilyProcessor(abc.ABC):
    """Built from an engine's processor/ directory: turns chat messages and images into an EncodedPrompt.

    `encode` is the same for every family: render the chat template, find the image placeholders
    (`placeholder`, the text the template writes per image), make each image's ImageItem
    (`image_items`), replace each placeholder by the text its rows become (`image_text`), tokenize
    (`tokenize`), and check that the tokenizer kept one `image_token_id` per feature row
    (`make_prompt`). This is how the HF processors expand placeholders (in the text, before
    tokenizing). Families with `video = True` do the same for videos, in prompt order with the
    images: `video_placeholder`, `video_items`, `video_text`, one `video_token_id` per row. A family
    whose decoder reads images in cross-attention layers puts no rows in the prompt: its
    `make_prompt` says which images each token sees instead."""

    placeholder: str  # what the chat template writes per image
    image_token_id: int  # the id of each image row's position in the expanded prompt
    # Video families only: what the template writes per video, and the id of each video row's position
    # (-1: this checkpoint has no video token, so it takes no videos).
    video_placeholder: str = ""
    video_token_id: int = -1

    def __init__(self, family: VLMFamily, processor_dir: Path):
        from transformers import AutoTokenizer

        from .chat import load_chat_template

        self.family = family
        self.processor_dir = Path(processor_dir)
        self.config = read_json(self.processor_dir / "config.json")
        self.tokenizer = self._load_part("tokenizer", lambda: AutoTokenizer.from_pretrained(str(self.processor_dir)))
        self.chat_template = self._load_part("chat template",
                                             lambda: load_chat_template(self.processor_dir, self.tokenizer))
        self.image_processor = self._load_part("image processor", self.load_image_processor)

    def _load_part(self, part: str, load):
        """`load()`, where transformers' failure to read the part's files becomes a ProcessorFileError naming
        the file at fault (vlmctl's own errors pass as they are)."""
        from ..errors import VlmctlError

        try:
            return load()
        except VlmctlError:
            raise
        except Exception as e:  # tokenizers raises plain Exception for a tokenizer.json it cannot parse
            raise ProcessorFileError(part, self.processor_dir, e) from e

    def load_image_processor(self):
        """The checkpoint's image processor (transformers' Auto class unless the family names one)."""
        from transformers import AutoImageProcessor

        return AutoImageProcessor.from_pretrained(str(self.processor_dir))

    # ---- checks the families' set-up shares ---------------------------------------------------
    def config_token_id(self, *keys: str) -> int:
        """The first of `keys` that config.json sets (the image token's id)."""
        from ..errors import CheckpointError

        for k in keys:
            if self.config.get(k) is not None and int(self.config[k]) >= 0:
                return int(self.config[k])
        raise CheckpointError(f"{self.processor_dir}/config.json: no {keys[0]}")

    def require_token(self, token: str, what: str = "") -> int:
        """The id of `token`, which must be one token of the tokenizer's vocabulary."""
        from ..errors import CheckpointError

        tid = self.tokenizer.convert_tokens_to_ids(token)
        if tid is None or (tid == self.tokenizer.unk_token_id and token != self.tokenizer.unk_token):
            raise CheckpointError(f"{self.processor_dir}: the tokenizer has no {token!r} token{what}")
        return int(tid)

    # ---- the prompt ---------------------------------------------------------------------------
    def encode(self, messages: list[dict], images: list, tools: list[dict] | None = None, videos=(),
               video_limits=None, video_items: list | None = None) -> EncodedPrompt:
        """`tools`: OpenAI function tools (models/tool_calls.normalize_tools) for the template to show.
        `videos`: media.video.Video objects in the prompt order of the messages' `{"type": "video"}`
        parts, with `video_limits` (media.video.VideoLimits; its defaults when None); only families
        with `video = True` take them. `video_items`: their `video_items(videos, video_limits)` when the
        caller decoded them already (the server does, on a worker of its own). Images and videos are
        expanded in prompt order, and `EncodedPrompt.images` lists their items in that order."""
        from ..errors import InputError
        from .chat import render_chat

        videos = list(videos or [])
        if videos and not self.family.video:
            raise InputError(f"the {self.family.name} family takes no video input")
        if videos and self.video_token_id < 0:
            raise InputError(f"this {self.family.name} checkpoint has no video token, so it takes no videos")
        text = render_chat(self.tokenizer, self.chat_template, messages, tools)
        marks = {self.placeholder: "image"}
        if self.family.video and self.video_token_id >= 0:
            marks[self.video_placeholder] = "video"
        pieces, kinds = split_on_placeholders(text, marks)
        for kind, given in (("image", images), ("video", videos)):
            if kinds.count(kind) != len(given):
                raise InputError(f"the prompt has {kinds.count(kind)} {kind} placeholder(s) but {len(given)} "
                                 f"{kind}(s) were given")
        image_items = self.image_items(list(images), [image_hash(img) for img in images]) if images else []
        if not videos:
            video_items = []
        elif video_items is None:
            from ..media.video import VideoLimits

            video_items = self.video_items(videos, video_limits or VideoLimits())
        elif len(video_items) != len(videos):
            raise ValueError(f"{len(video_items)} prepared video items for {len(videos)} videos")
        queue = {"image": iter(image_items), "video": iter(video_items)}
        text_of = {"image": self.image_text, "video": self.video_text}
        ordered, expanded = [], [pieces[0]]
        for kind, rest in zip(kinds, pieces[1:]):
            item = next(queue[kind])
            ordered.append(item)
            expanded.append(text_of[kind](item) + rest)
        ids = [int(t) for t in self.tokenize("".join(expanded))]
        return self.make_prompt(ids, text, ordered, image_items, video_items)

    def make_prompt(self, ids: list[int], text: str, items: list[ImageItem], image_items: list[ImageItem],
                    video_items: list[ImageItem]) -> EncodedPrompt:
        """The EncodedPrompt of the expanded, tokenized prompt `ids` (`items`: its images and videos in
        prompt order), once the tokenizer is seen to have kept one image (video) token per feature row."""
        from ..errors import CheckpointError

        for kind, token_id, its in (("image", self.image_token_id, image_items),
                                    ("video", self.video_token_id, video_items)):
            if sum(1 for t in ids if t == token_id) != sum(it.num_tokens for it in its):
                raise CheckpointError(f"the tokenizer does not keep the {kind} token (id {token_id}) as one token per "
                                      "feature row")
        return EncodedPrompt(token_ids=ids, images=items, image_placeholder_id=self.image_token_id, text=text,
                             video_placeholder_id=self.video_token_id if video_items else -1)

    def image_items(self, images: list, hashes: list[str]) -> list[ImageItem]:
        """The ImageItems of one prompt's images, in order (a family whose items depend on the other
        images of the prompt overrides this; others implement `image_item`)."""
        return [self.image_item(img, h) for img, h in zip(images, hashes)]

    def image_item(self, image, content_hash: str) -> ImageItem:
        """One image's preprocessed inputs and row count."""
        raise NotImplementedError(f"{type(self).__name__} implements neither image_items nor image_item")

    @abc.abstractmethod
    def image_text(self, item: ImageItem) -> str:
        """The text one image's placeholder becomes: `item.num_tokens` image tokens, with whatever
        separators the family's processor puts around and between them."""

    def video_items(self, videos: list, limits) -> list[ImageItem]:
        """The ImageItems of one prompt's videos, in order (families with `video = True`): each video's
        frames sampled and preprocessed as the family's video processor does, its rows counted, its
        vision work split into `meta["parts"]` where one call would be larger than an image's (see
        `vision_parts`), within `limits` (media.video.VideoLimits: frames, pixels, decode bounds)."""
        raise NotImplementedError(f"{type(self).__name__} belongs to a family with video = True but has no video_items")

    def video_text(self, item: ImageItem) -> str:
        """The text one video's placeholder becomes (families with `video = True`): `item.num_tokens`
        video tokens, with whatever the family's processor puts around them."""
        raise NotImplementedError(f"{type(self).__name__} belongs to a family with video = True but has no video_text")

    def tokenize(self, text: str) -> list[int]:
        """The expanded prompt's ids, as the family's processor tokenizes it."""
        return list(self.tokenizer(text)["input_ids"])

    # ---- rows an image becomes ----------------------------------------------------------------
    @abc.abstractmethod
    def num_image_tokens(self, size: tuple[int, int]) -> int:
        """Feature rows an image of `size` = (width, height) pixels (PIL's `Image.size`) becomes when it
        is its prompt's only image."""

    def max_image_tokens(self) -> int:
        """Upper bound of `num_image_tokens` over every size, under this processor's settings."""
        return self.family.max_image_tokens(self.config, self.processor_dir)

    # ---- vision -------------------------------------------------------------------------------
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
        """Vision runner output for one image -> its [feature_rows, hidden] rows (for the prompt table,
        or the cross-attention layers)."""
        return features.reshape(-1, features.shape[-1])

    def run_vision(self, items: list[ImageItem], runner) -> list:
        """The feature rows ([feature_rows, hidden] torch tensors) of images that share a `batch_key`,
        from one call of `runner(feed) -> tensor` (a vision backend running the exported graph or
        the family's module): collate, run, split per image, postprocess. The runtime's vision
        encoder and AWQ's image-text calibration both go through here."""
        import torch

        from ..errors import EngineError

        feed, sizes = self.collate(items)
        out = runner(feed)
        rows = []
        for it, chunk in zip(items, torch.split(out, sizes)):
            feats = self.postprocess_features(chunk, it)
            if not isinstance(feats, torch.Tensor):
                feats = torch.from_numpy(np.ascontiguousarray(feats))
            feats = feats.reshape(-1, feats.shape[-1])
            if feats.shape[0] != it.feature_rows:
                raise EngineError(f"vision produced {feats.shape[0]} rows for an image expected to give "
                                  f"{it.feature_rows}")
            rows.append(feats)
        return rows

    def position_ids(self, token_ids: list[int], prompt: EncodedPrompt):
        """None for ordinary 1-D positions; families with multi-dimensional rotary override."""
        return None


def split_on_placeholders(text: str, marks: dict[str, str]) -> tuple[list[str], list[str]]:
    """`text` split at every occurrence of the placeholder strings in `marks` (placeholder -> kind):
    the pieces between them (one more than the placeholders) and each placeholder's kind, in order.
    A longer placeholder wins where one is a prefix of another."""
    import re

    marks = {m: k for m, k in marks.items() if m}
    pattern = "|".join(re.escape(m) for m in sorted(marks, key=len, reverse=True))
    parts = re.split(f"({pattern})", text)
    return parts[0::2], [marks[m] for m in parts[1::2]]


def read_json(path: Path) -> dict:
    with open(path) as f:
        return json.load(f)


# ---- what transformers refuses ------------------------------------------------------------------
def config_refusals() -> tuple[type[BaseException], ...]:
    """What building a transformers config (or a model from it) raises for values it refuses: ValueError
    and TypeError (its own checks, e.g. an unknown sub-config model type), KeyError (a rope type or an
    activation it does not know), and huggingface_hub's strict-dataclass validation errors (transformers
    5's configs are strict dataclasses: a field of the wrong type, a class validator such as
    `validate_architecture`). Not StrictDataclassDefinitionError: that is a broken class, a bug."""
    found: list[type[BaseException]] = [ValueError, TypeError, KeyError]
    try:
        from huggingface_hub.errors import StrictDataclassClassValidationError, StrictDataclassFieldValidationError
    except ImportError:  # a huggingface_hub without strict dataclasses raises none of them
        pass
    else:
        found += [StrictDataclassFieldValidationError, StrictDataclassClassValidationError]
    return tuple(found)


def refusal_text(e: BaseException, limit: int = 300) -> str:
    """What transformers said, on one line of at most `limit` characters: a strict-dataclass error by its
    cause (the validator's own words), a KeyError as `KeyError: 'key'`, others by their message."""
    if type(e).__name__.startswith("StrictDataclass") and e.__cause__ is not None:
        e = e.__cause__
    text = " ".join(str(e).split()[:limit])  # one line, however many transformers wrote
    if isinstance(e, KeyError) or not text:  # a KeyError's message is only the key
        text = f"{type(e).__name__}: {text}".rstrip(": ")
    return text if len(text) <= limit else text[:limit - 3] + "..."


# The files each processor part is read from, in the order that names the one at fault.
PART_FILES: dict[str, tuple[str, ...]] = {
    "tokenizer": ("tokenizer.json", "tokenizer.model", "vocab.json", "merges.txt", "tokenizer_config.json",
                  "special_tokens_map.json", "added_tokens.json"),
    "chat template": ("chat_template.jinja", "chat_template.json", "processor_config.json", "tokenizer_config.json"),
    "image processor": ("processor_config.json", "preprocessor_config.json"),
}
_MISSING = {
    "tokenizer": "no tokenizer.json, tokenizer.model or vocab.json",
    "chat template": "no chat template file",
    "image processor": "no preprocessor_config.json, nor an image_processor entry in processor_config.json",
}


class ProcessorFileError(Exception):
    """transformers cannot load a part of an engine's or workspace's processor (the tokenizer, the chat
    template, the image processor) from its files. Not a VlmctlError: whose fault it is depends on who
    loads. `vlmctl convert` blames the source checkpoint (a CheckpointError naming the source's file,
    `describe(src)`); the engine, its own damaged files (its EngineError points to `vlmctl verify`).

    `file`: the name of the file at fault, or None where the part has no file at all."""

    def __init__(self, part: str, processor_dir: Path, cause: BaseException):
        self.part = part
        self.processor_dir = Path(processor_dir)
        self.file = file_at_fault(self.processor_dir, part)
        if self.file is None:
            self.detail = _MISSING.get(part, f"no {part} files")
        else:
            first = (str(cause).strip().splitlines() or [""])[0][:200]
            self.detail = f"{type(cause).__name__}: {first}" if first else type(cause).__name__
        super().__init__(self.describe(Path(processor_dir)))

    def describe(self, directory: Path) -> str:
        """The one-line message with the file in `directory` (the converted copy's source, say)."""
        where = Path(directory) / self.file if self.file else Path(directory)
        detail = self.detail.replace(str(self.processor_dir), str(directory))  # transformers names the path it read
        return f"{where}: the {self.part} cannot be loaded ({detail})"


def file_at_fault(processor_dir: Path, part: str) -> str | None:
    """Which of `part`'s files a failed load blames: one that is not JSON where JSON belongs, else the one
    transformers reads first (the image processor: processor_config.json's `image_processor` entry, else
    preprocessor_config.json); None when there is none."""
    names = [n for n in PART_FILES.get(part, ()) if (processor_dir / n).is_file()]
    parsed: dict[str, Any] = {}
    for n in names:
        if n.endswith(".json"):
            try:
                parsed[n] = json.loads((processor_dir / n).read_text())
            except (OSError, UnicodeDecodeError, json.JSONDecodeError):
                return n
    if part == "image processor":
        nested = parsed.get("processor_config.json")
        if isinstance(nested, dict) and "image_processor" in nested:
            return "processor_config.json"
        return "preprocessor_config.json" if "preprocessor_config.json" in names else None
    return names[0] if names else None
