"""What tests/test_moondream_real.py and the fixture harness (tests/fixtures/make_moondream_reference.py)
share: the small moondream-structured model both sides build, its seeded weights and its image.

The weights are a function of each tensor's moondream (current-layout) name and shape only, so the
harness, which ran moondream's own code, and the test, which runs mmpipe's, build the same model
without a weights file in the repository.
"""
from __future__ import annotations

import zlib

import numpy as np
import torch

MOONDREAM_REPO = "vikhyat/moondream"
MOONDREAM_COMMIT = "44146f139242dacdf7c02b799e68097424a31036"

# moondream's own config (moondream/torch/config.py field names), small but with its fixed structure:
# 27 vision layers (it pools the stitched local crops to enc_n_layers x enc_n_layers and views 729
# rows), 378 px crops of 14 px patches, text heads 64 wide (its rotary asserts rot_dim 32 = 64 / 2),
# max_context 2048 (its decode mask is 2048 wide), and grouped-query attention: 4 heads, 2 kv heads.
MD_SMALL = {
    "text": {"dim": 256, "ff_dim": 512, "n_layers": 2, "vocab_size": 512, "max_context": 2048, "n_heads": 4,
             "n_kv_heads": 2, "prefix_attn": 730},
    "vision": {"enc_dim": 32, "enc_patch_size": 14, "enc_n_layers": 27, "enc_ff_dim": 64, "enc_n_heads": 2,
               "proj_out_dim": 256, "crop_size": 378, "in_channels": 3, "max_crops": 12, "overlap_margin": 4,
               "proj_inner_dim": 64},
    "region": {"dim": 256, "coord_feat_dim": 16, "coord_out_dim": 32, "size_feat_dim": 16, "size_out_dim": 64,
               "inner_dim": 64},
}

# the same model as an mmpipe model JSON
MMPIPE_SMALL = {
    "family": "moondream",
    "vision": {"image_size": 378, "patch_size": 14, "dim": 32, "n_layers": 27, "n_heads": 2, "ff_dim": 64,
               "ln_eps": 1e-5, "crop_features": 2},
    "text": {"dim": 256, "n_layers": 2, "n_heads": 4, "n_kv_heads": 2, "ff_dim": 512, "vocab_size": 512,
             "max_context": 2048, "partial_rotary_factor": 0.5},
    "proj_inner_dim": 64,
}


def seeded_tensor(name: str, shape) -> torch.Tensor:
    """fp32, seeded by the name: LayerNorm scales 1 + 0.1 N, biases 0.02 N, matrices N / sqrt(fan_in)."""
    g = torch.Generator().manual_seed(zlib.crc32(name.encode()))
    r = torch.randn(tuple(shape), generator=g, dtype=torch.float32)
    if len(shape) == 1:
        return 0.02 * r if name.endswith(".bias") else 1.0 + 0.1 * r
    return r / float(shape[-1]) ** 0.5


def seeded_weights(table: dict[str, list[int]]) -> dict[str, torch.Tensor]:
    """moondream current name -> tensor, for every (name, shape) of the table."""
    return {name: seeded_tensor(name, shape) for name, shape in sorted(table.items())}


def reference_image() -> np.ndarray:
    """A 378 x 378 RGB uint8 image from integer arithmetic (no RNG): exactly one crop, no resize."""
    i, j = np.meshgrid(np.arange(378), np.arange(378), indexing="ij")
    return np.stack([(i * 7 + j * 3) % 256, (i * j // 5 + 40) % 256, (255 - i + 2 * j) % 256], -1).astype(np.uint8)


MULTI_TILE_HW = (640, 900)  # height x width: more than one 378 px crop, so moondream tiles it (2 x 4)


def multi_tile_image() -> np.ndarray:
    """A 640 x 900 RGB uint8 image from integer arithmetic: moondream resizes and tiles it."""
    h, w = MULTI_TILE_HW
    i, j = np.meshgrid(np.arange(h), np.arange(w), indexing="ij")
    return np.stack([(i * 5 + j * 2) % 256, (i * 3 + j * j // 7) % 256, (i * j // 11 + 90) % 256], -1).astype(np.uint8)


def pixels(image: np.ndarray) -> torch.Tensor:
    """[1, 3, H, W] in [-1, 1], moondream's normalisation ((x / 255) - 0.5) / 0.5, in fp32."""
    return torch.from_numpy(image).permute(2, 0, 1)[None].float().div(255.0).sub(0.5).div(0.5)


PROMPT = [0, 17, 301, 42, 99, 5, 250]  # BOS (moondream2's bos_id 0), then prompt ids
GREEDY_TOKENS = 8
LOGIT_POSITIONS = [0, 1, 400, 729]  # BOS, first / a middle / last image token; + every prompt position
