"""Preemption: SIGUSR1 (Slurm's `--signal=USR1@SECS` warning, `scancel --signal=USR1`) or SIGTERM
(a preemption or time limit) asks the run to stop at the next step boundary.

The handler only records the signal: the step in flight finishes, then all ranks agree (one
MAX all-reduce of a flag per step, since the signal reaches ranks at slightly different times and
a pipeline's ranks must save at the same step), write the atomic checkpoint and exit with
EXIT_REQUEUE, which the generated sbatch script turns into `scontrol requeue`. A second signal
while a save is under way gets the default action: whoever sends it twice wants the run gone.
"""
from __future__ import annotations

import os
import signal

EXIT_REQUEUE = 75  # EX_TEMPFAIL: "try again later"; the sbatch script requeues on it
MARKER = "preempted"  # rank 0 writes OUTPUT_DIR/preempted after that checkpoint; the sbatch script requeues on it
SIGNALS = (signal.SIGUSR1, signal.SIGTERM)


class Preemption:
    def __init__(self):
        self.signum: int | None = None
        for s in SIGNALS:
            signal.signal(s, self._on_signal)

    def _on_signal(self, signum, frame):
        if self.signum is not None:
            signal.signal(signum, signal.SIG_DFL)
            os.kill(os.getpid(), signum)
            return
        self.signum = signum

    def agreed(self) -> int:
        """Collective: the signal any rank has seen (0 if none). Every rank calls it after each step."""
        import torch
        import torch.distributed as dist
        from deepspeed.accelerator import get_accelerator
        flag = torch.tensor([self.signum or 0], dtype=torch.int32, device=get_accelerator().current_device_name())
        dist.all_reduce(flag, op=dist.ReduceOp.MAX)
        return int(flag.item())

    @staticmethod
    def name(signum: int) -> str:
        return signal.Signals(signum).name
