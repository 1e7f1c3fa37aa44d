"""Padded against packed rows (`--pack`), side by side in one run, on a long-tailed LLaVA-format set.

    python scripts/bench_packing.py                                   # 3 repeats, ~4.5 min here
    python scripts/bench_packing.py --repeats 5 --out-json docs/benchmarks/packing.json   # docs/packing.md, ~7 min

The data set, generated into WORK/data/ (WORK = --work, default runs/bench_packing): --records (4096)
LLaVA conversations, each with one 64 px PNG drawn by the built-in shapes renderer (WORK/data/img/N.png):

    {"image": "img/N.png", "conversations": [{"from": "human", "value": "<image>\nQUESTION"},
                                             {"from": "gpt", "value": ANSWER}]}

QUESTION is the shapes question about that image (4-6 words). ANSWER has A words, A = clip(round(X), 1,
--max-answer 112) with X ~ lognormal(--mu 2.7, --sigma 0.8): the shapes answer, then "the <colour> <shape> is
in the <quarter>" for each shape in turn, cycled to A words. Every word is in the built-in tokenizer's
vocabulary (checked: no id is [UNK]), so one word is one token. The answer's mean is exp(mu + sigma^2 / 2)
= 20.5 words before clipping (20.1 generated, 21 of 4096 clipped at 112), under a fifth of the max. Each
record's text (BOS, "question:", QUESTION, ANSWER, EOS) is measured with mmpipe's own ConversationEncoder
through the built-in tokenizer: mean 27.9 tokens, p10 / p50 / p90 / p99 13 / 22 / 49 / 103, max 121, so
mean / max = 0.23. T, the --text-len of both variants, is that max (121).

The model: the `small` preset (moondream family, N = 16 image positions spliced after BOS) with
text.max_context raised to K x N + T = 185 so the packed row fits (WORK/model.json, given as --preset; the padded
row of N + T = 137 is within it, and the context is no weight: both variants train the same model).

Two variants at the same model, the same micro-batch x GAS (--micro 16 x --gas 4 = 64 rows per step, in
WORK/ds.json, made from ds_configs/cpu_fp32.json) and the same --text-len T:

    padded   --text-len T                        one sample per row of N + T = 137 positions
    packed   --pack --max-images K --text-len T   rows of L = K x N + T positions, several samples each

K, a packed row's image slots: an average sample takes one image slot and N + m positions (m: the mean text
length), and K of them fit in a row of K x N + T positions when K x m <= T: the image slots cancel, so
K = round(T / m) = round(121 / 27.9) = round(4.34) = 4, L = 4 x 16 + 121 = 185. Room for more samples would
need more slots, but every slot runs through the vision tower whether an image fills it or not (a blank
image), so K is kept at what the text room fills: the runs pack 3.73 samples into each 4-slot row.

Each run: `python -m mmpipe.cli train --preset WORK/model.json --data WORK/data/llava.json --text-len T
--stages 2 --steps S --eval-samples 0 --data-workers 0 --seed 0 --ds-config WORK/ds.json --output-dir
WORK/rR-VARIANT [--pack --max-images K]` (`--data-workers 0`: no loader processes competing with the two
ranks for the two cores), --steps 20 (the first is left out of the rates). --repeats times, with the order of
the two alternating every repeat (padded first in even repeats), so drift in the load of this shared machine
falls on both alike; compare ratios, not absolute numbers.

From each run's summary.json (median step time): samples/s, useful tokens/s (a sample's own text and image
positions, padding not counted), positions/s (decoder positions computed, padding included), the padding share
1 - useful / positions, the step time, samples per row; from its stage_timing: stage 0's image loading per step
and each stage's forward + backward per micro-batch. From train_log.csv, a second estimate that the machine's
other jobs disturb less: each run's fastest step. From mmpipe's cost model (the partitioner's): forward +
backward FLOPs per row of each layout, the tower counted once per image slot, to set the measured ratio
against (flop_model, limits).

Prints a markdown table (medians over repeats, each repeat's value in brackets; the ratio row pairs the two
runs of one repeat) and the cost-model comparison, and writes the data statistics and every run to
--out-json. Unknown flags go to every `mmpipe train`. Wall time here (2 shared vCPUs): 25-45 s per run (most
of it the launch and building the run's data index), 6 runs with the defaults.
"""
from __future__ import annotations

import argparse
import csv
import json
import os
import shlex
import shutil
import statistics
import subprocess
import sys
import time
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

VARIANTS = ("padded", "packed")


