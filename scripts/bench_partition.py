"""Partition methods measured against each other and against the cost model, in one run.

    python scripts/bench_partition.py                          # small preset, 2 and 4 stages, ~9 min
    python scripts/bench_partition.py --steps 60 --repeats 1 --out-json runs/bench_partition.json

For every stage count in --stages (2, 4) x vision trainable / frozen x method in --methods
(balanced, uniform, parameters) it runs

    python -m mmpipe.cli train --preset small --stages S --partition M [--freeze vision] --steps N
        --eval-samples 0 --data-workers 0 --output-dir WORK/...

(`--data-workers 0`: no loader processes competing with the ranks for the cores; the first and
last stage load their micro-batches in the rank itself, which the stage timers count as `load`),
and reads summary.json: the parts, each stage's measured forward + backward per step (stage_timing)
-> max/mean, the median step time, the measured and 1F1B-theory bubble.

Prediction, from mmpipe.planning.costmodel for the same parts, micro-batch and GAS:
  per-stage (forward, backward) = stage_seconds(layer_costs(cfg, freeze, text_len), parts, micro, dev,
                                                measured=profile_layers(cfg, text_len, micro))
  step = pipeline_step_seconds(those, gas, boundary bytes, grad bytes, dp=1, dev)
with dev = Device("cpu", 1e10, 24e9, 5e9): the FLOP/s figure is unused (every layer kind is
calibrated), the 5 GB/s link only sizes the p2p term (small). profile_layers runs in this process
before any training, on one thread (torch.set_num_threads(1)), as each rank runs, --profile-rounds
times; the median per layer kind is used.

Memory: each rank's peak RSS (VmHWM in /proc/<pid>/status), polled from outside every --poll
seconds; the rank processes are found by their command line (`-m mmpipe.train --local_rank=R ...
--output-dir <this run's dir>`). "train" is the high-water mark read once rank 0 has logged step
N-1 (steady-state training), "run" the last one read before the process exited (final checkpoint
save included). RSS is dominated by the Python/torch/DeepSpeed runtime, so the model-attributable
part is also reported: RSS of stage s minus RSS of stage s of a --baseline-preset run (`tiny`, a
few thousand parameters per layer, same stage count, same roles: first stage loads images, last
stage loads labels, rank 0 logs and writes the summary), compared with the predicted difference
stage_memory(small) - stage_memory(tiny).

Prints the tables and writes everything to --out-json. Unknown flags go to every `mmpipe train`.
"""
from __future__ import annotations

import argparse
import csv
import datetime as dt
import json
import os
import platform
import shutil
import signal
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

os.environ.setdefault("OMP_NUM_THREADS", "1")  # as each training rank runs (mmpipe.cli sets it)

REPO = Path(__file__).resolve().parent.parent
if str(REPO) not in sys.path:
    sys.path.insert(0, str(REPO))

import torch  # noqa: E402

from mmpipe.config import load_preset  # noqa: E402
from mmpipe.planning.costmodel import (  # noqa: E402
    BYTES,
    Device,
    layer_costs,
    pipeline_step_seconds,
    profile_layers,
    stage_memory,
    stage_seconds,
)

MiB = 2 ** 20
CLK_TCK = os.sysconf("SC_CLK_TCK")
MODES = {"trainable": (), "frozen": ("vision",)}


def parse_args(argv=None):
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0],
                                epilog="Unknown flags are passed to every `mmpipe train` run.")
    p.add_argument("--preset", default="small", help="model preset (default: small)")
    p.add_argument("--stages", default="2,4", help="stage counts, comma-separated (default: 2,4)")
    p.add_argument("--methods", default="balanced,uniform,parameters",
                   help="partition methods, comma-separated (default: balanced,uniform,parameters)")
    p.add_argument("--vision", default="trainable,frozen", help="vision modes: trainable, frozen (default: both)")
    p.add_argument("--steps", type=int, default=40, help="optimizer steps per run; the first is left out (default: 40)")
    p.add_argument("--repeats", type=int, default=2,
                   help="rounds over all configurations (methods in a rotated order each round); per configuration "
                        "the median over rounds of each run's median step is used (default: 2)")
    p.add_argument("--text-len", type=int, default=12, help="text tokens per sample (default: 12, the shapes set's)")
    p.add_argument("--micro", type=int, default=None,
                   help="micro-batch for the profile (default: the DeepSpeed config's, read from the first run)")
    p.add_argument("--profile-rounds", type=int, default=3,
                   help="profile_layers calls; median per layer kind (default: 3)")
    p.add_argument("--baseline-preset", default="tiny",
                   help="preset whose ranks give the runtime's RSS for the model-attributable memory ('' to skip; "
                        "default: tiny)")
    p.add_argument("--link-gbps", type=float, default=5.0, help="p2p bandwidth for the cost model (default: 5 GB/s)")
    p.add_argument("--poll", type=float, default=0.1, help="seconds between /proc reads of the ranks (default: 0.1)")
    p.add_argument("--wait-quiet", type=float, default=120.0,
                   help="before starting, wait up to this many seconds for other processes to use < 0.25 cores "
                        "(default: 120; 0: do not wait)")
    p.add_argument("--run-timeout", type=float, default=600.0, help="seconds before a run is killed (default: 600)")
    p.add_argument("--work-dir", default=None, help="runs go here (default: a temporary directory, removed afterwards)")
    p.add_argument("--keep", action="store_true", help="keep the temporary work directory")
    p.add_argument("--out-json", default=str(Path(tempfile.gettempdir()) / "bench_partition.json"),
                   help="write the results here (default: %(default)s)")
    p.add_argument("--from-json", default=None,
                   help="run nothing: re-aggregate and print the tables of a JSON this script wrote")
    args, extra = p.parse_known_args(argv)
    try:
        args.stage_counts = [int(s) for s in args.stages.split(",") if s.strip()]
    except ValueError:
        p.error(f"--stages: {args.stages!r} is not a comma-separated list of integers")
    args.method_list = [m.strip() for m in args.methods.split(",") if m.strip()]
    args.modes = [m.strip() for m in args.vision.split(",") if m.strip()]
    if any(m not in MODES for m in args.modes):
        p.error(f"--vision: {args.vision!r}: valid modes are trainable, frozen")
    if args.steps < 3:
        p.error("--steps: use at least 3 (the first step is left out)")
    if args.repeats < 1 or args.profile_rounds < 1:
        p.error("--repeats and --profile-rounds must be >= 1")
    return args, extra


