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

The `moondream` prompt format (`--prompt-format moondream`, and what `mmpipe import --moondream
--tokenizer DIR` saves) is moondream2's own: token-id templates, not text (MOONDREAM below). It is
carried by the tokenizer itself, as a marker chat template (MOONDREAM_IDS_TEMPLATE): so a run's
tokenizer/ brings it to `--init-from`, `mmpipe generate` and `mmpipe eval`, and the data index's
fingerprint (which includes the chat template) tells the two formats apart.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from pathlib import Path
from typing import TYPE_CHECKING

from tokenizers import Tokenizer, models, pre_tokenizers

if TYPE_CHECKING:  # transformers is imported where a tokenizer is made: ~0.5 s of CPU per process that needs none
    from transformers import PreTrainedTokenizerBase, PreTrainedTokenizerFast

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


@dataclass(frozen=True)
class MoondreamTokens:
    """moondream2's tokenizer ids and prompt templates: `TokenizerConfig` in moondream/torch/config.py
    of vikhyat/moondream at MOONDREAM_COMMIT, used with its starmie-v1 tokenizer. How moondream uses
    them (moondream/torch/moondream.py there):
      query    BOS, image, query_prefix, the question's ids (Tokenizer.encode), query_suffix TWICE:
               `query()` builds prefix + question + suffix and, without reasoning, appends the suffix
               again (`prompt_tokens[0] += ...["suffix"]`); with reasoning the second one follows the
               thinking tokens instead. A text-only query is the same ids without the image.
      caption  BOS, image, caption[length] (no question); `caption()` defaults to "normal".
      decoding `_generate_answer`: the first answer token is picked from the prompt's logits as they
               are; every later step sets the logit of answer_id to -inf; generation ends at eos_id.
    (moondream's config/config_md2.json and config_md05.json carry the older GPT-2-tokenizer
    templates, BOS/EOS 50256 and "\\n\\nQuestion:"-style ids: the text template MOONDREAM_TEMPLATE.)"""
    bos_id: int = 0
    eos_id: int = 0
    answer_id: int = 3
    query_prefix: tuple[int, ...] = (1, 15381, 2)
    query_suffix: tuple[int, ...] = (3,)
    caption_short: tuple[int, ...] = (1, 32708, 2, 12492, 3)
    caption_normal: tuple[int, ...] = (1, 32708, 2, 6382, 3)
    caption_long: tuple[int, ...] = (1, 32708, 2, 4059, 3)

    @property
    def max_id(self) -> int:
        return max(self.query_prefix + self.query_suffix + self.caption_short + self.caption_normal
                   + self.caption_long + (self.bos_id, self.eos_id, self.answer_id))


MOONDREAM_COMMIT = "44146f139242dacdf7c02b799e68097424a31036"
MOONDREAM = MoondreamTokens()
PROMPT_FORMATS = ("chat", "moondream")
# The marker of the moondream prompt format. Its prompts are built by id (mmpipe.data.text), never
# rendered: anything else that renders this template (transformers' apply_chat_template) fails loudly
# rather than producing a text prompt the weights were not trained on.
MOONDREAM_IDS_MARK = "mmpipe prompt format: moondream"
MOONDREAM_IDS_TEMPLATE = ("{#- " + MOONDREAM_IDS_MARK + " (token-id templates of moondream2's TokenizerConfig) -#}"
                          "{{ raise_exception('moondream prompts are token-id templates; mmpipe.data.text builds "
                          "them, not this chat template') }}")


def uses_moondream_ids(tok) -> bool:
    """True when tok is in the moondream prompt format (its chat template is the marker)."""
    template = getattr(tok, "chat_template", None)
    return isinstance(template, str) and MOONDREAM_IDS_MARK in template


IMAGE_TOKEN = "<image>"
# what AutoTokenizer reads a tokenizer from (a fast one's tokenizer.json; a slow one's vocabulary files)
TOKENIZER_FILES = ("tokenizer.json", "tokenizer_config.json", "tokenizer.model", "spiece.model", "vocab.json",
                   "vocab.txt")


@functools.lru_cache(maxsize=2)
def builtin_tokenizer(image_token: bool = False) -> PreTrainedTokenizerFast:
    """image_token: with the LLaVA family's `<image>` placeholder as one more special token, the
    last id (36); the data takes the `<image>` markers it tokenises out of the ids (they only say where an
    image goes, mmpipe.data.text) and inserts the placeholders by id (mmpipe.data.text.placeholders)."""
    from transformers import PreTrainedTokenizerFast
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


