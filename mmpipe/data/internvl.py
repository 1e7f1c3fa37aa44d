"""InternVL3.5's images (the internvl family, mmpipe.model.internvl): dynamic 448-px tiles through transformers' own
GotOcr2ImageProcessor (crop_to_patches: the tile grid whose aspect is closest to the image's among min..max tiles,
get_optimal_tiled_canvas; the resize, the crops in row-major order, a thumbnail after them when there are several),
called rather than copied, and InternVLProcessor's placeholder rule: <img>, 256 <IMG_CONTEXT> per crop, </img>.

An image of w x h px gets cols x rows tiles (transformers' canvas choice), so 1 + rows x cols crops with the
thumbnail, or one crop (no thumbnail) when the canvas is 1 x 1: its grid (orig_h, orig_w, rows, cols, n) says rows =
cols = 0 then, so the model's count 1 + rows x cols (mmpipe.model.llava_next.image_crops) holds either way; n, its
decoder positions, is crops x 256 + 2 (the brackets). The grid depends on the size alone, so the index records it
without decoding the image and every stage knows each slot's crops.

A row's crop budget T (--max-tiles) bounds a sample's crops: a sample whose images need more is a bad record,
`too_many_tiles` (an image is never cut down to fit). Default T: room for any sample of --max-images M images at
their cap, M x (max_tiles + 1), e.g. InternVL3.5 at M = 1: 13 crops, 13 x 256 + 2 = 3330 image positions; where M
such images and --text-len overflow the context, the crops it holds (InternTileRule.context_tiles); under --pack
without --max-images, for the most slots the context holds (mmpipe.data.dataset.context_slots). A row's image
positions are what T crops and M images can take, 256 x min(T, M x 13) + 2 M (row_positions): a clip's frames, one
crop each, are sized as that crop, not at an image's cap.
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..config import ModelConfig
from . import video
from .anyres import SampleCrops
from .blocks import TileBlocks
from .image_kinds import Tiles
from .records import BadRecord

FRAME_DEFAULTS = (2.0, 4, 32)  # a clip's (fps, min_frames, max_frames): InternVision's video_* defaults


@dataclass(frozen=True)
class InternTileRule(SampleCrops):
    """The image processor's settings for one run: everything a tiling, a crop or a count depends on."""
    crop_kinds = "tiles + thumbnails"
    size: int         # S, a tile's side (vision.image_size, 448)
    channels: int
    min_tiles: int
    max_tiles: int
    per_crop: int     # decoder positions per crop (vision.n_features, 256)
    row_tiles: int    # T, --max-tiles
    mean: tuple
    std: tuple
    video: tuple = (2.0, 4, 32)  # a clip's frames (fps, min_frames, max_frames): vision.video_* (frames as images)

    @property
    def most_crops(self) -> int:  # one image at its cap: its tiles and the thumbnail, e.g. 12 + 1
        return self.max_tiles + (self.max_tiles > 1)

    @property
    def pinpoints(self) -> tuple[tuple[int, int], ...]:
        """Every tile canvas (h, w) px it may pick, e.g. (448, 896) for 1 x 2: the planner's images without a size
        (mmpipe.planning.images.crop_row costs the largest that T holds); most tiles first, the squarest first among
        equals (3 x 4 before 1 x 12)."""
        n = range(1, self.max_tiles + 1)
        grids = sorted(((r, c) for r in n for c in n if self.min_tiles <= r * c <= self.max_tiles),
                       key=lambda g: (-g[0] * g[1], abs(g[0] - g[1]), g))
        return tuple((r * self.size, c * self.size) for r, c in grids)

    def canvas(self, width: int, height: int) -> tuple[int, int]:
        """(rows, cols) of tiles transformers' processor cuts a width x height image into."""
        from transformers.models.got_ocr2.image_processing_got_ocr2 import get_optimal_tiled_canvas
        if self.max_tiles <= 1:  # GotOcr2ImageProcessor.get_number_of_image_patches: no crops at max_patches 1
            return 1, 1
        cols, rows = get_optimal_tiled_canvas((height, width), (self.size, self.size), self.min_tiles, self.max_tiles)
        return rows, cols

    def grid(self, width: int, height: int, n_images: int = 1) -> tuple[int, int, int, int, int]:
        """(orig_h, orig_w, rows, cols, n) of a width x height image (rows = cols = 0: one crop); BadRecord
        too_many_tiles when its crops exceed the row's T."""
        rows, cols = self.canvas(width, height)
        rows, cols = (0, 0) if rows * cols == 1 else (rows, cols)
        crops = 1 + rows * cols
        if crops > self.row_tiles:
            raise BadRecord("too_many_tiles", f"image {width}x{height} makes {crops} crops ({rows} x {cols} tiles "
                                              f"+ the thumbnail) > the row's {self.row_tiles} (--max-tiles)")
        return height, width, rows, cols, self.count(height, width)

    def count(self, height: int, width: int, n_images: int = 1) -> int:
        """Decoder positions of one image: the processor's crops (get_number_of_image_patches) x 256 + <img> and
        </img> (InternVLProcessor.replace_image_token)."""
        return hf_image_processor(self).get_number_of_image_patches(height, width, {}) * self.per_crop + 2

    @staticmethod
    def crops(grid) -> int:
        return 1 + int(grid[2]) * int(grid[3])

    @staticmethod
    def positions(grid) -> int:
        return int(grid[4])

    def patches(self, image, n_images: int = 1) -> tuple[torch.Tensor, tuple]:
        """(crops float32 [1 + rows x cols, C, S, S], grid) of a PIL image as the processor makes them."""
        out = hf_image_processor(self)(images=[image], return_tensors="pt")
        grid = self.grid(image.width, image.height, n_images)
        crops = out["pixel_values"].float()
        if len(crops) != self.crops(grid):
            raise RuntimeError(f"the image processor made {len(crops)} crops of a {image.width}x{image.height} image, "
                               f"its grid says {self.crops(grid)}")
        return crops, grid

    def image_positions(self) -> int:
        """The most decoder positions one image takes: its cap's crops x 256 + 2, e.g. 13 x 256 + 2 = 3330."""
        return self.most_crops * self.per_crop + 2

    def row_budget(self, max_images: int) -> tuple[int, int]:
        """(crops, image positions) of the largest sample of max_images images: T's default and the row's."""
        m = max(1, max_images)
        return m * self.most_crops, m * self.image_positions()

    def row_positions(self, max_images: int) -> int:
        """The image positions a row of M slots and T crops holds: the most a sample within both takes, 256 a crop
        and 2 an image (its brackets), an image at most its cap: 256 x min(T, M x 13) + 2 M. At T's default
        (M x 13) that is row_budget's M x 3330; a clip's frames, one crop each, at T = M = 32: 32 x 258 = 8256
        (not 32 x 3330 = 106,560: a row sized by its slots' cap, not the crops it can hold)."""
        m = max(1, max_images)
        return self.per_crop * min(self.row_tiles, m * self.most_crops) + 2 * m

    def context_tiles(self, max_images: int, text_len: int, context: int) -> int:
        """T's default where M images at their cap and text_len do not fit the context (M x 3330 + text_len >
        text.max_context): the crops the context holds after the text and M images' brackets, (context - text_len -
        2 M) // 256, so the samples are bounded by their own crops (too_many_tiles) and not refused by a slot's
        cap they do not take; e.g. 32 frames at --text-len 1024, 40,960 positions: (40960 - 1024 - 64) // 256 = 155
        crops, 155 x 256 + 64 = 39,744 image positions (M x 13 = 416 crops would need 106,560). Where even one
        crop an image does not fit (fewer than M), M x 13: the row is refused as before, naming its positions."""
        m = max(1, max_images)
        if m * self.image_positions() + text_len <= context:
            return m * self.most_crops  # the default as it was: every row that fitted keeps its T
        crops = (context - text_len - 2 * m) // self.per_crop
        return crops if crops >= m else m * self.most_crops


