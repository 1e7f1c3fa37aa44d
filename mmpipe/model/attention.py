"""Attention shared by the vision and text towers: fused qkv, SDPA, partial rotary, the rows' per-sample masks."""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from torch import nn


def row_positions(segments: torch.Tensor) -> torch.Tensor:
    """segments long [B, L] (1, 2, ... per sample, 0 for padding) -> each position's index within its
    own sample [B, L]: rotary positions restart at every sample of a packed row.
    E.g. segments [1 1 1 2 2 0 0] -> positions [0 1 2 0 1 0 1]."""
    L = segments.shape[-1]
    i = torch.arange(L, device=segments.device).expand_as(segments)
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return i - torch.where(starts, i, torch.zeros_like(i)).cummax(dim=-1).values


def row_mask(segments: torch.Tensor, prefix: torch.Tensor | None = None) -> torch.Tensor:
    """bool [B, 1, L, L], True = may attend: causal within a sample, never across samples of a row.
    prefix bool [B, L] (the moondream family: each sample's BOS + image block) is bidirectional within
    its sample (moondream's prefix_attn). Padding (segment 0) attends to padding only, so
    no query row is empty (SDPA would give NaN)."""
    L = segments.shape[-1]
    i = torch.arange(L, device=segments.device)
    allowed = i[None, :] <= i[:, None]  # [L, L] causal
    if prefix is not None:
        allowed = allowed | (prefix[:, :, None] & prefix[:, None, :])  # [B, L, L]
    return (allowed & (segments[:, :, None] == segments[:, None, :]))[:, None]


def rotary_at(positions: torch.Tensor, rot_dim: int, theta: float):
    """cos, sin [B, 1, L, rot_dim] at each position's own index (row_positions), broadcasting over heads."""
    cos, sin = rotary_cos_sin(positions.shape[-1], rot_dim, theta, positions.device)  # positions < L
    return cos[positions][:, None], sin[positions][:, None]


def row_geometry(segments: torch.Tensor, rot_dim: int, theta: float, prefix: torch.Tensor | None = None,
                 start: int = 0):
    """(mask, (cos, sin)) a decoder layer attends with, from the row's segments alone (mmpipe.model.stage).
    start 0 (forward, generation's prefill): row_mask (prefix bool [B, L]: the moondream family's image
    blocks, bidirectional with their sample's BOS) and each sample's own rotary positions. start > 0
    (generation's new positions of a one-sample row, segments [B, T_new]): no mask, the new queries see
    every key cached before them, and rotary positions start..start+T_new-1."""
    if start:
        T = segments.shape[-1]
        return None, tuple(c[start:start + T] for c in rotary_cos_sin(start + T, rot_dim, theta, segments.device))
    positions = row_positions(segments)
    if prefix is not None:
        prefix = prefix | (positions == 0)
    return row_mask(segments, prefix), rotary_at(positions, rot_dim, theta)


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
        self.n_heads, self.n_kv_heads = n_heads, n_kv_heads or n_heads
        self.kv_dim = self.n_kv_heads * (dim // n_heads)
        self.qkv = nn.Linear(dim, dim + 2 * self.kv_dim)
        self.proj = nn.Linear(dim, dim)

    def forward(self, x: torch.Tensor, mask: torch.Tensor | None = None, rotary=None,
                cache: dict | None = None) -> torch.Tensor:
        """x [B, T, D]; mask and rotary (cos, sin) for these T query positions. With a cache (generation),
        k and v join those of the positions before (cached_attention) and the mask covers them too."""
        B, T, D = x.shape  # [B, T, D]
        if self.n_kv_heads == self.n_heads:
            # 3 x [B, H, T, Dh]
            q, k, v = self.qkv(x).view(B, T, 3, self.n_heads, D // self.n_heads).permute(2, 0, 3, 1, 4)
        else:
            q, k, v = self.qkv(x).split([D, self.kv_dim, self.kv_dim], dim=-1)
            q = q.view(B, T, self.n_heads, -1).transpose(1, 2)  # [B, H, T, Dh]
            k, v = (a.view(B, T, self.n_kv_heads, -1).transpose(1, 2) for a in (k, v))  # [B, H_kv, T, Dh]
        if rotary is not None:
            q, k = apply_partial_rotary(q, *rotary), apply_partial_rotary(k, *rotary)
        if cache is not None:
            out = cached_attention(q, k, v, cache, mask)
        elif self.n_kv_heads == self.n_heads:
            out = F.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T, Dh]
        else:
            out = F.scaled_dot_product_attention(q, *repeat_kv(k, v, self.n_heads), attn_mask=mask)
        return self.proj(out.transpose(1, 2).reshape(B, T, D))


class GeluMLP(nn.Module):
    def __init__(self, dim: int, ff_dim: int, out_dim: int | None = None):
        super().__init__()
        self.fc1 = nn.Linear(dim, ff_dim)
        self.fc2 = nn.Linear(ff_dim, out_dim or dim)

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return self.fc2(F.gelu(self.fc1(x), approximate="tanh"))


def repeat_kv(k: torch.Tensor, v: torch.Tensor, n_heads: int):
    """k, v [B, H_kv, T, Dh] -> [B, n_heads, T, Dh], kv head j serving query heads j*rep .. (j+1)*rep - 1
    (what SDPA's enable_gqa and moondream's attention do), e.g. 32 query heads / 8 kv heads: rep 4."""
    rep = n_heads // k.shape[1]
    if rep > 1:
        k, v = k.repeat_interleave(rep, dim=1), v.repeat_interleave(rep, dim=1)
    return k, v


def cached_attention(q, k, v, cache: dict, mask):
    """q [B, H, T_new, Dh]; k, v [B, H_kv, T_new, Dh] appended to the cache; GQA repeats K/V heads."""
    if "k" in cache:
        k, v = torch.cat([cache["k"], k], dim=2), torch.cat([cache["v"], v], dim=2)
    cache["k"], cache["v"] = k, v
    k, v = repeat_kv(k, v, q.shape[1])
    return torch.nn.functional.scaled_dot_product_attention(q, k, v, attn_mask=mask)  # [B, H, T_new, Dh]
