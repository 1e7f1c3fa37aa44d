"""`--full-step`: one real training step of the run's FULL model (every stage, the run's layout, data,
precision and ZeRO, through the trainer's own engine), each rank's peak memory measured against the
planner's memory for its stage (costmodel.stage_memory, what `mmpipe plan` prints per stage).

What "measured" is:
  - on a GPU: torch.cuda.max_memory_allocated during the step's engine build and step, minus what was
    allocated before (the planner's states + activations; the CUDA context, the caching allocator's
    reserve and NCCL's buffers are not in it);
  - on CPU: the process's resident set high-water mark (VmHWM, /proc/self/status) during the engine
    build and the step, minus the resident set (VmRSS) before it, the high-water mark reset first
    (/proc/self/clear_refs "5"), so it is this step's peak, not the process's. It counts everything the
    step touched (torch has no CPU allocator statistics): weights, gradients, optimizer state and
    activations, and also DeepSpeed's and gloo's buffers and the allocator's slack, hence CPU_SLACK.
    Loader workers are separate processes and are not counted.

A rank fails when measured > predicted x TOLERANCE[device] + SLACK[device]: the planner's figure is
what `mmpipe plan` fits a layout to a device with, so a run that needs more than that plus a margin can
run out of memory where the plan said it fits. On CPU the margin is wide: the RSS a model adds was
1.4-3.0x the planner's states + activations on `small` (docs/partition_benchmark.md: glibc keeps freed
activations, autograd's temporaries), and the first step's one-time allocations (first-use imports,
DeepSpeed's and gloo's buffers) add ~150 MiB whatever the model (157 MiB measured against 23 MiB
predicted for stage 0 of `small`). The step is run only where every stage fits
its device by the prediction (a pipeline step is collective: one stage that cannot run stops all); a
stage predicted over its device fails the check without running."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..data.dataset import prepare
from ..planning.costmodel import Shape, stage_memory
from ..run_args import TrainArgs
from ..run_config import RunConfig
from ..runtime.preference import LiveReference
from ..runtime.trainer import DataStream, Progress, build_engine, load_run_weights

TOLERANCE = {"cuda": 1.25, "cpu": 3.0}  # x the planner's stage memory
# bytes: on a GPU kernels' workspaces (cuBLAS) and the allocator's rounding; on CPU the one-time allocations
SLACK = {"cuda": 256 << 20, "cpu": 256 << 20}
STATUS = Path("/proc/self/status")


def predicted(run: RunConfig) -> list[float]:
    """The planner's bytes per stage for the run's layout (an `--ep` run's ranks holding 1 / EP of the experts)."""
    shape = Shape(run.stages, run.dp, run.micro, run.gas, run.ep)
    live = bool(run.objective.reference and not run.reference_logps)  # dpo: each stage's copy of its trained weights
    return [stage_memory(run.layers, run.parts, s, shape, run.precision, run.zero_stage, reference=live)["total"]
            for s in range(run.stages)]


def _status_bytes(key: str) -> int:
    for line in STATUS.read_text().splitlines():
        if line.startswith(key + ":"):
            return int(line.split()[1]) * 1024  # kB
    raise OSError(f"{STATUS} has no {key}")


class Peak:
    """This process's peak memory from start() to stop(), in bytes above what it held at start()."""

    def __init__(self, dev: torch.device):
        self.cuda = dev.type == "cuda"
        self.what = "max_memory_allocated" if self.cuda else "VmHWM - VmRSS before"

    def start(self) -> None:
        gc.collect()
        if self.cuda:
            torch.cuda.synchronize()
            torch.cuda.reset_peak_memory_stats()
            self.base = torch.cuda.memory_allocated()
            return
        self.base = _status_bytes("VmRSS")
        Path("/proc/self/clear_refs").write_text("5")  # resets VmHWM to the current RSS (Linux >= 4.0)

    def stop(self) -> int:
        if self.cuda:
            torch.cuda.synchronize()
            return torch.cuda.max_memory_allocated() - self.base
        return _status_bytes("VmHWM") - self.base


def device_memory(dev: torch.device) -> float:
    """Bytes one rank may use: the GPU's, or on CPU the host's RAM shared by the ranks on it."""
    if dev.type == "cuda":
        return float(torch.cuda.get_device_properties(dev).total_memory)
    ram = os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES")
    local = os.environ.get("LOCAL_SIZE") or os.environ.get("SLURM_NTASKS_PER_NODE") or "1"  # deepspeed / srun
    return ram / int(local)


def step(run: RunConfig, args: TrainArgs, rank: int, dev: torch.device) -> dict:
    """Collective: one step of the full model; this rank's measured peak (None where it could not measure)."""
    peak = Peak(dev)
    try:
        peak.start()
    except OSError as e:  # no /proc (not Linux): the step still runs with every rank, unmeasured here
        peak, why = None, f"cannot measure: {e}"
    engine = build_engine(run, args, rank)
    stream = DataStream(engine, run, args, prepare(run.data, run.model, args.output_dir, args.seed, verbose=False),
                        Progress())
    # dpo: the live reference's copy and its pass, as training holds and runs them (the memory the planner counts)
    reference = LiveReference(engine, run, load_run_weights) if run.objective.reference and not run.reference_logps \
        else None
    loss = engine.train_batch(data_iter=reference.step(stream.batches) if reference else stream.batches).item()
    stream.close()
    out = {"rank": rank, "stage": engine.stage_id, "loss": loss, "measured": peak.stop() if peak else None,
           "how": peak.what if peak else why}
    del engine, stream
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the full model's blocks back to the device before the other checks
    return out


def check(run: RunConfig, args: TrainArgs, rank: int, dev: torch.device) -> dict | None:
    """Collective; the verdict on rank 0 (None elsewhere)."""
    want, room = predicted(run), device_memory(dev)
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, None if max(want) > room else step(run, args, rank, dev))
    return judge(rows, want, room, dev.type) if rank == 0 else None


def judge(rows: list[dict | None], want: list[float], room: float, kind: str) -> dict:
    """rows: each rank's step (None everywhere when a stage did not fit and nothing ran)."""
    kind = "cuda" if kind == "cuda" else "cpu"
    base = {"tolerance": TOLERANCE[kind], "slack_bytes": SLACK[kind], "predicted_bytes": want, "device_bytes": room}
    over = [s for s, b in enumerate(want) if b > room]
    if over:
        return {**base, "ok": False, "ran": False, "over": over,
                "error": "; ".join(f"stage {s} predicted {want[s] / 2**30:.1f} GiB > the device's "
                                   f"{room / 2**30:.1f} GiB: not run" for s in over)}
    for r in rows:
        r["predicted"] = want[r["stage"]]
        r["ok"] = r["measured"] is None or r["measured"] <= r["predicted"] * TOLERANCE[kind] + SLACK[kind]
    return {**base, "ok": all(r["ok"] for r in rows), "ran": True, "ranks": rows}
