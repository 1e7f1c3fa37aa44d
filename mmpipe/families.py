"""The built-in model families, one registered entry each (mmpipe.registry.Family): everything the config, the data
side, the pipeline, the planner and the HF side ask of a family, in one place.

    MOONDREAM         family moondream, fusion prefix: the image spliced after BOS (mmpipe.model.layers)
    CROSS_ATTENTION   family moondream, fusion cross_attention: gated cross-attention layers read it
                      (mmpipe.model.cross_attention)
    LLAVA             family llava: CLIP / SigLIP tower, Llama / Qwen2 decoder, the image on <image>
                      placeholders (mmpipe.model.llava)
    QWEN2_VL          family qwen2_vl: Qwen2-VL / Qwen2.5-VL (by config), each image as many placeholders
                      as its grid gives, the grids kept to the head (mmpipe.model.qwen2_vl)
    QWEN3_VL          family qwen3_vl: Qwen3-VL dense and MoE, Qwen2-VL's rows plus DeepStack's carried feature sets
                      (mmpipe.model.qwen3_vl, mmpipe.model.moe)
    QWEN3_5           family qwen3_5: Qwen3.5 dense and MoE, Qwen3-VL's tower and rows, a decoder of Gated DeltaNet
                      and gated attention layers (mmpipe.model.qwen3_5)
    LLAVA_NEXT        family llava_next: LLaVA-NeXT / LLaVA-OneVision (by config), each image as its base crop
                      and tiles in the row's crop slots, the tilings kept to the head (mmpipe.model.llava_next)

This module sits above model/ and data/ (it names their layers and image kinds) and below everything that trains,
plans or converts; mmpipe.registry imports it on the first question. The HF side (mmpipe.hf, higher still) is named
by "module:function" strings the registry resolves on first use.
"""
from __future__ import annotations

from . import config as c
from .data.gemma3 import GEMMA3_IMAGES
from .data.gemma4 import GEMMA4_IMAGES
from .data.image_kinds import PATCHES, PLACEHOLDERS, SPLICED, TILES
from .data.internvl import INTERN_TILES
from .model import costs
from .model.cross_attention import CrossAttnBlock, CrossAttnTextEmbed, cross_attention_specs
from .model.gemma3 import (
    GEMMA3_COSTS,
    Gemma3Block,
    Gemma3SlidingBlock,
    Gemma3Text,
    Gemma3Vision,
    gemma3_checks,
    gemma3_specs,
)
from .model.gemma4 import BLOCKS as GEMMA4_BLOCK_CLASSES
from .model.gemma4 import (
    GEMMA4_COSTS,
    Gemma4Text,
    Gemma4TowerBlock,
    Gemma4Vision,
    gemma4_checks,
    gemma4_fields,
    gemma4_specs,
    gemma4_tower_tokens,
)
from .model.gemma4 import MOE_BLOCKS as GEMMA4_MOE_BLOCKS
from .model.internvl import COSTS as INTERNVL_COSTS
from .model.internvl import (
    InternBlock,
    InternEmbed,
    InternMoeBlock,
    InternText,
    InternVision,
    InternVisionBlock,
    crops_tokens,
    internvl_checks,
    internvl_fields,
    internvl_specs,
)
from .model.layers import (
    CropVision,
    DecoderBlock,
    LMHead,
    PatchEmbed,
    Projector,
    TextEmbed,
    VisionBlock,
    VisionNorm,
    moondream_checks,
    moondream_specs,
)
from .model.llava import (
    ClipVision,
    FinalNorm,
    LlamaBlock,
    LlamaText,
    LlavaEmbed,
    LlavaProjector,
    LMHeadLinear,
    TowerBlock,
    VisionEmbed,
    llava_checks,
    llava_specs,
    tied_head,
)
from .model.llava_next import AnyresEmbed, AnyresProjector, AnyresVision, llava_next_checks, llava_next_specs
from .model.moe import MOE_BLOCK, MoeHead, Qwen3MoeBlock, TiedMoeHead, moe_fields, qwen3_vl_layers
from .model.qwen2_vl import (
    MropeText,
    Qwen2Vision,
    QwenBlock,
    QwenEmbed,
    QwenMerger,
    QwenPatchEmbed,
    QwenVisionBlock,
    qwen2_vl_checks,
    qwen2_vl_specs,
)
from .model.qwen3_5 import (
    DELTANET_BLOCK,
    DELTANET_MOE_BLOCK,
    GATED_ATTENTION_BLOCK,
    GATED_ATTENTION_MOE_BLOCK,
    DeltaNetBlock,
    DeltaNetMoeBlock,
    GatedAttentionBlock,
    GatedAttentionMoeBlock,
    HybridText,
    Qwen35FinalNorm,
    qwen3_5_checks,
    qwen3_5_specs,
)
from .model.qwen3_5 import moe_fields as qwen3_5_moe_fields
from .model.qwen3_vl import (
    DEEPSTACK_ADDS,
    DEEPSTACK_MERGERS,
    DeepstackVision,
    Qwen3Block,
    Qwen3Embed,
    Qwen3Merger,
    Qwen3PatchEmbed,
    Qwen3Text,
    Qwen3Vision,
    Qwen3VisionBlock,
    deepstack_fields,
    qwen3_vl_checks,
)
from .model.sequence_parallel import LLAVA_SP_PLAN, QWEN2_VL_SP_PLAN, QWEN3_5_SP_PLAN, QWEN3_VL_SP_PLAN
from .model.stage import ROW, StageField
from .model.tensor_parallel import SIZES, Fused
from .model.tp_plans import (
    ATTENTION,
    DECODER,
    GEMMA3_TP_PLAN,
    GEMMA4_TP_PLAN,
    MOE_MLP,
    MOE_VOCAB_ENDS,
    QK_NORMS,
    QWEN2_VL_TP_PLAN,
    QWEN3_5_TP_PLAN,
    QWEN3_VL_TP_PLAN,
    VOCAB_ENDS,
    cross_attention_plan,
    moe_sizes,
    sequence_plan,
)
from .registry import Family, HfSide, ImageLayout, register

