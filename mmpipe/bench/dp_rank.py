"""Per-rank entry of an engine-'dp' variant: the same model, data and DeepSpeed JSON, data-parallel
through DeepSpeed's ordinary engine (no pipeline), so ZeRO-2/3 can run.

DeepSpeed 0.19.8 rejects ZeRO-2/3 for any PipelineModule (../shared/DEEPSPEED_NOTES.md). As the
notes found, a 1-stage VLMPipeline wrapped in a plain nn.Module whose forward returns the loss gets
the ordinary DeepSpeedEngine, and its losses matched the 2-stage pipeline. The run is resolved by
mmpipe.run_config with ZeRO-0/1 (its pipeline rule) and the requested stage is put back after.
Writes train_log.csv and summary.json with train's fields (no stage timing: there are no stages).
"""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import deepspeed
import torch
import torch.distributed as dist

from ..cluster.slurm_env import ranks_from_slurm
from ..config import ConfigError, fail
from ..data.batches import StepBatches, rank_batches
from ..data.dataset import prepare
from ..run_args import TrainArgs
from ..run_config import resolve
from ..runtime.feed import StepCounts, decoder_length, run_dataset
from ..runtime.pipeline import VLMPipeline
from ..runtime.steplog import StepLog
from ..runtime.trainer import DTYPES, join_process_group
from .memory import write_peak


class LossModule(torch.nn.Module):
    def __init__(self, pipe, loss):
        super().__init__()
        self.pipe, self.loss = pipe, loss  # the run's Objective.loss (mmpipe.model.objectives)

    def forward(self, inputs, labels):  # inputs: the stage contract's first input (mmpipe.model.stage)
        return self.loss(self.pipe(inputs), labels)


def main(argv=None) -> int:
    p = argparse.ArgumentParser()
    p.add_argument("--zero", type=int, required=True)
    p.add_argument("--local_rank", "--local-rank", type=int, default=None)  # the launcher's
    ns, rest = p.parse_known_args(argv)
    args = TrainArgs.from_argv(rest, prog="python -m mmpipe.bench.dp_rank")
    ranks_from_slurm(os.environ)  # an srun task of `mmpipe bench --slurm` (mmpipe.train does the same)
    try:
        run = resolve(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        return fail(e)
    rank = join_process_group(run.precision)
    if rank is None:
        return 2
    out = Path(args.output_dir)
    out.mkdir(parents=True, exist_ok=True)
    ds = dict(run.ds_config)
    ds.pop("pipeline", None)
    ds["zero_optimization"] = {**ds.get("zero_optimization", {}), "stage": ns.zero}
    pipe = VLMPipeline(run, seed=args.seed)  # 1 stage: every layer here, built under the same seeds
    model = LossModule(pipe, run.objective.loss)
    engine, _, _, _ = deepspeed.initialize(model=model, config=ds,
                                           model_parameters=[q for q in model.parameters() if q.requires_grad])
    samples = prepare(run.data, run.model, out, args.seed, verbose=False)
    dataset = run_dataset(run, samples, augment_seed=args.seed if run.data.augment else None, train=False)
    batches = rank_batches(dataset, StepBatches(0, run.micro, run.gas, rank, run.dp), dtype=DTYPES[run.precision],
                           workers=run.data.workers)
    log = StepLog(out, run.train_batch, decoder_length(run), enabled=rank == 0)  # e.g. 16 image + 12 text = 28
    counts = StepCounts(run, samples) if rank == 0 else None  # one-sample rows: the sweep refuses pack here
    for step in range(1, args.steps + 1):
        t0 = time.perf_counter()
        total, lr = 0.0, engine.get_lr()[0]  # the rate this step's update uses (the schedule moves after it)
        for _ in range(run.gas):
            inputs, labels = next(batches)
            loss = engine(inputs, labels)
            engine.backward(loss)
            engine.step()  # DeepSpeed steps the optimizer at the GAS boundary only
            total += loss.item() / run.gas
        # the mean over the DP replicas, as the PipelineEngine reports its loss (rank 0's alone is
        # the loss of half the batch at DP=2)
        mean = torch.tensor([total])
        dist.all_reduce(mean)
        total = float(mean) / run.dp
        dt = time.perf_counter() - t0
        # step s (1-based) trains rows [(s - 1) x micro x GAS x DP, + micro x GAS x DP) over all replicas
        log.step(step, total, dt, counts((step - 1) * run.train_batch, run.train_batch) if counts else None, lr=lr)
    del batches
    dist.barrier()
    dist.destroy_process_group()
    write_peak(out)
    log.finish(stages=1, dp=run.dp, micro_batch=run.micro, gradient_accumulation=run.gas, precision=run.precision,
               zero_stage=ns.zero, preset=run.model.name, engine="dp", data={"text_len": run.text_len, **log.seen()})
    return 0


if __name__ == "__main__":
    sys.exit(main())
