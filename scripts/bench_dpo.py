"""DPO's throughput benchmark (issue 56; docs/dpo.md): pairs/s with the live reference, with the precomputed one
(`mmpipe score-reference`, then `--reference-logps`) and SFT on the same rows, llava-tiny PP=2 on this machine.

    python scripts/bench_dpo.py                  # 400 shapes pairs, 150 steps each (~2 min on a shared 2-core box)
    python scripts/bench_dpo.py --pairs 64 --steps 20    # a smoke run
    python scripts/bench_dpo.py --preset qwen-tiny --tower-layers 4 --tower-dim 128 --live-only   # a tower-heavy
        # qwen-tiny, the live-reference run alone

Each run trains 8 micro x 2 GAS = 16 rows a step (8 pairs; SFT: 16 samples of the llava export of the same seed,
whose answers are the pairs' chosen ones, so its rows have the same shape). Reported: the median of train_log.csv's
samples_per_s (rows/s) over the steps after the first 10, pairs/s = rows/s / 2, and the step's ratio to SFT's. The
live and precomputed runs must also give the same losses (the file holds the same log-probs the live pass computes);
their largest difference is printed.
"""
from __future__ import annotations

import argparse
import csv
import json
import statistics
import sys
import tempfile
import time
from pathlib import Path

from mmpipe.cli import main
from mmpipe.data.export import export_shapes

OPTIMIZER = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0,
                                         "torch_adam": True}}


def _config(path: Path) -> Path:
    path.write_text(json.dumps({"train_micro_batch_size_per_gpu": 8, "gradient_accumulation_steps": 2,
                                "optimizer": OPTIMIZER, "gradient_clipping": 1.0, "steps_per_print": 10 ** 9}))
    return path


def _train(out: Path, data: Path, cfg: Path, steps: int, *extra: str, preset: str = "llava-tiny",
           stages: int = 2) -> list[dict]:
    argv = ["train", "--preset", preset, "--data", str(data), "--ds-config", str(cfg), "--steps", str(steps),
            "--stages", str(stages), "--output-dir", str(out), "--eval-samples", "0", "--seed", "3", *extra]
    if main(argv) != 0:
        sys.exit(f"bench_dpo: {' '.join(argv)} failed")
    return list(csv.DictReader(open(out / "train_log.csv")))


def _tower_heavy(preset: str, layers: int, dim: int, out: Path) -> str:
    """The preset's model JSON with `layers` vision blocks of width `dim` (0: the preset's; heads of 16, MLP 2 x dim),
    written to `out`: a tiny model whose tower dominates."""
    cfg = json.loads((Path(__file__).resolve().parents[1] / "mmpipe" / "presets" / f"{preset}.json").read_text())
    cfg["vision"]["n_layers"] = layers
    if dim:
        cfg["vision"].update(dim=dim, n_heads=dim // 16, ff_dim=2 * dim)
    out.write_text(json.dumps(cfg))
    return str(out)


def _rates(runs: dict) -> dict:
    """Each run's median rows/s (train_log.csv's samples_per_s) over the steps after the first 10."""
    return {k: statistics.median(float(r["samples_per_s"]) for r in rows[10:]) for k, rows in runs.items()}


def main_bench(pairs: int, steps: int, preset: str = "llava-tiny", live_only: bool = False,
               tower: tuple[int, int] = (0, 0), stages: int = 2) -> None:
    with tempfile.TemporaryDirectory() as d:
        root = Path(d)
        if tower[0]:
            preset = _tower_heavy(preset, *tower, root / f"{preset}-tower{tower[0]}x{tower[1]}.json")
        dpo = export_shapes(root / "dpo", "dpo-jsonl", pairs)
        cfg = _config(root / "ds.json")
        if live_only:  # the live-reference run alone (e.g. before / after a change to it)
            rate = _rates({"dpo, live reference": _train(root / "live", dpo, cfg, steps, "--objective", "dpo",
                                                         preset=preset, stages=stages)})["dpo, live reference"]
            print(f"\n{Path(preset).stem} PP={stages}, {pairs} pairs, 16 rows a step, {steps} steps: dpo, live "
                  f"reference {rate:.1f} rows/s, {rate / 2:.1f} pairs/s")
            return
        sft = export_shapes(root / "sft", "llava-jsonl", pairs)
        t0 = time.perf_counter()
        flags = ["--preset", preset, "--data", str(dpo), "--objective", "dpo", "--ds-config", str(cfg),
                 "--output-dir", str(root / "pre"), "--seed", "3"]
        if main(["score-reference", *flags]) != 0:
            sys.exit("bench_dpo: score-reference failed")
        scored = time.perf_counter() - t0
        logps = root / "pre" / "data" / "reference_logps.npz"
        runs = {"dpo, live reference": _train(root / "live", dpo, cfg, steps, "--objective", "dpo", preset=preset),
                "dpo, precomputed": _train(root / "pre", dpo, cfg, steps, "--objective", "dpo",
                                           "--reference-logps", str(logps), preset=preset),
                "sft, same rows": _train(root / "sft_run", sft, cfg, steps, preset=preset)}
        rate = _rates(runs)
        print(f"\n{Path(preset).stem} PP=2, {pairs} pairs, 16 rows a step, {steps} steps; score-reference took "
              f"{scored:.1f} s")
        print(f"{'run':<22}{'rows/s':>10}{'pairs/s':>10}{'step / sft':>12}")
        for k, v in rate.items():
            print(f"{k:<22}{v:>10.1f}{v / 2:>10.1f}{rate['sft, same rows'] / v:>12.2f}")
        live, pre = runs["dpo, live reference"], runs["dpo, precomputed"]
        print(f"live vs precomputed: largest loss difference over {steps} steps "
              f"{max(abs(float(a['loss']) - float(b['loss'])) for a, b in zip(live, pre)):.2e}")


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--pairs", type=int, default=400)
    p.add_argument("--steps", type=int, default=150)
    p.add_argument("--preset", default="llava-tiny")
    p.add_argument("--live-only", action="store_true", help="the live-reference dpo run alone")
    p.add_argument("--tower-layers", type=int, default=0, help="the preset with this many vision blocks")
    p.add_argument("--tower-dim", type=int, default=0, help="... of this width (with --tower-layers)")
    p.add_argument("--stages", type=int, default=2, help="pipeline stages (with --live-only)")
    a = p.parse_args()
    main_bench(a.pairs, a.steps, a.preset, a.live_only, (a.tower_layers, a.tower_dim), a.stages)
