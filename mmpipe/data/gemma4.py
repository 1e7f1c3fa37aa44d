"""The gemma4 family's images on the data side (mmpipe.data.image_kinds' protocol), by its config's
vision.max_soft_tokens (mmpipe.model.gemma4):

- 0: one fixed square per image, Gemma 3's bracketed placeholders and reader (mmpipe.data.gemma3, unchanged);
- > 0, what transformers does: each image keeps its aspect ratio within that soft-token budget, read by
  transformers' own Gemma4ImageProcessor (its get_aspect_ratio_preserving_size, bicubic resize, rescale, patch order,
  called rather than copied). An image of W x H px becomes h x w px, both multiples of pool x patch (3 x 16 = 48)
  and h w / patch^2 <= 9 x budget, so a grid (1, rows, cols) of patches and rows x cols / 9 soft tokens: a block of
  <start_of_image>, that many <image_soft_token>, <end_of_image>. E.g. at 280 (2520 patches of 16 px) a
  1000 x 500 (W x H) image: factor sqrt(2520 x 256 / 500000) = 1.136, ideally 568 x 1136 px (H x W), floored to
  multiples of 48: 528 x 1104 px, so 33 rows x 69 columns of patches and 11 x 23 = 253 soft tokens.

The second is a family of patches (image_kinds.Patches): a row's patch budget P (--max-patches, default
--max-images x 9 x budget), each slot's grid in the stage tuple's tiling, the index recording each image's grid
from its size alone (no pixel needed). The processor never shrinks an image to share P with the sample's others:
a sample whose images need more than their share (P / n each) is a bad record, too_many_patches.
"""
from __future__ import annotations

import dataclasses
import functools
import math
from dataclasses import dataclass

import numpy as np
import torch

from ..config import ModelConfig
from . import video
from .blocks import PatchBlocks
from .gemma3 import Gemma3Images
from .image_kinds import Patches
from .records import BadRecord

FRAME_DEFAULTS = (70, 2.0, 4, 32)  # (video soft tokens, fps, min_frames, max_frames): Gemma4Vision's video_* defaults


