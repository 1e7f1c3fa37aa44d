"""One variant = one launcher run: its DeepSpeed JSON, the front-door check, the deepspeed launcher,
then the measured row read back from what the ranks wrote (train_log.csv, summary.json, memory)."""
from __future__ import annotations

import copy
import csv
import json
import os
import shutil
import statistics
import subprocess
import time
from pathlib import Path

from ..cluster.ports import free_port
from ..config import ConfigError, load_preset
from ..planning.calibrate import text_len_of
from ..planning.costmodel import layer_costs
from ..run_args import TrainArgs
from ..run_config import REPO_CONFIGS, resolve
from ..runtime import precision
from .sweep import Sweep, Variant

BASE_CONFIG = REPO_CONFIGS / "cpu_fp32.json"


def ds_config(v: Variant, resolve_copy: bool = False) -> dict:
    """The variant's DeepSpeed JSON, from ds_configs/cpu_fp32.json. resolve_copy: for engine 'dp',
    the copy mmpipe.run_config checks (its pipeline rule allows ZeRO 0/1); the rank sets the real stage."""
    cfg = copy.deepcopy(json.loads(BASE_CONFIG.read_text()))
    cfg["train_micro_batch_size_per_gpu"] = v.micro
    cfg["gradient_accumulation_steps"] = v.gas
    zero = v.zero
    if resolve_copy and v.engine == "dp":
        zero = min(zero, 1)
    cfg["zero_optimization"] = {"stage": zero}
    cfg.pop("bf16", None)
    cfg.pop("fp16", None)
    if v.precision == "bf16":
        cfg["bf16"] = {"enabled": True}
    elif v.precision == "fp16":
        cfg["fp16"] = {"enabled": True, "initial_scale_power": 12, "loss_scale_window": 50}
    cfg["pipeline"] = {"stages": v.stages, "partition": v.partition,
                       "activation_checkpoint_interval": 1 if v.checkpointing else 0, "schedule": v.schedule}
    return cfg


def train_args(v: Variant, sweep: Sweep, out: Path, cfg_path: Path) -> TrainArgs:
    return TrainArgs(preset=v.preset, ds_config=str(cfg_path), stages=v.stages, steps=sweep.steps, output_dir=str(out),
                     eval_samples=0, keep_checkpoints=1, data_workers=v.data_workers, data=sweep.data, pack=v.pack,
                     max_images=v.max_images, text_len=v.text_len, freeze=v.freeze, ep=v.ep, tp=v.tp, sp=v.sp)


def check(v: Variant, sweep: Sweep, out: Path, this_device: bool = True) -> tuple[str, str] | None:
    """(status, reason) when the variant cannot run: 'refused' (mmpipe's own checks, one line per
    problem) or 'unsupported' (this device lacks its precision; with this_device=False the device is
    another machine's, a Slurm job asks its own); None when it can. Writes the config."""
    out.mkdir(parents=True, exist_ok=True)
    cfg_path = out / "ds_config.json"
    cfg = ds_config(v, resolve_copy=True)
    cfg_path.write_text(json.dumps(cfg, indent=2) + "\n")
    try:
        run = resolve(train_args(v, sweep, out, cfg_path), world_size=v.world, ds_config=cfg)
    except ConfigError as e:
        return "refused", "; ".join(str(e).splitlines())
    why = precision.problem(run.precision, precision.this_device()) if this_device else None
    return ("unsupported", why) if why else None


def first_error(log: str) -> str:
    """The first real error in a failed run's log (peers of a crashed rank only say 'connection closed')."""
    lines = log.splitlines()
    for key in ("out of memory", "OutOfMemoryError", "Error:", "error:", "Killed", "Traceback"):
        for ln in lines:
            if key in ln and "sigkill_handler" not in ln:
                return ln.strip()[-300:]
    return (lines[-1].strip() if lines else "no output")[-300:]


def rank_module(v: Variant, sweep: Sweep, out: Path) -> list[str]:
    """What each rank runs, after `python -m` (the deepspeed launcher's --module, or srun's python)."""
    module = "mmpipe.bench.rank" if v.engine == "pipe" else "mmpipe.bench.dp_rank"
    extra = [] if v.engine == "pipe" else ["--zero", str(v.zero)]
    return [module, *extra, *train_args(v, sweep, out, out / "ds_config.json").to_argv()]


def launch(v: Variant, sweep: Sweep, out: Path, where: list[str] | None = None,
           env_extra: dict | None = None) -> tuple[int, str, float]:
    """One deepspeed launch of the variant: local ranks, or `where` (--hostfile ... --include ...,
    mmpipe.bench.cluster.hostfile_where) across hosts."""
    launcher = shutil.which("deepspeed")
    if launcher is None:
        return 127, "deepspeed launcher not found on PATH", 0.0
    where = where or ["--num_gpus", str(v.world), "--master_addr", "127.0.0.1", "--master_port", str(free_port())]
    cmd = [launcher, *where, "--module", *rank_module(v, sweep, out)]
    env = dict(os.environ, PYTHONUNBUFFERED="1", **(env_extra or {}))
    env.setdefault("OMP_NUM_THREADS", "1")  # one thread per rank; the launcher does not set it
    return run_logged(cmd, env, out, sweep.timeout_s)


