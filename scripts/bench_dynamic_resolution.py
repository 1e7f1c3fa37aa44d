"""Native dynamic resolution with packed patches against every image resized to the largest size: the Qwen2-VL
family, side by side in one process, on a generated set of mixed image sizes (docs/dynamic_resolution.md).

    python scripts/bench_dynamic_resolution.py            # the docs' table: 192 samples, 5 repeats, ~5 min
    python scripts/bench_dynamic_resolution.py --quick    # 24 samples, 2 repeats: a smoke run, under a minute

The set (WORK = --work, default runs/bench_dynamic_resolution): --records LLaVA records, each one shapes image
(mmpipe.data.shapes, drawn at 448 px, resized to its size) and its shapes question and answer. Each record's
image size is drawn (numpy default_rng(--seed)) from SIZES below, a long-tailed mix of 56x56 .. 448x336 px,
every side a multiple of 28 so that the image processor keeps it exactly (grid = height / 14 x width / 14).
The same records exist twice, with their images at two sizes:

    native   WORK/native.jsonl    each image at its own size: its own grid, 16 .. 768 patches
    resized  WORK/resized.jsonl   each image resized (PIL bicubic) to the set's largest size, so every image
                                  has the largest grid (448x336: 24 x 32 = 768 patches, 192 decoder tokens)

Both go through mmpipe's own data path: resolve_data / prepare (the checked index, each grid by transformers'
Qwen2VLImageProcessor rule), packed rows (RowPlan first-fit over positions, image slots and patches; RowSet;
rank_batches: pixels [B, P, 1176], input_ids, has_image, segments, tiling). Both ways' rows have the same patch
budget P = --budget x the largest image's patches (default 1: P = 768, which is also mmpipe's default
--max-patches for one image slot at this model's max_pixels), and each way its own image slots and text room:
M = round(P / the way's mean patches per image) slots (native: 768 / 141 -> 5; resized: 1, so its rows are the
classic one image per row) and --text-len M x the set's longest text (so text never binds: patches and slots
do). The stream holds the same samples in the same order both ways (checked), and a way's rows hold each of the
--records samples once (one packing chunk).

The model: qwen-tiny's layers and widths with vision.max_pixels raised to 448 x 336 (qwen-tiny's 112 x 112
would resize every image of the set to at most 64 patches: no mix left), image_size 364 (the largest
square under it) and text.max_context 1024 (rows of up to 2M + P / 4 + text_len positions); bench_model()
below. ReferenceModel (the single-device model, the pipeline's layer list in one process), --seed, fp32.

One pass of a way = forward + backward (lm_loss on the answer tokens; no optimizer step, so the weights stay
the same) of every micro-batch (--micro rows) of its rows, the batches built beforehand (their image decoding
is timed once, apart). A warm-up pass of one micro-batch each, then --repeats repeats of both ways,
interleaved, the order alternating (native first in even repeats) so the machine's drift falls on both.
torch.set_num_threads(1): one measuring thread (the machine's two cores are shared).

Per way: vision patches computed per sample (rows x P / samples, padding included; the images' own in
brackets), decoder positions computed per sample (rows x L / samples; the samples' own), wall seconds per pass,
process CPU ms per row (what a row costs: wall time on a shared machine includes other jobs' turns), samples/s
and useful tokens/s (the samples' text tokens: BOS, question, answer, EOS, no image token; the same samples both
ways, so its ratio is the samples/s one) and samples per CPU second, each the median over repeats with the
min-max range; the native / resized ratio per repeat (the two passes of one repeat). Prints a markdown table and
writes everything to WORK/results.json.
"""
from __future__ import annotations

import argparse
import dataclasses
import json
import statistics
import sys
import time
from pathlib import Path

import numpy as np
import torch

ROOT = Path(__file__).resolve().parent.parent
sys.path.insert(0, str(ROOT))

WAYS = ("native", "resized")
# (width, height, weight in %): a long tail of small images, a few large ones; the grid (h x w patches of 14 px)
SIZES = ((56, 56, 20), (84, 56, 15), (112, 84, 15), (84, 112, 10), (168, 112, 15),  # 4x4, 4x6, 6x8, 8x6, 8x12
         (224, 168, 8), (168, 224, 7), (336, 252, 6), (448, 336, 4))               # 12x16, 16x12, 18x24, 24x32


