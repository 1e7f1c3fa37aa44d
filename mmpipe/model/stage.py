"""The stage contract: the one tuple that travels between pipeline stages.

DeepSpeed sends a tuple of tensors from stage to stage. Rules it imposes (see docs/pipeline.md):
every float tensor must be on the autograd graph at both ends, received float tensors get
requires_grad=True, integer tensors carry no gradient, and with 3+ stages floats must come
before ints. So the tuple is three fields, floats first, plus a fourth where the model needs it:

    hidden     float [B, S, D]  what the previous layer produced:
                                  after PatchEmbed / VisionBlock: vision tokens   [B, N_img, D_vision]
                                  after Projector:                image embeddings [B, N_img, D_text]
                                  after TextEmbed / DecoderBlock: merged sequence  [B, 1 + N_img + T_text, D_text]
                                  (cross-attention fusion: the text alone, [B, T_text, D_text])
    vision     float [B, N_img, D_text]  cross-attention fusion only: the projected image, from the
                                  text embedding to the last cross-attention layer, which drops it
                                  (no stage after that one receives it). Sent second, floats first.
    input_ids  long  [B, T_text] the text tokens (BOS first, right-padded); TextEmbed embeds them and
                                  the decoder rebuilds its attention mask from the model config
                                  (bidirectional over BOS + image, causal after) - no T x T mask travels.
    has_image  long  [B]         1 where the sample has an image; 0 for a text-only record, whose
                                  image positions (a zero image) the decoder masks out of attention.
    tiling     long  [B, 2]      moondream multi-crop only (vision.max_crops > 0): each image's local-crop
                                  tiling (rows, cols), from the first input to the Projector, which stitches
                                  the local crops with it; hidden is then [B x (1 + max_crops), N_img, D_vision].

The pipeline's first input is (pixel_values float [B, C, H, W], input_ids long [B, T_text], has_image long [B])
(multi-crop: pixel_values [B, 1 + max_crops, C, H, W] and tiling long [B, 2] last);
labels go to the last stage through DeepSpeed's (inputs, labels) data contract, never through here.
"""
from __future__ import annotations

from typing import NamedTuple

import torch


class StageTuple(NamedTuple):
    hidden: torch.Tensor
    input_ids: torch.Tensor
    has_image: torch.Tensor
    vision: torch.Tensor | None = None  # on the wire it goes second (floats first); see pack()
    tiling: torch.Tensor | None = None  # long [B, 2]: multi-crop only, last on the wire, dropped by the Projector

    @classmethod
    def unpack(cls, args: tuple) -> "StageTuple":
        if len(args) == 3:
            return cls(*args)
        if len(args) == 4 and args[1].is_floating_point():
            hidden, vision, input_ids, has_image = args
            return cls(hidden, input_ids, has_image, vision)
        if len(args) == 4:
            hidden, input_ids, has_image, tiling = args
            return cls(hidden, input_ids, has_image, tiling=tiling)
        raise ValueError(f"stage tuple must be (hidden, [vision,] input_ids, has_image, [tiling]), got {len(args)} "
                         f"tensors")

    def pack(self) -> tuple:
        # DeepSpeed's p2p needs plain tuples of contiguous tensors, floats before ints.
        floats = (self.hidden.contiguous(),) if self.vision is None else (self.hidden.contiguous(),
                                                                          self.vision.contiguous())
        ints = (self.input_ids.contiguous(), self.has_image.contiguous())
        return floats + ints + (() if self.tiling is None else (self.tiling.contiguous(),))
