"""Qwen3-VL (dense) in and out of Hugging Face: Qwen3VLForConditionalGeneration directories <-> mmpipe's layer
list (mmpipe.model.qwen3_vl).

Names: "<layer index>.<sub-name>" <-> transformers', a prefix per layer class, except the patch embedding, whose
learned position table is the tower's own (model.visual.pos_embed), e.g. for a 2-block tower with DeepStack
after block 0:

    0.proj.weight                 <->  model.visual.patch_embed.proj.weight
    0.pos_embed.weight            <->  model.visual.pos_embed.weight
    2.norm.weight                 <->  model.visual.deepstack_merger_list.0.norm.weight
    4.linear_fc1.weight           <->  model.visual.merger.linear_fc1.weight
    6.self_attn.q_norm.weight     <->  model.language_model.layers.0.self_attn.q_norm.weight

Every source tensor is mapped (a tied lm_head must equal the input embedding) or the import fails naming it;
so does a missing or misshapen one. transformers' Qwen3-VL always interleaves its multimodal rotary (its
rope_parameters' mrope_interleaved is not read), so the import does too.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..config import ModelConfig
from ..model.builder import ReferenceModel
from ..model.llava import FinalNorm, LMHeadLinear
from ..model.moe import MoeHead, Qwen3MoeBlock
from ..model.qwen2_vl import VISION_THETA
from ..model.qwen3_vl import (
    DeepstackMerger,
    DeepstackVision,
    Qwen3Block,
    Qwen3Embed,
    Qwen3Merger,
    Qwen3PatchEmbed,
    Qwen3Text,
    Qwen3Vision,
    Qwen3VisionBlock,
)
from .llava import ImportReport, _fail, processor_defaults, processor_settings, read_hf_config, tie_flag
from .moe import expert_layout, hf_moe_fields, moe_from_hf
from .qwen2_vl import _bounds, pixel_defaults_taken, plan_named, with_video_settings, write_with_processor
from .safetensors_io import as_weights, open_weights
from .stream import Imported, fill, meta_model

HF_CLASSES = {"qwen3_vl": "Qwen3VLForConditionalGeneration",
              "qwen3_vl_moe": "Qwen3VLMoeForConditionalGeneration"}  # text.moe (mmpipe.hf.moe, docs/moe.md)
DEFAULT_PIXELS = (65536, 16777216)  # Qwen3-VL's preprocessor_config: size shortest_edge / longest_edge
ACTS = {"gelu_pytorch_tanh": "gelu_tanh", "gelu": "gelu"}  # transformers' tower activations -> mmpipe's
STATS = (0.5, 0.5, 0.5)  # Qwen3-VL's image_mean and image_std (SigLIP's), taken where the processor has none


def _defaults_taken(proc: dict) -> tuple[list[str], list[str]]:
    """(the settings proc lacks, the defaults config_from_hf takes for them in words): for processor_defaults."""
    return pixel_defaults_taken(proc, DEFAULT_PIXELS, clip=False)


def _prefix(layer, k: int) -> str:
    """The HF prefix of the k-th layer of its class."""
    if isinstance(layer, DeepstackMerger):
        return f"model.visual.deepstack_merger_list.{layer.index}."
    return {Qwen3PatchEmbed: "model.visual.patch_embed.", Qwen3VisionBlock: f"model.visual.blocks.{k}.",
            Qwen3Merger: "model.visual.merger.", Qwen3Embed: "model.language_model.",
            Qwen3Block: f"model.language_model.layers.{k}.", FinalNorm: "model.language_model.",
            LMHeadLinear: "", Qwen3MoeBlock: f"model.language_model.layers.{k}.", MoeHead: ""}[type(layer)]


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """mmpipe name -> HF name for every weight of the mmpipe model (a tied head and DeepStack's adds have none)."""
    model = meta_model(cfg)
    out, seen = {}, {}
    for i, layer in enumerate(model):
        if not layer.state_dict():
            continue
        k = seen.get(type(layer), 0)
        seen[type(layer)] = k + 1
        for sub in layer.state_dict():
            name = ("model.visual." + sub if isinstance(layer, Qwen3PatchEmbed) and sub.startswith("pos_embed.")
                    else _prefix(layer, k) + sub)
            out[f"{i}.{sub}"] = name
    return out


def tower_config(vc, tc, proc: dict, cls: type = Qwen3Vision, **extra) -> Qwen3Vision:
    """The Qwen3-VL tower of an HF vision config (Qwen3-VL's, and Qwen3.5's, which is the same tower) and its image
    processor's settings -> the family's vision section `cls` (extra: its own fields); refuses, one line each, what the
    layers do not implement."""
    if vc.hidden_act not in ACTS:
        _fail("vision_config.hidden_act", f"'{vc.hidden_act}' (supported: {', '.join(ACTS)})")
    if vc.out_hidden_size != tc.hidden_size:
        _fail("vision_config", f"the merger's output width {vc.out_hidden_size} is not the decoder's hidden_size "
                               f"{tc.hidden_size}")
    theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", VISION_THETA)
    if theta != VISION_THETA:
        _fail("vision_config.rope_parameters", f"rope_theta {theta}: the tower's 2D rotary uses {VISION_THETA}")
    lo, hi = (int(got or default) for got, default in zip(_bounds(proc), DEFAULT_PIXELS))
    unit = vc.patch_size * vc.spatial_merge_size
    return cls(
        image_size=max(unit, math.isqrt(hi) // unit * unit), patch_size=vc.patch_size, dim=vc.hidden_size,
        n_layers=vc.depth, n_heads=vc.num_heads, ff_dim=vc.intermediate_size, channels=vc.in_channels,
        mean=tuple(proc.get("image_mean") or STATS), std=tuple(proc.get("image_std") or STATS), ln_eps=1e-6,
        act=ACTS[vc.hidden_act], temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size,
        min_pixels=lo, max_pixels=hi, num_position_embeddings=vc.num_position_embeddings, **extra)


def hf_tower(cfg: ModelConfig) -> dict:
    """tower_config's inverse: the HF vision config's fields of mmpipe's Qwen3-VL tower."""
    v = cfg.vision
    act = {mine: theirs for theirs, mine in ACTS.items()}[v.act]
    return dict(depth=v.n_layers, hidden_size=v.dim, intermediate_size=v.ff_dim, num_heads=v.n_heads,
                in_channels=v.channels, patch_size=v.patch_size, spatial_merge_size=v.merge_size,
                temporal_patch_size=v.temporal_patch_size, out_hidden_size=cfg.text.dim, hidden_act=act,
                num_position_embeddings=v.num_position_embeddings)


def text_section(cls, hf, model: str, *, theta: float, sections: tuple, **extra):
    """A Qwen3 family's decoder section (`cls`: Qwen3Text, HybridText; `extra`: its own fields) from an HF config,
    after the refusals the families share: RoPE scaling, attention bias, an activation other than SiLU. `theta`,
    `sections`: the family's rope_theta and mrope_section where the config leaves them out."""
    tc = hf.text_config
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        _fail("text_config.rope_parameters", f"rope_type '{rope['rope_type']}' (RoPE scaling) is not supported")
    if getattr(tc, "attention_bias", False):
        _fail("text_config.attention_bias", f"true: {model}'s attention has no bias in mmpipe's layers")
    if tc.hidden_act != "silu":
        _fail("text_config.hidden_act", f"'{tc.hidden_act}' (supported: silu)")
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    return cls(
        dim=tc.hidden_size, n_layers=tc.num_hidden_layers, n_heads=tc.num_attention_heads,
        ff_dim=tc.intermediate_size, vocab_size=tc.vocab_size, max_context=tc.max_position_embeddings,
        rope_theta=float(rope.get("rope_theta", theta)), ln_eps=tc.rms_norm_eps, n_kv_heads=tc.num_key_value_heads,
        tie_embeddings=tie_flag(hf),
        mrope_section=tuple(rope.get("mrope_section", sections)), mrope_interleaved=True, qk_norm=True,
        attn_head_dim=0 if head_dim * tc.num_attention_heads == tc.hidden_size else head_dim, **extra)


def config_from_hf(hf, name: str = "hf", proc: dict | None = None) -> ModelConfig:
    """A Qwen3VLConfig (+ its image processor's settings) -> the mmpipe config; refuses what the layers do not
    implement, and a DeepStack index beyond the tower (one line, from the config's checks)."""
    tc, vc, proc = hf.text_config, hf.vision_config, proc or {}
    text = text_section(Qwen3Text, hf, "Qwen3", theta=5000000.0, sections=(24, 20, 20), partial_rotary_factor=1.0,
                        moe=moe_from_hf(tc))
    vision = tower_config(vc, tc, proc, DeepstackVision, deepstack_indexes=tuple(vc.deepstack_visual_indexes))
    cfg = ModelConfig(name=name, family="qwen3_vl", vision=vision, text=text,
                      proj_inner_dim=vision.dim * vision.merge_size ** 2, image_token_id=hf.image_token_id,
                      vision_start_id=hf.vision_start_token_id, vision_end_id=hf.vision_end_token_id)
    cfg.validate()
    return cfg


def hf_config(cfg: ModelConfig, tok=None):
    """mmpipe Qwen3-VL config -> transformers' Qwen3VLConfig, with tok's special ids in its text config."""
    from transformers import Qwen3VLConfig, Qwen3VLMoeConfig

    from .llava import token_ids
    v, t = cfg.vision, cfg.text
    vision = dict(hf_tower(cfg), deepstack_visual_indexes=list(v.deepstack_indexes))
    text = dict(hidden_size=t.dim, intermediate_size=t.ff_dim, num_hidden_layers=t.n_layers,
                num_attention_heads=t.n_heads, num_key_value_heads=t.kv_heads, head_dim=t.head_dim,
                vocab_size=t.vocab_size, max_position_embeddings=t.max_context, rms_norm_eps=t.ln_eps,
                tie_word_embeddings=t.tie_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta,
                                 "mrope_section": list(t.mrope_section), "mrope_interleaved": True},
                **token_ids(tok, t.vocab_size), **(hf_moe_fields(t.moe) if t.moe else {}))
    return (Qwen3VLMoeConfig if t.moe else Qwen3VLConfig)(
        vision_config=vision, text_config=text, image_token_id=cfg.image_token_id,
        vision_start_token_id=cfg.vision_start_id, vision_end_token_id=cfg.vision_end_id,
        tie_word_embeddings=t.tie_embeddings)


def import_weights(model: ReferenceModel, source, where: str) -> ImportReport:
    """Load HF-named tensors into the mmpipe model: every source tensor mapped, every weight filled."""
    source = expert_layout(as_weights(source), model.cfg)  # an MoE checkpoint's experts in either layout
    assign, report = plan_named(model.cfg, source, where, key_map(model.cfg), HF_CLASSES["qwen3_vl"])
    fill(model, source, assign)
    return report


def hf_qwen3_config(path: str | Path, notes: list[str] | None = None):
    """An HF Qwen3-VL directory's (HF config, mmpipe config); no weight is read (but llava.settle_tie's two)."""
    path = Path(path)
    hf = read_hf_config(path, tuple(HF_CLASSES), notes)
    return hf, with_video_settings(config_from_hf(hf, path.name, processor_settings(path)[0]), path, notes)


def read_qwen3_vl(path: str | Path) -> Imported:
    """An HF Qwen3VLForConditionalGeneration directory, decided from its config and tensor headers (no weight
    read yet): save it layer by layer (Imported.save) or as a model (Imported.model)."""
    path, notes = Path(path), []
    _, cfg = hf_qwen3_config(path, notes)
    source = expert_layout(open_weights(path), cfg)  # an MoE checkpoint's experts in either layout (mmpipe.hf.moe)
    assign, report = plan_named(cfg, source, str(path), key_map(cfg), HF_CLASSES["qwen3_vl"])
    report.notes += notes + processor_defaults(path, _defaults_taken)  # the summary line says which it took
    return Imported(cfg, assign, source, report)


def import_qwen3_vl(path: str | Path, dtype=torch.float32) -> tuple[ReferenceModel, ImportReport]:
    """An HF Qwen3VLForConditionalGeneration directory -> (mmpipe single-device model, report)."""
    got = read_qwen3_vl(path)
    return got.model(dtype), got.report


def export_hf(source, out: str | Path, tok=None, shard_size=None) -> Path:
    """Write an HF directory (config.json, generation_config.json, the weights sharded, its image processor) that
    from_pretrained loads, one layer in memory at a time; source: a model or a run's layers (mmpipe.hf.stream)."""
    return write_with_processor(source, out, hf_config(source.cfg, tok), key_map(source.cfg), shard_size)