def bench_model():
    """qwen-tiny with the set's pixel bounds (module docstring)."""
    from mmpipe.config import load_preset
    cfg = load_preset("qwen-tiny")
    largest = max(w * h for w, h, _ in SIZES)
    return dataclasses.replace(cfg, name="qwen-tiny-448", vision=dataclasses.replace(
        cfg.vision, max_pixels=largest, image_size=364), text=dataclasses.replace(cfg.text, max_context=1024))


# ---------------------------------------------------------------------------------------- data set

def draw_sizes(n: int, seed: int) -> list[tuple[int, int]]:
    weights = np.array([w for *_, w in SIZES], dtype=float)
    picks = np.random.default_rng(seed).choice(len(SIZES), size=n, p=weights / weights.sum())
    return [SIZES[i][:2] for i in picks]


def make_data(work: Path, n: int, seed: int) -> tuple[dict, list, tuple[int, int]]:
    """WORK/{native,resized}.jsonl and their images; -> ({way: path}, sizes, the largest size)."""
    from PIL import Image

    from mmpipe.data.shapes import ShapesVQA
    vqa = ShapesVQA(448, 16, split="train", seed=seed)
    sizes = draw_sizes(n, seed)
    largest = max(sizes, key=lambda s: s[0] * s[1])
    records = {way: [] for way in WAYS}
    for way in WAYS:
        (work / "img" / way).mkdir(parents=True, exist_ok=True)
    for i, size in enumerate(sizes):
        s = vqa.sample(i)
        image = vqa.render(s).resize(size, Image.BICUBIC)
        for way, im in (("native", image), ("resized", image.resize(largest, Image.BICUBIC))):
            im.save(work / "img" / way / f"{i}.png")
            records[way].append({"id": str(i), "image": f"img/{way}/{i}.png", "conversations": [
                {"from": "human", "value": f"<image>\n{s.question}"}, {"from": "gpt", "value": s.answer}]})
    paths = {}
    for way, recs in records.items():
        paths[way] = work / f"{way}.jsonl"
        paths[way].write_text("".join(json.dumps(r) + "\n" for r in recs))
    return paths, sizes, largest


def text_positions(path: Path, cfg) -> list[int]:
    """Each record's text tokens as the family encodes them (built-in tokenizer, markers kept)."""
    from mmpipe.data.text import ConversationEncoder
    from mmpipe.data.tokenizer import builtin_tokenizer
    encoder = ConversationEncoder(builtin_tokenizer(image_token=True), 10 ** 6, markers=True)
    roles = {"human": "user", "gpt": "assistant"}
    out = []
    for line in path.read_text().splitlines():
        rec = json.loads(line)
        out.append(len(encoder.encode([(roles[t["from"]], t["value"]) for t in rec["conversations"]], 1).ids))
    return out


def row_flags(cfg, sizes, largest, texts, budget_images: int) -> dict:
    """{way: (M, text_len, P)}: the same patch budget P = budget_images x the largest grid's patches (1: mmpipe's
    default --max-patches for one image slot); M = round(P / the way's mean patches per image) slots; text_len =
    M x the longest text."""
    from mmpipe.data.patches import patch_rule
    rule = patch_rule(cfg, 1 << 20)
    patches = {"native": [int(np.prod(rule.grid(w, h))) for w, h in sizes],
               "resized": [int(np.prod(rule.grid(*largest)))] * len(sizes)}
    budget = budget_images * max(patches["resized"])
    out = {}
    for way, p in patches.items():
        slots = max(1, round(budget / statistics.mean(p)))
        out[way] = (slots, slots * max(texts), budget)
    return out


# ---------------------------------------------------------------------------------------- rows