# the integer tensor of each image slot's layout (mmpipe.model.stage): moondream multi-crop's tiling (rows, cols),
# read and dropped by the Projector; the dynamic families' grids / tilings, kept to the head
CROP_TILING = StageField("tiling", False, dropped_by=Projector)
KEPT_TILING = StageField("tiling", False)
# the cross-attention family's projected images, made by its text embedding, dropped after its last reader
CARRIED_VISION = StageField("vision", True, made_by=CrossAttnTextEmbed, dropped_by=CrossAttnBlock)


def _moondream_fields(cfg: c.ModelConfig, *carried: StageField) -> tuple[StageField, ...]:
    return ROW + carried + ((CROP_TILING,) if cfg.vision.crop_slots > 1 else ())


def _hf(module: str, hf_class: str, model_types: tuple[str, ...], label: str, *, importer: str, config: str,
        reader: str, key_map: str = "key_map") -> HfSide:
    """An HF directory's side, its functions in mmpipe.hf.<module> (key_map and export_hf by default)."""
    m = f"mmpipe.hf.{module}:"
    return HfSide("hf", hf_class, model_types, label, importer=m + importer, config=m + config, reader=m + reader,
                  key_map=m + key_map, export=m + "export_hf")


def _moe(cfg: c.ModelConfig):
    return cfg.text.moe  # Qwen3Text / HybridText: a MoeConfig, None for a dense decoder


_MOONDREAM_COSTS = {PatchEmbed: costs.PATCH_EMBED, VisionBlock: costs.VISION_BLOCK, VisionNorm: costs.VISION_NORM,
                    Projector: costs.PROJECTOR, TextEmbed: costs.TEXT_EMBED, DecoderBlock: costs.DECODER_BLOCK,
                    LMHead: costs.LM_HEAD}
_CROP_VISION = ImageLayout(spliced=True, vision=CropVision, text=c.TextConfig)

