"""InternVL3.5 in and out of Hugging Face: InternVLForConditionalGeneration directories (model_type "internvl", a
Qwen3 or Qwen3-MoE text config) <-> mmpipe's internvl layer list (mmpipe.model.internvl).

Names: "<layer index>.<sub-name>" <-> transformers', one prefix per layer class, e.g. for a 2-block tower:

    0.cls_token                          <->  model.vision_tower.embeddings.cls_token
    1.attention.q_norm.weight            <->  model.vision_tower.encoder.layer.0.attention.q_norm.weight
    3.linear_1.weight                    <->  model.multi_modal_projector.linear_1.weight
    5.self_attn.k_norm.weight            <->  model.language_model.layers.0.self_attn.k_norm.weight
    9.mlp.experts.gate_up_proj           <->  model.language_model.layers.0.mlp.experts.gate_up_proj (Qwen3-MoE)

Every source tensor is mapped (a tied lm_head must equal the input embedding) or the import fails naming it; so
does a missing or misshapen one. The <img> / </img> ids, which the config does not hold, come from the directory's
tokenizer, else InternVL-HF's layout (<img>, </img>, <IMG_CONTEXT> consecutive: image_token_id - 2, - 1), said in a
note. The tiles (size, min / max patches, mean, std) come from its preprocessor_config.json; an export writes
transformers' GotOcr2ImageProcessor with crop_to_patches, as InternVLProcessor runs it. The clips' sampling (fps,
num_frames) comes from its video_preprocessor_config.json (mmpipe.hf.video_config); an export writes
InternVLVideoProcessor with them.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

import torch

from ..config import ModelConfig
from ..model.builder import ReferenceModel
from ..model.internvl import (
    InternBlock,
    InternEmbed,
    InternMoeBlock,
    InternPatchEmbed,
    InternProjector,
    InternText,
    InternVision,
    InternVisionBlock,
)
from ..model.llava import FinalNorm, LMHeadLinear
from ..model.moe import MoeHead
from .export import write_hf
from .llava import ImportReport, _fail, processor_defaults, processor_settings, read_hf_config, tie_flag
from .moe import PerExpert, expert_layout, moe_from_hf
from .qwen2_vl import plan_named
from .safetensors_io import open_weights
from .stream import Imported, meta_model
from .video_config import video_kwargs, with_video_settings

HF_CLASS = "InternVLForConditionalGeneration"
TEXT_TYPES = ("qwen3", "qwen3_moe")
ACTS = {"gelu": "gelu", "gelu_pytorch_tanh": "gelu_tanh"}  # transformers' tower activations -> mmpipe's
IMAGENET = ((0.485, 0.456, 0.406), (0.229, 0.224, 0.225))  # InternVL's image_mean / image_std
TILES = (448, 1, 12)  # InternVL3.5's tile side and min / max tiles, taken where the directory gives none


def _prefix(layer, k: int) -> str:
    """The HF prefix of the k-th layer of its class."""
    return {InternPatchEmbed: "model.vision_tower.embeddings.",
            InternVisionBlock: f"model.vision_tower.encoder.layer.{k}.",
            InternProjector: "model.multi_modal_projector.", InternEmbed: "model.language_model.",
            InternBlock: f"model.language_model.layers.{k}.", InternMoeBlock: f"model.language_model.layers.{k}.",
            FinalNorm: "model.language_model.", LMHeadLinear: "", MoeHead: ""}[type(layer)]


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """mmpipe name -> HF name for every weight of the mmpipe model (a tied head has none of its own)."""
    out, seen = {}, {}
    for i, layer in enumerate(meta_model(cfg)):
        if not layer.state_dict():
            continue
        k = seen.get(type(layer), 0)
        seen[type(layer)] = k + 1
        out.update({f"{i}.{sub}": _prefix(layer, k) + sub for sub in layer.state_dict()})
    return out


# the layout transformers' save_pretrained writes (its llava conversion mapping, reversed on save) -> the model's names
LEGACY = (("language_model.lm_head.", "lm_head."), ("language_model.model.", "model.language_model."),
          ("vision_tower.", "model.vision_tower."), ("multi_modal_projector.", "model.multi_modal_projector."))


def canonical(name: str) -> str:
    """A source tensor's name as the key map spells it (either layout)."""
    for old, new in LEGACY:
        if name.startswith(old):
            return new + name[len(old):]
    return name