# ---------------------------------------------------------------------------------------- data set

def answer_words(sample, n: int) -> list[str]:
    """n words: the shapes answer, then a description of the image's shapes, cycled."""
    from mmpipe.data.shapes import QUARTERS
    words = sample.answer.split()
    desc = [w for s in sample.shapes for w in f"the {s.colour} {s.kind} is in the {QUARTERS[s.quarter]}".split()]
    while len(words) < n:
        words += desc
    return words[:n]


def make_data(data: Path, records: int, mu: float, sigma: float, max_answer: int, seed: int) -> Path:
    """WORK/data/llava.json + img/N.png; returns the JSON's path."""
    from mmpipe.data.shapes import ShapesVQA
    data.mkdir(parents=True, exist_ok=True)
    (data / "img").mkdir(exist_ok=True)
    vqa = ShapesVQA(64, 16, split="train", seed=seed)
    rng = np.random.default_rng(seed)
    lengths = np.clip(np.rint(rng.lognormal(mu, sigma, records)), 1, max_answer).astype(int)
    out = []
    for i, a in enumerate(lengths):
        s = vqa.sample(i)
        vqa.render(s).save(data / "img" / f"{i}.png")
        out.append({"id": str(i), "image": f"img/{i}.png", "conversations": [
            {"from": "human", "value": f"<image>\n{s.question}"},
            {"from": "gpt", "value": " ".join(answer_words(s, int(a)))}]})
    path = data / "llava.json"
    path.write_text(json.dumps(out))
    return path


def text_lengths(path: Path) -> np.ndarray:
    """Each record's text tokens (BOS, prompt, question, answer, EOS) as mmpipe encodes it for the moondream
    family (markers stripped, the image spliced after BOS), through the built-in tokenizer."""
    from mmpipe.data.text import ConversationEncoder
    from mmpipe.data.tokenizer import builtin_tokenizer
    tok = builtin_tokenizer()
    enc = ConversationEncoder(tok, text_len=10 ** 6, markers=False)
    roles = {"human": "user", "gpt": "assistant"}
    lengths = []
    for rec in json.loads(path.read_text()):
        e = enc.encode([(roles[t["from"]], t["value"]) for t in rec["conversations"]], 1)
        if (e.ids == tok.unk_token_id).any():
            raise SystemExit(f"record {rec['id']}: a word maps to [UNK]")
        lengths.append(len(e.ids))
    return np.array(lengths)


# ---------------------------------------------------------------------------------------- runs

def run_one(work: Path, name: str, variant: str, args, extra) -> dict:
    out = work / name
    cmd = [sys.executable, "-m", "mmpipe.cli", "train", "--preset", str(work / "model.json"),
           "--data", str(args.data), "--text-len", str(args.text_len),
           "--stages", "2", "--steps", str(args.steps), "--eval-samples", "0", "--data-workers", "0",
           "--seed", str(args.seed), "--ds-config", str(work / "ds.json"), "--output-dir", str(out),
           *(["--pack", "--max-images", str(args.k)] if variant == "packed" else []), *extra]
    shutil.rmtree(out, ignore_errors=True)  # never read an older invocation's summary.json
    failed_log = work / f"{name}.failed.log"  # a failure's whole output: the cause may be anywhere in it
    failed_log.unlink(missing_ok=True)
    t0 = time.perf_counter()
    proc = subprocess.run(cmd, cwd=ROOT, env=dict(os.environ, OMP_NUM_THREADS="1"), capture_output=True, text=True)
    wall = time.perf_counter() - t0
    if not (out / "summary.json").is_file():
        failed_log.write_text(f"$ {shlex.join(cmd)}\nexit status {proc.returncode}\n--- stdout\n{proc.stdout}\n"
                              f"--- stderr\n{proc.stderr}")
        raise SystemExit(f"{name} failed (exit status {proc.returncode}); its whole output: {failed_log}\n"
                         f"{proc.stdout[-3000:]}\n{proc.stderr[-3000:]}")
    s = json.loads((out / "summary.json").read_text())
    step_s, rows = s["step_time_s"], s["train_batch"]
    length = args.k * args.n_img + args.text_len if variant == "packed" else args.n_img + args.text_len
    res = {"name": name, "variant": variant, "wall_s": wall, "step_s": step_s, "rows_per_step": rows,
           "row_length": length, "steps": s["steps"], "final_loss": s["final_loss"], "parts": s.get("parts")}
    if s.get("useful_tokens_per_s") is None:
        raise SystemExit(f"{name}: summary.json has no useful_tokens_per_s (an mmpipe from before the packing "
                         f"rates); this benchmark needs them")
    data = s.get("data", {})
    stages = s.get("stage_timing", {}).get("per_stage", [])
    res.update(samples_per_s=s["samples_per_s"], useful_tokens_per_s=s["useful_tokens_per_s"],
               positions_per_s=s["positions_per_s"],
               # over the timed steps, as the rates: 1 - useful / computed positions
               padding_share=1 - s["useful_tokens_per_s"] / s["positions_per_s"],
               samples_per_row=s["samples_per_s"] * step_s / rows,
               load_ms=stages[0]["load_ms"] if stages else float("nan"),
               data={k: data.get(k) for k in ("samples_seen", "rows_seen", "useful_tokens", "positions",
                                              "padding_share")},
               fwd_bwd_ms_per_micro=[st["forward_ms_per_micro"] + st["backward_ms_per_micro"] for st in stages],
               idle=[st["idle_fraction"] for st in stages],
               load_ms_per_step=[st["load_ms"] for st in stages],  # stage 0: reading and decoding the images
               optimizer_ms_per_step=[st["step_ms"] for st in stages])
    # A second estimate, robust to the other jobs of a shared machine (as timeit's min): the fastest timed step
    # (train_log.csv: positions per step / positions_per_s; the first step left out), with the run's mean
    # samples and useful positions per step.
    with open(out / "train_log.csv") as f:
        log = list(csv.DictReader(f))[1:]
    best = min(rows * length / float(r["positions_per_s"]) for r in log)
    res.update(best_step_s=best, best_samples_per_s=res["samples_per_s"] * step_s / best,
               best_useful_tokens_per_s=res["useful_tokens_per_s"] * step_s / best)
    return res


