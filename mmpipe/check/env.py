"""Each rank's environment: host, device, whether it runs the run's precision, the torch / DeepSpeed /
NCCL versions and the process group's backend. Fails on a rank that cannot run the precision or on
ranks that disagree about a version (one run, one software stack)."""
from __future__ import annotations

import socket

import deepspeed
import torch
import torch.distributed as dist

from ..runtime.precision import problem, this_device

VERSIONS = ("torch", "deepspeed", "nccl")


def this_rank(precision: str) -> dict:
    dev = this_device()
    nccl = None
    if torch.cuda.is_available():  # a tuple (2, 21, 5) in torch 2.x, an int (2708) in older releases
        v = torch.cuda.nccl.version()
        nccl = ".".join(map(str, v)) if isinstance(v, tuple) else str(v)
    return {"rank": dist.get_rank(), "host": socket.gethostname(), "device": dev.describe(),
            "precision": precision, "precision_problem": problem(precision, dev), "torch": torch.__version__,
            "deepspeed": deepspeed.__version__, "nccl": nccl, "backend": dist.get_backend()}


def check(precision: str) -> tuple[dict | None, list[dict]]:
    """Collective: (the verdict, every rank's row) on rank 0; (None, []) elsewhere."""
    rows = [None] * dist.get_world_size()
    dist.all_gather_object(rows, this_rank(precision))
    if dist.get_rank() != 0:
        return None, []
    problems = [f"rank {r['rank']} ({r['host']}): {r['precision_problem']}" for r in rows if r["precision_problem"]]
    problems += [f"{k} differs between ranks: {sorted({str(r[k]) for r in rows})}" for k in VERSIONS
                 if len({r[k] for r in rows}) > 1]
    return {"ok": not problems, "problems": problems, "backend": rows[0]["backend"], "ranks": len(rows)}, rows
