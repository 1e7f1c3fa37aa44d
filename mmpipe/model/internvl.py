"""The InternVL3.5 layers (issue 55): InternViT on dynamic 448-px tiles, a pixel-shuffle (0.5) projector, a Qwen3
decoder, dense or MoE. transformers' InternVLForConditionalGeneration holds the same weights (mmpipe.hf.internvl).

Layer list (`internvl_specs`), InternVL3.5-8B as the example (InternViT-300M: 24 blocks of 1024; Qwen3-8B: 36 layers
of 4096); a row holds T crops of 448 px (each used slot's tiles then its thumbnail, slot order, then zero crops) and
L decoder positions; `tiling` [B, M, 4] is each slot's (orig_h, orig_w, rows, cols), rows = cols = 0 for an image
that is one tile (the processor adds no thumbnail then), so an image takes 1 + rows x cols crops either way:

    InternPatchEmbed      pixels [B, T, 3, 448, 448] -> [B x T, 1 + 1024, 1024]: a 14-px Conv2d, the class token,
                          the learned position table (1 + 32 x 32 rows)
    InternVisionBlock x24 x + lambda_1 attn(norm x), then x + lambda_2 mlp(norm x): layer scale, LayerNorm (the
                          6B tower of the 38B / 241B: RMSNorm and RMSNorms on q and k over the whole width)
    InternProjector       drops the class token; pixel shuffle 0.5: each 2 x 2 block of the 32 x 32 grid -> one
                          token of 4 x 1024 channels (256 a crop); LayerNorm, linear_1 GELU linear_2 -> 4096; row
                          b's used crops' tokens, in order, scattered onto its image_token_id positions: [B, L, 4096]
    InternEmbed           embed_tokens; the placeholder positions take the projector's features
    InternBlock x 36      Qwen3's block: q / k RMSNorms per head, 1-D rotary from 0 per sample, causal per sample
                          (InternMoeBlock: its MLP Qwen3-MoE's experts, mmpipe.model.moe)
    FinalNorm, head       mmpipe.model.llava's (tied when text.tie_embeddings; MoeHead / TiedMoeHead for an MoE one)

The tiling (grid choice, resize, crop order, thumbnail) is transformers' GotOcr2ImageProcessor's, called by the data
side (mmpipe.data.internvl), never copied; a tile's 256 features are (grid / 2)^2 at grid = 448 / 14 = 32.
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec
from torch import nn

from ..config import VISION_ACTS, ModelConfig, VisionConfig
from . import costs
from .llava import ACTS, FinalNorm, LlamaBlock, LlamaText, LMHeadLinear, decoder_specs, tied_head
from .llava_next import AnyresEmbed, row_crops
from .moe import MOE_BLOCK, MoeHead, PreNormMoeBlock, TiedMoeHead, moe_head
from .qwen3_vl import MoeConfig, Qwen3Attention
from .rows import mark_pair_rows, slot_images, unmark_pair_rows
from .stage import ROW, StageField, unpack_in

# ---- its model JSON's sections and their checks (the registry entry's layout and checks) ----

NORMS = ("layer_norm", "rms_norm")


@dataclass(frozen=True)
class InternVision(VisionConfig):
    """InternViT: a class token and a learned position table, layer scale (lambda_1 / lambda_2), its norm
    ("layer_norm": InternViT-300M; "rms_norm" with qk_norm: InternViT-6B), q / k / v biases (attn_bias), its MLP's
    activation; the tiles: min_tiles..max_tiles tiles of image_size px per image (GotOcr2ImageProcessor's
    min_patches / max_patches; InternVL3.5: 1..12) plus a thumbnail when there are several."""
    act: str = "gelu"
    norm: str = "layer_norm"
    qk_norm: bool = False
    attn_bias: bool = True
    layer_scale: float = 0.1  # HF's layer_scale_init_value: a fresh model's lambdas (an import reads the weights)
    min_tiles: int = 1
    max_tiles: int = 12
    # a clip's frames, each one crop of image_size px (InternVLVideoProcessor), sampled at video_fps, at least
    # video_min_frames, at most video_max_frames (mmpipe.data.video's frames as images)
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 32

    @property
    def n_positions(self) -> int:  # the class token and the patches, e.g. 32^2 + 1 = 1025
        return self.n_tokens + 1

    @property
    def n_features(self) -> int:  # a crop's tokens after the 0.5 pixel shuffle, e.g. (32 / 2)^2 = 256
        return (self.grid // 2) ** 2

    @property
    def proj_in_dim(self) -> int:  # a shuffled token's channels: 2 x 2 patches, e.g. 4 x 1024
        return 4 * self.dim

    @property
    def most_crops(self) -> int:  # one image at its tile cap: max_tiles tiles + the thumbnail, e.g. 13
        return self.max_tiles + (self.max_tiles > 1)

    @property
    def max_pixels(self) -> int:  # no pixel bounds (its tiles are a count): what Qwen's processor writers ask
        return 0


@dataclass(frozen=True)
class InternText(LlamaText):
    """The Qwen3 decoder: LlamaText with RMSNorms on each head's q and k, dense or mixture-of-experts (MoeConfig,
    mmpipe.model.moe: Qwen3-30B-A3B's 128 experts, top 8)."""
    qk_norm: bool = True
    moe: MoeConfig | None = None


