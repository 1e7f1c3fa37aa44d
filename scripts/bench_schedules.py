"""1F1B against zero-bubble ZB-H1 (`--schedule`), side by side in one run.

    python scripts/bench_schedules.py                     # small preset, PP=2, m = 4 and 8, ~8 min
    python scripts/bench_schedules.py --repeats 1 --steps 12 --out-json runs/bench_schedules.json

For m in --micro-batches (4, 8) x vision trainable / frozen x schedule (1f1b, zb-h1), --repeats
times, it runs

    python -m mmpipe.cli train --preset small --stages 2 --schedule S [--freeze vision] --steps N
        --eval-samples 0 --data-workers 0 --ds-config WORK/gasM.json --output-dir WORK/...

(cpu_fp32.json with gradient_accumulation_steps = m; `--data-workers 0`: no loader processes
competing with the ranks for the two cores). The order of the cells is rotated every repeat and
the two schedules of a cell alternate which goes first, so drift in the machine's load (it is
shared) falls on both alike; compare the ratios, not the absolute numbers.

From each run: samples/s = train_batch / median step time over steps 3..N (the first steps warm
up), and from summary.json's stage_timing (mmpipe.runtime.timing, first step skipped) each stage's
idle fraction (blocked in p2p and the loss broadcast / step time) and forward / backward ms per
micro-batch (zb-h1's backward = B + W). The no-bubble bound is m x the slower stage's (forward +
backward) per micro-batch + the optimizer step, both measured in the same run.

Prints a markdown table (medians over repeats) and writes every run to --out-json.
Unknown flags go to every `mmpipe train`.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import statistics
import subprocess
import sys
from pathlib import Path

ROOT = Path(__file__).resolve().parent.parent


def run_one(work: Path, name: str, ds_cfg: Path, schedule: str, freeze: bool, args, extra) -> dict:
    out = work / name
    cmd = [sys.executable, "-m", "mmpipe.cli", "train", "--preset", args.preset, "--stages", str(args.stages),
           "--schedule", schedule, "--steps", str(args.steps), "--eval-samples", "0", "--data-workers", "0",
           "--ds-config", str(ds_cfg), "--output-dir", str(out), *(["--freeze", "vision"] if freeze else []), *extra]
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    if not (out / "summary.json").is_file():
        raise SystemExit(f"{name} failed:\n{proc.stdout[-2000:]}\n{proc.stderr[-2000:]}")
    summary = json.loads((out / "summary.json").read_text())
    with open(out / "train_log.csv") as f:
        rows = list(csv.DictReader(f))
    step_s = statistics.median(summary["train_batch"] / float(r["samples_per_s"]) for r in rows[2:])
    stages = summary["stage_timing"]["per_stage"]
    return {"name": name, "schedule": schedule, "freeze": freeze, "m": summary["gradient_accumulation"],
            "samples_per_s": summary["train_batch"] / step_s, "step_ms": 1000 * step_s,
            "idle": [s["idle_fraction"] for s in stages],
            "forward_ms_per_micro": [s["forward_ms_per_micro"] for s in stages],
            "backward_ms_per_micro": [s["backward_ms_per_micro"] for s in stages],
            "optimizer_ms": max(s["step_ms"] for s in stages), "parts": summary["parts"]}


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--preset", default="small")
    p.add_argument("--stages", type=int, default=2)
    p.add_argument("--micro-batches", default="4,8", help="gradient accumulation steps m, comma-separated")
    p.add_argument("--steps", type=int, default=16)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--work", default="runs/bench_schedules")
    p.add_argument("--out-json", default="runs/bench_schedules.json")
    args, extra = p.parse_known_args()
    work = ROOT / args.work
    work.mkdir(parents=True, exist_ok=True)
    base = json.loads((ROOT / "ds_configs" / "cpu_fp32.json").read_text())
    cells = []
    for m in [int(x) for x in args.micro_batches.split(",")]:
        cfg = dict(base, gradient_accumulation_steps=m)
        (work / f"gas{m}.json").write_text(json.dumps(cfg))
        for freeze in (False, True):
            cells.append((m, freeze))
    results = []
    for r in range(args.repeats):
        order = cells[r % len(cells):] + cells[: r % len(cells)]
        for n, (m, freeze) in enumerate(order):
            scheds = ("1f1b", "zb-h1") if (r + n) % 2 == 0 else ("zb-h1", "1f1b")
            for s in scheds:
                name = f"r{r}-m{m}-{'frozen' if freeze else 'trainable'}-{s}"
                res = run_one(work, name, work / f"gas{m}.json", s, freeze, args, extra)
                res["repeat"] = r
                results.append(res)
                print(f"{name}: {res['samples_per_s']:.1f} samples/s, idle {[round(x, 3) for x in res['idle']]}",
                      flush=True)
    Path(ROOT / args.out_json).parent.mkdir(parents=True, exist_ok=True)
    (ROOT / args.out_json).write_text(json.dumps(results, indent=1))
    print(table(results, cells))


def table(results: list[dict], cells) -> str:
    med = statistics.median
    lines = ["| m | vision | schedule | samples/s | zb / 1f1b | idle stage 0 | idle stage 1 | fwd ms/micro | "
             "bwd ms/micro | no-bubble bound samples/s | of bound |", "|" + "---|" * 11]
    for m, freeze in cells:
        base = None
        for s in ("1f1b", "zb-h1"):
            rs = [x for x in results if x["m"] == m and x["freeze"] == freeze and x["schedule"] == s]
            sps = med(x["samples_per_s"] for x in rs)
            base = base or sps
            idle = [med(x["idle"][i] for x in rs) for i in range(len(rs[0]["idle"]))]
            fwd = [med(x["forward_ms_per_micro"][i] for x in rs) for i in range(len(idle))]
            bwd = [med(x["backward_ms_per_micro"][i] for x in rs) for i in range(len(idle))]
            # no bubble: the slower stage computes all m micro-batches back to back, then the optimizer step
            bound_ms = m * max(f + b for f, b in zip(fwd, bwd)) + med(x["optimizer_ms"] for x in rs)
            bound = rs[0]["samples_per_s"] * rs[0]["step_ms"] / bound_ms  # train_batch / bound seconds
            lines.append(f"| {m} | {'frozen' if freeze else 'trainable'} | {s} | {sps:.1f} | {sps / base:.3f} | "
                         f"{idle[0]:.3f} | {idle[-1]:.3f} | {' / '.join(f'{v:.1f}' for v in fwd)} | "
                         f"{' / '.join(f'{v:.1f}' for v in bwd)} | {bound:.1f} | {sps / bound:.3f} |")
    return "\n".join(lines)


if __name__ == "__main__":
    main()
