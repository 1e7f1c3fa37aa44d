"""Peer (b): PyTorch's own pipelining (torch.distributed.pipelining, Schedule1F1B, or ScheduleGPipe
with --schedule gpipe) on 2 ranks (torchrun, gloo), the same mmpipe layers (ReferenceModel, same
seeds) split at the same boundary mmpipe's balanced partition picks, the same batches, AdamW.

mmpipe's layers take and return one tuple (hidden, input_ids, has_image, ...); a PipelineStage
calls submod(*args), so each stage is wrapped to pack its arguments into that tuple.
"""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch
from torch import nn

from ..model.builder import ReferenceModel, lm_loss
from ..runtime.feed import decoder_length
from ..runtime.reference import clip_and_step, gradient_clipping, make_optimizer, make_scheduler
from ..runtime.steplog import StepLog
from .memory import write_peak
from .peer_common import batches, peer_args, peer_samples, resolved, step_counter


class TupleStage(nn.Module):
    def __init__(self, layers: nn.Sequential):
        super().__init__()
        self.layers = layers

    def forward(self, *xs):
        return self.layers(tuple(xs) if len(xs) > 1 else xs[0])


def main(argv=None) -> int:
    argv = list(sys.argv[1:] if argv is None else argv)
    schedule_name = "1f1b"
    if "--schedule" in argv:
        i = argv.index("--schedule")
        schedule_name = argv[i + 1]
        del argv[i:i + 2]
    a = peer_args(argv)
    torch.set_num_threads(int(os.environ.get("OMP_NUM_THREADS", "1")))
    import torch.distributed as dist
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run = resolved(a.preset, world, a.micro, a.gas, world, a.steps, a.data_workers, a.data, a.text_len)
    full = ReferenceModel(run.model, seed=a.seed)  # layer i under seed + i, as the pipeline builds it
    lo, hi = run.parts[rank], run.parts[rank + 1]
    stage_mod = TupleStage(nn.Sequential(*list(full)[lo:hi]))
    del full
    stage = PipelineStage(stage_mod, rank, world, torch.device("cpu"))
    sched_cls = Schedule1F1B if schedule_name == "1f1b" else ScheduleGPipe
    schedule = sched_cls(stage, n_microbatches=run.gas, loss_fn=lm_loss)
    params = [p for p in stage_mod.parameters() if p.requires_grad]
    opt = make_optimizer(run.ds_config, params)
    sched = make_scheduler(run.ds_config, opt)  # the same LR schedule as the mmpipe variant
    clip = gradient_clipping(run.ds_config)
    samples = peer_samples(run, a.seed, a.out)
    stream = batches(run, a.seed, first=rank == 0, last=rank == world - 1, samples=samples)
    counts = step_counter(run, samples) if rank == 0 else None
    log = StepLog(Path(a.out), run.micro * run.gas, decoder_length(run), enabled=rank == 0)  # 28 positions per row
    for step in range(1, a.steps + 1):
        dist.barrier()  # start every step together, as a train_batch does
        t0 = time.perf_counter()  # loading is inside the step, as in train_batch (its LoadMicroBatch)
        mbs = [next(stream) for _ in range(run.gas)]
        losses = []
        if rank == 0:  # images, input_ids, has_image[, tiling]; the schedule splits them into gas micro-batches
            schedule.step(*(torch.cat([m[0][k] for m in mbs]) for k in range(len(mbs[0][0]))))
        elif rank == world - 1:
            schedule.step(target=torch.cat([m[1] for m in mbs]), losses=losses)
        else:
            schedule.step()
        # same global-norm clipping as the DeepSpeed config (the norm summed over both stages)
        clip_and_step(params, opt, sched, clip, norm_allreduce=dist.all_reduce)
        loss = torch.tensor(sum(float(x.detach()) for x in losses) / len(losses) if losses else 0.0)
        dist.broadcast(loss, world - 1)
        dt = time.perf_counter() - t0
        n, useful = counts(step) if counts else (None, None)
        log.step(step, float(loss), dt, samples=n, useful=useful)
    log.finish(schedule=schedule_name, parts=run.parts, data={"text_len": run.text_len, **log.seen()})
    write_peak(a.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