def internvl_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """The fields only the internvl family's layers read: the tower, the tiles, the decoder, the image ids."""
    v, t, V = cfg.vision, cfg.text, cfg.text.vocab_size
    return (t.moe.checks(t) if t.moe else []) + [
        (v.act in VISION_ACTS, "vision.act", f"'{v.act}' is not supported (valid: {', '.join(VISION_ACTS)})"),
        (v.norm in NORMS, "vision.norm", f"'{v.norm}' (valid: {', '.join(NORMS)})"),
        (v.image_size % v.patch_size == 0 and v.grid % 2 == 0, "vision.image_size",
         f"{v.image_size} px of {v.patch_size}-px patches: the grid must be whole and even (the 0.5 pixel shuffle)"),
        (1 <= v.min_tiles <= v.max_tiles, "vision.max_tiles",
         f"{v.min_tiles}..{v.max_tiles}: tiles per image, 1 <= min_tiles <= max_tiles"),
        (v.dim % v.n_heads == 0, "vision.n_heads", f"{v.n_heads} does not divide the tower's width {v.dim}"),
        (t.n_heads % t.kv_heads == 0, "text.n_kv_heads", f"{t.n_kv_heads} does not divide n_heads {t.n_heads}"),
        (t.qk_norm, "text.qk_norm", "false: InternVL3.5's decoders are Qwen3's, with q / k norms (valid: true)"),
        (all(0 <= i < V for i in (cfg.image_token_id, cfg.vision_start_id, cfg.vision_end_id)), "image_token_id",
         f"{cfg.image_token_id} / vision_start_id {cfg.vision_start_id} / vision_end_id {cfg.vision_end_id}: "
         f"token ids of the {V}-token vocabulary (<IMG_CONTEXT>, <img>, </img>)"),
    ]


# ---- the tower ----

class VisionRMSNorm(nn.Module):
    """InternViT-6B's RMSNorm: the statistic in fp32, the weight applied in the input's dtype (as transformers')."""

    def __init__(self, dim: int, eps: float = 1e-6):
        super().__init__()
        self.weight, self.eps = nn.Parameter(torch.ones(dim)), eps

    def forward(self, x):
        x32 = x.float()
        return self.weight * (x32 * torch.rsqrt(x32.pow(2).mean(-1, keepdim=True) + self.eps)).to(x.dtype)


def vision_norm(v: InternVision) -> nn.Module:
    return nn.LayerNorm(v.dim, eps=v.ln_eps) if v.norm == "layer_norm" else VisionRMSNorm(v.dim, v.ln_eps)


class PatchEmbeddings(nn.Module):
    def __init__(self, v: InternVision):
        super().__init__()
        self.projection = nn.Conv2d(v.channels, v.dim, v.patch_size, v.patch_size)


class InternPatchEmbed(nn.Module):
    """pixels [B, T, C, S, S] -> [B x T, 1 + N, D]: patches, the class token first, + the position table."""
    group = "vision"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.cls_token = nn.Parameter(torch.zeros(1, 1, v.dim))
        self.patch_embeddings = PatchEmbeddings(v)
        self.position_embeddings = nn.Parameter(torch.randn(1, v.n_positions, v.dim) * 0.02)

    def forward(self, inputs):
        t = mark_pair_rows(unpack_in(self, inputs))  # dpo's pairs sharing their crops (rows.mark_pair_rows)
        w = self.patch_embeddings.projection.weight
        x = self.patch_embeddings.projection(t.hidden.flatten(0, t.hidden.dim() - 4).to(w.dtype))
        x = torch.cat([self.cls_token.expand(x.shape[0], 1, -1), x.flatten(2).transpose(1, 2)], dim=1)
        return t._replace(hidden=x + self.position_embeddings).pack()