# ---------------------------------------------------------------- machine state

def cpu_jiffies() -> tuple[int, int]:
    """(busy, total) jiffies over all CPUs from /proc/stat."""
    vals = [int(x) for x in open("/proc/stat").readline().split()[1:]]
    idle = vals[3] + (vals[4] if len(vals) > 4 else 0)
    total = sum(vals[:8])  # guest time is already inside user
    return total - idle, total


def self_cpu_s() -> float:
    t = os.times()
    return t.user + t.system


def foreign_cores(seconds: float = 2.0) -> float:
    """Cores used by processes other than this one over `seconds`."""
    b0, t0, s0 = *cpu_jiffies(), self_cpu_s()
    time.sleep(seconds)
    b1, t1, s1 = *cpu_jiffies(), self_cpu_s()
    ncpu = os.cpu_count() or 1
    busy_s = (b1 - b0) / max(1, t1 - t0) * ncpu * seconds
    return max(0.0, busy_s - (s1 - s0)) / seconds


def wait_quiet(limit: float) -> float:
    load = foreign_cores()
    t_end = time.monotonic() + limit
    while load > 0.25 and time.monotonic() < t_end:
        print(f"bench: other processes use {load:.2f} cores; waiting for a quiet machine", flush=True)
        time.sleep(5)
        load = foreign_cores()
    return load


def machine() -> dict:
    model = next((ln.split(":", 1)[1].strip() for ln in open("/proc/cpuinfo") if ln.startswith("model name")), "?")
    import deepspeed
    return {"cpu": model, "cpus": os.cpu_count(), "gpu": torch.cuda.is_available(),
            "ram_gib": round(os.sysconf("SC_PAGE_SIZE") * os.sysconf("SC_PHYS_PAGES") / 2 ** 30, 1),
            "python": platform.python_version(), "torch": torch.__version__, "deepspeed": deepspeed.__version__,
            "OMP_NUM_THREADS": os.environ.get("OMP_NUM_THREADS")}


# ---------------------------------------------------------------- one training run, watched from outside

def _cmdline(pid: int) -> list[str]:
    try:
        with open(f"/proc/{pid}/cmdline", "rb") as f:
            return f.read().decode(errors="replace").split("\0")
    except OSError:
        return []


def _status_kib(pid: int, keys=("VmHWM", "VmRSS")) -> dict | None:
    try:
        with open(f"/proc/{pid}/status") as f:
            out = {}
            for ln in f:
                k = ln.split(":", 1)[0]
                if k in keys:
                    out[k] = int(ln.split()[1])
            return out
    except OSError:
        return None


def _cpu_s(pid: int) -> float | None:
    try:
        with open(f"/proc/{pid}/stat") as f:
            fields = f.read().rsplit(")", 1)[1].split()
        return (int(fields[11]) + int(fields[12])) / CLK_TCK  # utime, stime
    except (OSError, IndexError, ValueError):
        return None


def _session_pids(sid: int) -> list[int]:
    out = []
    for name in os.listdir("/proc"):
        if name.isdigit():
            try:
                if os.getsid(int(name)) == sid:
                    out.append(int(name))
            except OSError:
                pass
    return out


def _log_steps(path: Path) -> int:
    try:
        with open(path) as f:
            return max(0, sum(1 for _ in f) - 1)
    except OSError:
        return 0


