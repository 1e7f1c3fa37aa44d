"""What `mmpipe export` writes beside HF weights, so the folder is a whole model: the run's tokenizer
and, for the LLaVA family, an HF LlavaProcessor (tokenizer + image processor at the model's image
size, mean and std). `mmpipe generate --checkpoint OUT` then reads the tokenizer the run trained
with, `AutoProcessor.from_pretrained(OUT)` works, and `mmpipe import --hf OUT` keeps the mean / std.

The run's tokenizer: RUN/tokenizer (a user's, or an import's), else the built-in one it trained with
(a LLaVA run's with its `<image>` token, the id model.json names).

File modes: safetensors (0.8) writes its files 0600 whatever the umask; `follow_umask` gives what
export wrote the mode any file the user writes gets.
"""
from __future__ import annotations

import os
from pathlib import Path

from ..config import ModelConfig, VisionConfig
from ..data.image_kinds import image_kind
from ..data.tokenizer import IMAGE_TOKEN, builtin_tokenizer, load_tokenizer
from .llava import hf_config


def run_tokenizer(run: Path, cfg: ModelConfig):
    """The tokenizer `run` trained with (module docstring)."""
    own = run / "tokenizer"
    if own.is_dir():
        return load_tokenizer(str(own), flag="--checkpoint")
    return builtin_tokenizer(image_token=image_kind(cfg).markers)


def image_processor(vision: VisionConfig):
    """The HF image processor of the vision tower's kind, at the model's size, mean and std."""
    from transformers import CLIPImageProcessor, SiglipImageProcessor
    size, stats = vision.image_size, dict(image_mean=list(vision.mean), image_std=list(vision.std))
    if vision.kind == "clip":
        return CLIPImageProcessor(size={"shortest_edge": size}, crop_size={"height": size, "width": size}, **stats)
    return SiglipImageProcessor(size={"height": size, "width": size}, **stats)


def write_processor(tok, cfg: ModelConfig, out: Path) -> str:
    """The run's tokenizer (and, LLaVA family, a LlavaProcessor around it) into out; says what it wrote."""
    if (not image_kind(cfg).image_token  # Qwen2-VL, NeXT: their image processor is export's (hf.qwen2_vl, llava_next)
            or tok.convert_tokens_to_ids(IMAGE_TOKEN) != cfg.image_token_id):
        tok.save_pretrained(out)  # no <image> placeholder at the model's id: no processor can expand it
        return "tokenizer"
    from transformers import LlavaProcessor
    processor = LlavaProcessor(
        image_processor=image_processor(cfg.vision), tokenizer=tok, patch_size=cfg.vision.patch_size,
        vision_feature_select_strategy=hf_config(cfg).vision_feature_select_strategy, image_token=IMAGE_TOKEN,
        num_additional_image_tokens=int(cfg.vision.kind == "clip"),  # CLIP's class token
        chat_template=tok.chat_template)
    processor.save_pretrained(out)
    return "tokenizer and processor"


def follow_umask(path: Path) -> None:
    """Every file at or under path gets mode 0666 less the umask (module docstring)."""
    mask = os.umask(0)
    os.umask(mask)
    for f in [path] if path.is_file() else path.rglob("*"):
        if f.is_file():
            f.chmod(0o666 & ~mask)