def _refusals(hf) -> None:
    """What mmpipe's layers do not implement, one line each (the first found)."""
    vc, tc = hf.vision_config, hf.text_config
    checks = [
        (tc.model_type in TEXT_TYPES, "text_config.model_type",
         f"'{tc.model_type}' (supported: {', '.join(TEXT_TYPES)}: InternVL3.5's decoders)"),
        (float(hf.downsample_ratio) == 0.5, "downsample_ratio", f"{hf.downsample_ratio} (supported: 0.5)"),
        (hf.vision_feature_layer == -1, "vision_feature_layer", f"{hf.vision_feature_layer} (supported: -1)"),
        (hf.vision_feature_select_strategy == "default", "vision_feature_select_strategy",
         f"'{hf.vision_feature_select_strategy}' (supported: default, the class token dropped)"),
        (hf.projector_hidden_act == "gelu", "projector_hidden_act", f"'{hf.projector_hidden_act}' (supported: gelu)"),
        (vc.hidden_act in ACTS, "vision_config.hidden_act", f"'{vc.hidden_act}' (supported: {', '.join(ACTS)})"),
        (vc.use_mean_pooling and vc.use_absolute_position_embeddings, "vision_config.use_mean_pooling",
         "false (or no absolute positions): the tower's last LayerNorm / no position table is not supported"),
        (tuple(vc.image_size)[0] == tuple(vc.image_size)[1] and tuple(vc.patch_size)[0] == tuple(vc.patch_size)[1],
         "vision_config.image_size", f"{list(vc.image_size)} / patch {list(vc.patch_size)}: square tiles only"),
        (not getattr(tc, "attention_bias", False), "text_config.attention_bias", "true: Qwen3's attention has none"),
        (not getattr(tc, "use_sliding_window", False), "text_config.use_sliding_window", "true is not supported"),
        (tc.hidden_act == "silu", "text_config.hidden_act", f"'{tc.hidden_act}' (supported: silu)"),
        ((getattr(tc, "rope_parameters", None) or {}).get("rope_type", "default") == "default",
         "text_config.rope_parameters", "RoPE scaling is not supported (rope_type default only)"),
    ]
    for ok, where, msg in checks:
        if not ok:
            _fail(where, msg)


def _text(hf) -> InternText:
    tc = hf.text_config
    head_dim = getattr(tc, "head_dim", None) or tc.hidden_size // tc.num_attention_heads
    moe = moe_from_hf(tc)
    if moe is not None:  # Qwen3-MoE's router renormalises its top k only by norm_topk_prob (Qwen3-30B-A3B: true)
        moe = dataclasses.replace(moe, norm_topk=bool(getattr(tc, "norm_topk_prob", False)))
    return InternText(
        dim=tc.hidden_size, n_layers=tc.num_hidden_layers, n_heads=tc.num_attention_heads, ff_dim=tc.intermediate_size,
        vocab_size=tc.vocab_size, max_context=tc.max_position_embeddings, partial_rotary_factor=1.0,
        rope_theta=float((getattr(tc, "rope_parameters", None) or {}).get("rope_theta", 1000000.0)),
        ln_eps=tc.rms_norm_eps, n_kv_heads=tc.num_key_value_heads, tie_embeddings=tie_flag(hf), qk_norm=True, moe=moe,
        attn_head_dim=0 if head_dim * tc.num_attention_heads == tc.hidden_size else head_dim)


