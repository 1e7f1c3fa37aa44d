"""`mmpipe bench SWEEP.json`: check the whole sweep, then run each variant (and each repeat,
interleaved: all variants once, then again, so slow drift of a shared machine spreads over all),
then the peers; write results.csv / .json / .md and the plots as it goes.

`--hostfile FILE` launches each variant across the hostfile's hosts; `--slurm` submits every run as
its own Slurm job instead (mmpipe.bench.cluster, mmpipe.bench.job) and `--collect DIR` builds the
results from what the jobs left (mmpipe.bench.collect). Every mode writes the plan (bench.json) and
one outcome.json per finished run, so `--collect` also rebuilds an interrupted local sweep."""
from __future__ import annotations

import argparse
import json
import os
import platform
import shutil
import sys
import time
from pathlib import Path

import torch

from ..cluster import hostfile, slurm
from ..config import ConfigError, fail
from ..flags import print_plan
from ..model.attention import attention_backend
from ..runtime import precision
from . import cluster
from . import collect as collect_mod
from . import sweep as sweep_mod
from .peak import peaks
from .peers import run_peer
from .report import write_all
from .rows import OUTCOME, outcome, peer_base, variant_base, write_outcome
from .run_variant import check, launch
from .sweep import Sweep, Variant

# a run that did not finish is a failure of the sweep; these are answers
NOT_FAILED = ("ok", "unsupported", "refused", "pending")
PLOTS_EVERY_S = 60  # a long sweep's pictures stay current; a tiny one draws them once, at its end


def add_bench_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("sweep", nargs="?", default=None,
                   help="sweep file, e.g. ds_configs/sweeps/default.json (docs/benchmarks.md)")
    p.add_argument("--output-dir", default=None, help="where results go (default: runs/bench/<sweep name>)")
    p.add_argument("--only", default="", help="comma-separated variant names to run (default: all)")
    p.add_argument("--no-peers", action="store_true", help="skip the peers even if the sweep lists them")
    p.add_argument("--collect", default=None, metavar="DIR",
                   help="no sweep: rebuild DIR's results.csv/json/md and plots from the runs it holds; runs not "
                        "finished are 'pending'")
    p.add_argument("--slurm", action="store_true",
                   help="submit every run (variant x repeat, and each peer) as its own Slurm job; then --collect")
    h = p.add_argument_group("hosts (with --hostfile): each variant across the hostfile's slots, stage 0 first")
    h.add_argument("--hostfile", default=None, help="DeepSpeed hostfile, 'HOST slots=N' lines (docs/multinode.md)")
    h.add_argument("--include", default="", help="only these hosts/slots (DeepSpeed's syntax)")
    h.add_argument("--exclude", default="", help="not these hosts/slots")
    h.add_argument("--master-addr", default=None, help="rendezvous host (default: each variant's first host)")
    h.add_argument("--master-port", type=int, default=None, help="rendezvous port (default: a free port here)")
    slurm.add_slurm_args(p, bench=True)


def machine() -> dict:
    import os

    import torch
    cpu = platform.processor() or platform.machine()
    try:
        for ln in open("/proc/cpuinfo"):
            if ln.startswith("model name"):
                cpu = ln.split(":", 1)[1].strip()
                break
    except OSError:
        pass
    return {"cpu": cpu, "cores": os.cpu_count(), "python": platform.python_version(), "torch": torch.__version__,
            "gpu": torch.cuda.get_device_name(0) if torch.cuda.is_available() else None}


def _mode(args: argparse.Namespace) -> str:
    if args.collect is not None:
        extra = [f for f, on in (("a sweep file", args.sweep), ("--slurm", args.slurm),
                                 ("--hostfile", args.hostfile), ("--only", args.only)) if on]
        if extra:
            raise ConfigError(f"--collect: takes only the directory, not {', '.join(extra)}")
        return "collect"
    if args.sweep is None:
        raise ConfigError("bench: give a sweep file (or --collect DIR)")
    if args.slurm and args.hostfile:
        raise ConfigError("--slurm / --hostfile: use one of them (Slurm places the ranks itself)")
    if (args.include or args.exclude) and not args.hostfile:
        raise ConfigError("--include / --exclude: they filter a --hostfile; give one")
    return "slurm" if args.slurm else "hostfile" if args.hostfile else "local"


