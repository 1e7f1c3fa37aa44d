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

The pipeline's first input is (pixel_values float [B, C, H, W], input_ids long [B, T_text], has_image long [B]);
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

    @classmethod
    def unpack(cls, args: tuple) -> "StageTuple":
        if len(args) == 3:
            return cls(*args)
        if len(args) == 4:
            hidden, vision, input_ids, has_image = args
            return cls(hidden, input_ids, has_image, vision)
        raise ValueError(f"stage tuple must be (hidden, [vision,] input_ids, has_image), got {len(args)} tensors")

    def pack(self) -> tuple:
        # DeepSpeed's p2p needs plain tuples of contiguous tensors, floats before ints.
        ints = (self.input_ids.contiguous(), self.has_image.contiguous())
        if self.vision is None:
            return (self.hidden.contiguous(), *ints)
        return (self.hidden.contiguous(), self.vision.contiguous(), *ints)
