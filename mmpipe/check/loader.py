"""The loader against the pipeline: the first stage's rows/s (and samples/s) with the run's data options
(workers, crops, packing, image sizes), timed on rank 0, against the rows/s one pipeline replica takes:
the planner's prediction for the run's full model and layout on this device, or, where the equivalence
check trained the full model itself (a model of at most 2 blocks per group), that measured rate.
Passes when the loader keeps up."""
from __future__ import annotations

import time

import torch
from deepspeed.accelerator import get_accelerator

from ..data.batches import StepBatches, micro_batch_indices, rank_batches
from ..data.dataset import prepare
from ..planning.costmodel import KNOWN_DEVICES, Device, Shape
from ..planning.layout import Training, predict_layout
from ..planning.plan import cpu_device
from ..run_config import RunConfig
from ..runtime.feed import run_dataset
from ..runtime.trainer import DTYPES

MIN_SECONDS, MAX_MICRO = 2.0, 64  # timed: at least 2 micro-batches and MIN_SECONDS, at most MAX_MICRO


def planner_device() -> Device | None:
    """The planner's Device for this rank's accelerator: the CPU measured (mmpipe plan --device cpu), a
    known GPU by name (an A100 by its memory), else None (no prediction to compare with)."""
    if get_accelerator().device_name() == "cpu":
        return cpu_device()
    if not torch.cuda.is_available():
        return None
    here = torch.cuda.current_device()
    name, memory = torch.cuda.get_device_name(here).lower(), torch.cuda.get_device_properties(here).total_memory
    found = [k for k in KNOWN_DEVICES if k.split("-")[0] in name]
    if len(found) > 1:
        found = [k for k in found if k.endswith("80gb") == (memory > 50e9)]
    return KNOWN_DEVICES[found[0]] if found else None


def predicted_rows_per_s(run: RunConfig, device: Device | None) -> float | None:
    """Rows per second one pipeline replica's first stage must load: micro x GAS per predicted step."""
    if device is None:
        return None
    pipe = run.ds_config.get("pipeline", {})
    training = Training(run.precision, run.zero_stage, device, run.schedule,
                        checkpointing=int(pipe.get("activation_checkpoint_interval", 0) or 0) > 0, freeze=run.freeze)
    shape = Shape(run.stages, run.dp, run.micro, run.gas, run.ep, tp=run.tp, sp=run.sp)  # a TP / SP replica's pace
    layout = predict_layout(run.model, shape, training, run.text_len, run.max_images)
    return run.micro * run.gas / layout.step["step_s"] if layout.step else None


def measure(run: RunConfig, seed: int, out_dir: str, measured: float | None = None) -> dict:
    """Rank 0: the first stage's loader timed after its first micro-batch (worker start-up excluded).
    measured: the pipeline's rows/s of the full model, where the equivalence check trained it."""
    samples = prepare(run.data, run.model, out_dir, seed, verbose=False)
    dataset = run_dataset(run, samples, first=True, last=run.stages == 1,
                          augment_seed=seed if run.data.augment else None)
    batches = rank_batches(dataset, StepBatches(0, run.micro, run.gas, 0, run.dp), workers=run.data.workers,
                           dtype=DTYPES[run.precision])
    next(batches)
    n, t0 = 0, time.perf_counter()
    while n < MAX_MICRO and (n < 2 or time.perf_counter() - t0 < MIN_SECONDS):
        next(batches)
        n += 1
    rows_s = n * run.micro / (time.perf_counter() - t0)
    batches.close()
    plan = dataset.plan
    rows = [r for m in range(1, n + 1) for r in micro_batch_indices(m // run.gas, run.micro, run.gas, 0, run.dp)[
        m % run.gas]]
    per_row = sum(len(plan.row(r)) for r in rows) / len(rows) if plan is not None else 1.0
    need = measured or predicted_rows_per_s(run, planner_device())
    # clips (docs/video.md): decoding them is where a loader falls behind; their rate at the set's clips per sample
    stats = samples.index.stats if samples.index else {}
    clips = stats.get("clips", 0) / max(1, stats.get("good", 0))
    return {"ok": need is None or rows_s >= need, "rows_per_s": rows_s, "samples_per_s": rows_s * per_row,
            "clips_per_s": rows_s * per_row * clips if clips else None,
            "samples_per_row": per_row, "pipeline_rows_per_s": need, "micro_batches_timed": n,
            "pipeline_rate": "measured" if measured else "predicted",
            "workers": run.data.workers}