def run_train(preset: str, stages: int, method: str, freeze: tuple[str, ...], steps: int, out_dir: Path,
              extra: list[str], poll: float, timeout: float) -> dict:
    cmd = [sys.executable, "-m", "mmpipe.cli", "train", "--preset", preset, "--stages", str(stages),
           "--partition", method, *(["--freeze", ",".join(freeze)] if freeze else []), "--steps", str(steps),
           "--eval-samples", "0", "--data-workers", "0", "--output-dir", str(out_dir), *extra]
    env = dict(os.environ, OMP_NUM_THREADS="1",
               PYTHONPATH=os.pathsep.join([str(REPO), os.environ.get("PYTHONPATH", "")]).rstrip(os.pathsep))
    out_dir.parent.mkdir(parents=True, exist_ok=True)
    log_path = out_dir.parent / f"{out_dir.name}.log"
    res = {"cmd": " ".join(cmd[1:]), "log": str(log_path)}
    ranks: dict[int, dict] = {}      # local rank -> {"pid", "hwm_kib", "hwm_train_kib", "cpu_s"}
    session_cpu: dict[int, float] = {}
    train_log = out_dir / "train_log.csv"
    b0, t0j = cpu_jiffies()
    s0 = self_cpu_s()
    t0 = time.perf_counter()
    with open(log_path, "w") as log:
        proc = subprocess.Popen(cmd, cwd=REPO, env=env, stdout=log, stderr=subprocess.STDOUT, start_new_session=True)
        last_scan = 0.0
        try:
            while proc.poll() is None:
                now = time.perf_counter()
                if now - t0 > timeout:
                    os.killpg(proc.pid, signal.SIGKILL)
                    proc.wait()
                    res["timed_out"] = True
                    break
                if len(ranks) < stages or now - last_scan > 1.0:  # find the ranks (and the launchers' CPU)
                    last_scan = now
                    for pid in _session_pids(proc.pid):
                        c = _cpu_s(pid)
                        if c is not None:
                            session_cpu[pid] = c
                        argv = _cmdline(pid)
                        if "mmpipe.train" not in argv or str(out_dir) not in argv:
                            continue
                        lr = next((a.split("=", 1)[1] for a in argv if a.startswith("--local_rank=")), None)
                        if lr is not None and int(lr) not in ranks:
                            ranks[int(lr)] = {"pid": pid, "hwm_kib": 0, "hwm_train_kib": None}
                in_steady = _log_steps(train_log) >= steps - 1
                for r in ranks.values():
                    st = _status_kib(r["pid"])
                    if st is None:
                        continue
                    r["hwm_kib"] = max(r["hwm_kib"], st.get("VmHWM", 0))
                    if in_steady and r["hwm_train_kib"] is None:
                        r["hwm_train_kib"] = st.get("VmHWM", 0)
                    c = _cpu_s(r["pid"])
                    if c is not None:
                        r["cpu_s"] = session_cpu[r["pid"]] = c
                time.sleep(poll)
        except BaseException:
            os.killpg(proc.pid, signal.SIGKILL)
            raise
    wall = time.perf_counter() - t0
    b1, t1j = cpu_jiffies()
    ncpu = os.cpu_count() or 1
    busy_s = (b1 - b0) / max(1, t1j - t0j) * ncpu * wall
    res.update(rc=proc.returncode, wall_s=wall,
               other_load_cores=max(0.0, busy_s - sum(session_cpu.values()) - (self_cpu_s() - s0)) / wall,
               rss={r: {"peak_train_mib": (v["hwm_train_kib"] or 0) / 1024 or None, "peak_run_mib": v["hwm_kib"] / 1024,
                        "cpu_s": v.get("cpu_s")} for r, v in sorted(ranks.items())})
    summary = out_dir / "summary.json"
    lines = log_path.read_text(errors="replace").splitlines()
    if not summary.is_file() or res.get("timed_out"):
        errors = [ln for ln in lines if ln.startswith("mmpipe: error:")]
        res["refused" if errors else "failed"] = "\n".join(errors or lines[-15:])
        return res
    if proc.returncode != 0:  # summary.json written, then a rank died on the way out: keep the numbers, say so
        res["exit_problem"] = f"exit status {proc.returncode} after summary.json was written: " + "; ".join(
            ln.strip() for ln in lines if "terminate called" in ln or "exits with return code" in ln)[:400]
    res["summary"] = json.loads(summary.read_text())
    with open(train_log) as f:
        rows = list(csv.DictReader(f))
    tb = res["summary"]["train_batch"]
    steps_s = [tb / float(r["samples_per_s"]) for r in rows[1:] if float(r["samples_per_s"]) > 0]
    res["step_s_list"] = steps_s
    return res


# ---------------------------------------------------------------- prediction

def profile(cfg, text_len: int, micro: int, rounds: int) -> dict:
    torch.set_num_threads(1)  # each rank runs on one thread
    runs = [profile_layers(cfg, text_len=text_len, micro=micro) for _ in range(rounds)]
    return {k: (statistics.median(r[k][0] for r in runs), statistics.median(r[k][1] for r in runs)) for k in runs[0]}