@functools.lru_cache(maxsize=8)
def hf_image_processor(rule: InternTileRule):
    """transformers' GotOcr2ImageProcessor as InternVLProcessor runs it (crop_to_patches)."""
    from transformers import GotOcr2ImageProcessor
    return GotOcr2ImageProcessor(size={"height": rule.size, "width": rule.size}, crop_to_patches=True,
                                 min_patches=rule.min_tiles, max_patches=rule.max_tiles, image_mean=list(rule.mean),
                                 image_std=list(rule.std))


def intern_rule(cfg: ModelConfig, budget: int = 0, max_images: int = 1) -> InternTileRule:
    """The run's rule at the row's T crops (budget; 0: T's default for max_images images)."""
    v = cfg.vision
    rule = InternTileRule(v.image_size, v.channels, v.min_tiles, v.max_tiles, v.n_features, budget or 1,
                          tuple(v.mean), tuple(v.std), (v.video_fps, v.video_min_frames, v.video_max_frames))
    return rule if budget else dataclasses.replace(rule, row_tiles=rule.row_budget(max_images)[0])


@functools.lru_cache(maxsize=8)
def video_processor(rule: InternTileRule):
    """transformers' InternVLVideoProcessor at the tile size, mean and std (each frame resized to one S x S crop);
    the frames it is given are the ones mmpipe.data.video.frame_indices sampled with its own sample_frames."""
    from transformers import InternVLVideoProcessor
    return InternVLVideoProcessor(size={"height": rule.size, "width": rule.size}, image_mean=list(rule.mean),
                                  image_std=list(rule.std), do_sample_frames=False)


@dataclass(frozen=True)
class BracketTileBlocks(TileBlocks):
    """TileBlocks whose block is <img>, n - 2 placeholders, </img> (InternVLProcessor's)."""
    start_id: int = 0
    end_id: int = 0

    def block(self, grid) -> np.ndarray:
        n = int(grid[4])
        return np.array([self.start_id, *[self.image_id] * (n - 2), self.end_id], dtype=np.int64)


