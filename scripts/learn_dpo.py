"""DPO's learning check (issue 56; docs/dpo.md): held-out preference accuracy and the chosen answer's greedy rate
of a model that learns a question type from preference pairs, after an SFT warm-up that taught it to see.

    python scripts/learn_dpo.py --output-dir runs/learn_dpo          # the docs' numbers (DPO with RPO's SFT term)
    python scripts/learn_dpo.py --rpo-alpha 0 --dpo-steps 1000 --output-dir runs/learn_dpo_sigmoid  # DPO's loss alone
    python scripts/learn_dpo.py --sft-steps 50 --dpo-steps 20 --every 10 --sft-n 200 --n 200 --eval-n 50  # smoke

1. SFT (`mmpipe train`, the `small` preset, 2 stages) on the shapes export's questions of three types (count,
   colour_of_shape, where_is_shape): the model learns to see shapes, colours and places.
2. DPO (`--objective dpo --init-from` the SFT run; its reference the SFT model) on pairs of a type the SFT run never
   answered (--types, default colour_at_quarter: the colour in a named quarter), the right answer chosen and, by
   default, another colour the image shows rejected (--rejected present), so neither a blind order of the answers
   nor "a colour that is in the image" tells the two apart: the start's preference accuracy is near chance.
3. Each DPO checkpoint (and the start) on held-out pairs of those types, made the same way from another seed's images:
   `mmpipe eval --objective dpo`'s preference accuracy (the chosen answer's summed log-prob above the rejected's),
   and `mmpipe eval`'s exact match of the greedy answer against the chosen one (the chosen answer's greedy rate).
Writes OUTPUT_DIR/learn_dpo.csv (step, dpo seconds, accuracy, margin, greedy rate) and prints it.
"""
from __future__ import annotations

import argparse
import csv
import json
import random
import sys
import time
from pathlib import Path

from mmpipe.cli import main
from mmpipe.data.export import ANSWERS, export_shapes
from mmpipe.data.shapes import QUESTION_TYPES, ShapesVQA

SFT_TYPES = ("count", "colour_of_shape", "where_is_shape")
DPO_TYPES = ("colour_at_quarter",)


def _config(path: Path, micro: int, gas: int, lr: float, schedule: dict | None) -> Path:
    cfg = {"train_micro_batch_size_per_gpu": micro, "gradient_accumulation_steps": gas, "gradient_clipping": 1.0,
           "steps_per_print": 10 ** 9, "optimizer": {"type": "AdamW", "params": {
               "lr": lr, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0, "torch_adam": True}}}
    if schedule:
        cfg["scheduler"] = schedule
    path.write_text(json.dumps(cfg))
    return path


def _keep(path: Path, types: tuple[str, ...], out: Path) -> Path:
    """The records of `types` (record i of an export is of QUESTION_TYPES[i % 5]) to `out`, beside the images."""
    lines = path.read_text().splitlines(keepends=True)
    out.write_text("".join(x for i, x in enumerate(lines) if QUESTION_TYPES[i % len(QUESTION_TYPES)] in types))
    return out


def _rejected(sample, rng: random.Random, how: str) -> str:
    """A wrong answer of the sample's question type. random: any; present: one the image shows (another shape's
    colour or kind) where the image has another shape, else any. (The exporter's own wrong answer was once a fixed
    step from the right one for a colour type, an order a model learns without the image; it is drawn per record now:
    docs/dpo.md.)"""
    wrong = [a for a in ANSWERS[sample.qtype] if a != sample.answer]
    colours, kinds = [s.colour for s in sample.shapes], [s.kind for s in sample.shapes]
    shown = {"colour_of_shape": colours, "colour_at_quarter": colours, "shape_of_colour": kinds}.get(sample.qtype, [])
    present = [a for a in shown if a != sample.answer]
    return rng.choice(present if how == "present" and present else wrong)


def _pairs(out: Path, n: int, seed: int, types: tuple[str, ...], how: str) -> Path:
    """Preference pairs of `types` from a shapes export of n records (seed), the rejected answers drawn by `how`
    (export: the exporter's own)."""
    path = export_shapes(out, "dpo-jsonl", n, seed=seed)
    data, rng = ShapesVQA(64, 16, "train", seed), random.Random(seed)
    recs = [json.loads(x) for x in path.read_text().splitlines()]
    keep = []
    for i, r in enumerate(recs):
        sample = data.sample(i)
        if sample.qtype in types:
            keep.append(r if how == "export" else dict(r, rejected=_rejected(sample, rng, how)))
    (out / "pairs.jsonl").write_text("".join(json.dumps(r) + "\n" for r in keep))
    return out / "pairs.jsonl"


def _chosen_as_answers(pairs: Path, out: Path) -> Path:
    """The held-out pairs as LLaVA records whose answer is the chosen one: `mmpipe eval` scores its greedy answer."""
    recs = [json.loads(x) for x in pairs.read_text().splitlines()]
    out.write_text("".join(json.dumps({"image": r["images"][0], "conversations": [
        {"from": "human", "value": r["prompt"]}, {"from": "gpt", "value": r["chosen"]}]}) + "\n" for r in recs))
    return out


def _run(argv: list[str]) -> None:
    if main(argv) != 0:
        sys.exit(f"learn_dpo: mmpipe {' '.join(argv)} failed")


def _score(run: Path, tag: str, pairs: Path, chosen: Path, out: Path) -> tuple[float, float, float]:
    """(preference accuracy, mean margin, chosen greedy rate) of checkpoint `tag` of `run`."""
    (run / "checkpoints" / "latest").write_text(tag)
    _run(["eval", "--objective", "dpo", "--checkpoint", str(run), "--data", str(pairs), "--out",
          str(out / f"{tag}_pairs.jsonl"), "--batch-size", "32"])
    pref = json.loads((out / f"{tag}_pairs.summary.json").read_text())
    _run(["eval", "--checkpoint", str(run), "--data", str(chosen), "--out", str(out / f"{tag}_greedy.jsonl"),
          "--batch-size", "32", "--max-new-tokens", "4"])
    greedy = json.loads((out / f"{tag}_greedy.summary.json").read_text())
    return pref["accuracy"], pref["margin"], greedy["exact"]