def predict(cfg, freeze, text_len: int, parts: list[int], micro: int, gas: int, precision: str, measured: dict,
            dev: Device, cores: int) -> dict:
    rows = layer_costs(cfg, freeze, text_len)
    times = stage_seconds(rows, parts, micro, dev, measured=measured)
    boundary = [rows[b - 1].boundary_elems * micro * BYTES[precision] for b in parts[1:-1]]
    grad = max(sum(r.params for r in rows[a:b] if r.trainable) for a, b in zip(parts, parts[1:])) * BYTES[precision]
    step = pipeline_step_seconds(times, gas, boundary, grad, 1, dev)
    compute = [(f + b) * gas for f, b in times]  # seconds per step
    mem = [stage_memory(rows, parts, s, micro=micro, micro_batches=gas, precision=precision, zero_stage=0, dp=1)
           for s in range(len(parts) - 1)]
    return {"stage_fwd_bwd_ms_per_micro": [[f * 1e3, b * 1e3] for f, b in times],
            "stage_compute_ms": [c * 1e3 for c in compute],
            "max_over_mean": max(compute) / (sum(compute) / len(compute)),
            "step_ms": step["step_s"] * 1e3, "slot_ms": step["slot_s"] * 1e3, "p2p_ms": step["p2p_s"] * 1e3,
            "bubble": step["bubble"],
            # not the cost model: with more ranks than cores, all stages' work shares `cores` cores
            "core_bound_ms": sum(compute) / min(cores, len(compute)) * 1e3,
            "stage_memory_mib": [m["total"] / MiB for m in mem],
            "stage_memory_parts_mib": [{k: v / MiB for k, v in m.items()} for m in mem]}


def measured(res: dict) -> dict:
    s = res["summary"]
    t = s["stage_timing"]
    per = t["per_stage"]
    gas = s["gradient_accumulation"]
    busy = [(r["forward_ms"] + r["backward_ms"] + r["load_ms"]) / gas for r in per]
    return {"parts": s["parts"], "step_ms": s["step_time_s"] * 1e3,
            "step_ms_list": [x * 1e3 for x in res.get("step_s_list", [])],
            "stage_compute_ms": t["compute_ms"], "max_over_mean": t["max_over_mean"],
            "stage_fwd_bwd_ms_per_micro": [[r["forward_ms_per_micro"], r["backward_ms_per_micro"]] for r in per],
            "stage_load_ms_per_micro": [r["load_ms"] / gas for r in per],
            "stage_step_ms": [r["step_ms"] for r in per],
            "stage_idle_fraction": [r["idle_fraction"] for r in per],
            "measured_bubble": t["measured_bubble"], "theory_bubble": t["theory_bubble"],
            # the 1F1B formula fed with MEASURED per-micro busy time (fwd + bwd + load) and the optimizer step
            "formula_on_measured_ms": (gas + len(per) - 1) * max(busy) + max(r["step_ms"] for r in per),
            "rss_train_mib": [res["rss"].get(k, {}).get("peak_train_mib") for k in range(len(per))],
            "rss_run_mib": [res["rss"].get(k, {}).get("peak_run_mib") for k in range(len(per))]}


# ---------------------------------------------------------------- report

def fmt(v, spec=".2f", none="-"):
    return none if v is None else format(v, spec)


