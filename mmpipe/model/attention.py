"""Attention shared by the vision and text towers: fused qkv, SDPA, partial rotary, the rows' per-sample masks.

A decoder layer attends under its row's mask (row_attention, from the segments alone), one of:

    None        every key (generation's new positions)
    CAUSAL      one-sample rows: SDPA's is_causal fast path, no mask materialized
    Split       packed rows on CPU (sample_split: each sample's own is_causal SDPA, or its own [s, s] mask where a
                family passes block ids or a window, Gemma 3's), and a vision tower's images
                and windows (segment_split): each segment's own SDPA, equal sizes batched, no mask
    bool tensor [B, 1, L, L] row_mask, the dense reference (MMPIPE_ATTENTION=dense), and the moondream prefix
                on CPU (bidirectional within the prefix, causal after it: not one causal SDPA per sample)
    BlockMask   packed rows (and the moondream prefix) on CUDA: FlexAttention skips cross-sample blocks

and `attend` runs any of them, so a layer has one call whatever its row. Which path a device takes and
why (the measured CPU costs) is in docs/attention.md; MMPIPE_ATTENTION=dense forces the reference mask
on every row (attention_backend).
"""
from __future__ import annotations

import functools
import os
import weakref

import torch
import torch.nn.functional as F
from torch import nn

from ..config import ConfigError


