"""Peer (b): PyTorch's own pipelining (torch.distributed.pipelining, Schedule1F1B, or ScheduleGPipe
with --schedule gpipe) on 2 ranks (torchrun, gloo), the same mmpipe layers (ReferenceModel, same
seeds) split at the same boundary mmpipe's balanced partition picks, the same batches, AdamW.

mmpipe's layers take and return one tuple (hidden, input_ids, has_image, ...); a PipelineStage
calls submod(*args), so each stage is wrapped to pack its arguments into that tuple.

--schedule zbv: torch's zero-bubble ScheduleZBVZeroBubble (peer `torch_pipe_zb`). It needs two
stages per rank in a V: the model is cut into 4 balanced stages, rank 0 holds stages 0 and 3, rank 1
stages 1 and 2. Torch 2.14's split backward (B for the inputs, W for the weights, from its own
autograd graph analysis) mis-pairs output gradients when a stage's outputs mix float and integer
tensors (stage_backward_input indexes the gradients over the float outputs by position in all
outputs), so in this peer only the floats of mmpipe's stage tuple travel. The integers (input_ids,
has_image, segments[, tiling]) are the micro-batch's own, unchanged from layer to layer, and every rank loads
them (first=False: no image is decoded); each stage takes them from a queue filled per step, one
entry per micro-batch in forward order (WireStage).
"""
from __future__ import annotations

import os
import sys
import time
from collections import deque
from pathlib import Path

import torch
from torch import nn
from torch.utils.data import DataLoader

from ..data.batches import StepBatches, collate
from ..model.builder import ReferenceModel
from ..planning.partition import compute_parts
from ..runtime.feed import decoder_length, run_dataset
from ..runtime.reference import clip_and_step, gradient_clipping, make_optimizer, make_scheduler
from ..runtime.steplog import StepLog
from .memory import write_peak
from .peer_common import batches, peer_args, peer_samples, resolved, step_counter


class TupleStage(nn.Module):
    def __init__(self, layers: nn.Sequential):
        super().__init__()
        self.layers = layers

    def forward(self, *xs):
        # torch's pipelining receives each micro-batch into buffers it reuses, and c10d's recv does not bump a
        # tensor's version: the layers' per-micro-batch geometry (mmpipe.model.attention.row_cached, keyed on
        # the integer tensors' identity and version) would be the previous micro-batch's. Fresh integers here.
        xs = tuple(t if t.is_floating_point() else t.clone() for t in xs)
        return self.layers(tuple(xs) if len(xs) > 1 else xs[0])


class WireStage(nn.Module):
    """One stage of the zbv peer: floats in and out on the wire, the micro-batch's integer tensors from
    `ints` (n_ints of them: the Projector drops tiling, so a stage after it takes 3, one before it 4)."""

    def __init__(self, layers: nn.Sequential, first: bool, last: bool, n_ints: int):
        super().__init__()
        self.layers, self.first, self.last, self.n_ints = layers, first, last, n_ints
        self.ints: deque = deque()

    def forward(self, *xs):
        if not self.first:
            xs = xs + tuple(self.ints.popleft()[:self.n_ints])
        out = self.layers(tuple(xs) if len(xs) > 1 else xs[0])
        if self.last:
            return out
        floats = tuple(t for t in out if t.is_floating_point())
        return floats if len(floats) > 1 else floats[0]


def boundaries(parts: list[int], layers: list[nn.Module], inputs: tuple) -> list[tuple]:
    """The stage tuple entering each stage 1..P-1 and the final output, on one micro-batch (no grad):
    what WireStage sends, as PipelineStage's input_args / output_args (so torch infers no shapes by
    running a stage on uninitialised integer ids)."""
    seen, x = [], inputs
    with torch.no_grad():
        for lo, hi in zip(parts, parts[1:]):
            for layer in layers[lo:hi]:
                x = layer(x)
            # torch derives which outputs get a gradient from the examples' requires_grad
            seen.append(tuple(t.detach().requires_grad_(t.is_floating_point()) for t in
                              (x if isinstance(x, tuple) else (x,))))
    return seen


def zbv_schedule(run, seed: int, rank: int, world: int, samples):
    """ScheduleZBVZeroBubble over 2 x world balanced stages in a V (rank r holds stages r and
    2 x world - 1 - r), its WireStages, and this rank's stream of micro-batch integer tensors (None on
    rank 0, which loads them with the images)."""
    from torch.distributed.pipelining import PipelineStage, ScheduleZBVZeroBubble

    n = 2 * world
    parts = compute_parts(run.layers, n, "balanced")
    full = ReferenceModel(run.model, seed=seed)
    layers = list(full)
    probe = next(batches(run, seed, first=True, last=False, samples=samples))[0]  # one micro-batch's inputs
    seen = boundaries(parts, layers, probe)
    mods, stages = [], []
    for s in (rank, n - 1 - rank):
        inputs = probe if s == 0 else tuple(t for t in seen[s - 1] if t.is_floating_point())
        n_ints = 0 if s == 0 else sum(1 for t in seen[s - 1] if not t.is_floating_point())
        out = seen[s] if s == n - 1 else tuple(t for t in seen[s] if t.is_floating_point())
        if s and n_ints > 3 and rank != 0:
            raise SystemExit(f"mmpipe bench: peer torch_pipe_zb: stage {s} needs the multi-crop tiling, which "
                             f"rank {rank} does not load (cut the model after the Projector)")
        mod = WireStage(nn.Sequential(*layers[parts[s]:parts[s + 1]]), s == 0, s == n - 1, n_ints)
        mods.append(mod)
        stages.append(PipelineStage(mod, s, n, torch.device("cpu"), input_args=inputs,
                                    output_args=out[0] if len(out) == 1 else out))
    del full, layers
    schedule = ScheduleZBVZeroBubble(stages, n_microbatches=run.gas, loss_fn=run.objective.loss)
    return schedule, mods, (None if rank == 0 else int_batches(run, samples))


