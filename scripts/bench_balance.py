"""Rows balanced by predicted cost (`--balance on`, the default with --pack) against stream order (`--balance off`),
in one sitting, on long-tailed mixed data (issue 57, docs/balance.md).

    python scripts/bench_balance.py                          # ~2.5 min on the 2-CPU VM, alone
    python scripts/bench_balance.py --repeats 3 --out-json docs/benchmarks/balance.json   # docs/balance.md, ~4.5 min

The data, generated into WORK/data/ (WORK = --work, default runs/bench_balance): --records (600) LLaVA conversations,
each with 0, 1, 2, 3 or 4 images (equally likely; 40 px PNGs) and an answer of A words of the built-in tokenizer's
vocabulary (one word, one token), A = clip(round(X), 20, 2000), X ~ lognormal(ln 200, 1.0): median 200, a few
near 2,000. The model: llava-tiny (a 2-block SigLIP-shaped tower, a 2-block Qwen2-shaped decoder, width 32) with
text.max_context raised to hold --max-images 12 images of 16 positions and --text-len 2048 (L = 2,240 a row).

Four runs of `python -m mmpipe.cli train --pack --max-images 12 --text-len 2048 --steps S --data-workers 0`,
micro-batch 2, 16 rows a step, OMP_NUM_THREADS=1 per rank:

    dp2   --stages 1 --dp 2, GAS 4     the step waits for the slower rank
    pp2   --stages 2 --dp 1, GAS 8     each stage's micro-batches

each with --balance off then on (--repeats: the pair's order alternates). From each run's summary.json: the
median step time (the first step left out) and data.balance, the per-rank (dp2) and per-micro-batch (pp2) max/mean
of the predicted cost before (stream order) and after (balanced), p50 over the run's steps. The balanced bound (the
mean rank's cost, issue 57's goal) in seconds, were a step all rank work: stream order's step / its max/mean.

Then, in this process, the cost model against the clock: the first --rows (100) packed rows, each timed alone
(forward + backward of the single-device model, one thread; the fastest of 3 passes over all of them, the first
pass also warming up), against RowCosts' predicted
FLOPs (tower + decoder): Pearson's r, Spearman's rho, and the least-squares seconds per FLOP and intercept. And
the clock's view of the dp2 layout: the timed rows' 6 whole steps of 16, laid out by predicted cost, each rank's
summed measured row seconds, max/mean in stream order and balanced.
"""
from __future__ import annotations

import argparse
import json
import math
import os
import random
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))
WORDS = "red green blue yellow cyan magenta circle square triangle left right top bottom".split()
MAX_IMAGES, TEXT_LEN = 12, 2048
LAYOUTS = {"dp2": (["--stages", "1", "--dp", "2"], 4), "pp2": (["--stages", "2", "--dp", "1"], 8)}


def write_data(work: Path, records: int, seed: int = 0) -> Path:
    """WORK/data/llava.json: the long-tailed mixed set of the module docstring."""
    from PIL import Image
    d = work / "data"
    (d / "img").mkdir(parents=True, exist_ok=True)
    rnd = random.Random(seed)
    for i in range(8):
        Image.new("RGB", (40, 40), tuple(rnd.randrange(256) for _ in range(3))).save(d / "img" / f"{i}.png")
    recs = []
    for _ in range(records):
        k, words = rnd.randrange(5), min(2000, max(20, round(rnd.lognormvariate(math.log(200), 1.0))))
        rec = {"conversations": [{"from": "human", "value": "what shape is " + " ".join(["<image>"] * k)},
                                 {"from": "gpt", "value": " ".join(rnd.choice(WORDS) for _ in range(words))}]}
        if k:
            rec["image"] = [f"img/{rnd.randrange(8)}.png" for _ in range(k)]
        recs.append(rec)
    (d / "llava.json").write_text(json.dumps(recs))
    return d / "llava.json"


