"""Tiny Hugging Face Qwen2-VL / Qwen2.5-VL models with random weights, built from transformers' configs
(nothing is downloaded), their image processor (transformers' Qwen2VLImageProcessor, small min / max
pixels so grids are a few patches), and samples in Qwen's layout: text, <|vision_start|>, t h w / 4
<|image_pad|>, <|vision_end|>, text.

"qwen2": LayerNorm tower, fc1 / fc2 quick_gelu, full attention, untied head.
"qwen2_5": RMSNorm tower, SwiGLU with bias, window_size 56 px = 2 x 2 merge units (so a 4 x 6 or 8 x 4
grid spans several windows) with full attention in block 1 of 3 only, tied embeddings."""
from __future__ import annotations

from pathlib import Path

import numpy as np
import torch
from PIL import Image
from transformers import (
    Qwen2_5_VLConfig,
    Qwen2_5_VLForConditionalGeneration,
    Qwen2VLConfig,
    Qwen2VLForConditionalGeneration,
    Qwen2VLImageProcessor,
)

VOCAB, IMAGE, VIDEO, START, END = 200, 190, 191, 192, 193
KINDS = ("qwen2", "qwen2_5")
SPECIALS = {IMAGE: "<|image_pad|>", VIDEO: "<|video_pad|>", START: "<|vision_start|>", END: "<|vision_end|>",
            194: "<|im_start|>", 195: "<|im_end|>", 0: "<|endoftext|>"}
# Qwen's chat template without the default system turn
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
PIXELS = dict(min_pixels=56 * 56, max_pixels=28 * 28 * 16)  # at most 16 merge units per image


def qwen_config(kind: str):
    text = dict(hidden_size=64, intermediate_size=128, num_hidden_layers=2, num_attention_heads=4,
                num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=512, rms_norm_eps=1e-6,
                rope_parameters={"rope_type": "default", "rope_theta": 10000.0, "mrope_section": [2, 3, 3]},
                bos_token_id=1, eos_token_id=2, pad_token_id=0, tie_word_embeddings=kind == "qwen2_5")
    ids = dict(image_token_id=IMAGE, video_token_id=VIDEO, vision_start_token_id=START, vision_end_token_id=END,
               tie_word_embeddings=kind == "qwen2_5")
    common = dict(num_heads=2, patch_size=14, spatial_merge_size=2, temporal_patch_size=2)
    if kind == "qwen2":
        vision = dict(common, depth=2, embed_dim=32, hidden_size=64, mlp_ratio=2)
        return Qwen2VLConfig(text_config=text, vision_config=vision, **ids)
    vision = dict(common, depth=3, hidden_size=32, intermediate_size=48, out_hidden_size=64, window_size=56,
                  fullatt_block_indexes=[1])
    return Qwen2_5_VLConfig(text_config=text, vision_config=vision, **ids)


def save_qwen(kind: str, out: Path, seed: int = 0):
    """The tiny model (and its image processor) saved to out; returns the model, in eval mode."""
    torch.manual_seed(seed)
    cls = Qwen2VLForConditionalGeneration if kind == "qwen2" else Qwen2_5_VLForConditionalGeneration
    model = cls(qwen_config(kind)).eval()
    with torch.no_grad():  # HF's init leaves norms at 1 / biases at 0: perturb them so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or "ln_q" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            if "q_proj" in name or "k_proj" in name:
                p.mul_(8)  # std 0.02 makes attention ~uniform, blind to positions and masks
            elif name.endswith("attn.qkv.weight") or name.endswith("attn.qkv.bias"):
                p[: 2 * p.shape[0] // 3].mul_(8)  # the tower's q and k rows
            elif name.endswith("merger.mlp.2.weight"):
                p.mul_(10)  # image tokens as loud as text ones, so the tower's details reach the logits
    model.save_pretrained(out)
    processor().save_pretrained(out)
    return model


def processor() -> Qwen2VLImageProcessor:
    return Qwen2VLImageProcessor(**PIXELS)


def image(w: int, h: int, seed: int) -> Image.Image:
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, (h, w, 3), dtype=np.uint8))


def encode(images: list[Image.Image]) -> tuple[torch.Tensor, torch.Tensor]:
    """(pixel_values [N_patches, 1176], image_grid_thw [n, 3]) from transformers' image processor."""
    out = processor()(images=images, return_tensors="pt")
    return out["pixel_values"], out["image_grid_thw"]


def sample(grids: torch.Tensor, seed: int, words: int = 3) -> torch.Tensor:
    """input_ids [T]: `words` text tokens, then per image <|vision_start|>, its t h w / 4 placeholders,
    <|vision_end|> and `words` more text tokens."""
    g = torch.Generator().manual_seed(seed)
    parts = [torch.randint(3, 180, (words,), generator=g)]
    for t, h, w in grids.tolist():
        block = torch.tensor([START] + [IMAGE] * (t * h * w // 4) + [END])
        parts += [block, torch.randint(3, 180, (words,), generator=g)]
    return torch.cat(parts)


def hf_logits(model, ids: torch.Tensor, pixels: torch.Tensor | None, grids: torch.Tensor | None) -> torch.Tensor:
    """transformers' logits [T, V] for one sample (no image: pixels / grids None)."""
    kw = {} if pixels is None else dict(pixel_values=pixels, image_grid_thw=grids,
                                        mm_token_type_ids=(ids == IMAGE).int()[None])
    with torch.no_grad():
        return model(input_ids=ids[None], **kw).logits[0]


def save_tokenizer(path, words: dict[int, str] | None = None) -> None:
    """A Qwen-like word-level tokenizer over the tiny vocabulary (token i is "wi", the specials at their ids),
    no BOS, Qwen's chat template; words: more words at ids of their own (e.g. Qwen3-VL's timestamps)."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    # the template's roles: no unknown (= pad) id in a prompt
    names = {**SPECIALS, 196: "user", 197: "assistant", **(words or {})}
    vocab = {names.get(i, f"w{i}"): i for i in range(VOCAB)}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=[v for k, v in SPECIALS.items() if k])
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)


def assert_greedy_is_hf_generate(model, hf, ids: torch.Tensor, px: torch.Tensor, grids: torch.Tensor,
                                 tokens: int = 5) -> None:
    """One image prompt through mmpipe's generate (a 1-slot row with 4 patches of padding), KV-cached and not, gives
    transformers' own greedy `generate` tokens: the decode path of every layer kind against HF's."""
    from mmpipe.inference.generate import generate
    from mmpipe.inference.sampling import Sampling
    pixels = torch.cat([px, torch.zeros(4, px.shape[1])])[None]
    greedy = Sampling(eos_id=None, max_new_tokens=tokens)
    mine = generate(model, pixels, ids.tolist(), greedy, tiling=grids[None])
    assert mine == generate(model, pixels, ids.tolist(), greedy, use_cache=False, tiling=grids[None])
    with torch.no_grad():
        out = hf.generate(input_ids=ids[None], pixel_values=px, image_grid_thw=grids,
                          mm_token_type_ids=(ids == hf.config.image_token_id).int()[None], max_new_tokens=tokens,
                          min_new_tokens=tokens, do_sample=False)
    assert out[0, len(ids):].tolist() == mine
