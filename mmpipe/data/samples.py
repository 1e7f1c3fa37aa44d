"""Position -> sample, for the built-in shapes set and for an indexed user dataset.

Both answer tokens(pos) -> (Encoded, n_images) without touching an image (what the last stage
needs; Encoded.image_at says where each image's placeholders go) and pixels(pos, k) -> image k,
normalised [3, S, S] (what the first stage adds), plus row(pos), the sample's stable id (the shapes
index, or the record's number in its source file). n_images is an int: code written for one image
reads it as has_image (at most 1 under --max-images 1, the default).
"""
from __future__ import annotations

import dataclasses
import functools
from dataclasses import dataclass

import numpy as np
import torch

from ..config import ModelConfig
from .crops import Crops, make_transform
from .image_kinds import image_kind, image_rule
from .images import open_image
from .index import DataIndex
from .records import BadRecord, ImageSlot, VideoRef
from .shapes import ShapesVQA
from .sources import Source
from .text import IMAGE_MARKER, ConversationEncoder, Encoded
from .tokenizer import builtin_tokenizer
from .video import media_count

SHAPES_TEXT_LEN = 12  # longest shapes text, BOS + question: what colour is in the top-left + cyan + EOS, is 10 tokens


class ShapesSamples:
    """The built-in set as an endless ordered stream: position p is ShapesVQA sample p. A family whose images take
    a row budget (its image kind's unit: a family of patches' P, tiles' T crops) reads each S x S image as its
    rule makes it: patches or crops, its grid that of S x S."""
    index = source = None  # generated, not read: no data index or source file (IndexedSamples has both)

    def __init__(self, cfg: ModelConfig, seed: int, split: str = "train", budget: int = 0):
        self.data = ShapesVQA(cfg.vision.image_size, cfg.vision.patch_size, split, seed)
        self.tok = builtin_tokenizer()
        self.encoder = ConversationEncoder(self.tok, SHAPES_TEXT_LEN)
        self.rule = image_rule(cfg, budget)
        self.transform = self.rule.patches if self.rule else make_transform(cfg.vision, resize="squash")
        self.grids = np.array([self.rule.grid(cfg.vision.image_size, cfg.vision.image_size)] if self.rule else
                              np.zeros((0, 3)), dtype=np.int64)
        self.pad_id = self.tok.pad_token_id

    def tokens(self, pos: int) -> tuple[Encoded, int]:
        s = self.data.sample(pos)
        enc = self._encode(s.question, s.answer)
        return (dataclasses.replace(enc, grids=self.grids) if self.rule else enc), 1

    @functools.lru_cache(maxsize=None)
    def _encode(self, question: str, answer: str) -> Encoded:
        # The set has 108 distinct (question, answer) pairs (count 4, colour_of_shape 5 x 6,
        # shape_of_colour 6 x 5, where_is_shape 5 x 4, colour_at_quarter 4 x 6). Rendering the chat
        # template four times per sample cost ~1 ms, 16 ms per micro-batch of 16 on the last stage,
        # which loads without workers; RowSet only reads the arrays (sample_sequence), so sharing them is safe.
        return self.encoder.encode([("user", question), ("assistant", answer)], n_images=1)  # image_at [1]

    def pixels(self, pos: int, k: int = 0) -> torch.Tensor | Crops:
        assert k == 0, k  # one image per sample
        out = self.transform(self.data.render(self.data.sample(pos)))
        return out[0] if self.rule else out

    def row(self, pos: int) -> int:
        return pos


@dataclass(frozen=True)
class ImageReader:
    """How a record's images become the model's pixels: opened under image_root with the pixel guard, then the
    family's grid rule (a dynamic family's PatchRule: patches, mmpipe.data.patches; any-resolution tiles'
    TileRule: crops, mmpipe.data.anyres) or, for fixed-size images, the transform (resize, --augment)."""
    image_root: str
    max_pixels: int
    rule: object = None
    transform: object = None
    kind: object = None  # its image kind (mmpipe.data.image_kinds), which reads a record's clips


def image_reader(cfg: ModelConfig, image_root: str, max_pixels: int, *, resize: str = "pad", augment: bool = False,
                 budget: int = 0) -> ImageReader:
    """budget: the row's vision budget (mmpipe.data.image_kinds)."""
    rule = image_rule(cfg, budget)
    return ImageReader(image_root, max_pixels, rule,
                       None if rule else make_transform(cfg.vision, resize=resize, augment=augment), image_kind(cfg))


