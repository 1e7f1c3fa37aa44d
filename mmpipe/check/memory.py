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
stage predicted over its device fails the check without running.

At --tp / --sp the prediction is one rank's of the layout, as `mmpipe plan` prices it (rank_rows: one TP rank's
slices and activations / TP with --sequence-parallel, one SP rank's L / SP positions of those). The process's peak
on CPU cannot see a rank's slice (a tiny model's whole weight is KBs under the 256 MiB slack), so each rank's
parameter bytes are counted too, exactly (weights(): each of the module's parameters once, numel x element size),
and held to the planner's `weights` within WEIGHTS_TOLERANCE: a rank that kept a whole weight beside (or instead of)
its slice, or a slice the planner does not price, fails at any size."""
from __future__ import annotations

import gc
import os
from pathlib import Path

import torch
import torch.distributed as dist

from ..data.dataset import prepare
from ..planning.costmodel import LayerCost, Shape, stage_memory
from ..planning.sequence_parallel import sp_layer_costs, sp_stage_rows
from ..planning.tensor_parallel import tp_layer_costs
from ..run_args import TrainArgs
from ..run_config import RunConfig
from ..runtime.preference import LiveReference
from ..runtime.trainer import DataStream, Progress, build_engine, load_run_weights

TOLERANCE = {"cuda": 1.25, "cpu": 3.0}  # x the planner's stage memory
# bytes: on a GPU kernels' workspaces (cuBLAS) and the allocator's rounding; on CPU the one-time allocations
SLACK = {"cuda": 256 << 20, "cpu": 256 << 20}
# a rank's parameter bytes against the planner's weights: both count the same tensors (the layer's parameters, a
# tied module once a stage), so any difference is a tensor one side holds and the other does not; 1% for rounding
WEIGHTS_TOLERANCE = 0.01
STATUS = Path("/proc/self/status")


def rank_rows(run: RunConfig) -> list[LayerCost]:
    """The planner's rows as one rank of the run's layout holds them, as `mmpipe plan` prices a layout: at --tp one TP
    rank's (tp_layer_costs: split weights / TP, activations / TP with --sequence-parallel), at --sp one SP rank's of
    those (sp_layer_costs: L / SP positions, the tower split by images where one stage holds it, sp_stage_rows)."""
    rows = tp_layer_costs(run.model, run.layers, run.tp, run.sequence_parallel)
    return sp_stage_rows(sp_layer_costs(run.model, rows, run.sp, run.tp, run.max_images), run.parts)


def predicted_states(run: RunConfig) -> list[dict]:
    """stage_memory's dict per stage for one rank of the run's layout (an `--ep` run's ranks holding 1 / EP of the
    experts, a TP rank its slices, an SP rank its positions): weights, grads, optimizer, activations, total."""
    shape = Shape(run.stages, run.dp, run.micro, run.gas, run.ep, run.tp, run.sp)
    live = bool(run.objective.reference and not run.reference_logps)  # dpo: each stage's copy of its trained weights
    rows = rank_rows(run)
    return [stage_memory(rows, run.parts, s, shape, run.precision, run.zero_stage, reference=live)
            for s in range(run.stages)]


def predicted(run: RunConfig) -> list[float]:
    """The planner's bytes per stage for one rank of the run's layout (predicted_states' totals)."""
    return [m["total"] for m in predicted_states(run)]


def weights(module: torch.nn.Module) -> int:
    """The bytes of a module's parameters, each once (a tied module's weight is one tensor: parameters() dedups)."""
    return sum(p.numel() * p.element_size() for p in module.parameters())


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
           "how": peak.what if peak else why, "weights": weights(engine.module)}
    del engine, stream
    gc.collect()
    if dev.type == "cuda":
        torch.cuda.empty_cache()  # the full model's blocks back to the device before the other checks
    return out


def check(run: RunConfig, args: TrainArgs, rank: int, dev: torch.device) -> dict | None:
    """Collective; the verdict on rank 0 (None elsewhere)."""
    states, room = predicted_states(run), device_memory(dev)
    want = [m["total"] for m in states]
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, None if max(want) > room else step(run, args, rank, dev))
    if rank:
        return None
    why = unpriced_weights(run)
    own = None if why else [m["weights"] for m in states]
    out = judge(rows, want, room, dev.type, own, f"tp {run.tp} x sp {run.sp}")
    return {**out, "weights_unchecked": why} if why else out


def unpriced_weights(run: RunConfig) -> str:
    """Why a rank's parameter bytes are not held to the planner's ('' where they are)."""
    if run.schedule.stages_per_rank > 1:
        return "a DualPipeV rank holds two stages (r and 2P - 1 - r): its parameters are no one stage's"
    if run.lora is not None and run.tp > 1:
        # the runtime splits a split linear's adapter with it (tensor_parallel.adapters_split), the planner counts it
        # whole (tensor_parallel._row_split: --lora is not planned at TP > 1). E.g. llava-tiny --lora 4 --freeze
        # vision at TP 2: 157,184 B a rank, the planner's 161,792
        return "the planner prices LoRA adapters whole at --tp > 1 (the runtime splits them with their linears)"
    return ""


def judge(rows: list[dict | None], want: list[float], room: float, kind: str, want_weights: list[float] | None = None,
          layout: str = "") -> dict:
    """rows: each rank's step (None everywhere when a stage did not fit and nothing ran). want_weights: the planner's
    parameter bytes per stage for one rank, each rank's `weights` held to them (WEIGHTS_TOLERANCE); layout: the
    model axes they were priced at, for the failure's line."""
    kind = "cuda" if kind == "cuda" else "cpu"
    base = {"tolerance": TOLERANCE[kind], "slack_bytes": SLACK[kind], "predicted_bytes": want, "device_bytes": room,
            "weights_tolerance": WEIGHTS_TOLERANCE, "predicted_weights_bytes": want_weights}
    over = [s for s, b in enumerate(want) if b > room]
    if over:
        return {**base, "ok": False, "ran": False, "over": over,
                "error": "; ".join(f"stage {s} predicted {want[s] / 2**30:.1f} GiB > the device's "
                                   f"{room / 2**30:.1f} GiB: not run" for s in over)}
    for r in rows:
        r["predicted"] = want[r["stage"]]
        r["ok"] = r["measured"] is None or r["measured"] <= r["predicted"] * TOLERANCE[kind] + SLACK[kind]
        if want_weights is not None and r.get("weights") is not None:
            r["predicted_weights"] = want_weights[r["stage"]]
            r["weights_ok"] = abs(r["weights"] - r["predicted_weights"]) <= WEIGHTS_TOLERANCE * r["predicted_weights"]
            r["ok"] = r["ok"] and r["weights_ok"]
    off = [r for r in rows if not r.get("weights_ok", True)]
    out = {**base, "ok": all(r["ok"] for r in rows), "ran": True, "ranks": rows}
    if off:  # the process's peak cannot show these on CPU: named, with both counts
        out["error"] = "; ".join(
            f"rank {r['rank']} (stage {r['stage']}) holds {r['weights'] / 2**20:.3f} MiB of parameters, the planner's "
            f"{r['predicted_weights'] / 2**20:.3f} MiB at {layout}" for r in off)
    return out
