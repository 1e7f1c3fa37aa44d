"""Tiny Hugging Face LLaVA models with random weights, built from transformers' configs (nothing is
downloaded), and a batch in LLaVA's layout: BOS, a word, the <image> placeholders, text."""
from __future__ import annotations

from pathlib import Path

import torch
from transformers import (
    CLIPVisionConfig,
    LlamaConfig,
    LlavaConfig,
    LlavaForConditionalGeneration,
    Qwen2Config,
    SiglipVisionConfig,
)

IMAGE_TOKEN = 99
VOCAB = 100


def _vision(kind: str):
    common = dict(hidden_size=32, intermediate_size=64, num_hidden_layers=3, num_attention_heads=2, image_size=32,
                  patch_size=8)
    return CLIPVisionConfig(**common) if kind == "clip" else SiglipVisionConfig(**common)


def llava_config(kind: str) -> LlavaConfig:
    """'siglip_llama': SigLIP + Llama (GQA 4/2, theta 5000, untied, all features, last block's output);
    'clip_qwen2': CLIP + Qwen2 (qkv bias, tied embeddings, class token dropped, second-to-last block)."""
    if kind == "siglip_llama":
        text = LlamaConfig(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                           num_key_value_heads=2, vocab_size=VOCAB, max_position_embeddings=128, rms_norm_eps=1e-6,
                           rope_parameters={"rope_type": "default", "rope_theta": 5000.0}, tie_word_embeddings=False,
                           bos_token_id=1, eos_token_id=2, pad_token_id=0)
        return LlavaConfig(vision_config=_vision("siglip"), text_config=text, image_token_id=IMAGE_TOKEN,
                           vision_feature_layer=-1, vision_feature_select_strategy="full", tie_word_embeddings=False)
    text = Qwen2Config(hidden_size=32, intermediate_size=64, num_hidden_layers=2, num_attention_heads=4,
                       num_key_value_heads=1, vocab_size=VOCAB, max_position_embeddings=128, tie_word_embeddings=True,
                       bos_token_id=1, eos_token_id=2, pad_token_id=0)
    return LlavaConfig(vision_config=_vision("clip"), text_config=text, image_token_id=IMAGE_TOKEN,
                       vision_feature_layer=-2, vision_feature_select_strategy="default", tie_word_embeddings=True)


def n_features(kind: str) -> int:
    return 16  # (32 / 8)^2 patches; CLIP's class token dropped by 'default', SigLIP has none


def save_hf(kind: str, out: Path, seed: int = 0, **save_kw) -> LlavaForConditionalGeneration:
    torch.manual_seed(seed)
    model = LlavaForConditionalGeneration(llava_config(kind)).eval()
    with torch.no_grad():  # HF's init leaves norms at 1 / biases at 0: perturb them so a mix-up shows
        for name, p in model.named_parameters():
            if "norm" in name or name.endswith("bias"):
                p.add_(torch.randn_like(p) * 0.1)
            elif "q_proj" in name or "k_proj" in name:
                p.mul_(8)  # std 0.02 makes attention ~uniform, blind to positions (RoPE theta) and masks
    model.save_pretrained(out, **save_kw)
    return model


def batch(kind: str, B: int = 2, seed: int = 1):
    """pixel_values [B, 3, 32, 32], input_ids [B, T] (placeholders after 2 tokens), labels [B, T]."""
    g = torch.Generator().manual_seed(seed)
    n = n_features(kind)
    text = torch.randint(3, IMAGE_TOKEN, (B, 6), generator=g)
    ids = torch.cat([torch.ones(B, 1, dtype=torch.long), text[:, :1], torch.full((B, n), IMAGE_TOKEN), text[:, 1:]], 1)
    labels = ids.clone()
    labels[:, : 2 + n] = -100  # HF's labels: the token at each position; only the text after the image counts
    return torch.randn(B, 3, 32, 32, generator=g), ids, labels


def word_tokenizer(path, template: str):
    """A word-level tokenizer over w0..w99 (BOS w1, EOS w2, pad w0) with `template` as its chat
    template, saved to path: token id i is the word "wi"."""
    from tokenizers import Tokenizer, models, pre_tokenizers
    from transformers import PreTrainedTokenizerFast
    tok = Tokenizer(models.WordLevel({f"w{i}": i for i in range(VOCAB)}, unk_token="w3"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="w1", eos_token="w2", pad_token="w0", unk_token="w3")
    fast.chat_template = template
    fast.save_pretrained(path)
    return fast


def shifted(labels: torch.Tensor) -> torch.Tensor:
    """HF labels (the token at each position) -> mmpipe's (the token each position predicts next)."""
    return torch.cat([labels[:, 1:], torch.full_like(labels[:, :1], -100)], dim=1)


def with_random_adapters(model, groups: tuple[str, ...] = ("vision", "projector", "text")):
    """A ReferenceModel of model's weights with LoRA adapters (rank 4, alpha 8) on `groups`, the adapters
    random (seed 5): peft starts B at zero, an adapter that changes nothing, so these make them count."""
    from mmpipe.model import ReferenceModel
    from mmpipe.model.lora import Lora, is_adapter, load_base
    adapted = ReferenceModel(model.cfg, lora=Lora(4, 8.0, groups=groups))
    for mine, theirs in zip(adapted, model):
        load_base(mine, theirs.state_dict())
    torch.manual_seed(5)
    with torch.no_grad():
        for name, p in adapted.named_parameters():
            if is_adapter(name):
                p.copy_(torch.randn_like(p) * 0.2)
    return adapted.eval()


def peft_of(adapted, hf_class, out: Path, key_map, export_hf):
    """adapted's adapters exported as a peft adapter (mmpipe.hf.adapter, with its base beside it) and loaded
    by peft onto transformers' hf_class: the model a user of the export gets."""
    from peft import PeftModel

    from mmpipe.hf.adapter import export_adapter
    export_adapter(adapted, out, key_map, export_hf)
    return PeftModel.from_pretrained(hf_class.from_pretrained(out / "base"), out).eval()


def perturbed(model):
    """A copy of a ReferenceModel with every weight moved (seeded): as if trained, so an export that carried
    the imported weights instead would show."""
    from mmpipe.model import ReferenceModel
    changed = ReferenceModel(model.cfg).eval()
    changed.load_state_dict(model.state_dict())
    with torch.no_grad():
        g = torch.Generator().manual_seed(3)
        for p in changed.parameters():
            p.add_(torch.randn(p.shape, generator=g) * 0.02)
    return changed