def flop_model(args) -> dict:
    """mmpipe's cost model (mmpipe.planning.costmodel, the one the partitioner uses) per row, forward +
    backward: the vision side (patch embedding, ViT, projector) once per image slot, the decoder at the
    row's length (its attention over the whole L x L row: SDPA runs the full row under the per-sample mask)."""
    from mmpipe.config import load_preset
    from mmpipe.planning.partition import layer_table
    cfg = load_preset(str(args.work / "model.json"))
    out = {}
    for variant, slots, length in (("padded", 1, args.n_img + args.text_len),
                                   ("packed", args.k, args.k * args.n_img + args.text_len)):
        table = layer_table(cfg, (), length - args.n_img)  # decoder positions = N + text_len'
        per_layer = [(r.fwd_flops + r.bwd_flops) * (slots if r.group in ("vision", "projector") else 1) / 1e9
                     for r in table]
        vision = sum(f for f, r in zip(per_layer, table) if r.group in ("vision", "projector"))
        decoder = sum(per_layer) - vision
        out[variant] = {"vision_gflop_per_row": vision, "decoder_gflop_per_row": decoder,
                        "vision_share": vision / (vision + decoder), "layers": [r.name for r in table],
                        "gflop_per_layer": per_layer}
    return out


# ---------------------------------------------------------------------------------------- report

def fmt(v: float, digits: int) -> str:
    return f"{v:,.{digits}f}"


COLUMNS = [("samples_per_s", "samples/s", 1), ("useful_tokens_per_s", "useful tokens/s", 0),
           ("positions_per_s", "positions/s", 0), ("padding_share", "padding share", 3), ("step_s", "step s", 3),
           ("samples_per_row", "samples / row", 2), ("load_ms", "s0 load ms / step", 0)]


