"""Cluster launch for real: a 2-stage pipeline over two ssh "hosts" via `deepspeed --hostfile`
(pdsh), the same pipeline as a Slurm batch job from `mmpipe slurm --submit`, and that job
preempted with USR1, requeued and resumed. Every run's losses equal one single-host run's."""
from __future__ import annotations

import os
import re
import signal
import subprocess
import sys
import time
from pathlib import Path

import psutil
import pytest

from conftest import ROOT, Run, fixed_schedule_config, train_run
from mmpipe.cluster.ports import free_port
from services import slurm_cluster, ssh_cluster

STEPS = 120  # ~50-90 ms a step on tiny (by load): ~6-11 s of training, the single-host reference's too
# the preemption tests signal once the run has logged this many steps; the signal lands a few steps later
# (3 on a loaded machine here), so the run is still training with 110 steps (5+ s) to spare
SIGNAL_AFTER = 10


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return fixed_schedule_config(tmp_path_factory.mktemp("cfg") / "ds.json", STEPS)


def _args(cfg, steps):
    return ["--preset", "tiny", "--ds-config", str(cfg), "--eval-samples", "0", "--seed", "2", "--stages", "2",
            "--steps", str(steps)]


@pytest.fixture(scope="module")
def single_host(tmp_path_factory, cfg):
    """The reference: both stages on this host through the plain deepspeed launcher."""
    return train_run(tmp_path_factory.mktemp("ref"), *_args(cfg, STEPS)).check()


def test_two_host_hostfile_pipeline_equals_single_host(tmp_path, cfg, single_host):
    with ssh_cluster(tmp_path / "ssh") as (hosts, ssh_opts):
        hostfile = tmp_path / "hostfile"
        hostfile.write_text("".join(f"{h} slots=1\n" for h in hosts))
        out = tmp_path / "run"
        env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", PDSH_SSH_ARGS_APPEND=ssh_opts)
        proc = subprocess.run([sys.executable, "-m", "mmpipe.cli", "train", "--hostfile", str(hostfile),
                               "--master-port", str(free_port()), "--output-dir", str(out), *_args(cfg, 20)],
                              cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
        # the shell wrapper for your own launches: the same pdsh launch; its ssh check is DeepSpeed's
        # (plain ssh to the first host), which cannot see PDSH_SSH_ARGS_APPEND's key, so skip it
        out2 = tmp_path / "wrapper"
        proc2 = subprocess.run(["launch/deepspeed_hostfile.sh", str(hostfile), hosts[0], "--no_ssh_check",
                                "--master_port", str(free_port()), "--", "--output-dir", str(out2), *_args(cfg, 5)],
                               cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)
    run = Run(out, proc).check()
    wrapped = Run(out2, proc2).check()
    log = proc.stdout + proc.stderr
    # pdsh prefixes each remote line with its host: each "host" started its own rank
    for h in hosts:
        assert re.search(rf"^{h}: ", log, re.M), f"no output from {h}:\n{log[-3000:]}"
    assert "--hostfile" in log and "pdsh" in log
    assert run.summary["stages"] == 2 and run.summary["dp"] == 1
    ref = single_host.losses
    assert run.losses == {s: ref[s] for s in range(1, 21)}
    assert wrapped.losses == {s: ref[s] for s in range(1, 6)}
    assert all(re.search(rf"^{h}: ", proc2.stdout + proc2.stderr, re.M) for h in hosts)


def _wait_rows(log_csv: Path, n: int, timeout: float = 180) -> None:
    """Until the run has logged n steps: well inside the run, never at its end."""
    deadline = time.time() + timeout
    while time.time() < deadline and (not log_csv.is_file() or len(log_csv.read_text().splitlines()) < 1 + n):
        time.sleep(0.05)
    assert log_csv.is_file(), "the run never started training"


def _job_state(env, job) -> dict:
    r = subprocess.run(["scontrol", "show", "job", job], env=env, capture_output=True, text=True)
    return dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)


def _wait_job(env, job, timeout=300) -> dict:
    deadline = time.time() + timeout
    while time.time() < deadline:
        st = _job_state(env, job)
        if st.get("JobState") in ("COMPLETED", "FAILED", "CANCELLED", "TIMEOUT", "NODE_FAIL", "OUT_OF_MEMORY"):
            return st
        time.sleep(0.5)
    raise AssertionError(f"job {job} still {_job_state(env, job).get('JobState')} after {timeout} s")


def _submit(env, out, cfg, steps, *extra) -> str:
    proc = subprocess.run([sys.executable, "-m", "mmpipe.cli", "slurm", "--submit", "--nodes", "1",
                           "--tasks-per-node", "2", "--job-name", "mmpipe-test", "--time", "10:00",
                           "--output-dir", str(out), *_args(cfg, steps), *extra],
                          cwd=ROOT, env=env, capture_output=True, text=True, timeout=120)
    assert proc.returncode == 0, proc.stderr
    job = proc.stdout.strip().splitlines()[-1]
    assert job.isdigit(), proc.stdout
    return job


