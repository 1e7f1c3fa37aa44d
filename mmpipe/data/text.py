"""Conversations -> token ids and labels, through the tokenizer's chat template.

Labels come from character spans, so any chat template works without per-template code:
the conversation is rendered once in full and once per assistant turn up to that turn (with the
generation prompt), which gives each assistant reply's character span [start, end) including its
end-of-turn tokens but not the whitespace a template puts after them (as HF's assistant masks);
a token is a target when its characters overlap a reply span. Worked example
with the built-in template (word-level, one token per word):

    text    [BOS] question: what shape is red circle [EOS]
    target    0       0       0    0   0  0    1      1      -> loss on "circle" and [EOS] only

The image is not in the text: it is spliced after the first token (BOS) by the model, so the
`<image>` marker of LLaVA-style data is removed here (its count was checked when the record was
read). The LLaVA family reads its image from placeholder ids inside input_ids instead
(`placeholders(cfg)`: vision.n_features copies of image_token_id); pad_sample puts them right
after BOS for a sample with an image, the layout moondream's spliced image has. Sequences are a
fixed `text_len` tokens per run; a longer one is refused (`too_long`) or, under the `truncate`
policy, cut to text_len if its first answer token survives.

The moondream prompt format (a tokenizer marked by mmpipe.data.tokenizer.as_moondream) is built by
id instead, exactly as moondream2 lays out a query (MOONDREAM, moondream/torch/config.py and
moondream.py at MOONDREAM_COMMIT): BOS, the query prefix, the question's ids, the query suffix
twice, then the answer's ids and EOS, which are the targets. With the ids of moondream's
TokenizerConfig (question "what colour", answer "red", word ids 40, 41 and 42):

    ids     0  1  15381  2  40  41  3  3  42  0      (the image is spliced after the first 0)
    target  0  0    0    0   0   0  0  0   1  1

A record without a question (an `<image>`-only user turn, or a data config's "prompt": "") gets
moondream's caption template instead: BOS, 1 32708 2 6382 3 ("normal" length), then the caption.
moondream has no multi-turn template, so a record with more than one question is a bad record.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .records import BadRecord
from .tokenizer import MOONDREAM, bos_id, uses_moondream_ids

IMAGE_MARKER = "<image>"
OVERLONG = ("skip", "truncate")


def strip_marker(text: str) -> str:
    return text.replace(IMAGE_MARKER, "").strip()


@dataclass
class Encoded:
    ids: np.ndarray      # int64 [n], n <= text_len, starts with BOS
    target: np.ndarray   # bool  [n], True where the token is an answer token (predicted, in the loss)
    truncated: bool = False


class ConversationEncoder:
    def __init__(self, tokenizer, text_len: int, overlong: str = "skip"):
        assert overlong in OVERLONG, overlong
        self.tok, self.text_len, self.overlong = tokenizer, text_len, overlong
        self.bos = bos_id(tokenizer)
        self.moondream = uses_moondream_ids(tokenizer)

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        return self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)

    def reply_spans(self, messages: list[dict]) -> tuple[str, list[tuple[int, int]]]:
        text = self._render(messages)
        spans = []
        for i, m in enumerate(messages):
            if m["role"] != "assistant":
                continue
            start = len(self._render(messages[:i], generation_prompt=True))
            end = len(self._render(messages[:i + 1]).rstrip())  # a template's newline after the turn is not taught
            if not text.startswith(self._render(messages[:i + 1])):
                raise ValueError("the chat template renders a conversation's prefix differently from the whole; "
                                 "reply spans cannot be located (give a prefix-stable --chat-template)")
            spans.append((start, end))
        return text, spans

    def encode(self, messages: list[tuple[str, str]]) -> Encoded:
        """messages: (role, text) pairs, user first, alternating; raises BadRecord('too_long'), and in the
        moondream format BadRecord('bad_turns') for more than one question."""
        if self.moondream:
            ids, target = self._moondream_ids(messages)
        else:
            msgs = [{"role": r, "content": strip_marker(t) if r == "user" else t.strip()} for r, t in messages]
            text, spans = self.reply_spans(msgs)
            enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
            ids = list(enc.input_ids)
            target = [any(s < e_tok and b_tok < e for s, e in spans) for b_tok, e_tok in enc.offset_mapping]
            if not ids or ids[0] != self.bos:
                ids, target = [self.bos] + ids, [False] + target
        if len(ids) > self.text_len:
            first = target.index(True) if True in target else len(ids)
            if self.overlong == "skip" or first >= self.text_len:
                raise BadRecord("too_long", f"{len(ids)} text tokens > --text-len {self.text_len}"
                                + ("" if self.overlong == "skip" else
                                   f" and the first answer token (token {first}) would be cut"))
            ids, target = ids[:self.text_len], target[:self.text_len]
            return Encoded(np.array(ids, dtype=np.int64), np.array(target, dtype=bool), truncated=True)
        return Encoded(np.array(ids, dtype=np.int64), np.array(target, dtype=bool))

    def prompt_ids(self, messages: list[tuple[str, str]]) -> list[int]:
        """A conversation ending in a user turn, rendered with the generation prompt: what generation
        continues from."""
        if self.moondream:
            if len(messages) != 1:
                raise ValueError(f"the moondream prompt format takes one question, not {len(messages)} turns")
            return self._moondream_prompt(messages[0][1])
        msgs = [{"role": r, "content": strip_marker(t) if r == "user" else t.strip()} for r, t in messages]
        ids = self.tok(self._render(msgs, generation_prompt=True), add_special_tokens=False).input_ids
        return ids if ids and ids[0] == self.bos else [self.bos] + ids

    # ---- the moondream prompt format: moondream2's token-id templates (module docstring) ----

    def _moondream_prompt(self, question: str) -> list[int]:
        """moondream's `query()` ids without reasoning: BOS, prefix, the question as moondream encodes it
        (the tokenizers library's encode with its defaults), the suffix, and the suffix again (query()
        appends it a second time where reasoning would put its thinking tokens). No question: `caption()`'s
        "normal" template."""
        question = strip_marker(question)
        if not question:
            return [MOONDREAM.bos_id, *MOONDREAM.caption_normal]
        return [MOONDREAM.bos_id, *MOONDREAM.query_prefix, *self.tok.backend_tokenizer.encode(question).ids,
                *MOONDREAM.query_suffix, *MOONDREAM.query_suffix]

    def _moondream_ids(self, messages: list[tuple[str, str]]) -> tuple[list[int], list[bool]]:
        if len(messages) != 2:
            raise BadRecord("bad_turns", f"{len(messages)} turns: the moondream prompt format takes one question and "
                                         f"its answer (moondream has no multi-turn template)")
        prompt = self._moondream_prompt(messages[0][1])
        # the answer as generation produces it: its own tokens (no post-processor's), then EOS
        answer = self.tok.backend_tokenizer.encode(messages[1][1].strip(), add_special_tokens=False).ids
        answer = [*answer, MOONDREAM.eos_id]
        return prompt + answer, [False] * len(prompt) + [True] * len(answer)


def answer_id_of(tok) -> int | None:
    """The id decoding must not produce after an answer's first token: moondream's answer marker
    (TokenizerConfig.answer_id 3) for a tokenizer in the moondream format, whose `_generate_answer`
    sets its logit to -inf on every step after the first; None for chat templates."""
    return MOONDREAM.answer_id if uses_moondream_ids(tok) else None


def placeholders(cfg) -> tuple[int, int]:
    """(token id, count) of the image placeholders a sample with an image carries in input_ids:
    (image_token_id, vision.n_features) for the LLaVA family, e.g. (32000, 576); (-1, 0) otherwise
    (the image is spliced in by the model, or attended to)."""
    if not cfg.layout.placeholders:
        return -1, 0
    return cfg.image_token_id, cfg.vision.n_features


def decoder_positions(cfg, text_len: int) -> int:
    """Decoder positions per sample, pads included: spliced image + placeholders + text, e.g.
    moondream-shaped 16 + 0 + 12 = 28, LLaVA-shaped 0 + 16 + 12 = 28."""
    return cfg.n_image_positions + placeholders(cfg)[1] + text_len


def with_placeholders(ids: list[int], cfg) -> list[int]:
    """A prompt (BOS first) with the family's image placeholders after BOS (none outside LLaVA)."""
    token, n = placeholders(cfg)
    return list(ids[:1]) + [token] * n + list(ids[1:])