def write_configs(work: Path) -> tuple[Path, dict[int, Path]]:
    """(WORK/model.json: llava-tiny with room for L positions, {GAS: WORK/dsGAS.json} at micro-batch 2)."""
    cfg = json.loads((ROOT / "mmpipe" / "presets" / "llava-tiny.json").read_text())
    cfg["text"]["max_context"] = MAX_IMAGES * 16 + TEXT_LEN
    (work / "model.json").write_text(json.dumps(cfg))
    ds = {}
    for gas in sorted({g for _, g in LAYOUTS.values()}):
        c = json.loads((ROOT / "ds_configs" / "cpu_fp32.json").read_text())
        c.update(train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=gas)
        c.pop("train_batch_size", None)
        ds[gas] = work / f"ds{gas}.json"
        ds[gas].write_text(json.dumps(c))
    return work / "model.json", ds


def common(work: Path, data: Path, model: Path) -> list[str]:
    return ["--preset", str(model), "--data", str(data), "--pack", "--max-images", str(MAX_IMAGES), "--text-len",
            str(TEXT_LEN), "--eval-samples", "0", "--data-workers", "0", "--seed", "0"]


def train(work: Path, name: str, argv: list[str]) -> dict:
    out = work / name
    env = dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1")
    t0 = time.perf_counter()
    proc = subprocess.run([sys.executable, "-m", "mmpipe.cli", "train", "--output-dir", str(out), *argv], cwd=ROOT,
                          env=env, capture_output=True, text=True)
    if not (out / "summary.json").is_file():
        raise SystemExit(f"bench_balance: {name} failed (exit {proc.returncode}):\n{proc.stdout[-2000:]}\n"
                         f"{proc.stderr[-2000:]}")
    s = json.loads((out / "summary.json").read_text())
    b = s["data"]["balance"]
    level = "rank" if s["dp"] > 1 else "micro"
    return {"run": name, "step_time_s": s["step_time_s"], "wall_s": round(time.perf_counter() - t0, 1),
            "applied": b["applied"], "level": level, "before_p50": b[level]["before"]["p50"],
            "after_p50": b[level]["after"]["p50"], "before_max": b[level]["before"]["max"],
            "after_max": b[level]["after"]["max"], "samples_per_s": s["samples_per_s"]}


def per_row(work: Path, data: Path, model: Path, ds: Path, rows: int, passes: int = 3) -> dict:
    """Each of the first `rows` packed rows timed alone (forward + backward, one thread; the fastest of `passes`
    passes over all of them) against its predicted FLOPs."""
    import torch

    from mmpipe.data.batches import rank_batches
    from mmpipe.data.dataset import prepare
    from mmpipe.model.builder import ReferenceModel
    from mmpipe.run_args import TrainArgs
    from mmpipe.run_config import resolve
    from mmpipe.runtime.feed import run_dataset, step_balance
    out = work / "rows"
    run = resolve(TrainArgs.from_argv(common(work, data, model) + ["--ds-config", str(ds), "--stages", "1",
                                                                    "--output-dir", str(out)]), world_size=1)
    samples = prepare(run.data, run.model, str(out), 0, verbose=False)
    dataset = run_dataset(run, samples)
    cost = step_balance(run, samples, dataset.plan, force=True).cost
    torch.set_num_threads(1)
    net = ReferenceModel(run.model, seed=0)
    batches = list(rank_batches(dataset, [[r] for r in range(rows)]))  # one row each, (inputs, labels)
    seconds = np.full(rows, np.inf)
    for _ in range(passes):  # every row once a pass, the fastest kept: a shared machine's load drifts
        for r, (inputs, labels) in enumerate(batches):
            t0 = time.perf_counter()
            net.zero_grad(set_to_none=True)
            run.objective.loss(net(*inputs), labels).backward()
            seconds[r] = min(seconds[r], time.perf_counter() - t0)
    predicted = [sum(cost(r)) for r in range(rows)]
    x, y = np.array(predicted), np.array(seconds)
    even = measured_evenness(cost, y)
    slope, intercept = np.polyfit(x, y, 1)
    ranks = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return {"rows": rows, "passes": passes, "pearson_r": float(np.corrcoef(x, y)[0, 1]),
            "spearman_rho": float(np.corrcoef(*ranks)[0, 1]), "s_per_gflop": float(slope * 1e9),
            "intercept_s": float(intercept), "row_s_min": float(y.min()), "row_s_median": float(np.median(y)),
            "row_s_max": float(y.max()), "gflop_min": float(x.min() / 1e9), "gflop_max": float(x.max() / 1e9),
            **even, "points": [[round(float(a) / 1e9, 4), round(float(b), 5)] for a, b in zip(x, y)]}


