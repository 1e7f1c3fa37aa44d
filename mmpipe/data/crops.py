"""moondream's multi-crop preprocessing: a global crop plus overlapping local crops, in fixed slots.

moondream2 does not pad or squash an image to one 378 px square only. It also tiles a resized
copy of the image into up to `max_crops` (12) local crops of 378 px that overlap by
2 x `overlap_margin` patches, encodes every crop with the vision tower, stitches the local
crops' features back into one grid (`mmpipe/model/crops.py`) and pools that to 27 x 27, next
to the global crop's 27 x 27. This module is the data half: the rule that picks the tiling and
cuts the crops, bit-for-bit what moondream's Pillow path cuts (tests/test_crops.py checks it
against recorded outputs of moondream's own code).

The rule, with moondream's numbers (crop 378 px = 27 patches x 14 px, margin 4 patches):
- margin = 4 x 14 = 56 px on each side; a crop's window (what it adds over its neighbour) is
  27 - 2 x 4 = 19 patches = 266 px.
- tiling (rows, cols) = select_tiling(height - 112, width - 112, 266, max_crops): the image less
  its two outer margins, tiled with 266 px windows (see select_tiling for the choice), capped at
  max_crops where moondream's rule overshoots it (very long images; see crop_tiling).
- the image is resized (squashed, LANCZOS) to (rows x 266 + 112) x (cols x 266 + 112) px
  (height x width), e.g. 2 x 266 + 112 = 644, and crop (i, j) is its 378 x 378 px square at
  (i x 266, j x 266): the last one ends exactly at the edge ((rows - 1) x 266 + 378 = rows x 266 + 112), so no crop is
  ever padded, and neighbours share 378 - 266 = 112 px = 8 patches.
- the global crop is the whole image squashed (LANCZOS) to 378 x 378.
- pixels / 255, then (x - 0.5) / 0.5 (the vision config's mean / std), in float32 (moondream
  divides in bfloat16). Always Pillow: moondream uses libvips when pyvips imports, which
  resamples differently (docs/data.md has the measured difference).

Every image gives 1 + rows x cols crops (at least 2: a 1 x 1 tiling still has its local crop).
A batch needs fixed shapes, so overlap_crops returns 1 + max_crops slots, global first, then the
local crops row-major, the rest zeros, with a valid mask and the tiling. The vision tower encodes
every slot: 1 + max_crops (13) ViT passes per image, whatever its size.
"""
from __future__ import annotations

import math
from typing import NamedTuple

import numpy as np
import torch
from PIL import Image

from ..config import VisionConfig
from .images import ImageTransform, to_rgb

# moondream2's defaults (moondream/torch/config.py, VisionConfig): 378 px crops of 27 x 27
# patches of 14 px, at most 12 local crops, neighbours overlapping by 2 x 4 patches.
CROP_SIZE = 378  # = 27 x 14
PATCH_SIZE = 14
MAX_CROPS = 12
OVERLAP_MARGIN = 4  # patches


class Crops(NamedTuple):
    """One image's crops in fixed slots: pixels [1 + max_crops, 3, S, S] float32 (slot 0 the global
    crop, then the local crops row-major, then zeros), valid [1 + max_crops] long (1 for the
    1 + rows x cols real crops, 0 for padding), tiling (rows, cols)."""
    pixels: torch.Tensor
    valid: torch.Tensor
    tiling: tuple[int, int]


