"""The gemma3 family's images on the data side (mmpipe.data.image_kinds' protocol): LLaVA's fixed-size placeholders,
each image's block bracketed by Gemma 3's <start_of_image> / <end_of_image> ids (the config's vision_start_id /
vision_end_id), and one image read by transformers' own Gemma3ImageProcessor.

transformers' Gemma3Processor turns an image marker into "\\n\\n<start_of_image>" + 256 x <image_soft_token> +
"<end_of_image>\\n\\n"; a row holds the same ids (the blank lines are text the tokenizer reads, not the block's): e.g.
gemma3-tiny's 4 soft tokens at ids 60, bracketed by 61 and 62, are the block [61, 60, 60, 60, 60, 62], 6 positions.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from ..config import ModelConfig
from .blocks import FixedBlocks
from .image_kinds import Placeholders


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


GEMMA3_IMAGES = Gemma3Images()
