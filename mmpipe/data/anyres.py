"""Any-resolution tiles (the LLaVA-NeXT / LLaVA-OneVision family, cfg.vision.grid_pinpoints): an image -> its
base crop and tiles through transformers' own LlavaNextImageProcessor / LlavaOnevisionImageProcessor (grid
choice, resize, pad, crop order), and its decoder positions through LlavaNextProcessor /
LlavaOnevisionProcessor's own placeholder rule (`replace_image_token`: `_get_number_of_features`, the CLIP
class token's -1, OneVision's several-image rule), all called rather than copied.

An image of h x w px gets the pinpoint transformers' select_best_resolution picks, (H, W) px, so a grid of
rows x cols = H / S x W / S tiles of the crop size S, and is encoded as 1 + rows x cols crops: the whole image
resized to S x S (the base crop), then the tiles in the processor's order. OneVision (vision.anyres_max > 0)
encodes an image of a sample with several images as its base crop only (padded to a square): rows = cols = 0,
N + 1 positions. The grid and the positions n_k depend on (h, w) and the sample's image count alone, so the
data index records them from the image's size and every stage knows each slot's tiling (orig_h, orig_w, rows,
cols) without decoding it. An index grid is (orig_h, orig_w, rows, cols, n_k); the row's `tiling` the first 4.

A row's crop budget T (--max-tiles) bounds a sample's crops: a sample whose images need more than T crops is
a bad record, `too_many_tiles` (an image is never cut down to fit). Default T: room for any one sample of
--max-images M images at their largest, M x (1 + the largest pinpoint's tiles); OneVision's cap on that:
max(1 + the largest pinpoint's tiles, M), since only a one-image sample is tiled (e.g. llava-v1.6, 2 x 2 tiles
at most, M = 2: T = 10; llava-onevision, 6 x 6, M = 4: T = 37, not 148). A row's image positions are sized the
same way from `image_positions`, the most one image can take (an upper bound of the processor's count).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..model.llava_next import image_crops
from .records import BadRecord


class SampleCrops:
    """A crop rule's check of a whole sample (TileRule, mmpipe.data.internvl.InternTileRule): its images' grids, and
    too_many_tiles when together their crops (`crops`, named `crop_kinds`) exceed the row's T (`row_tiles`)."""
    crop_kinds = "base crops + tiles"

    def sample_grids(self, sizes: list[tuple[int, int]]) -> np.ndarray:
        """int64 [n, 5]: the grids of a sample's (width, height) images."""
        grids = [self.grid(w, h, len(sizes)) for w, h in sizes]
        crops = sum(self.crops(g) for g in grids)
        if crops > self.row_tiles:
            raise BadRecord("too_many_tiles", f"{len(sizes)} images make {crops} crops ({self.crop_kinds}) > the "
                                              f"row's {self.row_tiles} (--max-tiles)")
        return np.array(grids, dtype=np.int64).reshape(-1, 5)


