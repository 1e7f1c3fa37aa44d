"""The driver inside one `mmpipe bench --slurm` job: `python -m mmpipe.bench.job SWEEP_OUT INDEX`.

It runs run INDEX of the sweep's plan (OUT/bench.json) as a local sweep would, with `srun` as its
launcher: the variant's ranks are the job's tasks (mmpipe.cluster.slurm_env maps them, as for
`mmpipe slurm`), a peer is one task that starts its own processes. Preemption is handled as for a
training job (docs/slurm.md): the ranks finish their step, checkpoint and leave OUT/.../preempted,
and the driver requeues the job; the requeued job resumes from `checkpoints/latest`. When the run is
over it writes outcome.json (exit status, wall time over all attempts, this node's peaks), and the
job that finds every run of the sweep over writes the results, as `mmpipe bench --collect` would.
"""
from __future__ import annotations

import fcntl
import json
import os
import signal
import subprocess
import sys
import time
from pathlib import Path

from ..cluster.preempt import MARKER as PREEMPTED
from ..config import ConfigError
from ..runtime import precision
from . import collect
from .main import machine
from .peak import peaks
from .peers import peer_command
from .rows import peer_base, write_outcome
from .run_variant import rank_module

GRACE_S = 60  # after the sweep's timeout: time for the ranks to finish their step before SIGKILL


def _note_term(signum, frame):
    # the batch step must outlive srun (Slurm sends TERM to both on preemption) to requeue the job
    print(f"mmpipe bench: job driver got {signal.Signals(signum).name}; waiting for the ranks", flush=True)


def main(argv=None) -> int:
    out_s, index_s = (sys.argv[1:] if argv is None else argv)[:2]
    out = Path(out_s)
    plan, sw = collect.load(out)
    item = plan["items"][int(index_s)]
    vout = out / item["dir"]
    job = os.environ.get("SLURM_JOB_ID", "")
    signal.signal(signal.SIGTERM, _note_term)
    if item["kind"] == "variant":
        v = next(v for v in sw.variants if v.name == item["name"])
        why = precision.problem(v.precision, precision.this_device())  # this node's device, not the submitter's
        if why:
            write_outcome(vout, status="unsupported", reason=why, job=job)
            return finish(out)
        cmd = [sys.executable, "-u", "-m", *rank_module(v, sw, vout)]
        if (vout / "checkpoints" / "latest").is_file():  # a requeued job continues from its checkpoint
            cmd.append("--resume")
        env = dict(os.environ)
        prec = v.precision
    else:
        _, like = peer_base(item["name"], item["repeat"], sw)
        cmd, env = peer_command(item["name"], sw.peer_shape(), sw, vout)
        prec = like.precision
    env["PYTHONUNBUFFERED"] = "1"
    (vout / PREEMPTED).unlink(missing_ok=True)  # only this attempt's preemption may requeue the job
    rc, wall = run_attempt(["srun", *cmd], env, vout, sw.timeout_s)
    attempts = _attempts(vout, rc, wall)
    if rc == 124:  # our own TERM at the timeout made the ranks checkpoint as if preempted: not a requeue
        (vout / PREEMPTED).unlink(missing_ok=True)
    if (vout / PREEMPTED).is_file() and plan.get("requeue", True):
        (vout / PREEMPTED).unlink()
        print(f"mmpipe bench: preempted; requeueing job {job}", flush=True)
        r = subprocess.run(["scontrol", "requeue", job], capture_output=True, text=True)
        if r.returncode == 0:
            return 0
        print(f"mmpipe bench: scontrol requeue failed: {r.stderr.strip()}", flush=True)
    reason = (f"timeout after {sw.timeout_s} s" if rc == 124 else
              "preempted, and not requeued (--no-requeue)" if (vout / PREEMPTED).is_file() else "")
    device, peak = peaks(sw.device, sw.peak_flops, {prec, "fp32"})
    write_outcome(vout, rc=rc, reason=reason,
                  wall_s=sum(a["wall_s"] for a in attempts), attempts=len(attempts), job=job, device=device,
                  peaks=peak, machine=machine())
    return finish(out)


def run_attempt(cmd: list[str], env: dict, vout: Path, timeout_s: float) -> tuple[int, float]:
    """srun the ranks, their output appended to run.log (one header per attempt): (exit status, wall s).
    Past the sweep's timeout srun gets TERM, which it passes to the ranks; the exit status is 124."""
    t0 = time.perf_counter()
    with open(vout / "run.log", "a") as log:
        log.write(f"# attempt {os.environ.get('SLURM_RESTART_COUNT', '0')} of job {os.environ.get('SLURM_JOB_ID')}: "
                  + " ".join(cmd) + "\n")
        log.flush()
        p = subprocess.Popen(cmd, env=env, stdout=log, stderr=subprocess.STDOUT)
        try:
            rc = p.wait(timeout=timeout_s)
        except subprocess.TimeoutExpired:
            p.terminate()
            try:
                p.wait(timeout=GRACE_S)
            except subprocess.TimeoutExpired:
                p.kill()
                p.wait()
            rc = 124
    return rc, time.perf_counter() - t0


def _attempts(vout: Path, rc: int, wall: float) -> list[dict]:
    """Every attempt of this run so far (a requeued job runs again), this one appended."""
    p = vout / "attempts.jsonl"
    with open(p, "a") as f:
        f.write(json.dumps({"job": os.environ.get("SLURM_JOB_ID"), "restart": os.environ.get("SLURM_RESTART_COUNT",
                                                                                           "0"),
                            "rc": rc, "wall_s": round(wall, 2)}) + "\n")
    return [json.loads(ln) for ln in p.read_text().splitlines() if ln.strip()]


def finish(out: Path) -> int:
    """The job that finds every run over writes the sweep's results (serialised: two can finish at once)."""
    with open(out / ".collect.lock", "w") as lock:
        fcntl.flock(lock, fcntl.LOCK_EX)
        try:
            plan, _ = collect.load(out)
        except ConfigError as e:
            print(f"mmpipe bench: not collecting: {e}", flush=True)
            return 0
        if all(it["status"] or (out / it["dir"] / collect.OUTCOME).is_file() for it in plan["items"]):
            print("mmpipe bench: every run of the sweep is over; collecting", flush=True)
            collect.collect(out, query_slurm=False)
    return 0


if __name__ == "__main__":
    sys.exit(main())
