"""Samples -> micro-batches: the per-rank stream DeepSpeed's pipeline pulls from.

The stream is a sequence of positions 0, 1, 2, ...; optimizer step s consumes positions
[s * B, (s + 1) * B) with B = micro x GAS x DP (e.g. 16 x 4 x 2 = 128), and micro-batch m of
data-parallel rank d takes the `micro` positions starting at s * B + (m * DP + d) * micro. So
replicas see disjoint positions, every position is used once, and the first and last stage of a
pipeline (same d) pull the same micro-batches in the same order. Position -> sample is fixed by
the data (mmpipe.data.samples): the built-in set's sample p, or a user dataset's good record
order_e[p mod N] in epoch e = p div N, order_e a permutation drawn from (seed, e). The position
after step s is s x B; checkpoints save it, and --resume starts there: nothing repeated or skipped.

A position is a row of the one layout (mmpipe.data.packing.RowSet, mmpipe.model.stage): one sample,
or several with --pack. One sample per row (text_len = 12, 16 image positions, L = 28):

    input_ids      [BOS] img_1 .. img_N question: what shape is red circle [EOS] [PAD] ...
                   (moondream: IMAGE_SLOT ids; LLaVA: <image> placeholders at its marker)
    labels         position p holds the token p should predict (p + 1's token) for the answer
                   tokens, IGNORE_INDEX elsewhere: loss on answer tokens only (mmpipe.data.text).
    segments       1 over the sample, 0 over its padding; a text-only sample has no image block.
"""
from __future__ import annotations

from typing import Callable, Iterator

import numpy as np
import torch
from torch.utils.data import DataLoader, Dataset


def micro_batch_indices(step: int, micro: int, gas: int, dp_rank: int, dp_size: int, start: int = 0,
                        order: Callable[[int], tuple[int, ...]] | None = None) -> list[list[int]]:
    """Stream positions of one optimizer step for one data-parallel rank, as gas micro-batches.
    A step consumes micro x gas x dp positions (e.g. 32 x 2 x 1 = 64), at start + [step * 64, (step + 1) * 64):
    micro-batch m of rank d takes the slice starting at (m * dp + d) * micro. order(base): the step's positions
    laid out in that slot order instead of stream order (mmpipe.data.balance.StepBalance: rows by cost)."""
    base = start + step * micro * gas * dp_size
    slots = order(base) if order is not None else range(base, base + micro * gas * dp_size)
    return [[slots[(m * dp_size + dp_rank) * micro + i] for i in range(micro)] for m in range(gas)]


class StepBatches:
    """An endless batch sampler: one rank's micro-batches of positions, from stream position
    `start` (0, or the samples a resumed checkpoint had consumed) on; order: micro_batch_indices'."""

    def __init__(self, start: int, micro: int, gas: int, dp_rank: int, dp_size: int,
                 order: Callable[[int], tuple[int, ...]] | None = None):
        self.start, self.micro, self.gas, self.dp_rank, self.dp_size = start, micro, gas, dp_rank, dp_size
        self.order = order

    def __iter__(self) -> Iterator[list[int]]:
        step = 0
        while True:
            yield from micro_batch_indices(step, self.micro, self.gas, self.dp_rank, self.dp_size, self.start,
                                           self.order)
            step += 1


def pair_images(items: list[dict]) -> list[dict]:
    """The items whose images the micro-batch carries: all, or where the rejected rows share their chosen rows' images
    (RowSet's share_pairs: row 2i + 1 `shared`, no pixels) the chosen ones, rows 2i, so pixels hold B / 2 rows and
    the tower encodes each pair's images once (mmpipe.model.rows.slot_images: slot m of rows 2i and 2i + 1 reads
    pixel row i's image m). A shared row without its tiling (moondream's multi-crop, made with the pixels) takes
    its partner's. ValueError where a shared row does not follow its partner."""
    if not any("shared" in it for it in items):
        return items
    chosen, rejected = items[::2], items[1::2]
    if len(items) % 2 or any("shared" in a or b.get("shared") != a["pos"] for a, b in zip(chosen, rejected)):
        raise ValueError(f"rows {[it['pos'] for it in items]}: a micro-batch of preference pairs must hold each "
                         f"chosen row followed by its rejected row")
    for a, b in zip(chosen, rejected):
        if "tiling" in a and "tiling" not in b:
            b["tiling"] = a["tiling"]
    return chosen


def collate(items: list[dict]) -> dict:
    images = pair_images(items)
    out = {"pos": torch.tensor([it["pos"] for it in items]),
           "input_ids": torch.from_numpy(np.stack([it["input_ids"] for it in items])),
           "has_image": torch.from_numpy(np.stack([np.asarray(it["has_image"], dtype=np.int64) for it in items]))}
    for key in ("labels", "weights", "segments"):  # segments [B, L] (has_image [B, M])
        if key in items[0]:
            out[key] = torch.from_numpy(np.stack([it[key] for it in items]))
    if "pixels" in images[0]:
        out["pixels"] = torch.stack([it["pixels"] for it in images])  # [B, ...], or [B / 2, ...] shared by pairs
    if "tiling" in items[0]:
        out["tiling"] = torch.tensor([it["tiling"] for it in items], dtype=torch.long)  # [B, M, 2]
    return out


def _one_thread(_):
    torch.set_num_threads(1)


def rank_batches(dataset: Dataset, sampler: StepBatches, *, workers: int = 0, prefetch: int = 4,
                 dtype: torch.dtype = torch.float32, on_batch: Callable[[torch.Tensor], None] | None = None,
                 pin_memory: bool = False) -> Iterator[tuple]:
    """Endless ((pixel_values, input_ids, has_image, segments[, tiling]), labels) micro-batches in
    DeepSpeed's (inputs, labels) form; without images inputs is the integer tensors alone (what a stage
    after the first joins to the floats it receives, mmpipe.runtime.wire), labels None without labels, and
    (labels, weights) with loss weights (mmpipe.data.packing.LossNorm). Worker processes decode
    ahead (`prefetch` micro-batches each) and the DataLoader hands batches back in sampler order.
    on_batch(positions) sees what is consumed, for --log-samples. pin_memory (a CUDA rank): batches in
    page-locked memory, so the rank's copy to its GPU can be asynchronous (mmpipe.runtime.wire.to_device)."""
    loader = DataLoader(dataset, batch_sampler=sampler, collate_fn=collate, num_workers=workers,
                        prefetch_factor=prefetch if workers else None, worker_init_fn=_one_thread if workers else None,
                        persistent_workers=False, pin_memory=pin_memory)
    for b in loader:
        if on_batch is not None:
            on_batch(b["pos"])
        # the stage tuple's order: floats, then input_ids, has_image, segments, tiling
        inputs = (b["input_ids"], b["has_image"], b["segments"]) + ((b["tiling"],) if "tiling" in b else ())
        if "pixels" in b:
            pixels = b["pixels"].to(dtype)
            if pin_memory and pixels is not b["pixels"]:  # the cast (bf16 / fp16 runs) made a pageable copy
                pixels = pixels.pin_memory()
            inputs = (pixels,) + inputs
        labels = (b["labels"], b["weights"]) if "weights" in b else b.get("labels")
        yield inputs, labels
