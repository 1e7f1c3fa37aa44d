"""`mmpipe slurm`: an sbatch script for a run, and with --submit its job id.

The script starts one Slurm task per rank with `srun` (ranks from SLURM_PROCID / SLURM_LOCALID /
SLURM_NTASKS, see slurm_env.py; the first node is the rendezvous), asks Slurm for USR1 ahead of
the time limit, and requeues itself when the ranks stopped for a signal (mmpipe.cluster.preempt); the
requeued job finds `checkpoints/latest` and resumes. Every value that reaches the script is
either checked against a plain character set (#SBATCH lines are not shell, and a newline would
start a new line of the script) or shell-quoted.
"""
from __future__ import annotations

import argparse
import dataclasses
import os
import re
import shlex
import subprocess
import sys
from pathlib import Path

from ..config import ConfigError, fail
from ..flags import add_flags, from_namespace, print_plan, to_argv
from ..run_args import CheckArgs, TrainArgs
from ..run_config import requested_stages, resolve
from .preempt import MARKER as PREEMPTED

SAFE = re.compile(r"^[A-Za-z0-9._,+-]+$")          # names: partition, account, job name
SAFE_PATH = re.compile(r"^[A-Za-z0-9._,+/@=-]+$")  # a path inside an #SBATCH line
TIME = re.compile(r"^(\d+-)?\d+(:\d+){0,2}$")       # Slurm: MM, MM:SS, HH:MM:SS, D-HH, D-HH:MM[:SS]
ENV_KEY = re.compile(r"^[A-Za-z_][A-Za-z0-9_]*$")


def add_slurm_args(p: argparse.ArgumentParser, bench: bool = False) -> None:
    """bench: the flags of `mmpipe bench --slurm`, where each variant's job is sized from its stages x dp
    (these are the most a job may ask for) and there is no single script to write or submit."""
    if bench:
        g = p.add_argument_group("Slurm jobs (with --slurm): the most one variant's job may ask for, as for "
                                 "`mmpipe slurm`")
        g.add_argument("--nodes", type=int, default=1, help="most nodes one job may use (default: 1)")
        g.add_argument("--tasks-per-node", type=int, default=None,
                       help="ranks per node (default: --gpus-per-node, else all of a variant's ranks on one node)")
    else:
        g = p.add_argument_group("Slurm job (every other flag is passed to the ranks, as for `mmpipe train`)")
        g.add_argument("--nodes", type=int, default=1, help="nodes (default: 1)")
        g.add_argument("--tasks-per-node", type=int, default=None,
                       help="ranks per node (default: --gpus-per-node, else the run's stages x --tp x --sp: a "
                            "pipeline per node); world size = nodes x this")
    g.add_argument("--gpus-per-node", type=int, default=0, help="GPUs per node, one per rank (default: 0, CPU)")
    g.add_argument("--cpus-per-task", type=int, default=1, help="CPU cores per rank = OMP_NUM_THREADS (default: 1)")
    g.add_argument("--slurm-partition", default=None,
                   help="Slurm partition (--partition is the pipeline's layer split)")
    g.add_argument("--time", default=None, help="time limit, e.g. 4:00:00 or 2-00:00:00")
    g.add_argument("--account", default=None, help="Slurm account to charge")
    g.add_argument("--job-name", default="mmpipe", help="job name (default: mmpipe)")
    g.add_argument("--env", action="append", default=[], metavar="KEY=VALUE",
                   help="export this in the job (repeatable); the submitting shell's environment is exported too")
    g.add_argument("--no-requeue", dest="requeue", action="store_false",
                   help="do not requeue after a preemption signal (default: requeue and resume)")
    g.add_argument("--signal-secs", type=int, default=120,
                   help="Slurm sends USR1 this many seconds before the time limit (default: 120)")
    if bench:
        return
    g.add_argument("--command", choices=("train", "check"), default="train",
                   help="what the ranks run: train (default), or `mmpipe check`'s checks on the allocation's own "
                        "ranks (rank 0 writes OUTPUT_DIR/check.json; no resume, no requeue; docs/check.md)")
    add_flags(p, CheckArgs)  # check's own flags, with --command check
    g.add_argument("--script", default=None, help="write the script here (default: OUTPUT_DIR/slurm_job.sh)")
    g.add_argument("--submit", action="store_true", help="submit it with sbatch and print the job id")


