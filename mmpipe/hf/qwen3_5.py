"""Qwen3.5 (dense) in and out of Hugging Face: Qwen3_5ForConditionalGeneration directories <-> mmpipe's layer list
(mmpipe.model.qwen3_5).

Names: "<layer index>.<sub-name>" <-> transformers', a prefix per layer class, the decoder layers numbered across
both kinds (a linear layer's sub-names are under linear_attn, a full one's under self_attn), e.g. for a 1-block tower
and decoder layers linear, full:

    0.proj.weight                        <->  model.visual.patch_embed.proj.weight
    0.pos_embed.weight                   <->  model.visual.pos_embed.weight
    2.linear_fc1.weight                  <->  model.visual.merger.linear_fc1.weight
    4.linear_attn.A_log                  <->  model.language_model.layers.0.linear_attn.A_log
    5.self_attn.q_proj.weight            <->  model.language_model.layers.1.self_attn.q_proj.weight

Every source tensor is mapped (a tied lm_head must equal the input embedding) or the import fails naming it, except
the multi-token-prediction head (mtp.*), which transformers does not load either; a missing or misshapen tensor fails.
"""
from __future__ import annotations

from pathlib import Path

import torch

from ..config import HybridText, ModelConfig
from ..model.builder import ReferenceModel
from ..model.llava import LMHeadLinear
from ..model.qwen3_5 import DeltaNetBlock, GatedAttentionBlock, Qwen35FinalNorm, layer_types
from ..model.qwen3_vl import Qwen3Embed, Qwen3Merger, Qwen3PatchEmbed, Qwen3VisionBlock
from .llava import ImportReport, _fail, processor_defaults, processor_settings, read_hf_config
from .qwen2_vl import pixel_defaults_taken, plan_named, write_with_processor
from .qwen3_vl import DEFAULT_PIXELS, hf_tower, text_section, tower_config
from .safetensors_io import LazyWeights, as_weights, open_weights
from .stream import Imported, fill, meta_model

HF_CLASSES = {"qwen3_5": "Qwen3_5ForConditionalGeneration"}
DECODER = (DeltaNetBlock, GatedAttentionBlock)


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """mmpipe name -> HF name for every weight of the mmpipe model (a tied head has none)."""
    model = meta_model(cfg)
    out, seen = {}, {}
    for i, layer in enumerate(model):
        if not layer.state_dict():
            continue
        kind = DECODER if isinstance(layer, DECODER) else type(layer)  # both kinds count as decoder layers
        k = seen.get(kind, 0)
        seen[kind] = k + 1
        prefix = ("model.visual.patch_embed." if isinstance(layer, Qwen3PatchEmbed) else
                  f"model.visual.blocks.{k}." if isinstance(layer, Qwen3VisionBlock) else
                  "model.visual.merger." if isinstance(layer, Qwen3Merger) else
                  f"model.language_model.layers.{k}." if isinstance(layer, DECODER) else
                  "model.language_model." if isinstance(layer, (Qwen3Embed, Qwen35FinalNorm)) else
                  "" if isinstance(layer, LMHeadLinear) else None)
        if prefix is None:
            raise ValueError(f"layer {i} ({type(layer).__name__}) has no Qwen3.5 name")
        for sub in layer.state_dict():
            out[f"{i}.{sub}"] = ("model.visual." + sub if isinstance(layer, Qwen3PatchEmbed)
                                 and sub.startswith("pos_embed.") else prefix + sub)
    return out


def config_from_hf(hf, name: str = "hf", proc: dict | None = None) -> ModelConfig:
    """A Qwen3_5Config (+ its image processor's settings) -> the mmpipe config; refuses what the layers do not
    implement, and a layer pattern that does not match the layer count (one line, from the config's checks)."""
    tc, vc, proc = hf.text_config, hf.vision_config, proc or {}
    kinds = list(getattr(tc, "layer_types", None) or [])
    if len(kinds) != tc.num_hidden_layers or not set(kinds) <= {"linear_attention", "full_attention"}:
        _fail("text_config.layer_types", f"{len(kinds)} kinds {sorted(set(kinds))} for {tc.num_hidden_layers} layers "
                                         f"(one per layer: linear_attention or full_attention)")
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    text = text_section(
        HybridText, hf, "Qwen3.5", theta=10000000.0, sections=(11, 11, 10),
        partial_rotary_factor=float(rope.get("partial_rotary_factor", getattr(tc, "partial_rotary_factor", 0.25))),
        full_attention_indexes=tuple(i for i, kind in enumerate(kinds) if kind == "full_attention"),
        linear_key_heads=tc.linear_num_key_heads,
        linear_value_heads=tc.linear_num_value_heads, linear_key_dim=tc.linear_key_head_dim,
        linear_value_dim=tc.linear_value_head_dim, linear_conv_kernel=tc.linear_conv_kernel_dim)
    vision = tower_config(vc, tc, proc)  # Qwen3-VL's tower, without DeepStack
    cfg = ModelConfig(name=name, family="qwen3_5", vision=vision, text=text,
                      proj_inner_dim=vision.dim * vision.merge_size ** 2, image_token_id=hf.image_token_id,
                      vision_start_id=hf.vision_start_token_id, vision_end_id=hf.vision_end_token_id)
    cfg.validate()
    return cfg