def table(results: list[dict]) -> str:
    """Medians over repeats, each repeat's value in brackets; the ratio row pairs the runs of one repeat."""
    med = statistics.median
    by = {v: [r for r in results if r["variant"] == v] for v in VARIANTS}
    pairs = list(zip(by["packed"], by["padded"]))  # the two runs of one repeat
    n_stages = len(by["packed"][0]["fwd_bwd_ms_per_micro"])
    lines = ["| variant | row positions | " + " | ".join(c[1] for c in COLUMNS) + " | fwd+bwd ms / micro (s0 / s1) |",
             "|---|---|" + "---|" * (len(COLUMNS) + 1)]
    for v in VARIANTS:
        cells = [f"{fmt(med(r[k] for r in by[v]), d)} ({', '.join(fmt(r[k], d) for r in by[v])})"
                 for k, _, d in COLUMNS]
        stages = [med(r["fwd_bwd_ms_per_micro"][i] for r in by[v]) for i in range(n_stages)]
        lines.append(f"| {v} | {by[v][0]['row_length']} | " + " | ".join(cells) + " | "
                     + " / ".join(f"{x:.0f}" for x in stages) + " |")
    ratios = []
    for k, _, _ in COLUMNS:
        per = [p[k] / q[k] for p, q in pairs]
        ratios.append(f"**{med(per):.2f}** ({', '.join(f'{x:.2f}' for x in per)})")
    stages = [med(p["fwd_bwd_ms_per_micro"][i] / q["fwd_bwd_ms_per_micro"][i] for p, q in pairs)
              for i in range(n_stages)]
    lines.append("| packed / padded | | " + " | ".join(ratios) + " | " + " / ".join(f"{x:.2f}" for x in stages) + " |")
    q = [p["best_useful_tokens_per_s"] / r["best_useful_tokens_per_s"] for p, r in pairs]
    best = {v: [r["best_step_s"] for r in by[v]] for v in VARIANTS}
    lines.append(f"\nFastest step of each run (robust to the machine's other load): packed / padded useful tokens/s "
                 f"**{med(q):.2f}** ({', '.join(f'{x:.2f}' for x in q)}); step s "
                 + ", ".join(f"{v} {med(t):.3f} ({', '.join(f'{x:.3f}' for x in t)})" for v, t in best.items()))
    return "\n".join(lines)


def limits(results: list[dict], flops: dict, args) -> dict:
    """Where the gain goes: samples per row against what a row costs, measured and by the cost model."""
    med = statistics.median
    by = {v: [r for r in results if r["variant"] == v] for v in VARIANTS}
    s = med(r["samples_per_row"] for r in by["packed"])
    pad, pk = flops["padded"], flops["packed"]
    cost = {v: f["vision_gflop_per_row"] + f["decoder_gflop_per_row"] for v, f in flops.items()}
    pairs = list(zip(by["packed"], by["padded"]))
    step_ratio = med(p["step_s"] / q["step_s"] for p, q in pairs)
    return {
        "samples_per_packed_row": s, "image_slots": args.k, "blank_slot_share": 1 - s / args.k,
        "positions_per_sample": {"padded": args.n_img + args.text_len,
                                 "packed": (args.k * args.n_img + args.text_len) / s},
        "row_cost_ratio_measured": step_ratio,
        "row_cost_ratio_flops": cost["packed"] / cost["padded"],
        "vision_share_flops": {"padded": pad["vision_share"], "packed": pk["vision_share"]},
        "samples_gain_measured": med(p["samples_per_s"] / q["samples_per_s"] for p, q in pairs),
        "samples_gain_measured_best_step": med(p["best_samples_per_s"] / q["best_samples_per_s"] for p, q in pairs),
        "row_cost_ratio_measured_best_step": med(p["best_step_s"] / q["best_step_s"] for p, q in pairs),
        "samples_gain_flops": s * cost["padded"] / cost["packed"],
        # the same rows if the vision side cost nothing / if only used slots ran the tower
        "samples_gain_flops_free_vision": s * cost["padded"] / pk["decoder_gflop_per_row"],
        # per stage, at the runs' own partition: the stage holding the tower grows most
        "stage_gflop_per_row": {v: [sum(flops[v]["gflop_per_layer"][a:b]) for a, b in
                                    zip(by[v][0]["parts"], by[v][0]["parts"][1:])] for v in VARIANTS},
        "stage_fwd_bwd_ratio_measured": [med(p["fwd_bwd_ms_per_micro"][i] / q["fwd_bwd_ms_per_micro"][i]
                                             for p, q in pairs) for i in range(len(pairs[0][0]["parts"]) - 1)],
        # a pipeline step follows its slower stage
        "samples_gain_flops_slowest_stage": s * max(sum(flops["padded"]["gflop_per_layer"][a:b]) for a, b in
                                                    zip(by["padded"][0]["parts"], by["padded"][0]["parts"][1:]))
        / max(sum(flops["packed"]["gflop_per_layer"][a:b]) for a, b in
              zip(by["packed"][0]["parts"], by["packed"][0]["parts"][1:])),
        "samples_gain_flops_no_blank_slots": s * cost["padded"] / (pk["decoder_gflop_per_row"]
                                                                  + pk["vision_gflop_per_row"] * s / args.k),
    }