class IndexedSamples:
    """A user dataset's good records, reshuffled every epoch by (seed, epoch)."""

    def __init__(self, index: DataIndex, source: Source, reader: ImageReader, *, seed: int, pad_id: int,
                 ordered: bool = False):
        """ordered: position p is good record p in file order, no reshuffling (a validation set)."""
        self.index, self.source, self.seed, self.pad_id, self.ordered = index, source, seed, pad_id, ordered
        self.reader, self.rule = reader, reader.rule

    @functools.lru_cache(maxsize=2)
    def _order(self, epoch: int) -> np.ndarray:
        return np.random.default_rng([self.seed, epoch]).permutation(len(self.index))

    def entry(self, pos: int) -> int:
        if self.ordered:
            return pos % len(self.index)
        epoch, k = divmod(pos, len(self.index))
        return int(self._order(epoch)[k])

    def tokens(self, pos: int) -> tuple[Encoded, int]:
        n, ix = self.entry(pos), self.index
        sl = slice(ix.offsets[n], ix.offsets[n + 1])
        return (Encoded(ix.tokens[sl], ix.target[sl], image_at=ix.images_of(n), grids=ix.grids_of(n)),
                int(ix.n_images[n]))

    def pixels(self, pos: int, k: int = 0) -> torch.Tensor | Crops:
        """Image k of the sample (in the order of its <image> markers)."""
        row = self.row(pos)
        try:
            kind = self.reader.kind
            rec = kind.with_timestamps(self.source.record(row), self.rule, self.reader.image_root, IMAGE_MARKER)
            if k >= len(rec.images):
                raise IndexError(f"record {row} has {len(rec.images)} image(s), not an image {k}")
            if isinstance(rec.images[k], VideoRef):  # a clip at its marker's place: its sampled frames' patches
                return kind.clip_pixels(rec.images[k], self.rule, self.reader.image_root, media_count(rec.images),
                                        self.index.grids_of(self.entry(pos))[k])
            if isinstance(rec.images[k], ImageSlot):  # a slot its family's processor cuts an image into (crops)
                return kind.slot_pixels(rec.images[k], self.reader.image_root, self.reader.max_pixels)
            image = open_image(rec.images[k], self.reader.image_root, self.reader.max_pixels)
            if self.rule is None:
                return self.reader.transform(image)
            patches, grid = self.rule.patches(image, kind.images_count(rec.images))  # a clip: one medium
            stored = tuple(int(g) for g in self.index.grids_of(self.entry(pos))[k])
            if grid != stored[:len(grid)]:  # a family whose clips take a step column: an image's (t, h, w) first
                raise RuntimeError(f"{row}: image {k} gives grid {grid}, the index recorded {stored}: the data "
                                   f"changed after it was checked at start-up; restore it, or start a new run")
            return patches
        except BadRecord as e:
            # checked before training; failing now means the files changed under the run
            raise RuntimeError(f"{getattr(e, 'where', row)}: {e.reason}: the data changed after it was checked "
                               f"at start-up; restore it, or start a new run") from None

    def row(self, pos: int) -> int:
        return int(self.index.rows[self.entry(pos)])


class EvalSet:
    """A finite validation set of `size` samples at positions 0..size-1 of `samples`. Positions past
    the end (a step's last micro-batches, which must keep the pipeline's fixed shape) repeat sample
    0 with no answer token labelled: they add nothing to the loss sum or the token count."""

    def __init__(self, samples, size: int):
        self.samples, self.size, self.pad_id = samples, size, samples.pad_id

    def tokens(self, pos: int) -> tuple[Encoded, int]:
        if pos < self.size:
            return self.samples.tokens(pos)
        enc, n_images = self.samples.tokens(0)
        return dataclasses.replace(enc, target=np.zeros_like(enc.target)), n_images

    def pixels(self, pos: int, k: int = 0) -> torch.Tensor:
        return self.samples.pixels(pos if pos < self.size else 0, k)

    def row(self, pos: int) -> int:
        return self.samples.row(pos if pos < self.size else 0)

    def answer_tokens(self) -> int:
        """Labelled positions in the whole set: the validation loss's denominator (BOS never predicted)."""
        return sum(int(enc.target[1:].sum()) for enc, _ in map(self.samples.tokens, range(self.size)))
