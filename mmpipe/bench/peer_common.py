"""What both peers share: the variant's model config, text length and data. They write their log with
mmpipe.train's writer (mmpipe.runtime.steplog: train_log.csv, summary.json; memory_rank*.json from
.memory) so one reader serves all."""
from __future__ import annotations

import argparse

from ..data.batches import StepBatches, TrainSet, rank_batches
from ..data.dataset import prepare
from ..run_args import TrainArgs
from ..run_config import resolve
from .run_variant import ds_config
from .sweep import Variant


def peer_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser()
    p.add_argument("--preset", default="small")
    p.add_argument("--micro", type=int, required=True)
    p.add_argument("--gas", type=int, required=True)
    p.add_argument("--steps", type=int, required=True)
    p.add_argument("--out", required=True)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--data-workers", type=int, default=2)
    return p.parse_args(argv)


def resolved(preset: str, stages: int, micro: int, gas: int, world: int, steps: int, data_workers: int = 2):
    """mmpipe's RunConfig for these shapes (stage boundaries, text length, data, optimizer recipe;
    the LR schedule spans `steps`, as a variant's `--steps` makes it)."""
    cfg = ds_config(Variant(name="peer", preset=preset, stages=stages, micro=micro, gas=gas))
    args = TrainArgs(preset=preset, stages=stages, steps=steps, data_workers=data_workers)
    return resolve(args, world_size=world, ds_config=cfg)


def batches(run, seed: int, *, first: bool = True, last: bool = True):
    """mmpipe's own micro-batch stream for dp rank 0 (the same samples a PP run trains on), loaded
    as mmpipe.train loads it: images and the loader workers only on the first stage, labels only
    on the last, so a peer pays the same data cost as the variant it is compared with."""
    v = run.model.vision
    data = TrainSet(prepare(run.data, run.model, "", seed, verbose=False), text_len=run.text_len,
                    n_img=run.model.n_image_positions, image_size=v.image_size, need_images=first, need_labels=last,
                    max_crops=v.max_crops)
    return rank_batches(data, StepBatches(0, run.micro, run.gas, 0, 1), workers=run.data.workers if first else 0)