def main(argv=None) -> int:
    args, extra = parse_args(argv)
    if args.from_json:
        result = json.loads(Path(args.from_json).read_text())
        saved = argparse.Namespace(**result["args"])
        result["baselines"] = {int(k): v for k, v in result["baselines"].items()}  # JSON made the keys strings
        result["configs"], result["verdicts"] = aggregate(result["runs"], result["baselines"], saved, result)
        report(result, saved)
        return 0
    if shutil.which("deepspeed") is None:
        sys.exit("bench: the deepspeed launcher is not on PATH")
    work = Path(args.work_dir) if args.work_dir else Path(tempfile.mkdtemp(prefix="bench_partition_"))
    work.mkdir(parents=True, exist_ok=True)
    cfg = load_preset(args.preset)
    dev = Device("cpu", 1e10, 24e9, args.link_gbps * 1e9)
    cores = os.cpu_count() or 1
    started = dt.datetime.now().astimezone()
    t_all = time.perf_counter()
    print(f"bench: {args.preset}, stages {args.stage_counts}, methods {args.method_list}, vision {args.modes}, "
          f"{args.steps} steps x {args.repeats} round(s); work dir {work}", flush=True)
    quiet = wait_quiet(args.wait_quiet) if args.wait_quiet > 0 else foreign_cores()
    print(f"bench: other processes use {quiet:.2f} cores at the start", flush=True)

    # 1. calibration, on one thread, before any run (micro from the first run's config if not given)
    micro = args.micro
    if micro is None:
        from mmpipe.run_args import TrainArgs
        from mmpipe.run_config import resolve
        micro = resolve(TrainArgs.from_argv(["--preset", args.preset, *extra]), world_size=2).micro
    t = time.perf_counter()
    prof = profile(cfg, args.text_len, micro, args.profile_rounds)
    print(f"bench: profile_layers x{args.profile_rounds} at micro {micro} in {time.perf_counter() - t:.1f} s (ms per "
          f"micro-batch fwd/bwd): " + ", ".join(f"{k} {f * micro * 1e3:.2f}/{b * micro * 1e3:.2f}"
                                               for k, (f, b) in prof.items()), flush=True)

    # 2. baseline runs (runtime RSS per stage position)
    baselines = {}
    if args.baseline_preset:
        bcfg = load_preset(args.baseline_preset)
        for S in args.stage_counts:
            name = f"baseline_{args.baseline_preset}_{S}st"
            print(f"bench: {name} ...", end=" ", flush=True)
            r = run_train(args.baseline_preset, S, "balanced", (), args.steps, work / name / "run", extra, args.poll,
                          args.run_timeout)
            if "summary" in r:
                s = r["summary"]
                mem = [stage_memory(layer_costs(bcfg, (), args.text_len), s["parts"], k, micro=s["micro_batch"],
                                    micro_batches=s["gradient_accumulation"], precision=s["precision"], zero_stage=0,
                                    dp=1)["total"] / MiB for k in range(S)]
                baselines[S] = {"parts": s["parts"], "predicted_mib": mem, "other_load_cores": r["other_load_cores"],
                                "rss_train_mib": [r["rss"].get(k, {}).get("peak_train_mib") for k in range(S)],
                                "rss_run_mib": [r["rss"].get(k, {}).get("peak_run_mib") for k in range(S)]}
                print(f"RSS (train) {[fmt(x, '.0f') for x in baselines[S]['rss_train_mib']]} MiB", flush=True)
            else:
                print(f"FAILED ({r.get('refused') or r.get('failed')})", flush=True)

    # 3. the runs
    runs = []
    for rep in range(args.repeats):
        for S in args.stage_counts:
            for mode in args.modes:
                k = (rep + args.stage_counts.index(S) + args.modes.index(mode)) % len(args.method_list)
                for method in args.method_list[k:] + args.method_list[:k]:  # rotate the order to spread drift
                    name = f"r{rep}_{S}st_{mode}_{method}"
                    print(f"bench: {name} ...", end=" ", flush=True)
                    r = run_train(args.preset, S, method, MODES[mode], args.steps, work / name / "run", extra,
                                  args.poll, args.run_timeout)
                    entry = {"round": rep, "stages": S, "vision": mode, "method": method, "wall_s": r["wall_s"],
                             "other_load_cores": r["other_load_cores"], "cmd": r["cmd"]}
                    if "exit_problem" in r:
                        entry["exit_problem"] = r["exit_problem"]
                    if "summary" not in r:
                        entry["refused" if "refused" in r else "failed"] = r.get("refused") or r.get("failed")
                        label = "refused: " if "refused" in r else "FAILED: "
                        print(label + entry.get("refused", entry.get("failed")), flush=True)
                        runs.append(entry)
                        continue
                    s = r["summary"]
                    if s["data"]["text_len"] != args.text_len or s["micro_batch"] != micro:
                        print(f"(warning: run has text_len {s['data']['text_len']}, micro {s['micro_batch']}; "
                              f"predicted with {args.text_len}, {micro})", end=" ")
                    entry["measured"] = measured(r)
                    entry["predicted"] = predict(cfg, MODES[mode], args.text_len, s["parts"], s["micro_batch"],
                                                 s["gradient_accumulation"], s["precision"], prof, dev, cores)
                    entry["gas"], entry["micro"] = s["gradient_accumulation"], s["micro_batch"]
                    m, pr = entry["measured"], entry["predicted"]
                    print(f"parts {m['parts']} step {m['step_ms']:.1f} ms (pred {pr['step_ms']:.1f}), max/mean "
                          f"{m['max_over_mean']:.3f} (pred {pr['max_over_mean']:.3f}), other load "
                          f"{r['other_load_cores']:.2f} cores, {r['wall_s']:.0f} s"
                          + (f" [{r['exit_problem']}]" if "exit_problem" in r else ""), flush=True)
                    runs.append(entry)

    result = {"date": started.isoformat(timespec="seconds"), "machine": machine(), "args": vars(args), "extra": extra,
              "device_for_costmodel": dev.__dict__, "micro": micro, "profile_ms_per_micro":
              {k: [f * micro * 1e3, b * micro * 1e3] for k, (f, b) in prof.items()},
              "other_load_cores_at_start": quiet, "baselines": baselines, "runs": runs}
    result["configs"], result["verdicts"] = aggregate(runs, baselines, args, result)
    result["total_s"] = time.perf_counter() - t_all
    report(result, args)
    Path(args.out_json).parent.mkdir(parents=True, exist_ok=True)
    Path(args.out_json).write_text(json.dumps(result, indent=1) + "\n")
    print(f"\nbench: wrote {args.out_json}; {result['total_s'] / 60:.1f} min in all", flush=True)
    if not args.work_dir and not args.keep:
        shutil.rmtree(work, ignore_errors=True)
    else:
        print(f"bench: runs kept in {work}")
    return 0


