"""LLaVA-NeXT / LLaVA-OneVision in and out of Hugging Face: LlavaNextForConditionalGeneration /
LlavaOnevisionForConditionalGeneration directories <-> mmpipe's llava_next layer list (mmpipe.model.llava_next).

The two share LLaVA's tower, projector and decoder names, so mmpipe.hf.llava does the work: its config reader
(then the family, pinpoints and OneVision's cap set here), its name map (the projector layer's image_newline is
`model.image_newline`), its import (every source tensor mapped or reported unused, e.g. the tower's blocks past
the feature layer) and its export (the tower cut at the feature layer). What is this module's: the generation,
by model_type (llava_next, or llava_onevision: vision_aspect_ratio "anyres_max_N" -> vision.anyres_max N), and
the image processor an export writes (transformers' LlavaNextImageProcessor / LlavaOnevisionImageProcessor at the
model's crop size, pinpoints, mean and std), so `mmpipe import --hf` of the export reads the same model back.
"""
from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import torch

from ..config import ModelConfig, widen
from ..model.builder import ReferenceModel
from ..model.llava_next import AnyresVision
from . import llava
from .llava import ImportReport, _fail, _preprocessor, read_hf_config
from .safetensors_io import open_weights
from .stream import Imported

HF_CLASSES = {"llava_next": "LlavaNextForConditionalGeneration",
              "llava_onevision": "LlavaOnevisionForConditionalGeneration"}


def _anyres_max(hf) -> int:
    """OneVision's vision_aspect_ratio 'anyres_max_9' -> 9; LLaVA-NeXT: 0 (no cap)."""
    if hf.model_type != "llava_onevision":
        return 0
    m = re.fullmatch(r"anyres_max_(\d+)", str(getattr(hf, "vision_aspect_ratio", "anyres_max_9")))
    if m is None or int(m.group(1)) < 1:
        _fail("vision_aspect_ratio", f"'{hf.vision_aspect_ratio}' (supported: anyres_max_N, N >= 1)")
    return int(m.group(1))


def config_from_hf(hf, name: str = "hf", mean=None, std=None) -> ModelConfig:
    """A LlavaNextConfig / LlavaOnevisionConfig -> the mmpipe llava_next config (LLaVA's reading of the tower,
    decoder and projector, then the pinpoints and cap). Refuses what the layers do not implement."""
    if getattr(hf, "multimodal_projector_bias", True) is False:
        _fail("multimodal_projector_bias", "false: only the projector with biases is supported")
    base = llava.config_from_hf(hf, name, mean, std, check=False)
    pinpoints = tuple(tuple(int(x) for x in p) for p in hf.image_grid_pinpoints)
    vision = widen(AnyresVision, base.vision, grid_pinpoints=pinpoints, anyres_max=_anyres_max(hf))
    cfg = dataclasses.replace(base, family="llava_next", vision=vision)
    cfg.validate()
    return cfg


def hf_config(cfg: ModelConfig, tok=None):
    """mmpipe llava_next config -> the HF config of its generation (OneVision when vision.anyres_max > 0), its
    tower cut at the feature layer and tok's special ids in its text config, as mmpipe.hf.llava.hf_config."""
    from transformers import LlavaNextConfig, LlavaOnevisionConfig
    base, v = llava.hf_config(cfg, tok), cfg.vision
    common = dict(vision_config=base.vision_config, text_config=base.text_config, image_token_id=cfg.image_token_id,
                  image_grid_pinpoints=[list(p) for p in v.grid_pinpoints], vision_feature_layer=-1,
                  vision_feature_select_strategy=v.feature_select, tie_word_embeddings=cfg.text.tie_embeddings)
    if v.anyres_max:
        return LlavaOnevisionConfig(**common, vision_aspect_ratio=f"anyres_max_{v.anyres_max}")
    return LlavaNextConfig(**common)


def key_map(cfg: ModelConfig) -> dict[str, str]:
    """mmpipe name -> HF name for every weight of the mmpipe model (a tied head has none of its own)."""
    return llava.key_map(cfg, llava._hf_names(hf_config(cfg)))


def hf_llava_next_config(path: str | Path, notes: list[str] | None = None):
    """An HF LLaVA-NeXT / OneVision directory's (HF config, mmpipe config); no weight is read (but
    llava.settle_tie's two)."""
    path = Path(path)
    hf = read_hf_config(path, tuple(HF_CLASSES), notes)
    return hf, config_from_hf(hf, path.name, *_preprocessor(path))


def read_llava_next(path: str | Path) -> Imported:
    """An HF LlavaNext / LlavaOnevision directory, decided from its config and tensor headers (no weight read)."""
    path, notes = Path(path), []
    hf, cfg = hf_llava_next_config(path, notes)
    source = open_weights(path)
    assign, report = llava.plan_weights(cfg, source, hf, str(path))
    clip = cfg.vision.kind == "clip"
    report.notes += notes + llava.processor_defaults(path, lambda d: llava.stats_defaults(d, clip))
    return Imported(cfg, assign, source, report)


def import_llava_next(path: str | Path, dtype=torch.float32) -> tuple[ReferenceModel, ImportReport]:
    """An HF LlavaNext / LlavaOnevision ForConditionalGeneration directory -> (mmpipe single-device model, report)."""
    got = read_llava_next(path)
    return got.model(dtype), got.report


def image_processor(cfg: ModelConfig):
    """transformers' image processor of the generation at the model's crop, pinpoints, mean and std: the one
    the data side cuts the crops with (mmpipe.data.anyres)."""
    from ..data.anyres import hf_image_processor, tile_rule
    return hf_image_processor(tile_rule(cfg))


def export_hf(source, out: str | Path, tok=None, shard_size=None) -> Path:
    """Write an HF directory (config.json, the weights sharded, its image processor) that from_pretrained loads,
    one layer in memory at a time; source: a model or a run's layers; tok: the run's tokenizer, whose special ids
    the config declares (mmpipe.hf.llava.token_ids)."""
    out = llava.export_hf(source, out, hf=hf_config(source.cfg, tok), shard_size=shard_size)
    image_processor(source.cfg).save_pretrained(out)
    return out