def _quantile(xs: list[float], q: float) -> float:
    xs = sorted(xs)
    i = (len(xs) - 1) * q
    lo, hi = int(i), min(int(i) + 1, len(xs) - 1)
    return xs[lo] + (xs[hi] - xs[lo]) * (i - lo)


def _median_iqr(xs: list[float]) -> tuple[float, float]:
    return statistics.median(xs), _quantile(xs, 0.75) - _quantile(xs, 0.25)


def measure(v: Variant, sweep: Sweep, out: Path, peak_flops: float | None) -> dict:
    """Row fields from train_log.csv (warm-up steps dropped), summary.json and memory_rank*.json.
    Per step: samples_per_s (real samples), useful_tokens_per_s (their own decoder positions) and
    positions_per_s (computed, padding included); the step time is rows x positions per row /
    positions_per_s, e.g. 64 x 28 / 7168 = 0.25 s (a packed step holds more samples than rows)."""
    with open(out / "train_log.csv", newline="") as f:
        rows = [r for r in csv.DictReader(f)]
    measured = [r for r in rows if int(r["step"]) > sweep.warmup_steps]
    sps = [float(r["samples_per_s"]) for r in measured]
    ups = [float(r["useful_tokens_per_s"]) for r in measured]
    pps = [float(r["positions_per_s"]) for r in measured]
    summary = json.loads((out / "summary.json").read_text())
    train_batch, length = summary["train_batch"], summary["decoder_length"]  # rows per step, positions per row
    step = [train_batch * length / p for p in pps]
    rows_per_s = statistics.median(p / length for p in pps)
    data = summary.get("data") or {}
    text_len = data.get("text_len") or v.text_len
    images = data.get("max_images") or v.max_images or 1  # the run's own slots (packed: from its data)
    flops = flops_per_row(v.preset, text_len, images)
    mem = []
    for r in range(v.world):
        p = out / f"memory_rank{r}.json"
        m = json.loads(p.read_text()) if p.is_file() else {}
        mem.append(m.get("max_memory_allocated_bytes") or m.get("peak_rss_bytes"))
    timing = summary.get("stage_timing") or {}
    per_stage = timing.get("per_stage") or []
    achieved = flops * rows_per_s  # the model's FLOPs on every computed position, padding included
    (s_med, s_iqr), (u_med, u_iqr), (p_med, p_iqr) = _median_iqr(sps), _median_iqr(ups), _median_iqr(pps)
    return {
        "measured_steps": len(measured), "text_len": text_len, "max_images": images,
        "samples_per_s": s_med, "samples_per_s_iqr": s_iqr, "samples_per_s_min": min(sps),
        "samples_per_s_max": max(sps),
        "useful_tokens_per_s": u_med, "useful_tokens_per_s_iqr": u_iqr,
        "positions_per_s": p_med, "positions_per_s_iqr": p_iqr, "padding_share": data.get("padding_share"),
        "step_time_s": statistics.median(step),
        "peak_mem_mb_per_rank": [round(b / 2**20, 1) if b else None for b in mem],
        "peak_mem_mb_max": round(max(b for b in mem if b) / 2**20, 1) if any(mem) else None,
        "bubble_measured": timing.get("measured_bubble"),
        "bubble_theory": (v.stages - 1) / (v.gas + v.stages - 1),
        "stage_imbalance": timing.get("max_over_mean"),
        # per stage, from summary.json's stage_timing (mmpipe.runtime.timing; a schedule's B + W is its backward)
        "parts": summary.get("parts"),
        "stage_idle": [r.get("idle_fraction") for r in per_stage] or None,
        "stage_forward_ms_per_micro": [r.get("forward_ms_per_micro") for r in per_stage] or None,
        "stage_backward_ms_per_micro": [r.get("backward_ms_per_micro") for r in per_stage] or None,
        "optimizer_ms": max((r["step_ms"] for r in per_stage if r.get("step_ms") is not None), default=None),
        "achieved_flops": achieved,
        "mfu": achieved / (peak_flops * v.world) if peak_flops else None,
        "final_loss": summary.get("final_loss"),
        "train_batch": train_batch,
    }


def flops_per_row(preset: str, text_len: int | None, images: int = 1) -> float:
    """Model FLOPs of one training row (forward + backward, recompute NOT counted: MFU's convention),
    from mmpipe's cost model for the preset at the run's text length (None: the built-in data's) and
    image slots per row (a one-sample row of the classic layout: images 1, one sample's FLOPs)."""
    cfg = load_preset(preset)
    text_len = text_len or text_len_of(cfg)
    return sum(r.fwd_flops + r.bwd_flops for r in layer_costs(cfg, (), text_len, False, images=images))


def run_logged(cmd: list[str], env: dict, out: Path, timeout_s: float) -> tuple[int, str, float]:
    """Run one launch with its output in out/run.log: (exit status, reason if it timed out, wall s)."""
    t0 = time.perf_counter()
    with open(out / "run.log", "w") as log:
        log.write(" ".join(cmd) + "\n")
        log.flush()
        try:
            rc = subprocess.call(cmd, env=env, stdout=log, stderr=subprocess.STDOUT, timeout=timeout_s)
        except subprocess.TimeoutExpired:
            return 124, f"timeout after {timeout_s} s", time.perf_counter() - t0
    return rc, "", time.perf_counter() - t0
