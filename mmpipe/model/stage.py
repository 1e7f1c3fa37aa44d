"""The stage contract: the one tuple every layer takes and returns, its fields named by the family's schema,
and what of it crosses a stage boundary.

Each family declares the fields its layers pass on (`Family.fields(cfg)`, a tuple of `StageField`: name,
float or integer, the layer class that makes it, the layer class after whose last instance it is dropped).
From the schema and the layer list, `bind_fields` gives every built layer the fields of the tuple it takes
(`stage_in`) and of the one it returns (`stage_out`); `unpack` zips a layer's plain tensor tuple with those
fields and checks each tensor is the kind its field says (a wrong tuple is an error naming the field, never a guess
from counting dtypes), and `pack` returns the floats first, then the integers, each in the order the schema
made them. A carried feature (the cross-attention family's `vision`; later DeepStack's sets) is one
mechanism: a field made by one layer and dropped after its last reader, so no boundary after that carries it.
The schemas (mmpipe.families):

    moondream          hidden | input_ids, has_image, segments [, tiling: multi-crop, dropped by the Projector]
    cross_attention    hidden, vision (made by CrossAttnTextEmbed, dropped after the last CrossAttnBlock) | the ints
    llava              hidden | input_ids, has_image, segments
    qwen2_vl           hidden | input_ids, has_image, segments, tiling (each slot's grid t, h, w; kept to the head)
    llava_next         hidden | input_ids, has_image, segments, tiling (each slot's orig_h, orig_w, rows, cols; kept)

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
    tiling     long  [B, M, 2]   moondream multi-crop only (vision.crop_slots > 1): each image slot's
                                  local-crop tiling (rows, cols), from the first input to the Projector, which
                                  stitches the local crops with it; hidden is then
                                  [B x M x crop_slots, N_img, D_vision].
               long  [B, M, 3]   the Qwen2-VL family (image kind patches): each slot's grid (t, h, w) in patches
                                  (0 0 0 unused), KEPT to the head: the tower's masks and rotary and the decoder's
                                  multimodal positions read it, so every stage's loader gives it (from the index's
                                  image sizes, no image decoded); hidden is [B, P, patch_dim] pixel patches, slot
                                  order then zero padding, then [B, P, D_vision], [B, P / merge^2, D_text]
                                  (mmpipe.model.qwen2_vl).
               long  [B, M, 4]   the llava_next family: each slot's (orig_h, orig_w, rows, cols) tile grid (0s unused),
                                  kept to the head: the AnyresProjector lays each image's crops out by it
                                  (mmpipe.model.llava_next).

One sample per row (no --pack, --max-images 1) is simply the smallest row: M = 1, segments 1 over the
sample and 0 over its padding (mmpipe.model.rows.sample_rows builds it from one prompt per row, for
generation and evaluation). A text-only sample has no image block, so its text follows BOS at
positions 1, 2, ...: moondream itself gives a text-only prompt no image positions (docs/packing.md).
The vision tower sees B x M (x crop slots) images; an unused slot holds a blank image no placeholder reads.

The pipeline's first input is (pixel_values float [B, M, C, H, W], input_ids, has_image, segments)
(multi-crop: pixel_values [B, M, crop_slots, C, H, W] and tiling last); a later stage's
loader gives it the same integer tensors without pixel_values (multi-crop: tiling only where the
Projector runs, which then decodes the images for it); labels go to the last stage through
DeepSpeed's (inputs, labels) data contract, never through here.
"""
from __future__ import annotations

from collections.abc import Callable
from typing import NamedTuple

import torch


class StageField(NamedTuple):
    """One field of a family's stage tuple. made_by: the layer class whose output first has it (None: the
    pipeline's first input has it); dropped_by: the layer class whose LAST instance's output no longer has it
    (None: kept to the head); per_position: for a carried float field sized by the row rather than by its images,
    cfg -> its elements per decoder position (Gemma 4's per-layer inputs and shared K/V; the planner's boundary
    bytes, mmpipe.planning.costmodel._carry), None: one image set."""
    name: str
    floating: bool
    made_by: type | None = None
    dropped_by: type | None = None
    per_position: Callable | None = None


# every family's row fields (mmpipe.families adds each family's own: vision, tiling)
HIDDEN = StageField("hidden", True)
ROW = (HIDDEN, StageField("input_ids", False), StageField("has_image", False), StageField("segments", False))


def _packed_order(fields) -> tuple[StageField, ...]:
    return tuple(f for f in fields if f.floating) + tuple(f for f in fields if not f.floating)


