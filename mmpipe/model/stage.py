"""The stage contract: the one tuple every layer takes and returns, and what of it crosses a stage boundary.

Only its floats travel between pipeline stages: `hidden`, and `vision` while the cross-attention
family carries it. The integer tensors (input_ids, has_image, segments, tiling) never change from
layer to layer (the Projector only drops tiling), so each stage reads them from its own copy of the
micro-batch and joins them to the floats it receives before its layers run, and a stage returns its
floats only (mmpipe.runtime.wire, mmpipe.runtime.pipeline.VLMPipeline.forward; docs/pipeline.md).
DeepSpeed's rules for what it sends: a float tensor must be on the autograd graph at both ends
(received floats get requires_grad=True), one blocking message per tensor. The single-device
reference (mmpipe.model.builder.ReferenceModel) runs the whole tuple through the same layers. Fields,
floats first (`pack` order, as the first stage's inputs and each stage's rebuilt tuple have them):

    hidden     float [B, S, D]  what the previous layer produced:
                                  after PatchEmbed / VisionBlock: vision tokens   [B, N_img, D_vision]
                                  after Projector:                image embeddings [B, N_img, D_text]
                                  after TextEmbed / DecoderBlock: the row              [B, L, D_text]
                                  (vision tower and Projector: B x M images in place of B)
    vision     float [B x M, N_img, D_text]  cross-attention fusion only: the projected image, from the
                                  text embedding to the last cross-attention layer, which drops it
                                  (no stage after that one receives it). Sent second.
    (the integer tensors, never sent; one layout, rows, for every family and every command:)
    input_ids  long  [B, L]      every decoder position's token, right-padded: a row of L = M x N + text_len
                                  positions holds one or (--pack) several whole samples; each image's N
                                  positions a block of placeholder ids (LLaVA: image_token_id at its <image>
                                  marker; moondream: IMAGE_SLOT -1 right after its sample's BOS; the
                                  cross-attention family: N = 0, the text alone). TextEmbed embeds them and
                                  each decoder layer rebuilds its mask and positions from segments: no L x L
                                  mask travels.
    has_image  long  [B, M]      per image slot, in the order of the row's image blocks: the segment (1, 2, ...)
                                  of the sample whose image fills it, 0 for an unused slot (so `> 0` means in
                                  use). The cross-attention family attends from each text position to the
                                  slots of its own segment only.
    segments   long  [B, L]      1, 2, ... the sample each position belongs to, 0 for padding: per sample,
                                  causal attention (moondream: BOS + image block bidirectional) and rotary
                                  positions from 0; never across samples of a row.
    tiling     long  [B, M, 2]   moondream multi-crop only (vision.max_crops > 0): each image slot's
                                  local-crop tiling (rows, cols), from the first input to the Projector, which
                                  stitches the local crops with it; hidden is then
                                  [B x M x (1 + max_crops), N_img, D_vision].
               long  [B, M, 3]   the Qwen2-VL family (cfg.layout.dynamic): each slot's grid (t, h, w) in patches
                                  (0 0 0 unused), KEPT to the head: the tower's masks and rotary and the decoder's
                                  multimodal positions read it, so every stage's loader gives it (from the index's
                                  image sizes, no image decoded); hidden is [B, P, patch_dim] pixel patches, slot
                                  order then zero padding, then [B, P, D_vision], [B, P / merge^2, D_text]
                                  (mmpipe.model.qwen2_vl).

One sample per row (no --pack, --max-images 1) is simply the smallest row: M = 1, segments 1 over the
sample and 0 over its padding (mmpipe.model.rows.sample_rows builds it from one prompt per row, for
generation and evaluation). A text-only sample has no image block, so its text follows BOS at
positions 1, 2, ...: moondream itself gives a text-only prompt no image positions (docs/packing.md).
The vision tower sees B x M (x crop slots) images; an unused slot holds a blank image no placeholder reads.

The pipeline's first input is (pixel_values float [B, M, C, H, W], input_ids, has_image, segments)
(multi-crop: pixel_values [B, M, 1 + max_crops, C, H, W] and tiling last); a later stage's
loader gives it the same integer tensors without pixel_values (multi-crop: tiling only where the
Projector runs, which then decodes the images for it); labels go to the last stage through
DeepSpeed's (inputs, labels) data contract, never through here.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class StageTuple(NamedTuple):
    hidden: torch.Tensor
    input_ids: torch.Tensor
    has_image: torch.Tensor
    segments: torch.Tensor
    vision: torch.Tensor | None = None  # goes second (floats first); see pack()
    tiling: torch.Tensor | None = None  # long [B, M, 2] multi-crop, dropped by the Projector; [B, M, 3] Qwen grids

    @classmethod
    def unpack(cls, args: tuple) -> "StageTuple":
        """(hidden, [vision,] input_ids, has_image, segments[, tiling]): the floats, then the integers in
        their fixed order; tiling is there while a multi-crop model has not reached its Projector (Qwen2-VL: always)."""
        floats = [a for a in args if a.is_floating_point()]
        ints = [a for a in args if not a.is_floating_point()]
        if not 1 <= len(floats) <= 2 or len(ints) not in (3, 4):
            raise ValueError(f"stage tuple must be (hidden, [vision,] input_ids, has_image, segments, [tiling]), "
                             f"got {len(floats)} float and {len(ints)} integer tensors")
        return cls(floats[0], *ints[:3], vision=floats[1] if len(floats) == 2 else None,
                   tiling=ints[3] if len(ints) == 4 else None)

    def pack(self) -> tuple:
        # plain tuples of contiguous tensors, floats first (DeepSpeed's p2p sends the floats of a stage's last one)
        fields = (self.hidden, self.vision, self.input_ids, self.has_image, self.segments, self.tiling)
        return tuple(t.contiguous() for t in fields if t is not None)
