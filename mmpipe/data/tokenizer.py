"""Tokenizers: the built-in one (no download) or `AutoTokenizer` from a local directory.

The built-in tokenizer is a real PreTrainedTokenizerFast (save_pretrained / AutoTokenizer work)
over the vocabulary of the synthetic shapes task, with its own chat template:
    [BOS] question: <question words> <answer words> [EOS]
The answer follows the question's last word directly. A separator such as moondream's
"Answer:" makes the answer position look up the question's key word first and the image
second; the 1M-parameter demo model does not learn that two-hop lookup in its 10-minute CPU
budget (measured in docs/shapes.md), while one hop from the key word itself is learned in ~2.

A tokenizer from a directory keeps its own chat template; one without a template gets the
model family's prompt format (moondream's "\\n\\nQuestion: ...\\n\\nAnswer: ..."). Nothing is
downloaded: the directory must hold the tokenizer files, and remote code is never trusted.
"""
from __future__ import annotations

import functools
from pathlib import Path

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import AutoTokenizer, PreTrainedTokenizerBase, PreTrainedTokenizerFast

from ..config import ConfigError
from .shapes import VOCABULARY

SPECIALS = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]
PROMPT_WORDS = ["question:"]

# Jinja, as transformers' apply_chat_template renders it. Whitespace is free: the word-level
# pre-tokenizer splits on it.
BUILTIN_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}question: {{ m['content'] }} "
                    "{% else %}{{ m['content'] }} {{ eos_token }} {% endif %}{% endfor %}")
# The leading newlines are a Jinja string: transformers renders with trim_blocks, which drops the
# first newline right after a block tag such as {% if %} ("\n\nQuestion" would become "\nQuestion").
MOONDREAM_TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}"
                      "{{ '\\n\\n' }}Question: {{ m['content'] }}\n\nAnswer:{% else %} {{ m['content'] }}"
                      "{{ eos_token }}"
                      "{% endif %}{% endfor %}")


IMAGE_TOKEN = "<image>"


@functools.lru_cache(maxsize=2)
def builtin_tokenizer(image_token: bool = False) -> PreTrainedTokenizerFast:
    """image_token: with the LLaVA family's `<image>` placeholder as one more special token, the
    last id (36); text never produces it (the data removes `<image>` markers), the data path
    inserts it by id (mmpipe.data.text.placeholders)."""
    words = SPECIALS + PROMPT_WORDS + [w for w in VOCABULARY if w not in PROMPT_WORDS] + [IMAGE_TOKEN] * image_token
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]",
                                   pad_token="[PAD]", unk_token="[UNK]")
    if image_token:
        fast.add_special_tokens({"additional_special_tokens": [IMAGE_TOKEN]})
    fast.chat_template = BUILTIN_TEMPLATE
    return fast


def add_image_token(tok: PreTrainedTokenizerBase) -> int:
    """The id of `<image>` in tok, added as a special token when missing (tok is changed)."""
    if IMAGE_TOKEN not in tok.get_vocab():
        from tokenizers import AddedToken
        tok.add_tokens([AddedToken(IMAGE_TOKEN, special=True, normalized=False)], special_tokens=True)
    return tok.convert_tokens_to_ids(IMAGE_TOKEN)


def load_tokenizer(path: str | None) -> PreTrainedTokenizerBase:
    """The built-in tokenizer (path None or 'builtin'), else AutoTokenizer from a local directory.
    Raises ConfigError with one line when the directory cannot serve as a training tokenizer."""
    if path in (None, "", "builtin"):
        return builtin_tokenizer()
    if not Path(path).is_dir():
        raise ConfigError(f"--tokenizer: {path} is not a directory (give a local tokenizer directory or 'builtin')")
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises OSError/ValueError/... for unusable directories
        raise ConfigError(f"--tokenizer: cannot load a tokenizer from {path}: {str(e).splitlines()[0]}") from None
    if not tok.is_fast:
        raise ConfigError(f"--tokenizer: {path} gives a slow tokenizer; mmpipe needs a fast one (tokenizer.json) "
                          f"for the character offsets that place the labels")
    if tok.eos_token_id is None:
        raise ConfigError(f"--tokenizer: {path} has no eos_token; answers need one to stop")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # pads are never attended to (causal, right padding) nor labelled
    if tok.chat_template is None:
        tok.chat_template = MOONDREAM_TEMPLATE
    return tok


def bos_id(tok: PreTrainedTokenizerBase) -> int:
    """The sequence's first token, after which the image is spliced. Tokenizers without a BOS
    (GPT-2 style, as moondream's) start with EOS, which is what moondream does."""
    return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
