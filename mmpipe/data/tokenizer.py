"""The built-in tokenizer: a word-level `transformers` tokenizer built in memory, no download.

It is a real PreTrainedTokenizerFast (save_pretrained / AutoTokenizer.from_pretrained work), with
the vocabulary of the synthetic shapes task. Prompt format:
    [BOS] question: <question words> <answer words> [EOS]
The answer follows the question's last word directly. A separator such as moondream's
"Answer:" makes the answer position look up the question's key word first and the image
second; the 1M-parameter demo model does not learn that two-hop lookup in its 10-minute CPU
budget (measured in docs/shapes.md), while one hop from the key word itself is learned in ~2.
"""
from __future__ import annotations

import functools

from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

SPECIALS = ["[PAD]", "[BOS]", "[EOS]", "[UNK]"]
PROMPT_WORDS = ["question:"]


@functools.lru_cache(maxsize=1)
def builtin_tokenizer() -> PreTrainedTokenizerFast:
    from .shapes import VOCABULARY  # the words the task can say
    words = SPECIALS + PROMPT_WORDS + [w for w in VOCABULARY if w not in PROMPT_WORDS]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(words)}, unk_token="[UNK]"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    return PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="[BOS]", eos_token="[EOS]",
                                  pad_token="[PAD]", unk_token="[UNK]")


def prompt_text(question: str) -> str:
    return f"question: {question}"