# Phi's parallel block: the fused qkv split per part (q heads, kv heads: each part's 1/TP, so TP divides the kv heads),
# proj and fc2 by row (two all-reduces, one per branch), fc1 by column; the vocab ends split; SigLIP tower, projector
# and norms replicated, as LLaVA's (moondream2: the 0.4 B tower of 1.9 B, on fixed 378-px crops). The one LayerNorm's
# output enters each branch's region once (attn, mlp: entries, each reading nothing but its column linear), so under
# --sequence-parallel each branch all-gathers the norm's positions and reduce-scatters its row linear's output: the
# block's two regions, as a sequential block's; the norms, the row biases and the head on 1/TP of the positions
MOONDREAM_TP_PLAN = {
    DecoderBlock: {"attn.qkv": Fused(("q_dim", "kv_dim", "kv_dim")), "attn.proj": "row", "mlp.fc1": "column",
                   "mlp.fc2": "row", "attn": "entry", "mlp": "entry",
                   **{f"attn.{n}": "heads" for n in ("n_heads", "n_kv_heads", "q_dim", "kv_dim")}},
    TextEmbed: {"wte": "vocab"}, LMHead: {"linear": "vocab"},
    SIZES: lambda cfg: (("KV heads (text.n_kv_heads) of its fused qkv", cfg.text.kv_heads),),
    **sequence_plan(TextEmbed, (DecoderBlock, LMHead)),
}
MOONDREAM = register(Family(
    "moondream", "prefix", moondream_specs, (VisionBlock, DecoderBlock), _MOONDREAM_COSTS, _CROP_VISION, SPLICED,
    checks=moondream_checks, fields=_moondream_fields,
    hf=HfSide("moondream"),  # moondream's one safetensors file (mmpipe.hf.moondream), its region head beside
    tp_plan=MOONDREAM_TP_PLAN))
CROSS_ATTENTION = register(Family(
    "moondream", "cross_attention", cross_attention_specs, (VisionBlock, DecoderBlock, CrossAttnBlock),
    {**_MOONDREAM_COSTS, CrossAttnTextEmbed: costs.CROSS_ATTN_TEXT_EMBED, CrossAttnBlock: costs.CROSS_ATTN_BLOCK},
    ImageLayout(cross_attention=True, vision=CropVision, text=c.TextConfig), SPLICED,
    checks=moondream_checks, fields=lambda cfg: _moondream_fields(cfg, CARRIED_VISION),
    tp_plan=cross_attention_plan(MOONDREAM_TP_PLAN)))  # moondream's decoder split and each gated block's heads
# --tp (mmpipe.model.tensor_parallel): the decoder split as Megatron splits Llama (q/k/v and gate/up by column, heads
# whole on a rank, kv heads fewer than TP ranks whole on each; o and down by row), the embedding and head by
# vocabulary (a tied head reads the embedding's own vocab-split matrix, so the tie holds shard by shard). The tower
# and projector are replicated: every TP rank runs them whole, with no collective. They are small beside the
# decoder (CLIP-L 0.3 B of LLaVA-1.5-7B's 7.1 B) and run once per image; splitting them is issue 54's later work.
# A layer not named is replicated.
LLAVA_TP_PLAN = {
    LlamaBlock: {"self_attn": "entry", "mlp": "entry",  # each input enters the TP region once (2, not 5, a block)
                 "self_attn.q_proj": "column", "self_attn.k_proj": "kv", "self_attn.v_proj": "kv",
                 "self_attn.o_proj": "row", "self_attn.n_heads": "heads", "self_attn.kv_heads": "kv_heads",
                 "mlp.gate_proj": "column", "mlp.up_proj": "column", "mlp.down_proj": "row"},
    LlavaEmbed: {"embed_tokens": "vocab"},
    LMHeadLinear: {"lm_head": "vocab"},
    tied_head: {"": "vocab"},
    **sequence_plan(LlavaEmbed, (LlamaBlock,)),  # --sequence-parallel: the decoder on 1/TP of the row's positions
}
LLAVA = register(Family(
    "llava", "prefix", llava_specs, (TowerBlock, LlamaBlock),
    {VisionEmbed: costs.PATCH_EMBED, TowerBlock: costs.VISION_BLOCK, LlavaProjector: costs.PROJECTOR,
     LlavaEmbed: costs.TEXT_EMBED, LlamaBlock: costs.LLAMA_BLOCK, FinalNorm: costs.FINAL_NORM,
     LMHeadLinear: costs.LINEAR_HEAD, tied_head: costs.LINEAR_HEAD},
    ImageLayout(placeholders=True, vision=ClipVision, text=LlamaText), PLACEHOLDERS, checks=llava_checks,
    fields=lambda cfg: ROW, tower_tokens=lambda cfg: cfg.vision.n_positions,  # CLIP's class token too
    hf=_hf("llava", "LlavaForConditionalGeneration", ("llava",), "LLaVA", importer="import_llava",
           config="hf_llava_config", reader="read_llava", key_map="hf_key_map"),
    tp_plan=LLAVA_TP_PLAN, sp_plan=LLAVA_SP_PLAN))

