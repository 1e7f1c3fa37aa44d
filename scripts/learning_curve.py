"""The default run's learning curve: `mmpipe train` with a checkpoint every N steps, then the
held-out accuracy (greedy answers, exact match) of every checkpoint against training time.

    python scripts/learning_curve.py --output-dir runs/curve --save-every 100

Extra flags go to `mmpipe train` unchanged; `--keep-checkpoints` defaults to 0 here (keep all), since
the curve evaluates every checkpoint after training. Writes curve.csv and curve.md into the output
directory; docs/shapes.md quotes the numbers of one run.
"""
from __future__ import annotations

import argparse
import csv
import subprocess
import sys
from pathlib import Path

import torch

from mmpipe.config import load_preset
from mmpipe.inference.evaluate import evaluate
from mmpipe.runtime.checkpoint import load_reference


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default="runs/curve")
    p.add_argument("--save-every", type=int, default=100)
    p.add_argument("--preset", default="small")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--eval-samples", type=int, default=1000)
    p.add_argument("--keep-checkpoints", default="0", help="passed to mmpipe train; 0 keeps every checkpoint")
    args, train_args = p.parse_known_args()
    out = Path(args.output_dir)
    cmd = [sys.executable, "-m", "mmpipe.cli", "train", "--output-dir", str(out), "--preset", args.preset,
           "--seed", str(args.seed), "--save-every", str(args.save_every), "--keep-checkpoints", args.keep_checkpoints,
           *train_args]
    if subprocess.call(cmd) != 0 or not (out / "summary.json").is_file():
        print("learning_curve: training failed", file=sys.stderr)
        return 1
    with open(out / "train_log.csv") as f:
        elapsed = {int(r["step"]): float(r["elapsed_s"]) for r in csv.DictReader(f)}
    cfg = load_preset(args.preset)
    torch.set_num_threads(2)
    rows = []
    tags = sorted((d for d in (out / "checkpoints").iterdir() if d.name.startswith("step")),
                  key=lambda d: int(d.name[4:]))
    for d in tags:
        step = int(d.name[4:])
        res = evaluate(load_reference(out / "checkpoints", cfg, d.name), cfg, seed=args.seed,
                       n_samples=args.eval_samples)
        rows.append({"step": step, "train_s": round(elapsed[step], 1), "accuracy": round(res["accuracy"], 4),
                     **{k: round(v, 4) for k, v in res["per_type"].items()}})
        print(rows[-1], flush=True)
    with open(out / "curve.csv", "w", newline="") as f:
        w = csv.DictWriter(f, list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    cols = list(rows[0])
    md = ["| " + " | ".join(cols) + " |", "|" + "---|" * len(cols)]
    md += ["| " + " | ".join(str(r[c]) for c in cols) + " |" for r in rows]
    (out / "curve.md").write_text("\n".join(md) + "\n")
    print("\n".join(md))
    return 0


if __name__ == "__main__":
    sys.exit(main())
