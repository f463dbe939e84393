"""Image-text calibration: decoder inputs that include the visual tokens.

A `.jsonl` calibration file whose records have an `image` (a path relative to the file, or a list
of paths) next to their `text` runs the whole VLM front end: each such record becomes a user turn
(images, then the text) rendered by the family's own chat template and processor, its images go
through the vision tower and projector (torch, float32), and the image feature rows replace the
placeholder embeddings exactly as the runtime's prompt-embedding table does. Records without an
image are plain tokenized text. The embedded sequences are concatenated and cut into blocks of
`seq_len` rows (records are not skipped for length: one image alone is often longer than a block).

Positions inside a block are 1-D (0..seq_len-1) for every family, including those with
multi-dimensional rotary positions: this is calibration statistics, not inference.

Families whose decoder reads images in cross-attention layers (Llama 3.2 Vision) have no image rows
to splice in: `cross_attention_calibration` makes one sample per image record instead - its token
embeddings, its image states and transformers' cross-attention masks - so the cross-attention
layers see what they see at inference.
"""

from __future__ import annotations

import random
from pathlib import Path

from ..errors import EngineError, InputError
from ..formats.prompt_table import fake_ids
from ..formats.workdir import Workspace
from ..progress import Progress, ensure
from .calibration import DEFAULT_SEED, _resolve, jsonl_objects


def read_image_text_records(spec: str | None, base_dir: Path | None = None) -> list[dict] | None:
    """[{"text", "images": [Path]}] when `spec` is a .jsonl file with at least one image; else None."""
    if not spec:
        return None
    path = _resolve(spec, base_dir)
    if not (path.is_file() and path.suffix in (".jsonl", ".json")):
        return None
    records, any_image = [], False
    for n, obj in jsonl_objects(path):
        if isinstance(obj, str):
            obj = {"text": obj}
        if not isinstance(obj, dict) or not isinstance(obj.get("text", ""), str):
            raise InputError(f"{path}:{n}: expected an object with a string \"text\" field")
        imgs = obj.get("images", obj.get("image")) or []
        imgs = [imgs] if isinstance(imgs, str) else imgs
        if not isinstance(imgs, list) or not all(isinstance(i, str) for i in imgs):
            raise InputError(f"{path}:{n}: \"image\" must be a path or a list of paths")
        paths = [(path.parent / i) if not Path(i).is_absolute() else Path(i) for i in imgs]
        for p in paths:
            if not p.is_file():
                raise InputError(f"{path}:{n}: image {p} not found")
        any_image = any_image or bool(paths)
        records.append({"text": obj.get("text", ""), "images": paths, "line": n})
    return records if any_image else None


def _front_end(workspace):
    """(processor, vision runner, float32 token embeddings, embedding scale) of a conversion workspace: the
    family's processor and its own torch vision module, float32 on the CPU (the reference the exported
    graphs are checked against)."""
    import torch

    from ..models.registry import get_family
    from .awq import embedding_scale, embedding_weight

    workspace = workspace if isinstance(workspace, Workspace) else Workspace(Path(workspace))
    family = get_family(workspace.family_name())
    processor = family.load_processor(workspace.processor, workspace.vision)
    module = family.build_vision_module(workspace.vision, torch.float32).eval()

    def run(feed):
        return module(*[torch.from_numpy(v) for v in feed.values()])

    return (processor, run, embedding_weight(workspace.llm).to(torch.float32), embedding_scale(workspace.llm))


