"""The Gemma 4 family (transformers' Gemma4ForConditionalGeneration, image and text): a vision tower with a learned
2-D position table and 2-D rotary, 3 x 3 pooling, and a Gemma decoder with two inputs no other family has, both
carried in the stage tuple (mmpipe.model.stage.StageField):

    per_layer   float [B, L, n_layers x P]  the per-layer input embeddings (PLE): a second token table
                (vocab x n_layers P) plus a projection of the row's embeddings, computed once by Gemma4Embed;
                decoder layer i reads its slice [:, :, i P:(i + 1) P], the last decoder layer drops the field.
                So it crosses every stage boundary inside the decoder (gemma-4-E2B: 35 x 256 = 8960 floats a
                position, 3.5 x its 1536-wide hidden).
    kv_sliding, kv_full  float [B, L, 2 x H_kv x Dh]  KV sharing: the last num_kv_shared_layers layers compute no
                keys or values; each reuses those of the last earlier layer of its own attention type (the
                producer, a *Store class), which puts its rotated keys and normed values in the field; the last
                consumer of that type (a *Shared class) drops it. A cut between producer and consumer sends it.

Layer list (`gemma4_specs`):

    Gemma4PatchEmbed       pixels [B, M, 3, S, S] in [0, 1] -> B x M images of (S/16)^2 patches: 2 (x - 0.5),
                           input_proj (16 x 16 x 3 -> Dv, no bias), + table[0][column] + table[1][row]
    Gemma4TowerBlock x n   sandwich-normed encoder layer (Gemma RMSNorm x w), q / k / v norms (v's unscaled),
                           2-D rotary (first half of each head by column, second by row), bidirectional
    Gemma4Projector        k x k average pool on the patch grid (3 x 3), x sqrt(Dv), unscaled RMSNorm,
                           embedding_projection [Dv -> D]
    Gemma4Embed            tokens (placeholders read as pad) x sqrt(D), the image features over the placeholders,
                           then per_layer (above)
    Gemma4Block x n        by type: sliding (window, rotary base 1e4, head_dim) or full (global_head_dim, its
                           own kv heads, proportional rotary on a fraction of each head, k = v when k_eq_v),
                           plain / *Store / *Shared; q_norm / k_norm, scale 1, sandwich norms, the GELU-tanh
                           MLP (double width on shared layers when double_wide_mlp), then the per-layer input
                           gate (x + norm(proj(gelu(gate(x)) * per_layer_i)))), all times layer_scalar
    Gemma4FinalNorm, head  the tied embedding (or an untied head), logits soft-capped (final_softcap)

With a text.moe section (26B-A4B: 128 experts of 704, top 8) every decoder layer is its sparse class
(Gemma4SlidingMoeBlock, Gemma4GlobalMoeStore, ...): transformers' MoE block runs beside the dense MLP, both inside
the same post_feedforward_layernorm, post_1(mlp(pre(x))) + post_2(experts(pre_2(x))), routed by Gemma4Router on x
itself; the experts are mmpipe.model.moe's (dispatch, --ep) with a GELU-tanh gate. The router statistics cross the
stages in moe_stats (made by decoder layer 0, kept to the head), and the head (Gemma4MoeHead / Gemma4TiedMoeHead)
returns its load-balancing term beside the soft-capped logits (aux_coef 0 as imported: transformers has none).

Attention: sliding layers are causal per sample, each image block both ways (when bidirectional_vision), within
the window; full layers are causal per sample only (transformers' create_masks_for_vision_model: "Gemma 4
explicitly disables bidirectional attention on global attention layers").

Two image layouts, by vision.max_soft_tokens:
- 0: one fixed square per image of vision.image_size, pixels [B, M, 3, S, S] (every patch valid, positions the
  row-major grid); the stage tuple is the row alone.
- > 0 (what transformers does): each image keeps its aspect ratio within that soft-token budget (transformers'
  Gemma4ImageProcessor, mmpipe.data.gemma4), a row's images as one patch list pixels [B, P, 3 p^2] (each image's
  rows x cols patches row-major, contiguous in slot order, then zero padding) and each slot's grid (1, rows, cols)
  in the stage tuple's `tiling` (kept to the head, as Qwen2-VL's). Each patch's (column, row) in its own image
  indexes the position table and turns the 2-D rotary; a patch attends to its own image's patches only (padding
  to itself); the pool averages each image's 3 x 3 cells (row-major pooled grid), and the embedding puts row b's
  pooled tokens, in order, on its placeholders (transformers' Gemma4VisionModel: its padding is masked out of
  attention and pooling, its pooled padding stripped).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from ..config import ModelConfig, VisionConfig
from . import costs
from .attention import apply_partial_rotary, attend, row_attention, row_cached, row_positions, segment_split
from .gemma3 import Gemma3Text, gemma_rotary, image_blocks
from .llava import FinalNorm, LlavaEmbed
from .moe import Experts, MoeHead, TiedMoeHead, expert_params, route_stats
from .qwen2_vl import Patches, patch_coords, used_grids
from .qwen3_vl import MoeConfig
from .rows import place_images, place_in_order, tower_rows
from .stage import ROW, StageField, StageTuple, live_fields, unpack_in, unpack_out

SOFT_TOKEN_BUDGETS = (70, 140, 280, 560, 1120)  # what transformers' Gemma4ImageProcessor accepts (max_soft_tokens)
TILING = StageField("tiling", False)  # each slot's grid (1, rows, cols), kept to the head (mmpipe.families')

# ---- its model JSON's sections and their checks ----


@dataclass(frozen=True)
class Gemma4Vision(VisionConfig):
    """Gemma 4's tower. Its square image_size (the fixed square, and the planner's image): (S / patch)^2 patches
    pooled pool x pool to mm_tokens soft tokens, e.g. 768 px / 16 = 48 x 48 patches, pooled 3 x 3 to 16 x 16 = 256;
    with max_soft_tokens, images of any aspect ratio within it instead (module docstring). Pixels reach it
    rescaled to [0, 1] (mean 0, std 1: the tower maps them to [-1, 1] itself)."""
    mean: tuple[float, float, float] = (0.0, 0.0, 0.0)
    std: tuple[float, float, float] = (1.0, 1.0, 1.0)
    n_kv_heads: int = 0
    head_dim: int = 0
    pool: int = 3
    position_table: int = 10240
    rope_theta: float = 100.0
    clipped: bool = False  # Gemma4ClippableLinear's input / output bounds (buffers, read from the checkpoint)
    standardize: bool = False  # the pooled features' (x - std_bias) x std_scale (buffers; the 26B / 31B towers)
    # > 0: images keep their aspect ratio within this many soft tokens (transformers' Gemma4ImageProcessor's
    # max_soft_tokens: at most 9 x that many patches an image), pixels a patch list with each slot's grid in
    # `tiling`; 0: one fixed square of image_size (module docstring)
    max_soft_tokens: int = 0
    # a clip's frames, each an image at the video processor's own budget (Gemma4VideoProcessor's max_soft_tokens,
    # default 70), sampled at video_fps, at least video_min_frames, at most video_max_frames (its num_frames, 32)
    # (mmpipe.data.video's frames as images; with max_soft_tokens only)
    video_soft_tokens: int = 70
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 32

    @property
    def patches_per_image(self) -> int:  # the most patches the processor makes of one image, e.g. 280 x 9 = 2520
        return self.max_soft_tokens * self.pool ** 2

    @property
    def kv_heads(self) -> int:
        return self.n_kv_heads or self.n_heads

    @property
    def attn_head_dim(self) -> int:
        return self.head_dim or self.dim // self.n_heads

    @property
    def pooled_side(self) -> int:  # e.g. 48 / 3 = 16
        return self.grid // self.pool

    @property
    def mm_tokens(self) -> int:  # e.g. 16^2 = 256
        return self.pooled_side ** 2

    @property
    def n_features(self) -> int:  # <image_soft_token> placeholders per image
        return self.mm_tokens


@dataclass(frozen=True)
class Gemma4Text(Gemma3Text):
    """Gemma 4's decoder. Besides Gemma 3's sliding pattern (the last layer always full, as transformers forces):
    full layers' own head width and kv heads (global_head_dim, global_kv_heads; k_eq_v: v is k's projection),
    proportional rotary on global_rotary_factor of each full head, per-layer inputs of ple_dim each (0: none),
    the last kv_shared_layers layers reusing K/V, double-width MLPs on those (double_wide_mlp), soft-capped
    logits (final_softcap, 0: none), image blocks both ways on sliding layers (bidirectional_vision), and with a moe
    section (26B-A4B) routed experts beside every layer's dense MLP (the Gemma4*Moe* blocks)."""
    sliding_window: int = 512
    local_rope_theta: float = 10000.0
    rope_theta: float = 1000000.0
    global_head_dim: int = 0
    global_kv_heads: int = 0
    k_eq_v: bool = False
    global_rotary_factor: float = 0.25
    ple_dim: int = 0
    ple_vocab: int = 0
    kv_shared_layers: int = 0
    double_wide_mlp: bool = False
    final_softcap: float = 0.0
    bidirectional_vision: bool = False
    pad_id: int = 0
    # Gemma 4's MoE block on every layer (transformers' enable_moe_block): experts (num_experts), top_k
    # (top_k_experts), ff_dim (moe_intermediate_size); aux_coef 0 as imported (transformers adds no load-balancing
    # loss for Gemma 4; set it to add one); no shared expert (the dense MLP is the always-on path)
    moe: MoeConfig | None = None

    def is_sliding(self, i: int) -> bool:
        return bool((i + 1) % self.sliding_pattern) and i != self.n_layers - 1

    def layer_head_dim(self, sliding: bool) -> int:
        return self.head_dim if sliding else (self.global_head_dim or self.head_dim)

    def layer_kv_heads(self, sliding: bool) -> int:
        return self.kv_heads if sliding or not (self.k_eq_v and self.global_kv_heads) else self.global_kv_heads

    def kv_modes(self) -> list[str | None]:
        """transformers' kv_sharing_modes: None, "store" (the last unshared layer of a type that shared layers
        read) or "reuse" (a shared layer) per decoder layer."""
        n, first = self.n_layers, self.n_layers - self.kv_shared_layers
        modes: list[str | None] = [None if i < first else "reuse" for i in range(n)]
        if self.kv_shared_layers:
            for sliding in {self.is_sliding(i) for i in range(first, n)}:
                modes[max(i for i in range(first) if self.is_sliding(i) == sliding)] = "store"
        return modes