def load_tokenizer(path: str | None, prompt_format: str | None = None, flag: str = "--tokenizer"
                   ) -> PreTrainedTokenizerBase:
    """The built-in tokenizer (path None or 'builtin'), else AutoTokenizer from a local directory.
    prompt_format: None keeps the directory's own (moondream's when it carries the marker, else its chat
    template); 'moondream' puts it in moondream's token-id format (as_moondream); 'chat' uses a chat
    template (the text fallback replaces the moondream marker).
    Raises ConfigError with one line when the directory cannot serve as a training tokenizer, naming
    `flag`, the option the directory came from (--checkpoint: the model's own, no --tokenizer given)."""
    assert prompt_format in (None,) + PROMPT_FORMATS, prompt_format
    if path in (None, "", "builtin"):
        if prompt_format == "moondream":
            raise ConfigError("--prompt-format moondream: needs moondream's own tokenizer (--tokenizer DIR, a local "
                              "copy of its starmie-v1 tokenizer.json); the built-in one has none of its template ids")
        return builtin_tokenizer()
    hint = "" if flag == "--tokenizer" else "; give --tokenizer DIR, the tokenizer the model was trained with"
    if not Path(path).is_dir():
        raise ConfigError(f"{flag}: {path} is not a directory (give a local tokenizer directory or 'builtin')")
    if not any((Path(path) / f).is_file() for f in TOKENIZER_FILES):
        raise ConfigError(f"{flag}: {path} holds no tokenizer (none of {', '.join(TOKENIZER_FILES)}){hint}")
    from transformers import AutoTokenizer  # its import loads transformers.models: ~0.2 s more than the built-in's
    try:
        tok = AutoTokenizer.from_pretrained(path, local_files_only=True, trust_remote_code=False)
    except Exception as e:  # transformers raises OSError/ValueError/... for unusable directories
        why = " ".join(str(e).split())  # all of it, on one line: transformers' first line ends mid-sentence
        raise ConfigError(f"{flag}: cannot load a tokenizer from {path}: {why}{hint}") from None
    if not tok.is_fast:
        raise ConfigError(f"{flag}: {path} gives a slow tokenizer; mmpipe needs a fast one (tokenizer.json) "
                          f"for the character offsets that place the labels")
    if prompt_format == "moondream" or (prompt_format is None and uses_moondream_ids(tok)):
        return as_moondream(tok, path)
    if tok.eos_token_id is None:
        raise ConfigError(f"{flag}: {path} has no eos_token; answers need one to stop")
    if tok.pad_token_id is None:
        tok.pad_token = tok.eos_token  # pads are never attended to (causal, right padding) nor labelled
    if tok.chat_template is None or uses_moondream_ids(tok):  # 'chat' asked for on a moondream-format one
        tok.chat_template = MOONDREAM_TEMPLATE
    return tok


def as_moondream(tok: PreTrainedTokenizerBase, path: str) -> PreTrainedTokenizerBase:
    """tok in the moondream prompt format (changed in place): BOS, EOS and pad are id 0 as moondream's
    TokenizerConfig has them (starmie-v1's tokenizer.json names no BOS/EOS, so they are set here), and
    the chat template is the marker. Refused: a tokenizer whose BOS/EOS is another id (the tokenizer.json
    of older moondream2 snapshots is the GPT-2 one, 50256), or one too small for the templates' ids."""
    for what, tid in (("EOS", tok.eos_token_id), ("BOS", tok.bos_token_id)):
        if tid is not None and tid != MOONDREAM.eos_id:
            raise ConfigError(f"--tokenizer: {path}'s {what} is id {tid}, but moondream's prompt format needs its "
                              f"starmie-v1 tokenizer (BOS and EOS id {MOONDREAM.eos_id}; the tokenizer.json of older "
                              f"moondream2 snapshots is the GPT-2 one, EOS 50256)")
    if len(tok) <= MOONDREAM.max_id:
        raise ConfigError(f"--tokenizer: {path} has {len(tok)} tokens, but moondream's prompt templates use ids up "
                          f"to {MOONDREAM.max_id}; give moondream's starmie-v1 tokenizer")
    special = tok.convert_ids_to_tokens(MOONDREAM.eos_id)
    tok.eos_token = tok.bos_token = special
    if tok.pad_token_id is None:
        tok.pad_token = special  # pads are never attended to (causal, right padding) nor labelled
    tok.chat_template = MOONDREAM_IDS_TEMPLATE
    return tok


def bos_id(tok: PreTrainedTokenizerBase) -> int:
    """The sequence's first token, after which the image is spliced. Tokenizers without a BOS
    (GPT-2 style, as moondream's) start with EOS, which is what moondream does."""
    return tok.bos_token_id if tok.bos_token_id is not None else tok.eos_token_id