def quartiles(xs: list[float]) -> list[float] | None:
    if len(xs) < 4:
        return None
    q = statistics.quantiles(xs, n=4)
    return [q[0], q[2]]


def best_split(cfg, freeze, text_len: int, stages: int, micro: int, prof: dict) -> dict:
    """The lowest predicted max/mean forward+backward over EVERY contiguous split DeepSpeed can train
    (each stage holding a trainable parameter), with the calibrated layer times: how close to 1.0
    any partition method could get for this layer list."""
    from itertools import combinations

    from mmpipe.planning.partition import check_trainable
    rows = layer_costs(cfg, freeze, text_len)
    dev = Device("cpu", 1e10, 24e9, 5e9)
    best = None
    for inner in combinations(range(1, len(rows)), stages - 1):
        parts = [0, *inner, len(rows)]
        try:
            check_trainable(rows, parts)
        except Exception:
            continue
        c = [f + b for f, b in stage_seconds(rows, parts, micro, dev, measured=prof)]
        mom = max(c) / (sum(c) / len(c))
        if best is None or mom < best["max_over_mean"]:
            best = {"parts": parts, "max_over_mean": mom}
    return best


def busy_max_over_mean(run: dict) -> float:
    """max/mean over stages of forward + backward + data loading per step: what paces the pipeline here."""
    m = run["measured"]
    busy = [c + ld * run["gas"] for c, ld in zip(m["stage_compute_ms"], m["stage_load_ms_per_micro"])]
    return max(busy) / (sum(busy) / len(busy))


