"""The canonical record every data format is read into, and the bad-record vocabulary.

A Record is one training conversation: an optional image reference and alternating user /
assistant messages (a caption pair is one user prompt and one assistant caption). `where` names
its origin as `file:line` (or `dataset[row]`), so a bad record can be reported exactly.
"""
from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

# every reason a record can be refused; the keys of the counts in the log and summary.json
BAD_KINDS = {
    "bad_json": "line or file is not valid JSON",
    "bad_encoding": "text is not valid UTF-8",
    "missing_field": "a required field is missing or has the wrong type",
    "unknown_role": "a conversation turn's role is neither human/user nor gpt/assistant",
    "bad_turns": "turns do not alternate user / assistant, or no assistant turn",
    "empty_answer": "an assistant turn is empty",
    "image_marker": "<image> markers disagree with the record's image (one marker iff an image)",
    "missing_image": "the image file does not exist",
    "empty_image": "the image file is empty or has zero width or height",
    "huge_image": "the image has more pixels than --max-image-pixels (decompression-bomb guard)",
    "corrupt_image": "the image bytes cannot be decoded",
    "too_long": "the text does not fit the sequence budget (--text-len) with its first answer token",
}


class BadRecord(Exception):
    """One record refused, with the reason as one line. kind is a key of BAD_KINDS."""

    def __init__(self, kind: str, reason: str):
        assert kind in BAD_KINDS, kind
        super().__init__(reason)
        self.kind, self.reason = kind, reason


@dataclass
class Record:
    where: str                     # "data/train.jsonl:17", "parquet[42]"
    messages: list[tuple[str, str]]  # (role, text), role "user" | "assistant", starting with user
    image: Any = None              # None, a path (relative to the image root), bytes, or a PIL image
    meta: dict = field(default_factory=dict)
