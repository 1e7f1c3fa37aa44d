"""Qwen2-VL / Qwen2.5-VL in and out of Hugging Face: Qwen2VLForConditionalGeneration /
Qwen2_5_VLForConditionalGeneration directories <-> mmpipe's layer list (mmpipe.model.qwen2_vl).

Names. mmpipe's single-device model names a weight "<layer index>.<HF sub-name>", so the map is a prefix
per layer, e.g. for a 2-block tower:

    0.proj.weight                <->  model.visual.patch_embed.proj.weight
    2.attn.qkv.weight            <->  model.visual.blocks.1.attn.qkv.weight
    3.mlp.0.weight               <->  model.visual.merger.mlp.0.weight
    5.self_attn.q_proj.bias      <->  model.language_model.layers.0.self_attn.q_proj.bias

Checkpoints in the layout of the Hub's Qwen2-VL releases (visual.*, model.layers.*, model.embed_tokens.*)
are renamed to the installed transformers' first. Every source tensor is mapped (a tied lm_head must
equal the input embedding) or the import fails naming the tensor; so does a missing or misshapen one.
The generation is the HF config's model_type: qwen2_vl (LayerNorm, fc1 / fc2 quick_gelu, full attention)
or qwen2_5_vl (RMSNorm, SwiGLU with bias, window attention outside its fullatt_block_indexes).
"""
from __future__ import annotations

import dataclasses
import json
import math
import re
from pathlib import Path

import torch

from ..config import ModelConfig
from ..model.builder import ReferenceModel
from ..model.llava import FinalNorm, LMHeadLinear
from ..model.qwen2_vl import (
    VISION_THETA,
    MropeText,
    PatchVision,
    Qwen2Vision,
    QwenBlock,
    QwenEmbed,
    QwenMerger,
    QwenPatchEmbed,
    QwenVisionBlock,
)
from ..registry import family_of
from .export import write_hf
from .llava import (
    CLIP_MEAN,
    CLIP_STD,
    ImportReport,
    _fail,
    processor_defaults,
    processor_settings,
    read_hf_config,
    settings_file,
    stats_defaults,
    tie_flag,
    token_ids,
)
from .safetensors_io import as_weights, open_weights, same_tensor
from .stream import Imported, fill, meta_model

HF_CLASSES = {"qwen2_vl": "Qwen2VLForConditionalGeneration", "qwen2_5_vl": "Qwen2_5_VLForConditionalGeneration"}
LEGACY = [(r"^visual\.", "model.visual."), (r"^model\.(?!visual\.|language_model\.)", "model.language_model.")]
# HF name prefix of each layer class; "{}" takes the layer's index among those of its class
PREFIX = {QwenPatchEmbed: "model.visual.patch_embed.", QwenVisionBlock: "model.visual.blocks.{}.",
          QwenMerger: "model.visual.merger.", QwenEmbed: "model.language_model.",
          QwenBlock: "model.language_model.layers.{}.", FinalNorm: "model.language_model.", LMHeadLinear: ""}
DEFAULT_PIXELS = (56 * 56, 28 * 28 * 1280)  # transformers' Qwen2VLImageProcessor's min / max pixels


def model_type(path: str | Path) -> str | None:
    """config.json's model_type, or None when there is none to read (the LLaVA importer then says why)."""
    try:
        kind = json.loads((Path(path) / "config.json").read_text()).get("model_type")
    except (OSError, ValueError, AttributeError):
        return None
    return kind if isinstance(kind, str) else None  # a list or number is no type: transformers' reader says so


def _bounds(proc: dict) -> tuple[int | None, int | None]:
    """The image processor's (min_pixels, max_pixels): its own keys, else its size's shortest / longest edge
    (which newer transformers write); None where it has neither."""
    size = proc.get("size") if isinstance(proc.get("size"), dict) else {}  # older processors: one int
    return proc.get("min_pixels") or size.get("shortest_edge"), proc.get("max_pixels") or size.get("longest_edge")


def _defaults_taken(proc: dict) -> tuple[list[str], list[str]]:
    """(the settings proc lacks, the defaults _vision takes for them in words): for processor_defaults."""
    return pixel_defaults_taken(proc, DEFAULT_PIXELS, clip=True)