def select_tiling(height: int, width: int, crop_size: int, max_crops: int) -> tuple[int, int]:
    """(rows, cols) of crop_size tiles for a height x width area, at most max_crops of them.

    - An area no taller or no wider than one tile: (1, 1).
    - At least ceil(side / crop_size) tiles per side are needed to cover it at full scale. If even
      that is over budget, both counts are scaled by sqrt(budget / needed), floored (at least 1):
      the image is then shrunk to fit, keeping roughly its aspect.
    - Otherwise the tiles follow the aspect ratio at the full budget, rows = floor(sqrt(budget x
      h / w)), cols = floor(sqrt(budget x w / h)), raised to the minimum; if that is over budget
      the larger count (rows on a tie) is cut to floor(budget / the other).
    E.g. 528 x 788 (a 640 x 900 image less its margins) in 266 px tiles, budget 12: needs 2 x 3;
    sqrt(12 x 528 / 788) = 2.8 -> 2 rows, sqrt(12 x 788 / 528) = 4.2 -> 4 cols: 2 x 4 = 8 <= 12.

    This is moondream's rule exactly, including its one flaw: the "at least 1" after scaling can
    exceed the budget for long thin areas. E.g. 277 x 7449 (a 389 x 7561 px image less margins)
    needs 2 x 29 = 58 tiles; scale sqrt(12 / 58) = 0.455: floor(0.91) = 0 -> 1 row, but
    floor(13.2) = 13 cols, 13 > 12. crop_tiling caps that; this function does not, so it can be
    compared with moondream's.
    """
    if max_crops < 1:
        raise ValueError(f"max_crops must be >= 1, got {max_crops}")
    if height <= crop_size or width <= crop_size:
        return 1, 1
    need_rows, need_cols = math.ceil(height / crop_size), math.ceil(width / crop_size)
    if need_rows * need_cols > max_crops:
        scale = math.sqrt(max_crops / (need_rows * need_cols))
        return max(1, math.floor(need_rows * scale)), max(1, math.floor(need_cols * scale))
    rows = max(math.floor(math.sqrt(max_crops * height / width)), need_rows)
    cols = max(math.floor(math.sqrt(max_crops * width / height)), need_cols)
    if rows * cols > max_crops:
        if cols > rows:
            cols = math.floor(max_crops / rows)
        else:
            rows = math.floor(max_crops / cols)
    return max(1, rows), max(1, cols)


def crop_tiling(height: int, width: int, max_crops: int = MAX_CROPS, overlap_margin: int = OVERLAP_MARGIN,
                crop_size: int = CROP_SIZE, patch_size: int = PATCH_SIZE) -> tuple[int, int]:
    """The tiling an image of height x width px gets: its size less the two outer margins (2 x 4 x
    14 = 112 px), in windows of (27 - 2 x 4) x 14 = 266 px. Cheap: decided from the size alone."""
    margin_px, window = _geometry(overlap_margin, crop_size, patch_size)
    rows, cols = select_tiling(height - 2 * margin_px, width - 2 * margin_px, window, max_crops)
    # The one departure from moondream: its rule can give more tiles than the budget for images
    # about 19 times longer than wide or more (at 12: 389 x 7561 px -> 1 x 13, 500 x 20000 -> 1 x 21),
    # which fixed 1 + max_crops slots cannot hold; the longer side is cut to fit, as select_tiling
    # itself does when the aspect-ratio tiling is over budget (1 x 21 -> 1 x 12: squashed harder).
    if rows * cols > max_crops:
        if cols > rows:
            cols = max_crops // rows
        else:
            rows = max_crops // cols
    return rows, cols


def _geometry(overlap_margin: int, crop_size: int, patch_size: int) -> tuple[int, int]:
    """(margin in px, window in px): 4 x 14 = 56 and (27 - 8) x 14 = 266 for moondream."""
    if crop_size % patch_size:
        raise ValueError(f"crop size {crop_size} is not a whole number of {patch_size} px patches")
    grid = crop_size // patch_size
    if overlap_margin < 0 or 2 * overlap_margin >= grid:
        raise ValueError(f"overlap margin {overlap_margin} must be in 0..{(grid - 1) // 2} patches "
                         f"for {grid}-patch crops")
    return overlap_margin * patch_size, (grid - 2 * overlap_margin) * patch_size


def cut_crops(image: Image.Image, max_crops: int = MAX_CROPS, overlap_margin: int = OVERLAP_MARGIN,
              crop_size: int = CROP_SIZE, patch_size: int = PATCH_SIZE) -> tuple[np.ndarray, tuple[int, int]]:
    """uint8 [1 + rows x cols, S, S, 3] crops (global first, local row-major) and (rows, cols)."""
    if image.mode != "RGB":
        image = to_rgb(image)
    width, height = image.size
    margin_px, window = _geometry(overlap_margin, crop_size, patch_size)
    rows, cols = crop_tiling(height, width, max_crops, overlap_margin, crop_size, patch_size)
    # squash to the tiling's exact size: rows windows plus the two outer margins per axis
    resized = np.asarray(image.resize((cols * window + 2 * margin_px, rows * window + 2 * margin_px),
                                      resample=Image.Resampling.LANCZOS))
    crops = np.empty((1 + rows * cols, crop_size, crop_size, 3), dtype=np.uint8)
    crops[0] = np.asarray(image.resize((crop_size, crop_size), resample=Image.Resampling.LANCZOS))
    for i in range(rows):
        for j in range(cols):
            y, x = i * window, j * window
            crops[1 + i * cols + j] = resized[y:y + crop_size, x:x + crop_size]
    return crops, (rows, cols)