def main() -> None:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    p.add_argument("--records", type=int, default=4096)
    p.add_argument("--mu", type=float, default=2.7, help="lognormal answer length (words): mean of its log")
    p.add_argument("--sigma", type=float, default=0.8, help="lognormal answer length (words): sd of its log")
    p.add_argument("--max-answer", type=int, default=112, help="answer words are clipped to [1, this]")
    p.add_argument("--max-images", type=int, default=0, dest="k", help="K, the packed rows' image slots "
                   "(default 0: round(T / mean text length))")
    p.add_argument("--micro", type=int, default=16, help="rows per micro-batch")
    p.add_argument("--gas", type=int, default=4, help="micro-batches per step")
    p.add_argument("--steps", type=int, default=20)
    p.add_argument("--repeats", type=int, default=3)
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--work", default="runs/bench_packing")
    p.add_argument("--out-json", default="runs/bench_packing.json")
    args, extra = p.parse_known_args()
    work = args.work = ROOT / args.work
    work.mkdir(parents=True, exist_ok=True)

    path = args.data = make_data(work / "data", args.records, args.mu, args.sigma, args.max_answer, args.seed)
    lengths = text_lengths(path)
    args.text_len = int(lengths.max())
    model = json.loads((ROOT / "mmpipe" / "presets" / "small.json").read_text())
    v = model["vision"]
    args.n_img = (v["image_size"] // v["patch_size"]) ** 2
    mean = float(lengths.mean())
    args.k = args.k or max(1, round(args.text_len / mean))
    # the context holds the packed row, K x N + T (a row must fit it, mmpipe.data.dataset.row_text_len); the padded
    # row, N + T, is within it. The context is no weight (rotary positions restart at every sample): the same model
    model["text"]["max_context"] = args.k * args.n_img + args.text_len
    model["_comment"] = (f"small with text.max_context {args.k} x {args.n_img} + {args.text_len} "
                         f"(scripts/bench_packing.py)")
    (work / "model.json").write_text(json.dumps(model, indent=1))
    ds = json.loads((ROOT / "ds_configs" / "cpu_fp32.json").read_text())
    ds.update(train_micro_batch_size_per_gpu=args.micro, gradient_accumulation_steps=args.gas)
    (work / "ds.json").write_text(json.dumps(ds, indent=1))
    pct = {q: float(np.percentile(lengths, q)) for q in (10, 50, 90, 99)}
    data = {"records": args.records, "mu": args.mu, "sigma": args.sigma, "max_answer_words": args.max_answer,
            "text_tokens": {"mean": mean, "min": int(lengths.min()), **{f"p{q}": v for q, v in pct.items()},
                            "max": int(lengths.max())},
            "mean_over_max": mean / lengths.max(), "text_len": args.text_len, "image_positions": args.n_img,
            "max_images": args.k, "padded_row": args.n_img + args.text_len,
            "packed_row": args.k * args.n_img + args.text_len, "micro": args.micro, "gas": args.gas,
            "steps": args.steps, "extra_flags": extra}
    print(f"data: {args.records} records, answer words lognormal(mu {args.mu}, sigma {args.sigma}) clipped to "
          f"[1, {args.max_answer}]; text tokens mean {mean:.1f}, p10/p50/p90/p99 "
          f"{'/'.join(f'{v:.0f}' for v in pct.values())}, max {lengths.max()} (mean/max {mean / lengths.max():.3f}); "
          f"T = {args.text_len}, K = {args.k}: rows {args.n_img + args.text_len} padded, "
          f"{args.k * args.n_img + args.text_len} packed", flush=True)

    results = []
    for r in range(args.repeats):
        for variant in (VARIANTS if r % 2 == 0 else VARIANTS[::-1]):
            res = run_one(work, f"r{r}-{variant}", variant, args, extra)
            res["repeat"] = r
            results.append(res)
            print(f"r{r}-{variant}: {res['samples_per_s']:.1f} samples/s, {res['useful_tokens_per_s']:.0f} useful "
                  f"tokens/s, padding {res['padding_share']:.3f}, step {res['step_s']:.3f} s, "
                  f"wall {res['wall_s']:.0f} s", flush=True)
    flops = flop_model(args)
    lim = limits(results, flops, args)
    out = ROOT / args.out_json
    out.parent.mkdir(parents=True, exist_ok=True)
    out.write_text(json.dumps({"data": data, "flops": flops, "limits": lim, "runs": results}, indent=1, default=str))
    print(table(results))
    print(json.dumps({"flops": flops, "limits": lim}, indent=1))


if __name__ == "__main__":
    main()