def main_bench(args: argparse.Namespace) -> int:
    try:
        mode = _mode(args)
        if mode == "collect":
            return _collect_plan(Path(args.collect)) if args.dry_run else main_collect(Path(args.collect))
        sw = sweep_mod.load(args.sweep)
        only = [n for n in args.only.split(",") if n]
        unknown = [n for n in only if n not in {v.name for v in sw.variants}]
        if unknown:
            raise ConfigError(f"--only: no variant named {', '.join(unknown)} in {args.sweep}")
        variants = [v for v in sw.variants if not only or v.name in only]
        peer_list = [] if args.no_peers else sw.peers
        out = Path(args.output_dir or f"runs/bench/{sw.name}")
        hosts = None
        if mode == "slurm":
            out = out.resolve()  # the jobs run elsewhere: every path they get is absolute
            cluster.check_slurm(args, sw, variants, peer_list, out)
        elif mode == "hostfile":
            env = hostfile.with_rank_threads(dict(os.environ))
            hosts = cluster.hostfile_hosts(args.hostfile, args.include, args.exclude, env, ssh=not args.dry_run)
            cluster.check_hostfile(hosts, variants)
        else:  # local ranks: MMPIPE_ATTENTION=flex without CUDA refused here, not once per variant's first attention
            attention_backend(torch.device(precision.this_device().kind))
    except ConfigError as e:
        return fail(e)
    items = cluster.plan_items(sw, variants, peer_list)
    if args.dry_run:
        return print_plan(f"bench {sw.name}: {len(items)} run(s), {mode}", output_dir=out.resolve(),
                          runs=", ".join(f"{it['name']}#{it['repeat']}" for it in items))
    out.mkdir(parents=True, exist_ok=True)
    command = "mmpipe bench " + " ".join(sys.argv[2:]) if sys.argv[1:2] == ["bench"] else None
    raw = json.loads(Path(args.sweep).read_text())
    if "data" in raw:  # absolute, as parsed: bench.json is re-read from elsewhere (a Slurm job, --collect)
        raw["data"] = sw.data
    plan = cluster.new_plan(mode, args.sweep, raw, items, command=command, requeue=getattr(args, "requeue", True))
    for it in items:  # an earlier sweep's outcome in the same folder must not pass for this one's
        (out / it["dir"] / OUTCOME).unlink(missing_ok=True)
    if mode == "slurm":
        return submit(args, sw, out, plan)
    cluster.write_plan(out, plan)
    where = (lambda v: cluster.hostfile_where(args.hostfile, hosts, v.world, args.master_addr,
                                              args.master_port)) if hosts else None
    return run_here(sw, variants, peer_list, out, plan, where)


def submit(args: argparse.Namespace, sw: Sweep, out: Path, plan: dict) -> int:
    """--slurm: refusals recorded now, every other run submitted as its own job, in one go."""
    for it in plan["items"]:
        vout = out / it["dir"]
        if vout.exists():  # a requeued job resumes from checkpoints/latest: never from an earlier sweep's
            shutil.rmtree(vout)
        if it["kind"] == "variant":
            v = next(v for v in sw.variants if v.name == it["name"])
            cannot = check(v, sw, vout, this_device=False)  # the precision is each job's node's to check
            if cannot:
                it["status"], it["reason"] = cannot
    cluster.write_plan(out, plan)
    try:
        jobs = cluster.submit_slurm(args, sw, out, plan, Path.cwd())
    except ConfigError as e:
        return fail(e)
    refused = [it["dir"] for it in plan["items"] if it["status"]]
    print(f"mmpipe bench: submitted {len(jobs)} job(s) {', '.join(jobs)}"
          + (f"; refused without a job: {', '.join(refused)}" if refused else "")
          + f". The last job to finish writes the results; until then: mmpipe bench --collect {out}", flush=True)
    return 0


def _collect_plan(out: Path) -> int:
    """--collect --dry-run: the sweep folder read, nothing rebuilt."""
    try:
        plan, sw = collect_mod.load(out)
    except ConfigError as e:
        return fail(e)
    return print_plan(f"bench --collect: {len(plan['items'])} run(s) of {sw.name}", output_dir=out.resolve(),
                      would_write="results.csv, results.json, results.md and the plots")


def main_collect(out: Path) -> int:
    try:
        rows = collect_mod.collect(out)
    except ConfigError as e:
        return fail(e)
    print((out / "results.md").read_text(), flush=True)
    pending = [f"{r['name']}#{r['repeat']}" for r in rows if r["status"] == "pending"]
    if pending:
        print(f"mmpipe bench: {len(pending)} of {len(rows)} run(s) pending: {', '.join(pending)}", flush=True)
    return _exit_status(rows)


def _exit_status(rows: list[dict]) -> int:
    # a variant the device lacks (unsupported) or that mmpipe refuses is a recorded answer, not a failure
    broken = [r["name"] for r in rows if r["status"] not in NOT_FAILED]
    if broken:
        print(f"mmpipe bench: {len(broken)} run(s) did not finish: {', '.join(broken)}", file=sys.stderr, flush=True)
    return 1 if broken else 0