def row_positions(segments: torch.Tensor) -> torch.Tensor:
    """segments long [B, L] (1, 2, ... per sample, 0 for padding) -> each position's index within its
    own sample [B, L]: rotary positions restart at every sample of a packed row.
    E.g. segments [1 1 1 2 2 0 0] -> positions [0 1 2 0 1 0 1]."""
    L = segments.shape[-1]
    i = torch.arange(L, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return i - torch.where(starts, i, torch.zeros_like(i)).cummax(dim=-1).values


def row_mask(segments: torch.Tensor, prefix: torch.Tensor | None = None, blocks: torch.Tensor | None = None,
             window: int | None = None) -> torch.Tensor:
    """bool [B, 1, L, L], True = may attend: causal within a sample, never across samples of a row.
    prefix bool [B, L] (the moondream family: each sample's BOS + image block) is bidirectional within
    its sample (moondream's prefix_attn). blocks long [B, L] (a family's block ids, e.g. Gemma 3's images: 0 none,
    k > 0 the k-th block): positions of one block see each other both ways (same_block). window W: a query sees
    only keys less than W positions back (q - k < W; Gemma 3's sliding layers), bidirectional pairs too, as
    transformers' AND(sliding window, OR(causal, block)). Padding (segment 0) attends to padding only, so
    no query row is empty (SDPA would give NaN)."""
    L = segments.shape[-1]
    i = torch.arange(L, device=segments.device)
    allowed = i[None, :] <= i[:, None]  # [L, L] causal
    if prefix is not None:
        allowed = allowed | (prefix[:, :, None] & prefix[:, None, :])  # [B, L, L]
    if blocks is not None:
        allowed = allowed | same_block(blocks[:, :, None], blocks[:, None, :])
    if window:
        allowed = allowed & (i[:, None] - i[None, :] < window)
    return (allowed & (segments[:, :, None] == segments[:, None, :]))[:, None]


def same_block(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Block ids a (queries) and b (keys), broadcast: True where both are in one block (an id > 0)."""
    return (a == b) & (a > 0)


def rotary_at(positions: torch.Tensor, rot_dim: int, theta: float):
    """cos, sin [B, 1, L, rot_dim] at each position's own index (row_positions), broadcasting over heads."""
    cos, sin = rotary_cos_sin(positions.shape[-1], rot_dim, theta, positions.device)  # positions < L
    return cos[positions][:, None], sin[positions][:, None]


def row_geometry(segments: torch.Tensor, rot_dim: int, theta: float, prefix: torch.Tensor | None = None,
                 start: int = 0):
    """(mask, (cos, sin)) a decoder layer attends with, from the row's segments alone (mmpipe.model.stage).
    start 0 (forward, generation's prefill): row_attention's mask (prefix bool [B, L]: the moondream family's
    image blocks, bidirectional with their sample's BOS) and each sample's own rotary positions, both built
    once per segments tensor and shared by every layer of the stage (row_cached). start > 0 (generation's
    new positions of a one-sample row, segments [B, T_new]): no mask, the new queries see every key cached
    before them, and rotary positions start..start+T_new-1."""
    if start:
        T = segments.shape[-1]
        return None, tuple(c[start:start + T] for c in rotary_cos_sin(start + T, rot_dim, theta, segments.device))
    rotary = row_cached((segments,), ("rotary", rot_dim, theta),
                        lambda: rotary_at(row_positions(segments), rot_dim, theta))
    return row_attention(segments, prefix), rotary


class _Causal:
    def __repr__(self) -> str:
        return "CAUSAL"


CAUSAL = _Causal()  # the whole row is one causal sample (its padding, if any, at the end): is_causal=True
BACKENDS = ("auto", "dense", "flex")  # MMPIPE_ATTENTION's values


def attention_choice() -> str:
    """MMPIPE_ATTENTION (unset: auto), or ConfigError in one line (mmpipe train checks it before any rank)."""
    choice = os.environ.get("MMPIPE_ATTENTION") or "auto"
    if choice not in BACKENDS:
        raise ConfigError(f"MMPIPE_ATTENTION={choice}: no such attention backend (valid: {', '.join(BACKENDS)})")
    return choice


def attention_backend(device: torch.device) -> str:
    """How rows attend on this device: one-sample rows CAUSAL, packed ones 'flex' (FlexAttention, compiled)
    on CUDA or 'split' elsewhere (sample_split; a moondream image prefix: row_mask through SDPA): torch 2.14's
    FlexAttention has no backward on CPU, and there the split by sample measured faster than the dense mask
    (docs/attention.md). MMPIPE_ATTENTION=dense: the reference, row_mask for every row, causal ones too;
    =flex: FlexAttention (CUDA only)."""
    choice = attention_choice()
    if choice == "flex" and device.type != "cuda":
        raise ConfigError(f"MMPIPE_ATTENTION=flex: FlexAttention needs CUDA (torch's has no backward on "
                          f"{device.type}); unset it or set dense")
    return choice if choice != "auto" else ("flex" if device.type == "cuda" else "split")


def row_attention(segments: torch.Tensor, prefix: torch.Tensor | None = None, blocks: torch.Tensor | None = None,
                  window: int | None = None):
    """The mask a row's queries attend under (see the module docstring), once per segments (and prefix)
    tensor: CAUSAL when every row is one sample with no bidirectional prefix beyond its BOS, else the
    device's backend (attention_backend): a flex BlockMask, or on CPU the causal split by sample (the dense
    row_mask where a prefix reaches past a sample's BOS; MMPIPE_ATTENTION=dense: row_mask always).
    Each sample's first position joins the prefix (row_mask: a prefix needs its BOS). Padding at a causal
    row's end attends causally to the sample before it, where row_mask gives it padding only: its outputs
    differ, but no real position sees them and their labels are ignored, so losses and gradients are the
    same. blocks / window (row_mask's: bidirectional blocks, a sliding window) go to every backend: the split by
    sample then gives each sample's SDPA its own small mask (sample_split)."""
    backend = attention_backend(segments.device)
    tensors = (segments,) + tuple(x for x in (prefix, blocks) if x is not None)
    return row_cached(tensors, ("mask", backend, prefix is None, blocks is None, window),
                      lambda: _row_attention(segments, prefix, backend, blocks, window))


def _row_attention(segments: torch.Tensor, prefix: torch.Tensor | None, backend: str,
                   blocks: torch.Tensor | None = None, window: int | None = None):
    if prefix is not None:
        prefix = prefix | (row_positions(segments) == 0)
    if window and window >= segments.shape[-1]:
        window = None  # no query is that far from a key of its row: the window cuts nothing
    if blocks is not None and not bool((blocks > 0).any()):
        blocks = None
    if backend != "dense" and blocks is None and not window and one_sample_rows(segments, prefix):
        return CAUSAL
    if backend == "flex":
        return document_block_mask(segments, prefix, blocks, window)
    if backend == "split" and (prefix is None or not (prefix & (row_positions(segments) > 0)).any()):
        return sample_split(segments, blocks, window)  # causal within each sample: a BOS prefix is causal too
    return row_mask(segments, prefix, blocks, window)


def one_sample_rows(segments: torch.Tensor, prefix: torch.Tensor | None = None) -> bool:
    """Every row is 1 .. 1 0 .. 0 (one sample, padding only at its end) and no position but a sample's first
    is in the prefix: causal attention is then exactly the row's mask on every real position. One host sync."""
    ok = (segments <= 1).all() & (segments[:, 1:] <= segments[:, :-1]).all()
    if prefix is not None:
        ok = ok & ~(prefix[:, 1:] & (segments[:, 1:] > 0)).any()
    return bool(ok)


def document_block_mask(segments: torch.Tensor, prefix: torch.Tensor | None = None,
                        blocks: torch.Tensor | None = None, window: int | None = None):
    """row_mask as a FlexAttention BlockMask [B, 1, L, L]: which 128 x 128 blocks hold any allowed pair (the
    rest, the cross-sample blocks, are skipped) plus the pairwise rule for the partial ones. Built once per
    row (row_attention caches it); its rule reads copies of segments / prefix, so that the cache entry dies
    with the row's own tensors."""
    from torch.nn.attention.flex_attention import create_block_mask  # imports torch._dynamo: only when used
    seg = segments.clone()
    pre = None if prefix is None else prefix.clone()
    blk = None if blocks is None else blocks.clone()

    def causal(b, h, q, kv):
        return (seg[b, q] == seg[b, kv]) & (q >= kv)

    def with_prefix(b, h, q, kv):
        return (seg[b, q] == seg[b, kv]) & ((q >= kv) | (pre[b, q] & pre[b, kv]))

    def with_blocks(b, h, q, kv):  # row_mask's rule with blocks and a window
        seen = q >= kv
        if blk is not None:
            seen = seen | same_block(blk[b, q], blk[b, kv])
        if window:
            seen = seen & (q - kv < window)
        return (seg[b, q] == seg[b, kv]) & seen
    B, L = segments.shape
    rule = with_blocks if blk is not None or window else causal if pre is None else with_prefix
    return create_block_mask(rule, B, None, L, L, device=segments.device)


@functools.cache
def flex_kernel(device_type: str):
    """torch's flex_attention, compiled on CUDA (fused, block-sparse kernels); eager elsewhere (the math
    reference: forward only on CPU in torch 2.14, the tests' and the benchmark's)."""
    from torch.nn.attention.flex_attention import flex_attention
    return torch.compile(flex_attention) if device_type == "cuda" else flex_attention


def attend(q: torch.Tensor, k: torch.Tensor, v: torch.Tensor, mask=None) -> torch.Tensor:
    """q [B, H, T, Dh], k, v [B, H_kv, S, Dh] (grouped-query when H_kv < H: kv head j serves query heads
    j*rep .. (j+1)*rep - 1) under a row_attention mask (module docstring) -> [B, H, T, Dh]."""
    if isinstance(mask, Split):
        return mask.attend(q, k, v)
    gqa = k.shape[1] != q.shape[1]
    if mask is CAUSAL:
        return F.scaled_dot_product_attention(q, k, v, is_causal=True, enable_gqa=gqa)
    if mask is not None and not isinstance(mask, torch.Tensor) and q.shape[-1] < FLEX_MIN_HEAD_DIM:
        mask = dense_of(mask)
    if mask is None or isinstance(mask, torch.Tensor):
        return F.scaled_dot_product_attention(q, k, v, attn_mask=mask, enable_gqa=gqa)
    return flex_kernel(q.device.type)(q, k, v, block_mask=mask, enable_gqa=gqa)


class Split:
    """Block-diagonal attention as a split: a row's positions, cut into segments that attend only within
    themselves, as one batched SDPA per segment size (a group: idx long [n, s], the flattened b * P + p
    positions of n segments of s each, in their order in the row) and `alone`, the positions that attend
    to themselves only (their output is their v). Computes sum s^2 scores, not P^2, and keeps no mask.
    E.g. a row of 4 images of 32 x 32 patches in Qwen2.5's windowed blocks: one group [64, 64] (16 windows
    of 8 x 8 patches per image), 64 x 64^2 = 262144 scores where the dense mask computes 4096^2 = 16.8 M.
    The stage's tensors keep their fixed [B, P, D] shape; only the batches inside follow the images."""

    def __init__(self, groups: list[torch.Tensor], alone: torch.Tensor, causal: bool = False,
                 masks: list[torch.Tensor] | None = None):
        # masks: per group, bool [n, 1, s, s] within its segments (sample_split's blocks / window), else None
        self.groups, self.alone, self.causal, self.masks = groups, alone, causal, masks
        self.inv = torch.argsort(torch.cat([g.flatten() for g in groups] + [alone]))  # back to row order

    def attend(self, q: torch.Tensor, k: torch.Tensor, v: torch.Tensor) -> torch.Tensor:
        """q [B, H, P, Dh], k, v [B, H_kv, P, Dh] -> [B, H, P, Dh]."""
        B, H, P, Dh = q.shape
        flat = [a.transpose(1, 2).reshape(B * P, a.shape[1], Dh) for a in (q, k, v)]  # [B P, heads, Dh]
        outs = []
        for g, idx in enumerate(self.groups):
            n, s = idx.shape
            qg, kg, vg = (a.index_select(0, idx.flatten()).view(n, s, a.shape[1], Dh).transpose(1, 2) for a in flat)
            m = None if self.masks is None else self.masks[g]
            o = F.scaled_dot_product_attention(qg, kg, vg, attn_mask=m, is_causal=self.causal and m is None,
                                               enable_gqa=kg.shape[1] != H)
            outs.append(o.transpose(1, 2).reshape(n * s, H, Dh))
        v_alone = flat[2].index_select(0, self.alone)
        outs.append(v_alone if v_alone.shape[1] == H else v_alone.repeat_interleave(H // v_alone.shape[1], dim=1))
        return torch.cat(outs).index_select(0, self.inv).view(B, P, H, Dh).transpose(1, 2)


def segment_split(seg: torch.Tensor, causal: bool = False) -> Split:
    """seg long [B, P]: each position's segment id (ids unique across the batch; -1: attends to itself only)
    -> the Split that attends within segments, each segment's positions in row order (causal: as in the
    row). One host sync (the segment sizes decide the batches): build it once per micro-batch (row_cached)."""
    flat = seg.flatten()
    real = (flat >= 0).nonzero().squeeze(1)
    order = real[torch.argsort(flat[real], stable=True)]  # positions grouped by segment, row order within
    _, sizes = torch.unique_consecutive(flat[order], return_counts=True)
    starts = sizes.cumsum(0) - sizes
    groups = [order[starts[sizes == s][:, None] + torch.arange(s, device=seg.device)]
              for s in sizes.unique().tolist()]
    return Split(groups, (flat < 0).nonzero().squeeze(1), causal)


def sample_split(segments: torch.Tensor, blocks: torch.Tensor | None = None, window: int | None = None) -> Split:
    """A decoder row's segments [B, L] (1, 2, ... per sample, 0 padding) as a causal Split by sample: row_mask's
    attention (padding causal among the row's padding, as row_mask has it) without its L x L mask. CPU's path for
    packed rows (row_attention): faster than the dense mask there, measured (docs/attention.md). With blocks or a
    window (row_mask's) each group's samples get their own [s, s] masks: sum s^2 booleans, never L^2."""
    ids = segments + (segments.amax() + 1) * torch.arange(segments.shape[0], device=segments.device)[:, None]
    split = segment_split(ids, causal=True)
    if blocks is None and not window:
        return split
    masks = []
    for idx in split.groups:  # a group's row: one sample's positions in row order, so local index = its position
        s = idx.shape[1]
        i = torch.arange(s, device=segments.device)
        m = (i[None, :] <= i[:, None]).expand(idx.shape[0], s, s)
        if blocks is not None:
            b = blocks.flatten()[idx]  # [n, s]
            m = m | same_block(b[:, :, None], b[:, None, :])
        if window:
            m = m & (i[:, None] - i[None, :] < window)
        masks.append(m[:, None])
    split.masks = masks
    return split


def split_mask(seg: torch.Tensor) -> torch.Tensor:
    """The dense reference of segment_split(seg): bool [B, 1, P, P], True where both positions are in one
    segment, or on the diagonal (a -1 position sees itself only)."""
    P = seg.shape[-1]
    same = (seg[:, :, None] == seg[:, None, :]) & (seg >= 0)[:, :, None]
    return (same | torch.eye(P, dtype=torch.bool, device=seg.device))[:, None]


FLEX_MIN_HEAD_DIM = 16  # compiled flex's kernels (tl.dot) need it: llava-tiny's 8 attends under dense_of


def dense_of(block_mask) -> torch.Tensor:
    """The bool [B, 1, L, L] a BlockMask encodes (its rule at every pair): row_mask's, for head dims flex
    cannot compile; tiny models only, so it is rebuilt per call rather than kept."""
    from torch.nn.attention.flex_attention import create_mask
    B, _, Q, KV = block_mask.shape
    return create_mask(block_mask.mask_mod, B, 1, Q, KV, block_mask.kv_num_blocks.device)


_ROW_CACHE: dict = {}


def row_cached(tensors: tuple, key: tuple, build):
    """build(), once per identity (and in-place version) of `tensors`: what every layer of a stage derives
    from the same micro-batch's integer tensors (mmpipe.model.stage: they never change from layer to layer).
    An entry goes when any of its tensors is freed; at most 64 are kept. A caller that refills such a tensor
    in place without bumping its version (c10d's recv into a reused buffer, as torch.distributed.pipelining
    does) must hand the layers a fresh one (mmpipe.bench.torch_pipe_peer.TupleStage)."""
    full = (*((id(t), 0 if t.is_inference() else t._version) for t in tensors), *key)  # inference: no version
    hit = _ROW_CACHE.get(full)
    if hit is not None and all(r() is t for r, t in zip(hit[0], tensors)):
        return hit[1]
    value = build()
    while len(_ROW_CACHE) >= 64:
        _ROW_CACHE.pop(next(iter(_ROW_CACHE)))
    _ROW_CACHE[full] = ([weakref.ref(t, lambda _, k=full: _ROW_CACHE.pop(k, None)) for t in tensors], value)
    return value


def slot_prefix(input_ids: torch.Tensor, slot: int) -> torch.Tensor:
    """input_ids == slot (the moondream family's image positions), once per input_ids tensor (row_cached),
    so that row_attention finds the same prefix tensor in every layer."""
    return row_cached((input_ids,), ("slot", slot), lambda: input_ids == slot)


@functools.lru_cache(maxsize=16)
def rotary_cos_sin(seq_len: int, rot_dim: int, theta: float, device: torch.device):
    """cos, sin [T, rot_dim] for NeoX-style (rotate-half) rotary embeddings, in fp32."""
    inv_freq = 1.0 / (theta ** (torch.arange(0, rot_dim, 2, device=device, dtype=torch.float32) / rot_dim))
    freqs = torch.outer(torch.arange(seq_len, device=device, dtype=torch.float32), inv_freq)
    emb = torch.cat([freqs, freqs], dim=-1)
    return emb.cos(), emb.sin()


def apply_partial_rotary(x: torch.Tensor, cos: torch.Tensor, sin: torch.Tensor) -> torch.Tensor:
    """x [B, H, T, Dh]; rotate the first rot_dim features of each head, pass the rest through (Phi)."""
    rot_dim = cos.shape[-1]
    x_rot, x_pass = x[..., :rot_dim], x[..., rot_dim:]
    x1, x2 = x_rot.chunk(2, dim=-1)
    rotated = torch.cat([-x2, x1], dim=-1)
    x_rot = (x_rot.float() * cos + rotated.float() * sin).to(x.dtype)
    return torch.cat([x_rot, x_pass], dim=-1)


class FusedAttention(nn.Module):
    """Multi-head self-attention with one qkv projection, as in SigLIP (split) and Phi (fused).

    With n_kv_heads < n_heads (grouped-query attention, moondream's text model) the fused projection
    is [q | k | v] with n_heads, n_kv_heads and n_kv_heads heads of head_dim rows each, e.g. 2048 wide,
    32 heads of 64, 8 kv heads: 2048 + 2 x 8 x 64 = 3072 rows (moondream: dim x (1 + 2 kv/heads));
    each k/v head serves n_heads / n_kv_heads consecutive query heads. n_kv_heads == n_heads is the
    plain 3 x dim layout and keeps its own code path."""

    def __init__(self, dim: int, n_heads: int, n_kv_heads: int | None = None):
        super().__init__()
        self.n_heads, self.n_kv_heads, self.head_dim = n_heads, n_kv_heads or n_heads, dim // n_heads
        self.q_dim, self.kv_dim = dim, self.n_kv_heads * self.head_dim  # q_dim: a TP plan's Fused widths
        self.qkv = nn.Linear(dim, dim + 2 * self.kv_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, rotary=None,
                cache: dict | None = None) -> torch.Tensor:
        """x [B, T, D]; mask and rotary (cos, sin) for these T query positions. With a cache (generation),
        k and v join those of the positions before (cached_attention) and the mask covers them too."""
        B, T, _ = x.shape  # [B, T, D]; the heads' width H x Dh is D, or D / TP on a TP rank (its heads)
        if self.n_kv_heads == self.n_heads:
            # 3 x [B, H, T, Dh]
            q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        else:
            q, k, v = self.qkv(x).split([self.n_heads * self.head_dim, self.kv_dim, self.kv_dim], dim=-1)
            q = q.view(B, T, self.n_heads, -1).transpose(1, 2)  # [B, H, T, Dh]
            k, v = (a.view(B, T, self.n_kv_heads, -1).transpose(1, 2) for a in (k, v))  # [B, H_kv, T, Dh]
        if rotary is not None:
            q, k = apply_partial_rotary(q, *rotary), apply_partial_rotary(k, *rotary)
        out = attend(q, k, v, mask) if cache is None else cached_attention(q, k, v, cache, mask)  # [B, H, T, Dh]
        return self.proj(out.transpose(1, 2).reshape(B, T, -1))


class GeluMLP(nn.Module):
    def __init__(self, dim: int, ff_dim: int, out_dim: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, ff_dim)
        self.fc2 = nn.Linear(ff_dim, out_dim or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def cached_attention(q, k, v, cache: dict, mask):
    """q [B, H, T_new, Dh]; k, v [B, H_kv, T_new, Dh] appended to the cache, then attend (GQA as there)."""
    if "k" in cache:
        k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
    cache["k"], cache["v"] = k, v
    return attend(q, k, v, mask)  # [B, H, T_new, Dh]