def _vision(hf, proc: dict) -> InternVision:
    vc = hf.vision_config
    size = proc.get("size") or {}
    tile = int(size.get("height", TILES[0])) if isinstance(size, dict) else TILES[0]
    if tile != tuple(vc.image_size)[0]:
        _fail("preprocessor_config.json", f"size {tile} px is not the tower's image_size {tuple(vc.image_size)[0]}")
    return InternVision(
        image_size=tile, patch_size=tuple(vc.patch_size)[0], dim=vc.hidden_size, n_layers=vc.num_hidden_layers,
        n_heads=vc.num_attention_heads, ff_dim=vc.intermediate_size, channels=vc.num_channels,
        mean=tuple(proc.get("image_mean") or IMAGENET[0]), std=tuple(proc.get("image_std") or IMAGENET[1]),
        ln_eps=vc.layer_norm_eps, act=ACTS[vc.hidden_act], norm=vc.norm_type, qk_norm=bool(vc.use_qk_norm),
        attn_bias=bool(vc.attention_bias), layer_scale=float(vc.layer_scale_init_value),
        min_tiles=int(proc.get("min_patches") or TILES[1]), max_tiles=int(proc.get("max_patches") or TILES[2]))


def config_from_hf(hf, name: str = "hf", proc: dict | None = None, brackets: tuple[int, int] | None = None
                   ) -> ModelConfig:
    """An InternVLConfig (+ its image processor's settings, the <img> / </img> ids) -> the mmpipe config; refuses
    what the layers do not implement, one line."""
    _refusals(hf)
    start, end = brackets or (hf.image_token_id - 2, hf.image_token_id - 1)
    cfg = ModelConfig(name=name, family="internvl", vision=_vision(hf, proc or {}), text=_text(hf),
                      proj_inner_dim=hf.text_config.hidden_size, image_token_id=hf.image_token_id,
                      vision_start_id=start, vision_end_id=end)
    cfg.validate()
    return cfg


def _brackets(path: Path, notes: list[str]) -> tuple[int, int] | None:
    """(<img>, </img>) ids from the directory's tokenizer; None (and a note) without one that has them."""
    try:
        from transformers import AutoTokenizer
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True)
        ids = [tok.convert_tokens_to_ids(t) for t in ("<img>", "</img>")]
        if all(isinstance(i, int) and i != tok.unk_token_id for i in ids):
            return ids[0], ids[1]
    except Exception:  # no tokenizer, or one transformers cannot read: the layout's ids, said below
        pass
    notes.append("no tokenizer with <img> / </img>: took InternVL-HF's ids, image_token_id - 2 and - 1")
    return None


def hf_internvl_config(path: str | Path, notes: list[str] | None = None):
    """An HF InternVL directory's (HF config, mmpipe config); no weight is read (but llava.settle_tie's two)."""
    path, notes = Path(path), notes if notes is not None else []
    hf = read_hf_config(path, ("internvl",), notes)
    cfg, read = with_video_settings(config_from_hf(hf, path.name, processor_settings(path)[0],
                                                   _brackets(path, notes)), path)
    cfg.validate()
    notes += [read] if read else []
    return hf, cfg


def _defaults_taken(proc: dict) -> tuple[list[str], list[str]]:
    keys = [k for k in ("image_mean", "image_std", "max_patches") if not proc.get(k)]
    return keys, [f"InternVL's {' / '.join(keys)}"] if keys else []


def read_internvl(path: str | Path) -> Imported:
    """An HF InternVLForConditionalGeneration directory, decided from its config and tensor headers (no weight
    read yet): save it layer by layer (Imported.save) or as a model (Imported.model)."""
    path, notes = Path(path), []
    _, cfg = hf_internvl_config(path, notes)
    source = expert_layout(PerExpert(open_weights(path)), cfg)  # Qwen3-MoE's experts: saved one module each, fused here
    assign, report = plan_named(cfg, source, str(path), key_map(cfg), HF_CLASS, rename=canonical)
    report.notes += notes + processor_defaults(path, _defaults_taken)
    return Imported(cfg, assign, source, report)


def import_internvl(path: str | Path, dtype=torch.float32) -> tuple[ReferenceModel, ImportReport]:
    got = read_internvl(path)
    return got.model(dtype), got.report


