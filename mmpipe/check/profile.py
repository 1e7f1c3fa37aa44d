"""A device profile measured on the run's own ranks, in `mmpipe plan --calibrate`'s format
(calibrate.PROFILE_KIND, read by calibrate.load_profile), so `mmpipe plan --device-profile FILE`
plans with what this hardware did rather than a data sheet's peak.

Each rank times the forward and backward of every layer kind of the run's model at full width
(costmodel.profile_layers: one layer of each kind, at the run's micro-batch, row shape, precision and
threads, on the rank's own device); rank 0 keeps the slowest rank's table (a pipeline runs at its
slowest device's pace) and turns it into the profile's terms:

    efficiency[precision] = the full model's FLOPs per micro-batch (forward + backward, as the planner
                            counts them) / (peak_flops x the seconds its layers take by the table)
    link, all-reduce      = the slowest point-to-point / all-reduce bandwidth the link check measured
                            on these ranks (none measured: the device's own figure)
    per-slot overhead     = what the equivalence run's measured step (the shrunk model on the run's own
                            layout) took beyond this profile's prediction for it, per slot (>= 0; 1F1B
                            only, 0 otherwise); per-step and split overheads 0

peak_flops is the planner's figure for the device (`--device cpu`'s measured matmul, a known GPU's
data sheet) or, for a GPU outside the table, a matmul timed on it. The table itself rides along as
`layer_kinds` (seconds per sample); the planner reads the fitted terms only."""
from __future__ import annotations

import json
import platform
import statistics
import time
from pathlib import Path

import torch
import torch.distributed as dist

from ..data.image_kinds import image_kind
from ..planning.calibrate import CHECK_SOURCE, PROFILE_KIND, load_profile, profile_device
from ..planning.costmodel import Device, Shape, profile_layers, stage_seconds
from ..planning.images import families_words, sized_families
from ..planning.layout import CPU_LINK, Training, plan_layout
from ..planning.schedule_registry import BASELINE
from ..run_config import RunConfig
from ..runtime.trainer import DTYPES
from .loader import planner_device

PROFILE_FILE = "device_profile.json"


def model_seconds(run: RunConfig, kinds: dict) -> float:
    """Forward + backward seconds of one micro-batch through every layer of the run's model, by the table."""
    f, b = stage_seconds(run.layers, [0, len(run.layers)], run.micro, Device("table", 1.0, 0.0, 1.0), kinds)[0]
    return f + b


def this_rank(run: RunConfig, dev: torch.device) -> dict:
    """This rank's layer-kind table (seconds per sample) and the model's seconds per micro-batch by it."""
    try:
        kinds = profile_layers(run.model, run.text_len, run.micro, run.precision, threads=torch.get_num_threads(),
                               images=run.max_images, device=str(dev))
    except RuntimeError as e:  # e.g. out of memory on a wide layer kind: named in the table, the other checks stand
        return {"rank": dist.get_rank(), "error": str(e).splitlines()[0][:200]}
    return {"rank": dist.get_rank(), "kinds": kinds, "seconds": model_seconds(run, kinds)}


def _matmul_peak(dev: torch.device, dtype: torch.dtype) -> float:
    """FLOP/s of a 4096^3 matmul on dev: the peak of a GPU the planner does not know."""
    a = torch.randn(4096, 4096, dtype=dtype, device=dev)
    for _ in range(3):
        a @ a
    torch.cuda.synchronize(dev)
    t0 = time.perf_counter()
    for _ in range(10):
        a @ a
    torch.cuda.synchronize(dev)
    return 2 * 4096 ** 3 * 10 / (time.perf_counter() - t0)


def slot_overhead(run: RunConfig, small: RunConfig | None, measured_step: float | None, dev: Device) -> float:
    """Seconds per slot the equivalence run's measured step took beyond dev's prediction for it (>= 0)."""
    if small is None or not measured_step or run.schedule is not BASELINE:
        return 0.0
    lay = plan_layout(small.layers, Shape(small.stages, small.dp, small.micro, small.gas),
                      Training(small.precision, min(small.zero_stage, 1), dev,
                               partition=",".join(map(str, small.parts[1:-1])) or "balanced"))  # its own split
    return max(0.0, (measured_step - lay.step["step_s"]) / lay.step["slots"]) if lay.step else 0.0


