"""What both peers share: the variant's model config, text length and data. They write their log with
mmpipe.train's writer (mmpipe.runtime.steplog: train_log.csv, summary.json; memory_rank*.json from
.memory) so one reader serves all. Peers run one sample per row (the smallest row, one image slot): a
sweep's packing variant is compared with peers that do not pack (docs/benchmarks.md)."""
from __future__ import annotations

import argparse

from ..data.batches import StepBatches, rank_batches
from ..data.dataset import prepare
from ..run_args import TrainArgs
from ..run_config import resolve
from ..runtime.feed import StepCounts, run_dataset
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
    p.add_argument("--data", default="shapes", help="the sweep's --data (default: the built-in shapes set)")
    p.add_argument("--text-len", type=int, default=None, help="the variant's --text-len (default: the data's)")
    return p.parse_args(argv)


def resolved(a, stages: int, world: int):
    """mmpipe's RunConfig for a peer's flags `a` (preset, micro, gas, steps, data_workers, data, text_len) in
    `stages` stages of `world` ranks (stage boundaries, text length, data, optimizer recipe; the LR schedule spans
    a.steps, as a variant's `--steps` makes it); never packed."""
    cfg = ds_config(Variant(name="peer", preset=a.preset, stages=stages, micro=a.micro, gas=a.gas))
    args = TrainArgs(preset=a.preset, stages=stages, steps=a.steps, data_workers=a.data_workers, data=a.data,
                     text_len=a.text_len)
    return resolve(args, world_size=world, ds_config=cfg)


def peer_samples(run, seed: int, out: str):
    """The run's sample stream; user data is checked into OUT/data/ as a variant's is (ranks building
    it at once is safe: mmpipe.data.index writes it under temporary names)."""
    return prepare(run.data, run.model, out, seed, verbose=False)


def batches(run, seed: int, *, first: bool = True, last: bool = True, samples=None):
    """mmpipe's own micro-batch stream for dp rank 0 (the same samples a PP run trains on), loaded
    as mmpipe.train loads it: images and the loader workers only on the first stage, labels only
    on the last, so a peer pays the same data cost as the variant it is compared with."""
    samples = peer_samples(run, seed, "") if samples is None else samples  # "": the built-in set keeps no files
    data = run_dataset(run, samples, first=first, last=last, train=False)  # one-sample rows, no loss weights
    return rank_batches(data, StepBatches(0, run.micro, run.gas, 0, 1), workers=run.data.workers if first else 0)


def step_counter(run, samples):
    """step -> (real samples, useful decoder positions) of peer step `step` (1-based): one-sample rows
    [(step - 1) x micro x GAS, + micro x GAS), as batches() draws them (feed.StepCounts)."""
    counts, batch = StepCounts(run, samples), run.micro * run.gas
    return lambda step: counts((step - 1) * batch, batch)

