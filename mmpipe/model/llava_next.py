"""The LLaVA-NeXT / LLaVA-OneVision layers: any-resolution tiles. One family, the generations differ by config
(mmpipe.config.VisionConfig.grid_pinpoints, anyres_max).

Layer list (`llava_next_specs`), llava-v1.6-mistral-7b as the example; a row holds T crops of image_size px
(each used slot's base crop then its rows x cols tiles in transformers' order, slot order, then zero crops)
and L decoder positions; `tiling` [B, M, 4] is each slot's (orig_h, orig_w, rows, cols), rows = cols = 0 for
an image encoded as its base crop only, and stays in the stage tuple to the head (mmpipe.model.stage):

    VisionEmbed          pixels [B, T, 3, 336, 336] -> [B x T, 577, 1024] (mmpipe.model.llava's CLIP / SigLIP)
    TowerBlock x 23      mmpipe.model.llava's, on every crop alike
    AnyresProjector      linear_1 GELU linear_2 on every crop's features ('default': CLIP's class token dropped),
                         then per image: the base crop's N features, the tiles' features as one (rows x g,
                         cols x g) grid, unpadded to the image's aspect, (OneVision) bilinear-pooled past
                         anyres_max x N, one learned image_newline after each feature row; row b's images'
                         features scattered onto its image_token_id positions in order: [B, L, 4096]
    AnyresEmbed          embed_tokens; the placeholder positions take the projector's features
    LlamaBlock x 32, FinalNorm, head   mmpipe.model.llava's (tied when text.tie_embeddings)

OneVision's clips (mmpipe.data.video): a clip of F sampled frames takes a slot of F crops, each frame resized to
image_size by transformers' LlavaOnevisionVideoProcessor, its tiling (0, 0, -1, 1 - F) (rows -1 marks a clip; 1 +
rows x cols = F, the crops every count already computes). Each frame is encoded by the tower and the projector as a
crop, its g x g features bilinear-pooled to ceil(g / 2) x ceil(g / 2) (LlavaOnevisionModel.apply_pooling), the
frames' pooled features in order, then one image_newline after the whole clip (get_video_features): F ceil(g / 2)^2
+ 1 positions (LlavaOnevisionProcessor.replace_video_token's count), e.g. 32 frames of 27 x 27: 32 x 196 + 1 = 6273.

The unpad and pooling rules are transformers' LlavaNextModel / LlavaOnevisionModel.pack_image_features, and
the counts those of their processors' _get_number_of_features (`image_feature_count`), from the sizes alone,
so the data side, the planner and the layers agree without an image decoded. Parameter names follow
transformers' modules (the projector's `image_newline` is `model.image_newline`), so mmpipe.hf.llava_next maps
them one to one.
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec
from torch import nn

from ..config import ModelConfig, VisionConfig
from .llava import (
    ClipVision,
    LlavaEmbed,
    LlavaProjector,
    TowerBlock,
    VisionEmbed,
    decoder_specs,
    llava_checks,
)
from .rows import slot_images, unmark_pair_rows
from .stage import unpack_in

# ---- its model JSON's sections and their checks (the registry entry's layout and checks) ----

@dataclass(frozen=True)
class AnyresVision(ClipVision):
    """The LLaVA-NeXT / OneVision family (mmpipe.model.llava_next): LLaVA's tower with any-resolution tiling.
    grid_pinpoints are HF's image_grid_pinpoints ([h, w] px, multiples of image_size): an image is encoded as its
    base crop plus the tiles of the pinpoint its aspect fits best; anyres_max is OneVision's "anyres_max_9" -> 9 (its
    features are bilinear-pooled past 9 x N; also: an image of a several-image sample is its base crop only), 0 for
    LLaVA-NeXT. `image_size` is the tower's crop (336 CLIP-L, 384 SigLIP)."""
    grid_pinpoints: tuple[tuple[int, int], ...] = ()
    anyres_max: int = 0
    # OneVision's clips (mmpipe.data.video; --video-fps, --video-min-frames, --video-max-frames): the video
    # processor's sampling; its frames are the tower's crop size
    video_fps: float = 2.0
    video_min_frames: int = 4
    video_max_frames: int = 768

    @property
    def any_resolution(self) -> bool:  # as transformers' conv: OneVision's SigLIP cuts 384 px / 14 into 27 x 27
        return bool(self.grid_pinpoints)


