"""A rank that raises an error in the middle of a step (issue 60): every rank stops with its own one-line reason
and exit status 1, soon, `mmpipe train` exits with that status (not a signal's), nothing aborts and no rank is left
running. One PP=2 launch of `tiny`; the fault is the MMPIPE_FAULT=raise-in-step:STEP:RANK test hook
(mmpipe.runtime.teardown.error_fault). The finished run's side (exit 0, every gloo thread joined) is asserted on
test_reliability's uninterrupted run."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import threading
import time

from conftest import ROOT

# From rank 1's error line to `mmpipe train`'s exit. A clean exit takes a few seconds: rank 1 releases its groups
# and exits, the launcher (polling each second) stops the others, rank 0 has failed on the lost connection and
# exits too. DeepSpeed's launcher waits 30 s for a rank that does not exit before it SIGKILLs it, so a rank stuck
# in its teardown (or a gloo timeout, 30 min) shows as over 30 s.
BOUND_S = 25


def _run_streamed(cmd: list[str], env: dict, limit_s: float = 400) -> tuple[int, str, float | None, float]:
    """Run `cmd` (its own process group, killed whole after limit_s); returns its status, its output, when rank 1's
    error line was read and when the command ended (time.monotonic)."""
    job = subprocess.Popen(cmd, cwd=ROOT, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                           start_new_session=True)
    killer = threading.Timer(limit_s, lambda: os.killpg(job.pid, signal.SIGKILL))
    killer.start()
    lines, fault_at = [], None
    try:
        for line in job.stdout:
            lines.append(line)
            if fault_at is None and "mmpipe: error: rank 1: " in line:
                fault_at = time.monotonic()
        rc = job.wait()
    finally:
        killer.cancel()
    return rc, "".join(lines), fault_at, time.monotonic()


def test_an_error_on_one_rank_stops_every_rank_with_its_reason_and_a_nonzero_status(tmp_path):
    out = tmp_path / "run"
    spec = "raise-in-step:2:1"  # the last stage's rank, in its first forward of step 2: rank 0 is sending to it
    cmd = [sys.executable, "-m", "mmpipe.cli", "train", "--preset", "tiny", "--stages", "2", "--steps", "3",
           "--eval-samples", "0", "--output-dir", str(out)]
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", MMPIPE_FAULT=spec)
    rc, log, fault_at, ended = _run_streamed(cmd, env)
    # the failing rank's status, passed on by the launcher: 1, not SIGABRT's 250 nor a kill's
    assert rc == 1, log[-4000:]
    assert fault_at is not None and ended - fault_at < BOUND_S, (ended - (fault_at or ended), log[-4000:])
    # each rank's one line: the raising rank names its error, its peer the lost connection it failed on
    raised = re.findall(r"mmpipe: error: rank 1: (.*)", log)
    assert raised == [f"RuntimeError: injected fault (MMPIPE_FAULT={spec}); traceback in {out}/errors/rank1.txt"]
    lost = re.findall(r"mmpipe: error: rank 0: (\w+): .*; traceback in (.*)", log)
    assert lost == [("RuntimeError", f"{out}/errors/rank0.txt")], log[-4000:]
    assert "Traceback" not in log and "terminate called" not in log and "gloo threads still running" not in log
    trace = (out / "errors" / "rank1.txt").read_text()
    assert trace.startswith("Traceback") and "in fault" in trace and trace.rstrip().endswith(f"MMPIPE_FAULT={spec})")
    # step 1 trained and logged, step 2 never finished; no rank process is left behind
    assert not (out / "summary.json").exists()
    assert [r.split(",")[0] for r in (out / "train_log.csv").read_text().splitlines()[1:]] == ["1"]
    left = subprocess.run(["pgrep", "-f", f"mmpipe.train .*{out}"], capture_output=True, text=True).stdout.split()
    assert left == [], f"rank processes still running: {left}"
