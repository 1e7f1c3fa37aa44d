"""Rank entry of `mmpipe check`: `python -m mmpipe.check.rank` with train's flags, on the ranks `mmpipe
train` would start. Each rank resolves the same run, then every rank takes part in the checks in turn
(env, links, with --full-step memory, equivalence, profile) while rank 0 also times the loader; rank 0
prints the table and writes check.json and device_profile.json in --output-dir (mmpipe.check.report)."""
from __future__ import annotations

import argparse
import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from ..cluster.hostfile import rank_threads
from ..cluster.slurm_env import ranks_from_slurm
from ..config import ConfigError, fail
from ..flags import add_flags, from_namespace
from ..run_args import CheckArgs, TrainArgs
from ..run_config import resolve
from ..runtime.trainer import join_process_group
from ..train import parse_args
from . import env, equivalence, links, loader, memory, profile, report


def parse(argv=None) -> tuple[TrainArgs, CheckArgs]:
    """train's flags (mmpipe.train.parse_args) and check's own (CheckArgs), from one command line."""
    p = argparse.ArgumentParser(add_help=False)
    add_flags(p, CheckArgs)
    ns, rest = p.parse_known_args(argv)
    return parse_args(rest), from_namespace(CheckArgs, ns)


def main(argv=None) -> int:
    args, opts = parse(argv)
    ranks_from_slurm(os.environ)
    try:
        rank_threads(os.environ)
        run = resolve(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        return fail(e)
    rank = join_process_group(run.precision)
    if rank is None:
        return 2
    clock, dev, checks = Clock(), links.device(), {}
    checks["env"], ranks = clock("env", env.check, run.precision)
    link_rows = clock("links", links.measure, run)
    checks["links"] = {"ok": all(r["ok"] for r in link_rows), "rows": link_rows}
    _whole_layer_checks(run, args, opts, rank, dev, link_rows, checks, clock)
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        for name, c in checks.items():
            c["seconds"] = round(clock.seconds.get(name, 0.0), 2)  # (0: a check skipped)
        if report.write(Path(args.output_dir), run, ranks, checks):
            return 1  # under srun (no front door): the job's exit status says it too
    return 0


# --tp / --sp: what the check does not run yet, and why (docs/tensor_parallel.md, docs/sequence_parallel.md). The
# equivalence runs there (the pipeline's model-axis ranks against the single-device loop: equivalence._replica0), and
# the --full-step memory (each rank against the planner's one rank of the layout: memory.rank_rows)
SKIPPED = {"tp": "it times a whole stage's layers on each rank for the planner's device profile",
           "sp": "it times a whole stage's layers on whole rows on each rank for the planner's device profile"}
SKIPPED["tp x sp"] = SKIPPED["sp"]


def _skipped(run, rank: int) -> dict | None:
    """The profile's row at --tp / --sp (on rank 0; None elsewhere)."""
    if run.tp > 1 and run.sp > 1:
        axis, flags = "tp x sp", f"--tp {run.tp} --sp {run.sp}"
    else:
        axis, flags = ("tp", f"--tp {run.tp}") if run.tp > 1 else ("sp", f"--sp {run.sp}")
    return None if rank else {"ok": True, "skipped": f"skipped at {flags}: {SKIPPED[axis]}"}


def _whole_layer_checks(run, args: TrainArgs, opts: CheckArgs, rank: int, dev, link_rows: list, checks: dict,
                        clock) -> None:
    """memory (with --full-step), equivalence, the loader against the pipeline's rate, the device profile; on the
    model axis (--tp / --sp) the profile is skipped (SKIPPED), the others run."""
    if opts.full_step:  # before the others: its peak is measured above a baseline they would have raised
        checks["memory"] = clock("memory", memory.check, run, args, rank, dev)
    eq = checks["equivalence"] = clock("equivalence", equivalence.check, run, args, rank, dev)
    full = eq.get("pipeline_rows_per_s") if rank == 0 and eq.get("full_model") else None
    checks["loader"] = clock("loader", loader.measure, run, args.seed, args.output_dir, full) if rank == 0 else None
    if run.tp * run.sp > 1:
        checks["profile"] = _skipped(run, rank)
        return
    small, step_s = shrunk_step(run, args, eq) if rank == 0 else (None, None)
    checks["profile"] = clock("profile", profile.check, run, dev, args.output_dir, link_rows, small, step_s)


def shrunk_step(run, args: TrainArgs, eq: dict):
    """The equivalence run's shrunk run and its measured step seconds (for the profile's per-slot overhead)."""
    if not eq.get("pipeline_rows_per_s"):
        return None, None
    try:
        return equivalence.shrunk_run(run, args), run.micro * run.gas / eq["pipeline_rows_per_s"]
    except ConfigError:
        return None, None


class Clock:
    """Calls a check and keeps its wall seconds by name (check.json says where a check's minutes went)."""

    def __init__(self):
        self.seconds = {}

    def __call__(self, name: str, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        self.seconds[name] = time.perf_counter() - t0
        return out


if __name__ == "__main__":
    sys.exit(main())