@dataclass(frozen=True)
class InternTiles(Tiles):
    """The internvl family's images: Tiles' protocol (a crop budget T, --max-tiles; a `tiles` row, CropRow, for the
    planner and the balancer) under InternTileRule; a clip as its frames, each one crop (mmpipe.data.video's
    frames as images)."""
    clip_crops = False
    frames_as_images = True

    def budget(self, cfg: ModelConfig, given: int | None, max_images: int, problems: list[str]) -> int:
        if given is not None and given < 1:
            problems.append(f"--max-tiles: {given} must be >= 1 (crops per row: each image's tiles and thumbnail)")
            return 1
        return given if given is not None else intern_rule(cfg, 0, max_images).row_tiles

    def follow(self, cfg: ModelConfig, slots: int, sizes: list) -> int:
        return intern_rule(cfg, 0, slots).row_tiles

    def rule(self, cfg: ModelConfig, budget: int, max_images: int = 1):
        return intern_rule(cfg, budget, max_images)

    def context_budget(self, cfg: ModelConfig, budget: int, max_images: int, text_len: int | None) -> int:
        """T's default at --text-len (mmpipe.data.image_kinds.row_budget, --max-tiles not given): InternTileRule.
        context_tiles where M images at their cap and the text overflow the context, else budget (M x 13)."""
        if text_len is None:
            return budget
        return intern_rule(cfg, 0, max_images).context_tiles(max_images, text_len, cfg.text.max_context)

    def sample_positions(self, cfg: ModelConfig, max_images: int, budget: int) -> int:
        return intern_rule(cfg, budget, max_images).row_positions(max_images)

    def blocks(self, cfg: ModelConfig, max_images: int, budget: int):
        rule, v = intern_rule(cfg, budget, max_images), cfg.vision
        return BracketTileBlocks(rule.row_tiles, rule.row_positions(max_images), cfg.image_token_id,
                                 (v.channels, v.image_size, v.image_size), cfg.vision_start_id, cfg.vision_end_id)

    def grid_key(self, rule, record_images: int, budget: int) -> list:
        """What an index's grids and its too_many_tiles refusals depend on: the rule and T (and the clips' sampling
        where not the default: an index made before clips keeps its key). budget 0 (T follows the slots): T itself
        where it is below the slots' M x 13, context_budget's (so an index made before it keeps its key)."""
        key = list(dataclasses.astuple(dataclasses.replace(rule, row_tiles=0)))
        fitted = not budget and rule.row_tiles < record_images * rule.most_crops
        return key[:-1] + ([list(rule.video)] if rule.video != FRAME_DEFAULTS else []) + [rule.row_tiles if fitted
                                                                                          else budget]

    # its clips: frames as images (mmpipe.data.video), each one crop of the tile size after its `FrameN: ` line
    def video_processor(self, rule):
        return video_processor(rule)

    def frame_text(self, info, indices, marker: str) -> str:
        """InternVLProcessor.replace_video_token's text for the clip's sampled frames, `marker` per frame: e.g.
        'Frame1: <image>\nFrame2: <image>' (each frame's <img>, placeholders and </img> are its block)."""
        from transformers import InternVLProcessor
        proc = InternVLProcessor.__new__(InternVLProcessor)  # the method reads these four and the frame count
        proc.start_image_token, proc.end_image_token, proc.image_token, proc.image_seq_length = "", "", marker, 1
        return proc.replace_video_token({"pixel_values_videos": [torch.empty(len(indices))]}, 0)

    def frame_grid(self, rule, info, n_media: int) -> tuple[int, int, int, int, int]:
        """(orig_h, orig_w, 0, 0, n): one crop, no tiles, n = 256 + 2 positions."""
        return info.height, info.width, 0, 0, rule.per_crop + 2

    def check_sample(self, rule, grids, media) -> None:
        """too_many_tiles where the sample's images' crops and its frames (a crop each) exceed the row's T."""
        from .records import VideoRef
        crops = sum(rule.crops(g) for g in grids)
        if crops > rule.row_tiles:
            frames = sum(isinstance(m, VideoRef) for m in media)
            raise BadRecord("too_many_tiles", f"{len(media) - frames} images and {frames} clip frames make {crops} "
                                              f"crops (a frame one crop) > the row's {rule.row_tiles} (--max-tiles)")

    def with_timestamps(self, rec, rule, image_root, marker: str):
        return video.frames_laid_out(rec, self, rule, image_root, marker)

    def media_grids(self, media: list, rule, image_root, max_pixels: int, spare: int = 0):
        return video.frames_grids(media, self, rule, image_root, max_pixels)

    def clip_pixels(self, ref, rule, image_root, n_media: int, grid):
        """Frame ref.frame as one crop [1, C, S, S], the video processor's."""
        return video.frame_pixels(ref, self, rule, image_root)[None]

    def images_count(self, media: list) -> int:
        return len(media)  # each frame an image of its own


INTERN_TILES = InternTiles()
