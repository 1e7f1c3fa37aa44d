"""Samples -> micro-batches: the per-rank stream DeepSpeed's pipeline pulls from.

The stream is a sequence of positions 0, 1, 2, ...; optimizer step s consumes positions
[s * B, (s + 1) * B) with B = micro x GAS x DP (e.g. 16 x 4 x 2 = 128), and micro-batch m of
data-parallel rank d takes the `micro` positions starting at s * B + (m * DP + d) * micro. So
replicas see disjoint positions, every position is used once, and the first and last stage of a
pipeline (same d) pull the same micro-batches in the same order. Position -> sample is fixed by
the data (mmpipe.data.samples): the built-in set's sample p, or a user dataset's good record
order_e[p mod N] in epoch e = p div N, order_e a permutation drawn from (seed, e). The position
after step s is s x B; checkpoints save it, and --resume starts there: nothing repeated or skipped.

Sequence layout for one sample (text_len = 12, 16 image tokens, so T = 28 decoder positions):

    text tokens    [BOS] question: what shape is red circle [EOS] [PAD] ...
    decoder input  [BOS] img_1 .. img_N question: what shape is red circle [EOS] [PAD] ...
    labels         position p holds the token p should predict (p + 1's token) for the answer
                   tokens, IGNORE_INDEX elsewhere: loss on answer tokens only (mmpipe.data.text).

The LLaVA family carries its image inside input_ids: [BOS] <image> x N question: ... [EOS] [PAD] ...,
input_ids and labels N + text_len wide (a text-only sample: no placeholders, N more pads).
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset

from ..model.builder import IGNORE_INDEX
from .crops import Crops, blank_image
from .text import pad_sample


def micro_batch_indices(step: int, micro: int, gas: int, dp_rank: int, dp_size: int, start: int = 0) -> list[list[int]]:
    """Stream positions of one optimizer step for one data-parallel rank, as gas micro-batches.
    A step consumes micro x gas x dp positions (e.g. 32 x 2 x 1 = 64), at start + [step * 64, (step + 1) * 64):
    micro-batch m of rank d takes the slice starting at (m * dp + d) * micro."""
    base = start + step * micro * gas * dp_size
    return [[base + (m * dp_size + dp_rank) * micro + i for i in range(micro)] for m in range(gas)]


class StepBatches:
    """An endless batch sampler: one rank's micro-batches of positions, from stream position
    `start` (0, or the samples a resumed checkpoint had consumed) on."""

    def __init__(self, start: int, micro: int, gas: int, dp_rank: int, dp_size: int):
        self.start, self.micro, self.gas, self.dp_rank, self.dp_size = start, micro, gas, dp_rank, dp_size

    def __iter__(self) -> Iterator[list[int]]:
        step = 0
        while True:
            yield from micro_batch_indices(step, self.micro, self.gas, self.dp_rank, self.dp_size, self.start)
            step += 1


class TrainSet(Dataset):
    """Stream position -> tensors. need_images=False (the last stage) decodes no image;
    need_labels=False (the first stage of a multi-stage pipeline) builds no labels."""

    def __init__(self, samples, *, text_len: int, n_img: int, image_size: int, need_images: bool = True,
                 need_labels: bool = True, augment_seed: int | None = None, image_token: tuple[int, int] = (-1, 0),
                 max_crops: int = 0, norm=None):
        """image_token: the LLaVA family's (placeholder id, count) after BOS, mmpipe.data.text.placeholders.
        max_crops: moondream multi-crop (vision.max_crops): samples.pixels gives Crops, 1 + max_crops slots.
        norm: the loss weights (mmpipe.data.packing.LossNorm over one-sample rows); None: labels alone."""
        self.samples, self.text_len, self.n_img, self.image_size = samples, text_len, n_img, image_size
        self.max_crops, self.norm = max_crops, norm
        self.image_token = image_token
        self.need_images, self.need_labels, self.augment_seed = need_images, need_labels, augment_seed

    def __len__(self):  # positions are endless; the batch sampler decides which are read
        return 2 ** 62

    def __getitem__(self, pos: int) -> dict:
        enc, has_image = self.samples.tokens(pos)
        input_ids, labels = pad_sample(enc, self.text_len, self.n_img, self.samples.pad_id, IGNORE_INDEX,
                                       image_token=self.image_token, has_image=has_image)
        item = {"pos": pos, "input_ids": input_ids, "has_image": int(has_image)}
        if self.need_labels:
            item["labels"] = labels
            if self.norm is not None:
                item["weights"] = np.where(labels != IGNORE_INDEX, self.norm.per_sample(pos)[0], 0.0).astype(np.float32)
        if self.need_images:
            if has_image:
                if self.augment_seed is not None:  # per position: augmentation repeats exactly on resume
                    torch.manual_seed(self.augment_seed * 1_000_003 + pos)
                px = self.samples.pixels(pos)
            else:  # text-only record: a zero image the decoder masks out (mmpipe.model.attention); LLaVA: no
                # placeholders, so the embedding uses none of its features (mmpipe.model.llava.LlavaEmbed)
                px = blank_image(self.image_size, self.max_crops)
            if isinstance(px, Crops):  # multi-crop: [1 + max_crops, 3, S, S] and the tiling the Projector stitches
                item["pixels"], item["tiling"] = px.pixels, px.tiling
            else:
                item["pixels"] = px
        return item


def collate(items: list[dict]) -> dict:
    out = {"pos": torch.tensor([it["pos"] for it in items]),
           "input_ids": torch.from_numpy(np.stack([it["input_ids"] for it in items])),
           "has_image": torch.from_numpy(np.stack([np.asarray(it["has_image"], dtype=np.int64) for it in items]))}
    for key in ("labels", "weights", "segments"):  # rows: segments [B, L] (has_image [B, M])
        if key in items[0]:
            out[key] = torch.from_numpy(np.stack([it[key] for it in items]))
    if "pixels" in items[0]:
        out["pixels"] = torch.stack([it["pixels"] for it in items])
    if "tiling" in items[0]:
        out["tiling"] = torch.tensor([it["tiling"] for it in items], dtype=torch.long)  # [B, 2]; rows [B, M, 2]
    return out


def _one_thread(_):
    torch.set_num_threads(1)


def rank_batches(dataset: TrainSet, sampler: StepBatches, *, workers: int = 0, prefetch: int = 4,
                 dtype: torch.dtype = torch.float32, on_batch: Callable[[torch.Tensor], None] | None = None
                 ) -> Iterator[tuple]:
    """Endless ((pixel_values, input_ids, has_image[, segments][, tiling]), labels) micro-batches in
    DeepSpeed's (inputs, labels) form; without images inputs is the integer tensors alone (what a stage
    after the first joins to the floats it receives, mmpipe.runtime.wire), labels None without labels, and
    (labels, weights) with loss weights (mmpipe.data.packing.LossNorm). Worker processes decode
    ahead (`prefetch` micro-batches each) and the DataLoader hands batches back in sampler order.
    on_batch(positions) sees what is consumed, for --log-samples."""
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                        prefetch_factor=prefetch if workers else None, worker_init_fn=_one_thread if workers else None,
                        persistent_workers=False)
    for b in loader:
        if on_batch is not None:
            on_batch(b["pos"])
        # the stage tuple's order: floats, then input_ids, has_image, segments, tiling
        inputs = (b["input_ids"], b["has_image"]) + tuple(b[k] for k in ("segments", "tiling") if k in b)
        if "pixels" in b:
            inputs = (b["pixels"].to(dtype),) + inputs
        labels = (b["labels"], b["weights"]) if "weights" in b else b.get("labels")
        yield inputs, labels