def build_rows(cfg, path: Path, work: Path, flags: tuple, n: int, micro: int, seed: int) -> dict:
    """One way's rows of the n samples through mmpipe's data path, and their micro-batches."""
    from mmpipe.data.args import DataArgs
    from mmpipe.data.batches import rank_batches
    from mmpipe.data.dataset import prepare, resolve_data
    from mmpipe.data.packing import RowPlan, RowSet, row_shape, sample_size
    slots, text_len, budget = flags
    opts = resolve_data(DataArgs(data=str(path), text_len=text_len, max_images=slots, max_patches=budget, pack=True,
                                 data_workers=0), cfg)
    samples = prepare(opts, cfg, work / f"index_{path.stem}", seed=seed, verbose=False)
    if len(samples.index) != n:
        raise SystemExit(f"{path}: {len(samples.index)} good records of {n}; see {work}/index_{path.stem}/data/")
    shape = row_shape(cfg, opts.max_images, opts.text_len, opts.vision_budget)
    size = sample_size(samples, shape)
    plan = RowPlan(size, shape, pack=True, chunk=n)  # one chunk: the rows hold the n samples, each once
    rows = next(r for r in range(n + 1) if plan.samples_before(r) == n)
    t0 = time.perf_counter()
    batches = list(rank_batches(RowSet(samples, plan),
                                [list(range(r, min(r + micro, rows))) for r in range(0, rows, micro)]))
    load_s = time.perf_counter() - t0
    encs = [samples.tokens(pos)[0] for pos in range(n)]
    return {"batches": batches, "rows": rows, "row_positions": shape.length, "max_images": shape.max_images,
            "text_len": shape.text_len, "max_patches": opts.vision_budget, "load_s": load_s,
            "samples": [samples.row(pos) for pos in range(n)],
            "own_patches": sum(size(pos)[2] for pos in range(n)),
            "own_positions": sum(size(pos)[0] for pos in range(n)),
            "text_tokens": sum(len(e.ids) for e in encs), "answer_tokens": int(sum(e.target[1:].sum() for e in encs))}


# ---------------------------------------------------------------------------------------- measuring

def one_pass(model, batches) -> tuple[float, float]:
    """(wall s, process CPU s) of forward + backward over the batches."""
    from mmpipe.model.builder import lm_loss
    t0, c0 = time.perf_counter(), time.process_time()
    for inputs, labels in batches:
        model.zero_grad(set_to_none=True)
        lm_loss(model(*inputs), labels).backward()
    return time.perf_counter() - t0, time.process_time() - c0


def measure(model, ways: dict, repeats: int) -> dict:
    """{way: [(wall, cpu) per repeat]}: interleaved, the order alternating every repeat."""
    for way in WAYS:
        one_pass(model, ways[way]["batches"][:1])  # warm-up
    times = {way: [] for way in WAYS}
    for r in range(repeats):
        for way in (WAYS if r % 2 == 0 else WAYS[::-1]):
            times[way].append(one_pass(model, ways[way]["batches"]))
            print(f"repeat {r} {way}: {times[way][-1][0]:.2f} s", flush=True)
    return times


# ---------------------------------------------------------------------------------------- report

def spread(values: list[float], digits: int) -> str:
    """median [min-max]"""
    return f"{statistics.median(values):,.{digits}f} [{min(values):,.{digits}f}-{max(values):,.{digits}f}]"


def summarise(ways: dict, times: dict, n: int) -> dict:
    out = {}
    for way, w in ways.items():
        wall = [t for t, _ in times[way]]
        cpu = [c for _, c in times[way]]
        out[way] = {"rows": w["rows"], "samples_per_row": n / w["rows"], "row_positions": w["row_positions"],
                    "max_images": w["max_images"], "text_len": w["text_len"], "max_patches": w["max_patches"],
                    "patches_per_sample": w["rows"] * w["max_patches"] / n, "own_patches_per_sample":
                    w["own_patches"] / n, "positions_per_sample": w["rows"] * w["row_positions"] / n,
                    "own_positions_per_sample": w["own_positions"] / n, "text_tokens_per_sample": w["text_tokens"] / n,
                    "pass_s": wall, "cpu_s": cpu, "samples_per_s": [n / t for t in wall],
                    "useful_tokens_per_s": [w["text_tokens"] / t for t in wall],
                    "samples_per_cpu_s": [n / c for c in cpu], "load_s": w["load_s"],
                    "cpu_ms_per_row": 1e3 * statistics.median(cpu) / w["rows"]}
    a, b = out["native"], out["resized"]
    out["ratio"] = {k: [x / y for x, y in zip(a[k], b[k])] for k in
                    ("samples_per_s", "useful_tokens_per_s", "samples_per_cpu_s")}
    out["ratio"].update({k: a[k] / b[k] for k in ("patches_per_sample", "own_patches_per_sample",
                                                  "positions_per_sample", "own_positions_per_sample",
                                                  "samples_per_row", "cpu_ms_per_row")})
    return out