# Its vision layers are costed on the row's patch budget (costs.QWEN_*, per_row: mmpipe.planning.costmodel)
QWEN2_VL = register(Family(
    "qwen2_vl", "prefix", qwen2_vl_specs, (QwenVisionBlock, QwenBlock),
    {QwenPatchEmbed: costs.QWEN_PATCH_EMBED, QwenVisionBlock: costs.QWEN_VISION_BLOCK, QwenMerger: costs.QWEN_MERGER,
     QwenEmbed: costs.QWEN_EMBED, QwenBlock: costs.QWEN_BLOCK, FinalNorm: costs.FINAL_NORM,
     LMHeadLinear: costs.LINEAR_HEAD, tied_head: costs.LINEAR_HEAD},
    ImageLayout(placeholders=True, vision=Qwen2Vision, text=MropeText), PATCHES, checks=qwen2_vl_checks,
    fields=lambda cfg: ROW + (KEPT_TILING,),
    media=("image", "video"),  # clips: mmpipe.data.video (Qwen2.5-VL's absolute-time rotary)
    # Qwen2.5-VL's class by config (mmpipe.hf.qwen2_vl)
    hf=_hf("qwen2_vl", "Qwen2VLForConditionalGeneration", ("qwen2_vl", "qwen2_5_vl"), "Qwen2-VL",
           importer="import_qwen2_vl", config="hf_qwen_config", reader="read_qwen2_vl"), tp_plan=QWEN2_VL_TP_PLAN,
    sp_plan=QWEN2_VL_SP_PLAN))

# The tower, projector and embedding are costed on the row's T crops (costs.ANYRES_*, per_row: a CropRow)
LLAVA_NEXT = register(Family(
    "llava_next", "prefix", llava_next_specs, (TowerBlock, LlamaBlock),
    {VisionEmbed: costs.ANYRES_PATCH_EMBED, TowerBlock: costs.ANYRES_VISION_BLOCK,
     AnyresProjector: costs.ANYRES_PROJECTOR, AnyresEmbed: costs.ANYRES_EMBED, LlamaBlock: costs.LLAMA_BLOCK,
     FinalNorm: costs.FINAL_NORM, LMHeadLinear: costs.LINEAR_HEAD, tied_head: costs.LINEAR_HEAD},
    ImageLayout(placeholders=True, vision=AnyresVision, text=LlamaText), TILES, checks=llava_next_checks,
    tower_tokens=lambda cfg: cfg.vision.n_positions,  # CLIP's class token too
    fields=lambda cfg: ROW + (KEPT_TILING,),
    media=("image", "video"),  # clips: OneVision's pooled frames (mmpipe.data.video); NeXT refuses
    # LlavaOnevisionForConditionalGeneration's by config (vision.anyres_max > 0: mmpipe.hf.llava_next)
    hf=_hf("llava_next", "LlavaNextForConditionalGeneration", ("llava_next", "llava_onevision"),
           "LLaVA-NeXT / OneVision", importer="import_llava_next", config="hf_llava_next_config",
           reader="read_llava_next"),
    # LLaVA's split (its LlamaBlock, head, tower replicated) and the anyres embedding's vocabulary: the tower runs on
    # a row's T crops of a fixed size (llava-v1.6's CLIP-L: 0.3 B of 7.1 B), as LLaVA's on its one crop
    tp_plan={**LLAVA_TP_PLAN, AnyresEmbed: {"embed_tokens": "vocab"}, **sequence_plan(AnyresEmbed, (LlamaBlock,))}))

