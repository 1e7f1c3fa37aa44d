"""Tiny Hugging Face LLaVA-NeXT / LLaVA-OneVision models with random weights, built from transformers' configs
(nothing is downloaded), their image processors (transformers' LlavaNextImageProcessor /
LlavaOnevisionImageProcessor at 56 px crops, pinpoints up to 2 x 2 tiles), and samples in their layout: text,
each image's placeholder block (transformers' feature count), text.

"next": CLIP tower (class token, feature layer -2, 'default'), Llama decoder, untied head; N = 16 per crop.
"onevision": SigLIP tower (feature layer -1, 'full'), Qwen2 decoder (qkv bias), tied embeddings, and
anyres_max_2: an image whose unpadded tiles give over 2 x 16 features is bilinear-pooled (a 2 x 2 grid's
8 x 8 -> 5 x 5); an image of a several-image sample is its base crop only (batch_num_images)."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    LlavaNextConfig,
    LlavaNextForConditionalGeneration,
    LlavaNextImageProcessor,
    LlavaOnevisionConfig,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionImageProcessor,
)

VOCAB, IMAGE = 200, 190
KINDS = ("next", "onevision")
CROP = 56
PINPOINTS = [[56, 56], [56, 112], [112, 56], [112, 112]]


def hf_config(kind: str):
    common = dict(image_size=CROP, patch_size=14, hidden_size=32, intermediate_size=64, num_hidden_layers=3,
                  num_attention_heads=2)
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=kind == "onevision")
    if kind == "next":
        return LlavaNextConfig(vision_config=dict(common, model_type="clip_vision_model", hidden_act="quick_gelu"),
                               text_config=dict(text, model_type="llama"), image_token_id=IMAGE,
                               image_grid_pinpoints=PINPOINTS, vision_feature_layer=-2,
                               vision_feature_select_strategy="default")
    return LlavaOnevisionConfig(vision_config=dict(common, model_type="siglip_vision_model"),
                                text_config=dict(text, model_type="qwen2"), image_token_id=IMAGE,
                                image_grid_pinpoints=PINPOINTS, vision_feature_layer=-1,
                                vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_2",
                                tie_word_embeddings=True)


def processor(kind: str):
    stats = dict(image_mean=[0.48, 0.45, 0.4], image_std=[0.27, 0.26, 0.28])
    if kind == "next":
        return LlavaNextImageProcessor(size={"shortest_edge": CROP}, crop_size={"height": CROP, "width": CROP},
                                       image_grid_pinpoints=PINPOINTS, **stats)
    return LlavaOnevisionImageProcessor(size={"height": CROP, "width": CROP}, image_grid_pinpoints=PINPOINTS, **stats)


def save_model(kind: str, out: Path, seed: int = 0):
    """The tiny model (and its image processor) saved to out; returns the model, in eval mode."""
    torch.manual_seed(seed)
    cls = LlavaNextForConditionalGeneration if kind == "next" else LlavaOnevisionForConditionalGeneration
    model = cls(hf_config(kind)).eval()
    with torch.no_grad():  # HF's init leaves norms at 1 / biases at 0: perturb them so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(8)  # std 0.02 makes attention ~uniform, blind to positions and masks
            elif "multi_modal_projector.linear_2.weight" in name:
                p.mul_(10)  # image tokens as loud as text ones, so the tower's details reach the logits
            elif name.endswith("image_newline"):
                p.mul_(5)
    model.save_pretrained(out)
    processor(kind).save_pretrained(out)
    return model


def image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def encode(kind: str, images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [n, max crops, 3, 56, 56], image_sizes [n, 2] (h, w)) from transformers' image processor, the
    images as one sample's (OneVision pads the base crop of an image of a several-image sample to a square)."""
    out = processor(kind)(images=[images], return_tensors="pt")
    return out["pixel_values"], out["image_sizes"]


def sample(counts: list[int], seed: int, words: int = 3) -> torch.Tensor:
    """input_ids [T]: `words` text tokens, then per image its `count` placeholders and `words` more tokens."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(3, 180, (words,), generator=g)]
    for n in counts:
        parts += [torch.full((n,), IMAGE), torch.randint(3, 180, (words,), generator=g)]
    return torch.cat(parts)


def hf_logits(model, ids: torch.Tensor, pixels: torch.Tensor | None, sizes: torch.Tensor | None) -> torch.Tensor:
    """transformers' logits [T, V] for one sample (no image: pixels / sizes None)."""
    kw = {} if pixels is None else dict(pixel_values=pixels, image_sizes=sizes)
    if pixels is not None and isinstance(model.config, LlavaOnevisionConfig):
        kw["batch_num_images"] = torch.tensor([len(sizes)])
    with torch.no_grad():
        return model(input_ids=ids[None], **kw).logits[0]


def tilings(kind: str, sizes: torch.Tensor) -> list[tuple[int, int, int, int]]:
    """Each image's (orig_h, orig_w, rows, cols): transformers' select_best_resolution over the pinpoints, in
    crops; rows = cols = 0 where OneVision encodes the base crop only (an image of a several-image sample)."""
    from transformers.image_processing_utils import select_best_resolution
    out = []
    for h, w in sizes.tolist():
        rows, cols = (x // CROP for x in select_best_resolution((h, w), PINPOINTS))
        out.append((h, w, 0, 0) if kind == "onevision" and len(sizes) > 1 else (h, w, rows, cols))
    return out


def feature_counts(model, pixels: torch.Tensor, sizes: torch.Tensor) -> list[int]:
    """Decoder positions of each image as transformers' model lays its features out (get_image_features)."""
    kw = {"batch_num_images": torch.tensor([len(sizes)])} if isinstance(model.config, LlavaOnevisionConfig) else {}
    with torch.no_grad():
        return [len(f) for f in model.model.get_image_features(pixels, sizes, return_dict=True, **kw).pooler_output]