def gemma4_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    v, t = cfg.vision, cfg.text
    first = t.n_layers - t.kv_shared_layers
    kinds_before = {t.is_sliding(i) for i in range(first)}
    kinds_after = {t.is_sliding(i) for i in range(first, t.n_layers)}
    return moe_checks(t) + [
        (v.grid % v.pool == 0 and v.image_size % v.patch_size == 0, "vision.image_size",
         f"{v.image_size} px must be a multiple of patch_size {v.patch_size} x pool {v.pool}"),
        (v.grid <= v.position_table, "vision.position_table", f"{v.position_table} < the {v.grid}-patch side"),
        (v.max_soft_tokens in (0, *SOFT_TOKEN_BUDGETS), "vision.max_soft_tokens",
         f"{v.max_soft_tokens}: 0 (a fixed square) or one of transformers' {SOFT_TOKEN_BUDGETS}"),
        # the processor's longest side is max_soft_tokens x pool patches (a thin image: budget / pool^2 cells of
        # pool patches), e.g. 280 x 3 = 840 <= 10240
        (v.max_soft_tokens * v.pool <= v.position_table, "vision.max_soft_tokens",
         f"{v.max_soft_tokens} soft tokens make sides of up to {v.max_soft_tokens * v.pool} patches, past the "
         f"{v.position_table}-entry position table"),
        (v.n_heads % v.kv_heads == 0 and v.attn_head_dim % 4 == 0, "vision.n_kv_heads",
         f"{v.kv_heads} kv heads of {v.attn_head_dim}: must divide {v.n_heads} heads, width a multiple of 4"),
        (t.n_heads % t.kv_heads == 0 and t.n_heads % t.layer_kv_heads(False) == 0, "text.n_kv_heads",
         f"{t.kv_heads} / {t.layer_kv_heads(False)} kv heads must divide n_heads {t.n_heads}"),
        (0 <= t.kv_shared_layers < t.n_layers and kinds_after <= kinds_before, "text.kv_shared_layers",
         f"{t.kv_shared_layers}: the shared layers' types need an earlier producer of each"),
        (t.sliding_window >= 1 and t.sliding_pattern >= 1, "text.sliding_window",
         f"{t.sliding_window} / sliding_pattern {t.sliding_pattern} must be >= 1"),
        (0 < t.global_rotary_factor <= 1, "text.global_rotary_factor", f"{t.global_rotary_factor} not in (0, 1]"),
        (t.ple_dim == 0 or t.ple_vocab > 0, "text.ple_vocab", "per-layer inputs need their vocabulary (> 0)"),
        (t.final_softcap >= 0, "text.final_softcap", f"{t.final_softcap} must be >= 0 (0: none)"),
        (t.partial_rotary_factor == 1.0, "text.partial_rotary_factor", "sliding layers rotate whole heads (1.0)"),
        (0 <= t.pad_id < t.vocab_size, "text.pad_id", f"{t.pad_id} is not a token id"),
        (0 <= cfg.image_token_id < t.vocab_size, "image_token_id",
         f"{cfg.image_token_id} is not a token id of the {t.vocab_size}-token vocabulary"),
        (0 <= cfg.vision_start_id < t.vocab_size, "vision_start_id",
         f"{cfg.vision_start_id} is not a token id of the {t.vocab_size}-token vocabulary"),
        (0 <= cfg.vision_end_id < t.vocab_size, "vision_end_id",
         f"{cfg.vision_end_id} is not a token id of the {t.vocab_size}-token vocabulary"),
    ]


