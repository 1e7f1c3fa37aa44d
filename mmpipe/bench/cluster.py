"""Where a sweep's runs go: the plan every mode writes (OUT/bench.json: the sweep, and each run's folder,
Slurm job and refusal), the Slurm job each run gets under `--slurm` (nodes x tasks from its stages x
dp, checked against the Slurm flags before anything is submitted), and the hosts each variant gets
under `--hostfile` (the hostfile's slots in order, stage 0 first).
"""
from __future__ import annotations

import argparse
import json
import math
import shlex
import sys
from pathlib import Path

from ..cluster import hostfile, slurm
from ..cluster.ports import free_port
from ..config import ConfigError
from .peers import PEER_RANKS
from .sweep import Sweep, Variant

PLAN = "bench.json"
PLAN_VERSION = 1


def run_dir(kind: str, name: str, rep: int) -> str:
    """A run's folder under the sweep's output directory, the same in every mode."""
    return f"{'variants' if kind == 'variant' else 'peers'}/{name}_r{rep}"


def plan_items(sw: Sweep, variants: list[Variant], peers: list[str]) -> list[dict]:
    """Every run of the sweep in the order a local sweep runs them: all variants once per repeat
    (interleaved, so a shared machine's drift spreads over all), then the peers."""
    items = [{"kind": "variant", "name": v.name, "repeat": rep} for rep in range(sw.repeats) for v in variants]
    items += [{"kind": "peer", "name": p, "repeat": rep} for rep in range(sw.repeats) for p in peers]
    for it in items:
        it.update(dir=run_dir(it["kind"], it["name"], it["repeat"]), job=None, status=None, reason="")
    return items


def write_plan(out: Path, plan: dict) -> None:
    """Atomically: a Slurm job may read the plan while the submitter adds job ids to it."""
    tmp = out / (PLAN + ".tmp")
    tmp.write_text(json.dumps(plan, indent=2) + "\n")
    tmp.replace(out / PLAN)


def new_plan(mode: str, sweep_file: str, raw: dict, items: list[dict], **extra) -> dict:
    return {"version": PLAN_VERSION, "mode": mode, "sweep_file": sweep_file, "sweep": raw, "items": items, **extra}


# --- Slurm ---------------------------------------------------------------------------------------

def tasks_per_node(a: argparse.Namespace, world: int) -> int:
    """Ranks per node: the flag, else one per GPU, else (CPU) all of a run's ranks on one node."""
    return a.tasks_per_node or a.gpus_per_node or world


def job_shape(a: argparse.Namespace, what: str, world: int, one_node: bool = False) -> tuple[int, int]:
    """(nodes, tasks per node) of the job for `world` ranks, or ConfigError when the flags do not allow it."""
    per = tasks_per_node(a, world)
    if world <= per:
        return 1, world
    if one_node:
        raise ConfigError(f"{what}: its {world} ranks run on one node; --tasks-per-node allows {per}")
    if world % per:
        raise ConfigError(f"{what}: {world} ranks do not fill whole nodes of {per} tasks (--tasks-per-node); "
                          f"use a --tasks-per-node that divides {world}")
    nodes = world // per
    if nodes > a.nodes:
        raise ConfigError(f"{what}: {world} ranks need {nodes} nodes of {per} tasks; --nodes allows {a.nodes}")
    return nodes, per


def check_slurm(a: argparse.Namespace, sw: Sweep, variants: list[Variant], peers: list[str], out: Path) -> None:
    """Everything --slurm can refuse before a job is submitted, one line per problem (exit 2)."""
    problems = slurm.check(a)
    if not slurm.SAFE_PATH.match(str(out)):
        problems.append(f"--output-dir: {str(out)!r} may hold only letters, digits and . _ , + / @ = - "
                        f"(it goes into an #SBATCH line)")
    for v in variants:
        try:
            job_shape(a, f"variant '{v.name}' ({v.stages} stages x dp {v.dp})", v.world)
        except ConfigError as e:
            problems.append(str(e))
    for p in peers:
        try:
            job_shape(a, f"peer '{p}'", PEER_RANKS[p], one_node=True)
        except ConfigError as e:
            problems.append(str(e))
    if problems:
        raise ConfigError("\n".join(problems))
    slurm.check_partition(a.slurm_partition)


def job_time(a: argparse.Namespace, sw: Sweep) -> str:
    """--time, else the sweep's per-run timeout plus 5 minutes for start-up and the driver, in minutes."""
    return a.time or str(math.ceil((sw.timeout_s + 300) / 60))


