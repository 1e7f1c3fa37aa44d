"""The Qwen3-VL layers (dense): Qwen2-VL's row layout and decoder positions (mmpipe.model.qwen2_vl, imported),
a tower with learned positions and DeepStack, the Qwen3 decoder under interleaved multimodal rotary.

Layer list (`qwen3_vl_specs`), Qwen3-VL-8B as the example (tower 27 blocks of 1152, DeepStack after blocks
8, 16, 24; decoder 36 layers of 4096); a row holds P patches and L positions as in Qwen2-VL:

    Qwen3PatchEmbed       pixels [B, P, 3 x 2 x 16 x 16 = 1536] -> [B, P, 1152]: the Conv3d (with bias) as one
                          matmul, plus the 48 x 48 learned position table resampled (bilinear, corners aligned,
                          as transformers' get_vision_interpolation_indices_and_weights) to each image's grid
    Qwen3VisionBlock x 27 LayerNorm, fused qkv with 2D rotary (Qwen2-VL's vision_attention: within each image),
                          linear_fc1 / linear_fc2 (gelu tanh)
    DeepstackMerger<k>    after block deepstack_indexes[k]: norm over the merged 4 x 1152, fc1 GELU fc2 ->
                          the carried float field deepstack_k [B, P / 4, 4096]; hidden passes unchanged
    Qwen3Merger           norm (per patch), 4 patches as one, fc1 GELU fc2: [B, P / 4, 4096]
    Qwen3Embed            Qwen2-VL's QwenEmbed (the merged tokens onto the placeholders)
    Qwen3Block x 36       q / k RMSNorms per head, interleaved multimodal rotary (frequency j turns by t, h or w
                          as j % 3 says, inside each axis's section), causal within each sample; no qkv bias
    DeepstackAdd<k>       after decoder layer k: hidden at the image placeholders += deepstack_k's first tokens
                          (in order, as QwenEmbed places the merged ones), then drops deepstack_k
    FinalNorm, head       mmpipe.model.llava's (tied when text.tie_embeddings)

So the stage tuple carries deepstack_k from the merger that makes it to the add that reads it, through any
cut between: 3 x P / 4 x D_text floats more per row there (8B at P = 16384: 3 x 4096 x 4096 x 2 bytes in bf16
= 96 MiB), none after decoder layer k. Parameter names follow transformers' Qwen3VLForConditionalGeneration
(mmpipe.hf.qwen3_vl maps them).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec
from torch import nn

from ..config import ModelConfig
from .attention import FusedAttention, apply_partial_rotary, attend, cached_attention, row_cached
from .llava import ACTS, LlamaAttention, decoder_specs
from .qwen2_vl import (
    MropeText,
    PatchVision,
    QwenBlock,
    QwenEmbed,
    mrope_geometry,
    patch_coords,
    qwen2_vl_checks,
    used_grids,
    vision_attention,
)
from .rows import slot_images, tower_rows
from .stage import StageField, StageTuple, unpack_in, unpack_out

# ---- its model JSON's sections and their checks (the registry entry's layout and checks) ----

MAX_DEEPSTACK = 8  # DeepStack sets a model may carry (mmpipe.model.qwen3_vl makes a layer class per set)


@dataclass(frozen=True)
class Qwen3Vision(PatchVision):
    """The Qwen3.5 family's tower (Qwen3-VL's without DeepStack): Qwen2-VL's, no windows, plus a learned position
    table of num_position_embeddings = side^2 bilinearly resampled to each image's grid (2304 = 48^2)."""
    num_position_embeddings: int = 0

    @property
    def tokens_per_second(self) -> int:  # clips keep the temporal index in the rotary: their time is in the text
        return 0

    @property
    def timestamps(self) -> bool:
        return True


@dataclass(frozen=True)
class DeepstackVision(Qwen3Vision):
    """The Qwen3-VL family's tower (mmpipe.model.qwen3_vl): the blocks whose outputs DeepStack merges and adds to
    the outputs of decoder layers 0, 1, ... (Qwen3-VL-8B: (8, 16, 24) of 27 blocks)."""
    deepstack_indexes: tuple[int, ...] = ()


