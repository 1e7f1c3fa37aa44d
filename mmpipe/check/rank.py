"""Rank entry of `mmpipe check`: `python -m mmpipe.check.rank` with train's flags, on the ranks `mmpipe
train` would start. Each rank resolves the same run, then every rank takes part in the checks in turn
(env, links, equivalence) while rank 0 also times the loader; rank 0 prints the table and writes
check.json in --output-dir (mmpipe.check.report)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

import deepspeed
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator

from ..cluster.hostfile import rank_threads
from ..cluster.slurm_env import ranks_from_slurm
from ..config import ConfigError, fail
from ..run_config import resolve
from ..runtime.trainer import refuse_unsupported, setup_torch
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
    setup_torch()
    deepspeed.init_distributed()
    rank = dist.get_rank()
    if get_accelerator().device_name() != "cpu":  # each rank on its own device (NCCL needs it before any collective)
        get_accelerator().set_device(int(os.environ.get("LOCAL_RANK", "0")))
    if refuse_unsupported(run.precision, rank):
        return 2
    env_result, ranks = env.check(run.precision)
    link_rows = links.measure(run)
    eq = equivalence.check(run, args, rank, links.device())
    feed = loader.measure(run, args.seed, args.output_dir) if rank == 0 else None
    dist.barrier()
    dist.destroy_process_group()
    if rank == 0:
        checks = {"env": env_result, "links": {"ok": all(r["ok"] for r in link_rows), "rows": link_rows},
                  "equivalence": eq, "loader": feed}
        report.write(Path(args.output_dir), run, ranks, checks)
    return 0


if __name__ == "__main__":
    sys.exit(main())
