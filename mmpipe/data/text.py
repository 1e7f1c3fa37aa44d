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
read). Sequences are a fixed `text_len` tokens per run; a longer one is refused (`too_long`)
or, under the `truncate` policy, cut to text_len if its first answer token survives.
"""
from __future__ import annotations

from dataclasses import dataclass

import numpy as np

from .records import BadRecord
from .tokenizer import bos_id

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
        """messages: (role, text) pairs, user first, alternating; raises BadRecord('too_long')."""
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
        msgs = [{"role": r, "content": strip_marker(t) if r == "user" else t.strip()} for r, t in messages]
        ids = self.tok(self._render(msgs, generation_prompt=True), add_special_tokens=False).input_ids
        return ids if ids and ids[0] == self.bos else [self.bos] + ids


def pad_sample(e: Encoded, text_len: int, n_img: int, pad_id: int, ignore_index: int) -> tuple[np.ndarray, np.ndarray]:
    """input_ids [text_len] (right-padded) and labels [n_img + text_len]: text token j sits at decoder
    position n_img + j (j >= 1) and is predicted from position n_img + j - 1."""
    input_ids = np.full(text_len, pad_id, dtype=np.int64)
    input_ids[:len(e.ids)] = e.ids
    labels = np.full(n_img + text_len, ignore_index, dtype=np.int64)
    j = np.nonzero(e.target)[0]
    j = j[j >= 1]  # BOS is never predicted
    labels[n_img + j - 1] = e.ids[j]
    return input_ids, labels