def llava_next_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """LLaVA's checks (tower, decoder, <image>) plus the pinpoints: [h, w] pairs, multiples of the crop."""
    v, S = cfg.vision, cfg.vision.image_size
    ok = bool(v.grid_pinpoints) and all(len(p) == 2 and all(isinstance(x, int) and x > 0 and x % S == 0 for x in p)
                                        for p in v.grid_pinpoints)
    return llava_checks(cfg) + [
        (ok, "vision.grid_pinpoints", f"{[list(p) for p in v.grid_pinpoints]}: one or more [h, w] pairs in "
         f"pixels, each a positive multiple of image_size {S}"),
        (v.anyres_max >= 0, "vision.anyres_max", f"{v.anyres_max} must be >= 0 (0: LLaVA-NeXT, no pooling)"),
        (v.n_features == v.n_tokens, "vision.feature_select", f"'{v.feature_select}' with a {v.kind} tower: tiles "
         f"need one feature per patch (valid: default for clip, full for siglip)"),
    ]



def unpad_box(h: int, w: int, H: int, W: int) -> tuple[int, int, int, int]:
    """(top, bottom, left, right) of a (H, W) feature grid an (h, w) px image fills after the processor's
    resize-and-centre-pad (transformers' unpad_image, its float rounding kept)."""
    if w / h > W / H:
        pad = (H - int(round(h * (W / w), 7))) // 2
        return pad, H - pad, 0, W
    pad = (W - int(round(w * (H / h), 7))) // 2
    return 0, H, pad, W - pad


