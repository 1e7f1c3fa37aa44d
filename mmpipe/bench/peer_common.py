"""What both peers share: the variant's model config, text length and data, and writing their log
in mmpipe.train's format (train_log.csv, summary.json, memory_rank*.json) so one reader serves all."""
from __future__ import annotations

import argparse
import csv
import json
import statistics
from pathlib import Path


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
    from ..run_config import add_train_args, resolve
    from .run_variant import ds_config
    from .sweep import Variant
    import tempfile
    cfg = ds_config(Variant(name="peer", preset=preset, stages=stages, micro=micro, gas=gas))
    with tempfile.NamedTemporaryFile("w", suffix=".json", delete=False) as f:
        json.dump(cfg, f)
    p = argparse.ArgumentParser()
    add_train_args(p)
    args = p.parse_args(["--preset", preset, "--ds-config", f.name, "--stages", str(stages), "--steps", str(steps),
                       "--data-workers", str(data_workers)])
    return resolve(args, world_size=world)


def batches(run, seed: int, *, first: bool = True, last: bool = True):
    """mmpipe's own micro-batch stream for dp rank 0 (the same samples a PP run trains on), loaded
    as mmpipe.train loads it: images and the loader workers only on the first stage, labels only
    on the last, so a peer pays the same data cost as the variant it is compared with."""
    from ..data.batches import StepBatches, TrainSet, rank_batches
    from ..data.dataset import prepare
    v = run.model.vision
    data = TrainSet(prepare(run.data, run.model, "", seed, verbose=False), text_len=run.text_len,
                    n_img=run.model.n_image_positions, image_size=v.image_size, need_images=first, need_labels=last)
    return rank_batches(data, StepBatches(0, run.micro, run.gas, 0, 1), workers=run.data.workers if first else 0)


class StepLog:
    def __init__(self, out: Path, train_batch: int, seq: int):
        from ..train import CSV_FIELDS
        self.out, self.tb, self.seq = out, train_batch, seq
        out.mkdir(parents=True, exist_ok=True)
        self.f = open(out / "train_log.csv", "w", newline="")
        self.w = csv.DictWriter(self.f, CSV_FIELDS)
        self.w.writeheader()
        self.times, self.losses, self.elapsed = [], [], 0.0

    def step(self, i: int, dt: float, loss: float) -> None:
        self.times.append(dt)
        self.losses.append(loss)
        self.elapsed += dt
        self.w.writerow({"step": i, "loss": repr(loss), "lr": "", "samples_per_s": f"{self.tb / dt:.1f}",
                         "tokens_per_s": f"{self.tb * self.seq / dt:.0f}", "elapsed_s": f"{self.elapsed:.2f}",
                         "skipped": ""})
        self.f.flush()

    def finish(self, **extra) -> None:
        self.f.close()
        step_s = statistics.median(self.times[1:] or self.times)
        (self.out / "summary.json").write_text(json.dumps({
            "steps": len(self.times), "final_loss": self.losses[-1], "samples_per_s": self.tb / step_s,
            "tokens_per_s": self.tb * self.seq / step_s, "step_time_s": step_s, "train_batch": self.tb, **extra},
            indent=2) + "\n")
