"""What an image takes in a row (mmpipe.data.packing.RowShape.images), by the kind of its family's images
(mmpipe.data.image_kinds): a fixed block of N positions, or a share of the row's vision budget (P patches, T
crops) and the block of its grid. Each answers the same questions: the positions M images take in a row, an
image's vision units, its block of decoder ids and its length, the width of a slot's tiling, a unit's pixels.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np


@dataclass(frozen=True)
class FixedBlocks:
    """Images of one size: each takes N decoder positions, a block of one id (moondream's spliced image tokens,
    IMAGE_SLOT; LLaVA's image_token_id placeholders). No vision budget: the slots' pixels are fixed-size images."""
    image_len: int  # N
    image_id: int
    budget = 0
    tiling_width = 0

    def positions(self, max_images: int) -> int:
        return max_images * self.image_len

    def block(self, grid=None) -> np.ndarray:
        return np.full(self.image_len, self.image_id, dtype=np.int64)


@dataclass(frozen=True)
class PatchBlocks:
    """A dynamic-resolution family's images (mmpipe.data.patches): a budget of P vision patches per row; an image
    of grid (t, h, w) takes t h w of them and a block of <|vision_start|>, t h w / merge^2 placeholders,
    <|vision_end|>, so each image has 2 positions of its own (the brackets) and the placeholders share
    P / merge^2: M x 2 + P / merge^2 positions, e.g. M = 2, P = 64, merge 2: 4 + 16."""
    budget: int       # P
    merge: int        # patches per placeholder, along each side
    image_id: int
    start_id: int     # the block's brackets (vision_start_id, vision_end_id)
    end_id: int
    patch_dim: int    # floats per patch, C x T x p x p
    time_column: bool = False  # a slot's tiling has a 4th column, a clip's temporal rotary step (PatchRule.grid_width)

    @property
    def tiling_width(self) -> int:
        """A slot's grid (t, h, w)[, step]."""
        return 4 if self.time_column else 3

    @property
    def least(self) -> int:
        """The fewest patches an image takes: one placeholder's merge x merge."""
        return self.merge * self.merge

    def positions(self, max_images: int) -> int:
        return max_images * 2 + self.budget // (self.merge * self.merge)

    @property
    def unit(self) -> tuple:
        return (self.patch_dim,)

    def units(self, grid) -> int:
        return int(np.prod(grid[:3]))  # (t, h, w): a 4th column is a clip's step, no size

    def block_len(self, grid) -> int:
        return 2 + self.units(grid) // (self.merge * self.merge)

    def block(self, grid) -> np.ndarray:
        n = self.units(grid) // (self.merge * self.merge)
        return np.array([self.start_id, *[self.image_id] * n, self.end_id], dtype=np.int64)


@dataclass(frozen=True)
class TileBlocks:
    """Any-resolution tiles (mmpipe.data.anyres): a budget of T crops per row; an image of grid (orig_h, orig_w,
    rows, cols, n) takes 1 + rows x cols of them and a block of n placeholders (no brackets), and the row's images
    share image_positions decoder positions, room for its largest sample."""
    budget: int           # T
    image_positions: int
    image_id: int
    crop: tuple           # one crop's pixels (C, S, S)
    tiling_width = 4      # a slot's (orig_h, orig_w, rows, cols)
    least = 1             # the fewest crops an image takes: its base crop

    def positions(self, max_images: int) -> int:
        return self.image_positions

    @property
    def unit(self) -> tuple:
        return self.crop

    def units(self, grid) -> int:
        return 1 + int(grid[2]) * int(grid[3])

    def block_len(self, grid) -> int:
        return int(grid[4])

    def block(self, grid) -> np.ndarray:
        return np.full(int(grid[4]), self.image_id, dtype=np.int64)
