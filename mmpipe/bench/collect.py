"""`mmpipe bench --collect DIR`: results.csv / .json / .md and the plots rebuilt from what a sweep's
output directory holds, whichever way it ran (here, `--hostfile`, `--slurm`). The plan (bench.json)
lists every run; a run whose outcome.json exists is measured exactly as a local sweep measures it
(mmpipe.bench.rows), one without is `pending` while its Slurm job is queued or running, or says how
its job ended (`timeout`, `oom`, `failed`). A directory that is not a sweep's is refused, one line.
"""
from __future__ import annotations

import subprocess
from pathlib import Path

from ..config import ConfigError, read_json
from . import sweep as sweep_mod
from .cluster import PLAN, PLAN_VERSION, run_dir
from .report import write_all
from .rows import OUTCOME, outcome, peer_base, read_outcome, variant_base
from .sweep import PEERS, Sweep

__all__ = ["OUTCOME", "load", "collect", "rows_of"]

MODES = ("local", "hostfile", "slurm")
# Slurm job states in which the run may still produce its outcome
ACTIVE = {"PENDING", "CONFIGURING", "RUNNING", "COMPLETING", "REQUEUED", "REQUEUE_FED", "REQUEUE_HOLD", "RESIZING",
          "SUSPENDED", "STOPPED", "SIGNALING", "STAGE_OUT", "RESV_DEL_HOLD", "SPECIAL_EXIT"}
# states a job can end in without outcome.json -> the row's status
ENDED = {"TIMEOUT": "timeout", "DEADLINE": "timeout", "OUT_OF_MEMORY": "oom"}


def load(out: Path) -> tuple[dict, Sweep]:
    """The plan of the sweep in `out` and its sweep, or ConfigError naming what is wrong (one line)."""
    where = f"--collect: {out}"
    if not out.is_dir():
        raise ConfigError(f"{where}: no such directory")
    plan = read_json(out / PLAN, f"{where}/{PLAN}", f"no such file, so not the output directory of `mmpipe bench` "
                                                      f"(it writes {PLAN} before its first run)")
    if not isinstance(plan, dict):
        raise ConfigError(f"{where}/{PLAN}: must hold a JSON object")
    if plan.get("version") != PLAN_VERSION:
        raise ConfigError(f"{where}/{PLAN}: version {plan.get('version')!r} is not {PLAN_VERSION}")
    if plan.get("mode") not in MODES:
        raise ConfigError(f"{where}/{PLAN}: mode {plan.get('mode')!r} is not one of {', '.join(MODES)}")
    try:
        sw = sweep_mod.parse(plan.get("sweep"), str(plan.get("sweep_file") or out / PLAN))
    except ConfigError as e:
        raise ConfigError(f"{where}/{PLAN}: its sweep is malformed: {'; '.join(str(e).splitlines())}") from None
    items = plan.get("items")
    if not isinstance(items, list) or not items:
        raise ConfigError(f"{where}/{PLAN}: 'items' must be a non-empty list of runs")
    names = {v.name for v in sw.variants}
    for i, it in enumerate(items):
        if not isinstance(it, dict):
            raise ConfigError(f"{where}/{PLAN}: items[{i}] must be an object")
        kind, name, rep = it.get("kind"), it.get("name"), it.get("repeat")
        if kind not in ("variant", "peer") or not isinstance(rep, int) or isinstance(rep, bool) or rep < 0 or \
                name not in (names if kind == "variant" else PEERS):
            raise ConfigError(f"{where}/{PLAN}: items[{i}] is not a run of its sweep "
                              f"(kind {kind!r}, name {name!r}, repeat {rep!r})")
        # the folder follows from the run, so a plan cannot point outside its directory
        if it.get("dir") != run_dir(kind, name, rep):
            raise ConfigError(f"{where}/{PLAN}: items[{i}].dir {it.get('dir')!r} is not {run_dir(kind, name, rep)!r}")
        if it.get("status") not in (None, "refused") or not isinstance(it.get("reason", ""), str) or \
                not (it.get("job") is None or str(it.get("job")).isdigit()):
            raise ConfigError(f"{where}/{PLAN}: items[{i}] has a malformed status, reason or job id")
    return plan, sw


def job_state(job: str) -> str | None:
    """The Slurm state of a job, None if Slurm does not know it (finished long ago, another cluster)."""
    try:
        r = subprocess.run(["scontrol", "-o", "show", "job", job], capture_output=True, text=True, timeout=30)
    except (FileNotFoundError, subprocess.TimeoutExpired):
        return None
    if r.returncode != 0:
        return None
    fields = dict(kv.split("=", 1) for kv in r.stdout.split() if "=" in kv)
    return fields.get("JobState")


def _unfinished(it: dict, vout: Path, mode: str, query_slurm: bool) -> dict:
    """Status and reason of a run without outcome.json."""
    job = it.get("job")
    if mode != "slurm":
        return {"status": "pending", "reason": "not run yet (the sweep was interrupted or is still running)"}
    if not job:
        return {"status": "pending", "reason": "not submitted"}
    state = job_state(job) if query_slurm else None
    if state is None or state in ACTIVE:
        return {"status": "pending", "reason": f"job {job} {(state or 'has no outcome yet').lower()}"}
    return {"status": ENDED.get(state, "failed"),
            "reason": f"job {job} ended {state} without an outcome ({vout}/slurm-{job}.out)"}


def rows_of(out: Path, plan: dict, sw: Sweep, query_slurm: bool = True) -> tuple[list[dict], list[dict]]:
    """One row per run of the plan, and the outcomes read (for the sweep's meta)."""
    rows, outcomes = [], []
    for it in plan["items"]:
        vout = out / it["dir"]
        if it["kind"] == "variant":
            like = next(v for v in sw.variants if v.name == it["name"])
            row = variant_base(like, it["repeat"])
        else:
            row, like = peer_base(it["name"], it["repeat"], sw)
        if it["status"]:  # refused before it was launched or submitted
            rows.append({**row, "status": it["status"], "reason": it.get("reason", "")})
            continue
        try:
            oc = read_outcome(vout)
        except ValueError as e:
            rows.append({**row, "status": "failed", "reason": str(e)})
            continue
        if oc is None:
            rows.append({**row, **_unfinished(it, vout, plan["mode"], query_slurm)})
        elif "status" in oc:  # decided without a launch (this node lacks the precision)
            rows.append({**row, "status": oc["status"], "reason": oc.get("reason", "")})
        else:
            outcomes.append(oc)
            rows.append(outcome(row, like, sw, vout, oc.get("peaks") or {}, oc["rc"], oc.get("reason", ""),
                                float(oc.get("wall_s") or 0.0)))
    return rows, outcomes


def collect(out: Path, query_slurm: bool = True) -> list[dict]:
    """Rebuild results.csv / .json / .md and the plots in `out`; the rows."""
    plan, sw = load(out)
    rows, outcomes = rows_of(out, plan, sw, query_slurm)
    first = outcomes[0] if outcomes else {}
    peaks = {}
    for oc in outcomes:  # MFU is per row (its node's peak); the table's header shows the first of each
        for k, v in (oc.get("peaks") or {}).items():
            peaks.setdefault(k, v)
    meta = {"sweep": plan.get("sweep_file"), "device": first.get("device") or sw.device or "unknown", "peaks": peaks,
            "steps": sw.steps, "warmup_steps": sw.warmup_steps, "data": sw.data, "machine": first.get("machine"),
            "command": plan.get("command"), "mode": plan["mode"],
            "pending": sum(r["status"] == "pending" for r in rows)}
    write_all(rows, out, meta, sw.targets)
    return rows