def check(a: argparse.Namespace) -> list[str]:
    problems = []
    for flag, val, lo in (("--nodes", a.nodes, 1), ("--tasks-per-node", a.tasks_per_node, 1),
                          ("--gpus-per-node", a.gpus_per_node, 0), ("--cpus-per-task", a.cpus_per_task, 1),
                          ("--signal-secs", a.signal_secs, 1)):
        if val is not None and val < lo:
            problems.append(f"{flag}: {val} must be >= {lo}")
    for flag, val in (("--slurm-partition", a.slurm_partition), ("--account", a.account), ("--job-name", a.job_name)):
        if val is not None and not SAFE.match(val):
            problems.append(f"{flag}: {val!r} may hold only letters, digits and . _ , + - "
                            f"(it goes into an #SBATCH line)")
    if getattr(a, "command", "train") != "check" and getattr(a, "full_step", False):
        problems.append("--full-step: a check flag; give --command check")
    if a.time is not None and not TIME.match(a.time):
        problems.append(f"--time: {a.time!r} is not a Slurm time (MM, HH:MM:SS, D-HH:MM:SS, ...)")
    for kv in a.env:
        key, eq, val = kv.partition("=")
        if not eq or not ENV_KEY.match(key):
            problems.append(f"--env: {kv!r} is not KEY=VALUE with KEY a shell variable name")
        elif "\n" in val or "\0" in val:
            problems.append(f"--env: {key}'s value holds a newline or NUL byte")
    return problems


def directives(a: argparse.Namespace, out: str, *, job_name: str, nodes: int, tasks_per_node: int,
               cpus_per_task: int, gpus_per_node: int, time: str | None) -> list[str]:
    """The #SBATCH lines of a job (without the prefix); every value checked by check() / SAFE_PATH.
    `mmpipe bench --slurm` sizes each variant's job itself, hence the explicit resources."""
    sb = [f"--job-name={job_name}", f"--nodes={nodes}", f"--ntasks-per-node={tasks_per_node}",
          f"--cpus-per-task={cpus_per_task}"]
    sb += [f"--gpus-per-node={gpus_per_node}"] if gpus_per_node else []
    sb += [f"--partition={a.slurm_partition}"] if a.slurm_partition else []
    sb += [f"--account={a.account}"] if a.account else []
    sb += [f"--time={time}"] if time else []
    if checking(a):  # check's ranks save nothing on a signal and must not run twice: never requeued (nor by
        return sb + [f"--output={out}/slurm-%j.out", "--no-requeue"]  # the cluster's JobRequeue on a node failure)
    sb += [f"--output={out}/slurm-%j.out", "--open-mode=append"]  # a requeued job appends to the same log
    # USR1 to the ranks (not B:, the batch shell) ahead of the limit; --requeue lets it be requeued
    sb += ["--requeue", f"--signal=USR1@{a.signal_secs}"] if a.requeue else [f"--signal=USR1@{a.signal_secs}"]
    return sb


def checking(a: argparse.Namespace) -> bool:
    """The job runs `mmpipe check`'s ranks (--command check): no checkpoint to resume, nothing to requeue."""
    return getattr(a, "command", "train") == "check"


def partitions(env=None) -> list[str]:
    """The cluster's partitions, as sinfo lists them (the default one without its '*')."""
    try:
        r = subprocess.run(["sinfo", "-h", "-o", "%P"], capture_output=True, text=True, timeout=60,
                           env=env if env is not None else dict(os.environ))
    except FileNotFoundError:
        raise ConfigError("--slurm-partition: sinfo not found on PATH (Slurm's client commands are needed "
                          "to check the partition)") from None
    except subprocess.TimeoutExpired:
        raise ConfigError("--slurm-partition: sinfo did not answer within 60 s") from None
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or [f"exit status {r.returncode}"])[-1]
        raise ConfigError(f"--slurm-partition: sinfo failed: {why}")
    return [ln.strip().rstrip("*") for ln in r.stdout.splitlines() if ln.strip()]


def check_partition(name: str | None, env=None) -> None:
    """An unknown partition is refused now, not by sbatch one job at a time."""
    if name is None:
        return
    known = partitions(env)
    if name not in known:
        raise ConfigError(f"--slurm-partition: {name!r} is not a partition of this cluster "
                          f"(sinfo lists: {', '.join(known) or 'none'})")