def image_text_embeddings(workspace: Workspace, records: list[dict], samples: int, seq_len: int,
                          seed: int = DEFAULT_SEED, progress: Progress | None = None):
    """Float32 decoder input embeddings [n, seq_len, hidden] from a conversion workspace."""
    import torch

    progress = ensure(progress)
    processor, run, embed, scale = _front_end(workspace)
    tokenizer = processor.tokenizer
    vocab = embed.shape[0]

    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    need = samples * seq_len
    pieces, total = [], 0
    task = progress.task("awq: embedding image-text calibration records", total=len(records))
    with torch.inference_mode():
        for i in order:
            rec = records[i]
            if rec["images"]:
                images = _load_images(rec)
                content = [{"type": "image"} for _ in images] + [{"type": "text", "text": rec["text"]}]
                prompt = processor.encode([{"role": "user", "content": content}], images)
                table = torch.cat(_image_rows(processor, prompt.images, run))
                try:  # the runtime's prompt-table contract: row `id - vocab` of the table for each fake id
                    ids = torch.from_numpy(fake_ids(prompt.token_ids, prompt.image_placeholder_id, vocab,
                                                    table.shape[0]))
                except EngineError as e:
                    raise InputError(f"calibration record at line {rec['line']}: {e.message}") from None
                rows = ids >= vocab
                x = embed[ids.clamp(max=vocab - 1)] * scale
                x[rows] = table[ids[rows] - vocab]  # image rows are never scaled
            else:
                ids = torch.tensor(tokenizer.encode(rec["text"]), dtype=torch.long)
                if ids.numel() == 0:
                    continue
                x = embed[ids] * scale
            pieces.append(x)
            total += x.shape[0]
            task.advance()
            if total >= need:
                break
    task.done()
    n = min(samples, total // seq_len)
    if n == 0:
        raise InputError(f"image-text calibration gave {total} positions; need at least one block of {seq_len}")
    return torch.cat(pieces)[: n * seq_len].view(n, seq_len, -1)


def _image_rows(processor, items: list, run) -> list:
    """Feature rows of each image, in order; images that can share a vision call share one."""
    groups: dict[tuple, list[int]] = {}
    for i, it in enumerate(items):
        groups.setdefault(processor.batch_key(it), []).append(i)
    rows: list = [None] * len(items)
    for idx in groups.values():
        for i, r in zip(idx, processor.run_vision([items[i] for i in idx], run)):
            rows[i] = r
    return rows


def _load_images(rec: dict) -> list:
    from PIL import Image

    from ..media.images import flatten_to_rgb

    images = []
    for p in rec["images"]:
        try:
            images.append(flatten_to_rgb(Image.open(p)))
        except OSError as e:
            raise InputError(f"calibration record at line {rec['line']}: cannot read image {p} ({e})") from None
    return images


def cross_attention_calibration(workspace: Workspace, records: list[dict], samples: int, seq_len: int,
                                seed: int = DEFAULT_SEED, progress: Progress | None = None):
    """(token embeddings [n, seq_len, hidden], {"states": [n, R, hidden], "mask": [n, 1, seq_len, R],
    "rowmask": [n, 1, seq_len, 1], "ids": [n, seq_len]}) for a decoder with cross-attention layers, float32.

    One sample per record with images: its user turn (images, then text) rendered by the family's
    template, cut at `seq_len` or continued with the other records' text (tokens that see the
    record's images, as generated tokens would). `states` are the images' vision outputs (R: the most
    rows of any sample; a sample's extra rows are masked for every token), `mask` is transformers'
    additive cross-attention mask (a token sees its images' real tiles; a token before the first
    image sees every row of its own images) and `rowmask` 0 where a token sees no image yet."""
    import numpy as np
    import torch

    progress = ensure(progress)
    processor, run, embed, scale = _front_end(workspace)
    tokenizer = processor.tokenizer

    order = list(range(len(records)))
    random.Random(seed).shuffle(order)
    with_images = [records[i] for i in order if records[i]["images"]][:samples]
    filler = [t for i in order for t in tokenizer(records[i]["text"], add_special_tokens=False)["input_ids"]]
    embeds, states, masks, rowmasks, all_ids = [], [], [], [], []
    at = 0  # where the filler stream continues
    task = progress.task("awq: embedding image-text calibration records", total=len(with_images))
    with torch.inference_mode():
        for rec in with_images:
            content = [{"type": "image"} for _ in rec["images"]] + [{"type": "text", "text": rec["text"]}]
            prompt = processor.encode([{"role": "user", "content": content}], _load_images(rec))
            ids = list(prompt.token_ids)[:seq_len]
            seen = np.asarray(prompt.cross.token_images)[:seq_len]
            while len(ids) < seq_len and filler:
                take = filler[at:at + seq_len - len(ids)]
                if not take:  # the stream ran out: from its start again
                    at = 0
                    continue
                ids += take
                at += len(take)
            if len(ids) < seq_len:
                raise InputError(f"calibration record at line {rec['line']}: {len(ids)} tokens and no text to fill "
                                 f"a block of {seq_len}")
            seen = np.concatenate([seen, np.repeat(seen[-1:], seq_len - len(seen), 0)])
            feats = torch.cat([r.float() for r in _image_rows(processor, prompt.images, run)])
            first = np.concatenate([[0], np.cumsum(prompt.cross.image_rows)])
            mask = torch.zeros(seq_len, feats.shape[0], dtype=torch.bool)
            for t, (f, e) in enumerate(seen):
                if f < e:
                    for k in range(f, e):
                        mask[t, first[k]:first[k] + prompt.cross.visible_rows[k]] = True
                else:
                    mask[t] = True  # no image in view yet: every row (transformers' full-row rule)
            embeds.append(embed[torch.tensor(ids)] * scale)
            all_ids.append(torch.tensor(ids))
            states.append(feats)
            masks.append(mask)
            rowmasks.append(torch.from_numpy(seen[:, 0] < seen[:, 1]))
            task.advance()
    task.done()
    if not embeds:
        raise InputError("image-text calibration has no record with an image")
    R = max(s.shape[0] for s in states)
    n = len(embeds)
    out_states = torch.zeros(n, R, embed.shape[1])
    out_mask = torch.full((n, 1, seq_len, R), torch.finfo(torch.float32).min)
    for j, (st, m) in enumerate(zip(states, masks)):
        out_states[j, :st.shape[0]] = st
        out_mask[j, 0, :, :st.shape[0]].masked_fill_(m, 0.0)
    rowmask = torch.stack(rowmasks).to(torch.float32)[:, None, :, None]
    return torch.stack(embeds), {"states": out_states, "mask": out_mask, "rowmask": rowmask,
                                 "ids": torch.stack(all_ids)}


def calibration_files(spec: str | None, base_dir: Path | None = None) -> list[Path]:
    """Every file a calibration source reads (the .jsonl and its images), for cache keys."""
    if not spec:
        return []
    path = _resolve(spec, base_dir)
    if not path.is_file():
        return []
    records = read_image_text_records(spec, base_dir) or []
    return [path] + sorted({p for r in records for p in r["images"]})