@dataclass(frozen=True)
class MoeConfig:
    """A mixture-of-experts decoder's MLP (issue 43; mmpipe.model.moe, docs/moe.md): the model JSON's "text": {...,
    "moe": {...}}. Every decoder layer's MLP is `experts` SwiGLU experts of width ff_dim (transformers'
    moe_intermediate_size), each token sent to its top_k by a softmax router, their weights renormalised to sum 1
    (norm_topk; Qwen3-VL-MoE always does), with the load-balancing loss x aux_coef (router_aux_loss_coef; 0.001)
    added to the LM loss. shared_ff_dim > 0: a shared expert every token runs beside the routed ones, a SwiGLU of that
    width (shared_expert_intermediate_size) scaled by sigmoid(shared_expert_gate x) (Qwen3.5-MoE; 0: none, as
    Qwen3-VL-MoE; written to model.json only when set). Qwen3-VL-30B-A3B: 128 experts, top 8, ff_dim 768;
    Qwen3.5-35B-A3B: 256 experts, top 8, ff_dim 512, shared_ff_dim 512."""
    experts: int
    top_k: int
    ff_dim: int
    aux_coef: float = 0.001
    norm_topk: bool = True
    shared_ff_dim: int = 0

    def checks(self, text: "Qwen3Text") -> list[tuple[bool, str, str]]:
        """The section's own ranges and the decoder it sits in (the qwen3_vl and qwen3_5 families' checks ask them)."""
        return [(self.experts >= 1 and self.ff_dim >= 1, "text.moe.experts",
                 f"{self.experts} experts of ff_dim {self.ff_dim}: both must be >= 1"),
                (1 <= self.top_k <= self.experts, "text.moe.top_k",
                 f"{self.top_k} must be between 1 and the {self.experts} experts"),
                (self.aux_coef >= 0, "text.moe.aux_coef", f"{self.aux_coef} must be >= 0"),
                (self.shared_ff_dim >= 0, "text.moe.shared_ff_dim",
                 f"{self.shared_ff_dim} must be >= 0 (0: no shared expert)")]


@dataclass(frozen=True)
class Qwen3Text(MropeText):
    """The Qwen3-VL family's decoder: the sections interleaved over the frequencies (t h w t h w ..., transformers'
    mrope_interleaved) instead of in 3 blocks, and RMSNorms on each head's q and k."""
    mrope_interleaved: bool = False
    qk_norm: bool = False
    moe: MoeConfig | None = None  # a mixture-of-experts decoder (MoeConfig; None: dense)


def qwen3_tower_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """Qwen2-VL's checks (no windows in Qwen3-VL's tower) plus the square position table."""
    v = cfg.vision
    side = math.isqrt(v.num_position_embeddings)
    return qwen2_vl_checks(cfg) + [
        (side >= 2 and side * side == v.num_position_embeddings, "vision.num_position_embeddings",
         f"{v.num_position_embeddings} is not a square table of side >= 2 (Qwen3-VL: 2304 = 48^2)"),
        (v.window_size == 0, "vision.window_size", f"{v.window_size}: Qwen3-VL's tower has no windows (valid: 0)"),
        (v.norm == "layernorm" and v.mlp == "gelu", "vision.mlp",
         f"'{v.mlp}' / norm '{v.norm}': Qwen3-VL's tower is LayerNorm + fc1 / fc2 (valid: gelu / layernorm)"),
    ]


def qwen3_vl_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """Qwen3's tower checks, DeepStack's indexes (one per decoder layer it adds to), and an MoE decoder's section."""
    v, t = cfg.vision, cfg.text
    return qwen3_tower_checks(cfg) + (t.moe.checks(t) if t.moe else []) + [
        (all(0 <= i < v.n_layers for i in v.deepstack_indexes) and list(v.deepstack_indexes)
         == sorted(set(v.deepstack_indexes)), "vision.deepstack_indexes",
         f"{list(v.deepstack_indexes)}: increasing block indices of a {v.n_layers}-block tower"),
        (len(v.deepstack_indexes) <= min(t.n_layers, MAX_DEEPSTACK), "vision.deepstack_indexes",
         f"{len(v.deepstack_indexes)} sets for decoder layers 0..{len(v.deepstack_indexes) - 1}: at most "
         f"{min(t.n_layers, MAX_DEEPSTACK)} (the decoder's {t.n_layers} layers, mmpipe's {MAX_DEEPSTACK})"),
    ]



