"""Starting the peers as their own processes (so each is measured like a variant: its own launcher,
a fresh interpreter, one thread per rank) with the shapes and batch of the sweep's 'pp2' variant."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..cluster.ports import free_port
from .run_variant import run_logged


def run_peer(kind: str, shape, sweep, out: Path) -> tuple[int, str, float]:
    out.mkdir(parents=True, exist_ok=True)
    common = ["--preset", shape.preset, "--micro", str(shape.micro), "--gas", str(shape.gas),
              "--steps", str(sweep.steps), "--out", str(out), "--data-workers", str(shape.data_workers)]
    if kind == "hf":
        cmd = [sys.executable, "-m", "mmpipe.bench.hf_peer", *common]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", "2", "--master_addr", "127.0.0.1",
               "--master_port", str(free_port()), "-m", "mmpipe.bench.torch_pipe_peer", *common]
    env = dict(os.environ, PYTHONUNBUFFERED="1", RANK=os.environ.get("RANK", "0"))
    env.setdefault("OMP_NUM_THREADS", "1")
    if kind == "hf":
        env["RANK"] = "0"
    return run_logged(cmd, env, out, sweep.timeout_s)
