"""LLaVA-NeXT / LLaVA-1.6 (`LlavaNextForConditionalGeneration`): CLIP tower -> MLP projector -> Llama or
Mistral decoder, with anyres grid crops.

An image of (height, width) pixels becomes a base crop plus the crops of the grid pinpoint that
`select_best_resolution` picks; the vision graph runs per crop and the host stitches, unpads and
appends `image_newline` (llava_anyres.py). Its prompt length is
    grid**2  +  h' * w'  +  h'
where h' x w' is the crop grid's feature map (grid rows x grid columns of `image_size //
patch_size` patches each) with the image processor's padding cut away: e.g. 336-pixel crops
(24x24 patches) on a 672x672 pinpoint give at most 576 + 48*48 + 48 = 2928 rows.
Multi-image prompts give each image its full anyres form, as transformers does.
"""

from __future__ import annotations

from .llava_anyres import AnyresLlavaFamily


class LlavaNextFamily(AnyresLlavaFamily):
    name = "llava_next"
    architectures = ("LlavaNextForConditionalGeneration",)
    config_class = "LlavaNextConfig"
    model_class = "LlavaNextForConditionalGeneration"
    multi_image = True
