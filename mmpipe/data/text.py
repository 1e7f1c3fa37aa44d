"""Conversations -> token ids and labels, through the tokenizer's chat template.

Labels come from character spans, so any chat template works without per-template code:
the conversation is rendered once in full and once per assistant turn up to that turn (with the
generation prompt), which gives each assistant reply's character span [start, end) including its
end-of-turn tokens but not the whitespace a template puts after them (as HF's assistant masks);
a token is a target when its characters overlap a reply span. Worked example
with the built-in template (word-level, one token per word):

    text    [BOS] question: what shape is red circle [EOS]
    target    0       0       0    0   0  0    1      1      -> loss on "circle" and [EOS] only

Images are not text tokens. The moondream family splices its image after the first token (BOS)
in the model, so the `<image>` markers of LLaVA-style data are removed here (their count was
checked when the record was read). The LLaVA family reads each image from a block of placeholder
ids inside input_ids (its image kind's block: vision.n_features copies of image_token_id), and, as
Hugging Face's LLaVA processor does, at the image's `<image>` marker: with `markers=True` the
markers stay in the rendered text, are located after tokenisation and taken out of the ids, and
Encoded.image_at[k] says before which text token image k's block goes. Without markers (pairs, the
shapes set, the moondream prompt format) every image goes right after BOS (image_at 1), the layout
moondream's spliced image has. --text-len counts text tokens only. Sequences are a fixed
`text_len` tokens per run; a longer one is refused (`too_long`) or, under the `truncate` policy,
cut to text_len if its first answer token and its images' markers survive.

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

import re
from dataclasses import dataclass, field

import numpy as np

from ..config import ConfigError
from .records import BadRecord
from .tokenizer import BUILTIN_TEMPLATE, MOONDREAM, bos_id, uses_moondream_ids

IMAGE_MARKER = "<image>"
OVERLONG = ("skip", "truncate")
_MARKER = re.compile(re.escape(IMAGE_MARKER))


def strip_marker(text: str) -> str:
    return text.replace(IMAGE_MARKER, "").strip()


class MarkerText(str):
    """An image marker's text (ConversationEncoder's image_text) with the text its family's processor writes on
    either side of each image after the chat template: Gemma3Processor's blank lines, "\\n\\n" + block + "\\n\\n"
    (mmpipe.data.gemma3). They go in after the template, which may trim a turn's ends (Gemma's does), and are
    text, tokenised with their neighbours as the processor's are."""
    before: str
    after: str

    def __new__(cls, text: str, before: str = "", after: str = ""):
        out = super().__new__(cls, text)
        out.before, out.after = before, after
        return out

    def __reduce__(self):  # index workers get it pickled
        return MarkerText, (str(self), self.before, self.after)


def _no_image() -> np.ndarray:
    return np.zeros(0, dtype=np.int64)


@dataclass
class Encoded:
    ids: np.ndarray      # int64 [n], n <= text_len, starts with BOS
    target: np.ndarray   # bool  [n], True where the token is an answer token (predicted, in the loss)
    truncated: bool = False
    # int64 [n_images]: image k's placeholder block goes before ids[image_at[k]] (1: right after BOS).
    # Empty: no image, or one its maker did not place (mmpipe.data.packing.sample_sequence then puts it after BOS).
    image_at: np.ndarray = field(default_factory=_no_image)
    # int64 [n_images, 3]: each image's patch grid (t, h, w), dynamic-resolution families only (mmpipe.data.patches;
    # recorded by the index from the image's size); empty otherwise.
    grids: np.ndarray = field(default_factory=lambda: np.zeros((0, 3), dtype=np.int64))


