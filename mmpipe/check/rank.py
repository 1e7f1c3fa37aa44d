"""Rank entry of `mmpipe check`: `python -m mmpipe.check.rank` with train's flags, on the ranks `mmpipe
train` would start. Each rank resolves the same run, then every rank takes part in the checks in turn
(env, links, equivalence) while rank 0 also times the loader; rank 0 prints the table and writes
check.json in --output-dir (mmpipe.check.report)."""
from __future__ import annotations

import os
import sys
import time
from pathlib import Path

import torch.distributed as dist

from ..cluster.hostfile import rank_threads
from ..cluster.slurm_env import ranks_from_slurm
from ..config import ConfigError, fail
from ..run_config import resolve
from ..runtime.trainer import join_process_group
from ..train import parse_args
from . import env, equivalence, links, loader, report


def main(argv=None) -> int:
    args = parse_args(argv)
    ranks_from_slurm(os.environ)
    try:
        rank_threads(os.environ)
        run = resolve(args, world_size=int(os.environ.get("WORLD_SIZE", "1")))
    except ConfigError as e:
        return fail(e)
    rank = join_process_group(run.precision)
    if rank is None:
        return 2
    clock = Clock()
    env_result, ranks = clock(env.check, run.precision)
    link_rows = clock(links.measure, run)
    eq = clock(equivalence.check, run, args, rank, links.device())
    full = eq.get("pipeline_rows_per_s") if rank == 0 and eq.get("full_model") else None
    feed = clock(loader.measure, run, args.seed, args.output_dir, full) if rank == 0 else None
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        checks = {"env": env_result, "links": {"ok": all(r["ok"] for r in link_rows), "rows": link_rows},
                  "equivalence": eq, "loader": feed}
        for c, seconds in zip(checks.values(), clock.seconds):
            c["seconds"] = round(seconds, 2)
        if report.write(Path(args.output_dir), run, ranks, checks):
            return 1  # under srun (no front door): the job's exit status says it too
    return 0


class Clock:
    """Calls a check and keeps its wall seconds (check.json says where a check's minutes went)."""

    def __init__(self):
        self.seconds = []

    def __call__(self, fn, *a):
        t0 = time.perf_counter()
        out = fn(*a)
        self.seconds.append(time.perf_counter() - t0)
        return out


if __name__ == "__main__":
    sys.exit(main())