def pad_sample(e: Encoded, text_len: int, n_img: int, pad_id: int, ignore_index: int, *,
               image_token: tuple[int, int] = (-1, 0), has_image: bool = True) -> tuple[np.ndarray, np.ndarray]:
    """input_ids [n_ph + text_len] (right-padded) and labels [n_img + n_ph + text_len], n_ph the
    placeholder count of image_token = (id, n_ph) (`placeholders(cfg)`). A sample with an image gets
    the n_ph placeholder ids right after BOS (a text-only one none, so more padding); text token j
    (j >= 1) then sits at decoder position k + j, k = n_img + (n_ph if has_image else 0), and is
    predicted from position k + j - 1. Placeholder positions are never labelled."""
    token, n_ph = image_token
    k = n_ph if has_image else 0
    ids = np.concatenate([e.ids[:1], np.full(k, token, dtype=np.int64), e.ids[1:]]) if k else e.ids
    input_ids = np.full(n_ph + text_len, pad_id, dtype=np.int64)
    input_ids[:len(ids)] = ids
    labels = np.full(n_img + n_ph + text_len, ignore_index, dtype=np.int64)
    j = np.nonzero(e.target)[0]
    j = j[j >= 1]  # BOS is never predicted
    labels[n_img + k + j - 1] = e.ids[j]
    return input_ids, labels