def pooled_shape(v: VisionConfig, H: int, W: int) -> tuple[int, int] | None:
    """OneVision's cap: an unpadded (H, W) feature grid over anyres_max x N features (ratio > 1.1) is
    bilinear-pooled to this size; None when it stays (and always for LLaVA-NeXT, anyres_max 0)."""
    if not v.anyres_max:
        return None
    ratio = math.sqrt(H * W / (v.anyres_max * v.grid ** 2))
    return (int(H // ratio), int(W // ratio)) if ratio > 1.1 else None


def image_crops(rows, cols):
    """Crops the tower encodes for one image: its base crop and its rows x cols tiles (0 x 0: the base only);
    ints, or tensors of them (a row's slots)."""
    return 1 + rows * cols


def clip_tiling(frames: int) -> tuple[int, int, int, int]:
    """A OneVision clip's slot tiling: rows -1 marks it, 1 + rows x cols = its frames' crops (module docstring)."""
    return 0, 0, -1, 1 - frames


def pooled_side(g: int) -> int:
    """A clip frame's pooled feature side (LlavaOnevisionModel.apply_pooling): ceil(g / 2), e.g. 27 -> 14."""
    return math.ceil(g / 2)


def image_feature_count(v: VisionConfig, h: int, w: int, rows: int, cols: int) -> int:
    """Decoder positions of one (h, w) px image tiled rows x cols: the base crop's N, then each (unpadded,
    pooled) feature row and its newline; a base-only image N + 1 (transformers' processors' count); a clip (rows
    -1) of F = 1 - cols frames: F pooled grids, then one newline."""
    if rows < 0:
        return (1 - cols) * pooled_side(v.grid) ** 2 + 1
    if not rows:
        return v.grid ** 2 + 1
    top, bottom, left, right = unpad_box(h, w, rows * v.grid, cols * v.grid)
    H, W = pooled_shape(v, bottom - top, right - left) or (bottom - top, right - left)
    return v.grid ** 2 + H * (W + 1)


def row_crops(tiling: torch.Tensor, has_image: torch.Tensor) -> torch.Tensor:
    """[B, M] crops of each slot (0 for an unused one) from tiling [B, M, 4] and has_image [B, M]."""
    if tiling is None or tiling.dim() != 3 or tiling.shape[-1] != 4:
        raise ValueError("the llava_next family's layers need each image slot's tiling: the stage tuple's tiling "
                         "long [B, M, 4] (orig_h, orig_w, rows, cols), last of its integer tensors")
    return image_crops(tiling[..., 2], tiling[..., 3]) * (has_image > 0)


class AnyresProjector(LlavaProjector):
    """llava.py's projector on every crop, then each image's features laid out as transformers does (module
    docstring) onto its placeholder block: [B x T, N_pos, D_v] -> [B, L, D_text], zeros off the placeholders."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.v, self.token = cfg.vision, cfg.image_token_id
        self.image_newline = nn.Parameter(torch.randn(cfg.text.dim) / math.sqrt(cfg.text.dim))  # HF's init

    def forward(self, args):
        n, t = unmark_pair_rows(unpack_in(self, args))  # n: B, or B / 2 rows' crops shared by dpo's pairs
        B = t.input_ids.shape[0]
        x = super().forward(args)[0]  # [n x T, N, D]
        x = x.view(n, -1, *x.shape[1:])
        crops = row_crops(t.tiling, t.has_image)
        where = t.input_ids == self.token
        rows, src = [], slot_images(B, 1, n).tolist()  # row b's crops: its own, or its pair's chosen row's
        for b in range(B):
            feats = self.row_features(x[src[b]], t.tiling[b], crops[b], b)
            if len(feats) != int(where[b].sum()):
                raise ValueError(f"row {b}: {int(where[b].sum())} image placeholder positions (id {self.token}) "
                                 f"for {len(feats)} image features (its slots' tilings)")
            rows.append(x.new_zeros(where.shape[1], x.shape[-1]).masked_scatter(where[b, :, None], feats))
        return t._replace(hidden=torch.stack(rows) + 0 * x.sum()).pack()  # padding crops stay on the graph

    def row_features(self, x: torch.Tensor, tiling: torch.Tensor, crops: torch.Tensor, b: int) -> torch.Tensor:
        """One row's images' features in slot order [n_b, D] from its crops' x [T, N, D]."""
        if int(crops.sum()) > x.shape[0]:
            raise ValueError(f"row {b}: image tiles of {int(crops.sum())} crops in a row of {x.shape[0]} "
                             f"(the row's crop budget)")
        out, at = [x.new_zeros(0, x.shape[-1])], 0
        for (h, w, r, c), n in zip(tiling.tolist(), crops.tolist()):
            if n:
                out.append(self.image_features(x[at:at + n], h, w, r, c))
                at += n
        return torch.cat(out)

    def image_features(self, x: torch.Tensor, h: int, w: int, rows: int, cols: int) -> torch.Tensor:
        """One image's crops' features [1 + rows x cols, N, D] -> [image_feature_count, D]; a clip's (rows -1) frames'
        [F, N, D] -> [F ceil(g / 2)^2 + 1, D]."""
        base, newline, g, D = x[0], self.image_newline.to(x.dtype), self.v.grid, x.shape[-1]
        if rows < 0:
            return self.clip_features(x, newline)
        if not rows:
            return torch.cat([base, newline[None]])
        grid = x[1:].view(rows, cols, g, g, D).permute(4, 0, 2, 1, 3).reshape(D, rows * g, cols * g)
        top, bottom, left, right = unpad_box(h, w, rows * g, cols * g)
        grid = grid[:, top:bottom, left:right]
        size = pooled_shape(self.v, *grid.shape[1:])
        if size is not None:
            grid = F.interpolate(grid[None], list(size), mode="bilinear")[0]
        grid = torch.cat([grid, newline[:, None, None].expand(D, grid.shape[1], 1)], dim=-1)
        return torch.cat([base, grid.flatten(1).T])


    def clip_features(self, x: torch.Tensor, newline: torch.Tensor) -> torch.Tensor:
        """A clip's frames [F, g g, D] (CLIP's class token already dropped by 'default') -> each frame's features
        bilinear-pooled g x g -> ceil(g / 2)^2, frame after frame, then one newline: [F ceil(g / 2)^2 + 1, D]
        (transformers' LlavaOnevisionModel.get_video_features / apply_pooling)."""
        F_, g, D = x.shape[0], self.v.grid, x.shape[-1]
        grid = x.reshape(F_, g, g, D).permute(0, 3, 1, 2)  # [F, D, g, g]
        side = pooled_side(g)
        pooled = F.interpolate(grid, size=[side, side], mode="bilinear").permute(0, 2, 3, 1)  # [F, s, s, D]
        return torch.cat([pooled.reshape(-1, D), newline[None]])


class AnyresEmbed(LlavaEmbed):
    """Token embedding; the image_token_id positions take the projector's features (hidden [B, L, D]), the rest
    their embedding. The same module is the tied head (mmpipe.model.llava.tied_head); decode: LlavaEmbed's."""

    def forward(self, args):
        t = unpack_in(self, args)
        emb = self.embed_tokens(t.input_ids)
        where = (t.input_ids == self.image_token_id)[..., None]
        return t._replace(hidden=torch.where(where, t.hidden.to(emb.dtype), emb)).pack()


def llava_next_specs(cfg: ModelConfig) -> list[LayerSpec]:
    return ([LayerSpec(VisionEmbed, cfg, True)] + [LayerSpec(TowerBlock, cfg) for _ in range(cfg.vision.n_blocks_used)]
            + [LayerSpec(AnyresProjector, cfg)] + decoder_specs(cfg, AnyresEmbed))
