"""Rows: fixed-shape micro-batches, the one layout every family trains, validates and evaluates
through (mmpipe.model.stage): one sample per row (the smallest row, M = 1), several images per
sample, and, with --pack, several samples per row.

A row is L = M x N + text_len decoder positions with M image slots (M = --max-images, N decoder
positions per image: the moondream family's spliced image tokens or LLaVA's placeholders): room for
M images and text_len text tokens in any mix. Any one good sample fits (the index refused more than
M images, and longer text by --overlong), so unpacked rows hold one sample each; packed rows hold as
many whole samples as fit. E.g. llava-tiny (N = 16) at M = 4, text_len 96: L = 4 x 16 + 96 = 160;
samples of 16 + 20, 16 + 35, 16 + 12 and 16 + 30 positions fill 161 > 160, so the fourth opens the
next row.

`RowPlan` maps a stream of row positions 0, 1, 2, ... onto the sample stream (mmpipe.data.batches'
positions): chunks of CHUNK consecutive sample positions are packed first-fit, each chunk on its own,
so row r depends only on the samples before it and every rank (first and last stage, every DP
replica) derives the same rows. Steps, DP sharding and --resume then work on row positions exactly
as they do on sample positions: step s consumes rows [s x B, (s + 1) x B), B = micro x GAS x DP.

`LossNorm` is the loss normalisation (--loss-norm): each labelled position gets a weight so that the
step's loss is the mean over the global batch's answer tokens (token, the default: packed == unpacked)
or the mean over its samples of each sample's mean (sample); mmpipe.model.builder.lm_loss sums
CE x weight. DeepSpeed scales each micro-batch loss by 1 / GAS and averages gradients over DP, so
the weight carries GAS x DP: token: GAS x DP / (answer tokens of the step's B rows), e.g. 4 x 2 / 1310.
"""
from __future__ import annotations

import functools
from dataclasses import dataclass
from typing import Callable

import numpy as np
import torch
from torch.utils.data import Dataset

from ..model.builder import IGNORE_INDEX
from .blocks import FixedBlocks, PatchBlocks, TileBlocks
from .crops import Crops, stack_images
from .image_kinds import image_kind
from .preference import same_pairs

CHUNK = 1024  # sample positions packed together: first-fit looks at most this far ahead
LOSS_NORMS = ("token", "sample")


@dataclass(frozen=True)
class RowShape:
    """One row's fixed shape: M image slots and text_len text positions; `images` says what an image takes
    (FixedBlocks: N positions each; PatchBlocks / TileBlocks: a share of the row's vision budget, P patches or
    T crops, and the positions of its grid's block). L = images.positions(M) + text_len, e.g. llava-tiny at M = 4,
    text_len 96: 4 x 16 + 96 = 160."""
    max_images: int
    text_len: int
    images: FixedBlocks | PatchBlocks | TileBlocks

    @property
    def length(self) -> int:
        return self.images.positions(self.max_images) + self.text_len

    @property
    def vision_budget(self) -> int:
        """The row's vision units: P patches or T crops; 0 for fixed-size images."""
        return self.images.budget

    @property
    def image_len(self) -> int:
        """Decoder positions per fixed-size image (0 where images take a budget's share instead)."""
        return getattr(self.images, "image_len", 0)

    @property
    def image_id(self) -> int:
        return self.images.image_id

    def units(self, grid) -> int:
        """Vision units one image of this grid takes: t h w patches, or 1 + rows x cols crops."""
        return self.images.units(grid)

    def tiling(self, grid) -> tuple:
        """A slot's `tiling`: the grid (t, h, w), or (orig_h, orig_w, rows, cols) of an any-resolution grid."""
        return tuple(int(g) for g in grid[:self.images.tiling_width])

    def block_len(self, grid) -> int:
        """len(block(grid)), without building it."""
        return self.images.block_len(grid)

    def block(self, grid=None) -> np.ndarray:
        """One image's decoder ids: N placeholders, the bracketed block of its grid, or its grid's n placeholders."""
        return self.images.block(grid)


def row_shape(cfg, max_images: int, text_len: int, budget: int = 0) -> RowShape:
    """The row of cfg's images (mmpipe.data.image_kinds): budget, the row's vision budget in its kind's unit
    (P patches, T crops; 0: the default for max_images)."""
    return RowShape(max_images, text_len, image_kind(cfg).blocks(cfg, max_images, budget))