class VisionAttention(nn.Module):
    """q / k / v (biases: attn_bias), optional RMSNorms on q and k over the whole width, bidirectional within a crop."""

    def __init__(self, v: InternVision):
        super().__init__()
        self.n_heads = v.n_heads
        self.q_proj, self.k_proj, self.v_proj = (nn.Linear(v.dim, v.dim, bias=v.attn_bias) for _ in range(3))
        self.projection_layer = nn.Linear(v.dim, v.dim)
        if v.qk_norm:  # transformers' InternVLVisionRMSNorm at its default eps
            self.q_norm, self.k_norm = VisionRMSNorm(v.dim), VisionRMSNorm(v.dim)

    def forward(self, x):
        B, N, D = x.shape
        q, k, v = self.q_proj(x), self.k_proj(x), self.v_proj(x)
        if hasattr(self, "q_norm"):
            q, k = self.q_norm(q), self.k_norm(k)
        q, k, v = (y.view(B, N, self.n_heads, -1).transpose(1, 2) for y in (q, k, v))
        return self.projection_layer(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, N, D))


class VisionMLP(nn.Module):
    def __init__(self, v: InternVision):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(v.dim, v.ff_dim), nn.Linear(v.ff_dim, v.dim), ACTS[v.act]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class InternVisionBlock(nn.Module):
    """x + lambda_1 attention(norm x), then x + lambda_2 mlp(norm x) (layer scale: per-channel weights)."""
    group = "vision"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.attention, self.mlp = VisionAttention(v), VisionMLP(v)
        self.layernorm_before, self.layernorm_after = vision_norm(v), vision_norm(v)
        self.lambda_1 = nn.Parameter(torch.full((v.dim,), v.layer_scale))
        self.lambda_2 = nn.Parameter(torch.full((v.dim,), v.layer_scale))

    def forward(self, args):
        t = unpack_in(self, args)
        x = t.hidden + self.lambda_1 * self.attention(self.layernorm_before(t.hidden))
        return t._replace(hidden=x + self.lambda_2 * self.mlp(self.layernorm_after(x))).pack()


# ---- the projector and the decoder ----

def pixel_shuffle(x: torch.Tensor, g: int) -> torch.Tensor:
    """[n, g g, C] patch features (row-major) -> [n, (g / 2)^2, 4 C]: output token (r, c) holds patches (2r, 2c),
    (2r, 2c + 1), (2r + 1, 2c), (2r + 1, 2c + 1) side by side, in that channel order (transformers' pixel_shuffle at
    scale 0.5, the same arithmetic in one view and one permute)."""
    n, _, C = x.shape
    h = g // 2
    return x.view(n, h, 2, h, 2, C).permute(0, 1, 3, 2, 4, 5).reshape(n, h * h, 4 * C)


class InternProjector(nn.Module):
    """[B x T, 1 + N, D_v] -> [B, L, D_text]: the class token dropped, pixel shuffle, layer_norm, linear_1 GELU
    linear_2 on every crop; each row's used crops' tokens (its slots' 1 + rows x cols crops, in order) onto its
    image_token_id positions, zeros elsewhere."""
    group = "projector"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.grid, self.token = v.grid, cfg.image_token_id
        self.layer_norm = nn.LayerNorm(v.proj_in_dim)  # transformers' projector: LayerNorm's default eps, 1e-5
        self.linear_1 = nn.Linear(v.proj_in_dim, cfg.text.dim)
        self.linear_2 = nn.Linear(cfg.text.dim, cfg.text.dim)

    def forward(self, args):
        rows_, t = unmark_pair_rows(unpack_in(self, args))  # B, or B / 2 rows' crops shared by dpo's pairs
        B = t.input_ids.shape[0]
        x = pixel_shuffle(t.hidden[:, 1:], self.grid)
        x = self.linear_2(F.gelu(self.linear_1(self.layer_norm(x))))  # [rows_ x T, n, D]
        x = x.view(rows_, -1, *x.shape[1:])
        src = slot_images(B, 1, rows_).tolist()  # row b's crops: its own, or its pair's chosen row's
        crops, where = row_crops(t.tiling, t.has_image).sum(-1), t.input_ids == self.token
        rows = []
        for b in range(B):
            n = int(crops[b])
            if n > x.shape[1] or n * x.shape[2] != int(where[b].sum()):
                raise ValueError(f"row {b}: {int(where[b].sum())} image placeholder positions (id {self.token}) for "
                                 f"{n} crops of {x.shape[2]} features (the row holds {x.shape[1]} crops)")
            feats = x[src[b], :n].reshape(-1, x.shape[-1])
            rows.append(x.new_zeros(where.shape[1], x.shape[-1]).masked_scatter(where[b, :, None], feats))
        return t._replace(hidden=torch.stack(rows) + 0 * x.sum()).pack()  # padding crops stay on the graph


