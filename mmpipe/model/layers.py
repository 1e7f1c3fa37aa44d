"""The moondream-shaped layers, one class per pipeline layer.

Every layer takes and returns the stage tuple (mmpipe.model.stage), except the first
(takes the batch inputs) and the last (returns logits). `group` names what --freeze acts on.
`moondream_specs` is the moondream family's layer list (mmpipe.families).
"""
from __future__ import annotations

import typing
from dataclasses import dataclass

import torch
from deepspeed.pipe import LayerSpec
from torch import nn

from ..config import ModelConfig, VisionConfig
from .attention import FusedAttention, GeluMLP, row_geometry, slot_prefix
from .crops import merge_crop_features
from .rows import IMAGE_SLOT, pair_rows, place_images
from .stage import StageTuple, unpack_in, unpack_out

# ---- its model JSON's sections and their checks (the registry entry's layout and checks) ----

@dataclass(frozen=True)
class CropVision(VisionConfig):
    """The moondream family's tower (both fusions): SigLIP-shaped, GELU-tanh, with moondream2's multi-crop."""
    multi_crop: typing.ClassVar[bool] = True  # --max-crops limits its crops
    # How many crop features each image token concatenates before the projector. moondream2 feeds [global crop,
    # pooled local crops] side by side, so its proj_mlp.fc1 reads 2 x dim (2 x 1152 = 2304; 0.5B: 2 x 720 = 1440).
    # 1: the projector reads the tower's output as is.
    crop_features: int = 1
    # Multi-crop (moondream2: 12): each image is encoded as a global crop plus up to max_crops overlapping local
    # crops of image_size px (mmpipe.data.crops), in 1 + max_crops fixed slots per sample; the projector reads
    # [global, stitched-and-pooled locals]. 0: one crop per image. overlap_margin: patches each local crop shares
    # with a neighbour on each side (moondream: 4).
    max_crops: int = 0
    overlap_margin: int = 4

    @property
    def crop_slots(self) -> int:  # 1 + 12 = 13 for moondream2
        return 1 + self.max_crops if self.max_crops else 1

    @property
    def proj_in_dim(self) -> int:  # e.g. 2 x 1152 = 2304 (moondream2)
        return self.crop_features * self.dim


def moondream_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """Grouped-query attention in the Phi block (k/v heads shared by n_heads / kv_heads query heads each)
    and the projector's crop features (1, or moondream2's global + pooled local: 2)."""
    v, t = cfg.vision, cfg.text
    return [
        (t.n_kv_heads >= 0 and t.n_heads % t.kv_heads == 0, "text.n_kv_heads",
         f"{t.n_kv_heads} does not divide n_heads {t.n_heads}"),
        (v.crop_features in (1, 2), "vision.crop_features",
         f"{v.crop_features} (valid: 1, or 2 for moondream2's global + local crop features)"),
        (v.max_crops >= 0 and (v.max_crops == 0 or v.crop_features == 2), "vision.max_crops",
         f"{v.max_crops}: multi-crop needs crop_features 2 (the projector reads global + local features)"),
        (v.max_crops == 0 or not (cfg.layout and cfg.layout.cross_attention), "vision.max_crops",
         f"{v.max_crops}: multi-crop is for the prefix decoder (cross-attention reads one crop)"),
        (v.max_crops == 0 or 0 <= 2 * v.overlap_margin < v.grid, "vision.overlap_margin",
         f"{v.overlap_margin} patches on each side leave no window in a {v.grid}-patch crop"),
    ]