def sample_sequence(enc, n_images: int, shape: RowShape) -> tuple[np.ndarray, np.ndarray]:
    """One sample's decoder positions: ids [n] with each image's block (RowShape.block: N placeholder ids,
    or a dynamic family's bracketed block of its grid, enc.grids[k]) inserted before token enc.image_at[k],
    and labels [n] (position p holds the token at p + 1 where that is an answer token; the first token (BOS)
    is never predicted, an image block never labelled)."""
    at = [int(a) for a in enc.image_at[:n_images]] or [1] * n_images  # unplaced: right after BOS
    pieces, targets, prev = [], [], 0
    for k, a in enumerate(at):
        block = shape.block(enc.grids[k] if shape.vision_budget else None)
        pieces += [enc.ids[prev:a], block]
        targets += [enc.target[prev:a], np.zeros(len(block), dtype=bool)]
        prev = a
    ids = np.concatenate(pieces + [enc.ids[prev:]]).astype(np.int64)
    target = np.concatenate(targets + [enc.target[prev:]]).astype(bool)
    target[0] = False  # BOS
    labels = np.full(len(ids), IGNORE_INDEX, dtype=np.int64)
    labels[:-1] = np.where(target[1:], ids[1:], IGNORE_INDEX)
    return ids, labels


class RowPlan:
    """Row position -> the sample positions it holds (in stream order within the row)."""

    def __init__(self, size_of: Callable[[int], tuple], shape: RowShape, pack: bool, chunk: int = CHUNK,
                 unit: int = 1):
        """size_of(pos) -> (decoder positions, images[, vision patches]) of sample pos. unit: consecutive sample
        positions packed together, position u k + j into row j of a group of `unit` rows (2: a preference pair,
        mmpipe.data.preference: rows 2i / 2i + 1 hold the chosen / rejected sides of the same pairs, in the same
        order, so segment s of the two rows is one pair)."""
        self.size_of, self.shape, self.pack, self.chunk, self.unit = size_of, shape, pack, chunk, unit
        self._chunks: list[list[list[int]]] = []
        self._first_row = [0]  # row position of each chunk's first row

    def row(self, r: int) -> list[int]:
        if not self.pack:
            return [r]
        while self._first_row[-1] <= r:
            self._pack_next()
        c = int(np.searchsorted(self._first_row, r, side="right")) - 1
        return self._chunks[c][r - self._first_row[c]]

    def samples_before(self, r: int) -> int:
        """Samples the rows before row position r hold (what a run has consumed after r rows)."""
        return sum(len(self.row(i)) for i in range(r)) if self.pack else r

    def _pack_next(self) -> None:
        """First-fit over one chunk: each unit (a sample; a pair) goes to the first open group of `unit` rows with
        room in each row for its sample's positions, images and (dynamic families) patches, else opens a group;
        groups keep their opening order."""
        start, u = len(self._chunks) * self.chunk, self.unit
        # at most one group per unit: free positions, image slots (and patches) of every row the chunk may open,
        # searched in C (a resume replays every chunk before its row: ~5 ms each, 1M samples ~5 s)
        room = np.full((self.chunk // u, u), self.shape.length, dtype=np.int64)
        slots = np.full((self.chunk // u, u), self.shape.max_images, dtype=np.int64)
        patches = np.full((self.chunk // u, u), self.shape.vision_budget, dtype=np.int64)
        groups: list[list[list[int]]] = []
        for first in range(start, start + self.chunk, u):
            sizes = np.array([self.size_of(first + j) for j in range(u)], dtype=np.int64)  # [u, 2 or 3]
            fits = ((room >= sizes[:, 0]) & (slots >= sizes[:, 1])).all(axis=1)
            if sizes.shape[1] > 2:
                fits &= (patches >= sizes[:, 2]).all(axis=1)
            i = int(np.argmax(fits))  # the first group with room; an unopened one at worst
            if i == len(groups):
                groups.append([[] for _ in range(u)])
            for j in range(u):
                groups[i][j].append(first + j)
            room[i] -= sizes[:, 0]
            slots[i] -= sizes[:, 1]
            patches[i] -= sizes[:, 2] if sizes.shape[1] > 2 else 0
        rows = [row for group in groups for row in group]
        self._chunks.append(rows)
        self._first_row.append(self._first_row[-1] + len(rows))


class LossNorm:
    """Per-position loss weights for the chosen normalisation (module docstring)."""

    def __init__(self, mode: str, rows_per_step: int, gas: int, dp: int, answers: Callable[[int], list[int]]):
        """answers(row position) -> answer-token count of each sample in that row, in row order."""
        assert mode in LOSS_NORMS, mode
        self.mode, self.batch, self.scale, self.answers = mode, rows_per_step, gas * dp, answers

    @functools.lru_cache(maxsize=8)
    def _step(self, step: int) -> tuple[int, int, dict[int, list[int]]]:
        """(answer tokens, samples with an answer) over the step's whole global batch, and each row's
        answer counts (kept: reading a sample's tokens again for its row's weights cost the last stage,
        which loads without workers, ~0.25 ms per micro-batch of 4 on the shapes set)."""
        rows = {r: self.answers(r) for r in range(step * self.batch, (step + 1) * self.batch)}
        counts = [n for ns in rows.values() for n in ns]
        return max(1, sum(counts)), max(1, sum(1 for n in counts if n)), rows

    def per_sample(self, r: int) -> list[float]:
        """Row r's weight for each labelled position of each of its samples."""
        tokens, samples, rows = self._step(r // self.batch)
        if self.mode == "token":
            return [self.scale / tokens] * len(rows[r])
        return [self.scale / (samples * n) if n else 0.0 for n in rows[r]]


class RowSet(Dataset):
    """Row position -> the row's tensors (the one layout, mmpipe.model.stage): input_ids, labels,
    segments, loss weights [L]; has_image [M] (each slot's segment, 0 unused); pixels [M, 3, S, S]
    (multi-crop [M, 1 + K, 3, S, S] and tiling [M, 2]). Unused image slots hold blank images, which no
    placeholder reads. A dynamic family (PatchBlocks, P): pixels [P, patch_dim], each used slot's
    patches in slot order then zeros, and tiling [M, 3], each slot's grid (t, h, w), 0 0 0 unused, on
    every stage (the decoder's positions need it), from the index: no image is opened for it. Any-resolution
    tiles (TileBlocks, T): pixels [T, C, S, S], each used slot's crops then zero crops, and tiling [M, 4],
    each slot's (orig_h, orig_w, rows, cols), likewise on every stage. share_pairs (preference pairs,
    mmpipe.data.preference.shares_images): an odd row (2i + 1, the rejected sides of row 2i's pairs) opens no image
    and is marked `shared`; mmpipe.data.batches.collate then carries row 2i's images for both."""

    def __init__(self, samples, plan: RowPlan, *, blank=None, need_images: bool = True, need_labels: bool = True,
                 norm: LossNorm | None = None, augment_seed: int | None = None, share_pairs: bool = False):
        """blank: an unused image slot's pixels, the image kind's (mmpipe.data.image_kinds); None for a kind of
        row budgets, whose unused slots hold no patches."""
        self.samples, self.plan, self.shape = samples, plan, plan.shape
        self.blank, self.norm, self.augment_seed = blank, norm, augment_seed
        self.need_images, self.need_labels = need_images, need_labels
        self.share_pairs = share_pairs and plan.unit == 2

    def __len__(self):
        return 2 ** 62

    def __getitem__(self, r: int) -> dict:
        L, M = self.shape.length, self.shape.max_images
        ids = np.full(L, self.samples.pad_id, dtype=np.int64)
        labels = np.full(L, IGNORE_INDEX, dtype=np.int64)
        segments = np.zeros(L, dtype=np.int64)
        images, owners, grids, end = [], [], [], 0
        for seg, pos in enumerate(self.plan.row(r), start=1):
            enc, n_images = self.samples.tokens(pos)
            s_ids, s_labels = sample_sequence(enc, int(n_images), self.shape)
            ids[end:end + len(s_ids)], labels[end:end + len(s_ids)] = s_ids, s_labels
            segments[end:end + len(s_ids)] = seg
            images += [(pos, k) for k in range(int(n_images))]
            owners += [seg] * int(n_images)
            grids += list(enc.grids[:int(n_images)])
            end += len(s_ids)
        item = {"pos": r, "input_ids": ids, "segments": segments,  # has_image: each slot's segment, 0 unused
                "has_image": np.array(owners + [0] * (M - len(images)), dtype=np.int64)}
        if self.need_labels:
            item["labels"] = labels
            if self.norm is not None:
                w = np.array([0.0] + self.norm.per_sample(r), dtype=np.float32)[segments]
                item["weights"] = np.where(labels != IGNORE_INDEX, w, 0.0).astype(np.float32)
        if self.share_pairs and r % 2:
            item["shared"] = self._partner(r)  # row r - 1's images are this row's: none opened here
        if self.shape.vision_budget:  # M x (t, h, w), or M x (orig_h, orig_w, rows, cols)
            item["tiling"] = [self.shape.tiling(g) for g in grids] + [(0,) * self.shape.images.tiling_width] * (
                M - len(grids))
            if self.need_images and "shared" not in item:
                item["pixels"] = self._patches(images)
        elif self.need_images and "shared" not in item:
            px = [self._image(pos, k) for pos, k in images] + [self.blank] * (M - len(images))
            item["pixels"], tiling = stack_images(px)  # [M, 3, S, S]; multi-crop [M, 1 + K, 3, S, S] and its tiling
            if tiling is not None:
                item["tiling"] = tiling.tolist()  # M x (rows, cols)
        return item

    def _partner(self, r: int) -> int:
        """Row r - 1, whose pairs' chosen sides row r's rejected ones are, in the same order (RowPlan's unit of 2),
        so the two rows' image slots hold the same images; ValueError where they are not (the pairs' layout)."""
        if not same_pairs(self.samples, self.plan.row(r - 1), self.plan.row(r)):
            raise ValueError(f"rows {r - 1} and {r} are not the chosen and rejected sides of the same pairs")
        return r - 1

    def _patches(self, images: list[tuple[int, int]]) -> torch.Tensor:
        """[P, patch_dim] (or [T, C, S, S]): the row's images' patches (crops) in slot order, zero padded (the
        sizes were checked by the index, so they fill at most P, T)."""
        pieces = [self._image(pos, k) for pos, k in images]  # each checked against its grid (samples.pixels)
        used = sum(len(p) for p in pieces)
        return torch.cat(pieces + [torch.zeros(self.shape.vision_budget - used, *self.shape.images.unit)])

    def _image(self, pos: int, k: int) -> torch.Tensor | Crops:
        if self.augment_seed is not None:  # per sample and image: augmentation repeats exactly on resume
            torch.manual_seed(self.augment_seed * 1_000_003 + pos * 64 + k)
        return self.samples.pixels(pos, k)


def answer_counts(samples, plan: RowPlan) -> Callable[[int], list[int]]:
    """row position -> each sample's labelled positions (BOS never predicted), read from the token
    index alone: no image is opened."""
    def counts(r: int) -> list[int]:
        return [int(samples.tokens(pos)[0].target[1:].sum()) for pos in plan.row(r)]
    return counts


def sample_size(samples, shape: RowShape) -> Callable[[int], tuple]:
    """pos -> (decoder positions, images) of a sample: its text plus N positions per image; a dynamic
    family's adds its vision patches, (text + its blocks, images, patches), read from the grids."""
    def size(pos: int) -> tuple:
        enc, n_images = samples.tokens(pos)
        if not shape.vision_budget:
            return len(enc.ids) + int(n_images) * shape.image_len, int(n_images)
        grids = enc.grids[:n_images]
        units = sum(shape.units(g) for g in grids)
        blocks = sum(shape.block_len(g) for g in grids)
        return len(enc.ids) + blocks, int(n_images), units
    return size


def sample_rowset(samples, cfg, text_len: int, slots: int = 1, **kw) -> RowSet:
    """One sample per row with one image slot (no --pack, --max-images 1; `slots` where an image takes several,
    Gemma 3's pan-and-scan): the smallest rows, e.g. the teacher-forced loss of `mmpipe eval`
    (mmpipe.inference.scoring). kw: RowSet's."""
    shape = row_shape(cfg, slots, text_len)
    return RowSet(samples, RowPlan(sample_size(samples, shape), shape, pack=False),
                  blank=image_kind(cfg).blank(cfg), **kw)
