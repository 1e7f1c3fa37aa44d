"""Gemma 4 in and out of Hugging Face: Gemma4ForConditionalGeneration directories (model_type gemma4) <-> mmpipe's
layer list (mmpipe.model.gemma4).

Names, a prefix per layer (mmpipe's "<layer index>.<sub>", the sub-name HF's module name):

    Gemma4PatchEmbed     model.vision_tower.patch_embedder.*
    Gemma4TowerBlock k   model.vision_tower.encoder.layers.k.*
    Gemma4Projector      model.embed_vision.* (its norm has no weight)
    Gemma4Embed          model.language_model.{embed_tokens, embed_tokens_per_layer, per_layer_model_projection,
                         per_layer_projection_norm}.*
    Gemma4*Block k       model.language_model.layers.k.* (layer_scalar, a buffer, too); a sparse one's MoE
                         block (enable_moe_block: 26B-A4B) under transformers' names as they are: router.{proj.weight,
                         scale, per_expert_scale}, experts.gate_up_proj [E, 2F, D], experts.down_proj [E, D, F] (the
                         layout transformers saves: Gemma 4 has no conversion mapping), pre_feedforward_layernorm_2,
                         post_feedforward_layernorm_1, post_feedforward_layernorm_2
    Gemma4FinalNorm      model.language_model.norm.weight
    Gemma4Head           lm_head.weight (a tied head has none: the embedding's; Gemma4MoeHead likewise)

An audio tower (model.audio_tower.*, model.embed_audio.*) is reported unused: this family reads images and text,
and a record with audio is a bad record (Family.media). Refused in one line: bidirectional attention over all
tokens, layer types other than "every k-th global" (the last always global), RoPE types other than Gemma 4's
(default sliding, proportional full), an MoE block without its experts' sizes.
"""
from __future__ import annotations

import math
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig
from ..model.gemma4 import (
    SOFT_TOKEN_BUDGETS,
    Gemma4Block,
    Gemma4Embed,
    Gemma4FinalNorm,
    Gemma4Head,
    Gemma4MoeHead,
    Gemma4PatchEmbed,
    Gemma4Projector,
    Gemma4Text,
    Gemma4TowerBlock,
    Gemma4Vision,
)
from ..model.qwen3_vl import MoeConfig
from .export import write_hf
from .llava import ImportReport, processor_settings, read_hf_config, tie_flag, token_ids
from .qwen2_vl import plan_named
from .safetensors_io import Renamed, open_weights
from .stream import Imported, meta_model
from .video_config import video_kwargs, with_video_settings

HF_CLASSES = {"gemma4": "Gemma4ForConditionalGeneration"}
TOWER, LM = "model.vision_tower.", "model.language_model."
UNUSED = ("model.audio_tower.", "model.embed_audio.")


def _fail(where: str, msg: str):
    raise ConfigError(f"{where}: {msg}")


def _name(layer, sub: str, k: int) -> str:
    if isinstance(layer, Gemma4PatchEmbed):
        return TOWER + "patch_embedder." + sub
    if isinstance(layer, Gemma4TowerBlock):
        return f"{TOWER}encoder.layers.{k}.{sub}"
    if isinstance(layer, Gemma4Projector):  # the standardization's buffers are the tower's
        return (TOWER if sub.startswith("std_") else "model.embed_vision.") + sub
    if isinstance(layer, (Gemma4Embed, Gemma4FinalNorm)):
        return LM + sub
    if isinstance(layer, Gemma4Block):
        return f"{LM}layers.{k}.{sub}"
    if isinstance(layer, (Gemma4Head, Gemma4MoeHead)):
        return sub
    raise ValueError(f"{type(layer).__name__} has no Gemma 4 name")


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """mmpipe name -> HF name for every weight (and saved buffer) of the mmpipe model."""
    out, seen = {}, {}
    for i, layer in enumerate(meta_model(cfg)):
        kind = Gemma4Block if isinstance(layer, Gemma4Block) else type(layer)  # every decoder block counts
        k = seen.get(kind, 0)
        seen[kind] = k + 1
        for sub in layer.state_dict():
            out[f"{i}.{sub}"] = _name(layer, sub, k)
    return out


def _pattern(tc) -> int:
    """The k of "every k-th layer global, the last global" that gives tc.layer_types; one line when none does."""
    kinds, n = list(tc.layer_types), tc.num_hidden_layers
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    k = full[0] + 1 if full and full[0] != n - 1 else n + 1
    want = ["sliding_attention" if (i + 1) % k and i != n - 1 else "full_attention" for i in range(n)]
    if kinds != want:
        _fail("text_config.layer_types", f"{kinds[:8]}...: only every k-th layer global, the last global")
    return k


