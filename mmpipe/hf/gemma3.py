"""Gemma 3 in and out of Hugging Face: Gemma3ForConditionalGeneration directories (model_type gemma3) <->
mmpipe's layer list (mmpipe.model.gemma3).

Names, a prefix per layer (mmpipe's "<layer index>.<sub>" where the sub-name is HF's module name):

    VisionEmbed        model.vision_tower.embeddings.*          (older saves: vision_tower.vision_model.*)
    TowerBlock k       model.vision_tower.encoder.layers.k.*
    Gemma3Projector    post_layernorm.* -> model.vision_tower.post_layernorm.*, the rest model.multi_modal_projector.*
    Gemma3Embed        model.language_model.embed_tokens.weight (older: language_model.model.*)
    Gemma3(Sliding)Block k  model.language_model.layers.k.*
    Gemma3FinalNorm    model.language_model.norm.weight
    LMHeadLinear       lm_head.weight (a tied head has none: the embedding's)

SigLIP's pooling head (model.vision_tower.head.*, which Gemma 3 never runs) is reported unused. What the layers do
not implement is refused in one line: logit soft-capping (Gemma 2's; every released Gemma 3 config has none),
bidirectional text attention (EmbeddingGemma), RoPE other than default / linear, a layer pattern other than
"every k-th layer global". Export writes the same config back (no SigLIP head), and the directory's image processor
(transformers' Gemma3ImageProcessor at the model's size and statistics, and its pan-and-scan settings: import reads
do_pan_and_scan and its three pan_and_scan_* numbers from the directory's processor config).
"""
from __future__ import annotations

import re
from pathlib import Path

import torch

from ..config import ConfigError, ModelConfig
from ..model.gemma3 import Gemma3Block, Gemma3Embed, Gemma3FinalNorm, Gemma3Projector, Gemma3Text, Gemma3Vision
from ..model.llava import LMHeadLinear, TowerBlock, VisionEmbed
from .export import write_hf
from .llava import ImportReport, processor_settings, read_hf_config, tie_flag, token_ids
from .qwen2_vl import plan_named
from .safetensors_io import Renamed, open_weights
from .stream import Imported, meta_model

HF_CLASSES = {"gemma3": "Gemma3ForConditionalGeneration"}
TOWER, LM = "model.vision_tower.", "model.language_model."
LEGACY = [(r"^language_model\.model\.", LM), (r"^language_model\.lm_head\.", "lm_head."),
          (r"^vision_tower\.vision_model\.", TOWER), (r"^model\.vision_tower\.vision_model\.", TOWER),
          (r"^vision_tower\.", TOWER), (r"^multi_modal_projector\.", "model.multi_modal_projector.")]
UNUSED = (TOWER + "head.",)  # SigLIP's pooling head


def _fail(where: str, msg: str):
    raise ConfigError(f"{where}: {msg}")


def canonical(name: str) -> str:
    """A source name in the installed transformers' layout (older saves' prefixes renamed)."""
    for pat, new in LEGACY:
        if re.match(pat, name):
            return re.sub(pat, new, name)
    return name


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """mmpipe name -> HF name for every weight of the mmpipe model."""
    out, seen = {}, {}
    for i, layer in enumerate(meta_model(cfg)):
        kind = Gemma3Block if isinstance(layer, Gemma3Block) else type(layer)  # sliding blocks count as blocks
        k = seen.get(kind, 0)
        seen[kind] = k + 1
        for sub in layer.state_dict():
            if isinstance(layer, VisionEmbed):
                hf = TOWER + "embeddings." + sub
            elif isinstance(layer, TowerBlock):
                hf = f"{TOWER}encoder.layers.{k}.{sub}"
            elif isinstance(layer, Gemma3Projector):
                hf = (TOWER if sub.startswith("post_layernorm") else "model.multi_modal_projector.") + sub
            elif isinstance(layer, (Gemma3Embed, Gemma3FinalNorm)):
                hf = LM + sub
            elif isinstance(layer, Gemma3Block):
                hf = f"{LM}layers.{k}.{sub}"
            elif isinstance(layer, LMHeadLinear):
                hf = sub
            else:
                raise ValueError(f"layer {i} ({type(layer).__name__}) has no Gemma 3 name")
            out[f"{i}.{sub}"] = hf
    return out


def _pattern(tc) -> int:
    """The k of "every k-th layer global" that gives tc.layer_types; one line when no k does."""
    kinds = list(tc.layer_types)
    full = [i for i, kind in enumerate(kinds) if kind == "full_attention"]
    k = full[0] + 1 if full else len(kinds) + 1
    want = ["sliding_attention" if (i + 1) % k else "full_attention" for i in range(len(kinds))]
    if kinds != want or len(kinds) != tc.num_hidden_layers:
        _fail("text_config.layer_types", f"{kinds[:8]}...: only every k-th layer global (Gemma 3's 5 sliding : 1)")
    return k