def position_taps(grids: torch.Tensor, P: int, merge: int, side: int):
    """(indices long [B, P, 4], weights float [B, P, 4]) into the side x side position table for each patch:
    bilinear with corners aligned, as transformers resamples it (an h-patch column maps row r to r (side - 1) /
    (h - 1) of the table; e.g. h = 4, side = 48: rows 0, 15.67, 31.33, 47). Padding patches read row 0."""
    c = patch_coords(grids, P, merge)
    g = grids.gather(1, c.slot.clamp(max=grids.shape[1] - 1)[..., None].expand(-1, -1, 3))  # [B, P, 3]

    def axis(i, size):
        src = i.float() * (side - 1) / (size - 1).clamp(min=1).float()
        lo = src.floor()
        taps = (lo.long()[..., None] + torch.arange(2, device=i.device)).clamp(0, side - 1)  # [B, P, 2]
        w = (1 - (src[..., None] - lo[..., None] - torch.arange(2, device=i.device)).abs()).clamp(min=0)
        return taps, w
    (ht, hw), (wt, ww) = axis(c.row, g[..., 1]), axis(c.col, g[..., 2])
    idx = (ht[..., :, None] * side + wt[..., None, :]).flatten(-2)
    return idx, (hw[..., :, None] * ww[..., None, :]).flatten(-2)


class Qwen3PatchEmbed(nn.Module):
    """pixel_values [B, P, C x T x p x p] -> [B, P, D_v]: the Conv3d (bias) as one matmul + learned positions."""
    group = "vision"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = self.v = cfg.vision
        k = (v.temporal_patch_size, v.patch_size, v.patch_size)
        self.proj = nn.Conv3d(v.channels, v.dim, k, stride=k)
        self.pos_embed = nn.Embedding(v.num_position_embeddings, v.dim)
        self.side = int(v.num_position_embeddings ** 0.5)

    def forward(self, inputs):
        t = unpack_in(self, inputs)
        w = self.proj.weight
        x = F.linear(t.hidden.to(w.dtype), w.flatten(1), self.proj.bias)
        idx, wt = row_cached((t.tiling, t.has_image), ("qwen3-pos", *x.shape[:2], self.v),  # tower_rows: dpo's pairs
                             lambda: position_taps(used_grids(tower_rows(t)), x.shape[1], self.v.merge_size, self.side))
        pos = (self.pos_embed(idx) * wt[..., None].to(x.dtype)).sum(-2)  # [B, P, D_v]
        return t._replace(hidden=x + pos).pack()


class VisionMLP(nn.Module):
    def __init__(self, dim: int, ff_dim: int, act: str):
        super().__init__()
        self.linear_fc1, self.linear_fc2, self.act = nn.Linear(dim, ff_dim), nn.Linear(ff_dim, dim), ACTS[act]

    def forward(self, x):
        return self.linear_fc2(self.act(self.linear_fc1(x)))


class Qwen3VisionBlock(nn.Module):
    """norm1, attention (fused qkv with bias, Qwen2-VL's 2D rotary, within each image), norm2, fc1 / fc2."""
    group = "vision"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = self.v = cfg.vision
        self.norm1, self.norm2 = nn.LayerNorm(v.dim, eps=v.ln_eps), nn.LayerNorm(v.dim, eps=v.ln_eps)
        self.attn = FusedAttention(v.dim, v.n_heads)
        self.mlp = VisionMLP(v.dim, v.ff_dim, v.act)

    def forward(self, args):
        t = unpack_in(self, args)
        mask, rotary = vision_attention(t, self.v, True)
        x = t.hidden + self.attn(self.norm1(t.hidden), mask=mask, rotary=rotary)
        return t._replace(hidden=x + self.mlp(self.norm2(x))).pack()