def live_fields(schema: tuple[StageField, ...], layer_types: list[type]) -> list[tuple[StageField, ...]]:
    """The fields of the tuple entering each layer of a layer list (whose classes are layer_types), in pack
    order, and last those leaving it: what `bind_fields` gives each layer. Every field of the schema must be read: one
    that no layer makes, or that a layer class drops which the list does not hold, is a schema error."""
    last = {cls: i for i, cls in enumerate(layer_types)}
    first = {cls: i for i, cls in reversed(list(enumerate(layer_types)))}
    for f in schema:
        for role, cls in (("made_by", f.made_by), ("dropped_by", f.dropped_by)):
            if cls is not None and cls not in last:
                raise ValueError(f"stage field {f.name!r}: {role} {cls.__name__}, which the layer list does not hold")
    live = [f for f in schema if f.made_by is None]
    names = []
    for i, cls in enumerate(layer_types):
        names.append(_packed_order(live))
        # made by the class's FIRST instance only: a tied head's class is its embedding's, and must not make again
        # what the embedding made and a later layer dropped (Gemma 4's per_layer)
        live += [f for f in schema if f.made_by is cls and first[cls] == i and f not in live]
        live = [f for f in live if not (f.dropped_by is cls and last[cls] == i)]
    return names + [_packed_order(live)]


def bind_fields(layers, schema: tuple[StageField, ...], layer_types: list[type], start: int = 0) -> None:
    """Give each built layer (global index start + k of the list layer_types) the fields it takes and returns."""
    names = live_fields(schema, layer_types)
    for k, layer in enumerate(layers):
        layer.__dict__["stage_in"], layer.__dict__["stage_out"] = names[start + k], names[start + k + 1]


class StageTuple:
    """The named fields of one stage tuple (a field not there reads None). `unpack(args, names)` from a layer's
    plain tuple; `pack()` back to one: floats first, each kind in the order its fields were made."""
    __slots__ = ("_fields",)

    def __init__(self, hidden: torch.Tensor, input_ids: torch.Tensor, has_image: torch.Tensor,
                 segments: torch.Tensor, **carried: torch.Tensor | None):
        fields = {"hidden": hidden, "input_ids": input_ids, "has_image": has_image, "segments": segments, **carried}
        object.__setattr__(self, "_fields", fields)

    def __getattr__(self, name: str):
        if name.startswith("__"):
            raise AttributeError(name)
        return self._fields.get(name)

    def __setattr__(self, name, value):
        raise AttributeError("a StageTuple is immutable: use _replace")

    @property
    def names(self) -> tuple[str, ...]:
        return tuple(k for k, v in self._fields.items() if v is not None)

    def _replace(self, **fields: torch.Tensor | None) -> "StageTuple":
        """A copy with these fields set (None: not there, its place kept, as generation's decode sets hidden
        again); a new field goes after the others of its kind."""
        new = object.__new__(StageTuple)
        object.__setattr__(new, "_fields", {**self._fields, **fields})
        return new

    @classmethod
    def unpack(cls, args, fields: tuple[StageField, ...] = ROW) -> "StageTuple":
        """args: a layer's plain tuple; fields: what it holds, in order (the layer's stage_in / stage_out; the
        plain row by default, for a layer used outside a layer list). Each tensor is checked against its field's
        kind, so a tuple of another layout is an error naming the field, not a misread."""
        args = (args,) if torch.is_tensor(args) else tuple(args)
        wrong = [f"{f.name} should be {'a float' if f.floating else 'an integer'} tensor"
                 for f, a in zip(fields, args) if a.is_floating_point() != f.floating]
        if len(args) != len(fields) or wrong:
            raise ValueError(f"stage tuple: expected ({', '.join(f.name for f in fields)}), got {len(args)} tensors"
                             + (f" ({'; '.join(wrong)})" if wrong else ""))
        new = object.__new__(cls)
        object.__setattr__(new, "_fields", {f.name: a for f, a in zip(fields, args)})
        return new

    def pack(self) -> tuple:
        # plain tuples of contiguous tensors, floats first (DeepSpeed's p2p sends the floats of a stage's last one)
        fields = [t for t in self._fields.values() if t is not None]
        return tuple(t.contiguous() for t in fields if t.is_floating_point()) + tuple(
            t.contiguous() for t in fields if not t.is_floating_point())


def unpack_in(layer, args) -> StageTuple:
    """The tuple a layer takes, named by its place in the layer list (bind_fields; the plain row if unbound)."""
    return StageTuple.unpack(args, layer.__dict__.get("stage_in", ROW))


def unpack_out(layer, args) -> StageTuple:
    """The tuple a layer returned, named likewise (generation's decode, which runs a layer's forward)."""
    return StageTuple.unpack(args, layer.__dict__.get("stage_out", ROW))
