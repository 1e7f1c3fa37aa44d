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
                                  after TextEmbed / DecoderBlock: merged sequence  [B, 1 + N_img + T_text, D_text]
                                  (cross-attention fusion: the text alone, [B, T_text, D_text])
    vision     float [B, N_img, D_text]  cross-attention fusion only: the projected image, from the
                                  text embedding to the last cross-attention layer, which drops it
                                  (no stage after that one receives it). Sent second.
    (the integer tensors, never sent:)
    input_ids  long  [B, T_text] the text tokens (BOS first, right-padded); TextEmbed embeds them and
                                  the decoder rebuilds its attention mask from the model config
                                  (bidirectional over BOS + image, causal after) - no T x T mask travels.
    has_image  long  [B]         1 where the sample has an image; 0 for a text-only record, whose
                                  image positions (a zero image) the decoder masks out of attention.
    tiling     long  [B, 2]      moondream multi-crop only (vision.max_crops > 0): each image's local-crop
                                  tiling (rows, cols), from the first input to the Projector, which stitches
                                  the local crops with it; hidden is then [B x (1 + max_crops), N_img, D_vision].

Rows (--pack or --max-images > 1, mmpipe.data.packing): a row of L decoder positions holds one or
several whole samples and up to M images. Then
    input_ids  long  [B, L]      every decoder position's token, each image's N positions a block of
                                  placeholder ids (LLaVA: image_token_id at its <image> marker; moondream:
                                  IMAGE_SLOT -1 right after its sample's BOS), right-padded
    has_image  long  [B, M]      1 for the image slots in use, in the order of the row's image blocks
    segments   long  [B, L]      1, 2, ... the sample each position belongs to, 0 for padding: each decoder
                                  stage rebuilds its per-sample mask and positions from it (O(L) ints each
                                  stage loads, never an L x L mask)
    tiling     long  [B, M, 2]   multi-crop, per image slot
and the vision tower sees B x M (x crop slots) images. has_image's rank (2 for rows) tells the layouts
apart, so the same layers run both.

The pipeline's first input is (pixel_values float [B, C, H, W], input_ids long [B, T_text], has_image long [B])
(multi-crop: pixel_values [B, 1 + max_crops, C, H, W] and tiling long [B, 2] last); a later stage's
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
    vision: torch.Tensor | None = None  # goes second (floats first); see pack()
    tiling: torch.Tensor | None = None  # long [B, 2]: multi-crop only, packed last, dropped by the Projector
    segments: torch.Tensor | None = None  # long [B, L]: rows only (has_image [B, M]), packed after has_image

    @property
    def rows(self) -> bool:
        return self.segments is not None

    @classmethod
    def unpack(cls, args: tuple) -> "StageTuple":
        floats = [a for a in args if a.is_floating_point()]
        ints = [a for a in args if not a.is_floating_point()]
        if not 1 <= len(floats) <= 2 or len(ints) < 2:
            raise ValueError(f"stage tuple must be (hidden, [vision,] input_ids, has_image, [segments,] [tiling]), "
                             f"got {len(floats)} float and {len(ints)} integer tensors")
        input_ids, has_image, *rest = ints
        segments = rest.pop(0) if has_image.dim() == 2 and rest else None
        if len(rest) > 1 or (has_image.dim() == 2) != (segments is not None):
            raise ValueError(f"stage tuple: has_image {tuple(has_image.shape)} with {len(ints)} integer tensors")
        return cls(floats[0], input_ids, has_image, floats[1] if len(floats) == 2 else None,
                   rest[0] if rest else None, segments)

    def pack(self) -> tuple:
        # plain tuples of contiguous tensors, floats first (DeepSpeed's p2p sends the floats of a stage's last one)
        fields = (self.hidden, self.vision, self.input_ids, self.has_image, self.segments, self.tiling)
        return tuple(t.contiguous() for t in fields if t is not None)
