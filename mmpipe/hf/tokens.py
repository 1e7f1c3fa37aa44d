"""The LLaVA image placeholder in a real tokenizer: added when missing, the model's vocabulary grown to fit."""
from __future__ import annotations

import dataclasses

import torch
from tokenizers import AddedToken
from torch import nn

from ..model.builder import ReferenceModel
from ..model.llava import LlavaEmbed, LMHeadLinear

IMAGE_TOKEN = "<image>"


def _grow(weight: torch.Tensor, rows: int) -> nn.Parameter:
    """[V, D] -> [V + rows, D]; new rows start at the mean of the old ones (as HF's resize), so the
    new token's logit starts at the average instead of at a random outlier."""
    return nn.Parameter(grown(weight.detach(), rows), requires_grad=weight.requires_grad)


def grown(weight: torch.Tensor, rows: int) -> torch.Tensor:
    """_grow's rows on a plain tensor, in its dtype (a streamed import's bf16 embedding: the mean taken in fp32)."""
    new = weight.float().mean(0, keepdim=True).to(weight.dtype).expand(rows, -1)
    return torch.cat([weight, new], dim=0)


def image_token(tok, vocab_size: int, token: str = IMAGE_TOKEN) -> tuple[int, int]:
    """Make `token` one special token of `tok` when missing: (its id, the vocabulary the model needs, at least
    vocab_size)."""
    if token not in tok.get_vocab():
        tok.add_tokens([AddedToken(token, special=True, normalized=False)], special_tokens=True)
    return tok.convert_tokens_to_ids(token), max(len(tok), vocab_size)


def add_image_token(tok, model: ReferenceModel, token: str = IMAGE_TOKEN) -> int:
    """Make `token` one special token of `tok` and the model's image placeholder; returns its id.
    When the tokenizer grows past the model's vocabulary, the input embedding and an untied head
    get new rows (a tied head shares the embedding's); model.cfg follows."""
    cfg = model.cfg
    token_id, vocab = image_token(tok, cfg.text.vocab_size, token)
    extra = vocab - cfg.text.vocab_size
    for layer in model:
        if isinstance(layer, LlavaEmbed):
            layer.image_token_id = token_id
            if extra:
                layer.embed_tokens.weight = _grow(layer.embed_tokens.weight, extra)
                layer.embed_tokens.num_embeddings = vocab
        elif isinstance(layer, LMHeadLinear) and extra:
            layer.lm_head.weight = _grow(layer.lm_head.weight, extra)
            layer.lm_head.out_features = vocab
    model.cfg = dataclasses.replace(cfg.with_vocab(vocab), image_token_id=token_id)
    return token_id