def _hf_text(cfg: ModelConfig, tok) -> dict:
    from .llava import token_ids
    t = cfg.text
    text = dict(model_type="qwen3_moe" if t.moe else "qwen3", hidden_size=t.dim, intermediate_size=t.ff_dim,
                num_hidden_layers=t.n_layers, num_attention_heads=t.n_heads, num_key_value_heads=t.kv_heads,
                head_dim=t.head_dim, vocab_size=t.vocab_size, max_position_embeddings=t.max_context,
                rms_norm_eps=t.ln_eps, tie_word_embeddings=t.tie_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta}, **token_ids(tok, t.vocab_size))
    if t.moe:
        m = t.moe
        if m.shared_ff_dim:
            _fail("text.moe.shared_ff_dim", f"{m.shared_ff_dim}: transformers' Qwen3Moe has no shared expert")
        text.update(num_experts=m.experts, num_experts_per_tok=m.top_k, moe_intermediate_size=m.ff_dim,
                    router_aux_loss_coef=m.aux_coef, norm_topk_prob=m.norm_topk, decoder_sparse_step=1,
                    mlp_only_layers=[])
    return text


def hf_config(cfg: ModelConfig, tok=None):
    """mmpipe internvl config -> transformers' InternVLConfig, with tok's special ids in its text config."""
    from transformers import InternVLConfig
    v, t = cfg.vision, cfg.text
    act = {mine: theirs for theirs, mine in ACTS.items()}[v.act]
    vision = dict(hidden_size=v.dim, num_hidden_layers=v.n_layers, num_attention_heads=v.n_heads,
                  intermediate_size=v.ff_dim, image_size=v.image_size, patch_size=v.patch_size, num_channels=v.channels,
                  hidden_act=act, norm_type=v.norm, use_qk_norm=v.qk_norm, attention_bias=v.attn_bias,
                  layer_norm_eps=v.ln_eps, layer_scale_init_value=v.layer_scale)
    return InternVLConfig(vision_config=vision, text_config=_hf_text(cfg, tok), image_token_id=cfg.image_token_id,
                          image_seq_length=v.n_features, downsample_ratio=0.5, vision_feature_layer=-1,
                          vision_feature_select_strategy="default", projector_hidden_act="gelu",
                          tie_word_embeddings=t.tie_embeddings)


def image_processor(cfg: ModelConfig):
    """transformers' GotOcr2ImageProcessor at the model's tiles, mean and std (mmpipe.data.internvl's)."""
    from ..data.internvl import hf_image_processor, intern_rule
    return hf_image_processor(intern_rule(cfg))


def saved_layout(names: dict[str, str]) -> dict[str, str]:
    """A key map in the layout transformers' save_pretrained writes (LEGACY's first names): what a per-expert write
    compares with transformers' own reverted state."""
    def saved(name: str) -> str:
        for old, new in LEGACY:
            if name.startswith(new):
                return old + name[len(new):]
        return name
    return {mine: saved(theirs) for mine, theirs in names.items()}


def export_hf(source, out: str | Path, tok=None, shard_size=None) -> Path:
    """Write an HF directory (config.json, the weights sharded, its image processor) that from_pretrained loads, one
    layer in memory at a time; source: a model or a run's layers (mmpipe.hf.stream). A Qwen3-MoE decoder's experts
    are written one module each, as transformers' save_pretrained writes them (mmpipe.hf.qwen3_5.write_per_expert)."""
    hf, names = hf_config(source.cfg, tok), key_map(source.cfg)
    if source.cfg.text.moe:
        from .qwen3_5 import write_per_expert
        out = write_per_expert(source, out, hf, saved_layout(names), shard_size)
    else:
        out = write_hf(source, out, hf, names, shard_size=shard_size)
    image_processor(source.cfg).save_pretrained(out)
    video_processor(source.cfg).save_pretrained(out)
    return out


def video_processor(cfg: ModelConfig):
    """transformers' InternVLVideoProcessor as the run reads clips (mmpipe.data.internvl.video_processor: the tile
    size, mean, std) with its sampling settings (video_config: fps, num_frames)."""
    from transformers import InternVLVideoProcessor
    v = cfg.vision
    return InternVLVideoProcessor(size={"height": v.image_size, "width": v.image_size}, image_mean=list(v.mean),
                                  image_std=list(v.std), **video_kwargs(cfg))
