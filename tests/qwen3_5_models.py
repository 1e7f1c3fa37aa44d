"""A tiny Hugging Face Qwen3.5 (transformers' Qwen3_5ForConditionalGeneration, random weights, nothing downloaded)
and its image processor (Qwen3-VL's at patch 16: tests/qwen3_models.py), samples in Qwen's layout
(tests/qwen_models.py).

The shape is chosen so that each thing the comparison relies on shows: decoder layers linear, linear, full, linear
(two Gated DeltaNet layers before the full-attention one and one after it); 2 key heads serving 4 value heads of
other widths (16 / 24) so a head mix-up shows; an attention head of 48 whose rotary turns its first 48 x 0.25 = 12
channels, mrope section (2, 2, 2); decays kept slow (A in 0.02 .. 0.3, alpha ~ 0.7 .. 0.97 a step) so that a state
carried across a sample boundary changes the next sample's logits; an untied head."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import Qwen3_5Config, Qwen3_5ForConditionalGeneration

from qwen3_models import perturbed, processor
from qwen_models import END, IMAGE, START, VIDEO, VOCAB

LAYER_TYPES = ["linear_attention", "linear_attention", "full_attention", "linear_attention"]


def qwen3_5_config(tie: bool = False, layer_types=None) -> Qwen3_5Config:
    text = dict(hidden_size=64, intermediate_size=96, num_hidden_layers=4, num_attention_heads=4,
                num_key_value_heads=2, head_dim=48, vocab_size=VOCAB, max_position_embeddings=512,
                rms_norm_eps=1e-6, tie_word_embeddings=tie, layer_types=layer_types or LAYER_TYPES,
                linear_conv_kernel_dim=4, linear_key_head_dim=16, linear_value_head_dim=24,
                linear_num_key_heads=2, linear_num_value_heads=4,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 2, 2],
                                 "mrope_interleaved": True, "partial_rotary_factor": 0.25},
                bos_token_id=1, eos_token_id=2, pad_token_id=0)
    vision = dict(depth=2, hidden_size=32, intermediate_size=48, num_heads=2, patch_size=16, temporal_patch_size=2,
                  spatial_merge_size=2, out_hidden_size=64, num_position_embeddings=36, hidden_act="gelu_pytorch_tanh")
    return Qwen3_5Config(text_config=text, vision_config=vision, image_token_id=IMAGE, video_token_id=VIDEO,
                         vision_start_token_id=START, vision_end_token_id=END, tie_word_embeddings=tie)


def _deltanet(name: str, p) -> None:
    """Gated DeltaNet's parameters, perturbed after Qwen3-VL's rules (tests/qwen3_models.perturbed)."""
    if name.endswith("A_log"):
        p.copy_(torch.empty_like(p).uniform_(0.02, 0.3).log())  # slow decays: a long memory
    elif "in_proj_b" in name or "in_proj_a" in name or "conv1d" in name:
        p.mul_(5)  # the write strengths, decays and conv taps vary from position to position


def save_qwen3_5(out: Path, seed: int = 0, tie: bool = False):
    """The tiny model (and its image processor) saved to out; returns the model, in eval mode."""
    torch.manual_seed(seed)
    model = perturbed(Qwen3_5ForConditionalGeneration(qwen3_5_config(tie)).eval(), _deltanet)
    model.save_pretrained(out)
    processor().save_pretrained(out)
    return model
