"""Exit status of short PP=2 `mmpipe train` runs under a loop (issue 60): does every finished run exit 0?

    python scripts/stress_exit.py --runs 200                 # 200 runs of each case (docs/reliability.md)
    python scripts/stress_exit.py --runs 20 --case small     # one case
    python scripts/stress_exit.py --runs 20 --cores          # an aborted rank's core -> gdb backtrace of all threads

Cases, alternated so that the machine's other load falls on both:

    small   `mmpipe train --preset small --stages 2` on the built-in synthetic shapes set
    hf      the same on a Hugging Face `json` data config (the shapes set exported as LLaVA jsonl) with --pack

Each run trains --steps steps (default 2) with --eval-samples 0 into WORK/<case> (emptied before each run) and
is counted as: exit 0 with summary.json; an abort (`terminate called without an active exception` or a rank's
return code -6, SIGABRT, in the launcher's log); or another failure. A failing run's log is kept in
WORK/failures/. With --cores the ranks may dump core (RLIMIT_CORE unlimited, in WORK/<case>'s cwd) and an aborted
rank's core is read with `gdb -batch -ex "thread apply all bt"` into WORK/failures/, then deleted.

The counts print as a table at the end and, with --json, are written there.
"""
from __future__ import annotations

import argparse
import json
import os
import re
import resource
import shutil
import subprocess
import sys
import time
from pathlib import Path

ABORT = "terminate called without an active exception"
SPAWNED = re.compile(r"process (\d+) spawned with command: .*'--local_rank=(\d+)'")
RANK_RC = re.compile(r"exits with return code = (-?\d+)")


def parse_args(argv=None) -> argparse.Namespace:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--runs", type=int, default=200, help="runs of each case (default 200)")
    p.add_argument("--case", action="append", choices=["small", "hf"], help="default: both")
    p.add_argument("--steps", type=int, default=2)
    p.add_argument("--work", type=Path, default=Path("runs/stress_exit"))
    p.add_argument("--timeout", type=float, default=600, help="seconds a run may take before it counts as hung")
    p.add_argument("--cores", action="store_true", help="let ranks dump core; backtrace an aborted rank's core")
    p.add_argument("--json", type=Path, help="write the counts (and each failing run) here")
    return p.parse_args(argv)


def hf_config(work: Path) -> Path:
    """The shapes set as LLaVA jsonl (200 records) behind a Hugging Face `json` builder data config."""
    data = work / "hf_data"
    cfg = data / "cfg.json"
    if not cfg.is_file():
        subprocess.run([sys.executable, "-m", "mmpipe.cli", "export-shapes", "--format", "llava-jsonl", "--n", "200",
                        "--out", str(data)], check=True, stdout=subprocess.DEVNULL)
        cfg.write_text(json.dumps({"format": "hf", "builder": "json", "data_files": ["train.jsonl"]}) + "\n")
    return cfg


def command(case: str, out: Path, steps: int, cfg: Path | None) -> list[str]:
    cmd = [sys.executable, "-m", "mmpipe.cli", "train", "--preset", "small", "--stages", "2", "--steps", str(steps),
           "--eval-samples", "0", "--output-dir", str(out)]
    return cmd + (["--data", str(cfg), "--pack"] if case == "hf" else [])


def unlimited_core() -> None:
    resource.setrlimit(resource.RLIMIT_CORE, (resource.RLIM_INFINITY, resource.RLIM_INFINITY))


