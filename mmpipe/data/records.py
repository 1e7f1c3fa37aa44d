"""The canonical record every data format is read into, and the bad-record vocabulary.

A Record is one training conversation: its image references (none, one, or several in the order
of their `<image>` markers) and alternating user / assistant messages (a caption pair is one user
prompt and one assistant caption). `where` names
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
    "empty_answer": "an assistant turn is empty (mmpipe eval: or its first answer tokenizes to no token)",
    "empty_prompt": "mmpipe eval: the prompt tokenizes to no token and the record has no image",
    "image_marker": "<image> markers in the user turns disagree with the record's images (one marker per image)",
    "too_many_images": "the record has more images than --max-images",
    "missing_image": "the image file does not exist",
    "empty_image": "the image file is empty or has zero width or height",
    "huge_image": "the image has more pixels than --max-image-pixels (decompression-bomb guard)",
    "corrupt_image": "the image bytes cannot be decoded",
    "too_many_patches": "the image's patch grid is larger than an image may take in a row (--max-patches)",
    "too_many_tiles": "the sample's images make more crops (base crops + tiles) than a row holds (--max-tiles)",
    "bad_aspect": "the image's aspect ratio is beyond what the image processor takes (200:1; any-resolution tiles: "
                  "no feature left after unpadding)",
    "bad_video": "the video file is missing or cannot be opened or decoded",
    "empty_video": "the video has no video stream, no frames, or too few frames for one temporal patch",
    "video_marker": "<video> markers in the user turns disagree with the record's videos (one marker per video)",
    "unsupported_media": "the record carries media its model family does not read (a video for an image-only family)",
    "equal_answers": "--objective dpo: a preference pair's chosen and rejected answers are the same",
    "too_long": "the text does not fit the sequence budget (--text-len) with its first answer token",
}


# What a record may carry besides text, by the names a family declares (mmpipe.registry.Family.media):
# each kind's record fields and its marker in the text. A record with a kind its family does not read is a bad
# record (unsupported_media), never trained as the text around it.
MEDIA_FIELDS = {"image": ("image",), "video": ("video", "videos"), "audio": ("audio", "audios")}
MEDIA_MARKERS = {"image": "<image>", "video": "<video>", "audio": "<audio>"}  # audio: no family reads it (Gemma 4's)


def carried_media(raw: dict, columns: dict) -> dict[str, str]:
    """{kind: what shows it} for each media kind a raw record carries: a non-empty field (the data config's column
    name where it maps the kind, e.g. its image column) or the kind's marker in any text value of the record."""
    found = {}
    for kind, names in MEDIA_FIELDS.items():
        names = (columns.get(kind, names[0]), *names[1:])
        field_name = next((n for n in names if raw.get(n) not in (None, "", [])), None)
        if field_name is not None:
            found[kind] = f"its '{field_name}' field"
        elif MEDIA_MARKERS[kind] in _texts(raw):
            found[kind] = f"a {MEDIA_MARKERS[kind]} marker"
    return found


def _texts(value) -> str:
    """Every string inside a raw record (conversation turns, captions, prompts), joined: where markers can be."""
    if isinstance(value, str):
        return value
    if isinstance(value, dict):
        return "\n".join(_texts(v) for v in value.values())
    if isinstance(value, list):
        return "\n".join(_texts(v) for v in value)
    return ""


def refuse_unread_media(raw: dict, columns: dict, media: tuple[str, ...], family: str) -> None:
    """BadRecord unsupported_media if the record carries a media kind outside `media` (the family's)."""
    for kind, shown_by in carried_media(raw, columns).items():
        if kind not in media:
            raise BadRecord("unsupported_media", f"the record carries a {kind} ({shown_by}); the {family} family "
                                                 f"reads {' and '.join(media) or 'text'} only")


def with_markers(messages: list, marker: str, texts: list[str]) -> list:
    """The messages with the user turns' k-th `marker` replaced by texts[k] (a clip's frames with their words, a
    pan-and-scan image's blocks: what one marker of the record expands to), in order; a marker past the texts stays."""
    out, k = [], 0
    for role, text in messages:
        parts = text.split(marker)
        if role == "user" and len(parts) > 1:
            text = parts[0]
            for part in parts[1:]:
                text += (texts[k] if k < len(texts) else marker) + part
                k += 1
        out.append((role, text))
    return out


@dataclass(frozen=True)
class VideoRef:
    """A clip in a record's media list (Record.images, at its <video> marker's place among the images): its path,
    relative to the image root. Read by a family whose media include video (mmpipe.data.video). frame j >= 0: the
    clip's j-th temporal patch alone, a slot of its own (Qwen3-VL's clips, mmpipe.data.video.with_timestamps)."""
    path: str
    frame: int = -1


@dataclass(frozen=True, eq=False)
class ImageSlot:
    """Slot `crop` of the `of` slots a family's image processor cuts a record's image into (Gemma 3's pan-and-scan,
    mmpipe.data.gemma3: 0 the whole image, j >= 1 its j-th crop), each at a marker of its own: its pixels are the
    family's image kind's (slot_pixels), its image checked once (at crop 0) when the index is built."""
    ref: Any
    crop: int
    of: int


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
    images: list[Any] = field(default_factory=list)  # each a path (relative to the image root), bytes, an
    # HF {"bytes", "path"} dict or a PIL image; image k belongs at the k-th <image> marker (a clip: a VideoRef,
    # its <video> marker made an <image> one, mmpipe.data.sources.with_videos)
    meta: dict = field(default_factory=dict)

    @property
    def image(self) -> Any:
        """The first image, or None (what one-image code reads)."""
        return self.images[0] if self.images else None
