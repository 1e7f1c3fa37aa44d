"""A model family defined outside the package, in this one module: the proof that a family is one module.

`toy_carry` is moondream's image side (a tower whose blocks attend within each image, the image spliced after
BOS) with one carried feature, as DeepStack carries its sets to the decoder layers that add them:

    PatchEmbed, VisionBlock x n, VisionNorm, Projector, SummaryEmbed, DecoderBlock, SummaryAdd, DecoderBlock..., LMHead

SummaryEmbed embeds the row as TextEmbed does and makes `summary`, each row's mean projected image token
[B, 1, D]; SummaryAdd, after the first decoder block, adds it (gated) at every position and is its last reader,
so the stage tuple carries it from the embedding to there and no further. A pipeline cut between the two sends
it as a second float. Its model JSON's "text" section is its own (ToyText: the gate's starting value besides a
decoder's fields), so a field of its layers is declared here too. Imported by name (MMPIPE_FAMILIES=toy_family, this
folder on PYTHONPATH), it registers itself: mmpipe's own code names no part of it.
"""
from __future__ import annotations

import dataclasses
from dataclasses import dataclass

import torch
from deepspeed.pipe import LayerSpec
from torch import nn

from mmpipe.config import ModelConfig, TextConfig
from mmpipe.families import MOONDREAM
from mmpipe.model import costs
from mmpipe.model.layers import DecoderBlock, LMHead, TextEmbed, VisionBlock, moondream_checks, vision_specs
from mmpipe.model.rows import IMAGE_SLOT, place_images
from mmpipe.model.stage import ROW, StageField, unpack_in
from mmpipe.registry import Family, register


@dataclass(frozen=True)
class ToyText(TextConfig):
    """Its decoder section: moondream's decoder fields, and SummaryAdd's starting gate."""
    summary_gate: float = 0.5


class SummaryEmbed(TextEmbed):
    """TextEmbed, plus the carried field `summary`: the row's images' mean projected token [B, 1, D] (0 for a row
    without an image)."""

    def forward(self, args):
        t = unpack_in(self, args)  # hidden: the projected images [B x M, N_img, D]
        B = t.input_ids.shape[0]
        used = (t.has_image > 0).to(t.hidden.dtype)  # [B, M]
        per_slot = t.hidden.view(B, -1, *t.hidden.shape[1:]).mean(2)  # [B, M, D]
        summary = (per_slot * used[..., None]).sum(1, keepdim=True) / used.sum(1).clamp(min=1)[:, None, None]
        emb = self.wte(t.input_ids.clamp(min=0))
        return t._replace(hidden=place_images(emb, t.input_ids, t.hidden, t.has_image, IMAGE_SLOT),
                          summary=summary).pack()


class SummaryAdd(nn.Module):
    """hidden + g * summary at every position; the last reader of summary, which it drops."""
    group = "projector"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.gate = nn.Parameter(torch.full((1,), cfg.text.summary_gate))

    def forward(self, args):
        t = unpack_in(self, args)
        return t._replace(hidden=t.hidden + self.gate * t.summary, summary=None).pack()


def toy_specs(cfg: ModelConfig) -> list[LayerSpec]:
    blocks = [LayerSpec(DecoderBlock, cfg) for _ in range(cfg.text.n_layers)]
    return (vision_specs(cfg) + [LayerSpec(SummaryEmbed, cfg), blocks[0], LayerSpec(SummaryAdd, cfg)] + blocks[1:]
            + [LayerSpec(LMHead, cfg)])


SUMMARY = StageField("summary", True, made_by=SummaryEmbed, dropped_by=SummaryAdd)
ADD_RULE = costs.LayerRule("SummaryAdd", costs.FINAL_NORM.cost, "sequence")

# where its decoder finds the image and its config checks: moondream's (the image spliced after BOS); its own text
# section
TOY = register(Family(
    "toy_carry", "prefix", toy_specs, (VisionBlock, DecoderBlock),
    {**MOONDREAM.cost_rules, SummaryEmbed: costs.TEXT_EMBED, SummaryAdd: ADD_RULE},
    dataclasses.replace(MOONDREAM.layout, text=ToyText), MOONDREAM.kind, checks=moondream_checks,
    fields=lambda cfg: ROW + (SUMMARY,)))