def run_once(cmd: list[str], out: Path, timeout: float, cores: bool) -> dict:
    """One launch: its status, seconds, whether a rank aborted (and which local rank), its log."""
    shutil.rmtree(out, ignore_errors=True)
    out.mkdir(parents=True)
    env = dict(os.environ, OMP_NUM_THREADS=os.environ.get("OMP_NUM_THREADS", "1"), PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    try:
        proc = subprocess.run(cmd, cwd=out, env=env, stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True,
                              timeout=timeout, preexec_fn=unlimited_core if cores else None)
        rc, log = proc.returncode, proc.stdout
    except subprocess.TimeoutExpired as e:
        rc, log = None, (e.stdout or b"").decode(errors="replace") if isinstance(e.stdout, bytes) else e.stdout or ""
    seconds = time.perf_counter() - t0
    rank_rcs = [int(x) for x in RANK_RC.findall(log)]
    aborted = ABORT in log or -6 in rank_rcs
    ok = rc == 0 and (out / "summary.json").is_file()
    return {"rc": rc, "seconds": round(seconds, 1), "ok": ok, "aborted": aborted, "rank_rcs": rank_rcs,
            "ranks": {pid: int(r) for pid, r in SPAWNED.findall(log)}, "log": log}


def backtrace(out: Path, dest: Path) -> str | None:
    """gdb's backtrace of every thread of the core an aborted rank left in `out` (its cwd)."""
    core = out / "core"
    if not core.is_file():
        return None
    gdb = shutil.which("gdb")
    if gdb:
        bt = subprocess.run([gdb, "-batch", "-ex", "thread apply all bt", sys.executable, str(core)],
                            capture_output=True, text=True, timeout=600).stdout
        dest.write_text(bt)
    core.unlink()
    return str(dest) if gdb else None


def record_failure(res: dict, case: str, i: int, out: Path, failures: Path) -> dict:
    failures.mkdir(parents=True, exist_ok=True)
    log = failures / f"{case}_{i:04d}.log"
    log.write_text(res["log"])
    bt = backtrace(out, failures / f"{case}_{i:04d}.gdb.txt")
    return {"case": case, "run": i, "rc": res["rc"], "aborted": res["aborted"], "rank_rcs": res["rank_rcs"],
            "log": str(log), "backtrace": bt}


def summarize(counts: dict, machine: str, args: argparse.Namespace) -> str:
    lines = [f"machine: {machine}; {args.steps} steps a run", "| case | runs | exit 0 | aborts (SIGABRT) | other "
             "failures | seconds a run (median) |", "|---|---|---|---|---|---|"]
    for case, c in counts.items():
        secs = sorted(c["seconds"]) or [0.0]
        lines.append(f"| {case} | {c['runs']} | {c['ok']} | {c['aborts']} | {c['other']} | {secs[len(secs) // 2]} |")
    return "\n".join(lines)


def cpu_model() -> str:
    for line in Path("/proc/cpuinfo").read_text().splitlines():
        if line.startswith("model name"):
            return f"{line.split(':', 1)[1].strip()}, {os.cpu_count()} CPUs"
    return f"{os.cpu_count()} CPUs"


def main(argv=None) -> int:
    args = parse_args(argv)
    cases = args.case or ["small", "hf"]
    work = args.work.resolve()
    cfg = hf_config(work) if "hf" in cases else None
    counts = {c: {"runs": 0, "ok": 0, "aborts": 0, "other": 0, "seconds": []} for c in cases}
    failed = []
    for i in range(args.runs):
        for case in cases:
            out = work / case
            res = run_once(command(case, out, args.steps, cfg), out, args.timeout, args.cores)
            c = counts[case]
            c["runs"] += 1
            c["seconds"].append(res["seconds"])
            c["ok"] += res["ok"]
            c["aborts"] += res["aborted"]
            c["other"] += not res["ok"] and not res["aborted"]
            if not res["ok"] or res["aborted"]:
                failed.append(record_failure(res, case, i, out, work / "failures"))
            print(f"{case} run {i + 1}/{args.runs}: rc {res['rc']} in {res['seconds']} s"
                  f"{' ABORT ' + str(res['rank_rcs']) if res['aborted'] else ''}", flush=True)
    table = summarize(counts, cpu_model(), args)
    print(table)
    if args.json:
        args.json.write_text(json.dumps({"machine": cpu_model(), "steps": args.steps, "counts": counts,
                                         "failures": failed}, indent=1) + "\n")
    return 0 if all(c["ok"] == c["runs"] and not c["aborts"] for c in counts.values()) else 1


if __name__ == "__main__":
    sys.exit(main())