def int_batches(run, samples):
    """The micro-batches' (input_ids, has_image, segments), as the images' rank draws them, without images."""
    data = run_dataset(run, samples, first=False, last=False, train=False)
    for b in DataLoader(data, batch_sampler=StepBatches(0, run.micro, run.gas, 0, 1), collate_fn=collate):
        yield b["input_ids"], b["has_image"], b["segments"]


def _schedule(name: str, run, seed: int, rank: int, world: int, samples):
    """(torch's schedule, this rank's stage modules, the later stages' integer-tensor feed or None, whether this rank
    holds the first / the last stage) for the schedule `name`: zbv's V, else one stage a rank, cut at run.parts."""
    from torch.distributed.pipelining import PipelineStage, Schedule1F1B, ScheduleGPipe
    if name == "zbv":
        schedule, stage_mods, ints = zbv_schedule(run, seed, rank, world, samples)
        return schedule, stage_mods, ints, rank == 0, rank == 0  # the V: rank 0 holds the first and the last stage
    full = ReferenceModel(run.model, seed=seed)  # layer i under seed + i, as the pipeline builds it
    stage_mods = [TupleStage(nn.Sequential(*list(full)[run.parts[rank]:run.parts[rank + 1]]))]
    stage = PipelineStage(stage_mods[0], rank, world, torch.device("cpu"))
    sched_cls = Schedule1F1B if name == "1f1b" else ScheduleGPipe
    schedule = sched_cls(stage, n_microbatches=run.gas, loss_fn=run.objective.loss)
    return schedule, stage_mods, None, rank == 0, rank == world - 1


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

    dist.init_process_group("gloo")
    rank, world = dist.get_rank(), dist.get_world_size()
    run = resolved(a, world, world)
    samples = peer_samples(run, a.seed, a.out)
    schedule, stage_mods, ints, first, last = _schedule(schedule_name, run, a.seed, rank, world, samples)
    params = [p for m in stage_mods for p in m.parameters() if p.requires_grad]
    opt = make_optimizer(run.ds_config, params)
    sched = make_scheduler(run.ds_config, opt)  # the same LR schedule as the mmpipe variant
    clip = gradient_clipping(run.ds_config)
    stream = batches(run, a.seed, first=first, last=last, samples=samples) if first or last else None
    counts = step_counter(run, samples) if rank == 0 else None
    log = StepLog(Path(a.out), run.micro * run.gas, decoder_length(run), enabled=rank == 0)  # 28 positions per row
    loss_rank = 0 if schedule_name == "zbv" else world - 1
    for step in range(1, a.steps + 1):
        dist.barrier()  # start every step together, as a train_batch does
        t0 = time.perf_counter()  # loading is inside the step, as in train_batch (its LoadMicroBatch)
        mbs = [next(stream) for _ in range(run.gas)] if stream else []
        if schedule_name == "zbv":  # each wire stage's integer tensors, micro-batch by micro-batch
            step_ints = [m[0][1:] for m in mbs] if first else [next(ints) for _ in range(run.gas)]
            for m in stage_mods:
                m.ints.extend(step_ints)
        losses = []
        kwargs = {"target": torch.cat([m[1] for m in mbs]), "losses": losses} if last else {}
        if first:  # images, input_ids, has_image, segments[, tiling]; the schedule splits them into gas micro-batches
            schedule.step(*(torch.cat([m[0][k] for m in mbs]) for k in range(len(mbs[0][0]))), **kwargs)
        else:
            schedule.step(**kwargs)
        # same global-norm clipping as the DeepSpeed config (the norm summed over all stages)
        clip_and_step(params, opt, sched, clip, norm_allreduce=dist.all_reduce)
        loss = torch.tensor(sum(float(x.detach()) for x in losses) / len(losses) if losses else 0.0)
        dist.broadcast(loss, loss_rank)
        dt = time.perf_counter() - t0
        log.step(step, float(loss), dt, counts(step) if counts else None)
    log.finish(schedule=schedule_name, parts=run.parts, data={"text_len": run.text_len, **log.seen()})
    write_peak(a.out)
    dist.barrier()
    dist.destroy_process_group()
    return 0


if __name__ == "__main__":
    sys.exit(main())