@dataclass(frozen=True)
class TileRule(SampleCrops):
    """The image processor's settings for one run: everything a tiling, a crop or a count depends on."""
    size: int           # S, the tower's crop (vision.image_size)
    patch: int
    channels: int
    pinpoints: tuple    # ((h, w), ...) px
    anyres_max: int     # OneVision's anyres_max_N (0: LLaVA-NeXT)
    select: str         # vision.feature_select: 'default' drops CLIP's class token
    extra: int          # tokens the tower puts before its patches (CLIP's class token: 1)
    row_tiles: int      # T, --max-tiles
    mean: tuple
    std: tuple
    video: tuple = ()   # OneVision's clip sampling (fps, min_frames, max_frames): vision.video_* (mmpipe.data.video)

    @property
    def side(self) -> int:  # features per crop side, e.g. 336 / 14 = 24
        return self.size // self.patch

    @property
    def most_tiles(self) -> int:  # the largest pinpoint's tiles, e.g. 2 x 2 = 4 (llava-v1.6), 6 x 6 (OneVision)
        return max((h // self.size) * (w // self.size) for h, w in self.pinpoints)

    def base_only(self, n_images: int) -> bool:
        """OneVision encodes an image of a several-image sample as its base crop alone."""
        return bool(self.anyres_max) and n_images > 1

    def grid(self, width: int, height: int, n_images: int = 1) -> tuple[int, int, int, int, int]:
        """(orig_h, orig_w, rows, cols, n_k) of a width x height image of a sample with n_images images;
        BadRecord (too_many_tiles: its crops exceed T; bad_aspect: so thin that unpadding leaves no feature)."""
        from transformers.image_processing_utils import select_best_resolution
        if self.base_only(n_images):
            rows = cols = 0
        else:
            best_h, best_w = select_best_resolution((height, width), [list(p) for p in self.pinpoints])
            rows, cols = best_h // self.size, best_w // self.size
            counter = _counter(self)
            unpadded, _ = counter._get_unpadded_features(height, width, self.side, self.side, rows, cols)
            if unpadded == 0:
                raise BadRecord("bad_aspect", f"image {width}x{height}: its {rows} x {cols} tiles keep no feature "
                                              f"row or column after unpadding (aspect too extreme for the pinpoints)")
        crops = image_crops(rows, cols)
        if crops > self.row_tiles:
            raise BadRecord("too_many_tiles", f"image {width}x{height} makes {crops} crops (base + "
                                              f"{rows} x {cols} tiles) > the row's {self.row_tiles} (--max-tiles)")
        return height, width, rows, cols, self.count(height, width, n_images)

    def count(self, height: int, width: int, n_images: int = 1) -> int:
        """Decoder positions of one image: the processor's own placeholder count for it."""
        inputs = {"image_sizes": [[height, width]], "batch_num_images": [n_images],
                  "pixel_values": torch.empty(1, 1, self.channels, self.size, self.size, device="meta")}
        counter = _counter(self)
        return len(counter.replace_image_token(inputs, 0)) // len(counter.image_token)

    @staticmethod
    def crops(grid) -> int:
        """Crops the tower encodes for one image of this grid (mmpipe.model.llava_next.image_crops)."""
        return image_crops(int(grid[2]), int(grid[3]))

    @staticmethod
    def positions(grid) -> int:
        return int(grid[4])

    def patches(self, image, n_images: int = 1) -> tuple[torch.Tensor, tuple]:
        """(crops float32 [1 + rows x cols, C, S, S], grid) of a PIL image as the processor makes them (named as
        PatchRule's, so a sample reads either rule). A several-image OneVision sample's image goes through the
        processor beside a 1 x 1 companion: the processor's own several-image path (pad to square, no tiles)."""
        images = [[image, _COMPANION()]] if self.base_only(n_images) else [image]
        out = hf_image_processor(self)(images=images, return_tensors="pt")
        grid = self.grid(image.width, image.height, n_images)
        crops = out["pixel_values"][0].float()
        if len(crops) != self.crops(grid):
            raise RuntimeError(f"the image processor made {len(crops)} crops of a {image.width}x{image.height} image, "
                               f"its grid says {self.crops(grid)}")
        return crops, grid

    def image_positions(self) -> int:
        """The most decoder positions one tiled image can take: the base crop's N plus, for the pinpoint of most,
        its feature rows' newlines and its features (unpadding only removes rows or columns; OneVision pools any
        grid over 1.1^2 x anyres_max x N features down to at most anyres_max x N), e.g. llava-v1.6 336 px at 2 x 2:
        576 + 48 x 49 = 2928."""
        limit = int(1.21 * self.anyres_max * self.side ** 2) if self.anyres_max else None
        base = self.side ** 2 + (0 if self.anyres_max else self.extra) - (self.select == "default")
        best = 0
        for h, w in self.pinpoints:
            rows, cols = (h // self.size) * self.side, (w // self.size) * self.side
            best = max(best, min(rows * cols, limit or rows * cols) + rows)
        return base + best

    def row_budget(self, max_images: int) -> tuple[int, int]:
        """(crops, image positions) of the largest sample of max_images images (module docstring): T's default
        and the row's image positions."""
        m, tiles, most = max(1, max_images), 1 + self.most_tiles, self.image_positions()
        if self.anyres_max:
            return max(tiles, m), max(most, m * self.count(self.size, self.size, 2))
        return m * tiles, m * most


def _COMPANION():
    from PIL import Image
    return Image.new("RGB", (1, 1))


@functools.lru_cache(maxsize=8)
def hf_image_processor(rule: TileRule):
    from transformers import LlavaNextImageProcessor, LlavaOnevisionImageProcessor
    common = dict(image_grid_pinpoints=[list(p) for p in rule.pinpoints], image_mean=list(rule.mean),
                  image_std=list(rule.std))
    if rule.anyres_max:
        return LlavaOnevisionImageProcessor(size={"height": rule.size, "width": rule.size}, **common)
    return LlavaNextImageProcessor(size={"shortest_edge": rule.size},
                                   crop_size={"height": rule.size, "width": rule.size}, **common)


@functools.lru_cache(maxsize=8)
def _counter(rule: TileRule):
    """The family's processor, for its placeholder rule only: its tokenizer one <image> token (the rule reads
    none of it), OneVision's video processor a default one."""
    from tokenizers import Tokenizer, models
    from transformers import LlavaNextProcessor, LlavaOnevisionProcessor, PreTrainedTokenizerFast
    tok = PreTrainedTokenizerFast(tokenizer_object=Tokenizer(models.WordLevel({"<image>": 0}, unk_token="<image>")))
    if rule.anyres_max:
        from transformers import LlavaOnevisionVideoProcessor
        return LlavaOnevisionProcessor(image_processor=hf_image_processor(rule), tokenizer=tok,
                                       video_processor=LlavaOnevisionVideoProcessor(),
                                       num_image_tokens=rule.side ** 2, vision_feature_select_strategy=rule.select,
                                       vision_aspect_ratio=f"anyres_max_{rule.anyres_max}")
    return LlavaNextProcessor(image_processor=hf_image_processor(rule), tokenizer=tok, patch_size=rule.patch,
                              vision_feature_select_strategy=rule.select, num_additional_image_tokens=rule.extra)


def tile_rule(cfg, budget: int = 0, max_images: int = 1) -> TileRule:
    """The run's rule at the row's T crops (budget; 0: T's default for max_images images, TileRule.row_budget)."""
    v = cfg.vision
    rule = TileRule(v.image_size, v.patch_size, v.channels, tuple(tuple(p) for p in v.grid_pinpoints), v.anyres_max,
                    v.feature_select, int(v.kind == "clip"), budget or 1, tuple(v.mean), tuple(v.std),
                    (v.video_fps, v.video_min_frames, v.video_max_frames))
    return rule if budget else dataclasses.replace(rule, row_tiles=rule.row_budget(max_images)[0])


def default_tile_budget(cfg, max_images: int) -> int:
    """--max-tiles when not given: room for any one sample of max_images images (module docstring)."""
    return tile_rule(cfg, 0, max_images).row_tiles