def aggregate(runs: list[dict], baselines: dict, args, result: dict) -> tuple[list[dict], dict]:
    """Median over rounds per (stages, vision, method); then the verdicts per (stages, vision)."""
    med = lambda xs: statistics.median(xs) if xs else None  # noqa: E731
    micro = result["micro"]
    prof = {k: (f / micro / 1e3, b / micro / 1e3) for k, (f, b) in result["profile_ms_per_micro"].items()}
    cfg = load_preset(args.preset)
    best = {(S, mode): best_split(cfg, MODES[mode], args.text_len, S, micro, prof)
            for S in args.stage_counts for mode in args.modes}
    configs = []
    for S in args.stage_counts:
        for mode in args.modes:
            for method in args.method_list:
                rs = [r for r in runs if (r["stages"], r["vision"], r["method"]) == (S, mode, method)]
                ok = [r for r in rs if "measured" in r]
                c = {"stages": S, "vision": mode, "method": method, "runs": len(rs), "ok": len(ok)}
                if not ok:
                    c["refused"] = next((r.get("refused") or r.get("failed") for r in rs), None)
                    configs.append(c)
                    continue
                m0, p0 = ok[0]["measured"], ok[0]["predicted"]
                c.update(parts=m0["parts"],
                         step_ms=med([r["measured"]["step_ms"] for r in ok]),
                         step_ms_q1_q3=quartiles([x for r in ok for x in r["measured"]["step_ms_list"]]),
                         step_ms_rounds=[r["measured"]["step_ms"] for r in ok],
                         max_over_mean=med([r["measured"]["max_over_mean"] for r in ok]),
                         busy_max_over_mean=med([busy_max_over_mean(r) for r in ok]),
                         measured_bubble=med([r["measured"]["measured_bubble"] for r in ok]),
                         theory_bubble=m0["theory_bubble"],
                         formula_on_measured_ms=med([r["measured"]["formula_on_measured_ms"] for r in ok]),
                         pred_step_ms=p0["step_ms"], pred_max_over_mean=p0["max_over_mean"],
                         pred_core_bound_ms=p0["core_bound_ms"],
                         other_load_cores=max(r["other_load_cores"] for r in ok))
                c["step_ratio"] = c["step_ms"] / c["pred_step_ms"]
                n = len(m0["parts"]) - 1
                c["stages_detail"] = []
                for s in range(n):
                    comp = med([r["measured"]["stage_compute_ms"][s] for r in ok])
                    rss = med([x for x in (r["measured"]["rss_train_mib"][s] for r in ok) if x is not None])
                    rss_run = med([x for x in (r["measured"]["rss_run_mib"][s] for r in ok) if x is not None])
                    d = {"stage": s, "layers": [m0["parts"][s], m0["parts"][s + 1] - 1],
                         "pred_compute_ms": p0["stage_compute_ms"][s], "compute_ms": comp,
                         "load_ms_per_micro": med([r["measured"]["stage_load_ms_per_micro"][s] for r in ok]),
                         "idle_fraction": med([r["measured"]["stage_idle_fraction"][s] for r in ok]),
                         "pred_mem_mib": p0["stage_memory_mib"][s], "rss_train_mib": rss,
                         "rss_run_mib": rss_run}
                    b = baselines.get(S)
                    if b and rss is not None and b["rss_train_mib"][s] is not None:
                        d["rss_model_mib"] = rss - b["rss_train_mib"][s]
                        d["pred_model_mib"] = d["pred_mem_mib"] - b["predicted_mib"][s]
                        d["mem_ratio"] = d["rss_model_mib"] / d["pred_model_mib"] if d["pred_model_mib"] else None
                    d["total_ratio"] = rss / d["pred_mem_mib"] if rss else None
                    c["stages_detail"].append(d)
                configs.append(c)

    verdicts = {"balanced_max_over_mean_le_1.05": [], "balanced_fastest": [], "step_within_15pct": [],
                "memory_within_10pct": []}
    for S in args.stage_counts:
        for mode in args.modes:
            group = [c for c in configs if (c["stages"], c["vision"]) == (S, mode) and "step_ms" in c]
            bal = next((c for c in group if c["method"] == "balanced"), None)
            if bal:
                verdicts["balanced_max_over_mean_le_1.05"].append(
                    {"stages": S, "vision": mode, "measured": bal["max_over_mean"],
                     "predicted": bal["pred_max_over_mean"],
                     "best_possible_predicted": best[(S, mode)], "busy_measured": bal["busy_max_over_mean"],
                     "met": bal["max_over_mean"] <= 1.05})
                fastest = min(group, key=lambda c: c["step_ms"])
                others = [c for c in group if c is not bal]
                # run-to-run spread: (max - min) / median of the per-round medians, largest in the group
                spread = max(((max(c["step_ms_rounds"]) - min(c["step_ms_rounds"])) / c["step_ms"] for c in group
                              if len(c["step_ms_rounds"]) > 1), default=None)
                same = [c["method"] for c in group if c["parts"] == bal["parts"] and c is not bal]
                vs_other = (bal["step_ms"] / min(c["step_ms"] for c in others) - 1) if others else None
                verdicts["balanced_fastest"].append(
                    {"stages": S, "vision": mode, "fastest": fastest["method"],
                     "step_ms": {c["method"]: c["step_ms"] for c in group},
                     "step_ms_q1_q3": {c["method"]: c["step_ms_q1_q3"] for c in group},
                     "same_parts_as_balanced": same,
                     "balanced_vs_best_other": vs_other,
                     "round_spread": spread,
                     "not_runnable": [c["method"] for c in configs if (c["stages"], c["vision"]) == (S, mode)
                                      and "step_ms" not in c],
                     "met": fastest is bal or fastest["parts"] == bal["parts"]})
            for c in group:
                verdicts["step_within_15pct"].append(
                    {"stages": S, "vision": mode, "method": c["method"], "measured_ms": c["step_ms"],
                     "predicted_ms": c["pred_step_ms"], "ratio": c["step_ratio"],
                     "met": abs(c["step_ratio"] - 1) <= 0.15})
                for d in c["stages_detail"]:
                    if d.get("mem_ratio") is not None:
                        verdicts["memory_within_10pct"].append(
                            {"stages": S, "vision": mode, "method": c["method"], "stage": d["stage"],
                             "rss_model_mib": d["rss_model_mib"], "pred_model_mib": d["pred_model_mib"],
                             "ratio": d["mem_ratio"], "total_ratio": d["total_ratio"],
                             "met": abs(d["mem_ratio"] - 1) <= 0.10})
    return configs, verdicts