class ConversationEncoder:
    def __init__(self, tokenizer, text_len: int, overlong: str = "skip", *, markers: bool = False,
                 image_text: str | None = None):
        """markers: keep `<image>` markers in the rendered text and place each image at its own (the LLaVA
        family: its image kind's `markers`); False: strip them, every image goes after BOS. image_text: what a
        marker becomes in the rendered text, the tokenizer's own special tokens for an image (Qwen2-VL's
        <|vision_start|><|image_pad|><|vision_end|>, mmpipe.data.text.image_text), so the text around it
        tokenises as the model's processor has it; a record without markers gets one per image at the start
        of its first user turn (where Qwen's chat template puts an image item), and no BOS is added for a
        tokenizer without one (Qwen's)."""
        assert overlong in OVERLONG, overlong
        self.tok, self.text_len, self.overlong, self.markers = tokenizer, text_len, overlong, markers
        self.image_text = image_text if markers else None
        self.marker = re.compile(re.escape(self.image_text)) if self.image_text else _MARKER
        self.bos = bos_id(tokenizer)
        self.lead_bos = self.image_text is None or tokenizer.bos_token_id is not None
        self.moondream = uses_moondream_ids(tokenizer)

    def _render(self, messages: list[dict], generation_prompt: bool = False) -> str:
        text = self.tok.apply_chat_template(messages, tokenize=False, add_generation_prompt=generation_prompt)
        before, after = getattr(self.image_text, "before", ""), getattr(self.image_text, "after", "")
        return self.marker.sub(lambda m: before + m.group() + after, text) if before or after else text  # MarkerText

    def _messages(self, messages: list[tuple[str, str]], n_images: int | None = None) -> list[dict]:
        keep = self.markers
        out = [{"role": r, "content": (t.strip() if keep else strip_marker(t)) if r == "user" else t.strip()}
               for r, t in messages]
        if self.image_text:
            for m in out:
                if m["role"] == "user":
                    m["content"] = m["content"].replace(IMAGE_MARKER, self.image_text)
            if n_images and not any(self.image_text in m["content"] for m in out):
                first = next(m for m in out if m["role"] == "user")
                first["content"] = self.image_text * n_images + first["content"]
        return out

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

    def _tokenise(self, text: str, n_images: int | None) -> tuple[list[int], list[tuple[int, int]], list[int]]:
        """(ids, character offsets, image_at) of the rendered text, BOS first, with the `<image>` markers
        taken out: a token whose characters overlap a marker is not text (the LLaVA tokenizer's one special
        <image> token; pieces of it for a tokenizer without one). image_at[k] counts the text tokens that
        start before marker k. n_images: the record's images (None: one per marker); no marker: after BOS."""
        enc = self.tok(text, add_special_tokens=False, return_offsets_mapping=True)
        marks = [m.span() for m in self.marker.finditer(text)] if self.markers else []
        n = len(marks) if n_images is None else n_images
        if marks and len(marks) != n:
            raise BadRecord("image_marker", f"{len(marks)} {IMAGE_MARKER} marker(s) for {n} image(s)")
        ids, offsets = [], []
        for tid, (b, e) in zip(enc.input_ids, enc.offset_mapping):
            if not any(b < me and mb < e for mb, me in marks):
                ids.append(tid)
                offsets.append((b, e))
        image_at = [sum(1 for b, _ in offsets if b < mb) for mb, _ in marks]
        if self.lead_bos and (not ids or ids[0] != self.bos):
            ids, offsets, image_at = [self.bos] + ids, [(0, 0)] + offsets, [a + 1 for a in image_at]
        return ids, offsets, image_at or [1] * n

    def encode(self, messages: list[tuple[str, str]], n_images: int | None = None) -> Encoded:
        """messages: (role, text) pairs, user first, alternating; n_images: the record's images (None: one per
        `<image>` marker, none without markers). Raises BadRecord('too_long'), BadRecord('image_marker') when
        markers are kept and their count is neither 0 nor n_images, and in the moondream format
        BadRecord('bad_turns') for more than one question."""
        if self.moondream:
            ids, target = self._moondream_ids(messages)
            image_at = [1] * (n_images or 0)  # moondream's templates are ids: its image always follows BOS
        else:
            text, spans = self.reply_spans(self._messages(messages, n_images))
            ids, offsets, image_at = self._tokenise(text, n_images)
            target = [any(s < e_tok and b_tok < e for s, e in spans) for b_tok, e_tok in offsets]
        at = np.array(image_at, dtype=np.int64)
        if len(ids) <= self.text_len:
            return Encoded(np.array(ids, dtype=np.int64), np.array(target, dtype=bool), image_at=at)
        first = target.index(True) if True in target else len(ids)
        if self.overlong == "skip" or first >= self.text_len:
            raise BadRecord("too_long", f"{len(ids)} text tokens > --text-len {self.text_len}"
                            + ("" if self.overlong == "skip" else
                               f" and the first answer token (token {first}) would be cut"))
        if len(at) and at.max() > self.text_len:  # a block may close the kept text (at == text_len), not follow it
            raise BadRecord("too_long", f"{len(ids)} text tokens > --text-len {self.text_len} and an image's "
                                        f"{IMAGE_MARKER} marker (before token {int(at.max())}) would be cut")
        return Encoded(np.array(ids[:self.text_len], dtype=np.int64), np.array(target[:self.text_len], dtype=bool),
                       truncated=True, image_at=at)

    def prompt(self, messages: list[tuple[str, str]], n_images: int | None = None) -> tuple[list[int], list[int]]:
        """(ids, image_at) of a conversation ending in a user turn, rendered with the generation prompt: what
        generation continues from, and where the prompt's images go (with_placeholders(ids, cfg, image_at)).
        n_images as for encode; raises BadRecord('image_marker') for markers that do not match it."""
        if self.moondream:
            if len(messages) != 1:
                raise ValueError(f"the moondream prompt format takes one question, not {len(messages)} turns")
            return self._moondream_prompt(messages[0][1]), [1] * (n_images or 0)
        ids, _, image_at = self._tokenise(self._render(self._messages(messages, n_images), generation_prompt=True),
                                          n_images)
        return ids, image_at

    def prompt_ids(self, messages: list[tuple[str, str]]) -> list[int]:
        """prompt()'s ids alone."""
        return self.prompt(messages)[0]

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