class PatchMerger(nn.Module):
    """norm, merge^2 consecutive patches as one, linear_fc1 GELU linear_fc2 -> D_text. post_shuffle: the norm
    runs on the merged 4 x D_v vector (DeepStack's mergers), else on each patch (the final merger)."""

    def __init__(self, cfg: ModelConfig, post_shuffle: bool):
        super().__init__()
        v = cfg.vision
        self.unit, self.post = v.merge_size ** 2, post_shuffle
        wide = v.dim * self.unit
        self.norm = nn.LayerNorm(wide if post_shuffle else v.dim, eps=1e-6)
        self.linear_fc1, self.linear_fc2 = nn.Linear(wide, wide), nn.Linear(wide, cfg.text.dim)

    def merge(self, x: torch.Tensor) -> torch.Tensor:
        B, P, D = x.shape
        x = x if self.post else self.norm(x)
        x = x.reshape(B, P // self.unit, self.unit * D)
        return self.linear_fc2(F.gelu(self.linear_fc1(self.norm(x) if self.post else x)))


class Qwen3Merger(PatchMerger):
    """[B, P, D_v] -> the merged image tokens [B, P / merge^2, D_text]."""
    group = "projector"

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, post_shuffle=False)

    def forward(self, args):
        t = unpack_in(self, args)
        return t._replace(hidden=self.merge(t.hidden)).pack()


class DeepstackMerger(PatchMerger):
    """Makes deepstack_<index> [B, P / merge^2, D_text] from the tower's hidden state; hidden passes on."""
    group = "projector"
    index = 0

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg, post_shuffle=True)

    def forward(self, args):
        t = unpack_in(self, args)
        return t._replace(**{f"deepstack_{self.index}": self.merge(t.hidden)}).pack()


class DeepstackAdd(nn.Module):
    """After decoder layer <index>: each row's image placeholder positions add deepstack_<index>'s tokens in order
    (the k-th placeholder of row b its k-th token, as QwenEmbed places the merged ones); drops the field. No
    weights; generation's new tokens are text, which it leaves alone."""
    group = "text"
    index = 0

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.token = cfg.image_token_id

    def forward(self, args):
        t = unpack_in(self, args)
        name = f"deepstack_{self.index}"
        feats = getattr(t, name).to(t.hidden.dtype)
        if feats.shape[0] != t.hidden.shape[0]:  # dpo's row pairs sharing their images (mmpipe.model.rows)
            feats = feats[slot_images(t.hidden.shape[0], 1, feats.shape[0], feats.device)]
        where = (t.input_ids == self.token) & (t.segments > 0)
        rank = (where.cumsum(-1) - 1).clamp(min=0, max=feats.shape[1] - 1)
        picked = feats.gather(1, rank[..., None].expand(-1, -1, feats.shape[-1]))
        return t._replace(hidden=t.hidden + picked * where[..., None].to(t.hidden.dtype), **{name: None}).pack()

    def decode(self, t: StageTuple, cache: dict, start: int) -> StageTuple:
        if start == 0:
            return unpack_out(self, self(t.pack()))
        return t._replace(**{f"deepstack_{self.index}": None})


# one maker and one adder class per DeepStack set, so that each set is a stage field of its own (made by its
# merger, dropped after its add: mmpipe.model.stage.StageField), named so that pickling finds them here
DEEPSTACK_MERGERS = [type(f"DeepstackMerger{k}", (DeepstackMerger,), {"index": k, "__module__": __name__})
                     for k in range(MAX_DEEPSTACK)]
DEEPSTACK_ADDS = [type(f"DeepstackAdd{k}", (DeepstackAdd,), {"index": k, "__module__": __name__})
                  for k in range(MAX_DEEPSTACK)]
globals().update({c.__name__: c for c in DEEPSTACK_MERGERS + DEEPSTACK_ADDS})


def deepstack_fields(cfg: ModelConfig) -> tuple[StageField, ...]:
    """deepstack_k, float, made by DeepstackMerger<k>, dropped after DeepstackAdd<k>, per set of the config."""
    return tuple(StageField(f"deepstack_{k}", True, made_by=DEEPSTACK_MERGERS[k], dropped_by=DEEPSTACK_ADDS[k])
                 for k in range(len(cfg.vision.deepstack_indexes)))