class InternEmbed(AnyresEmbed):
    """embed_tokens; the image_token_id positions take the projector's features (LLaVA-NeXT's rule)."""


class InternBlock(LlamaBlock):
    """Qwen3's decoder block: LlamaBlock (1-D rotary from 0 per sample, causal per sample) with q / k norms."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = Qwen3Attention(cfg)


class InternMoeBlock(PreNormMoeBlock, InternBlock):
    """InternBlock with Qwen3-MoE's sparse MLP; adds its layer's router statistics to the carried `moe_stats`."""


def internvl_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """The tower, the projector, the decoder (sparse, its head MoeHead or TiedMoeHead, when text.moe)."""
    moe = cfg.text.moe is not None
    text = decoder_specs(cfg, InternEmbed, InternMoeBlock if moe else InternBlock)
    tower = [LayerSpec(InternPatchEmbed, cfg)] + [LayerSpec(InternVisionBlock, cfg) for _ in range(cfg.vision.n_layers)]
    specs = tower + [LayerSpec(InternProjector, cfg)] + text
    return moe_head(specs, cfg) if moe else specs


TILING = StageField("tiling", False)  # each slot's (orig_h, orig_w, rows, cols), kept to the head as LLaVA-NeXT's
MOE_STATS = StageField("moe_stats", True, made_by=InternMoeBlock)  # mmpipe.model.moe's, kept to the head


def internvl_fields(cfg: ModelConfig) -> tuple[StageField, ...]:
    return ROW + ((MOE_STATS,) if cfg.text.moe else ()) + (TILING,)


# ---- cost rules: the tower and the projector on the row's T crops (per_row: a CropRow, as LLaVA-NeXT's) ----

def crops_tokens(cfg: ModelConfig) -> int:
    """The tower's tokens for one image at its cap (Family.tower_tokens), e.g. 13 x 1025 = 13325."""
    return cfg.vision.most_crops * cfg.vision.n_positions


def _projector(cfg, params, n, seq, row):
    """T crops' 256 shuffled tokens of 4 D_v each: kept the LayerNorm's input and output (8 D_v), linear_1's output
    and GELU's (2 D), the LayerNorm's statistics; then the row's [L, D] the tokens are scattered onto."""
    k, tokens, t = costs._crops(cfg, row), cfg.vision.n_features, cfg.text
    act = (2 * cfg.vision.proj_in_dim + 2 * t.dim + 2) * tokens
    return costs.Cost(tokens * k, 2.0 * params * tokens * k, act * k + seq * t.dim, 2.0 * tokens * k, seq * t.dim)


PROJECTOR = costs.LayerRule("InternProjector", _projector, "vision", per_row=True)
COSTS = {InternPatchEmbed: costs.ANYRES_PATCH_EMBED, InternVisionBlock: costs.ANYRES_VISION_BLOCK,
         InternProjector: PROJECTOR, InternEmbed: costs.ANYRES_EMBED, InternBlock: costs.LLAMA_BLOCK,
         FinalNorm: costs.FINAL_NORM, LMHeadLinear: costs.LINEAR_HEAD, tied_head: costs.LINEAR_HEAD,
         InternMoeBlock: MOE_BLOCK, MoeHead: costs.LINEAR_HEAD,
         TiedMoeHead: costs.LINEAR_HEAD}  # the MoE block: Qwen3-VL-MoE's rule (Qwen3's)
