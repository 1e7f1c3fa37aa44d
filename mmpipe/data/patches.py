"""Dynamic-resolution images (the Qwen2-VL family, image kind patches): an image -> its patch grid and
its flattened patches, through transformers' own Qwen2VLImageProcessor (its resize rule smart_resize,
min / max pixels, its patch order), which this module calls rather than copies.

An image of W x H pixels is resized to h' x w', both multiples of patch x merge (28 for Qwen) and
min_pixels <= h' w' <= max_pixels, aspect kept; that is the grid (t, h, w) = (1, h' / p, w' / p)
patches (an image is `temporal_patch_size` identical frames, one temporal patch). Its patches are
[t h w, C T p p] floats in the processor's order (merge units of merge^2 consecutive patches), and
it takes t h w / merge^2 decoder positions (+ <|vision_start|> and <|vision_end|>).

The grid depends on W and H alone, so the data index records it from the image's size (no pixel is
needed afterwards): every stage knows each image's positions and grid (`tiling`) without decoding it.

A row's patch budget P (--max-patches) bounds a sample's images too: the max_pixels of each of a
sample's n images is min(vision.max_pixels, P / n x p^2), so an image too large for the row is resized
down by the processor's own rule, never cropped. Default P: --max-images x vision.max_pixels / p^2 patches
(rounded down to a multiple of merge^2), room for M images at the largest size the processor makes,
e.g. Qwen2-VL's 1003520 px at p = 14: 5120 patches an image.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass

import numpy as np
import torch

from .records import BadRecord


@dataclass(frozen=True)
class PatchRule:
    """The image processor's settings for one run: everything a grid or a patch depends on."""
    patch: int
    merge: int
    temporal: int
    channels: int
    min_pixels: int
    max_pixels: int   # vision.max_pixels (0: none beyond the row's)
    row_patches: int  # P, --max-patches
    mean: tuple
    std: tuple
    tokens_per_second: int = 0  # vision.tokens_per_second: clips' absolute-time rotary (mmpipe.data.video)
    timestamps: bool = False  # Qwen3-VL's tower: clips by its video processor, timestamps as text (mmpipe.data.video)
    # clips' sampling (fps, min_frames, max_frames, min_pixels, max_pixels): vision.video_* (video.video_rule)
    video: tuple = ()

    @property
    def grid_width(self) -> int:
        """Columns of an index grid and a slot's tiling: (t, h, w), and a clip's temporal rotary step (its float32
        bits, mmpipe.data.video.step_bits; 0 for an image) where the family scales time (tokens_per_second > 0)."""
        return 4 if self.tokens_per_second else 3

    @property
    def factor(self) -> int:  # the resized sides are multiples of this, e.g. 14 x 2 = 28
        return self.patch * self.merge

    @property
    def patch_dim(self) -> int:  # C x T x p x p, e.g. 3 x 2 x 14 x 14 = 1176
        return self.channels * self.temporal * self.patch * self.patch

    def cap(self, n_images: int = 1) -> int:
        """max_pixels of one of a sample's n_images images: vision.max_pixels, lowered so the sample's
        images fit the row's P patches together (P / n each, down to a multiple of merge^2), e.g. P = 64 at
        p = 14 and 2 images: 32 x 196 = 6272 px each."""
        unit = self.merge * self.merge
        row = self.row_patches // max(1, n_images) // unit * unit * self.patch * self.patch
        return min(self.max_pixels, row) if self.max_pixels else row

    def grid(self, width: int, height: int, n_images: int = 1) -> tuple[int, int, int]:
        """(t, h, w) in patches of a width x height image of a sample with n_images images, by the processor's
        smart_resize; BadRecord (bad_aspect, too_many_patches) for an image it refuses or one over its share."""
        from transformers.models.qwen2_vl.image_processing_qwen2_vl import smart_resize
        cap = self.cap(n_images)
        try:
            h, w = smart_resize(height, width, factor=self.factor, min_pixels=self.min_pixels, max_pixels=cap)
        except ValueError as e:  # the processor's 200:1 aspect limit
            raise BadRecord("bad_aspect", f"image {width}x{height}: {' '.join(str(e).split())}") from None
        grid = (1, h // self.patch, w // self.patch)
        share = cap // (self.patch * self.patch)
        if grid[1] * grid[2] > share:  # smart_resize clamps a thin side up to one merge unit, or min_pixels
            raise BadRecord("too_many_patches", f"image {width}x{height} makes a {grid[1]}x{grid[2]} patch grid, "
                                                f"{grid[1] * grid[2]} patches > the {share} one of a sample's "
                                                f"{n_images} image(s) may take (--max-patches, vision.max_pixels)")
        return grid

    def sample_grids(self, sizes: list[tuple[int, int]]) -> np.ndarray:
        """int64 [n, grid_width]: the grids of a sample's (width, height) images (each within its share of P), a
        zero step column where the grids have one (an image's temporal position is 0 whatever the step)."""
        grids = np.array([self.grid(w, h, len(sizes)) for w, h in sizes], dtype=np.int64).reshape(-1, 3)
        return np.pad(grids, ((0, 0), (0, self.grid_width - 3)))

    def patches(self, image, n_images: int = 1) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(patches float32 [t h w, patch_dim], grid) of a PIL image, as the processor makes them; BadRecord for an
        image `grid` refuses (checked first: the processor's own refusal is a bare ValueError, e.g. `mmpipe
        generate` on an image no index has checked)."""
        self.grid(image.width, image.height, n_images)
        out = _processor(self, self.cap(n_images))(images=[image], return_tensors="pt")
        return out["pixel_values"].float(), tuple(int(g) for g in out["image_grid_thw"][0])

    def positions(self, grid) -> int:
        """Decoder placeholder positions of an image of this grid: t h w / merge^2."""
        return int(grid[0]) * int(grid[1]) * int(grid[2]) // (self.merge * self.merge)


@functools.lru_cache(maxsize=16)
def _processor(rule: PatchRule, max_pixels: int):
    from transformers import Qwen2VLImageProcessor
    return Qwen2VLImageProcessor(patch_size=rule.patch, merge_size=rule.merge, temporal_patch_size=rule.temporal,
                                 min_pixels=rule.min_pixels, max_pixels=max_pixels,
                                 image_mean=list(rule.mean), image_std=list(rule.std))


def per_image_patches(vision) -> int:
    """The most patches the processor gives one image: vision.max_pixels / p^2, down to a multiple of
    merge^2, e.g. 1003520 / 196 = 5120."""
    unit = vision.merge_size ** 2
    return vision.max_pixels // (vision.patch_size ** 2) // unit * unit


def default_patch_budget(vision, max_images: int) -> int:
    """--max-patches when not given: room for max_images images at the largest size (module docstring)."""
    return max(1, max_images) * per_image_patches(vision)


def patch_rule(cfg, budget: int) -> PatchRule:
    """The run's rule. The lower bound is at least one merge unit (min_pixels 0 would let smart_resize
    round a small image's side to 0)."""
    v = cfg.vision
    factor = v.patch_size * v.merge_size
    return PatchRule(v.patch_size, v.merge_size, v.temporal_patch_size, v.channels, max(v.min_pixels, factor * factor),
                     v.max_pixels, budget, tuple(v.mean), tuple(v.std), v.tokens_per_second, v.timestamps,
                     (v.video_fps, v.video_min_frames, v.video_max_frames, v.video_min_pixels, v.video_max_pixels))
