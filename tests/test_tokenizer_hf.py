"""A real tokenizer, built here with the `tokenizers` library and saved locally, loaded through
AutoTokenizer with its chat template: the <image> placeholder is added when missing (one token,
the embedding grown by one row, old rows untouched), found when present, and the LLaVA model then
reads the image from it."""
from __future__ import annotations

import torch
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from mmpipe.config import load_preset
from mmpipe.data.image_kinds import image_kind
from mmpipe.data.text import ConversationEncoder
from mmpipe.data.tokenizer import load_tokenizer
from mmpipe.hf.tokens import add_image_token
from mmpipe.inference.generate import generate
from mmpipe.inference.sampling import Sampling
from mmpipe.model import ReferenceModel

WORDS = ["<pad>", "<s>", "</s>", "<unk>", "USER:", "ASSISTANT:", "what", "colour", "is", "it", "red", "blue"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}USER: {{ m['content'] }} "
            "{% else %}ASSISTANT: {{ m['content'] }} {{ eos_token }} {% endif %}{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT:{% endif %}")


def _save_tokenizer(path, with_image: bool):
    words = WORDS + (["<image>"] if with_image else [])
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>")
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)
    return len(words)


def _model(vocab: int):
    return ReferenceModel(load_preset("llava-tiny").with_vocab(vocab), seed=2)


def test_placeholder_added_and_embedding_resized(tmp_path):
    n = _save_tokenizer(tmp_path, with_image=False)
    tok = load_tokenizer(str(tmp_path))  # AutoTokenizer from the directory, its own chat template
    assert tok.chat_template == TEMPLATE
    model = _model(n)
    old = model[model.cfg.vision.n_blocks_used + 2].embed_tokens.weight.detach().clone()  # LlavaEmbed
    image_id = add_image_token(tok, model)
    assert image_id == n and model.cfg.text.vocab_size == n + 1 and model.cfg.image_token_id == n
    emb = model[model.cfg.vision.n_blocks_used + 2].embed_tokens.weight
    assert emb.shape == (n + 1, 32) and torch.equal(emb[:n], old)
    assert torch.allclose(emb[n], old.mean(0))
    assert tok("USER: <image> what colour", add_special_tokens=False).input_ids == [4, n, 6, 7]
    # the chat template renders the prompt; N placeholders follow BOS; the (tied) head has n + 1 logits
    prompt = ConversationEncoder(tok, 64).prompt_ids([("user", "what colour is it")])
    assert tok.convert_ids_to_tokens(prompt) == ["<s>", "USER:", "what", "colour", "is", "it", "ASSISTANT:"]
    ids = image_kind(model.cfg).with_images(prompt, model.cfg, None)
    assert ids.count(n) == model.cfg.vision.n_features
    pixels = torch.randn(1, 3, 32, 32)
    logits = model.one_per_row(pixels, torch.tensor([ids]))
    assert logits.shape == (1, len(ids), n + 1)
    # the image reaches the text through the placeholders
    assert not torch.allclose(logits, model.one_per_row(pixels + 1, torch.tensor([ids])))
    assert len(generate(model, pixels, ids, Sampling(eos_id=None, max_new_tokens=3))) == 3


def test_placeholder_already_present_keeps_the_vocabulary(tmp_path):
    n = _save_tokenizer(tmp_path, with_image=True)
    tok = load_tokenizer(str(tmp_path))
    model = _model(n)
    assert add_image_token(tok, model) == n - 1 and model.cfg.text.vocab_size == n and len(tok) == n