@pytest.fixture(scope="module")
def slurm(tmp_path_factory):
    with slurm_cluster(tmp_path_factory.mktemp("slurm")) as env:
        yield dict(env, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")


def test_slurm_submit_trains_a_two_stage_pipeline_preempted_requeued_and_resumed(tmp_path, cfg, slurm, single_host):
    """`mmpipe slurm --submit`: two srun tasks become the 2-stage pipeline's ranks, without any launcher of
    ours; USR1 mid-run stops it after a step with a checkpoint, Slurm requeues the job, and it resumes."""
    out = tmp_path / "run"
    job = _submit(slurm, out, cfg, STEPS)
    _wait_rows(out / "train_log.csv", SIGNAL_AFTER)
    subprocess.run(["scancel", "--signal=USR1", job], env=slurm, check=True)
    deadline = time.time() + 120
    while time.time() < deadline:  # through REQUEUED / COMPLETING back to the queue
        st = _job_state(slurm, job)
        if st.get("Restarts") == "1":
            break
        time.sleep(0.5)
    assert st.get("Restarts") == "1", st
    # Slurm holds a requeued job back for the credential lifetime (services.py: cred_expire=10);
    # forcing StartTime=now before then fails it with "Job credential revoked"
    st = _wait_job(slurm, job, timeout=400)
    log = (out / f"slurm-{job}.out").read_text()
    assert st["JobState"] == "COMPLETED", log[-4000:]
    stopped = re.search(rf"mmpipe: SIGUSR1: stopped after step (\d+) of {STEPS}", log)
    assert stopped, log[-4000:]
    k = int(stopped[1])
    assert SIGNAL_AFTER <= k < STEPS
    assert f"requeueing job {job}" in log
    assert int(st["Restarts"]) == 1
    run = Run(out, None)
    assert (out / "summary.json").is_file(), log[-4000:]
    assert run.summary["start_step"] == k  # resumed from the preemption checkpoint, not from scratch
    # two srun tasks became rank 0 and 1 of a 2-stage pipeline
    assert run.summary["stages"] == 2 and run.summary["dp"] == 1
    assert "mmpipe: done" in log
    # every step exactly once, and the same losses as the uninterrupted run: nothing lost or repeated
    assert [int(r["step"]) for r in run.rows] == list(range(1, STEPS + 1))
    assert run.losses == single_host.losses


def test_sigterm_under_the_deepspeed_launcher_checkpoints_and_resumes(tmp_path, cfg, single_host):
    """SIGTERM (a preemption, a time limit) to the ranks outside Slurm: the same stop, save, exit 75;
    `--resume` continues with nothing lost or repeated."""
    out = tmp_path / "run"
    job = subprocess.Popen([sys.executable, "-m", "mmpipe.cli", "train", "--output-dir", str(out), *_args(cfg, STEPS)],
                           cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1"),
                           stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    _wait_rows(out / "train_log.csv", SIGNAL_AFTER)
    ranks = subprocess.run(["pgrep", "-f", f"mmpipe.train --local_rank=.*{out}"], capture_output=True, text=True)
    found = {int(p) for p in ranks.stdout.split()}
    pids = [p for p in found if psutil.Process(p).ppid() not in found]  # not the ranks' loader workers
    assert len(pids) == 2, ranks.stdout
    for pid in pids:
        os.kill(pid, signal.SIGTERM)
    text, _ = job.communicate(timeout=120)
    stopped = re.search(rf"mmpipe: SIGTERM: stopped after step (\d+) of {STEPS}", text)
    assert stopped, text[-3000:]
    k = int(stopped[1])
    assert job.returncode != 0 and not (out / "summary.json").exists()
    assert (out / "checkpoints" / "latest").read_text() == f"step{k}" and (out / "preempted").is_file()
    resumed = train_run(out, *_args(cfg, STEPS), "--resume").check()
    assert resumed.summary["start_step"] == k
    assert [int(r["step"]) for r in resumed.rows] == list(range(1, STEPS + 1))
    assert resumed.losses == single_host.losses


def test_free_port_is_reserved_for_its_launch():
    """The rendezvous port stays out of everyone else's way until rank 0's TCPStore binds it (it is left in
    TIME_WAIT: a plain bind, as another launch's port probe or a connection's source port would take it,
    is refused), and the store, which binds with SO_REUSEADDR, gets it."""
    import socket
    from datetime import timedelta

    import torch.distributed as dist
    port = free_port()
    with socket.socket() as other, pytest.raises(OSError):
        other.bind(("127.0.0.1", port))
    server = dist.TCPStore("127.0.0.1", port, 2, True, timeout=timedelta(seconds=20), wait_for_workers=False)
    client = dist.TCPStore("127.0.0.1", port, 2, False, timeout=timedelta(seconds=20))
    client.set("rank1", "here")
    assert server.get("rank1") == b"here"
