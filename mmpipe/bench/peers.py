"""Starting the peers as their own processes (so each is measured like a variant: its own launcher,
a fresh interpreter, one thread per rank) with the shapes and batch of the sweep's 'pp2' variant, on
the sweep's data, in the classic layout (one sample per row: a peer does not pack)."""
from __future__ import annotations

import os
import sys
from pathlib import Path

from ..cluster.hostfile import with_rank_threads
from ..cluster.ports import free_port
from .run_variant import run_logged

PEER_RANKS = {"hf": 1, "torch_pipe": 2, "torch_pipe_zb": 2}  # processes a peer runs, all on one machine
PEER_SCHEDULES = {"torch_pipe": "1f1b", "torch_pipe_zb": "zbv"}  # torch_pipe_peer --schedule (zbv: 4 stages in a V)


def peer_command(kind: str, shape, sweep, out: Path) -> tuple[list[str], dict]:
    """The peer's command line and environment, run as is here or as one Slurm task on one node."""
    common = ["--preset", shape.preset, "--micro", str(shape.micro), "--gas", str(shape.gas),
              "--steps", str(sweep.steps), "--out", str(out), "--data-workers", str(shape.data_workers),
              "--data", sweep.data]  # the peers do not pack: the variant's pack / max_images stay behind
    if shape.text_len is not None:
        common += ["--text-len", str(shape.text_len)]
    if kind == "hf":
        cmd = [sys.executable, "-m", "mmpipe.bench.hf_peer", *common]
    else:
        cmd = [sys.executable, "-m", "torch.distributed.run", "--nproc_per_node", str(PEER_RANKS[kind]),
               "--master_addr", "127.0.0.1", "--master_port", str(free_port()), "-m", "mmpipe.bench.torch_pipe_peer",
               *common, "--schedule", PEER_SCHEDULES[kind]]
    env = with_rank_threads(dict(os.environ, PYTHONUNBUFFERED="1", RANK=os.environ.get("RANK", "0")))
    if kind == "hf":
        env["RANK"] = "0"
    return cmd, env


def run_peer(kind: str, shape, sweep, out: Path) -> tuple[int, str, float]:
    out.mkdir(parents=True, exist_ok=True)
    cmd, env = peer_command(kind, shape, sweep, out)
    return run_logged(cmd, env, out, sweep.timeout_s)
