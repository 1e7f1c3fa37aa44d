"""The model families, one `Family` record each: what differs between them on the model side, asked
through `family_of(cfg)` rather than by comparing the `family` / `fusion` strings of the model JSON.

    MOONDREAM         family moondream, fusion prefix: the image spliced after BOS (mmpipe.model.layers)
    CROSS_ATTENTION   family moondream, fusion cross_attention: gated cross-attention layers read it
                      (mmpipe.model.cross_attention)
    LLAVA             family llava: CLIP / SigLIP tower, Llama / Qwen2 decoder, the image on <image>
                      placeholders (mmpipe.model.llava)
    QWEN2_VL          family qwen2_vl: Qwen2-VL / Qwen2.5-VL (by config), each image as many placeholders
                      as its grid gives, the grids kept to the head (mmpipe.model.qwen2_vl)
    QWEN3_VL          family qwen3_vl: Qwen3-VL dense, Qwen2-VL's rows plus DeepStack's carried feature sets
                      (mmpipe.model.qwen3_vl)
    QWEN3_5           family qwen3_5: Qwen3.5 dense, Qwen3-VL's tower and rows, a decoder of Gated DeltaNet and
                      gated attention layers (mmpipe.model.qwen3_5)
    LLAVA_NEXT        family llava_next: LLaVA-NeXT / LLaVA-OneVision (by config), each image as its base crop
                      and tiles in the row's crop slots, the tilings kept to the head (mmpipe.model.llava_next)

Where the image enters the decoder and which fields a family checks are the config's to know
(mmpipe.config.LAYOUTS, FAMILY_CHECKS, read as cfg.layout): the data side needs them too, and the
config layer imports nothing from here. A new family is one module with its layers and their
`decode`, its (family, fusion) among the config's known values, and one record below.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Callable

from deepspeed.pipe import LayerSpec

from ..config import FAMILY_CHECKS, LAYOUTS, ImageLayout, ModelConfig, load_plugins
from . import costs
from .cross_attention import CrossAttnBlock, CrossAttnTextEmbed, cross_attention_specs
from .layers import DecoderBlock, LMHead, PatchEmbed, Projector, TextEmbed, VisionBlock, VisionNorm, moondream_specs
from .llava import (
    FinalNorm,
    LlamaBlock,
    LlavaEmbed,
    LlavaProjector,
    LMHeadLinear,
    TowerBlock,
    VisionEmbed,
    llava_specs,
    tied_head,
)
from .llava_next import AnyresEmbed, AnyresProjector, llava_next_specs
from .moe import MOE_BLOCK, MoeHead, Qwen3MoeBlock, moe_fields, qwen3_vl_layers
from .qwen2_vl import QwenBlock, QwenEmbed, QwenMerger, QwenPatchEmbed, QwenVisionBlock, qwen2_vl_specs
from .qwen3_5 import (
    DELTANET_BLOCK,
    DELTANET_MOE_BLOCK,
    GATED_ATTENTION_BLOCK,
    GATED_ATTENTION_MOE_BLOCK,
    DeltaNetBlock,
    DeltaNetMoeBlock,
    GatedAttentionBlock,
    GatedAttentionMoeBlock,
    Qwen35FinalNorm,
    qwen3_5_specs,
)
from .qwen3_5 import moe_fields as qwen3_5_moe_fields
from .qwen3_vl import (
    DEEPSTACK_ADDS,
    DEEPSTACK_MERGERS,
    Qwen3Block,
    Qwen3Embed,
    Qwen3Merger,
    Qwen3PatchEmbed,
    Qwen3VisionBlock,
    deepstack_fields,
)
from .stage import ROW, StageField

# the integer tensor of each image slot's layout (mmpipe.model.stage): moondream multi-crop's tiling (rows, cols),
# read and dropped by the Projector; the dynamic families' grids / tilings, kept to the head
CROP_TILING = StageField("tiling", False, dropped_by=Projector)
KEPT_TILING = StageField("tiling", False)
# the cross-attention family's projected images, made by its text embedding, dropped after its last reader
CARRIED_VISION = StageField("vision", True, made_by=CrossAttnTextEmbed, dropped_by=CrossAttnBlock)


def _moondream_fields(cfg: ModelConfig, *carried: StageField) -> tuple[StageField, ...]:
    return ROW + carried + ((CROP_TILING,) if cfg.vision.crop_slots > 1 else ())


@dataclass(frozen=True)
class Family:
    """One model family: its layer list and what the pipeline, the cost model and the HF side ask of it."""
    family: str  # the model JSON's `family` and `fusion` that select it
    fusion: str
    layers: Callable[[ModelConfig], list[LayerSpec]]  # the pipeline's layer list (mmpipe.model.builder.layer_specs)
    # blocks that activation checkpointing may recompute (DeepSpeed's checkpointable_layers, the cost model)
    checkpointable: tuple[type, ...]
    # the cost rule of each layer class; a tied layer's later use (TiedLayerSpec) by its forward_fn
    cost_rules: dict[object, costs.LayerRule] = field(repr=False, compare=False)
    tower_tokens: Callable[[ModelConfig], int] = lambda cfg: cfg.vision.n_tokens  # what the vision blocks see
    hf_class: str | None = None  # the transformers class its weights load into unchanged, if any
    # whose names its weights take in and out of mmpipe (mmpipe.hf): "hf" (hf_class's, an HF directory),
    # "moondream" (moondream's one safetensors file, with moondream's region head beside the weights), or
    # None: no model outside mmpipe has its layers (cross-attention fusion), so no export and no import
    weight_names: str | None = "moondream"
    # what its records may carry besides text (mmpipe.data.records.MEDIA_FIELDS' kinds); a record with anything
    # else is a bad record, unsupported_media, counted with its reason, never trained as the text around it
    media: tuple[str, ...] = ("image",)
    # the kind of its images, the data side's rule for them (mmpipe.data.image_kinds): spliced (a fixed-size image
    # after BOS), placeholders (on <image> placeholder ids), patches (any size, a row's patch budget), tiles
    images: str = "spliced"
    # the stage tuple's fields (mmpipe.model.stage.StageField): the row's four, then what the family carries
    fields: Callable[[ModelConfig], tuple[StageField, ...]] = field(default=lambda cfg: ROW, repr=False,
                                                                     compare=False)
    # where other trainers must cut: the layers they keep on stage 0 (a layer list -> how many), which `mmpipe plan`
    # costs beside its own split (None: no such rule). Qwen3-VL: the tower and decoder layers 0..2 with DeepStack's
    # last add (Megatron-Bridge injects DeepStack on the first stage only; QwenLM/Qwen3-VL#1497)
    fixed_first_stage: Callable[[list[LayerSpec]], int] | None = field(default=None, repr=False, compare=False)

    def cost_rule(self, spec: LayerSpec) -> costs.LayerRule:
        return self.cost_rules[getattr(spec, "forward_fn", None) or spec.typename]


_MOONDREAM_COSTS = {PatchEmbed: costs.PATCH_EMBED, VisionBlock: costs.VISION_BLOCK, VisionNorm: costs.VISION_NORM,
                    Projector: costs.PROJECTOR, TextEmbed: costs.TEXT_EMBED, DecoderBlock: costs.DECODER_BLOCK,
                    LMHead: costs.LM_HEAD}

MOONDREAM = Family("moondream", "prefix", moondream_specs, (VisionBlock, DecoderBlock), _MOONDREAM_COSTS,
                   fields=_moondream_fields)
CROSS_ATTENTION = Family(
    "moondream", "cross_attention", cross_attention_specs, (VisionBlock, DecoderBlock, CrossAttnBlock),
    {**_MOONDREAM_COSTS, CrossAttnTextEmbed: costs.CROSS_ATTN_TEXT_EMBED, CrossAttnBlock: costs.CROSS_ATTN_BLOCK},
    weight_names=None, fields=lambda cfg: _moondream_fields(cfg, CARRIED_VISION))
LLAVA = Family(
    "llava", "prefix", llava_specs, (TowerBlock, LlamaBlock),
    {VisionEmbed: costs.PATCH_EMBED, TowerBlock: costs.VISION_BLOCK, LlavaProjector: costs.PROJECTOR,
     LlavaEmbed: costs.TEXT_EMBED, LlamaBlock: costs.LLAMA_BLOCK, FinalNorm: costs.FINAL_NORM,
     LMHeadLinear: costs.LINEAR_HEAD, tied_head: costs.LINEAR_HEAD},
    tower_tokens=lambda cfg: cfg.vision.n_positions,  # CLIP's class token too
    hf_class="LlavaForConditionalGeneration", weight_names="hf", images="placeholders")

# Its vision layers are costed on the row's patch budget (costs.QWEN_*, per_row: mmpipe.planning.costmodel)
QWEN2_VL = Family(
    "qwen2_vl", "prefix", qwen2_vl_specs, (QwenVisionBlock, QwenBlock),
    {QwenPatchEmbed: costs.QWEN_PATCH_EMBED, QwenVisionBlock: costs.QWEN_VISION_BLOCK, QwenMerger: costs.QWEN_MERGER,
     QwenEmbed: costs.QWEN_EMBED, QwenBlock: costs.QWEN_BLOCK, FinalNorm: costs.FINAL_NORM,
     LMHeadLinear: costs.LINEAR_HEAD, tied_head: costs.LINEAR_HEAD},
    # Qwen2.5-VL's class by config (mmpipe.hf.qwen2_vl)
    hf_class="Qwen2VLForConditionalGeneration", weight_names="hf", fields=lambda cfg: ROW + (KEPT_TILING,),
    images="patches", media=("image", "video"))  # clips: mmpipe.data.video (Qwen2.5-VL's absolute-time rotary)

# The tower, projector and embedding are costed on the row's T crops (costs.ANYRES_*, per_row: a CropRow)
LLAVA_NEXT = Family(
    "llava_next", "prefix", llava_next_specs, (TowerBlock, LlamaBlock),
    {VisionEmbed: costs.ANYRES_PATCH_EMBED, TowerBlock: costs.ANYRES_VISION_BLOCK,
     AnyresProjector: costs.ANYRES_PROJECTOR, AnyresEmbed: costs.ANYRES_EMBED, LlamaBlock: costs.LLAMA_BLOCK,
     FinalNorm: costs.FINAL_NORM, LMHeadLinear: costs.LINEAR_HEAD, tied_head: costs.LINEAR_HEAD},
    tower_tokens=lambda cfg: cfg.vision.n_positions,  # CLIP's class token too
    # LlavaOnevisionForConditionalGeneration's by config (vision.anyres_max > 0: mmpipe.hf.llava_next)
    hf_class="LlavaNextForConditionalGeneration", weight_names="hf", fields=lambda cfg: ROW + (KEPT_TILING,),
    images="tiles", media=("image", "video"))  # clips: OneVision's pooled frames (mmpipe.data.video); NeXT refuses

# Qwen2-VL's rules for the same shapes; DeepStack's sets are carried fields, one per merger / add pair
QWEN3_VL = Family(
    "qwen3_vl", "prefix", qwen3_vl_layers, (Qwen3VisionBlock, Qwen3Block, Qwen3MoeBlock),
    {Qwen3PatchEmbed: costs.QWEN_PATCH_EMBED, Qwen3VisionBlock: costs.QWEN_VISION_BLOCK,
     Qwen3Merger: costs.QWEN_MERGER, Qwen3Embed: costs.QWEN_EMBED, Qwen3Block: costs.QWEN_BLOCK,
     FinalNorm: costs.FINAL_NORM, LMHeadLinear: costs.LINEAR_HEAD, tied_head: costs.LINEAR_HEAD,
     **{m: costs.DEEPSTACK_MERGER for m in DEEPSTACK_MERGERS}, **{a: costs.DEEPSTACK_ADD for a in DEEPSTACK_ADDS},
     Qwen3MoeBlock: MOE_BLOCK, MoeHead: costs.LINEAR_HEAD},  # text.moe: mmpipe.model.moe
    hf_class="Qwen3VLForConditionalGeneration", weight_names="hf",
    fields=lambda cfg: ROW + deepstack_fields(cfg) + moe_fields(cfg) + (KEPT_TILING,), images="patches",
    media=("image", "video"),  # clips: a slot per temporal patch after its timestamp text (mmpipe.data.video)
    fixed_first_stage=lambda specs: 1 + max(i for i, s in enumerate(specs) if s.typename in DEEPSTACK_ADDS))

# Qwen3-VL's tower without DeepStack; each decoder layer kind by its own rule (mmpipe.model.qwen3_5): a
# linear-attention layer linear in positions (DELTANET_BLOCK), a full one with its output gate and its heads' own
# width (GATED_ATTENTION_BLOCK); Qwen3.5-MoE (text.moe) has the sparse kind of each, on its active parameters
QWEN3_5 = Family(
    "qwen3_5", "prefix", qwen3_5_specs,
    (Qwen3VisionBlock, DeltaNetBlock, GatedAttentionBlock, DeltaNetMoeBlock, GatedAttentionMoeBlock),
    {Qwen3PatchEmbed: costs.QWEN_PATCH_EMBED, Qwen3VisionBlock: costs.QWEN_VISION_BLOCK,
     Qwen3Merger: costs.QWEN_MERGER, Qwen3Embed: costs.QWEN_EMBED, DeltaNetBlock: DELTANET_BLOCK,
     GatedAttentionBlock: GATED_ATTENTION_BLOCK, Qwen35FinalNorm: costs.FINAL_NORM, LMHeadLinear: costs.LINEAR_HEAD,
     tied_head: costs.LINEAR_HEAD, DeltaNetMoeBlock: DELTANET_MOE_BLOCK,
     GatedAttentionMoeBlock: GATED_ATTENTION_MOE_BLOCK, MoeHead: costs.LINEAR_HEAD},  # text.moe: mmpipe.model.moe
    # Qwen3_5MoeForConditionalGeneration's by config (text.moe: mmpipe.hf.qwen3_5)
    hf_class="Qwen3_5ForConditionalGeneration", weight_names="hf",
    fields=lambda cfg: ROW + qwen3_5_moe_fields(cfg) + (KEPT_TILING,), images="patches")

FAMILIES = [MOONDREAM, CROSS_ATTENTION, LLAVA, QWEN2_VL, LLAVA_NEXT, QWEN3_VL, QWEN3_5]


def register(family: Family, layout: ImageLayout, checks: Callable[[ModelConfig], list] | None = None) -> Family:
    """A family from outside the package: its record, where its decoder finds the image (the config's and the data
    side's ImageLayout) and its config checks ((ok, field, message) per check), so that a model JSON naming its
    (family, fusion) validates, builds, plans and trains like a built-in one. A module that calls this on import
    is the whole family: name it in MMPIPE_FAMILIES or as a "mmpipe.families" entry point (mmpipe.config.
    load_plugins). Registering a (family, fusion) that exists is an error: a plugin cannot replace a family."""
    key = (family.family, family.fusion)
    if key in LAYOUTS:
        raise ValueError(f"model family {family.family}/{family.fusion} is registered already")
    LAYOUTS[key] = layout
    if checks is not None:
        FAMILY_CHECKS[family.family] = checks
    FAMILIES.append(family)
    return family


def family_of(cfg: ModelConfig) -> Family:
    load_plugins()
    for f in FAMILIES:
        if (f.family, f.fusion) == (cfg.family, cfg.fusion):
            return f
    raise ValueError(f"model config '{cfg.name}': no model family '{cfg.family}' with fusion '{cfg.fusion}' "
                     f"(valid: {', '.join(f'{f.family}/{f.fusion}' for f in FAMILIES)})")