def table(s: dict, n: int) -> str:
    head = ("| way | row: M slots, P patches, L positions | rows for the samples | samples / row | vision patches / "
            "sample (own) | decoder positions / sample (own) | s / pass | CPU ms / row | samples/s | useful tokens/s | "
            "samples / CPU s |")
    lines = [head, "|---" * 11 + "|"]
    for way in WAYS:
        w = s[way]
        lines.append(f"| {way} | {w['max_images']}, {w['max_patches']}, {w['row_positions']} | {w['rows']} | "
                     f"{w['samples_per_row']:.2f} | {w['patches_per_sample']:.0f} ({w['own_patches_per_sample']:.0f}) "
                     f"| {w['positions_per_sample']:.0f} ({w['own_positions_per_sample']:.0f}) | "
                     f"{spread(w['pass_s'], 2)} | {w['cpu_ms_per_row']:.0f} | "
                     f"{spread(w['samples_per_s'], 1)} | "
                     f"{spread(w['useful_tokens_per_s'], 0)} | {spread(w['samples_per_cpu_s'], 1)} |")
    r = s["ratio"]
    lines.append(f"| **native / resized** | | | {r['samples_per_row']:.2f} | {r['patches_per_sample']:.2f} "
                 f"({r['own_patches_per_sample']:.2f}) | {r['positions_per_sample']:.2f} "
                 f"({r['own_positions_per_sample']:.2f}) | | {r['cpu_ms_per_row']:.2f} | "
                 f"**{spread(r['samples_per_s'], 2)}** | "
                 f"**{spread(r['useful_tokens_per_s'], 2)}** | {spread(r['samples_per_cpu_s'], 2)} |")
    per = ", ".join(f"{x:.2f}" for x in r["samples_per_s"])
    return "\n".join(lines) + f"\n\n{n} samples; native / resized samples/s per repeat: {per}"


def main(argv=None) -> dict:
    p = argparse.ArgumentParser(description=__doc__.split("\n")[0], formatter_class=argparse.RawTextHelpFormatter)
    p.add_argument("--records", type=int, default=192, help="samples in the set (default 192)")
    p.add_argument("--repeats", type=int, default=5, help="passes of each way, interleaved (default 5)")
    p.add_argument("--micro", type=int, default=2, help="rows per forward + backward (default 2)")
    p.add_argument("--budget", type=int, default=1, help="the rows' patch budget P in images of the largest size "
                   "(default 1: P = 768, one resized image a row)")
    p.add_argument("--seed", type=int, default=0, help="the set's sizes and shapes, the stream order, the weights")
    p.add_argument("--work", type=Path, default=ROOT / "runs" / "bench_dynamic_resolution")
    p.add_argument("--quick", action="store_true", help="--records 24 --repeats 2: a smoke run")
    args = p.parse_args(argv)
    if args.quick:
        args.records, args.repeats = 24, 2
    if min(args.records, args.repeats, args.micro, args.budget) < 1:
        p.error("--records, --repeats, --micro and --budget must be >= 1")
    torch.set_num_threads(1)
    from mmpipe.model.builder import ReferenceModel
    cfg = bench_model()
    paths, sizes, largest = make_data(args.work, args.records, args.seed)
    flags = row_flags(cfg, sizes, largest, text_positions(paths["native"], cfg), args.budget)
    ways = {way: build_rows(cfg, paths[way], args.work, flags[way], args.records, args.micro, args.seed)
            for way in WAYS}
    if ways["native"]["samples"] != ways["resized"]["samples"]:
        raise SystemExit("the two ways' streams hold different samples")
    times = measure(ReferenceModel(cfg, seed=args.seed), ways, args.repeats)
    s = summarise(ways, times, args.records)
    s["set"] = {"records": args.records, "seed": args.seed, "budget": args.budget, "largest": largest,
                "micro": args.micro, "threads": torch.get_num_threads(),
                "sizes": {f"{w}x{h}": sizes.count((w, h)) for w, h, _ in SIZES}}
    print(table(s, args.records))
    (args.work / "results.json").write_text(json.dumps(s, indent=1))
    return s


if __name__ == "__main__":
    main()