def overlap_crops(image: Image.Image, max_crops: int = MAX_CROPS, overlap_margin: int = OVERLAP_MARGIN,
                  crop_size: int = CROP_SIZE, patch_size: int = PATCH_SIZE,
                  mean: tuple[float, ...] = (0.5, 0.5, 0.5), std: tuple[float, ...] = (0.5, 0.5, 0.5)) -> Crops:
    """An image's crops in 1 + max_crops fixed slots, normalised: see Crops."""
    crops, tiling = cut_crops(image, max_crops, overlap_margin, crop_size, patch_size)
    n = crops.shape[0]
    pixels = torch.zeros(1 + max_crops, 3, crop_size, crop_size)
    real = torch.from_numpy(crops).permute(0, 3, 1, 2).float().div_(255)
    mean_t, std_t = torch.tensor(mean).view(1, 3, 1, 1), torch.tensor(std).view(1, 3, 1, 1)
    pixels[:n] = (real - mean_t) / std_t
    valid = torch.zeros(1 + max_crops, dtype=torch.long)
    valid[:n] = 1
    return Crops(pixels, valid, tiling)


class CropTransform:
    """PIL image -> Crops, with the vision config's crop size, patch size, mean and std: the multi-crop
    counterpart of images.ImageTransform (which makes one [3, S, S] tensor). No augmentation:
    the crops' geometry is what the stitch rule on the model side assumes."""

    def __init__(self, vision: VisionConfig, max_crops: int = MAX_CROPS, overlap_margin: int = OVERLAP_MARGIN):
        _geometry(overlap_margin, vision.image_size, vision.patch_size)  # refuse a bad geometry now
        if max_crops < 1:
            raise ValueError(f"max_crops must be >= 1, got {max_crops}")
        self.vision, self.max_crops, self.overlap_margin = vision, max_crops, overlap_margin

    @property
    def slots(self) -> int:  # crops the vision tower encodes per image: 1 global + the budget
        return 1 + self.max_crops

    def __call__(self, img: Image.Image) -> Crops:
        v = self.vision
        return overlap_crops(img, self.max_crops, self.overlap_margin, v.image_size, v.patch_size, v.mean, v.std)


def make_transform(vision: VisionConfig, resize: str = "pad", augment: bool = False):
    """The image transform a model's config asks for: moondream multi-crop (vision.max_crops > 0, so more than one
    crop slot: CropTransform, PIL image -> Crops) or one crop (ImageTransform, PIL image -> [3, S, S])."""
    if vision.crop_slots > 1:
        return CropTransform(vision, vision.max_crops, vision.overlap_margin)
    return ImageTransform(vision, resize=resize, augment=augment)


def blank_image(size: int, max_crops: int = 0):
    """A text-only sample's image: zeros, which the decoder masks out; multi-crop: every slot zero,
    tiled 1 x 1 (the Projector stitches one zero crop; the decoder masks it all the same)."""
    if not max_crops:
        return torch.zeros(3, size, size)
    valid = torch.zeros(1 + max_crops, dtype=torch.long)
    valid[:2] = 1
    return Crops(torch.zeros(1 + max_crops, 3, size, size), valid, (1, 1))


def stack_images(images: list) -> tuple[torch.Tensor, torch.Tensor | None]:
    """Images for one batch, as the model takes them: (pixels [B, 3, S, S], None), or multi-crop
    (pixels [B, 1 + max_crops, 3, S, S], tiling long [B, 2])."""
    if images and isinstance(images[0], Crops):
        return (torch.stack([c.pixels for c in images]),
                torch.tensor([c.tiling for c in images], dtype=torch.long))
    return torch.stack(images), None