def render(a: argparse.Namespace, rank_argv: list[str], output_dir: Path, workdir: Path) -> str:
    """The sbatch script. Values are checked (check(), SAFE_PATH) or shlex-quoted here. Training's script resumes
    and requeues (module docstring); the check's (--command check) does neither, and says nothing of either."""
    q = shlex.quote
    out = str(output_dir)
    tasks = a.tasks_per_node or a.gpus_per_node or 1
    sb = directives(a, out, job_name=a.job_name, nodes=a.nodes, tasks_per_node=tasks,
                    cpus_per_task=a.cpus_per_task, gpus_per_node=a.gpus_per_node, time=a.time)
    env = [f"export {k}={q(v)}" for k, _, v in (kv.partition("=") for kv in a.env)]
    check = checking(a)
    module, extra = ("mmpipe.check.rank", to_argv(from_namespace(CheckArgs, a))) if check else ("mmpipe.train", [])
    cmd = " ".join(q(x) for x in [sys.executable, "-u", "-m", module, *rank_argv, *extra])
    head = f"""#!/bin/bash
# Generated by `mmpipe slurm`; docs/slurm.md. One task per rank, {a.nodes} node(s) x {tasks}.
{chr(10).join("#SBATCH " + s for s in sb)}

cd {q(str(workdir))}
export OMP_NUM_THREADS=${{SLURM_CPUS_PER_TASK:-1}}  # one thread per core a rank owns
{chr(10).join(env)}
# rendezvous: the job's first node, a port derived from the job id
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
"""
    if check:  # the job's exit status is the check's verdict (docs/check.md)
        return head + f"srun {cmd}\n"
    requeue = (f'if [ -f {q(out + "/" + PREEMPTED)} ]; then\n'
               f'  rm -f {q(out + "/" + PREEMPTED)}\n'
               f'  echo "mmpipe: preempted; requeueing job $SLURM_JOB_ID"\n'
               f'  scontrol requeue "$SLURM_JOB_ID"\n'
               f'  exit 0\n'
               f'fi\n') if a.requeue else ""
    return head + f"""# a requeued (or restarted) job continues from the newest checkpoint
RESUME=()
if [ -f {q(out + '/checkpoints/latest')} ]; then RESUME=(--resume); fi
# Slurm's TERM to the batch shell must not end it before srun returns and it can requeue
trap 'echo "mmpipe: batch shell got SIGTERM"' TERM

rm -f {q(out + "/" + PREEMPTED)}  # only this run's preemption may requeue the job
srun {cmd} "${{RESUME[@]}}"
rc=$?
{requeue}exit $rc
"""


def main_slurm(sargs: argparse.Namespace, targs: TrainArgs) -> int:
    """sargs: the Slurm flags (add_slurm_args); targs: the run, as for `mmpipe train`."""
    targs = dataclasses.replace(targs, resume=False)  # the script decides: --resume once a checkpoint exists
    problems = check(sargs)
    out = Path(targs.output_dir).resolve()
    if not SAFE_PATH.match(str(out)):
        problems.append(f"--output-dir: {str(out)!r} may hold only letters, digits and . _ , + / @ = - "
                        f"(it goes into an #SBATCH line)")
    if problems:
        return fail(ConfigError("\n".join(problems)))
    try:
        if sargs.tasks_per_node is None and not sargs.gpus_per_node:  # one pipeline per node (stages x tp ranks)
            tasks = requested_stages(targs) * max(1, targs.tp) * max(1, targs.sp)
            sargs = argparse.Namespace(**{**vars(sargs), "tasks_per_node": tasks})
        world = sargs.nodes * (sargs.tasks_per_node or sargs.gpus_per_node)
        resolve(targs, world_size=world)  # a bad run is refused here, not after waiting in the queue
    except ConfigError as e:
        return fail(e)
    script = render(sargs, targs.to_argv(), out, Path.cwd())
    path = Path(sargs.script) if sargs.script else out / "slurm_job.sh"
    if sargs.dry_run:
        print_plan(f"slurm: {sargs.nodes} node(s) x {world // sargs.nodes} task(s)", script=path.resolve(),
                   submit="sbatch --parsable " + str(path) if sargs.submit else "no (without --submit)",
                   output_dir=out)
        print(script, end="", flush=True)
        return 0
    out.mkdir(parents=True, exist_ok=True)
    path.write_text(script)
    path.chmod(0o755)
    print(f"mmpipe: wrote {path}", flush=True)
    if not sargs.submit:
        return 0
    try:
        job = submit(path)
    except ConfigError as e:
        return fail(e)
    print(job, flush=True)
    return 0


def submit(script: Path) -> str:
    """sbatch the script; its job id, or ConfigError with sbatch's own last line."""
    try:
        r = subprocess.run(["sbatch", "--parsable", str(script)], capture_output=True, text=True, env=dict(os.environ))
    except FileNotFoundError:
        raise ConfigError("sbatch: not found on PATH (Slurm's client commands are needed to submit)") from None
    if r.returncode != 0:
        why = (r.stderr.strip().splitlines() or ["exit status " + str(r.returncode)])[-1]
        raise ConfigError(f"sbatch: {why}")
    return r.stdout.strip().split(";")[0]