# Qwen2-VL's rules for the same shapes; DeepStack's sets are carried fields, one per merger / add pair
QWEN3_VL = register(Family(
    "qwen3_vl", "prefix", qwen3_vl_layers, (Qwen3VisionBlock, Qwen3Block, Qwen3MoeBlock),
    {Qwen3PatchEmbed: costs.QWEN_PATCH_EMBED, Qwen3VisionBlock: costs.QWEN_VISION_BLOCK,
     Qwen3Merger: costs.QWEN_MERGER, Qwen3Embed: costs.QWEN_EMBED, Qwen3Block: costs.QWEN_BLOCK,
     FinalNorm: costs.FINAL_NORM, LMHeadLinear: costs.LINEAR_HEAD, tied_head: costs.LINEAR_HEAD,
     **{m: costs.DEEPSTACK_MERGER for m in DEEPSTACK_MERGERS}, **{a: costs.DEEPSTACK_ADD for a in DEEPSTACK_ADDS},
     Qwen3MoeBlock: MOE_BLOCK, MoeHead: costs.LINEAR_HEAD,
     TiedMoeHead: costs.LINEAR_HEAD},  # text.moe: mmpipe.model.moe
    ImageLayout(placeholders=True, vision=DeepstackVision, text=Qwen3Text), PATCHES, checks=qwen3_vl_checks,
    fields=lambda cfg: ROW + deepstack_fields(cfg) + moe_fields(cfg) + (KEPT_TILING,),
    media=("image", "video"),  # clips: a slot per temporal patch after its timestamp text (mmpipe.data.video)
    # Megatron-Bridge injects DeepStack on the first stage only (QwenLM/Qwen3-VL#1497): the tower and decoder layers
    # 0..2 with DeepStack's last add
    fixed_first_stage=lambda specs: 1 + max(i for i, s in enumerate(specs) if s.typename in DEEPSTACK_ADDS),
    experts=_moe,
    hf=_hf("qwen3_vl", "Qwen3VLForConditionalGeneration", ("qwen3_vl", "qwen3_vl_moe"), "Qwen3-VL",
           importer="import_qwen3_vl", config="hf_qwen3_config", reader="read_qwen3_vl"), tp_plan=QWEN3_VL_TP_PLAN,
    sp_plan=QWEN3_VL_SP_PLAN))

# Qwen3-VL's tower without DeepStack; each decoder layer kind by its own rule (mmpipe.model.qwen3_5): a
# linear-attention layer linear in positions (DELTANET_BLOCK), a full one with its output gate and its heads' own
# width (GATED_ATTENTION_BLOCK); Qwen3.5-MoE (text.moe) has the sparse kind of each, on its active parameters
QWEN3_5 = register(Family(
    "qwen3_5", "prefix", qwen3_5_specs,
    (Qwen3VisionBlock, DeltaNetBlock, GatedAttentionBlock, DeltaNetMoeBlock, GatedAttentionMoeBlock),
    {Qwen3PatchEmbed: costs.QWEN_PATCH_EMBED, Qwen3VisionBlock: costs.QWEN_VISION_BLOCK,
     Qwen3Merger: costs.QWEN_MERGER, Qwen3Embed: costs.QWEN_EMBED, DeltaNetBlock: DELTANET_BLOCK,
     GatedAttentionBlock: GATED_ATTENTION_BLOCK, Qwen35FinalNorm: costs.FINAL_NORM, LMHeadLinear: costs.LINEAR_HEAD,
     tied_head: costs.LINEAR_HEAD, DeltaNetMoeBlock: DELTANET_MOE_BLOCK,
     GatedAttentionMoeBlock: GATED_ATTENTION_MOE_BLOCK, MoeHead: costs.LINEAR_HEAD,
     TiedMoeHead: costs.LINEAR_HEAD},  # text.moe: mmpipe.model.moe
    ImageLayout(placeholders=True, vision=Qwen3Vision, text=HybridText), PATCHES, checks=qwen3_5_checks,
    fields=lambda cfg: ROW + qwen3_5_moe_fields(cfg) + (KEPT_TILING,), experts=_moe,
    # Qwen3_5MoeForConditionalGeneration's by config (text.moe: mmpipe.hf.qwen3_5)
    hf=_hf("qwen3_5", "Qwen3_5ForConditionalGeneration", ("qwen3_5", "qwen3_5_moe"), "Qwen3.5",
           importer="import_qwen3_5", config="hf_qwen3_5_config", reader="read_qwen3_5"), tp_plan=QWEN3_5_TP_PLAN,
    sp_plan=QWEN3_5_SP_PLAN))