def hf_config(cfg: ModelConfig, tok=None):
    """mmpipe Qwen3.5 config -> transformers' Qwen3_5Config, with tok's special ids in its text config."""
    from transformers import Qwen3_5Config

    from .llava import token_ids
    t = cfg.text
    vision = hf_tower(cfg)
    text = dict(hidden_size=t.dim, intermediate_size=t.ff_dim, num_hidden_layers=t.n_layers,
                num_attention_heads=t.n_heads, num_key_value_heads=t.kv_heads, head_dim=t.head_dim,
                vocab_size=t.vocab_size, max_position_embeddings=t.max_context, rms_norm_eps=t.ln_eps,
                tie_word_embeddings=t.tie_embeddings, layer_types=list(layer_types(t)),
                linear_conv_kernel_dim=t.linear_conv_kernel, linear_key_head_dim=t.linear_key_dim,
                linear_value_head_dim=t.linear_value_dim, linear_num_key_heads=t.linear_key_heads,
                linear_num_value_heads=t.linear_value_heads,
                rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta,
                                 "mrope_section": list(t.mrope_section), "mrope_interleaved": True,
                                 "partial_rotary_factor": t.partial_rotary_factor},
                **token_ids(tok, t.vocab_size))
    return Qwen3_5Config(vision_config=vision, text_config=text, image_token_id=cfg.image_token_id,
                         vision_start_token_id=cfg.vision_start_id, vision_end_token_id=cfg.vision_end_id,
                         tie_word_embeddings=t.tie_embeddings)


def _without_mtp(source):
    """The source less its multi-token-prediction head (mtp.*: the released checkpoints carry one, transformers'
    Qwen3_5ForConditionalGeneration ignores it on load, and so does the import)."""
    if isinstance(source, LazyWeights):
        return LazyWeights({k: f for k, f in source.files.items() if not k.startswith("mtp.")})
    return {k: v for k, v in as_weights(source).items() if not k.startswith("mtp.")}


def import_weights(model: ReferenceModel, source, where: str) -> ImportReport:
    """Load HF-named tensors into the mmpipe model: every source tensor mapped, every weight filled."""
    source = as_weights(_without_mtp(source))
    assign, report = plan_named(model.cfg, source, where, key_map(model.cfg), HF_CLASSES["qwen3_5"])
    fill(model, source, assign)
    return report


def hf_qwen3_5_config(path: str | Path):
    """An HF Qwen3.5 directory's (HF config, mmpipe config); no weight is read."""
    path = Path(path)
    hf = read_hf_config(path, tuple(HF_CLASSES))
    return hf, config_from_hf(hf, path.name, processor_settings(path)[0])


def read_qwen3_5(path: str | Path) -> Imported:
    """An HF Qwen3_5ForConditionalGeneration directory, decided from its config and tensor headers (no weight read
    yet): save it layer by layer (Imported.save) or as a model (Imported.model)."""
    path = Path(path)
    _, cfg = hf_qwen3_5_config(path)
    source = _without_mtp(open_weights(path))
    assign, report = plan_named(cfg, source, str(path), key_map(cfg), HF_CLASSES["qwen3_5"])
    report.notes += processor_defaults(path, lambda proc: pixel_defaults_taken(proc, DEFAULT_PIXELS, clip=False))
    return Imported(cfg, assign, source, report)


def import_qwen3_5(path: str | Path, dtype=torch.float32) -> tuple[ReferenceModel, ImportReport]:
    """An HF Qwen3_5ForConditionalGeneration directory -> (mmpipe single-device model, report)."""
    got = read_qwen3_5(path)
    return got.model(dtype), got.report


def export_hf(source, out: str | Path, tok=None, shard_size=None) -> Path:
    """Write an HF directory (config.json, generation_config.json, the weights sharded, its image processor) that
    from_pretrained loads, one layer in memory at a time; source: a model or a run's layers (mmpipe.hf.stream)."""
    return write_with_processor(source, out, hf_config(source.cfg, tok), key_map(source.cfg), shard_size)