def pixel_defaults_taken(proc: dict, pixels: tuple[int, int], clip: bool) -> tuple[list[str], list[str]]:
    """A Qwen family's (settings proc lacks, the defaults taken in words): min / max pixels (the family's
    defaults), then the mean / std (CLIP's, or 0.5's with clip False: mmpipe.hf.llava.stats_defaults)."""
    keys, words = [], []
    for key, got, default in zip(("min_pixels", "max_pixels"), _bounds(proc), pixels):
        if not got:
            keys.append(key)
            words.append(f"{key} {default}")
    more = stats_defaults(proc, clip=clip)
    return keys + more[0], words + more[1]


def _vision(hf, proc: dict) -> Qwen2Vision:
    vc, v25 = hf.vision_config, hf.model_type == "qwen2_5_vl"
    theta = (getattr(vc, "rope_parameters", None) or {}).get("rope_theta", VISION_THETA)
    if theta != VISION_THETA:
        _fail("vision_config.rope_parameters", f"rope_theta {theta}: the tower's 2D rotary uses {VISION_THETA}")
    lo, hi = (int(got or default) for got, default in zip(_bounds(proc), DEFAULT_PIXELS))
    unit = vc.patch_size * vc.spatial_merge_size
    dim = vc.hidden_size if v25 else vc.embed_dim
    return Qwen2Vision(
        image_size=max(unit, math.isqrt(hi) // unit * unit), patch_size=vc.patch_size, dim=dim,
        n_layers=vc.depth, n_heads=vc.num_heads, ff_dim=vc.intermediate_size if v25 else int(dim * vc.mlp_ratio),
        channels=vc.in_channels, mean=tuple(proc.get("image_mean") or CLIP_MEAN),
        std=tuple(proc.get("image_std") or CLIP_STD), ln_eps=1e-6, act=vc.hidden_act,
        temporal_patch_size=vc.temporal_patch_size, merge_size=vc.spatial_merge_size,
        window_size=vc.window_size if v25 else 0, fullatt_blocks=tuple(vc.fullatt_block_indexes) if v25 else (),
        norm="rmsnorm" if v25 else "layernorm", mlp="swiglu" if v25 else "gelu", min_pixels=lo, max_pixels=hi,
        tokens_per_second=int(vc.tokens_per_second) if v25 else 0)


def config_from_hf(hf, name: str = "hf", proc: dict | None = None) -> ModelConfig:
    """A Qwen2VLConfig / Qwen2_5_VLConfig (+ its image processor's settings) -> the mmpipe config.
    Refuses what the layers do not implement."""
    tc = hf.text_config
    rope = dict(getattr(tc, "rope_parameters", None) or {})
    if rope.get("rope_type", "default") != "default":
        _fail("text_config.rope_parameters", f"rope_type '{rope['rope_type']}' (RoPE scaling) is not supported")
    if getattr(tc, "use_sliding_window", False):
        _fail("text_config.use_sliding_window", "sliding-window attention is not implemented")
    if tc.hidden_act != "silu":
        _fail("text_config.hidden_act", f"'{tc.hidden_act}' (supported: silu)")
    out = hf.vision_config.hidden_size if hf.model_type == "qwen2_vl" else hf.vision_config.out_hidden_size
    if out != tc.hidden_size:
        _fail("vision_config", f"the merger's output width {out} is not the decoder's hidden_size {tc.hidden_size}")
    text = MropeText(
        dim=tc.hidden_size, n_layers=tc.num_hidden_layers, n_heads=tc.num_attention_heads,
        ff_dim=tc.intermediate_size, vocab_size=tc.vocab_size, max_context=tc.max_position_embeddings,
        partial_rotary_factor=1.0, rope_theta=float(rope.get("rope_theta", 1000000.0)), ln_eps=tc.rms_norm_eps,
        n_kv_heads=tc.num_key_value_heads, qkv_bias=True,
        tie_embeddings=tie_flag(hf),
        mrope_section=tuple(rope.get("mrope_section", (16, 24, 24))))
    vision = _vision(hf, proc or {})
    cfg = ModelConfig(name=name, family="qwen2_vl", vision=vision, text=text,
                      proj_inner_dim=vision.dim * vision.merge_size ** 2, image_token_id=hf.image_token_id,
                      vision_start_id=hf.vision_start_token_id, vision_end_id=hf.vision_end_token_id)
    cfg.validate()
    return cfg


def hf_config(cfg: ModelConfig, tok=None):
    """mmpipe Qwen2-VL-family config -> the HF config of its generation (Qwen2.5-VL: the SwiGLU tower), with tok's
    special ids in its text config (mmpipe.hf.llava.token_ids: without them, transformers' class defaults,
    151643 / 151645, name tokens of a 151k vocabulary)."""
    from transformers import Qwen2_5_VLConfig, Qwen2VLConfig
    v, t = cfg.vision, cfg.text
    v25 = v.mlp == "swiglu"
    if not v25 and v.ff_dim % v.dim:
        _fail(f"model config '{cfg.name}'", f"vision.ff_dim {v.ff_dim}: Qwen2-VL's tower takes a whole multiple "
                                            f"of vision.dim {v.dim} (its mlp_ratio)")
    common = dict(depth=v.n_layers, num_heads=v.n_heads, in_channels=v.channels, patch_size=v.patch_size,
                  spatial_merge_size=v.merge_size, temporal_patch_size=v.temporal_patch_size, hidden_act=v.act)
    vision = (dict(common, hidden_size=v.dim, intermediate_size=v.ff_dim, out_hidden_size=t.dim,
                   window_size=v.window_size, fullatt_block_indexes=list(v.fullatt_blocks),
                   **({"tokens_per_second": v.tokens_per_second} if v.tokens_per_second else {})) if v25 else
              dict(common, embed_dim=v.dim, hidden_size=t.dim, mlp_ratio=v.ff_dim // v.dim))
    text = dict(hidden_size=t.dim, intermediate_size=t.ff_dim, num_hidden_layers=t.n_layers,
                num_attention_heads=t.n_heads, num_key_value_heads=t.kv_heads, vocab_size=t.vocab_size,
                max_position_embeddings=t.max_context, rms_norm_eps=t.ln_eps, tie_word_embeddings=t.tie_embeddings,
                rope_parameters={"rope_type": "default", "rope_theta": t.rope_theta,
                                 "mrope_section": list(t.mrope_section)}, **token_ids(tok, t.vocab_size))
    return (Qwen2_5_VLConfig if v25 else Qwen2VLConfig)(
        vision_config=vision, text_config=text, image_token_id=cfg.image_token_id,
        vision_start_token_id=cfg.vision_start_id, vision_end_token_id=cfg.vision_end_id,
        tie_word_embeddings=t.tie_embeddings)


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """mmpipe name -> HF name for every weight of the mmpipe model (a tied head has none of its own)."""
    model = meta_model(cfg)
    out, seen = {}, {}
    for i, layer in enumerate(model):
        if not layer.state_dict():  # a tied head's later use (builder.TiedCall)
            continue
        if type(layer) not in PREFIX:
            raise TypeError(f"no HF name for layer {i} ({type(layer).__name__})")
        prefix = PREFIX[type(layer)].format(seen.get(type(layer), 0))
        seen[type(layer)] = seen.get(type(layer), 0) + 1
        out.update({f"{i}.{sub}": prefix + sub for sub in layer.state_dict()})
    return out


def canonical(name: str) -> str:
    """A source tensor name in the installed transformers' layout (the Hub releases' renamed)."""
    for pat, new in LEGACY:
        name = re.sub(pat, new, name)
    return name


def import_weights(model: ReferenceModel, source, where: str) -> ImportReport:
    """Load HF-named tensors into the mmpipe model: every source tensor mapped, every weight filled."""
    source = as_weights(source)
    assign, report = plan_named(model.cfg, source, where, key_map(model.cfg), HF_CLASSES["qwen2_vl"], canonical)
    fill(model, source, assign)
    return report


def plan_named(cfg: ModelConfig, source, where: str, names: dict[str, str], hf_class: str,
               rename=lambda name: name) -> tuple[dict[str, str], ImportReport]:
    """The Qwen families' import plan (Qwen2/2.5-VL, Qwen3-VL): (mmpipe name -> source name, report), from the
    source's names and shapes (a lazy source reads only a tied head and its embedding, compared). names: mmpipe's
    weight -> the HF tensor (the family's key map); rename: a source name as the key map spells it (older
    checkpoints' prefixes). Every source tensor mapped and every weight filled; else one line naming the tensor."""
    source = as_weights(source)
    by_hf = {h: m for m, h in names.items()}
    shapes = {k: tuple(t.shape) for k, t in meta_model(cfg).state_dict().items()}
    report, assign, embed = ImportReport(), {}, "model.language_model.embed_tokens.weight"
    renamed = {rename(k): k for k in source}
    for name, src in renamed.items():
        if name == "lm_head.weight" and cfg.text.tie_embeddings:
            if embed in renamed and not same_tensor(source, renamed[embed], src):
                _fail(where, f"tensor '{src}': the config ties embeddings but it differs from the input embedding")
            report.mapped += 1
            continue
        if name not in by_hf:
            _fail(where, f"tensor '{src}' {source.shape(src)} matches no weight of a {hf_class}")
        mine = by_hf[name]
        if source.shape(src) != shapes[mine]:
            _fail(where, f"tensor '{src}' has shape {source.shape(src)}, the model expects {shapes[mine]}")
        assign[mine] = src
        report.mapped += 1
    missing = sorted(set(by_hf) - set(renamed))
    if missing:
        _fail(where, f"no tensor for '{missing[0]}'" + (f" and {len(missing) - 1} more" if len(missing) > 1 else ""))
    return assign, report


def hf_qwen_config(path: str | Path, notes: list[str] | None = None):
    """An HF Qwen2-VL / Qwen2.5-VL directory's (HF config, mmpipe config, its clips' settings its video processor's:
    with_video_settings); no weight is read (but llava.settle_tie's two)."""
    path = Path(path)
    hf = read_hf_config(path, tuple(HF_CLASSES), notes)
    return hf, with_video_settings(config_from_hf(hf, path.name, processor_settings(path)[0]), path, notes)


VIDEO_FILES = ("processor_config.json", "video_preprocessor_config.json", "preprocessor_config.json")


def video_settings(path: Path) -> tuple[dict, str | None]:
    """(the directory's video processor settings, the file they came from), in the order transformers'
    AutoVideoProcessor reads them (BaseVideoProcessor.get_video_processor_dict): processor_config.json's
    video_processor section, else video_preprocessor_config.json, else the image processor's preprocessor_config.json
    (a video processor built on the images' settings); ({}, None) with none of them."""
    for name in VIDEO_FILES:
        f = path / name
        if not f.is_file():
            continue
        d = settings_file(f)
        if name != "processor_config.json":
            return d, name
        if isinstance(d.get("video_processor"), dict):
            return d["video_processor"], name
    return {}, None


def video_processor_class(cfg: ModelConfig):
    """transformers' video processor of the family: Qwen3-VL's (a whole-clip pixel bound, its frame sampling), else
    Qwen2-VL's (a per-frame bound)."""
    from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
    return Qwen3VLVideoProcessor if cfg.vision.timestamps else Qwen2VLVideoProcessor


def with_video_settings(cfg: ModelConfig, path: Path, notes: list[str] | None = None) -> ModelConfig:
    """cfg with vision.video_* its video processor's, built as transformers builds it (video_settings' dict into the
    family's class by its from_dict: the keys it lacks take the class's defaults, e.g. Qwen2VLVideoProcessor's
    min_frames 4, max_frames 768). Its pixel bounds (size shortest / longest_edge, or min / max_pixels) become
    video_min_pixels / video_max_pixels; its fps video_fps, except where it has none (Qwen2VLVideoProcessor's
    default, which samples no frames: mmpipe samples at 2, qwen-vl-utils' rate). No file at all (transformers
    loads no video processor): the class's defaults, said in a note."""
    d, name = video_settings(path)
    proc = video_processor_class(cfg).from_dict(d)
    fps = float(proc.fps) if proc.fps else cfg.vision.video_fps
    vision = dataclasses.replace(cfg.vision, video_fps=fps, video_min_frames=int(proc.min_frames),
                                 video_max_frames=int(proc.max_frames),
                                 video_min_pixels=int(proc.size.shortest_edge or 0),  # a bound it lacks (a size of
                                 video_max_pixels=int(proc.size.longest_edge or 0))  # one edge): 0, the images'
    if name is None and notes is not None:
        notes.append(f"no video processor config: clips take {type(proc).__name__}'s defaults (min_pixels "
                     f"{vision.video_min_pixels}, max_pixels {vision.video_max_pixels}, fps {fps:g})")
    return dataclasses.replace(cfg, vision=vision)


def read_qwen2_vl(path: str | Path) -> Imported:
    """An HF Qwen2VL / Qwen2_5_VL directory, decided from its config and tensor headers (no weight read yet)."""
    path, notes = Path(path), []
    _, cfg = hf_qwen_config(path, notes)
    source = open_weights(path)
    assign, report = plan_named(cfg, source, str(path), key_map(cfg), HF_CLASSES["qwen2_vl"], canonical)
    report.notes += notes + processor_defaults(path, _defaults_taken)
    return Imported(cfg, assign, source, report)


def import_qwen2_vl(path: str | Path, dtype=torch.float32) -> tuple[ReferenceModel, ImportReport]:
    """An HF Qwen2VL / Qwen2_5_VL ForConditionalGeneration directory -> (mmpipe single-device model, report)."""
    got = read_qwen2_vl(path)
    return got.model(dtype), got.report


def image_processor(v: PatchVision):
    """transformers' Qwen2VLImageProcessor at the model's patch, merge, resize bounds, mean and std."""
    from transformers import Qwen2VLImageProcessor
    return Qwen2VLImageProcessor(min_pixels=v.min_pixels, max_pixels=v.max_pixels, patch_size=v.patch_size,
                                 temporal_patch_size=v.temporal_patch_size, merge_size=v.merge_size,
                                 image_mean=list(v.mean), image_std=list(v.std))


def export_hf(source, out: str | Path, tok=None, shard_size=None) -> Path:
    """Write an HF directory (config.json, generation_config.json, the weights sharded, its image processor) that
    from_pretrained loads, one layer in memory at a time; source: a model or a run's layers (mmpipe.hf.stream);
    tok: the run's tokenizer, whose special ids the config declares."""
    return write_with_processor(source, out, hf_config(source.cfg, tok), key_map(source.cfg), shard_size)


def write_with_processor(source, out: str | Path, hf, names: dict[str, str], shard_size=None) -> Path:
    """A family of patches' HF directory (Qwen2-VL's, Qwen3-VL's, Qwen3.5's): write_hf of its config `hf` and
    names, and beside it the Qwen2-VL image processor at the tower's pixel bounds."""
    out = write_hf(source, out, hf, names, shard_size=shard_size)
    if source.cfg.vision.max_pixels:
        image_processor(source.cfg.vision).save_pretrained(out)
    if "video" in family_of(source.cfg).media:  # a family that reads clips (Qwen3.5's tower reads none here)
        video_processor(source.cfg).save_pretrained(out)
    return out


def video_processor(cfg: ModelConfig):
    """The family's transformers video processor at the model's clip settings (vision.video_*; pixel bounds 0: the
    images'), sampling frames itself as mmpipe does (do_sample_frames) and without a total pixel cap (mmpipe has
    none): save_pretrained writes it as video_preprocessor_config.json, which import reads back."""
    v = cfg.vision
    return video_processor_class(cfg)(
        patch_size=v.patch_size, merge_size=v.merge_size, temporal_patch_size=v.temporal_patch_size,
        size={"shortest_edge": v.video_min_pixels or v.min_pixels, "longest_edge": v.video_max_pixels or v.max_pixels},
        image_mean=list(v.mean), image_std=list(v.std), fps=v.video_fps, min_frames=v.video_min_frames,
        max_frames=v.video_max_frames, do_sample_frames=True, cap_pixels_per_frame=False)
