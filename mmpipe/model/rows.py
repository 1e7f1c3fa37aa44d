"""Rows, the one layout (mmpipe.model.stage): image features into their placeholder positions, and
one prompt per row turned into row tensors.

The LLaVA family carries its image as a block of `image_token_id` placeholders inside input_ids;
the moondream family as IMAGE_SLOT (-1, never a token id) right after its sample's BOS; the
cross-attention family has no image positions (N = 0). Features are consumed in order: the k-th
used image slot of the micro-batch (row-major over [B, M]) fills the k-th placeholder block,
exactly as transformers' LLaVA fills its image tokens (masked_scatter).
"""
from __future__ import annotations

import torch

IMAGE_SLOT = -1  # the moondream family's placeholder id


def place_images(emb: torch.Tensor, input_ids: torch.Tensor, feats: torch.Tensor, has_image: torch.Tensor,
                 token: int) -> torch.Tensor:
    """emb [B, L, D] token embeddings; feats [B x M, N, D] projected images; has_image [B, M] (> 0: in use).
    Returns emb with placeholder position j of image k replaced by feats[k, j]. A micro-batch without any
    image keeps the tower on the autograd graph (the pipeline needs a gradient to send back) through
    0 x feats.sum()."""
    feats = feats.to(emb.dtype)
    where = input_ids == token  # [B, L]
    used = has_image.flatten() > 0  # [B x M], the same order as the blocks in the rows
    n, want = int(where.sum()), int(used.sum()) * feats.shape[1]
    if n != want:
        raise ValueError(f"{n} image placeholder positions (id {token}) for {want} image features "
                         f"({feats.shape[1]} per image)")
    x = emb.masked_scatter(where[..., None], feats[used].reshape(-1, feats.shape[-1]))
    return x + 0 * feats.sum() if n == 0 else x


def place_in_order(emb: torch.Tensor, where: torch.Tensor, feats: torch.Tensor, want: torch.Tensor, token: int,
                   what: str) -> torch.Tensor:
    """emb [B, L, D] with row b's placeholder positions (where [B, L]) taking row b's image tokens feats [B, P, D] in
    order: the families whose images are a variable number of tokens each (Qwen2-VL's merged patches, Gemma 4's
    pooled ones), counted from their grids (want [B]); a count that differs is one line naming the row."""
    have = where.sum(-1)
    if not torch.equal(have, want):
        b = int((have != want).nonzero()[0, 0])
        raise ValueError(f"row {b}: {int(have[b])} image placeholder positions (id {token}) for {int(want[b])} {what} "
                         f"(its slots' grids)")
    feats = feats.to(emb.dtype)
    rank = (where.cumsum(-1) - 1).clamp(min=0, max=feats.shape[1] - 1)  # position -> its image token
    picked = feats.gather(1, rank[..., None].expand(-1, -1, feats.shape[-1]))
    return torch.where(where[..., None], picked, emb)


def sample_rows(cfg, input_ids: torch.Tensor, has_image: torch.Tensor | None = None, pad_id: int = 0
                ) -> tuple[torch.Tensor, torch.Tensor, torch.Tensor]:
    """One sample per row, the smallest row: prompts input_ids [B, T] (BOS first; the LLaVA family's
    placeholders already in place, mmpipe.data.text.with_placeholders) and has_image [B] (default: all)
    -> (input_ids [B, L], has_image [B, 1], segments [B, L]) of the stage contract. The moondream family
    gets its N_img IMAGE_SLOT positions after BOS where the sample has an image (L = N_img + T); a
    text-only row beside image rows has none and is right-padded by N_img, segment 0 there, as
    mmpipe.data.packing.RowSet builds it; a batch of text-only rows is T wide. Every other position is
    its sample's (segment 1): right padding in the prompts is causal, after the text, so it changes
    nothing before it."""
    B, T = input_ids.shape
    flags = torch.ones(B, dtype=torch.long) if has_image is None else has_image.reshape(B).long()
    n = cfg.n_image_positions  # moondream: N_img spliced; LLaVA (placeholders) and cross-attention: 0
    width = T + (n if bool(flags.any()) else 0)
    ids = torch.full((B, width), pad_id, dtype=torch.long)
    segments = torch.zeros(B, width, dtype=torch.long)
    for b in range(B):
        k = n if flags[b] else 0
        ids[b, :1], ids[b, 1:1 + k], ids[b, 1 + k:k + T] = input_ids[b, :1], IMAGE_SLOT, input_ids[b, 1:]
        segments[b, :k + T] = 1
    return ids, (flags > 0).long()[:, None], segments
