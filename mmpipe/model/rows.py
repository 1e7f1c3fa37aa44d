"""Image features into the decoder sequence at their placeholder positions, for both layouts.

The LLaVA family always carries its image as a block of `image_token_id` placeholders inside
input_ids; in rows (--pack / --max-images, mmpipe.model.stage) the moondream family does too, with
IMAGE_SLOT (-1, never a token id) right after each sample's BOS. Features are consumed in order:
the k-th used image slot of the micro-batch (row-major over [B, M]) fills the k-th placeholder
block, exactly as transformers' LLaVA fills its image tokens (masked_scatter).
"""
from __future__ import annotations

import torch

IMAGE_SLOT = -1  # the moondream family's placeholder id in rows


def place_images(emb: torch.Tensor, input_ids: torch.Tensor, feats: torch.Tensor, has_image: torch.Tensor,
                 token: int) -> torch.Tensor:
    """emb [B, T, D] token embeddings; feats [B x M, N, D] projected images (M = 1 outside rows);
    has_image [B] (one image slot) or [B, M] (rows). Returns emb with placeholder position j of image k
    replaced by feats[k, j]. A micro-batch without any image keeps the tower on the autograd graph
    (the pipeline needs a gradient to send back) through 0 x feats.sum()."""
    feats = feats.to(emb.dtype)
    where = input_ids == token  # [B, T]
    if has_image.dim() == 1:  # one slot per sample: a text-only sample's placeholders are not there either
        where = where & has_image.bool()[:, None]
    used = has_image.flatten().bool()  # [B x M], the same order as the blocks in the rows
    n, want = int(where.sum()), int(used.sum()) * feats.shape[1]
    if n != want:
        raise ValueError(f"{n} image placeholder positions (id {token}) for {want} image features "
                         f"({feats.shape[1]} per image)")
    x = emb.masked_scatter(where[..., None], feats[used].reshape(-1, feats.shape[-1]))
    return x + 0 * feats.sum() if n == 0 else x