def moe_checks(t: Gemma4Text) -> list[tuple[bool, str, str]]:
    if t.moe is None:
        return []
    return t.moe.checks(t) + [
        (t.moe.shared_ff_dim == 0, "text.moe.shared_ff_dim",
         f"{t.moe.shared_ff_dim}: Gemma 4's MoE block has no shared expert (its dense MLP runs beside the experts; "
         f"valid: 0)"),
        (t.moe.norm_topk, "text.moe.norm_topk", "false: Gemma 4's router always renormalises its top k (valid: true)")]


# ---- the layers ----


class RMSNorm(nn.Module):
    """Gemma 4's RMSNorm: in fp32, x (mean(x^2) + eps)^-1/2, times w (from 1) when scaled, cast back."""

    def __init__(self, dim: int, eps: float, scale: bool = True):
        super().__init__()
        self.eps, self.scaled = eps, scale
        if scale:
            self.weight = nn.Parameter(torch.ones(dim))

    def forward(self, x):
        y = x.float()
        y = y * torch.pow(y.pow(2).mean(-1, keepdim=True) + self.eps, -0.5)
        return (y * self.weight.float() if self.scaled else y).type_as(x)


class ClippedLinear(nn.Module):
    """Gemma4ClippableLinear: a bias-free linear, its input and output clamped to bounds read from the checkpoint
    when clipped (infinite until then)."""

    def __init__(self, d_in: int, d_out: int, clipped: bool):
        super().__init__()
        self.linear = nn.Linear(d_in, d_out, bias=False)
        self.clipped = clipped
        if clipped:
            for name, value in (("input_min", -math.inf), ("input_max", math.inf), ("output_min", -math.inf),
                                ("output_max", math.inf)):
                self.register_buffer(name, torch.tensor(value))

    def forward(self, x):
        if self.clipped:
            return torch.clamp(self.linear(torch.clamp(x, self.input_min, self.input_max)), self.output_min,
                               self.output_max)
        return self.linear(x)


class GeluMLP(nn.Module):
    def __init__(self, dim: int, ff_dim: int, clipped: bool | None = None):
        super().__init__()
        make = (lambda i, o: nn.Linear(i, o, bias=False)) if clipped is None else \
            (lambda i, o: ClippedLinear(i, o, clipped))
        self.gate_proj, self.up_proj, self.down_proj = make(dim, ff_dim), make(dim, ff_dim), make(ff_dim, dim)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


def image_patches(t: StageTuple) -> Patches:
    """Each of the row's P patches' slot (M: padding) and (row, col) in its image's grid, from the slots' grids
    (t.tiling, unused slots zeroed): row-major within an image, transformers' convert_image_to_patches order
    (qwen2_vl.patch_coords with merge units of 1 patch). Once per micro-batch (row_cached)."""
    P = t.hidden.shape[1]  # the tower's rows: every row's, or dpo's pairs' shared ones (B / 2: rows.tower_rows)
    return row_cached((t.tiling, t.has_image), ("gemma4-patches", *t.hidden.shape[:2]),
                      lambda: patch_coords(used_grids(tower_rows(t)), P, 1))


def patch_grid(n: int, side: int, device) -> tuple[torch.Tensor, torch.Tensor]:
    """(column, row) of each of side^2 row-major patches: transformers' meshgrid(indexing="xy") positions."""
    idx = torch.arange(side * side, device=device)
    return idx % side, idx // side


class Gemma4PatchEmbed(nn.Module):
    group = "vision"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.patch, self.side = v.patch_size, v.grid
        self.input_proj = nn.Linear(v.patch_dim, v.dim, bias=False)
        self.position_embedding_table = nn.Parameter(torch.randn(2, v.position_table, v.dim) * 0.02)

    def forward(self, inputs):
        t = unpack_in(self, inputs)
        if t.tiling is not None:  # hidden: patches [B, P, C p p], each slot's grid in tiling
            return t._replace(hidden=self.embed_patches(t)).pack()
        px = t.hidden.flatten(0, t.hidden.dim() - 4)  # hidden: pixels [B, M, C, S, S]
        N, C, p, g = px.shape[0], px.shape[1], self.patch, self.side
        # transformers' convert_image_to_patches: [C, g, p, g, p] -> [g, g, p, p, C] -> [g^2, p p C]
        patches = px.reshape(N, C, g, p, g, p).permute(0, 2, 4, 3, 5, 1).reshape(N, g * g, p * p * C)
        x = self.input_proj((2 * (patches - 0.5)).to(self.input_proj.weight.dtype))
        col, row = patch_grid(N, g, px.device)
        x = x + self.position_embedding_table[0][col] + self.position_embedding_table[1][row]
        return t._replace(hidden=x).pack()

    def embed_patches(self, t: StageTuple) -> torch.Tensor:
        """[B, P, C p p] -> [B, P, Dv]: 2 (x - 0.5), input_proj, + table[0][column] + table[1][row] of each patch in
        its own image; a padding patch gets no position (Gemma4VisionPatchEmbedder zeroes it)."""
        c = image_patches(t)
        x = self.input_proj((2 * (t.hidden - 0.5)).to(self.input_proj.weight.dtype))
        valid = (c.slot < t.tiling.shape[1])[..., None]
        table = self.position_embedding_table
        return x + (table[0][c.col] + table[1][c.row]) * valid


def axial_rotary(side: int, head_dim: int, theta: float, device):
    """cos, sin [1, 1, side^2, head_dim] of a square's row-major patches (axial_rotary_at)."""
    col, row = patch_grid(side * side, side, device)
    return axial_rotary_at(col[None], row[None], head_dim, theta)