def report(result: dict, args) -> None:
    print(f"\n== step time and balance ({result['machine']['cpus']} CPUs, OMP_NUM_THREADS=1 per rank, "
          f"{args.steps} steps, median step; first step left out)")
    print(f"{'S':>2} {'vision':<9} {'method':<10} {'parts':<18} {'max/mean':>8} {'pred':>6} {'step ms':>8} "
          f"{'q1..q3':>13} {'pred ms':>8} {'meas/pred':>9} {'core-bnd':>8} {'on-meas':>8} {'bubble':>6} {'theory':>6} "
          f"{'other':>5} {'busy m/m':>8}")
    for c in result["configs"]:
        if "step_ms" not in c:
            print(f"{c['stages']:>2} {c['vision']:<9} {c['method']:<10} not runnable: {c.get('refused')}")
            continue
        q = c.get("step_ms_q1_q3")
        q = f"{q[0]:.0f}..{q[1]:.0f}" if q else "-"
        print(f"{c['stages']:>2} {c['vision']:<9} {c['method']:<10} {str(c['parts']):<18} {c['max_over_mean']:>8.3f} "
              f"{c['pred_max_over_mean']:>6.3f} {c['step_ms']:>8.1f} {q:>13} {c['pred_step_ms']:>8.1f} "
              f"{c['step_ratio']:>9.2f} {c['pred_core_bound_ms']:>8.1f} {c['formula_on_measured_ms']:>8.1f} "
              f"{c['measured_bubble']:>6.3f} {c['theory_bubble']:>6.3f} {c['other_load_cores']:>5.2f} "
              f"{c['busy_max_over_mean']:>8.3f}")
    print("  max/mean: measured forward+backward per stage (pred: cost model); pred ms: pipeline_step_seconds; "
          "core-bnd: all stages' predicted compute / min(cores, stages); on-meas: (m+P-1) x max measured "
          "(fwd+bwd+load) per micro + optimizer step; other: cores used by other processes during the run; "
          "busy m/m: max/mean of forward+backward+data loading per stage")

    print("\n== per stage (compute: forward+backward ms per step; memory MiB)")
    print(f"{'S':>2} {'vision':<9} {'method':<10} {'st':>2} {'layers':>7} {'pred cmp':>8} {'meas cmp':>8} {'ratio':>5} "
          f"{'load/mb':>7} {'idle':>5} {'pred MiB':>8} {'RSS':>7} {'RSS run':>7} {'RSS-base':>8} {'pred-base':>9} "
          f"{'ratio':>6}")
    for c in result["configs"]:
        for d in c.get("stages_detail", []):
            print(f"{c['stages']:>2} {c['vision']:<9} {c['method']:<10} {d['stage']:>2} "
                  f"{str(d['layers'][0]) + '..' + str(d['layers'][1]):>7} {d['pred_compute_ms']:>8.1f} "
                  f"{d['compute_ms']:>8.1f} {d['compute_ms'] / d['pred_compute_ms']:>5.2f} "
                  f"{d['load_ms_per_micro']:>7.2f} {d['idle_fraction']:>5.2f} {d['pred_mem_mib']:>8.2f} "
                  f"{fmt(d['rss_train_mib'], '.0f'):>7} {fmt(d['rss_run_mib'], '.0f'):>7} "
                  f"{fmt(d.get('rss_model_mib'), '.1f'):>8} {fmt(d.get('pred_model_mib'), '.2f'):>9} "
                  f"{fmt(d.get('mem_ratio'), '.2f'):>6}")
    for S, b in result["baselines"].items():
        print(f"  baseline {args.baseline_preset} {S} stages parts {b['parts']}: RSS (train) "
              f"{[fmt(x, '.0f') for x in b['rss_train_mib']]} MiB, "
              f"predicted {[fmt(x, '.2f') for x in b['predicted_mib']]} MiB")

    v = result["verdicts"]
    print("\n== verdicts")
    for x in v["balanced_max_over_mean_le_1.05"]:
        print(f"  balanced max/mean <= 1.05, {x['stages']} stages, vision {x['vision']}: "
              f"{'MET' if x['met'] else 'NOT MET'} (measured {x['measured']:.3f}, cost model {x['predicted']:.3f}; "
              f"best any split could do, cost model: {x['best_possible_predicted']['max_over_mean']:.3f} "
              f"{x['best_possible_predicted']['parts']}; with data loading {x['busy_measured']:.3f})")
    for x in v["balanced_fastest"]:
        rounds = {c["method"]: c["step_ms_rounds"] for c in result["configs"]
                  if (c["stages"], c["vision"]) == (x["stages"], x["vision"]) and "step_ms" in c}
        times = ", ".join(f"{k} {t:.1f} ({'/'.join(format(v, '.1f') for v in rounds[k])})"
                          for k, t in x["step_ms"].items())
        note = f"; same parts as balanced: {x['same_parts_as_balanced']}" if x["same_parts_as_balanced"] else ""
        note += f"; not runnable: {x['not_runnable']}" if x["not_runnable"] else ""
        if x["balanced_vs_best_other"] is not None and x["round_spread"] is not None:
            note += (f"; balanced {x['balanced_vs_best_other']:+.1%} vs the best other, run-to-run spread up to "
                     f"{x['round_spread']:.1%}")
        print(f"  balanced fastest, {x['stages']} stages, vision {x['vision']}: {'MET' if x['met'] else 'NOT MET'} "
              f"(median step ms (per round): {times}{note})")
    n_ok = sum(x["met"] for x in v["step_within_15pct"])
    print(f"  predicted step within 15%: {n_ok} of {len(v['step_within_15pct'])} runs "
          f"(measured/predicted {', '.join(format(x['ratio'], '.2f') for x in v['step_within_15pct'])})")
    crashed = [r for r in result["runs"] if "exit_problem" in r]
    if crashed:
        print(f"  note: {len(crashed)} of {sum('measured' in r for r in result['runs'])} runs "
              f"wrote summary.json and then "
              f"exited non-zero ({crashed[0]['exit_problem'][:160]}); their numbers are used")
    if v["memory_within_10pct"]:
        n_ok = sum(x["met"] for x in v["memory_within_10pct"])
        print(f"  model-attributable memory within 10%: {n_ok} of {len(v['memory_within_10pct'])} stages "
              f"(ratios {', '.join(fmt(x['ratio'], '.2f') for x in v['memory_within_10pct'])})")


if __name__ == "__main__":
    sys.exit(main())
