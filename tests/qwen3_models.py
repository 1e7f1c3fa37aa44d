"""A tiny Hugging Face Qwen3-VL (transformers' Qwen3VLForConditionalGeneration, random weights, nothing
downloaded), its image processor (transformers' Qwen2VLImageProcessor at patch 16, as Qwen3-VL's, with small
min / max pixels so grids are a few patches) and samples in Qwen's layout (tests/qwen_models.py's).

The shape is chosen so that each thing the comparison relies on shows: a 5-block tower with DeepStack after
blocks 0, 2 and 3 (not transformers' default 8, 16, 24, and not its last block); a 6 x 6 learned position table
(36 entries) that every grid resamples; a decoder head of 24 (not 64 / 4 = 16) with q / k norms and mrope
section (6, 3, 3), whose interleaving (t h w t h w t h w t t t) differs from the blocked one; an untied head."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen2VLImageProcessor, Qwen3VLConfig, Qwen3VLForConditionalGeneration

from qwen_models import END, IMAGE, START, VIDEO, VOCAB

PIXELS = dict(min_pixels=32 * 32, max_pixels=32 * 32 * 16)  # at most 16 merge units (of 32 x 32 px) per image
DEEPSTACK = [0, 2, 3]


def qwen3_config(tie: bool = False) -> Qwen3VLConfig:
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=24, vocab_size=VOCAB, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=tie,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [6, 3, 3],
                                 "mrope_interleaved": True},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=5, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=36,
                  deepstack_visual_indexes=DEEPSTACK, hidden_act="gelu_pytorch_tanh")
    return Qwen3VLConfig(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                         vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=tie)


def perturbed(model, more=lambda name, p: None):
    """A Qwen3-VL-towered model (Qwen3-VL's, Qwen3.5's) made to show a mix-up: HF's init leaves norms at 1 (or 0)
    and biases at 0, and its std 0.02 makes attention ~uniform; more(name, p): the family's own rules for the
    parameters none of these touch, in the same pass (so the random draws keep their order)."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(8)  # std 0.02 makes attention ~uniform, blind to positions and masks
            elif name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
                p[: 2 * p.shape[0] // 3].mul_(8)  # the tower's q and k rows
            elif "linear_fc2.weight" in name and ("merger" in name):
                p.mul_(10)  # image tokens (and DeepStack's sets) as loud as text ones
            elif name.endswith("pos_embed.weight"):
                p.mul_(20)  # the learned positions as loud as the patches, so their resampling shows
            else:
                more(name, p)
    return model


def save_qwen3(out: Path, seed: int = 0, tie: bool = False):
    """The tiny model (and its image processor) saved to out; returns the model, in eval mode."""
    torch.manual_seed(seed)
    model = perturbed(Qwen3VLForConditionalGeneration(qwen3_config(tie)).eval())
    model.save_pretrained(out)
    processor().save_pretrained(out)
    return model


def processor() -> Qwen2VLImageProcessor:
    return Qwen2VLImageProcessor(patch_size=16, merge_size=2, temporal_patch_size=2, image_mean=[0.5] * 3,
                                 image_std=[0.5] * 3, **PIXELS)


def encode(images) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [N_patches, 1536], image_grid_thw [n, 3]) from transformers' image processor."""
    out = processor()(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]