def learn(a) -> list[dict]:
    root = Path(a.output_dir)
    sft_types, dpo_types = (SFT_TYPES, tuple(a.types.split(","))) if a.split == "types" else (QUESTION_TYPES,) * 2
    pairs = _pairs(root / "dpo_data", a.n, 0, dpo_types, a.rejected)
    held = _pairs(root / "eval_data", a.eval_n, 1, dpo_types, a.rejected)
    chosen = _chosen_as_answers(held, root / "eval_data" / "chosen.jsonl")
    common = ["--preset", a.preset, "--stages", "2", "--eval-samples", "0", "--seed", "0"]
    t0 = time.perf_counter()
    sft = Path(a.sft_run) if a.sft_run else root / "sft"
    if not a.sft_run:
        sft_data = _keep(export_shapes(root / "sft_data", "llava-jsonl", a.sft_n), sft_types,
                         root / "sft_data" / "sft.jsonl")
        sft_cfg = _config(root / "sft.json", 16, 2, 5e-4, {"type": "WarmupCosineLR", "params": {
            "total_num_steps": a.sft_steps, "warmup_num_steps": min(100, a.sft_steps // 10)}})
        _run(["train", *common, "--data", str(sft_data), "--ds-config", str(sft_cfg), "--steps", str(a.sft_steps),
              "--output-dir", str(sft)])
    sft_s = time.perf_counter() - t0
    sft_tag = (sft / "checkpoints" / "latest").read_text().strip()
    dpo_cfg = _config(root / "dpo.json", a.micro, 2, a.lr, None)
    t0 = time.perf_counter()
    _run(["train", *common, "--objective", "dpo", "--beta", str(a.beta), "--rpo-alpha", str(a.rpo_alpha), "--data",
          str(pairs), "--ds-config",
          str(dpo_cfg), "--steps", str(a.dpo_steps), "--save-every", str(a.every), "--keep-checkpoints", "0",
          "--init-from", str(sft), "--output-dir", str(root / "dpo")])
    dpo_s = time.perf_counter() - t0
    log = {int(r["step"]): r for r in csv.DictReader(open(root / "dpo" / "train_log.csv"))}
    scores = root / "scores"
    rows = [{"step": 0, "dpo_s": 0.0, **dict(zip(("accuracy", "margin", "greedy"),
                                               _score(sft, sft_tag, held, chosen, scores)))}]
    for step in range(a.every, a.dpo_steps + 1, a.every):
        acc, margin, greedy = _score(root / "dpo", f"step{step}", held, chosen, scores)
        rows.append({"step": step, "dpo_s": float(log[step]["elapsed_s"]) if "elapsed_s" in log[step] else None,
                     "accuracy": acc, "margin": margin, "greedy": greedy})
    (root / "dpo" / "checkpoints" / "latest").write_text(f"step{a.dpo_steps}")
    with open(root / "learn_dpo.csv", "w", newline="") as f:
        w = csv.DictWriter(f, fieldnames=list(rows[0]))
        w.writeheader()
        w.writerows(rows)
    sft_said = f"SFT: {a.sft_run} ({sft_tag})" if a.sft_run else f"SFT {a.sft_steps} steps in {sft_s:.0f} s"
    print(f"\n{sft_said}; DPO {a.dpo_steps} steps in {dpo_s:.0f} s (with start-up)")
    print(f"{'dpo step':>9}{'dpo s':>8}{'pref acc':>10}{'margin':>9}{'greedy':>8}")
    for r in rows:
        print(f"{r['step']:>9}{(r['dpo_s'] or 0):>8.0f}{r['accuracy']:>10.3f}{r['margin']:>9.3f}{r['greedy']:>8.3f}")
    return rows


if __name__ == "__main__":
    p = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    p.add_argument("--output-dir", default="runs/learn_dpo")
    p.add_argument("--preset", default="small")
    p.add_argument("--sft-n", type=int, default=2000, help="records exported for SFT (it keeps its types)")
    p.add_argument("--n", type=int, default=10000, help="records exported for DPO (it keeps its types)")
    p.add_argument("--eval-n", type=int, default=1000, help="held-out records exported (the DPO types kept: 1 in 5)")
    p.add_argument("--sft-steps", type=int, default=600)
    p.add_argument("--dpo-steps", type=int, default=500)
    p.add_argument("--every", type=int, default=100, help="DPO checkpoints scored every N steps")
    p.add_argument("--lr", type=float, default=3e-4, help="DPO's constant learning rate")
    p.add_argument("--beta", type=float, default=0.1)
    p.add_argument("--micro", type=int, default=16, help="DPO rows per micro-batch (micro / 2 pairs; 2 GAS)")
    p.add_argument("--rpo-alpha", type=float, default=1.0, help="the SFT term on the chosen answers (RPO; 0: off)")
    p.add_argument("--types", default=",".join(DPO_TYPES), help="the DPO pairs' question types (--split types)")
    p.add_argument("--rejected", choices=("present", "random", "export"), default="present",
                   help="the rejected answer: another one the image shows, any wrong one, or the exporter's")
    p.add_argument("--split", choices=("types", "all"), default="types",
                   help="types: SFT on three question types, DPO on the two others; all: both on every type")
    p.add_argument("--sft-run", default=None, help="an SFT run to start from (skips step 1)")
    learn(p.parse_args())