def _rope(tc) -> tuple[float, float, float]:
    """(full layers' theta, their rotated fraction, sliding layers' theta)."""
    params = tc.rope_parameters or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    if local.get("rope_type", "default") != "default" or float(local.get("factor", 1.0)) != 1.0:
        _fail("text_config.rope_parameters.sliding_attention", f"{local}: only default RoPE")
    kind = full.get("rope_type", "default")
    if kind not in ("default", "proportional") or float(full.get("factor", 1.0)) != 1.0:
        _fail("text_config.rope_parameters.full_attention", f"rope_type '{kind}' (supported: proportional, default)")
    fraction = float(full.get("partial_rotary_factor", 1.0)) if kind == "proportional" else 1.0
    return float(full.get("rope_theta", 1e6)), fraction, float(local.get("rope_theta", 1e4))


def _refusals(hf) -> None:
    vc, tc = hf.vision_config, hf.text_config
    if vc is None:
        _fail("vision_config", "none: the gemma4 family is image and text (a text-only Gemma 4 is not read)")
    if tc.enable_moe_block and not all((tc.num_experts, tc.top_k_experts, tc.moe_intermediate_size)):
        _fail("text_config.enable_moe_block", f"true with num_experts {tc.num_experts}, top_k_experts "
                                             f"{tc.top_k_experts}, moe_intermediate_size {tc.moe_intermediate_size}: "
                                             f"all three must be set (>= 1)")
    if tc.use_bidirectional_attention == "all":
        _fail("text_config.use_bidirectional_attention", "'all': only the causal decoder is implemented")
    for where, act in (("vision_config.hidden_activation", vc.hidden_activation),
                       ("text_config.hidden_activation", tc.hidden_activation)):
        if act != "gelu_pytorch_tanh":
            _fail(where, f"'{act}' is not supported (gelu_pytorch_tanh)")
    if (vc.rope_parameters or {}).get("rope_type", "axial") != "axial":
        _fail("vision_config.rope_parameters", "only axial 2-D RoPE")