def _rope(tc) -> tuple[float, float, float]:
    """(global theta, its linear factor, the sliding layers' theta) from rope_parameters per layer type."""
    params = tc.rope_parameters or {}
    full, local = params.get("full_attention") or {}, params.get("sliding_attention") or {}
    for name, p in (("full_attention", full), ("sliding_attention", local)):
        if p.get("rope_type", "default") not in ("default", "linear"):
            _fail(f"text_config.rope_parameters.{name}", f"rope_type '{p['rope_type']}' (supported: default, linear)")
    factor = float(full.get("factor", 1.0)) if full.get("rope_type") == "linear" else 1.0
    local_factor = float(local.get("factor", 1.0)) if local.get("rope_type") == "linear" else 1.0
    if local_factor != 1.0:
        _fail("text_config.rope_parameters.sliding_attention", "linear scaling of the sliding layers is not supported")
    return float(full.get("rope_theta", 1e6)), factor, float(local.get("rope_theta", 1e4))


def _refusals(hf) -> None:
    vc, tc = hf.vision_config, hf.text_config
    if vc.model_type != "siglip_vision_model":
        _fail("vision_config", f"model_type '{vc.model_type}' (Gemma 3's tower: siglip_vision_model)")
    for where, act in (("vision_config.hidden_act", vc.hidden_act), ("text_config.hidden_activation",
                                                                     tc.hidden_activation)):
        if act != "gelu_pytorch_tanh":
            _fail(where, f"'{act}' is not supported (gelu_pytorch_tanh)")
    for name in ("attn_logit_softcapping", "final_logit_softcapping"):
        if getattr(tc, name, None) is not None:
            _fail(f"text_config.{name}", f"{getattr(tc, name)}: logit soft-capping is not implemented (Gemma 3 "
                                         f"releases have none)")
    if getattr(tc, "use_bidirectional_attention", False):
        _fail("text_config.use_bidirectional_attention", "true: only the causal decoder is implemented")


def config_from_hf(hf, name: str = "hf", proc: dict | None = None) -> ModelConfig:
    """A Gemma3Config (+ its image processor's settings: mean, std) -> the mmpipe config; one line for what the
    layers do not implement."""
    _refusals(hf)
    vc, tc, proc = hf.vision_config, hf.text_config, proc or {}
    theta, factor, local = _rope(tc)
    vision = Gemma3Vision(
        image_size=vc.image_size, patch_size=vc.patch_size, dim=vc.hidden_size, n_layers=vc.num_hidden_layers,
        n_heads=vc.num_attention_heads, ff_dim=vc.intermediate_size, channels=vc.num_channels,
        mean=tuple(proc.get("image_mean") or (0.5,) * 3), std=tuple(proc.get("image_std") or (0.5,) * 3),
        ln_eps=vc.layer_norm_eps, kind="siglip", act="gelu_tanh", mm_tokens=int(hf.mm_tokens_per_image),
        **pan_and_scan(proc))
    text = Gemma3Text(
        dim=tc.hidden_size, n_layers=tc.num_hidden_layers, n_heads=tc.num_attention_heads, ff_dim=tc.intermediate_size,
        vocab_size=tc.vocab_size, max_context=tc.max_position_embeddings, rope_theta=theta, ln_eps=tc.rms_norm_eps,
        n_kv_heads=tc.num_key_value_heads, attn_head_dim=tc.head_dim, qkv_bias=bool(tc.attention_bias),
        tie_embeddings=tie_flag(hf), sliding_window=int(tc.sliding_window), sliding_pattern=_pattern(tc),
        local_rope_theta=local, rope_factor=factor, query_pre_attn_scalar=int(tc.query_pre_attn_scalar))
    cfg = ModelConfig(name=name, family="gemma3", vision=vision, text=text, proj_inner_dim=tc.hidden_size,
                      image_token_id=int(hf.image_token_id), vision_start_id=int(hf.boi_token_index),
                      vision_end_id=int(hf.eoi_token_index))
    cfg.validate()
    return cfg


def pan_and_scan(proc: dict) -> dict:
    """The image processor's pan-and-scan settings as Gemma3Vision's fields; a setting its file leaves null (every
    released Gemma 3's) takes Gemma3Processor's default (its images_kwargs: off, 256 px, 4 crops, ratio 1.2)."""
    from transformers import Gemma3Processor
    default = Gemma3Processor.images_kwargs

    def get(key):
        return default[key] if proc.get(key) is None else proc[key]
    return {"pan_and_scan": bool(get("do_pan_and_scan")),
            "pan_and_scan_min_crop": int(get("pan_and_scan_min_crop_size")),
            "pan_and_scan_max_crops": int(get("pan_and_scan_max_num_crops")),
            "pan_and_scan_min_ratio": float(get("pan_and_scan_min_ratio_to_activate"))}