def axial_rotary_at(col: torch.Tensor, row: torch.Tensor, head_dim: int, theta: float):
    """cos, sin [B, 1, P, head_dim] of patches at col, row [B, P]: Gemma4VisionRotaryEmbedding's H-H-W-W layout;
    the first half of a head turns by the patch's column, the second by its row, each half rotate-half within
    itself."""
    inv = 1.0 / (theta ** (torch.arange(0, head_dim // 2, 2, device=col.device, dtype=torch.float32)
                           / (head_dim // 2)))
    fc, fr = col[..., None].float() * inv, row[..., None].float() * inv
    emb = torch.cat([fc, fc, fr, fr], -1)
    return emb.cos()[:, None], emb.sin()[:, None]


def tower_geometry(t: StageTuple, head_dim: int, theta: float):
    """(mask, (cos, sin)) of a tower block: a square's (None: all its patches see each other, rotary by the
    row-major grid), or a patch list's (each patch sees its own image's, a padding patch itself only: a Split of
    per-image segments; rotary by each patch's place in its own image). Once per micro-batch (row_cached)."""
    if t.tiling is None:
        side = math.isqrt(t.hidden.shape[1])
        return None, axial_rotary(side, head_dim, theta, t.hidden.device)

    def build():
        c, M = image_patches(t), t.tiling.shape[1]
        B = c.slot.shape[0]
        seg = torch.where(c.slot < M, torch.arange(B, device=c.slot.device)[:, None] * M + c.slot, -1)
        return segment_split(seg), axial_rotary_at(c.col, c.row, head_dim, theta)
    return row_cached((t.tiling, t.has_image), ("gemma4-tower", *t.hidden.shape[:2], head_dim, theta), build)


def rotate_halves(x, cos, sin):
    """apply_multidimensional_rope over 2 axes: each half of the head rotate-half by its own half of cos / sin."""
    h = x.shape[-1] // 2
    return torch.cat([apply_partial_rotary(x[..., :h], cos[..., :h], sin[..., :h]),
                      apply_partial_rotary(x[..., h:], cos[..., h:], sin[..., h:])], -1)


class Gemma4TowerAttention(nn.Module):
    def __init__(self, v: Gemma4Vision):
        super().__init__()
        self.n_heads, self.kv, self.hd, self.theta = v.n_heads, v.kv_heads, v.attn_head_dim, v.rope_theta
        self.q_proj = ClippedLinear(v.dim, v.n_heads * self.hd, v.clipped)
        self.k_proj = ClippedLinear(v.dim, self.kv * self.hd, v.clipped)
        self.v_proj = ClippedLinear(v.dim, self.kv * self.hd, v.clipped)
        self.o_proj = ClippedLinear(v.n_heads * self.hd, v.dim, v.clipped)
        self.q_norm, self.k_norm = RMSNorm(self.hd, v.ln_eps), RMSNorm(self.hd, v.ln_eps)
        self.v_norm = RMSNorm(self.hd, v.ln_eps, scale=False)

    def forward(self, x, mask, rotary):
        B, T, _ = x.shape
        cos, sin = rotary
        q = rotate_halves(self.q_norm(self.q_proj(x).view(B, T, -1, self.hd)).transpose(1, 2), cos, sin)
        k = rotate_halves(self.k_norm(self.k_proj(x).view(B, T, -1, self.hd)).transpose(1, 2), cos, sin)
        v = self.v_norm(self.v_proj(x).view(B, T, -1, self.hd)).transpose(1, 2)
        out = attend(q * math.sqrt(self.hd), k, v, mask)  # scale 1: SDPA's hd^-1/2 undone on q
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Gemma4TowerBlock(nn.Module):
    group = "vision"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(v.dim, v.ln_eps), RMSNorm(v.dim, v.ln_eps)
        self.pre_feedforward_layernorm = RMSNorm(v.dim, v.ln_eps)
        self.post_feedforward_layernorm = RMSNorm(v.dim, v.ln_eps)
        self.self_attn = Gemma4TowerAttention(v)
        self.mlp = GeluMLP(v.dim, v.ff_dim, v.clipped)

    def forward(self, args):
        t = unpack_in(self, args)
        a = self.self_attn
        attn = a(self.input_layernorm(t.hidden), *tower_geometry(t, a.hd, a.theta))
        x = t.hidden + self.post_attention_layernorm(attn)
        x = x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))
        return t._replace(hidden=x).pack()


class Gemma4Projector(nn.Module):
    """Gemma4VisionPooler (k x k average on the grid, x sqrt(Dv), fp32; standardized when vision.standardize) and
    Gemma4MultimodalEmbedder (unscaled RMSNorm, embedding_projection Dv -> D): [B, g^2, Dv] -> [B, (g/k)^2, D]."""
    group = "projector"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.side, self.pool, self.scale, self.standardize = v.grid, v.pool, v.dim ** 0.5, v.standardize
        if v.standardize:
            self.register_buffer("std_bias", torch.zeros(v.dim))
            self.register_buffer("std_scale", torch.ones(v.dim))
        self.embedding_pre_projection_norm = RMSNorm(v.dim, v.ln_eps, scale=False)
        self.embedding_projection = nn.Linear(v.dim, cfg.text.dim, bias=False)

    def forward(self, args):
        t = unpack_in(self, args)
        x = t.hidden
        B, _, D = x.shape
        if t.tiling is not None:
            pooled = self.pool_patches(t)
        else:
            pooled = F.avg_pool2d(x.float().transpose(1, 2).reshape(B, D, self.side, self.side), self.pool)
            pooled = pooled.flatten(2).transpose(1, 2)
        pooled = pooled * self.scale
        if self.standardize:
            pooled = (pooled - self.std_bias.float()) * self.std_scale.float()
        pooled = pooled.to(x.dtype)
        return t._replace(hidden=self.embedding_projection(self.embedding_pre_projection_norm(pooled))).pack()

    def pool_patches(self, t: StageTuple) -> torch.Tensor:
        """[B, P, Dv] -> fp32 [B, P / k^2, Dv]: each image's k x k cells averaged, its rows / k x cols / k pooled
        tokens row-major, the images' in slot order, zeros after (Gemma4VisionPooler._avg_pool_by_positions: a
        patch at (c, r) of an image of `cols` columns goes to cell (r // k) (cols // k) + c // k, its weight
        1 / k^2; padding patches go nowhere). E.g. a 6 x 9-patch image at k 3: 2 x 3 = 6 tokens."""
        c, k, x = image_patches(t), self.pool, t.hidden
        B, P, D = x.shape
        grids = used_grids(tower_rows(t))  # dpo's pairs: the even rows' (rows.tower_rows)
        counts = grids[..., 1] * grids[..., 2] // (k * k)  # [B, M] pooled tokens a slot
        slot = c.slot.clamp(max=grids.shape[1] - 1)
        start = (counts.cumsum(-1) - counts).gather(1, slot)
        cell = start + (c.row // k) * (grids[..., 2].gather(1, slot) // k) + c.col // k
        cell = torch.where(c.slot < grids.shape[1], cell, P // (k * k))  # padding: a spare cell, dropped
        out = x.new_zeros(B, P // (k * k) + 1, D, dtype=torch.float32)
        out = out.scatter_add(1, cell[..., None].expand(-1, -1, D), x.float() / (k * k))
        return out[:, :-1]


class Gemma4Embed(LlavaEmbed):
    """Tokens x sqrt(D) (the scale in the weight's dtype), placeholders read as pad (transformers' llm_input_ids),
    the image features over them; then the per-layer inputs (module docstring), made here once for every layer:
    ((RMSNorm(proj(x) / sqrt(D)) per layer) + table(ids) x sqrt(P)) / sqrt(2)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        t = cfg.text
        self.scale, self.pad_id, self.softcap = t.dim ** 0.5, t.pad_id, t.final_softcap
        self.n, self.ple = t.n_layers, t.ple_dim
        self.pool = cfg.vision.pool
        if t.ple_dim:
            self.embed_tokens_per_layer = nn.Embedding(t.ple_vocab, t.n_layers * t.ple_dim)
            nn.init.normal_(self.embed_tokens_per_layer.weight, std=0.02)
            self.per_layer_model_projection = nn.Linear(t.dim, t.n_layers * t.ple_dim, bias=False)
            self.per_layer_projection_norm = RMSNorm(t.ple_dim, t.ln_eps)

    def embed(self, ids):
        w = self.embed_tokens.weight
        return self.embed_tokens(ids) * torch.tensor(self.scale, dtype=w.dtype)

    def per_layer(self, ids, x):
        w = self.embed_tokens_per_layer.weight
        table = self.embed_tokens_per_layer(ids) * torch.tensor(self.ple ** 0.5, dtype=w.dtype)
        proj = self.per_layer_model_projection(x) * self.scale ** -1
        proj = self.per_layer_projection_norm(proj.view(*x.shape[:-1], self.n, self.ple)).flatten(-2)
        return (proj + table) * 2 ** -0.5

    def place_pooled(self, x: torch.Tensor, t: StageTuple) -> torch.Tensor:
        """x with row b's placeholders taking row b's pooled image tokens in order (t.hidden [B, P / k^2, D]: the
        first n_b of them, n_b from its used slots' grids: rows x cols / k^2 each); one line when the counts
        differ."""
        where = t.input_ids == self.image_token_id
        grids, k = used_grids(t), self.pool
        want = (grids[..., 1] * grids[..., 2] // (k * k)).sum(-1)
        placed = place_in_order(x, where, t.hidden, want, self.image_token_id, "pooled image tokens")
        return placed + 0 * t.hidden.sum()  # the tower stays on the graph

    def run(self, t: StageTuple, images: bool):
        ids = t.input_ids.masked_fill(t.input_ids == self.image_token_id, self.pad_id)
        x = self.embed(ids)
        if images and t.tiling is not None:
            x = self.place_pooled(x, t)
        elif images:
            x = place_images(x, t.input_ids, t.hidden, t.has_image, self.image_token_id)
        return t._replace(hidden=x, per_layer=self.per_layer(ids, x) if self.ple else None)

    def forward(self, args):
        return self.run(unpack_in(self, args), True).pack()

    def decode(self, t: StageTuple, cache: dict, start: int):
        return unpack_out(self, self(t.pack())) if start == 0 else self.run(t, False)


def gemma4_tied_head(embed: Gemma4Embed, args) -> torch.Tensor:
    """The tied LM head, soft-capped: cap x tanh(logits / cap) when final_softcap > 0."""
    return softcap(F.linear(args[0], embed.embed_tokens.weight), embed.softcap)


def softcap(logits: torch.Tensor, cap: float) -> torch.Tensor:
    return logits if not cap else torch.tanh(logits / cap) * cap


class Gemma4Head(nn.Module):
    """Untied head: hidden -> logits, soft-capped."""
    group = "text"
    adapters = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.lm_head = nn.Linear(cfg.text.dim, cfg.text.vocab_size, bias=False)
        self.cap = cfg.text.final_softcap

    def forward(self, args):
        return softcap(self.lm_head(unpack_in(self, args).hidden), self.cap)

    def decode(self, t: StageTuple, cache: dict, start: int):
        return self(t.pack())


def proportional_rotary(positions: torch.Tensor, head_dim: int, theta: float, fraction: float):
    """cos, sin [B, 1, L, head_dim] of transformers' "proportional" RoPE: the first fraction x head_dim / 2
    frequencies theta^(-2j / head_dim), the rest 0 (those pairs pass unrotated); rotate-half over the whole head."""
    angles = int(fraction * head_dim // 2)
    inv = 1.0 / (theta ** (torch.arange(0, 2 * angles, 2, device=positions.device, dtype=torch.float32) / head_dim))
    inv = torch.cat([inv, torch.zeros(head_dim // 2 - angles, device=positions.device)])
    emb = positions[..., None].float() * inv
    emb = torch.cat([emb, emb], -1)
    return emb.cos()[:, None], emb.sin()[:, None]


class Gemma4Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding: bool, mode: str | None):
        super().__init__()
        t = cfg.text
        self.sliding, self.shared = sliding, mode == "reuse"
        self.n_heads, self.hd, self.kv = t.n_heads, t.layer_head_dim(sliding), t.layer_kv_heads(sliding)
        self.window = t.sliding_window if sliding else None
        self.theta = t.local_rope_theta if sliding else t.rope_theta
        self.fraction = 1.0 if sliding else t.global_rotary_factor
        self.k_is_v = t.k_eq_v and not sliding  # full layers' values are their keys' projection (attention_k_eq_v)
        self.q_proj = nn.Linear(t.dim, t.n_heads * self.hd, bias=t.qkv_bias)
        self.q_norm = RMSNorm(self.hd, t.ln_eps)
        if not self.shared:
            self.k_proj = nn.Linear(t.dim, self.kv * self.hd, bias=t.qkv_bias)
            if not self.k_is_v:
                self.v_proj = nn.Linear(t.dim, self.kv * self.hd, bias=t.qkv_bias)
            self.k_norm = RMSNorm(self.hd, t.ln_eps)
            self.v_norm = RMSNorm(self.hd, t.ln_eps, scale=False)
        self.o_proj = nn.Linear(t.n_heads * self.hd, t.dim, bias=t.qkv_bias)

    def rotary(self, positions):
        if self.sliding:
            return gemma_rotary(positions, self.hd, self.theta, 1.0)
        return proportional_rotary(positions, self.hd, self.theta, self.fraction)

    def kv_of(self, x, rotary) -> torch.Tensor:
        """This layer's keys (normed, rotated) and values (unscaled-normed) stacked: [B, 2, H_kv, L, Dh]."""
        B, T, _ = x.shape
        k_raw = self.k_proj(x).view(B, T, self.kv, self.hd)
        v_raw = k_raw if self.k_is_v else self.v_proj(x).view(B, T, self.kv, self.hd)
        k = apply_partial_rotary(self.k_norm(k_raw).transpose(1, 2), *rotary)
        return torch.stack([k, self.v_norm(v_raw).transpose(1, 2)], 1)

    def forward(self, x, mask, rotary, kv=None, cache: dict | None = None):
        """-> (output, the K/V it attended to [B, 2, H_kv, S, Dh]); a shared layer attends to kv (its producer's).
        With a cache (generation) the new keys join the cached ones; a sliding layer then keeps its last
        window - 1 (the next query sees window keys, itself included), and returns them all before that cut, so
        a sliding consumer sees the same window its producer did."""
        B, T, _ = x.shape
        q = apply_partial_rotary(self.q_norm(self.q_proj(x).view(B, T, -1, self.hd)).transpose(1, 2), *rotary)
        if self.shared:
            kv = kv_heads(kv, self.kv, self.hd)  # the producer's, from its carried field
        else:
            kv = self.kv_of(x, rotary)
            if cache is not None:
                kv = torch.cat([cache["kv"], kv], dim=3) if "kv" in cache else kv
                cache["kv"] = kv[:, :, :, -(self.window - 1):] if self.window else kv
        out = attend(q * math.sqrt(self.hd), kv[:, 0], kv[:, 1], mask)  # scale 1: SDPA's hd^-1/2 undone on q
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1)), kv


def kv_field(kv: torch.Tensor) -> torch.Tensor:
    """A producer's K/V [B, 2, H_kv, S, Dh] as its carried field [B, S, 2 x H_kv x Dh]: sized by the row like every
    per-position field (StageField.per_position), so the planner and the profile know its shape from the config."""
    B, _, H, S, D = kv.shape
    return kv.permute(0, 3, 1, 2, 4).reshape(B, S, 2 * H * D)


def kv_heads(field: torch.Tensor, heads: int, head_dim: int) -> torch.Tensor:
    """kv_field's inverse: [B, S, 2 x H_kv x Dh] -> [B, 2, H_kv, S, Dh]."""
    B, S, _ = field.shape
    return field.view(B, S, 2, heads, head_dim).permute(0, 2, 3, 1, 4)


def gelu_tanh(x: torch.Tensor) -> torch.Tensor:
    return F.gelu(x, approximate="tanh")


class Gemma4Experts(Experts):
    """mmpipe.model.moe's experts (transformers' Gemma4TextExperts has the same gate_up_proj [E, 2F, D] and
    down_proj [E, D, F]), each a GELU-tanh gated MLP (the config's hidden_activation) instead of SwiGLU; the same
    dispatch, and --ep shards them as any Experts."""
    act = staticmethod(gelu_tanh)


class RouterProj(nn.Module):
    """The router's [E, D] projection (router.proj.weight), not an nn.Linear: --lora adapts linears, and a router
    stays frozen with the base, as mmpipe.model.moe's TopKRouter does (docs/moe.md)."""

    def __init__(self, dim: int, experts: int):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, dim).normal_(0.0, 0.02))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        return F.linear(x, self.weight)


class Gemma4Router(nn.Module):
    """transformers' Gemma4TextRouter: x [N, D] -> (probs fp32 [N, E], top-k ids [N, k], their weights fp32 [N, k]):
    logits = proj(norm(x) x scale x D^-1/2) (norm unscaled, `scale` a learned D vector), softmax in fp32, top k,
    renormalised to sum 1, then each times its expert's learned per_expert_scale."""

    def __init__(self, dim: int, experts: int, top_k: int, eps: float):
        super().__init__()
        self.norm = RMSNorm(dim, eps, scale=False)
        self.proj = RouterProj(dim, experts)
        self.scale = nn.Parameter(torch.ones(dim))
        self.per_expert_scale = nn.Parameter(torch.ones(experts))
        self.top_k, self.root = top_k, dim ** -0.5

    def forward(self, x: torch.Tensor):
        probs = self.proj(self.norm(x) * self.scale * self.root).softmax(-1, dtype=torch.float32)
        top, idx = probs.topk(self.top_k, dim=-1)
        top = top / top.sum(-1, keepdim=True)
        return probs, idx, top * self.per_expert_scale[idx]


class Gemma4Block(nn.Module):
    """A decoder layer (module docstring); subclasses fix its attention type, K/V role and whether it is sparse."""
    group = "text"
    sliding = False
    mode: str | None = None  # None, "store" (puts its K/V in the carried field), "reuse" (reads it)
    sparse = False  # the MoE block beside the dense MLP (text.moe; feed_forward)

    def __init__(self, cfg: ModelConfig, index: int):
        super().__init__()
        t = cfg.text
        self.index, self.ple = index, t.ple_dim
        self.image_token_id, self.blocks = cfg.image_token_id, t.bidirectional_vision and self.sliding
        self.field = "kv_sliding" if self.sliding else "kv_full"
        self.input_layernorm, self.post_attention_layernorm = RMSNorm(t.dim, t.ln_eps), RMSNorm(t.dim, t.ln_eps)
        self.pre_feedforward_layernorm = RMSNorm(t.dim, t.ln_eps)
        self.post_feedforward_layernorm = RMSNorm(t.dim, t.ln_eps)
        self.self_attn = Gemma4Attention(cfg, self.sliding, self.mode)
        self.mlp = GeluMLP(t.dim, t.ff_dim * (2 if t.double_wide_mlp and self.mode == "reuse" else 1))
        self.register_buffer("layer_scalar", torch.ones(1))
        if t.ple_dim:
            self.per_layer_input_gate = nn.Linear(t.dim, t.ple_dim, bias=False)
            self.per_layer_projection = nn.Linear(t.ple_dim, t.dim, bias=False)
            self.post_per_layer_input_norm = RMSNorm(t.dim, t.ln_eps)
        if self.sparse:  # transformers' names (Gemma4TextDecoderLayer with enable_moe_block)
            m = t.moe
            self.router = Gemma4Router(t.dim, m.experts, m.top_k, t.ln_eps)
            self.experts = Gemma4Experts(t.dim, m.ff_dim, m.experts)
            self.post_feedforward_layernorm_1 = RMSNorm(t.dim, t.ln_eps)
            self.post_feedforward_layernorm_2 = RMSNorm(t.dim, t.ln_eps)
            self.pre_feedforward_layernorm_2 = RMSNorm(t.dim, t.ln_eps)

    def feed_forward(self, x: torch.Tensor, real: torch.Tensor):
        """x (after attention) -> (what post_feedforward_layernorm takes, the router's statistics [B, 2, E] or None).
        Dense: mlp(pre_norm(x)). Sparse (Gemma4TextDecoderLayer's MoE block): the dense MLP and the experts side
        by side, each normed after, summed: post_1(mlp(pre(x))) + post_2(experts(pre_2(x))), the router reading x
        itself (its own unscaled norm); real: the positions the statistics count (segments > 0)."""
        y = self.mlp(self.pre_feedforward_layernorm(x))
        if not self.sparse:
            return y, None
        flat = x.reshape(-1, x.shape[-1])
        probs, idx, w = self.router(flat)
        e = self.experts(self.pre_feedforward_layernorm_2(flat), idx, w).view_as(x)
        y = self.post_feedforward_layernorm_1(y) + self.post_feedforward_layernorm_2(e)
        return y, route_stats(probs, idx, real)

    def geometry(self, t: StageTuple):
        a = self.self_attn
        rotary = row_cached((t.segments,), ("gemma4_rotary", a.hd, a.theta, a.fraction, a.sliding),
                            lambda: a.rotary(row_positions(t.segments)))
        blocks = image_blocks(t.input_ids, self.image_token_id) if self.blocks else None
        return row_attention(t.segments, blocks=blocks, window=a.window), rotary

    def run(self, t: StageTuple, mask, rotary, cache: dict | None = None) -> StageTuple:
        out, kv = self.self_attn(self.input_layernorm(t.hidden), mask, rotary, getattr(t, self.field), cache)
        x = t.hidden + self.post_attention_layernorm(out)
        y, stats = self.feed_forward(x, t.segments > 0)
        x = x + self.post_feedforward_layernorm(y)
        if self.ple:
            p = t.per_layer[..., self.index * self.ple:(self.index + 1) * self.ple]
            gated = F.gelu(self.per_layer_input_gate(x), approximate="tanh") * p
            x = x + self.post_per_layer_input_norm(self.per_layer_projection(gated))
        fields = {self.field: kv_field(kv)} if self.mode == "store" else {}
        if stats is not None:  # mmpipe.model.moe's moe_stats: made by the first decoder layer, kept to the head
            fields["moe_stats"] = stats if t.moe_stats is None else t.moe_stats + stats
        return t._replace(hidden=x * self.layer_scalar, **fields)

    def decode(self, t: StageTuple, cache: dict, start: int) -> StageTuple:
        """Cached generation: prefill (start 0) under the row's mask, then the new positions start.. (one at a
        time) against the cached keys; a producer passes on what it attended to, its consumers attend to that."""
        if not start:
            return self.leaving(self.run(t, *self.geometry(t), cache))
        a, T = self.self_attn, t.segments.shape[-1]
        pos = torch.arange(start, start + T, device=t.segments.device).expand(t.segments.shape[0], T)
        return self.leaving(self.run(t, None, a.rotary(pos), cache))

    def leaving(self, out: StageTuple) -> StageTuple:
        """out without the carried fields this layer is the last reader of (its stage_out lacks them)."""
        names = {f.name for f in self.__dict__.get("stage_out", ())}
        return out._replace(**{k: None for k in ("per_layer", "kv_sliding", "kv_full") if names and k not in names})

    def forward(self, args):
        t = unpack_in(self, args)
        return self.leaving(self.run(t, *self.geometry(t))).pack()


ROLES = {None: "Block", "store": "Store", "reuse": "Shared"}


def _block(sliding: bool, mode: str | None, sparse: bool = False) -> type:
    """Gemma4SlidingBlock / Gemma4GlobalStore / Gemma4SlidingMoeBlock / ...: one class per (type, role, sparse), so
    each K/V field has its maker and its dropper (StageField names classes) and the planner its experts' rule."""
    name = f"Gemma4{'Sliding' if sliding else 'Global'}{'Moe' if sparse else ''}{ROLES[mode]}"
    return type(name, (Gemma4Block,), {"sliding": sliding, "mode": mode, "sparse": sparse, "__module__": __name__})


BLOCKS = {(s, m): _block(s, m) for s in (True, False) for m in (None, "store", "reuse")}
MOE_BLOCKS = {(s, m): _block(s, m, True) for s in (True, False) for m in (None, "store", "reuse")}
globals().update({c.__name__: c for c in (*BLOCKS.values(), *MOE_BLOCKS.values())})  # pickling finds them here
Gemma4SlidingBlock, Gemma4GlobalBlock = BLOCKS[True, None], BLOCKS[False, None]


def block_table(t: Gemma4Text) -> dict:
    """The decoder's classes by (sliding, K/V role): sparse ones when the text section has an moe section."""
    return MOE_BLOCKS if t.moe else BLOCKS


class Gemma4MoeHead(MoeHead):
    """The untied head of a Gemma 4 MoE model: (soft-capped logits, aux_coef x the load-balancing loss)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.cap = cfg.text.final_softcap

    def forward(self, args):
        logits, aux = super().forward(args)
        return softcap(logits, self.cap), aux

    def decode(self, t: StageTuple, cache: dict, start: int):
        return softcap(super().decode(t, cache, start), self.cap)


class Gemma4TiedMoeHead(TiedMoeHead):
    """The tied head of a Gemma 4 MoE model (26B-A4B ties it): TiedMoeHead's, its logits soft-capped."""

    def __init__(self, cfg: ModelConfig, fields: tuple[StageField, ...]):
        super().__init__(cfg, fields)
        self.cap = cfg.text.final_softcap

    def __call__(self, embed: nn.Module, args):
        logits, aux = super().__call__(embed, args)
        return softcap(logits, self.cap), aux


class Gemma4FinalNorm(FinalNorm):
    make_norm = RMSNorm


def block_classes(cfg: ModelConfig) -> list[type]:
    t, table = cfg.text, block_table(cfg.text)
    return [table[t.is_sliding(i), m] for i, m in enumerate(t.kv_modes())]


def gemma4_specs(cfg: ModelConfig) -> list[LayerSpec]:
    t = cfg.text
    tied = t.tie_embeddings
    first = (TiedLayerSpec("embed", Gemma4Embed, cfg, tied_weight_attr="embed_tokens.weight") if tied
             else LayerSpec(Gemma4Embed, cfg))
    head = (TiedLayerSpec("embed", Gemma4Embed, cfg, forward_fn=gemma4_tied_head,
                          tied_weight_attr="embed_tokens.weight") if tied else LayerSpec(Gemma4Head, cfg))
    blocks = [LayerSpec(cls, cfg, i) for i, cls in enumerate(block_classes(cfg))]
    specs = ([LayerSpec(Gemma4PatchEmbed, cfg)] + [LayerSpec(Gemma4TowerBlock, cfg) for _ in range(cfg.vision.n_layers)]
             + [LayerSpec(Gemma4Projector, cfg), first] + blocks + [LayerSpec(Gemma4FinalNorm, cfg), head])
    return moe_head(specs, cfg) if t.moe else specs


def moe_head(specs: list[LayerSpec], cfg: ModelConfig) -> list[LayerSpec]:
    """The list with the head that also returns the load-balancing loss (mmpipe.model.moe.moe_head's rule, its
    logits soft-capped): Gemma4MoeHead, or Gemma4TiedMoeHead on the embedding, given the tuple entering it."""
    head = specs[-1]
    if not isinstance(head, TiedLayerSpec):
        return specs[:-1] + [LayerSpec(Gemma4MoeHead, cfg)]
    fields = live_fields(gemma4_fields(cfg), [s.typename for s in specs])[-2]
    return specs[:-1] + [TiedLayerSpec(head.key, head.typename, cfg, forward_fn=Gemma4TiedMoeHead(cfg, fields),
                                       tied_weight_attr=head.tied_weight_attr)]


def gemma4_fields(cfg: ModelConfig) -> tuple[StageField, ...]:
    """The row, then per_layer (Gemma4Embed to the last decoder layer) and each shared type's K/V (its producer to
    its last consumer)."""
    t, classes, table = cfg.text, block_classes(cfg), block_table(cfg.text)
    out = ROW + ((TILING,) if cfg.vision.max_soft_tokens else ())  # a patch list's grids, to the head
    if t.moe:  # mmpipe.model.moe's router statistics (2 E floats a row), made by decoder layer 0, kept to the head
        out += (StageField("moe_stats", True, made_by=classes[0]),)
    if t.ple_dim:
        out += (StageField("per_layer", True, made_by=Gemma4Embed, dropped_by=classes[-1],
                           per_position=_ple_width),)
    for sliding, name in ((True, "kv_sliding"), (False, "kv_full")):
        if table[sliding, "store"] in classes:
            out += (StageField(name, True, made_by=table[sliding, "store"], dropped_by=table[sliding, "reuse"],
                               per_position=_kv_widths[sliding]),)
    return out


def _ple_width(cfg: ModelConfig) -> int:  # per_layer's floats a position: n_layers x P (E2B: 35 x 256 = 8960)
    return cfg.text.n_layers * cfg.text.ple_dim


def _kv_width(sliding: bool):
    def width(cfg: ModelConfig) -> int:  # a shared K/V's floats a position: 2 x H_kv x Dh (E2B full: 2 x 1 x 512)
        return 2 * cfg.text.layer_kv_heads(sliding) * cfg.text.layer_head_dim(sliding)
    return width


_kv_widths = {True: _kv_width(True), False: _kv_width(False)}


# ---- cost rules (mmpipe.planning.costmodel) ----


def _block_cost(sliding: bool, mode: str | None):
    def cost(cfg, params, n, seq):
        """A Gemma 4 block per position, its type's own widths: the projections (2 x params: a shared layer has no
        K/V projections, so its params are fewer), q k^T and attn v over the keys it sees (min(seq, window) for a
        sliding layer: 4 x seq x keys x H x Dh). Kept per position, Gemma 3's measured terms (mmpipe.model.gemma3:
        10 D + 5 q + 4 kv + 4 F + 2 H + KV + 4 + 2 Dh; kv 0 on a shared layer, F doubled where double_wide_mlp) plus
        the per-layer input's 3 P + 3 D + 1 (gate out, GELU, product, projection, norm, residual; its statistic).
        An estimate from those parts, not measured against autograd as Gemma 3's was. E.g. gemma-4-31b's global
        layer (D 5376, q 32 x 512, kv 4 x 512, F 21504, no P): 10 x 5376 + 5 x 16384 + 4 x 2048 + 4 x 21504 +
        (64 + 4 + 4) + 1024 = 230,984 values a position."""
        t = cfg.text
        hd, kvh = t.layer_head_dim(sliding), t.layer_kv_heads(sliding)
        q, kv = t.n_heads * hd, (0 if mode == "reuse" else kvh * hd)
        ff = t.ff_dim * (2 if t.double_wide_mlp and mode == "reuse" else 1)
        keys = min(seq, t.sliding_window) if sliding else seq
        fwd = 2.0 * params * seq + 4.0 * seq * keys * q
        stats = 2 * t.n_heads + kvh + 4 + (1 if t.ple_dim else 0)
        ple = 3 * t.ple_dim + 3 * t.dim if t.ple_dim else 0
        act = (10 * t.dim + 5 * q + 4 * kv + 4 * ff + ple + stats + 2 * hd) * seq
        return costs.Cost(seq, fwd, act, (stats + 2 * hd) * seq, seq * t.dim)
    return cost


def _moe_block_cost(sliding: bool, mode: str | None):
    dense = _block_cost(sliding, mode)

    def cost(cfg, params, n, seq):
        """A sparse block: the dense block's rule (its MLP stays) on the ACTIVE parameters (the router and top_k of
        the E experts a position runs: params less (E - k) x 3 D Fm), plus what the MoE half keeps a position: the
        gathered inputs and each chosen expert's gate, up, GELU and product (k (D + 4 Fm)), the router's normed,
        scaled input and its logits and probabilities (2 D + 2 E), the three extra norms' outputs (3 D); fp32: the
        probabilities (E) and the four norms' statistics. An estimate from those parts (not measured), as
        moe.sparse_cost is for Qwen's blocks. E.g. gemma-4-26b-a4b (D 2816, k 8, Fm 704, E 128): 8 x (2816 + 2816)
        + 5 x 2816 + 256 = 59,392 values a position beside the dense block's."""
        m, t = cfg.text.moe, cfg.text
        c = dense(cfg, params - (m.experts - m.top_k) * expert_params(cfg), n, seq)
        extra = (m.top_k * (t.dim + 4 * m.ff_dim) + 5 * t.dim + 2 * m.experts) * seq
        return costs.Cost(c.tokens, c.fwd, c.act + extra, c.fp32 + (m.experts + 4) * seq, c.out)
    return cost


def gemma4_tower_tokens(cfg: ModelConfig) -> int:
    """The planner's patches an image (Family.tower_tokens): the square's, or an image at the soft-token budget's
    largest (9 x max_soft_tokens: 2520 at 280, 9% over the 768-px square's 2304)."""
    return cfg.vision.patches_per_image or cfg.vision.n_tokens


def _projector_cost(cfg, params, n, seq):
    """The k x k pool over the n patches, the unscaled RMSNorm and the Dv x D matmul over m pooled tokens (the
    square's, or max_soft_tokens); kept: the pooled and normed values (2 Dv) and the norm's statistic a pooled token
    (an estimate, not measured)."""
    v, m = cfg.vision, cfg.vision.max_soft_tokens or cfg.vision.mm_tokens
    return costs.Cost(n, n * v.dim + 2.0 * m * v.dim * cfg.text.dim, m * (2 * v.dim + 1), m, m * cfg.text.dim)


GEMMA4_PROJECTOR = costs.LayerRule("Gemma4Projector", _projector_cost, "vision")
BLOCK_RULES = {cls: costs.LayerRule(cls.__name__, _block_cost(s, m), "sequence") for (s, m), cls in BLOCKS.items()}
MOE_RULES = {cls: costs.LayerRule(cls.__name__, _moe_block_cost(s, m), "sequence", experts=True)
             for (s, m), cls in MOE_BLOCKS.items()}
GEMMA4_COSTS = {Gemma4PatchEmbed: costs.PATCH_EMBED, Gemma4TowerBlock: costs.VISION_BLOCK,
                Gemma4Projector: GEMMA4_PROJECTOR, Gemma4Embed: costs.TEXT_EMBED, **BLOCK_RULES, **MOE_RULES,
                Gemma4FinalNorm: costs.FINAL_NORM, Gemma4Head: costs.LINEAR_HEAD, gemma4_tied_head: costs.LINEAR_HEAD,
                Gemma4MoeHead: costs.LINEAR_HEAD, Gemma4TiedMoeHead: costs.LINEAR_HEAD}