def profile_doc(run: RunConfig, slowest: dict, base: Device, link_rows: list[dict]) -> dict:
    """The profile JSON (calibrate.profile_of's fields) from the slowest rank's table; its per-slot overhead 0
    until check() sets it (slot_overhead predicts with the rest of this profile)."""
    flops = sum(r.flops for r in run.layers) * run.micro
    eff = flops / (base.peak_flops * slowest["seconds"])
    bw = {k: min((r["bandwidth"] for r in link_rows if r["kind"] == k), default=None) for k in ("p2p", "all-reduce")}
    return {"kind": PROFILE_KIND, "version": 1, "device": base.name, "peak_flops": {run.precision: base.peak_flops},
            "efficiency": {run.precision: eff}, "microbatch_overhead_s": 0.0, "step_overhead_s": 0.0,
            "split_overhead_s": 0.0, "memory_bytes": base.memory, "link_bytes_per_s": bw["p2p"] or base.link,
            "allreduce_bytes_per_s": bw["all-reduce"] or base.allreduce_link or base.link,
            "fit": {"source": CHECK_SOURCE, "model": run.model.name, "micro": run.micro, "rank": slowest["rank"],
                    "model_seconds_per_micro": slowest["seconds"], "measured_links": [k for k, v in bw.items() if v]},
            "layer_kinds": {k: {"forward_s": f, "backward_s": b} for k, (f, b) in slowest["kinds"].items()},
            "machine": {"host": platform.node(), "threads": torch.get_num_threads()}}


def _base_device(run: RunConfig, dev: torch.device) -> Device:
    base = planner_device()
    if base is not None:
        return base
    mem = float(torch.cuda.get_device_properties(dev).total_memory)
    return Device(torch.cuda.get_device_name(dev), _matmul_peak(dev, DTYPES[run.precision]), mem,
                  CPU_LINK)


def skip_reason(model) -> str | None:
    """Why no profile is written for this model (None: one is): profile_layers times a fixed-size image of each
    layer kind, and a family whose images take any size in a row budget (the registry's: Qwen2-VL's patches,
    LLaVA-NeXT's tiles) has no one image size to time its tower at."""
    kind = image_kind(model)
    if kind.flag is None:
        return None
    return (f"no profile for the {model.family} family yet: its images take any size in a row budget "
            f"(--{kind.flag.replace('_', '-')}) and the profile times fixed-size images only "
            f"({families_words(sized_families())} write none)")


def check(run: RunConfig, dev: torch.device, out_dir: str, link_rows: list[dict], small: RunConfig | None = None,
          measured_step: float | None = None) -> dict | None:
    """Collective; rank 0 writes OUT_DIR/device_profile.json and returns the result (None elsewhere). A family
    whose images take any size is skipped (passes, no profile; skip_reason says why)."""
    why = skip_reason(run.model)
    if why:
        return {"ok": True, "skipped": why} if dist.get_rank() == 0 else None
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, this_rank(run, dev))
    if dist.get_rank() != 0:
        return None
    errors = [f"rank {r['rank']}: {r['error']}" for r in rows if "error" in r]
    if errors:
        return {"ok": False, "error": "; ".join(errors)}
    slowest = max(rows, key=lambda r: r["seconds"])
    base = _base_device(run, dev)
    doc = profile_doc(run, slowest, base, link_rows)
    doc["microbatch_overhead_s"] = slot_overhead(run, small, measured_step,
                                                 profile_device({**doc, "_path": ""}, run.precision))
    path = Path(out_dir) / PROFILE_FILE
    path.parent.mkdir(parents=True, exist_ok=True)
    path.write_text(json.dumps(doc, indent=2) + "\n")
    load_profile(str(path))  # what plan reads back: a profile that fails its own reader is a bug here
    return {"ok": True, "path": str(path), "precision": run.precision, "peak_flops": base.peak_flops,
            "efficiency": doc["efficiency"][run.precision], "slowest_rank": slowest["rank"],
            "model_seconds_per_micro": {r["rank"]: r["seconds"] for r in rows},
            "median_seconds_per_micro": statistics.median(r["seconds"] for r in rows),
            "microbatch_overhead_s": doc["microbatch_overhead_s"], "link_bytes_per_s": doc["link_bytes_per_s"],
            "allreduce_bytes_per_s": doc["allreduce_bytes_per_s"],
            # the row shape it was timed at: plan's own default --text-len is the model's context, not the data's
            "plan_flags": f"--precision {run.precision} --micro {run.micro} --text-len {run.text_len}"
                          + (f" --max-images {run.max_images}" if run.max_images > 1 else "")}
