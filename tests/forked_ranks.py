"""Ranks forked from the test process on gloo, each running a check and returning its numbers: the harness the
in-process tensor- and sequence-parallel tests share. A fork inherits the parent's imports (torch, deepspeed, mmpipe)
and whatever the test built, so it starts in about a second where a spawned rank re-imports for 20-30 s."""
from __future__ import annotations

import json
import os

import torch
import torch.distributed as dist
import torch.multiprocessing as mp


def _rank(rank: int, world: int, tmp: str, work) -> None:
    from deepspeed.comm import comm as ds_comm
    from deepspeed.comm.torch import TorchBackend
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    ds_comm.cdb = TorchBackend("gloo", ds_comm.default_pg_timeout, None)  # the vocab-parallel loss's collectives
    out = work(rank)
    with open(f"{tmp}/out{rank}.json", "w") as f:
        json.dump(out, f)
    dist.barrier()
    os._exit(0)  # leave without destructors (gloo's SIGABRT at exit)


def forked(tmp, work, world: int = 2) -> list:
    """work(rank) -> a JSON-able result, run on `world` forked gloo ranks (the WORLD group: dist.group.WORLD);
    their results in rank order. A rank that raises leaves no file, and the read below names it."""
    mp.start_processes(_rank, args=(world, str(tmp), work), nprocs=world, start_method="fork")
    return [json.loads((tmp / f"out{r}.json").read_text()) for r in range(world)]


def check_rank(rank: int, world: int, tmp: str, argv: list[str]):
    """A forked rank of `mmpipe check`'s in-process tests, set up as the launcher sets a rank up (its environment, one
    thread, the gloo group, DeepSpeed's communication) with the run resolved from argv: (args, run)."""
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE=str(world))
    import deepspeed

    from mmpipe.run_args import TrainArgs
    from mmpipe.run_config import resolve
    from mmpipe.runtime import trainer
    trainer.setup_torch()  # one thread before any op: a forked child must not enter the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=world)
    deepspeed.init_distributed()
    args = TrainArgs.from_argv(argv)
    return args, resolve(args, world_size=world)