def image_text(tok, cfg) -> str | None:
    """What an image marker becomes in the rendered text for a family of patches (ConversationEncoder's
    image_text; mmpipe.data.image_kinds asks it for those only): the tokenizer's own tokens at the config's
    vision_start_id, image_token_id and vision_end_id, e.g. Qwen2-VL's '<|vision_start|><|image_pad|><|vision_end|>',
    which must tokenise to exactly those ids. None for the built-in tokenizer, whose one special `<image>` token
    marks the place instead (its block's ids are the config's all the same, mmpipe.data.packing.sample_sequence).
    Raises ConfigError in one line for a tokenizer without them."""
    if getattr(tok, "chat_template", None) == BUILTIN_TEMPLATE:
        return None
    ids = [cfg.vision_start_id, cfg.image_token_id, cfg.vision_end_id]
    names = tok.convert_ids_to_tokens(ids) if all(0 <= i < len(tok) for i in ids) else None
    if names is None or None in names or tok("".join(names), add_special_tokens=False).input_ids != ids:
        raise ConfigError(f"--tokenizer: the {cfg.family} family's image tokens (vision_start_id, image_token_id, "
                          f"vision_end_id = {ids}) are not special tokens of this tokenizer "
                          f"({len(tok)} tokens); give the tokenizer the model was trained with")
    return "".join(names)


def with_placeholders(ids: list[int], token: int, n: int, image_at=None) -> list[int]:
    """A prompt (BOS first) with a block of n placeholders of id `token` (a fixed-size image kind's block:
    mmpipe.data.image_kinds) before ids[a] for each a in image_at (ConversationEncoder.prompt's), or after BOS when
    image_at is None. E.g. ids [1, 5, 6, 7], image_at [2], 3 placeholders of id 50 -> [1, 5, 50, 50, 50, 6, 7]."""
    out = list(ids)
    for a in sorted((1,) if image_at is None else (int(a) for a in image_at), reverse=True):  # last first: the
        out[a:a] = [token] * n  # earlier positions stay where image_at says
    return out
