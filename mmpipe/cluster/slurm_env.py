"""Rank discovery under `srun` without mpi4py: one Slurm task per rank.

DeepSpeed 0.19.8 does not read SLURM_* (its `--launcher slurm` relies on mpi4py), and
torch.distributed's env:// wants RANK / LOCAL_RANK / WORLD_SIZE / MASTER_ADDR / MASTER_PORT. The
sbatch script exports MASTER_ADDR (the job's first node) and MASTER_PORT; this fills in the rest
from the task's own Slurm variables. A launcher that already set RANK (deepspeed, torchrun) wins.
"""
from __future__ import annotations

import os

MAPPING = {"RANK": "SLURM_PROCID", "LOCAL_RANK": "SLURM_LOCALID", "WORLD_SIZE": "SLURM_NTASKS"}


def ranks_from_slurm(env=os.environ) -> bool:
    """Set RANK, LOCAL_RANK, WORLD_SIZE from an srun task's variables; True if it did."""
    if "RANK" in env or not all(v in env for v in MAPPING.values()) or "SLURM_STEP_ID" not in env:
        return False  # not an srun task (the batch shell has no step id), or another launcher's rank
    for ours, theirs in MAPPING.items():
        env[ours] = env[theirs]
    return True