def run_here(sw: Sweep, variants: list[Variant], peer_list: list[str], out: Path, plan: dict, where) -> int:
    """Run the plan from this machine (locally, or each variant across --hostfile's hosts)."""
    device, peak = peaks(sw.device, sw.peak_flops, {v.precision for v in variants} | {"fp32"})
    meta = {"sweep": plan["sweep_file"], "device": device, "peaks": peak, "steps": sw.steps,
            "warmup_steps": sw.warmup_steps, "data": sw.data, "machine": machine(), "command": plan["command"],
            "mode": plan["mode"]}
    rows, t0 = [], time.perf_counter()
    drawn = t0  # the PNGs: redrawn at most once a minute while the sweep runs, and at its end
    items = plan["items"]
    print(f"mmpipe bench: {len(variants)} variants x {sw.repeats} repeats + {len(peer_list)} peers on {device}; "
          f"results in {out}", flush=True)
    for i, it in enumerate(items, 1):
        def progress(msg: str, name: str = it["name"]) -> None:
            print(f"[bench {i}/{len(items)} {time.perf_counter() - t0:6.0f}s] {name}: {msg}", flush=True)
        rep = it["repeat"]
        if it["kind"] == "variant":
            v = next(v for v in variants if v.name == it["name"])
            row = run_variant_row(v, rep, sw, out, peak, progress, where(v) if where else None)
        else:
            row = run_peer_row(it["name"], rep, sw, out, peak, progress)
        if row["status"] in ("refused", "unsupported"):
            it["status"] = "refused" if row["status"] == "refused" else None
            it["reason"] = row["reason"]
            if row["status"] == "unsupported":
                write_outcome(out / it["dir"], status="unsupported", reason=row["reason"])
            cluster.write_plan(out, plan)
        else:
            write_outcome(out / it["dir"], rc=row.pop("_rc"), reason=row.pop("_reason"), wall_s=row["wall_s"],
                          device=device, peaks=peak, machine=meta["machine"])
        rows.append(row)
        progress(f"{row['samples_per_s']:.1f} samples/s, step {row['step_time_s'] * 1e3:.1f} ms, loss "
                 f"{row['final_loss']:.4f}" if row["status"] == "ok" else f"{row['status']}: {row['reason']}",
                 row["name"])
        draw = i == len(items) or time.perf_counter() - drawn >= PLOTS_EVERY_S
        write_all(rows, out, meta, sw.targets, plots=draw)  # partial results survive an interrupted sweep
        drawn = time.perf_counter() if draw else drawn
    print((out / "results.md").read_text(), flush=True)
    print(f"mmpipe bench: results.csv, results.json, results.md, throughput.png, memory.png, bubble.png, "
          f"predicted.png in {out}", flush=True)
    return _exit_status(rows)


def run_variant_row(v: Variant, rep: int, sw: Sweep, out: Path, peak: dict, progress,
                    where: list[str] | None = None) -> dict:
    """One repeat of a variant: refused / unsupported without a launch, else launched and measured."""
    row = variant_base(v, rep)
    vout = out / "variants" / f"{v.name}_r{rep}"
    cannot = check(v, sw, vout)
    if cannot:
        return {**row, "status": cannot[0], "reason": cannot[1]}
    progress(f"running ({v.world} ranks{' on ' + where[where.index('--include') + 1] if where else ''})")
    env = {"DS_ENV_FILE": str(hostfile.env_file(vout, _rank_env()))} if where else None
    return _measured(row, v, sw, vout, peak, *launch(v, sw, vout, where, env))


def run_peer_row(name: str, rep: int, sw: Sweep, out: Path, peak: dict, progress) -> dict:
    """One repeat of a peer (transformers, torch pipelining) on the sweep's peer shape, on this machine."""
    row, like = peer_base(name, rep, sw)
    vout = out / "peers" / f"{name}_r{rep}"
    progress("running", row["name"])
    return _measured(row, like, sw, vout, peak, *run_peer(name, sw.peer_shape(), sw, vout))


def _rank_env() -> dict:
    return hostfile.with_rank_threads(dict(os.environ))  # remote ranks see only what the env file carries


def _measured(row: dict, v: Variant, sw: Sweep, vout: Path, peak: dict, rc: int, reason: str, wall: float) -> dict:
    """The measured row, carrying the launch's exit status for outcome.json (popped before it is reported)."""
    return {**outcome(row, v, sw, vout, peak, rc, reason, wall), "_rc": rc, "_reason": reason}