def measured_evenness(cost, seconds: np.ndarray) -> dict:
    """The dp2 layout (micro 2 x GAS 4 x DP 2 = 16 rows a step) of each whole step among the timed rows, by
    predicted cost, judged by the rows' measured seconds: per-rank max/mean of the summed row times, stream order
    against balanced, p50 over the steps (the clock's view of what data.balance predicts)."""
    from mmpipe.data.balance import StepBalance, ratio
    step = StepBalance(cost, micro=2, gas=4, dp=2)
    out: dict = {"measured_steps": len(seconds) // step.batch}
    for level in ("rank", "micro"):
        before, after = [], []
        for base in range(0, len(seconds) - step.batch + 1, step.batch):
            order = step.layout(step.costs(base))
            t = np.stack([seconds[base:base + step.batch], np.zeros(step.batch)], axis=1)
            before.append(ratio(t, list(range(step.batch)), step, level, None))
            after.append(ratio(t, order, step, level, None))
        out[f"measured_{level}_max_over_mean"] = {"before_p50": float(np.median(before)),
                                                  "after_p50": float(np.median(after))}
    return out


def main() -> int:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--work", default="runs/bench_balance")
    p.add_argument("--records", type=int, default=600)
    p.add_argument("--steps", type=int, default=8)
    p.add_argument("--repeats", type=int, default=1)
    p.add_argument("--rows", type=int, default=100)
    p.add_argument("--layouts", default="dp2,pp2")
    p.add_argument("--out-json", default=None)
    a = p.parse_args()
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    data = write_data(work, a.records)
    model, ds = write_configs(work)
    results, layouts = [], [x for x in a.layouts.split(",") if x]
    for rep in range(a.repeats):
        for layout in layouts:
            flags, gas = LAYOUTS[layout]
            pair = ("off", "on") if rep % 2 == 0 else ("on", "off")
            for balance in pair:
                argv = common(work, data, model) + flags + ["--ds-config", str(ds[gas]), "--steps", str(a.steps),
                                                            "--balance", balance]
                results.append({"layout": layout, "repeat": rep, "balance": balance,
                                **train(work, f"r{rep}-{layout}-{balance}", argv)})
                print(json.dumps(results[-1]), flush=True)
    rows = per_row(work, data, model, ds[4], a.rows) if a.rows else None
    summary = {"layouts": {}, "per_row": rows, "runs": results, "machine": os.uname().nodename,
               "cpus": os.cpu_count(), "load_1min_at_end": os.getloadavg()[0]}
    for layout in layouts:
        on = [r["step_time_s"] for r in results if r["layout"] == layout and r["balance"] == "on"]
        off = [r["step_time_s"] for r in results if r["layout"] == layout and r["balance"] == "off"]
        one = next(r for r in results if r["layout"] == layout)
        # the balanced bound, were the step all rank work: stream order's step x mean / max of the predicted cost
        bound = float(np.median(off)) / one["before_p50"]
        summary["layouts"][layout] = {"step_s_off": float(np.median(off)), "step_s_on": float(np.median(on)),
                                      "on_over_off": float(np.median(on) / np.median(off)), "bound_s": bound,
                                      "on_over_bound": float(np.median(on)) / bound,
                                      "predicted_max_over_mean_before_p50": one["before_p50"],
                                      "predicted_max_over_mean_after_p50": one["after_p50"], "level": one["level"]}
    print(json.dumps(summary["layouts"], indent=2))
    print(json.dumps({k: v for k, v in (rows or {}).items() if k != "points"}, indent=2))
    if a.out_json:
        Path(a.out_json).write_text(json.dumps(summary, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
