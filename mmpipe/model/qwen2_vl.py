"""The Qwen2-VL / Qwen2.5-VL layers: one family, the generations differ by config (mmpipe.config.VisionConfig).

Layer list (`qwen2_vl_specs`), Qwen2.5-VL-7B as the example; a row holds P vision patches (slot order,
each image's patches contiguous in the image processor's order: merge units of 4 consecutive patches,
then zero padding) and L decoder positions; `tiling` [B, M, 3] is each slot's grid (t, h, w) in patches
and stays in the stage tuple to the head (mmpipe.model.stage):

    QwenPatchEmbed      pixels [B, P, 1176] -> [B, P, 1280]: the Conv3d (2 frames x 14 x 14) as one matmul
    QwenVisionBlock x 32  2D rotary per patch from its (row, col) in its image; attention within its image
                        (frame), or in a non-full block (Qwen2.5: all but 7, 15, 23, 31) within its window of
                        window_size / patch / merge = 4 x 4 merge units; a padding patch sees itself only
    QwenMerger          ln_q, 4 consecutive patches as one, Linear GELU Linear: [B, P/4, 3584]
    QwenEmbed           embed_tokens; row b's image_token_id positions take row b's first n_b merged tokens
    QwenBlock x 28      the Qwen2 decoder block, multimodal rotary (3 x [B, L] positions from each sample's
                        ids and grids, as transformers' get_rope_index), causal within each sample
    FinalNorm, head     mmpipe.model.llava's (tied when text.tie_embeddings)

Attention runs per segment (an image's frame, or a window): each patch's segment id from the grids
(vision_segments), the segments gathered into batches of equal size for SDPA (attention.Split), the outputs
put back in the row's order, so no window permutation of the hidden state is needed and the merger reads 4
consecutive patches as before; MMPIPE_ATTENTION=dense masks one dense [B, 1, P, P] attention instead, the
reference (docs/vision_attention.md).
Parameter names follow transformers' modules, so mmpipe.hf.qwen2_vl maps them one to one.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import NamedTuple

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec
from torch import nn

from ..config import VISION_ACTS, ModelConfig, VisionConfig
from .attention import FusedAttention, attention_choice, row_attention, row_cached, row_positions, segment_split
from .llava import LlamaBlock, LlamaText, LlavaEmbed, SwiGLU, TowerMLP, decoder_specs
from .rows import place_in_order, tower_rows
from .stage import StageTuple, unpack_in

# ---- its model JSON's sections and their checks (the registry entry's layout and checks) ----

@dataclass(frozen=True)
class PatchVision(VisionConfig):
    """The towers of patches (Qwen2-VL's, Qwen3-VL's; mmpipe.model.qwen2_vl): a patch spans temporal_patch_size frames
    (Qwen: 2, an image is 2 identical frames; patch_dim 3 x 2 x 14 x 14 = 1176), merge_size^2 neighbouring patches
    become one decoder token (Qwen: 2), window attention over window_size px (Qwen2.5: 112; 0: every block full)
    except in the fullatt_blocks (Qwen2.5: 7, 15, 23, 31), norm "layernorm" / "rmsnorm" (Qwen2.5), mlp "gelu"
    (fc1 / fc2 with `act`, Qwen2: quick_gelu) or "swiglu" (gate / up / down with bias, act silu: Qwen2.5), and the
    image processor's resize bounds in pixels (0: none). `dim` is the tower's width (embed_dim, 1280) and image_size
    the largest square image the bounds allow (what plan costs by default)."""
    act: str = "gelu_tanh"
    temporal_patch_size: int = 1
    merge_size: int = 1
    window_size: int = 0
    fullatt_blocks: tuple[int, ...] = ()
    norm: str = "layernorm"
    mlp: str = "gelu"
    min_pixels: int = 0
    max_pixels: int = 0
    # Clips (mmpipe.data.video; train / plan / generate's --video-* flags set them): the video processor's fps,
    # min_frames and max_frames, and its pixel bounds, 0: the images' (Qwen2-VL's min_pixels / max_pixels of a frame;
    # Qwen3-VL's size shortest_edge / longest_edge, over the whole clip's frames)
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768
    video_min_pixels: int = 0
    video_max_pixels: int = 0

    @property
    def patch_dim(self) -> int:  # e.g. 14 * 14 * 3 x 2 frames = 1176
        return self.patch_size * self.patch_size * self.channels * self.temporal_patch_size

    @property
    def timestamps(self) -> bool:  # a clip's time as text before each temporal patch (Qwen3-VL), not in the rotary
        return False


@dataclass(frozen=True)
class Qwen2Vision(PatchVision):
    """The Qwen2-VL / Qwen2.5-VL family's tower, with Qwen2.5-VL's absolute-time temporal rotary for clips
    (vision_config.tokens_per_second, its releases: 2): a clip's temporal patch f sits at f x tokens_per_second x
    temporal_patch_size / sampled fps (mmpipe.data.video); 0: Qwen2-VL's temporal index f (the rows' tiling keeps 3
    columns)."""
    tokens_per_second: int = 0


@dataclass(frozen=True)
class MropeText(LlamaText):
    """The Qwen2-VL family's decoder: multimodal rotary, the head's rotary frequencies in 3 sections rotated by the
    temporal, height and width position (Qwen: (16, 24, 24), summing to head_dim / 2)."""
    mrope_section: tuple[int, ...] = ()


def qwen2_vl_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """The Qwen2-VL family's tower (merge units, windows, norm, MLP), multimodal rotary and special ids."""
    v, t = cfg.vision, cfg.text
    unit = v.patch_size * v.merge_size  # px per merged token side
    ids = [(0 <= getattr(cfg, k) < t.vocab_size, k, f"{getattr(cfg, k)} is not a token id of the "
            f"{t.vocab_size}-token vocabulary") for k in ("image_token_id", "vision_start_id", "vision_end_id")]
    return ids + [
        (v.merge_size >= 1 and v.temporal_patch_size >= 1, "vision.merge_size",
         f"{v.merge_size} / temporal_patch_size {v.temporal_patch_size} must be >= 1"),
        (v.norm in ("layernorm", "rmsnorm"), "vision.norm", f"'{v.norm}' (valid: layernorm, rmsnorm)"),
        (v.mlp in ("gelu", "swiglu"), "vision.mlp", f"'{v.mlp}' (valid: gelu, swiglu)"),
        (v.act == "silu" if v.mlp == "swiglu" else v.act in VISION_ACTS, "vision.act",
         f"'{v.act}' with mlp '{v.mlp}' (valid: silu with swiglu; {', '.join(VISION_ACTS)} with gelu)"),
        ((v.dim // v.n_heads) % 4 == 0, "vision.dim", f"{v.dim} / {v.n_heads} heads: the 2D rotary needs a head "
         f"width divisible by 4"),
        (v.window_size >= 0 and v.window_size % unit == 0, "vision.window_size",
         f"{v.window_size} must be a multiple of patch_size x merge_size = {unit} (0: no windows)"),
        (all(0 <= i < v.n_layers for i in v.fullatt_blocks), "vision.fullatt_blocks",
         f"{list(v.fullatt_blocks)}: block indices of a {v.n_layers}-block tower"),
        (v.image_size % unit == 0, "vision.image_size", f"{v.image_size} is not a multiple of {unit}"),
        (0 <= v.min_pixels and (not v.max_pixels or v.min_pixels <= v.max_pixels), "vision.min_pixels",
         f"{v.min_pixels} must be between 0 and max_pixels {v.max_pixels}"),
        (t.n_heads % t.kv_heads == 0, "text.n_kv_heads", f"{t.n_kv_heads} does not divide n_heads {t.n_heads}"),
        (t.rotary_dim == t.head_dim, "text.partial_rotary_factor",
         f"{t.partial_rotary_factor}: multimodal rotary turns the whole head (valid: 1.0)"),
        (len(t.mrope_section) == 3 and sum(t.mrope_section) == t.head_dim // 2, "text.mrope_section",
         f"{list(t.mrope_section)}: 3 sections summing to head_dim / 2 = {t.head_dim // 2}"),
    ]


VISION_THETA = 10000.0  # the tower's 2D rotary base (transformers' vision rope_parameters)


def _norm(v: VisionConfig) -> nn.Module:
    return nn.RMSNorm(v.dim, eps=v.ln_eps) if v.norm == "rmsnorm" else nn.LayerNorm(v.dim, eps=v.ln_eps)


def used_grids(t: StageTuple) -> torch.Tensor:
    """t.tiling [B, M, 3] (or [B, M, 4]: clips' time steps, time_steps) with the unused slots' grids zeroed
    (has_image 0): the grids (t, h, w) the row holds."""
    if t.tiling is None or t.tiling.dim() != 3 or t.tiling.shape[-1] not in (3, 4):
        raise ValueError("the Qwen2-VL family's layers need each image slot's grid: the stage tuple's tiling "
                         "long [B, M, 3] (t, h, w) or [B, M, 4] (t, h, w, time step), last of its integer tensors")
    return t.tiling[..., :3] * (t.has_image > 0)[..., None]


def time_steps(t: StageTuple) -> torch.Tensor | None:
    """float32 [B, M]: each slot's temporal rotary step, the 4th tiling column's float32 bits (None: a tiling of
    3 columns, the temporal index itself). Qwen2.5-VL's clip of sampled_fps advances its temporal position by
    tokens_per_second x temporal_patch_size / sampled_fps per temporal patch, which transformers floors after a
    float32 product (get_vision_position_ids); the step rides in an integer column as its exact float32 bits
    (mmpipe.data.video.step_bits) because only floats that are activations cross stages, and the integer
    tensors every stage loads must carry the clip's value unrounded. An image slot's step is irrelevant (t = 1)."""
    if t.tiling is None or t.tiling.shape[-1] != 4:
        return None
    return t.tiling[..., 3].to(torch.int32).view(torch.float32)


class Patches(NamedTuple):
    """Each of a row's P patches: its slot (M: padding), frame, and (row, col) in its image's patch grid."""
    slot: torch.Tensor
    frame: torch.Tensor
    row: torch.Tensor
    col: torch.Tensor


def patch_coords(grids: torch.Tensor, P: int, merge: int) -> Patches:
    """grids [B, M, 3] -> each patch's place (Patches, [B, P] each). Within a frame the processor's order is
    merge units in raster order, each unit's merge x merge patches in raster order (transformers'
    vision_utils.get_vision_position_ids)."""
    B, M, _ = grids.shape
    n = grids.prod(-1)  # [B, M] patches per slot
    ends = n.cumsum(-1)
    if bool((ends[:, -1] > P).any()):
        raise ValueError(f"image grids of {ends[:, -1].max().item()} patches in a row of {P} (the row's patch budget)")
    p = torch.arange(P, device=grids.device).expand(B, P).contiguous()
    slot = torch.searchsorted(ends, p, right=True)  # [B, P]; M past the last image (padding)
    s = slot.clamp(max=M - 1)
    g = grids.gather(1, s[..., None].expand(-1, -1, 3))  # [B, P, 3]
    within = p - (ends - n).gather(1, s)
    hw, bw = (g[..., 1] * g[..., 2]).clamp(min=1), (g[..., 2] // merge).clamp(min=1)
    i = within % hw
    row = i // (merge * merge * bw) * merge + (i // merge) % merge
    col = (i // (merge * merge)) % bw * merge + i % merge
    return Patches(slot, within // hw, row, col)


def vision_segments(c: Patches, M: int, v: VisionConfig, full: bool) -> torch.Tensor:
    """Each patch's attention segment, long [B, P], ids unique across the batch: its image's frame, and in a
    windowed block (full False) its window of window_size / patch_size patches a side (Qwen2.5: 112 / 14 = 8,
    i.e. 4 x 4 merge units of 2 x 2: 64 patches, edge windows smaller); -1 for padding (sees itself only).
    E.g. a 54 x 74-patch image: one segment of 3996 in a full block, 7 x 10 windows (54 = 6 x 8 + 6 rows,
    74 = 9 x 8 + 2 columns) in a windowed one."""
    B, P = c.slot.shape
    unit = v.merge_size * (v.window_size // (v.patch_size * v.merge_size)) if not full else 0
    b = torch.arange(B, device=c.slot.device)[:, None].expand(B, P)
    key = [b, c.slot, c.frame] + ([c.row // unit, c.col // unit] if unit else [])
    _, seg = torch.unique(torch.stack(key, -1).flatten(0, 1), dim=0, return_inverse=True)
    return torch.where(c.slot < M, seg.view(B, P), -1)


def _same(a: torch.Tensor) -> torch.Tensor:
    return a[:, :, None] == a[:, None, :]


def dense_vision_mask(c: Patches, M: int, v: VisionConfig, full: bool) -> torch.Tensor:
    """bool [B, 1, P, P], the reference (MMPIPE_ATTENTION=dense), built pairwise from the coordinates, apart
    from vision_segments: same slot and frame (and window), padding patches seeing themselves only."""
    allowed = _same(c.slot) & _same(c.frame) & (c.slot < M)[:, :, None]
    if not full:
        unit = v.merge_size * (v.window_size // (v.patch_size * v.merge_size))  # patches per window side
        allowed = allowed & _same(c.row // unit) & _same(c.col // unit)
    return (allowed | torch.eye(c.slot.shape[1], dtype=torch.bool, device=allowed.device))[:, None]


def vision_geometry(t: StageTuple, v: VisionConfig, full: bool):
    """(mask, (cos, sin) [B, 1, P, head_dim]) of a vision block: attention within each image's frame (and,
    full False, its window of merge units), padding patches seeing themselves only. The mask is a Split of
    vision_segments (each segment's own SDPA, sizes batched: attention.segment_split) or, under
    MMPIPE_ATTENTION=dense, the reference bool [B, 1, P, P] (dense_vision_mask). The rotary turns each head's
    quarters by (row, col, row, col) x the frequencies of head_dim / 4."""
    B, P = t.hidden.shape[:2]
    c, M = patch_coords(used_grids(t), P, v.merge_size), t.tiling.shape[1]
    dense = attention_choice() == "dense"
    mask = dense_vision_mask(c, M, v, full) if dense else segment_split(vision_segments(c, M, v, full))
    half = v.dim // v.n_heads // 2
    inv = 1.0 / (VISION_THETA ** (torch.arange(0, half, 2, device=t.hidden.device, dtype=torch.float32) / half))
    f = torch.cat([c.row[..., None] * inv, c.col[..., None] * inv], dim=-1)  # [B, P, head_dim / 2]
    emb = torch.cat([f, f], dim=-1)[:, None]
    return mask, (emb.cos(), emb.sin())


def vision_attention(t: StageTuple, v: VisionConfig, full: bool):
    """vision_geometry once per micro-batch, block kind (window / full) and backend on this stage, shared by
    its blocks (row_cached on the grids)."""
    used_grids(t)  # refuses a tuple without the grids, before the cache keys on them
    # the tower's rows: every row's, or the preference pairs' shared ones (B / 2: mmpipe.model.rows.tower_rows)
    return row_cached((t.tiling, t.has_image), ("qwen-vision", *t.hidden.shape[:2], v, full, attention_choice()),
                      lambda: vision_geometry(tower_rows(t), v, full))


def mrope_positions(ids: torch.Tensor, segments: torch.Tensor, grids: torch.Tensor, token: int,
                    merge: int, steps: torch.Tensor | None = None) -> torch.Tensor:
    """The decoder's multimodal positions long [3, B, L] (temporal, height, width), per sample from 0 as
    transformers' get_rope_index: a text token is one more than the position before it (all three
    alike); an image block starting at s gives its merged token (f, r, c) positions (s + f, s + r, s + c)
    and the text after it continues at s + max(h, w) / merge. The k-th block of image tokens in a row is
    the row's k-th used slot (grids: used_grids); padding (segment 0) gets positions no one attends to.
    steps (time_steps, float32 [B, M]): a clip's temporal patch f sits at s + floor(f x its slot's step) instead
    of s + f (Qwen2.5-VL's absolute time); the text after the block still continues at s + max(h, w) / merge,
    whatever the clip's length, as transformers' get_rope_index does."""
    B, L = ids.shape
    rp = row_positions(segments)  # index within its sample
    img = (ids == token) & (segments > 0)
    n = grids.prod(-1) // (merge * merge)  # [B, M] merged tokens per slot
    ends = n.cumsum(-1)
    rank = (img.long().cumsum(-1) - 1).clamp(min=0)
    slot = torch.searchsorted(ends, rank, right=True).clamp(max=grids.shape[1] - 1)
    g = grids.gather(1, slot[..., None].expand(-1, -1, 3))
    n_tok = n.gather(1, slot)
    within = rank - (ends - n).gather(1, slot)
    lh, lw = g[..., 1] // merge, (g[..., 2] // merge).clamp(min=1)
    hw = (lh * lw).clamp(min=1)
    # each block's last token adds (max(lh, lw) - its tokens) to every position after it in its sample
    d = torch.where(img & (within == n_tok - 1), torch.maximum(lh, lw) - n_tok, torch.zeros_like(n_tok))
    before = d.cumsum(-1) - d
    start = torch.arange(L, device=ids.device).expand(B, L) - rp  # each position's sample start
    base = torch.where(img, rp - within, rp) + before - before.gather(1, start)
    zero = torch.zeros_like(base)
    k = within % hw
    frame = within // hw
    if steps is not None:  # float32 as transformers multiplies, then floored (.long()) as it does
        frame = (frame.float() * steps.gather(1, slot)).long()
    return torch.stack([base + torch.where(img, frame, zero), base + torch.where(img, k // lw, zero),
                        base + torch.where(img, k % lw, zero)])


def rope_delta(positions: torch.Tensor, segments: torch.Tensor) -> torch.Tensor:
    """[B]: the row's last sample's largest position + 1 - its length; a token generated after a prompt of
    T positions sits at T + delta (transformers' rope_deltas)."""
    last = segments == segments.amax(-1, keepdim=True)
    top = positions.amax(0).masked_fill(~last, torch.iinfo(positions.dtype).min).amax(-1)
    return top + 1 - last.sum(-1)


def mrope_rotary(positions: torch.Tensor, head_dim: int, theta: float, section: tuple[int, ...]):
    """cos, sin [B, 1, L, head_dim]: frequency j turns by the position of its section's axis (t, h, w)."""
    dev = positions.device
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=dev, dtype=torch.float32) / head_dim))
    axis = torch.repeat_interleave(torch.arange(len(section), device=dev) % 3, torch.tensor(section, device=dev))
    f = positions[axis].permute(1, 2, 0).float() * inv  # [B, L, head_dim / 2]
    emb = torch.cat([f, f], dim=-1)[:, None]
    return emb.cos(), emb.sin()


class QwenPatchEmbed(nn.Module):
    """pixel_values [B, P, C x T x p x p] (the processor's flattened patches) -> [B, P, D_v]: the Conv3d with
    stride = kernel is one matmul per patch."""
    group = "vision"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        k = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = nn.Conv3d(v.channels, v.dim, k, stride=k, bias=False)

    def forward(self, inputs):
        t = unpack_in(self, inputs)
        w = self.proj.weight
        return t._replace(hidden=F.linear(t.hidden.to(w.dtype), w.flatten(1))).pack()


class QwenVisionBlock(nn.Module):
    """norm1, attention (fused qkv with bias, 2D rotary), norm2, MLP (Qwen2: fc1 / fc2; Qwen2.5: SwiGLU with
    bias). full False: attention within windows (vision_geometry)."""
    group = "vision"

    def __init__(self, cfg: ModelConfig, full: bool = True):
        super().__init__()
        v = self.v = cfg.vision
        self.full = full
        self.norm1, self.norm2 = _norm(v), _norm(v)
        self.attn = FusedAttention(v.dim, v.n_heads)
        self.mlp = SwiGLU(v.dim, v.ff_dim, bias=True) if v.mlp == "swiglu" else TowerMLP(v.dim, v.ff_dim, v.act)

    def forward(self, args):
        t = unpack_in(self, args)
        mask, rotary = vision_attention(t, self.v, self.full)
        x = t.hidden + self.attn(self.norm1(t.hidden), mask=mask, rotary=rotary)
        return t._replace(hidden=x + self.mlp(self.norm2(x))).pack()


class QwenMerger(nn.Module):
    """ln_q, then each merge unit's merge^2 consecutive patches as one vector, mlp.0 GELU mlp.2:
    [B, P, D_v] -> [B, P / merge^2, D_text]."""
    group = "projector"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.unit = v.merge_size ** 2
        wide = v.dim * self.unit
        self.ln_q = _norm(v)
        self.mlp = nn.Sequential(nn.Linear(wide, wide), nn.GELU(), nn.Linear(wide, cfg.text.dim))

    def forward(self, args):
        t = unpack_in(self, args)
        x = self.ln_q(t.hidden)
        B, P, D = x.shape
        return t._replace(hidden=self.mlp(x.reshape(B, P // self.unit, self.unit * D))).pack()


class QwenEmbed(LlavaEmbed):
    """Token embedding; row b's image_token_id positions take row b's merged image tokens in order (the
    first n_b of its P / merge^2, n_b from its used slots' grids); the rest are padding. The same module
    is the tied head (mmpipe.model.llava.tied_head); decode: LlavaEmbed's."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.unit = cfg.vision.merge_size ** 2

    def forward(self, args):
        t = unpack_in(self, args)  # hidden: merged image tokens [B, P / merge^2, D]
        emb = self.embed_tokens(t.input_ids)
        where = t.input_ids == self.image_token_id
        want = used_grids(t).prod(-1).sum(-1) // self.unit
        return t._replace(hidden=place_in_order(emb, where, t.hidden, want, self.image_token_id,
                                                "merged image tokens")).pack()


class QwenBlock(LlamaBlock):
    """The Qwen2 decoder block (LlamaBlock with qkv bias) under multimodal rotary positions. Cached decoding:
    the prefill stores the row's rope delta in the layer's cache; new positions are start + delta."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.token, self.merge, self.section = cfg.image_token_id, cfg.vision.merge_size, cfg.text.mrope_section

    def geometry(self, t: StageTuple, start: int, cache: dict | None):
        hd, theta = self.self_attn.head_dim, self.self_attn.theta
        return mrope_geometry(t, start, cache, self.token, self.merge, ("mrope", hd, theta, self.section),
                              lambda pos: mrope_rotary(pos, hd, theta, self.section))


def mrope_geometry(t: StageTuple, start: int, cache: dict | None, token: int, merge: int, key: tuple, rotary):
    """A multimodal-rotary decoder block's (mask, rotary) (the Qwen2-VL, Qwen3-VL and Qwen3.5 families; rotary:
    positions [3, B, L] -> the block's cos / sin, key: what that rotary depends on). The prefill's row positions
    and rotary are built once per micro-batch on this stage and shared by its blocks, and store the row's rope
    delta in the layer's cache; a cached step's new positions are start + delta."""
    if start == 0:
        used_grids(t)  # refuses a tuple without the grids, before the cache keys on them
        pos, rot = row_cached(
            (t.input_ids, t.segments, t.tiling, t.has_image), (*key, token, merge),
            lambda: (p := mrope_positions(t.input_ids, t.segments, used_grids(t), token, merge, time_steps(t)),
                     rotary(p)))
        if cache is not None:
            cache["rope_delta"] = rope_delta(pos, t.segments)
        return row_attention(t.segments), rot
    T = t.segments.shape[-1]
    pos = start + torch.arange(T, device=t.segments.device) + cache["rope_delta"][:, None]  # [B, T]
    return None, rotary(pos.expand(3, -1, -1))


def qwen2_vl_specs(cfg: ModelConfig) -> list[LayerSpec]:
    v = cfg.vision
    blocks = [LayerSpec(QwenVisionBlock, cfg, full=not v.window_size or i in v.fullatt_blocks)
              for i in range(v.n_layers)]
    return ([LayerSpec(QwenPatchEmbed, cfg)] + blocks + [LayerSpec(QwenMerger, cfg)]
            + decoder_specs(cfg, QwenEmbed, QwenBlock))