@dataclass(frozen=True)
class Gemma4PatchRule:
    """The image processor's settings for one run: everything a grid or a patch depends on."""
    patch: int
    pool: int
    soft_tokens: int  # max_soft_tokens
    row_patches: int  # P, --max-patches
    channels: int = 3
    # a clip's frames (mmpipe.data.video, frames as images): each at the video processor's own max_soft_tokens
    # (Gemma4VideoProcessor's default 70, vision.video_soft_tokens), sampled at video (fps, min_frames, max_frames)
    video_soft_tokens: int = 70
    video: tuple = (2.0, 4, 32)
    grid_width = 3      # (t, h, w); no clip step column
    tokens_per_second = 0
    timestamps = False

    @property
    def factor(self) -> int:  # each resized side is a multiple of this, e.g. 3 x 16 = 48 px
        return self.patch * self.pool

    @property
    def min_pixels(self) -> int:
        return self.factor ** 2

    @property
    def per_image(self) -> int:  # the most patches the processor makes of one image: 9 x budget
        return self.soft_tokens * self.pool ** 2

    def cap(self, n_images: int = 1) -> int:
        """Patches one of a sample's n images may take: its share of P (down to a multiple of pool^2), at most
        per_image, e.g. P = 5040 and 2 images: 2520 each."""
        unit = self.pool ** 2
        return min(self.per_image, self.row_patches // max(1, n_images) // unit * unit)

    def grid(self, width: int, height: int, n_images: int = 1) -> tuple[int, int, int]:
        """(1, rows, cols) of a width x height image, by transformers' get_aspect_ratio_preserving_size; BadRecord
        (bad_aspect, too_many_patches) for an image it refuses or one over its share of P."""
        from transformers.models.gemma4.image_processing_gemma4 import get_aspect_ratio_preserving_size
        try:
            h, w = get_aspect_ratio_preserving_size(height, width, self.patch, self.per_image, self.pool)
        except ValueError as e:
            raise BadRecord("bad_aspect", f"image {width}x{height}: {' '.join(str(e).split())}") from None
        grid = (1, h // self.patch, w // self.patch)
        if grid[1] * grid[2] > self.cap(n_images):
            raise BadRecord("too_many_patches", f"image {width}x{height} makes a {grid[1]}x{grid[2]} patch grid, "
                                                f"{grid[1] * grid[2]} patches > the {self.cap(n_images)} one of a "
                                                f"sample's {n_images} image(s) may take (--max-patches)")
        return grid

    def sample_grids(self, sizes: list[tuple[int, int]]) -> np.ndarray:
        return np.array([self.grid(w, h, len(sizes)) for w, h in sizes], dtype=np.int64).reshape(-1, 3)

    def patches(self, image, n_images: int = 1) -> tuple[torch.Tensor, tuple[int, int, int]]:
        """(patches float32 [rows x cols, 3 p p], grid) of a PIL image as the processor makes them: its real
        patches (row-major), the padding to 9 x budget it appends left out."""
        grid = self.grid(image.width, image.height, n_images)
        out = _processor(self)(images=[image], return_tensors="pt")
        n = grid[1] * grid[2]
        if int(out["num_soft_tokens_per_image"][0]) * self.pool ** 2 != n:
            raise RuntimeError(f"image {image.width}x{image.height}: the processor made "
                               f"{int(out['num_soft_tokens_per_image'][0])} soft tokens, its grid {grid} says "
                               f"{n // self.pool ** 2}")
        return out["pixel_values"][0, :n].float(), grid

    def positions(self, grid) -> int:
        """Placeholders of an image of this grid: rows x cols / pool^2."""
        return int(grid[1]) * int(grid[2]) // self.pool ** 2


@functools.lru_cache(maxsize=8)
def _processor(rule: Gemma4PatchRule):
    from transformers import Gemma4ImageProcessor
    return Gemma4ImageProcessor(patch_size=rule.patch, max_soft_tokens=rule.soft_tokens,
                                pooling_kernel_size=rule.pool)


@functools.lru_cache(maxsize=8)
def video_processor(rule: Gemma4PatchRule):
    """transformers' Gemma4VideoProcessor at the run's patch, pool and video budget; the frames it is given are the
    ones mmpipe.data.video.frame_indices sampled with its own sample_frames (do_sample_frames False here)."""
    from transformers import Gemma4VideoProcessor
    return Gemma4VideoProcessor(patch_size=rule.patch, max_soft_tokens=rule.video_soft_tokens,
                                pooling_kernel_size=rule.pool, do_sample_frames=False)


def gemma4_rule(cfg: ModelConfig, budget: int) -> Gemma4PatchRule:
    v = cfg.vision
    return Gemma4PatchRule(v.patch_size, v.pool, v.max_soft_tokens, budget, v.channels, v.video_soft_tokens,
                           (v.video_fps, v.video_min_frames, v.video_max_frames))


@dataclass(frozen=True)
class Gemma4Patches(Patches):
    """Images of any aspect ratio within the soft-token budget (module docstring): Qwen2-VL's patch machinery
    with Gemma 4's rule, merge unit the 3 x 3 pool; a clip as its frames, each an image of the video budget
    (mmpipe.data.video's frames as images)."""
    name = "gemma4"
    describe = "images take a patch budget (--max-patches)"
    frames_as_images = True

    def budget(self, cfg: ModelConfig, given: int | None, max_images: int, problems: list[str]) -> int:
        """P: --max-patches, else room for M images at the processor's largest (M x 9 x max_soft_tokens)."""
        v, unit = cfg.vision, cfg.vision.pool ** 2
        if given is not None and (given < unit or given % unit):
            problems.append(f"--max-patches: {given} must be a positive multiple of pool^2 = {unit} (a soft token's "
                            f"patches)")
        return given if given is not None else max(1, max_images) * v.patches_per_image

    def follow(self, cfg: ModelConfig, slots: int, sizes: list) -> int:
        """P for M = slots images at the data's rate (Patches.follow's), at least one image at the budget."""
        unit, images = cfg.vision.pool ** 2, sum(int(n) for _, n in sizes)
        mean = sum(int(np.prod(enc.grids[:n, :3], axis=1).sum()) for enc, n in sizes) / max(1, images)
        return max(cfg.vision.patches_per_image, math.ceil(slots * mean / unit) * unit)

    def rule(self, cfg: ModelConfig, budget: int, max_images: int = 1):
        return gemma4_rule(cfg, budget) if budget else None

    def sample_positions(self, cfg: ModelConfig, max_images: int, budget: int) -> int:
        """Each image's two brackets and the placeholders of P patches: 2 M + P / 9 (P 0, as the planner asks: its
        default, M images at the budget, e.g. M = 2 at 280: 4 + 560)."""
        budget = budget or max(1, max_images) * cfg.vision.patches_per_image
        return 2 * max(1, max_images) + budget // cfg.vision.pool ** 2

    def blocks(self, cfg: ModelConfig, max_images: int, budget: int):
        v = cfg.vision
        return PatchBlocks(budget or max(1, max_images) * v.patches_per_image, v.pool, cfg.image_token_id,
                           cfg.vision_start_id, cfg.vision_end_id, v.channels * v.patch_size ** 2)

    def marker_text(self, tok, cfg: ModelConfig) -> str | None:
        return GEMMA4_SQUARES.marker_text(tok, cfg)  # as Gemma 3's, without its blank lines: the <image> marker

    def grid_key(self, rule, record_images: int, budget: int) -> list:
        """What an index's grids depend on: the patch, the pool, the budget, each image count's share of P (and the
        clips' budget and sampling where not the defaults: an index made before clips keeps its key)."""
        clips = (rule.video_soft_tokens, *rule.video)
        return ["gemma4", rule.patch, rule.pool, rule.soft_tokens,
                [rule.cap(n) for n in range(1, record_images + 1)]] + ([list(clips)] if clips != FRAME_DEFAULTS else [])

    # its clips: frames as images (mmpipe.data.video), each a slot of its own after its `mm:ss ` time
    def video_processor(self, rule):
        return video_processor(rule)

    def frame_text(self, info, indices, marker: str) -> str:
        """Gemma4Processor.replace_video_token's text for the clip's sampled frames, `marker` per frame: e.g.
        '00:00 <image> 00:01 <image>' (its brackets and soft tokens are the frame's block)."""
        from transformers import Gemma4Processor
        proc = Gemma4Processor.__new__(Gemma4Processor)  # the method reads these three and the metadata alone
        proc.boi_token, proc.eoi_token, proc.video_token = "", "", marker
        meta = video._metadata(info)
        meta.frames_indices = [int(i) for i in indices]
        return proc.replace_video_token({"num_soft_tokens_per_video": [1], "video_metadata": [meta]}, 0)

    def frame_grid(self, rule, info, n_media: int) -> tuple[int, int, int]:
        """(1, rows, cols) of a frame of the clip at the video budget, within its share of P."""
        try:
            return dataclasses.replace(rule, soft_tokens=rule.video_soft_tokens).grid(info.width, info.height,
                                                                                      n_media)
        except BadRecord as e:
            raise BadRecord(e.kind, f"a frame of the clip (max_soft_tokens {rule.video_soft_tokens}): "
                                    f"{e.reason}") from None

    def check_sample(self, rule, grids, media) -> None:
        """Nothing beyond each medium's share of P (frame_grid, grid)."""

    def with_timestamps(self, rec, rule, image_root, marker: str):
        return video.frames_laid_out(rec, self, rule, image_root, marker)

    def media_grids(self, media: list, rule, image_root, max_pixels: int, spare: int = 0):
        return video.frames_grids(media, self, rule, image_root, max_pixels)

    def clip_pixels(self, ref, rule, image_root, n_media: int, grid):
        """Frame ref.frame's real patches (the video processor pads each frame to 9 x its budget)."""
        return video.frame_pixels(ref, self, rule, image_root)[:int(grid[1]) * int(grid[2])]

    def images_count(self, media: list) -> int:
        return len(media)  # each frame an image of its own


GEMMA4_PATCHES = Gemma4Patches()


@dataclass(frozen=True)
class Gemma4Squares(Gemma3Images):
    """Gemma 4 at one fixed square an image (vision.max_soft_tokens 0): Gemma 3's placeholders; its family's clips
    are frames as images, which this config refuses (media_grids)."""
    frames_as_images = True
    around = None  # Gemma4Processor writes its block alone (replace_image_token), without Gemma 3's blank lines

    def media_grids(self, media: list, rule, image_root, max_pixels: int, spare: int = 0):
        raise BadRecord("unsupported_media", "a video for the gemma4 family at a fixed square (vision.max_soft_tokens "
                                             "0): its clips' frames are images of a soft-token budget; import a "
                                             "checkpoint whose image processor has max_soft_tokens")


GEMMA4_SQUARES = Gemma4Squares()


class Gemma4Images:
    """The family's entry's kind: image_kinds.image_kind(cfg) asks it for its config's (`of`)."""
    flag = None  # the family's presets are fixed squares; a config of max_soft_tokens takes --max-patches

    def of(self, cfg: ModelConfig):
        return GEMMA4_PATCHES if cfg.vision.max_soft_tokens else GEMMA4_SQUARES


GEMMA4_IMAGES = Gemma4Images()