class PatchEmbed(nn.Module):
    """pixels [B, C, H, W] -> linear patch embedding + learned positions, no CLS token (SigLIP).
    Multi-crop (moondream2): pixels [B, K, C, H, W] (K = vision.crop_slots) and the tiling; every crop slot is
    embedded as an image of its own, and the tiling rides along. pixels [B, M, C, H, W] (multi-crop
    [B, M, K, C, H, W]) -> B x M (x crops) images [B x M (x crops), N_img, D]."""
    group = "vision"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.patch_size = v.patch_size
        self.linear = nn.Linear(v.patch_dim, v.dim)
        self.pos_emb = nn.Parameter(torch.randn(1, v.n_tokens, v.dim) * 0.02)

    def forward(self, inputs):
        t = unpack_in(self, inputs)  # hidden: the pixels
        x = t.hidden.to(self.linear.weight.dtype)  # DeepSpeed casts the model, never the inputs
        x = x.flatten(0, x.dim() - 4)  # image / crop slots: [B, M, S, C, H, W] -> [B M S, C, H, W]
        B, C, H, W = x.shape
        p = self.patch_size
        # [B, C, H, W] -> [B, (H/p)(W/p), C p p]: one row per patch, row-major over the grid
        x = x.reshape(B, C, H // p, p, W // p, p).permute(0, 2, 4, 1, 3, 5).reshape(B, (H // p) * (W // p), C * p * p)
        return t._replace(hidden=self.linear(x) + self.pos_emb).pack()


class VisionBlock(nn.Module):
    """Pre-LN ViT block, bidirectional attention over the image tokens."""
    group = "vision"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.ln1 = nn.LayerNorm(v.dim, eps=v.ln_eps)
        self.attn = FusedAttention(v.dim, v.n_heads)
        self.ln2 = nn.LayerNorm(v.dim, eps=v.ln_eps)
        self.mlp = GeluMLP(v.dim, v.ff_dim)

    def forward(self, args):
        t = unpack_in(self, args)
        x = t.hidden  # [B, N_img, D_vision]
        x = x + self.attn(self.ln1(x))
        x = x + self.mlp(self.ln2(x))
        return t._replace(hidden=x).pack()


class VisionNorm(nn.Module):
    """The ViT's final LayerNorm (SigLIP post_layernorm)."""
    group = "vision"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.vision.dim, eps=cfg.vision.ln_eps)

    def forward(self, args):
        t = unpack_in(self, args)
        return t._replace(hidden=self.ln(t.hidden)).pack()


class Projector(nn.Module):
    """2-layer MLP, vision width -> text width. It keeps PyTorch's default nn.Linear init on
    purpose: initialised at std 0.02, the projected image starts far smaller than the text
    embeddings (std 1) and, in the measurement that motivated mmpipe's demo, the decoder
    ignored the image for about five minutes.

    With image_pos (cross-attention fusion) it also adds a learned position per image token at text
    width (std 1, the text embeddings' scale): the prefix decoder gives image tokens their positions
    through rotary attention, cross-attention has none, and without this the position-keyed
    questions stayed at chance (docs/models.md).

    vision.crop_features 2 (moondream2): fc1 reads [global crop features, pooled local crop features]
    per image token, 2 x D_vision. With vision.crop_slots K > 1 the tower has encoded K crop
    slots per sample and the stage tuple carries their tiling: the local crops are stitched without
    their overlaps and pooled to the global grid (mmpipe.model.crops.merge_crop_features), so the
    padding slots are never read and get no gradient. With one slot the tower encodes one crop
    whose features fill both halves, [g, g]: exactly moondream's input for an image it covers with
    one tile (either side <= 378 px), whose one local crop is then the same 378 x 378 resize as the
    global crop, stitched whole and pooled 27 x 27 -> 27 x 27, the identity."""
    group = "projector"

    def __init__(self, cfg: ModelConfig, image_pos: bool = False):
        super().__init__()
        self.crop_features, self.slots, self.margin = (cfg.vision.crop_features, cfg.vision.crop_slots,
                                                       cfg.vision.overlap_margin)
        self.mlp = GeluMLP(cfg.vision.proj_in_dim, cfg.proj_inner_dim, cfg.text.dim)
        if image_pos:
            self.image_pos = nn.Parameter(torch.randn(cfg.vision.n_tokens, cfg.text.dim))  # [N_img, D_text]

    def forward(self, args):
        t = unpack_in(self, args)
        x = t.hidden  # [B, N_img, D_vision]; multi-crop [B x slots, N_img, D_vision]
        if t.tiling is not None:  # [B (x M), slots, N_img, D_vision] -> [B (x M), N_img, 2 D_vision]
            per_row = t.tiling.numel() // (2 * t.tiling.shape[0])  # tiling [B, 2] (an image a row) or [B, M, 2]
            rows = x.shape[0] // (self.slots * per_row)  # B, or B / 2 for dpo's pairs (rows.pair_rows)
            tiling = pair_rows(t.tiling, rows).reshape(-1, 2)
            x = merge_crop_features(x.view(-1, self.slots, *x.shape[1:]), tiling, self.margin)
            t = t._replace(tiling=None)  # no stage after this one needs it
        elif self.crop_features == 2:  # one crop: [g, g], see above
            x = torch.cat([x, x], dim=-1)  # [B, N_img, 2 D_vision]
        x = self.mlp(x)  # [B, N_img, D_text]
        if hasattr(self, "image_pos"):
            x = x + self.image_pos
        return t._replace(hidden=x).pack()