class Qwen3Embed(QwenEmbed):
    """Qwen2-VL's embedding (the merged tokens onto the placeholders); its own class for the cost and name maps."""


def interleaved_rotary(positions: torch.Tensor, head_dim: int, theta: float, section: tuple[int, ...]):
    """cos, sin [B, 1, L, head_dim]: frequency j turns by the height position when j % 3 == 1 and j < 3 x
    section[1], by the width when j % 3 == 2 and j < 3 x section[2], else by the temporal one (transformers'
    Qwen3-VL recomposition: e.g. section (24, 20, 20) of 64 frequencies: t h w t h w ... up to j = 59, then t)."""
    dev = positions.device
    inv = 1.0 / (theta ** (torch.arange(0, head_dim, 2, device=dev, dtype=torch.float32) / head_dim))
    j = torch.arange(head_dim // 2, device=dev)
    axis = torch.zeros_like(j)
    for a in (1, 2):
        axis = torch.where((j % 3 == a) & (j < 3 * section[a]), a, axis)
    f = positions[axis].permute(1, 2, 0).float() * inv  # [B, L, head_dim / 2]
    emb = torch.cat([f, f], dim=-1)[:, None]
    return emb.cos(), emb.sin()


def text_rotary(text, positions: torch.Tensor, head_dim: int, theta: float):
    """The decoder's rotary at positions [3, B, L]: interleaved (Qwen3-VL) or in blocks (Qwen2-VL's)."""
    from .qwen2_vl import mrope_rotary
    rule = interleaved_rotary if text.mrope_interleaved else mrope_rotary
    return rule(positions, head_dim, theta, text.mrope_section)


class Qwen3Attention(LlamaAttention):
    """LlamaAttention with an RMSNorm on each head's q and k before the rotary (text.qk_norm)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        t = cfg.text
        self.q_norm, self.k_norm = nn.RMSNorm(t.head_dim, eps=t.ln_eps), nn.RMSNorm(t.head_dim, eps=t.ln_eps)

    def forward(self, x, mask, rotary, cache: dict | None = None):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim)).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_partial_rotary(q, *rotary), apply_partial_rotary(k, *rotary)
        out = attend(q, k, v, mask) if cache is None else cached_attention(q, k, v, cache, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Qwen3Block(QwenBlock):
    """The Qwen3 decoder block (q / k norms, no qkv bias) under interleaved multimodal rotary; cached decoding
    as QwenBlock's (the prefill keeps the row's rope delta)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.text = cfg.text
        if cfg.text.qk_norm:
            self.self_attn = Qwen3Attention(cfg)

    def geometry(self, t: StageTuple, start: int, cache: dict | None):
        hd, theta = self.self_attn.head_dim, self.self_attn.theta
        return mrope_geometry(t, start, cache, self.token, self.merge,
                              ("mrope3", hd, theta, self.section, self.text.mrope_interleaved),
                              lambda pos: text_rotary(self.text, pos, hd, theta))


def qwen3_vl_specs(cfg: ModelConfig, block: type = Qwen3Block) -> list[LayerSpec]:
    """block: the decoder block's class (mmpipe.model.moe's sparse one for an MoE model)."""
    v = cfg.vision
    tower = [LayerSpec(Qwen3PatchEmbed, cfg)]
    for i in range(v.n_layers):
        tower.append(LayerSpec(Qwen3VisionBlock, cfg))
        if i in v.deepstack_indexes:
            tower.append(LayerSpec(DEEPSTACK_MERGERS[v.deepstack_indexes.index(i)], cfg))
    text = decoder_specs(cfg, Qwen3Embed, block)  # [embed, block x n, FinalNorm, head]
    for k in reversed(range(len(v.deepstack_indexes))):
        text.insert(2 + k, LayerSpec(DEEPSTACK_ADDS[k], cfg))  # right after decoder layer k
    return tower + [LayerSpec(Qwen3Merger, cfg)] + text