def hf_config(cfg: ModelConfig, tok=None):
    """The mmpipe config -> the Gemma3Config of its export (no SigLIP head), tok's special ids (llava.token_ids)."""
    from transformers import Gemma3Config, Gemma3TextConfig, SiglipVisionConfig
    v, t = cfg.vision, cfg.text
    vision = SiglipVisionConfig(hidden_size=v.dim, intermediate_size=v.ff_dim, num_hidden_layers=v.n_layers,
                                num_attention_heads=v.n_heads, image_size=v.image_size, patch_size=v.patch_size,
                                num_channels=v.channels, hidden_act="gelu_pytorch_tanh", layer_norm_eps=v.ln_eps,
                                vision_use_head=False)
    full = {"rope_type": "default", "rope_theta": t.rope_theta} if t.rope_factor == 1.0 else \
        {"rope_type": "linear", "rope_theta": t.rope_theta, "factor": t.rope_factor}
    text = Gemma3TextConfig(
        vocab_size=t.vocab_size, hidden_size=t.dim, intermediate_size=t.ff_dim, num_hidden_layers=t.n_layers,
        num_attention_heads=t.n_heads, num_key_value_heads=t.kv_heads, head_dim=t.head_dim,
        max_position_embeddings=t.max_context, rms_norm_eps=t.ln_eps, attention_bias=t.qkv_bias,
        query_pre_attn_scalar=t.query_pre_attn_scalar, sliding_window=t.sliding_window,
        layer_types=["sliding_attention" if t.is_sliding(i) else "full_attention" for i in range(t.n_layers)],
        rope_parameters={"full_attention": full,
                         "sliding_attention": {"rope_type": "default", "rope_theta": t.local_rope_theta}},
        tie_word_embeddings=t.tie_embeddings, **token_ids(tok, t.vocab_size))
    return Gemma3Config(vision_config=vision, text_config=text, mm_tokens_per_image=v.mm_tokens,
                        image_token_index=cfg.image_token_id, boi_token_index=cfg.vision_start_id,
                        eoi_token_index=cfg.vision_end_id, tie_word_embeddings=t.tie_embeddings)


def image_processor(cfg: ModelConfig):
    """transformers' Gemma3ImageProcessor at the model's size and statistics (what the processor feeds it), with its
    pan-and-scan settings where the model takes crops (vision.pan_and_scan)."""
    from transformers import Gemma3ImageProcessor
    v = cfg.vision
    crops = {"do_pan_and_scan": True, "pan_and_scan_min_crop_size": v.pan_and_scan_min_crop,
             "pan_and_scan_max_num_crops": v.pan_and_scan_max_crops,
             "pan_and_scan_min_ratio_to_activate": v.pan_and_scan_min_ratio} if v.pan_and_scan else {}
    return Gemma3ImageProcessor(size={"height": v.image_size, "width": v.image_size}, image_mean=list(v.mean),
                                image_std=list(v.std), **crops)


def plan(cfg: ModelConfig, source, where: str) -> tuple[dict[str, str], ImportReport]:
    """(mmpipe name -> source name, report) from the names and shapes: SigLIP's head reported unused, every other
    tensor mapped (mmpipe.hf.qwen2_vl.plan_named), one line for one that fits nothing."""
    view = Renamed(source, canonical)
    unused = [view.names.pop(n) for n in [n for n in view.names if n.startswith(UNUSED)]]
    assign, report = plan_named(cfg, view, where, key_map(cfg), HF_CLASSES["gemma3"])
    report.unused += unused
    return {m: view.names[h] for m, h in assign.items()}, report


def hf_gemma3_config(path: str | Path, notes: list[str] | None = None):
    """An HF Gemma 3 directory's (HF config, mmpipe config); no weight is read (but llava.settle_tie's two)."""
    path = Path(path)
    hf = read_hf_config(path, tuple(HF_CLASSES), notes)
    return hf, config_from_hf(hf, path.name, processor_settings(path)[0])


def read_gemma3(path: str | Path) -> Imported:
    """An HF Gemma3ForConditionalGeneration directory, decided from its config and tensor headers: save it layer by
    layer (Imported.save) or as a model (Imported.model)."""
    path, notes = Path(path), []
    _, cfg = hf_gemma3_config(path, notes)
    source = open_weights(path)
    assign, report = plan(cfg, source, str(path))
    report.notes += notes
    return Imported(cfg, assign, source, report)


def import_gemma3(path: str | Path, dtype=torch.float32):
    """An HF Gemma3ForConditionalGeneration directory -> (mmpipe single-device model, report)."""
    got = read_gemma3(path)
    return got.model(dtype), got.report


def export_hf(source, out: str | Path, tok=None, shard_size=None) -> Path:
    """An HF directory from_pretrained loads (config.json, generation_config.json, the weights sharded, one layer in
    memory at a time: mmpipe.hf.export.write_hf) and its Gemma3ImageProcessor."""
    out = write_hf(source, out, hf_config(source.cfg, tok), key_map(source.cfg), shard_size=shard_size)
    image_processor(source.cfg).save_pretrained(out)
    return out