# InternVL3.5: InternViT on 448-px tiles in the row's T crops (costed at an image's tile cap), a Qwen3 decoder, dense
# or MoE (text.moe: mmpipe.model.moe's sparse MLP and head); mmpipe.model.internvl, mmpipe.data.internvl
INTERNVL = register(Family(
    "internvl", "prefix", internvl_specs, (InternVisionBlock, InternBlock, InternMoeBlock), INTERNVL_COSTS,
    ImageLayout(placeholders=True, vision=InternVision, text=InternText), INTERN_TILES, checks=internvl_checks,
    tower_tokens=crops_tokens, fields=internvl_fields, experts=_moe,
    media=("image", "video"),  # clips as frames, each one crop after its `FrameN: ` line (mmpipe.data.video)
    hf=_hf("internvl", "InternVLForConditionalGeneration", ("internvl",), "InternVL3.5", importer="import_internvl",
           config="hf_internvl_config", reader="read_internvl"),
    # the decoder as Qwen3-VL's (q / k norms per head, summed over TP); InternViT replicated, as LLaVA's tower: it runs
    # on fixed 448-px tiles (the 300M of 1B-30B; the 6B of 38B / 241B would want its own split: its q / k norms span
    # the whole width, a collective per block)
    # its MoE decoder (InternVL3.5-30B-A3B / 241B-A28B: Qwen3-MoE's) is moe.PreNormMoeBlock, split as Qwen3-VL-MoE's
    tp_plan={InternBlock: {**DECODER, **QK_NORMS}, InternMoeBlock: {**ATTENTION, **QK_NORMS, **MOE_MLP},
             InternEmbed: {"embed_tokens": "vocab"}, **VOCAB_ENDS, **MOE_VOCAB_ENDS, SIZES: moe_sizes,
             **sequence_plan(InternEmbed, (InternBlock, InternMoeBlock))}))

# Gemma 3 (mmpipe.model.gemma3): LLaVA's SigLIP tower, placeholders bracketed by <start_of_image> / <end_of_image> and
# read by transformers' Gemma3ImageProcessor (mmpipe.data.gemma3), a pooled projector, a decoder of sliding and global
# blocks whose image blocks attend both ways (mmpipe.model.attention's block ids)
GEMMA3 = register(Family(
    "gemma3", "prefix", gemma3_specs, (TowerBlock, Gemma3Block, Gemma3SlidingBlock), GEMMA3_COSTS,
    ImageLayout(placeholders=True, vision=Gemma3Vision, text=Gemma3Text), GEMMA3_IMAGES, checks=gemma3_checks,
    fields=lambda cfg: ROW,
    hf=_hf("gemma3", "Gemma3ForConditionalGeneration", ("gemma3",), "Gemma 3", importer="import_gemma3",
           config="hf_gemma3_config", reader="read_gemma3"), tp_plan=GEMMA3_TP_PLAN,
    sp_why_not="its carried per-layer fields and image blocks are not sliced yet"))

# Gemma 4 (mmpipe.model.gemma4): a tower with a learned 2-D position table and 3 x 3 pooling, its images by config
# (mmpipe.data.gemma4: a fixed square on Gemma 3's bracketed placeholders, or any aspect ratio within
# vision.max_soft_tokens as a patch list with each slot's grid in tiling), a decoder whose per-layer inputs and shared
# K/V are carried stage fields (gemma4_fields); audio is not among its media: a record with audio is a bad record
GEMMA4 = register(Family(
    "gemma4", "prefix", gemma4_specs,
    (Gemma4TowerBlock, *GEMMA4_BLOCK_CLASSES.values(), *GEMMA4_MOE_BLOCKS.values()), GEMMA4_COSTS,
    ImageLayout(placeholders=True, vision=Gemma4Vision, text=Gemma4Text), GEMMA4_IMAGES, checks=gemma4_checks,
    media=("image", "video"),  # clips as frames, each an image after its `mm:ss ` time (mmpipe.data.video)
    fields=gemma4_fields, tower_tokens=gemma4_tower_tokens, experts=_moe,  # text.moe: 26B-A4B's experts
    hf=_hf("gemma4", "Gemma4ForConditionalGeneration", ("gemma4",), "Gemma 4", importer="import_gemma4",
           config="hf_gemma4_config", reader="read_gemma4"), tp_plan=GEMMA4_TP_PLAN,
    sp_why_not="its per-layer inputs and shared K/V travel whole-row (not sliced yet)"))
