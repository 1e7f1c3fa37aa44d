"""Rows, the one layout (mmpipe.model.stage): image features into their placeholder positions, and
one prompt per row turned into row tensors.

The LLaVA family carries its image as a block of `image_token_id` placeholders inside input_ids;
the moondream family as IMAGE_SLOT (-1, never a token id) right after its sample's BOS; the
cross-attention family has no image positions (N = 0). Features are consumed in order: the k-th
used image slot of the micro-batch (row-major over [B, M]) fills the k-th placeholder block,
exactly as transformers' LLaVA fills its image tokens (masked_scatter).

Preference pairs (--objective dpo) share their images: rows 2i and 2i + 1 of a micro-batch are one pair's chosen
and rejected sides, the same pairs in the same order (mmpipe.data.packing.RowPlan's unit of 2), so their image slots
hold the same images. Where the family allows it (mmpipe.data.preference.SHARED_IMAGE_FAMILIES) the micro-batch
carries each row pair's images once (pixels [B / 2, ...]) and the tower encodes B / 2 rows' worth; slot (2i + s, m)
then reads image (i, m) (`slot_images`), so the two sides index one feature tensor twice and the tower's gradient
is the sum of both uses, as it was when each side had its own copy. Which case a tensor is in is its size: the tower's
images are either every row's or half of them (`pair_shared`), never anything else.
"""
from __future__ import annotations

import torch

IMAGE_SLOT = -1  # the moondream family's placeholder id


def pair_shared(images: int, rows: int) -> bool:
    """Whether the tower's `images` units (images, crops, or rows of patches) are `rows` rows' worth shared by row
    pairs (images == rows / 2, the preference pairs' micro-batch) rather than one set per row (images == rows)."""
    if images == rows:
        return False
    if 2 * images == rows:
        return True
    raise ValueError(f"{images} image units for {rows} rows' slots: neither one set per row nor one per row pair")


def slot_images(rows: int, per_row: int, images: int, device=None) -> torch.Tensor:
    """long [rows x per_row]: the image (row-major over the tower's `images` units) each of rows x per_row slots
    reads: itself, or where the images are the row pairs' (pair_shared) slot m of rows 2i and 2i + 1 reads image
    i x per_row + m, e.g. 4 rows x 2 slots over 4 images: 0 1 0 1 2 3 2 3."""
    slot = torch.arange(rows * per_row, device=device)
    if not pair_shared(images, rows * per_row):
        return slot
    return slot // (2 * per_row) * per_row + slot % per_row


def pair_rows(x: torch.Tensor | None, images: int) -> torch.Tensor | None:
    """x [B, ...] (a per-row integer tensor: has_image, tiling) for a tower that holds `images` rows of images: x, or
    where they are the row pairs' (B / 2) the even rows' (2i's, whose images row 2i + 1 shares)."""
    if x is None or not pair_shared(images, x.shape[0]):
        return x
    return x[::2]


def tower_rows(t):
    """The stage tuple t (hidden [B' , P, D]: a tower of row budgets, Qwen2-VL's patches) with has_image and tiling
    cut to the rows the tower holds: t itself, or the even rows where B' = B / 2 (pair_rows)."""
    n = t.hidden.shape[0]
    return t if not pair_shared(n, t.has_image.shape[0]) else t._replace(
        has_image=pair_rows(t.has_image, n), tiling=pair_rows(t.tiling, n))


def mark_pair_rows(t):
    """A crop tower's entry (LLaVA-NeXT / OneVision's, InternVL's: pixels [B', T, C, S, S] flattened to B' x T crops,
    whose projector lays out each row's crops and so must know B'): where B' = B / 2 (dpo's pairs) the odd rows'
    has_image rides through the tower as -h - 1 (< 0; no tower layer reads it), read back by unmark_pair_rows."""
    if t.hidden.dim() < 5 or not pair_shared(t.hidden.shape[0], t.has_image.shape[0]):  # [B', T, C, S, S] only
        return t
    has = t.has_image.clone()
    has[1::2] = -has[1::2] - 1
    return t._replace(has_image=has)


def unmark_pair_rows(t) -> tuple[int, object]:
    """(the tower's rows B' (B, or B / 2 where mark_pair_rows marked them), t with has_image as it was)."""
    has = t.has_image
    if not (has < 0).any():
        return has.shape[0], t
    return has.shape[0] // 2, t._replace(has_image=torch.where(has < 0, -has - 1, has))


def place_images(emb: torch.Tensor, input_ids: torch.Tensor, feats: torch.Tensor, has_image: torch.Tensor,
                 token: int) -> torch.Tensor:
    """emb [B, L, D] token embeddings; feats [B x M, N, D] projected images; has_image [B, M] (> 0: in use).
    Returns emb with placeholder position j of image k replaced by feats[k, j]. feats [B / 2 x M, N, D]: the
    preference pairs' shared images, slot m of rows 2i and 2i + 1 both reading image i x M + m (slot_images). A
    micro-batch without any image keeps the tower on the autograd graph (the pipeline needs a gradient to send
    back) through 0 x feats.sum()."""
    feats = feats.to(emb.dtype)
    where = input_ids == token  # [B, L]
    used = has_image.flatten() > 0  # [B x M], the same order as the blocks in the rows
    n, want = int(where.sum()), int(used.sum()) * feats.shape[1]
    if n != want:
        raise ValueError(f"{n} image placeholder positions (id {token}) for {want} image features "
                         f"({feats.shape[1]} per image)")
    src = slot_images(*has_image.shape, feats.shape[0], feats.device)[used]  # each used slot's image
    x = emb.masked_scatter(where[..., None], feats[src].reshape(-1, feats.shape[-1]))
    return x + 0 * feats.sum() if n == 0 else x


def place_in_order(emb: torch.Tensor, where: torch.Tensor, feats: torch.Tensor, want: torch.Tensor, token: int,
                   what: str) -> torch.Tensor:
    """emb [B, L, D] with row b's placeholder positions (where [B, L]) taking row b's image tokens feats [B, P, D] in
    order: the families whose images are a variable number of tokens each (Qwen2-VL's merged patches, Gemma 4's
    pooled ones), counted from their grids (want [B]); a count that differs is one line naming the row. feats
    [B / 2, P, D]: the preference pairs' shared images, rows 2i and 2i + 1 both reading row i (slot_images)."""
    have = where.sum(-1)
    if not torch.equal(have, want):
        b = int((have != want).nonzero()[0, 0])
        raise ValueError(f"row {b}: {int(have[b])} image placeholder positions (id {token}) for {int(want[b])} {what} "
                         f"(its slots' grids)")
    feats = feats.to(emb.dtype)
    if feats.shape[0] != emb.shape[0]:
        feats = feats[slot_images(emb.shape[0], 1, feats.shape[0], feats.device)]
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