def render_job(a: argparse.Namespace, sw: Sweep, out: Path, index: int, item: dict, workdir: Path) -> str:
    """One run's sbatch script: the resources its ranks need, then the job driver (mmpipe.bench.job),
    which starts them with srun, requeues after a preemption and records the outcome."""
    q = shlex.quote
    if item["kind"] == "variant":
        v = next(v for v in sw.variants if v.name == item["name"])
        nodes, per = job_shape(a, v.name, v.world)
        cpus, gpus = a.cpus_per_task, per if a.gpus_per_node else 0
    else:  # a peer is one task on one node that starts its own processes (torchrun)
        ranks = PEER_RANKS[item["name"]]
        nodes, per, cpus, gpus = 1, 1, a.cpus_per_task * ranks, ranks if a.gpus_per_node else 0
    vout = out / item["dir"]
    sb = slurm.directives(a, str(vout), job_name=f"{a.job_name}-{Path(item['dir']).name}", nodes=nodes,
                          tasks_per_node=per, cpus_per_task=cpus, gpus_per_node=gpus, time=job_time(a, sw))
    env = [f"export {k}={q(val)}" for k, _, val in (kv.partition("=") for kv in a.env)]
    cmd = " ".join(q(x) for x in [sys.executable, "-u", "-m", "mmpipe.bench.job", str(out), str(index)])
    return f"""#!/bin/bash
# Generated by `mmpipe bench --slurm` (docs/benchmarks.md): {item['dir']} of sweep {sw.name},
# {nodes} node(s) x {per} task(s).
{chr(10).join("#SBATCH " + s for s in sb)}

cd {q(str(workdir))}
export OMP_NUM_THREADS={a.cpus_per_task}  # threads per rank (a peer's task holds all its ranks' cores)
{chr(10).join(env)}
# rendezvous: the job's first node, a port derived from the job id
export MASTER_ADDR=$(scontrol show hostnames "$SLURM_JOB_NODELIST" | head -n 1)
export MASTER_PORT=$((20000 + SLURM_JOB_ID % 20000))
# the driver srun-s the ranks, requeues on a preemption, and writes outcome.json when the run is over
exec {cmd}
"""


def submit_slurm(a: argparse.Namespace, sw: Sweep, out: Path, plan: dict, workdir: Path, log=print) -> list[str]:
    """sbatch every run that is not refused, in plan order; job ids go into the plan as they come."""
    jobs = []
    for i, it in enumerate(plan["items"]):
        if it["status"]:
            continue
        vout = out / it["dir"]
        vout.mkdir(parents=True, exist_ok=True)
        script = vout / "slurm_job.sh"
        script.write_text(render_job(a, sw, out, i, it, workdir))
        script.chmod(0o755)
        try:
            it["job"] = slurm.submit(script)
        except ConfigError as e:
            write_plan(out, plan)
            done = f" (submitted before it: {', '.join(jobs)}; scancel them or --collect {out})" if jobs else ""
            raise ConfigError(f"{e}{done}") from None
        jobs.append(it["job"])
        log(f"mmpipe bench: {it['dir']}: job {it['job']}")
        write_plan(out, plan)
    return jobs


# --- hostfile ------------------------------------------------------------------------------------

def hostfile_hosts(path: str, include: str, exclude: str, env: dict, ssh: bool = True) -> dict[str, list[int]]:
    """The active hosts and slots, checked as `mmpipe train --hostfile` checks them (ssh first, unless not
    `ssh`: a dry run, as train's, leaves that to the launch)."""
    hosts = hostfile.active(hostfile.parse(path), include, exclude)
    if ssh and len(hosts) > 1:  # DeepSpeed runs a single active host locally, without ssh
        hostfile.check_reachable(hosts, env)
    return hosts


def placement(hosts: dict[str, list[int]], world: int) -> list[tuple[str, list[int]]]:
    """The first `world` slots in hostfile order (stage 0 on the first host), as (host, slots)."""
    out, left = [], world
    for h, slots in hosts.items():
        if left <= 0:
            break
        take = slots[:left]
        out.append((h, take))
        left -= len(take)
    return out


def check_hostfile(hosts: dict[str, list[int]], variants: list[Variant]) -> None:
    total = sum(len(s) for s in hosts.values())
    problems = [f"variant '{v.name}': {v.world} ranks ({v.stages} stages x dp {v.dp}) need more than the "
                f"hostfile's {total} active slots" for v in variants if v.world > total]
    if problems:
        raise ConfigError("\n".join(problems))


def hostfile_where(path: str, hosts: dict[str, list[int]], world: int, master_addr: str | None,
                   master_port: int | None) -> list[str]:
    """The deepspeed launcher's placement flags for one variant: the hostfile, an --include of exactly
    its slots, the master (the first host it uses, unless given). Every host was checked already."""
    place = placement(hosts, world)
    include = "@".join(f"{h}:{','.join(map(str, s))}" for h, s in place)
    return ["--hostfile", path, "--include", include, "--no_ssh_check", "--master_addr", master_addr or place[0][0],
            "--master_port", str(master_port or free_port())]
