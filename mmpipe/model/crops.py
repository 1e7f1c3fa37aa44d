"""moondream's multi-crop features: stitching the local crops' patch grids back into one grid.

The data side (`mmpipe/data/crops.py`) cuts an image into a global crop plus rows x cols local
crops of a resized copy of the image, each crop `grid` x `grid` patches (moondream: 378 px /
14 px = 27), neighbours overlapping by 2 x `overlap_margin` patches (moondream: 4, so 8 shared
patch rows/cols). The vision tower encodes every crop on its own; this module is the rule that
turns the local crops' feature grids back into one grid of the resized image and pools it to
the global grid, so each image token reads [global feature, pooled local feature] (2 x width:
2 x 1152 = 2304 for moondream2's projector).

The stitch rule (the same as moondream's reconstruct_from_crops, applied to patch features):
between two neighbouring crops the shared 2m patches are split in the middle, m to each, so a
crop keeps its own centre and gives up the m patches nearest an inner edge. Per axis, crop i of
n (width w = grid - 2m, the stride between crops in patches) keeps local patches

    first (i = 0):          [0, grid - m)       e.g. 0..22 of 0..26
    inner:                  [m, grid - m)       e.g. 4..22, 19 = w patches
    last (i = n - 1):       [m, grid)           e.g. 4..26
    only (n = 1):           [0, grid)           all 27

and local patch p of crop i lands at stitched position i * w + p. The stitched grid is
n * w + 2m patches per axis (moondream: 2 rows -> 2 x 19 + 8 = 46), exactly the resized image's
patch grid: crop i starts at pixel i * w * patch of the resized image, so stitched patch (y, x)
is the patch (y, x) of the resized image, seen by the crop in which it is most central.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F


def kept_span(index: int, count: int, grid: int, margin: int) -> tuple[int, int]:
    """[start, end) of the local patches crop `index` of `count` keeps along one axis."""
    if not 0 <= index < count:
        raise ValueError(f"crop index {index} is outside 0..{count - 1}")
    start = 0 if index == 0 else margin
    end = grid if index == count - 1 else grid - margin
    return start, end


def stitched_size(count: int, grid: int, margin: int) -> int:
    """Patches along one axis of the stitched grid: count crops at a stride of grid - 2m, plus the
    outer margins once (moondream, 3 crops: 3 x (27 - 8) + 8 = 65)."""
    return count * (grid - 2 * margin) + 2 * margin


def stitch_index(rows: int, cols: int, grid: int, margin: int) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """(crop, row, col) index grids, each [H, W] with H = stitched_size(rows), W = stitched_size(cols):
    stitched position (y, x) holds local patch (row[y, x], col[y, x]) of local crop crop[y, x]
    (row-major: crop = tile_row * cols + tile_col)."""
    if rows < 1 or cols < 1:
        raise ValueError(f"tiling {rows}x{cols}: rows and cols must be >= 1")
    if not 0 <= 2 * margin < grid:
        raise ValueError(f"overlap margin {margin} leaves no stride in a {grid}-patch crop")
    tile_y, local_y = _axis(rows, grid, margin)
    tile_x, local_x = _axis(cols, grid, margin)
    crop = tile_y[:, None] * cols + tile_x[None, :]
    h, w = crop.shape
    return crop, local_y[:, None].expand(h, w), local_x[None, :].expand(h, w)


def _axis(count: int, grid: int, margin: int) -> tuple[torch.Tensor, torch.Tensor]:
    """Per stitched position along one axis: which crop it comes from and which of its patches.
    Crop i owns stitched positions [i*w + m, (i+1)*w + m), stretched to 0 for the first crop and to
    the end for the last, so the tile is (pos - m) // w clamped to the crops there are."""
    stride = grid - 2 * margin
    pos = torch.arange(stitched_size(count, grid, margin))
    tile = torch.div(pos - margin, stride, rounding_mode="floor").clamp(0, count - 1)
    return tile, pos - tile * stride


def stitch_grid(features: torch.Tensor, rows: int, cols: int, overlap_margin: int) -> torch.Tensor:
    """[rows * cols (or more), g, g, D] local-crop feature grids, row-major -> the stitched
    [rows*(g - 2m) + 2m, cols*(g - 2m) + 2m, D] grid. Slots past rows * cols (a fixed-size batch's
    padding) are not read. Differentiable: it is one gather."""
    if features.dim() != 4 or features.shape[1] != features.shape[2]:
        raise ValueError(f"features must be [crops, g, g, D], got {tuple(features.shape)}")
    if features.shape[0] < rows * cols:
        raise ValueError(f"tiling {rows}x{cols} needs {rows * cols} crops, got {features.shape[0]}")
    crop, y, x = stitch_index(rows, cols, features.shape[1], overlap_margin)
    device = features.device
    return features[crop.to(device), y.to(device), x.to(device)]


def pool_grid(stitched: torch.Tensor, grid: int) -> torch.Tensor:
    """[H, W, D] -> [grid * grid, D] by adaptive average pooling (moondream: any stitched size to
    27 x 27 = 729 tokens, the global crop's token count), row-major like the patch tokens."""
    pooled = F.adaptive_avg_pool2d(stitched.permute(2, 0, 1), (grid, grid))
    return pooled.permute(1, 2, 0).reshape(grid * grid, stitched.shape[-1])


def merge_crop_features(features: torch.Tensor, tiling: torch.Tensor, overlap_margin: int) -> torch.Tensor:
    """What moondream's projector reads, for a batch in fixed-shape crop slots.

    features: [B, 1 + K, N, D] vision-tower outputs, N = g * g patch tokens per crop, slot 0 the
    global crop, slots 1.. the local crops row-major, slots past 1 + rows*cols padding (ignored,
    so they get no gradient). tiling: [B, 2] integer (rows, cols) per sample.
    Returns [B, N, 2D]: per image token, the global feature then the pooled stitched local one.
    """
    b, slots, n, d = features.shape
    grid = round(n ** 0.5)
    if grid * grid != n:
        raise ValueError(f"{n} tokens per crop is not a square patch grid")
    if tuple(tiling.shape) != (b, 2):
        raise ValueError(f"tiling must be [{b}, 2] (rows, cols), got {tuple(tiling.shape)}")
    out = []
    for sample, (rows, cols) in zip(features, tiling.tolist()):  # tolist: one host sync per batch
        if rows * cols > slots - 1:
            raise ValueError(f"tiling {rows}x{cols} needs {rows * cols} local slots, the batch has {slots - 1}")
        local = sample[1:1 + rows * cols].reshape(rows * cols, grid, grid, d)
        pooled = pool_grid(stitch_grid(local, rows, cols, overlap_margin), grid)
        out.append(torch.cat([sample[0], pooled], dim=-1))
    return torch.stack(out)
