"""The gemma3 family's images on the data side (mmpipe.data.image_kinds' protocol): LLaVA's fixed-size placeholders,
each image's block bracketed by Gemma 3's <start_of_image> / <end_of_image> ids (the config's vision_start_id /
vision_end_id), and one image read by transformers' own Gemma3ImageProcessor.

transformers' Gemma3Processor (5.25, processing_gemma3.py) renders the chat template with <start_of_image> where an
image goes, then turns each into its full_image_sequence, "\\n\\n<start_of_image>" + 256 x <image_soft_token> +
"<end_of_image>\\n\\n", and tokenises the whole: the blank lines are text, read with their neighbours (Gemma's
tokenizer has tokens for runs of newlines, so "user\\n" + "\\n\\n" is one "\\n\\n\\n"). A row holds the same ids: the
marker becomes the tokenizer's own <start_of_image> (a special token, so the text splits there as the processor's
does), the blank lines go in around it after the template (text.MarkerText; the template trims a turn's ends), and
the marker's token makes way for the block, e.g. gemma3-tiny's 4 soft tokens at ids 60, bracketed by 61 and 62:
[61, 60, 60, 60, 60, 62], 6 positions. The built-in tokenizer (not Gemma's) keeps LLaVA's <image> marker, no lines.

Pan-and-scan (vision.pan_and_scan, from the checkpoint's do_pan_and_scan: `Gemma3PanScan`): transformers'
Gemma3ImageProcessor cuts an image whose long side is at least min_ratio x its short one into K crops along it
(K = round(long / short), at most long / min_crop and max_crops, at least 2; none when a crop would be under
min_crop px), and Gemma3Processor writes "Here is the original image <block> and here are some crops to help you see
better <block> <block> ..." for it: the whole image's block, then each crop's. Here each of the 1 + K is an image slot
of its own (records.ImageSlot) at a marker of its own in that text (taken from Gemma3Processor.replace_image_token,
not retyped), so the index counts the crops' blocks and the connecting words before any pixel is read, and the tower
encodes every crop as an image. K comes from the image's size alone (its header, EXIF orientation applied), by the
processor's own pan_and_scan_batched on a shape-only tensor; the slots' pixels are the processor's pixel_values for
the image, in its order. E.g. at gemma3-tiny's 32 px, min_crop 8, max_crops 4, ratio 1.2: a 96 x 32 (W x H) image
gets round(3.0) = 3 crops of 32 x 32, 4 slots and 4 x 6 = 24 block positions; a 40 x 36 one (ratio 1.11) none.
--max-images counts slots: the 96 x 32 image alone needs --max-images 4.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..config import ModelConfig
from .blocks import FixedBlocks
from .image_kinds import Placeholders
from .images import _our_pil_settings, _resolve, open_image
from .records import BadRecord, ImageSlot, with_markers
from .text import MarkerText
from .tokenizer import BUILTIN_TEMPLATE


@dataclass(frozen=True)
class BracketedBlocks(FixedBlocks):
    """FixedBlocks whose N positions are start_id, N - 2 placeholders, end_id."""
    start_id: int = -1
    end_id: int = -1

    def block(self, grid=None) -> np.ndarray:
        return np.array([self.start_id] + [self.image_id] * (self.image_len - 2) + [self.end_id], dtype=np.int64)


@dataclass(frozen=True)
class Gemma3Images(Placeholders):
    name = "gemma3"
    # its placeholder is the config's <image_soft_token> id, never the built-in tokenizer's <image> (a LLaVA
    # processor would expand that one): mmpipe.run_config keeps the id, mmpipe.hf.bundle writes no LlavaProcessor
    image_token = False
    # the text Gemma3Processor writes before and after each image's block (its full_image_sequence, module
    # docstring); None: none (Gemma 4's processor writes its block alone: mmpipe.data.gemma4)
    around = ("\n\n", "\n\n")

    @property
    def slot_key(self) -> list | None:
        """What an index's words depend on beyond the tokenizer: the blank lines (an index made before them is
        made anew)."""
        return ["around", *self.around] if self.around else None

    def marker_text(self, tok, cfg: ModelConfig) -> str | None:
        """What an image marker becomes in the text: the tokenizer's <start_of_image> (the config's vision_start_id)
        with the blank lines around it (MarkerText); None (LLaVA's <image> marker) for the built-in tokenizer, one
        without that special token, or a kind without the lines."""
        if not self.around or getattr(tok, "chat_template", None) == BUILTIN_TEMPLATE or \
                not 0 <= cfg.vision_start_id < len(tok):
            return None
        name = tok.convert_ids_to_tokens(cfg.vision_start_id)
        if name is None or tok(name, add_special_tokens=False).input_ids != [cfg.vision_start_id]:
            return None
        return MarkerText(name, *self.around)

    def blocks(self, cfg: ModelConfig, max_images: int, budget: int):
        return BracketedBlocks(cfg.vision.n_features + 2, cfg.image_token_id, cfg.vision_start_id, cfg.vision_end_id)

    def sample_positions(self, cfg: ModelConfig, max_images: int, budget: int) -> int:
        """A bracketed block for each of up to M images: e.g. (256 + 2) x 2 = 516 for two images."""
        return (cfg.vision.n_features + 2) * max(1, max_images)

    def with_images(self, ids: list[int], cfg: ModelConfig, image_at, grids=()) -> list[int]:
        """A prompt with a bracketed block before ids[a] for each a in image_at (after BOS when None)."""
        out, block = list(ids), self.blocks(cfg, 1, 0).block().tolist()
        for a in sorted((1,) if image_at is None else (int(a) for a in image_at), reverse=True):
            out[a:a] = block  # last first: the earlier positions stay where image_at says
        return out

    def one_image(self, cfg: ModelConfig):
        """PIL image -> [3, S, S] by transformers' Gemma3ImageProcessor at the model's size, mean and std (resized
        to S x S whatever its aspect, rescaled, normalised), as Gemma3Processor feeds the model."""
        from transformers import Gemma3ImageProcessor
        v = cfg.vision
        proc = Gemma3ImageProcessor(size={"height": v.image_size, "width": v.image_size}, image_mean=list(v.mean),
                                    image_std=list(v.std))
        return lambda image: proc(image, return_tensors="pt")["pixel_values"][0]

    def of(self, cfg: ModelConfig):
        """The kind of cfg's images (image_kinds.image_kind asks): pan-and-scan's where its processor cuts crops."""
        v = cfg.vision
        if not v.pan_and_scan:
            return self
        return Gemma3PanScan(v.image_size, tuple(v.mean), tuple(v.std), v.pan_and_scan_min_crop,
                             v.pan_and_scan_max_crops, v.pan_and_scan_min_ratio)


@dataclass(frozen=True)
class Gemma3PanScan(Gemma3Images):
    """Gemma 3's images under pan-and-scan (module docstring): the processor's settings, what a slot's pixels and an
    image's crop count depend on."""
    size: int = 896
    mean: tuple = (0.5, 0.5, 0.5)
    std: tuple = (0.5, 0.5, 0.5)
    min_crop: int = 256
    max_crops: int = 4
    min_ratio: float = 1.2

    @property
    def slot_key(self) -> list:
        """What an index's slots and words depend on (its fingerprint): the processor's settings, the blank lines."""
        return ["pan_and_scan", self.size, self.min_crop, self.max_crops, self.min_ratio, *(self.around or ())]

    @property
    def slots_per_image(self) -> int:
        """The most slots one image takes: the whole image and max_crops crops (`mmpipe eval` reads one image a
        record, its slots all)."""
        return 1 + self.max_crops

    def augment_refusal(self, cfg: ModelConfig) -> str | None:
        return ("--augment: pan-and-scan images are resized and cut by transformers' Gemma3ImageProcessor, which has "
                "no augmentation; drop --augment")

    def crops(self, width: int, height: int) -> int:
        """K, the crops the processor cuts a width x height image into (0: none), by its own pan_and_scan_batched on
        a shape-only (meta) tensor, e.g. 96 x 32 at min_crop 8: 3."""
        shape = torch.empty(3, height, width, device="meta")
        return len(_processor(self).pan_and_scan_batched(shape, self.min_crop, self.max_crops, self.min_ratio))

    def with_timestamps(self, rec, rule, image_root, marker: str):
        """The record as the processor lays it out: each image's marker becomes Gemma3Processor's text for its K
        crops with a marker at each block, the image its 1 + K slots (ImageSlot); a record without markers gets
        them at the start of its first user turn. BadRecord for an image whose header cannot be read."""
        from types import SimpleNamespace

        from transformers import Gemma3Processor
        texts, slots = [], []
        for ref in rec.images:
            k = self.crops(*oriented_size(ref, image_root))
            # the processor's own words, each image block of them our marker
            texts.append(Gemma3Processor.replace_image_token(SimpleNamespace(full_image_sequence=marker),
                                                             {"num_crops": [k]}, 0))
            slots += [ImageSlot(ref, j, 1 + k) for j in range(1 + k)]
        if not texts:
            return rec
        if not any(marker in text for role, text in rec.messages if role == "user"):
            first = next(i for i, (role, _) in enumerate(rec.messages) if role == "user")
            rec = dataclasses.replace(rec, messages=[(r, marker * len(texts) + t if i == first else t)
                                                     for i, (r, t) in enumerate(rec.messages)])
        return dataclasses.replace(rec, messages=with_markers(rec.messages, marker, texts), images=slots)

    def slot_pixels(self, slot: ImageSlot, image_root, max_pixels: int) -> torch.Tensor:
        """[3, S, S]: the processor's pixel_values[slot.crop] of the slot's image (the whole image, then its crops)."""
        key = slot.ref if isinstance(slot.ref, (str, bytes)) else None  # a dict or a PIL image: not cached
        out = _slots(self, key, image_root, max_pixels) if key is not None else \
            _processor(self)(open_image(slot.ref, image_root, max_pixels), return_tensors="pt")["pixel_values"]
        if len(out) != slot.of:
            raise RuntimeError(f"{slot.ref}: the image processor cut {len(out)} slots, the index recorded {slot.of}: "
                               f"the data changed after it was checked at start-up; restore it, or start a new run")
        return out[slot.crop]


@functools.lru_cache(maxsize=8)
def _processor(kind: Gemma3PanScan):
    from transformers import Gemma3ImageProcessor
    return Gemma3ImageProcessor(size={"height": kind.size, "width": kind.size}, image_mean=list(kind.mean),
                                image_std=list(kind.std), do_pan_and_scan=True,
                                pan_and_scan_min_crop_size=kind.min_crop, pan_and_scan_max_num_crops=kind.max_crops,
                                pan_and_scan_min_ratio_to_activate=kind.min_ratio)


@functools.lru_cache(maxsize=2)  # an image's 1 + K slots are read one after the other: processed once
def _slots(kind: Gemma3PanScan, ref, image_root, max_pixels: int) -> torch.Tensor:
    return _processor(kind)(open_image(ref, image_root, max_pixels), return_tensors="pt")["pixel_values"]


def oriented_size(ref, image_root) -> tuple[int, int]:
    """(width, height) of a record's image as open_image returns it (EXIF orientation applied), from its header
    alone; BadRecord where it cannot be opened (the index's full check names the file's other faults)."""
    from PIL import Image

    def turned(im) -> tuple[int, int]:
        w, h = im.size
        return (h, w) if im.getexif().get(0x0112) in (5, 6, 7, 8) else (w, h)  # EXIF Orientation: a quarter turn
    with _our_pil_settings():
        if isinstance(ref, Image.Image):
            return turned(ref)
        source, name = _resolve(ref, image_root)
        try:
            with Image.open(source) as im:
                return turned(im)
        except Exception as e:  # PIL's UnidentifiedImageError, OSError, ...
            raise BadRecord("corrupt_image", f"{name}: cannot read the image header "
                                             f"({' '.join(str(e).split()) or type(e).__name__})") from None


GEMMA3_IMAGES = Gemma3Images()
