"""Rows balanced by predicted cost (`--balance on`, the default with --pack) against stream order (`--balance off`),
in one sitting, on long-tailed mixed data (issue 57, docs/balance.md).

    python scripts/bench_balance.py                          # ~2.5 min on the 2-CPU VM, alone
    python scripts/bench_balance.py --repeats 3 --out-json docs/benchmarks/balance.json   # docs/balance.md, ~4.5 min
    python scripts/bench_balance.py --layouts "" --out-json docs/benchmarks/balance_rows.json     # per row alone
    python scripts/bench_balance.py --tower --out-json docs/benchmarks/balance_tower.json         # the tower side

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
(forward + backward of the single-device model, one thread; the process's CPU seconds, which a shared machine's
other work does not inflate as it does wall seconds; the fastest of 3 passes over all of them, the first
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
    return write_records(work / "data", [(40, 40)] * 8, records, seed, images=4, words=(20, 200, 2000))


def write_records(d: Path, sizes: list[tuple[int, int]], records: int, seed: int, images: int,
                  words: tuple[int, int, int]) -> Path:
    """D/llava.json: `records` conversations of 0..images images (files of the given (w, h) sizes, each a random
    colour) and answers of lo..hi words, lognormal about the median (words = (lo, median, hi), sigma 1)."""
    from PIL import Image
    (d / "img").mkdir(parents=True, exist_ok=True)
    rnd = random.Random(seed)
    for i, size in enumerate(sizes):
        Image.new("RGB", size, tuple(rnd.randrange(256) for _ in range(3))).save(d / "img" / f"{i}.png")
    lo, median, hi = words
    recs = []
    for _ in range(records):
        k, n = rnd.randrange(images + 1), min(hi, max(lo, round(rnd.lognormvariate(math.log(median), 1.0))))
        rec = {"conversations": [{"from": "human", "value": "what shape is " + " ".join(["<image>"] * k)},
                                 {"from": "gpt", "value": " ".join(rnd.choice(WORDS) for _ in range(n))}]}
        if k:
            rec["image"] = [f"img/{rnd.randrange(len(sizes))}.png" for _ in range(k)]
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


def write_tower_data(work: Path, records: int, seed: int = 0) -> tuple[Path, Path]:
    """(WORK/tower/llava.json, WORK/tower/model.json): the tower side (--tower). Records of 0..6 images each, every
    image a random size, sides 56..448 px (squares and 1:2 / 2:1 bands: 4 x 4 .. 32 x 32 patch grids, 16 .. 1,024
    patches), and answers of 4..400 words (lognormal, median 40). The model: qwen-tiny (Qwen2-VL family: windowed
    tower attention, one full-attention block) with vision.max_pixels raised to 448 x 448 and text.max_context to
    hold --max-patches 4096 and --text-len 512."""
    d = work / "tower"
    sides = [56, 112, 224, 336, 448]
    write_records(d, [(w, h) for w in sides for h in sides if max(w, h) <= 2 * min(w, h)], records, seed, images=6,
                  words=(4, 40, 400))
    cfg = json.loads((ROOT / "mmpipe" / "presets" / "qwen-tiny.json").read_text())
    cfg["vision"]["max_pixels"] = 448 * 448
    cfg["text"]["max_context"] = 8 * 2 + TOWER_PATCHES // 4 + TOWER_TEXT
    (d / "model.json").write_text(json.dumps(cfg))
    return d / "llava.json", d / "model.json"


TOWER_IMAGES, TOWER_PATCHES, TOWER_TEXT = 8, 4096, 512


def tower_argv(data: Path, model: Path) -> list[str]:
    return ["--preset", str(model), "--data", str(data), "--pack", "--max-images", str(TOWER_IMAGES),
            "--max-patches", str(TOWER_PATCHES), "--text-len", str(TOWER_TEXT), "--eval-samples", "0",
            "--data-workers", "0", "--seed", "0"]


def per_row(work: Path, data: Path, model: Path, ds: Path, rows: int, passes: int = 3,
            argv: list[str] | None = None, out_name: str = "rows") -> dict:
    """Each of the first `rows` packed rows timed alone (forward + backward, one thread; the fastest of `passes`
    passes over all of them) against its predicted FLOPs. argv: the run's data and model flags (default: the
    llava-tiny set's, `common`). Also the two-part fit, seconds = a x tower + b x decoder + c, whose a and b say
    whether the model weighs a tower FLOP as the clock does a decoder FLOP."""
    import torch

    from mmpipe.data.batches import rank_batches
    from mmpipe.data.dataset import prepare
    from mmpipe.model.builder import ReferenceModel
    from mmpipe.run_args import TrainArgs
    from mmpipe.run_config import resolve
    from mmpipe.runtime.feed import run_dataset, step_balance
    out = work / out_name
    run = resolve(TrainArgs.from_argv((argv or common(work, data, model)) + ["--ds-config", str(ds), "--stages", "1",
                                                                             "--output-dir", str(out)]), world_size=1)
    samples = prepare(run.data, run.model, str(out), 0, verbose=False)
    dataset = run_dataset(run, samples)
    cost = step_balance(run, samples, dataset.plan, force=True).cost
    torch.set_num_threads(1)
    net = ReferenceModel(run.model, seed=0)
    batches = list(rank_batches(dataset, [[r] for r in range(rows)]))  # one row each, (inputs, labels)
    wall, seconds = np.full(rows, np.inf), np.full(rows, np.inf)
    for _ in range(passes):  # every row once a pass, the fastest kept: a shared machine's load drifts
        for r, (inputs, labels) in enumerate(batches):
            t0, c0 = time.perf_counter(), time.process_time()
            net.zero_grad(set_to_none=True)
            run.objective.loss(net(*inputs), labels).backward()
            seconds[r] = min(seconds[r], time.process_time() - c0)
            wall[r] = min(wall[r], time.perf_counter() - t0)
    parts = np.array([cost(r) for r in range(rows)])  # [rows, (tower, decoder)]

    def images(r: int) -> int:
        return sum(int(samples.tokens(p)[1]) for p in dataset.plan.row(r))

    x, y = parts.sum(axis=1), np.array(seconds)
    even = measured_evenness(cost, y)
    slope, intercept = np.polyfit(x, y, 1)
    ranks = np.argsort(np.argsort(x)), np.argsort(np.argsort(y))
    return {"rows": rows, "passes": passes, "order": order_effect(cost, 2, 8, 8), **two_part_fit(parts, y),
            "pearson_r": float(np.corrcoef(x, y)[0, 1]),
            "spearman_rho": float(np.corrcoef(*ranks)[0, 1]), "s_per_gflop": float(slope * 1e9),
            "intercept_s": float(intercept), "row_s_min": float(y.min()), "row_s_median": float(np.median(y)),
            "row_s_max": float(y.max()), "gflop_min": float(x.min() / 1e9), "gflop_max": float(x.max() / 1e9),
            "clock": "process CPU seconds (one thread: the seconds the row ran, not those it waited on a shared "
                     "machine)", "wall_pearson_r": float(np.corrcoef(x, wall)[0, 1]),
            **even, "points_columns": ["tower GFLOP", "decoder GFLOP", "images", "samples", "CPU s", "wall s"],
            "points": [[round(float(t) / 1e9, 4), round(float(d) / 1e9, 4), images(r), len(dataset.plan.row(r)),
                        round(float(c), 5), round(float(w), 5)]
                       for r, ((t, d), c, w) in enumerate(zip(parts, y, wall))]}


def simulate_1f1b(fwd: np.ndarray, bwd: np.ndarray) -> float:
    """fwd, bwd [stages, micro-batches]: each micro-batch's seconds on each stage -> 1F1B's makespan. Stage s runs
    min(P - s - 1, m) forwards, then forward / backward pairs, then the remaining backwards; a forward waits for
    the stage before's, a backward for the stage after's (the last stage's for its own forward); free p2p."""
    stages, m = fwd.shape
    order = []
    for s in range(stages):
        w = min(stages - s - 1, m)
        order.append([("F", i) for i in range(w)] + [op for i in range(m - w) for op in (("F", w + i), ("B", i))]
                     + [("B", i) for i in range(m - w, m)])
    done: dict[tuple, float] = {}
    free, at = [0.0] * stages, [0] * stages
    while any(at[s] < len(order[s]) for s in range(stages)):
        moved = False
        for s in range(stages):
            if at[s] == len(order[s]):
                continue
            kind, i = order[s][at[s]]
            dep = (("F", s - 1, i) if s else None) if kind == "F" else (("B", s + 1, i) if s < stages - 1
                                                                         else ("F", s, i))
            if dep is not None and dep not in done:
                continue
            free[s] = max(free[s], done.get(dep, 0.0)) + (fwd if kind == "F" else bwd)[s, i]
            done[(kind, s, i)], at[s], moved = free[s], at[s] + 1, True
        assert moved, "1F1B order deadlocked"
    return max(free)


def johnson(a: np.ndarray, b: np.ndarray) -> list[int]:
    """Johnson's rule for two stages: the micro-batches lighter on the first stage than on the second first, by
    their first-stage load rising, then the others by their second-stage load falling (optimal for a two-machine
    flow shop of forwards alone; a heuristic under 1F1B's backwards)."""
    first = sorted((i for i in range(len(a)) if a[i] < b[i]), key=lambda i: (a[i], i))
    return first + sorted((i for i in range(len(a)) if a[i] >= b[i]), key=lambda i: (-b[i], i))


def order_effect(cost, micro: int, gas: int, steps: int) -> dict:
    """Issue 57 item 2 predicted, not measured: a PP=2 x DP=1 step's GAS micro-batches (balanced by StepBalance) in
    stream order (what runs) against Johnson's order by stage cost and its reverse, each step's 1F1B makespan
    (simulate_1f1b; forward = 1/3, backward = 2/3 of a stage's predicted FLOPs; the split at the mean row's
    min-max FLOPs cut). Ratios to stream order: p50 / min / max over the steps."""
    from mmpipe.data.balance import StepBalance
    step = StepBalance(cost, micro=micro, gas=gas, dp=1)
    layers = np.array([cost.layer_flops(r) for r in range(steps * step.batch)])
    prefix = np.cumsum(layers.mean(axis=0))
    cut = int(np.argmin([max(prefix[b - 1], prefix[-1] - prefix[b - 1]) for b in range(1, len(prefix))])) + 1
    ratios: dict[str, list[float]] = {"johnson": [], "reverse": []}
    for k in range(steps):
        order = step.order(k * step.batch)
        loads = np.array([[layers[list(order[g * micro:(g + 1) * micro])][:, a:b].sum() for g in range(gas)]
                          for a, b in ((0, cut), (cut, layers.shape[1]))])  # [2 stages, gas]
        def span(perm):
            t = loads[:, perm]
            return simulate_1f1b(t / 3, 2 * t / 3)
        base, best = span(list(range(gas))), johnson(loads[0], loads[1])
        ratios["johnson"].append(span(best) / base)
        ratios["reverse"].append(span(best[::-1]) / base)
    return {"cut_after_layer": cut, "steps": steps, "micro": micro, "gas": gas,
            **{f"{k}_over_stream": {"p50": float(np.median(v)), "min": float(min(v)), "max": float(max(v))}
               for k, v in ratios.items()}}


def two_part_fit(parts: np.ndarray, y: np.ndarray) -> dict:
    """Least squares seconds = a x tower GFLOP + b x decoder GFLOP + c, and each part's own correlation with what
    the clock leaves it (y less the other part's fitted seconds and c): where a and b differ the model's FLOPs weigh
    the two parts unlike the clock. A part the same in every row (a fixed tower) has no slope of its own: None."""
    g = parts / 1e9
    varies = g.std(axis=0) > 1e-9 * np.abs(g).max(axis=0).clip(min=1e-30)
    cols = [g[:, i] for i in range(2) if varies[i]]
    coef = np.linalg.lstsq(np.stack([*cols, np.ones(len(y))], axis=1), y, rcond=None)[0]
    slopes, k = [None, None], 0
    for i in range(2):
        if varies[i]:
            slopes[i], k = float(coef[k]), k + 1
    out = {"tower_s_per_gflop": slopes[0], "decoder_s_per_gflop": slopes[1], "two_part_intercept_s": float(coef[-1]),
           "tower_gflop_range": [float(g[:, 0].min()), float(g[:, 0].max())],
           "decoder_gflop_range": [float(g[:, 1].min()), float(g[:, 1].max())]}
    for i, name in enumerate(("tower", "decoder")):
        if slopes[i] is not None:
            other = slopes[1 - i] * g[:, 1 - i] if slopes[1 - i] is not None else 0.0
            out[f"{name}_pearson_r"] = float(np.corrcoef(g[:, i], y - other - coef[-1])[0, 1])
    return out


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
    p.add_argument("--tower", action="store_true",
                   help="only the cost model against the clock on the tower side: --rows rows of a Qwen2-VL-family "
                        "model on many images of many sizes (write_tower_data), no training runs")
    a = p.parse_args()
    work = Path(a.work).resolve()
    work.mkdir(parents=True, exist_ok=True)
    if a.tower:
        return tower_main(work, a)
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


def tower_main(work: Path, a) -> int:
    """--tower: per_row on the tower set, printed and (--out-json) written."""
    data, model = write_tower_data(work, a.records)
    _, ds = write_configs(work)
    rows = per_row(work, data, model, ds[4], a.rows, argv=tower_argv(data, model), out_name="tower_rows")
    rows.update(machine=os.uname().nodename, cpus=os.cpu_count(), load_1min_at_end=os.getloadavg()[0])
    print(json.dumps({k: v for k, v in rows.items() if k != "points"}, indent=2))
    if a.out_json:
        Path(a.out_json).write_text(json.dumps(rows, indent=2) + "\n")
    return 0


if __name__ == "__main__":
    sys.exit(main())