def square_side(vc, max_soft_tokens: int) -> int:
    """The tower's square image in px: what transformers' Gemma4ImageProcessor makes of a square image at its
    soft-token budget, floor(sqrt(budget)) pooled tokens a side (280 -> 16: 16 x 3 x 16 = 768 px, 256 tokens),
    capped by the position table (a side of at most position_embedding_size patches)."""
    side = min(math.isqrt(max_soft_tokens), vc.position_embedding_size // vc.pooling_kernel_size)
    return side * vc.pooling_kernel_size * vc.patch_size


def aspect_budget(vc, max_soft_tokens: int) -> int:
    """vision.max_soft_tokens of the import: the processor's budget, so that images keep their aspect ratio as
    transformers' Gemma4ImageProcessor makes them, where the position table holds the longest side it can make
    (budget x pool patches: 280 x 3 = 840 <= 10240 in the released models); else 0, the fixed square (a table
    smaller than that, e.g. the tests' 6 entries, would index past its end)."""
    fits = max_soft_tokens * vc.pooling_kernel_size <= vc.position_embedding_size
    return max_soft_tokens if fits and max_soft_tokens in SOFT_TOKEN_BUDGETS else 0


def moe_from_hf(tc) -> MoeConfig | None:
    """enable_moe_block's experts (every layer's; None: dense). aux_coef 0: transformers' Gemma 4 adds no
    load-balancing loss (a model JSON may set one); its router always renormalises its top k."""
    if not tc.enable_moe_block:
        return None
    return MoeConfig(experts=int(tc.num_experts), top_k=int(tc.top_k_experts), ff_dim=int(tc.moe_intermediate_size),
                     aux_coef=0.0)


def config_from_hf(hf, name: str = "hf", max_soft_tokens: int = 280) -> ModelConfig:
    """A Gemma4Config -> the mmpipe config, the tower at square_side px, images of any aspect ratio within
    max_soft_tokens where the position table holds them (aspect_budget); one line for what the layers do not
    implement."""
    _refusals(hf)
    vc, tc = hf.vision_config, hf.text_config
    theta, fraction, local = _rope(tc)
    layer = tc.per_layer_config
    full_i = tc.layer_types.index("full_attention")
    local_i = tc.layer_types.index("sliding_attention") if "sliding_attention" in tc.layer_types else full_i
    vision = Gemma4Vision(
        image_size=square_side(vc, max_soft_tokens), patch_size=vc.patch_size,
        dim=vc.hidden_size, n_layers=vc.num_hidden_layers, n_heads=vc.num_attention_heads,
        ff_dim=vc.intermediate_size, ln_eps=vc.rms_norm_eps, n_kv_heads=vc.num_key_value_heads,
        head_dim=vc.head_dim, pool=vc.pooling_kernel_size, position_table=vc.position_embedding_size,
        rope_theta=float(vc.rope_parameters.get("rope_theta", 100.0)), clipped=bool(vc.use_clipped_linears),
        standardize=bool(vc.standardize), max_soft_tokens=aspect_budget(vc, max_soft_tokens))
    text = Gemma4Text(
        dim=tc.hidden_size, n_layers=tc.num_hidden_layers, n_heads=tc.num_attention_heads, ff_dim=tc.intermediate_size,
        vocab_size=tc.vocab_size, max_context=tc.max_position_embeddings, rope_theta=theta, ln_eps=tc.rms_norm_eps,
        n_kv_heads=layer[local_i].num_key_value_heads, attn_head_dim=layer[local_i].head_dim,
        qkv_bias=bool(tc.attention_bias),
        tie_embeddings=tie_flag(hf), sliding_window=int(tc.sliding_window), sliding_pattern=_pattern(tc),
        local_rope_theta=local, global_head_dim=layer[full_i].head_dim,
        global_kv_heads=layer[full_i].num_key_value_heads, k_eq_v=bool(tc.attention_k_eq_v),
        global_rotary_factor=fraction, ple_dim=int(tc.hidden_size_per_layer_input or 0),
        ple_vocab=int(tc.vocab_size_per_layer_input or 0), kv_shared_layers=int(tc.num_kv_shared_layers),
        double_wide_mlp=bool(tc.use_double_wide_mlp), final_softcap=float(tc.final_logit_softcapping or 0.0),
        bidirectional_vision=tc.use_bidirectional_attention == "vision", pad_id=int(tc.pad_token_id or 0),
        moe=moe_from_hf(tc))
    cfg = ModelConfig(name=name, family="gemma4", vision=vision, text=text, proj_inner_dim=tc.hidden_size,
                      image_token_id=int(hf.image_token_id), vision_start_id=int(hf.boi_token_id),
                      vision_end_id=int(hf.eoi_token_id))
    cfg.validate()
    return cfg


def hf_config(cfg: ModelConfig, tok=None):
    """The mmpipe config -> the Gemma4Config of its export (no audio tower), tok's special ids (llava.token_ids)."""
    from transformers import Gemma4Config, Gemma4TextConfig, Gemma4VisionConfig
    v, t = cfg.vision, cfg.text
    vision = Gemma4VisionConfig(
        hidden_size=v.dim, intermediate_size=v.ff_dim, num_hidden_layers=v.n_layers, num_attention_heads=v.n_heads,
        num_key_value_heads=v.kv_heads, head_dim=v.attn_head_dim, rms_norm_eps=v.ln_eps, pooling_kernel_size=v.pool,
        patch_size=v.patch_size, position_embedding_size=v.position_table, use_clipped_linears=v.clipped,
        standardize=v.standardize,
        rope_parameters={"rope_type": "axial", "rope_theta": v.rope_theta})
    ids = {k: val for k, val in token_ids(tok, t.vocab_size).items() if val is not None}
    ids.setdefault("pad_token_id", t.pad_id)
    text = Gemma4TextConfig(
        vocab_size=t.vocab_size, hidden_size=t.dim, intermediate_size=t.ff_dim, num_hidden_layers=t.n_layers,
        num_attention_heads=t.n_heads, num_key_value_heads=t.kv_heads, head_dim=t.head_dim,
        global_head_dim=t.layer_head_dim(False), num_global_key_value_heads=t.global_kv_heads or None,
        attention_k_eq_v=t.k_eq_v, max_position_embeddings=t.max_context, rms_norm_eps=t.ln_eps,
        attention_bias=t.qkv_bias, sliding_window=t.sliding_window,
        layer_types=["sliding_attention" if t.is_sliding(i) else "full_attention" for i in range(t.n_layers)],
        rope_parameters={"sliding_attention": {"rope_type": "default", "rope_theta": t.local_rope_theta},
                         "full_attention": {"rope_type": "proportional", "rope_theta": t.rope_theta,
                                            "partial_rotary_factor": t.global_rotary_factor}},
        hidden_size_per_layer_input=t.ple_dim, vocab_size_per_layer_input=t.ple_vocab or t.vocab_size,
        num_kv_shared_layers=t.kv_shared_layers, use_double_wide_mlp=t.double_wide_mlp,
        final_logit_softcapping=t.final_softcap or None,
        use_bidirectional_attention="vision" if t.bidirectional_vision else None,
        tie_word_embeddings=t.tie_embeddings, **moe_fields(t), **ids)
    return Gemma4Config(vision_config=vision, text_config=text, audio_config=None,
                        image_token_id=cfg.image_token_id, boi_token_id=cfg.vision_start_id,
                        eoi_token_id=cfg.vision_end_id, tie_word_embeddings=t.tie_embeddings)


def moe_fields(t: Gemma4Text) -> dict:
    """moe_from_hf's inverse (aux_coef has no field: transformers' Gemma 4 has no load-balancing loss)."""
    if t.moe is None:
        return {"enable_moe_block": False}
    return dict(enable_moe_block=True, num_experts=t.moe.experts, top_k_experts=t.moe.top_k,
                moe_intermediate_size=t.moe.ff_dim)


def plan(cfg: ModelConfig, source, where: str) -> tuple[dict[str, str], ImportReport]:
    """(mmpipe name -> source name, report): an audio tower reported unused, every other tensor mapped."""
    view = Renamed(source, lambda n: n)
    unused = [view.names.pop(n) for n in [n for n in view.names if n.startswith(UNUSED)]]
    assign, report = plan_named(cfg, view, where, key_map(cfg), HF_CLASSES["gemma4"])
    report.unused += unused
    return {m: view.names[h] for m, h in assign.items()}, report


def hf_gemma4_config(path: str | Path, notes: list[str] | None = None):
    """An HF Gemma 4 directory's (HF config, mmpipe config); no weight is read."""
    path = Path(path)
    hf = read_hf_config(path, tuple(HF_CLASSES), notes)
    budget = int(processor_settings(path)[0].get("max_soft_tokens") or 280)
    cfg, read = with_video_settings(config_from_hf(hf, path.name, budget), path, SOFT_TOKEN_BUDGETS)
    cfg.validate()
    v = cfg.vision
    if notes is not None and read:
        notes.append(read)
    if notes is not None and not v.max_soft_tokens:  # the square: say why images lose their aspect ratio
        notes.append(f"images read as a fixed {v.image_size}-px square: the {v.position_table}-entry position table "
                     f"cannot hold the sides of up to {budget} x {v.pool} patches that max_soft_tokens {budget} makes")
    return hf, cfg


def read_gemma4(path: str | Path) -> Imported:
    """An HF Gemma4ForConditionalGeneration directory, decided from its config and tensor headers."""
    path, notes = Path(path), []
    _, cfg = hf_gemma4_config(path, notes)
    source = open_weights(path)
    assign, report = plan(cfg, source, str(path))
    report.notes += notes
    return Imported(cfg, assign, source, report)


def import_gemma4(path: str | Path, dtype=torch.float32):
    """An HF Gemma4ForConditionalGeneration directory -> (mmpipe single-device model, report)."""
    got = read_gemma4(path)
    return got.model(dtype), got.report


def export_hf(source, out: str | Path, tok=None, shard_size=None) -> Path:
    """An HF directory from_pretrained loads (config.json, generation_config.json, the weights sharded, one layer in
    memory at a time: mmpipe.hf.export.write_hf), and, where the images keep their aspect ratio, transformers'
    Gemma4ImageProcessor at the model's budget and Gemma4VideoProcessor at its clips' settings (video_config: fps,
    num_frames, max_soft_tokens), so a re-import and Gemma4Processor read images and clips as the run did."""
    out = write_hf(source, out, hf_config(source.cfg, tok), key_map(source.cfg), shard_size=shard_size)
    v = source.cfg.vision
    if v.max_soft_tokens:  # a fixed square reads no clips (mmpipe.data.gemma4): no video processor either
        from transformers import Gemma4ImageProcessor, Gemma4VideoProcessor
        Gemma4ImageProcessor(patch_size=v.patch_size, max_soft_tokens=v.max_soft_tokens,
                             pooling_kernel_size=v.pool).save_pretrained(out)
        Gemma4VideoProcessor(patch_size=v.patch_size, pooling_kernel_size=v.pool,
                             **video_kwargs(source.cfg)).save_pretrained(out)
    return out
