"""The vision side of a dynamic-resolution row for the planner (the Qwen2-VL family, cfg.layout.dynamic):
`mmpipe plan --image-size WxH` and `--max-patches P` -> the row's PatchRow (mmpipe.model.costs), through
the data side's own rule (mmpipe.data.patches: transformers' Qwen2-VL smart_resize, called, not copied).

A row holds --max-images M images of that size (default 1; `--image-size 1024x768,512x512`: images of
those sizes in turn, M default their number), each resized as training resizes it: to
multiples of patch x merge px (28) between vision.min_pixels and vision.max_pixels, and, when M of them
would not fit the row's P patches, further down to P / M each. E.g. qwen2.5-vl-72b, 1024x768, M = 4,
P = 16384: 1036 x 756 px, a 54 x 74-patch grid, 3996 patches and 999 decoder positions each; 15984 of the
16384 patches used. Without --image-size the image is vision.image_size square (the presets: the largest
the processor makes), without --max-patches P is train's default (mmpipe.data.patches.default_max_patches).
"""
from __future__ import annotations

import re

from ..config import ConfigError, ModelConfig
from ..data.dataset import dynamic
from ..data.patches import default_max_patches, patch_rule
from ..data.records import BadRecord
from ..model.costs import PatchRow


def parse_image_sizes(text: str) -> list[tuple[int, int]]:
    """'1024x768,512x512' -> [(1024, 768), (512, 512)] (parse_image_size of each)."""
    return [parse_image_size(part) for part in (text or "").split(",")]


def parse_image_size(text: str) -> tuple[int, int]:
    """'1024x768' -> (1024, 768): width x height in pixels, both >= 1; ConfigError in one line otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", text or "")
    if not m or min(int(m[1]), int(m[2])) < 1:
        raise ConfigError(f"--image-size: {text!r} is not WIDTHxHEIGHT in pixels, both at least 1 (e.g. 1024x768)")
    return int(m[1]), int(m[2])


def patch_row(cfg: ModelConfig, images: int = 1, max_patches: int = 0,
              sizes: list[tuple[int, int]] | None = None) -> PatchRow | None:
    """The row's patch budget and its `images` images, of `sizes` (width, height) in turn (default the
    preset's vision.image_size square), each grid as the data makes it (patch_rule(...).grid); None for a
    fixed-resolution family. ConfigError for a size the processor refuses (an aspect over 200:1)."""
    if not dynamic(cfg):
        return None
    v, images = cfg.vision, max(1, images)
    p = max_patches or default_max_patches(v, images)
    sizes, rule, grids = sizes or [(v.image_size, v.image_size)], patch_rule(cfg, p), []
    for width, height in (sizes[k % len(sizes)] for k in range(images)):
        try:
            grids.append(rule.grid(width, height, images))
        except BadRecord as e:
            raise ConfigError(f"--image-size {width}x{height}: {e} (--max-patches {p}, --max-images {images})"
                              ) from None
    return PatchRow(p, tuple(grids))