class TextEmbed(nn.Module):
    """Token embedding with each image in its sample's IMAGE_SLOT block right after BOS (mmpipe.model.rows):
    [BOS, img_1..img_N, text...]; a text-only sample has no block, its text follows BOS."""
    group = "text"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.wte = nn.Embedding(cfg.text.vocab_size, cfg.text.dim)

    def forward(self, args):
        t = unpack_in(self, args)  # hidden: the images [B x M, N_img, D]; input_ids [B, L], image blocks in place
        emb = self.wte(t.input_ids.clamp(min=0))  # [B, L, D]; IMAGE_SLOT positions are overwritten
        return t._replace(hidden=place_images(emb, t.input_ids, t.hidden, t.has_image, IMAGE_SLOT)).pack()

    def decode(self, t: StageTuple, cache: dict, start: int) -> StageTuple:
        """Cached generation (mmpipe.inference.generate): the prompt as in forward, the image in place;
        afterwards only the new tokens, whose positions follow it."""
        return unpack_out(self, self(t.pack())) if start == 0 else t._replace(hidden=self.wte(t.input_ids))


class DecoderBlock(nn.Module):
    """Phi block: one LayerNorm feeds attention and MLP in parallel; x + attn(ln x) + mlp(ln x). Per
    sample of the row: its BOS + image block bidirectional, causal after, rotary positions from 0."""
    group = "text"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t = cfg.text
        self.rotary_dim, self.theta = t.rotary_dim, t.rope_theta
        self.ln = nn.LayerNorm(t.dim, eps=t.ln_eps)
        self.attn = FusedAttention(t.dim, t.n_heads, t.kv_heads)  # grouped-query when text.n_kv_heads < n_heads
        self.mlp = GeluMLP(t.dim, t.ff_dim)

    def forward(self, args):
        t = unpack_in(self, args)
        return t._replace(hidden=self.run(t, 0)).pack()

    def decode(self, t: StageTuple, cache: dict, start: int) -> StageTuple:
        """Cached generation: the new positions, attending to the keys and values cached before them."""
        return t._replace(hidden=self.run(t, start, cache))

    def run(self, t: StageTuple, start: int, cache: dict | None = None) -> torch.Tensor:
        """t.hidden [B, T, D] -> [B, T, D]: the whole row (forward, prefill: start 0) or generation's new
        positions start.. (mmpipe.model.attention.row_geometry)."""
        prefix = slot_prefix(t.input_ids, IMAGE_SLOT)  # BOS + image bidirectional
        mask, rotary = row_geometry(t.segments, self.rotary_dim, self.theta, prefix, start)
        h = self.ln(t.hidden)
        return t.hidden + self.attn(h, mask=mask, rotary=rotary, cache=cache) + self.mlp(h)


class LMHead(nn.Module):
    """Final LayerNorm + untied linear head -> logits [B, T, V]."""
    group = "text"
    adapters = False  # no LoRA on the vocabulary projection (mmpipe.model.lora)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.ln = nn.LayerNorm(cfg.text.dim, eps=cfg.text.ln_eps)
        self.linear = nn.Linear(cfg.text.dim, cfg.text.vocab_size)

    def forward(self, args):
        x = unpack_in(self, args).hidden
        return self.linear(self.ln(x))

    def decode(self, t: StageTuple, cache: dict, start: int) -> torch.Tensor:
        return self(t.pack())  # position by position: the logits of the new positions


def vision_specs(cfg: ModelConfig, **projector) -> list[LayerSpec]:
    """The image side of the moondream-shaped families: PatchEmbed, VisionBlock x n, VisionNorm, Projector."""
    return ([LayerSpec(PatchEmbed, cfg)] + [LayerSpec(VisionBlock, cfg) for _ in range(cfg.vision.n_layers)]
            + [LayerSpec(VisionNorm, cfg), LayerSpec(Projector, cfg, **projector)])


def moondream_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """The image spliced after BOS: vision_specs, TextEmbed, DecoderBlock x n_text, LMHead."""
    return (vision_specs(cfg) + [LayerSpec(TextEmbed, cfg)]
            + [LayerSpec(DecoderBlock, cfg) for _ in range(cfg.text.n_layers)] + [LayerSpec(LMHead, cfg)])
