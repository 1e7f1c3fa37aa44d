"""Write the built-in shapes set to disk in the user-data formats: example files for docs/data.md,
fixtures for the tests, and a real multimodal set the built-in tokenizer covers word for word.

    mmpipe export-shapes --format llava-jsonl --n 500 --out data/shapes_llava

llava-jsonl / llava-json: every record has its image and 1 question; every even record a second
turn asking the count (a multi-turn conversation). pairs-csv / pairs-jsonl: a caption listing the
shapes ("red circle blue square"). parquet / hf-disk: the LLaVA records as a `datasets` Dataset with
the image column holding PNG bytes (datasets.Image). dpo-jsonl: preference pairs in TRL's format (prompt, chosen:
the right answer, rejected: a wrong one of the same kind, images) for --objective dpo (docs/dpo.md).
"""
from __future__ import annotations

import argparse
import csv
import json
import random
from pathlib import Path

from .shapes import COLOURS, COUNTS, QUARTERS, SHAPES, ShapesVQA

FORMATS = ("llava-jsonl", "llava-json", "pairs-csv", "pairs-jsonl", "parquet", "hf-disk")  # supervised records
PREFERENCE_FORMATS = ("dpo-jsonl",)  # preference pairs, read by --objective dpo alone
ANSWERS = {"count": COUNTS, "colour_of_shape": list(COLOURS), "shape_of_colour": SHAPES, "where_is_shape": QUARTERS,
           "colour_at_quarter": list(COLOURS)}  # a question type's possible answers: a wrong one is drawn from them


def preference_record(data: ShapesVQA, i: int, image: str) -> dict:
    """TRL's VLM preference record: the right answer chosen, another answer of its question type rejected."""
    s = data.sample(i)
    answers = ANSWERS[s.qtype]
    # the wrong answer a seeded draw among the others, not one tied to i: the sample's question type cycles with i,
    # so an offset of i % (n - 1) was the same for every record of a type (colour_at_quarter's always the colour
    # before the right one in COLOURS), an order a model scores 5 pairs of 6 by without the image (docs/dpo.md)
    offset = random.Random(i).randrange(1, len(answers))
    wrong = answers[(answers.index(s.answer) + offset) % len(answers)]
    return {"prompt": f"<image>\n{s.question}", "chosen": s.answer, "rejected": wrong, "images": [image]}


def llava_record(data: ShapesVQA, i: int, image: str) -> dict:
    s = data.sample(i)
    conv = [{"from": "human", "value": f"<image>\n{s.question}"}, {"from": "gpt", "value": s.answer}]
    if i % 2 == 0 and s.qtype != "count":
        conv += [{"from": "human", "value": "how many shapes are there"},
                 {"from": "gpt", "value": COUNTS[len(s.shapes) - 1]}]
    return {"id": f"shapes-{i}", "type": s.qtype, "image": image, "conversations": conv}  # type: its first question's


def caption(data: ShapesVQA, i: int) -> str:
    return " ".join(f"{s.colour} {s.kind}" for s in sorted(data.sample(i).shapes, key=lambda s: s.quarter))


def export_shapes(out: str | Path, fmt: str, n: int, *, seed: int = 0, image_size: int = 64, patch: int = 16) -> Path:
    """Writes the set under `out` (images/ + one data file) and returns the data file or dataset dir."""
    if fmt not in FORMATS + PREFERENCE_FORMATS:
        raise ValueError(f"format {fmt!r} is not one of {', '.join(FORMATS + PREFERENCE_FORMATS)}")
    out = Path(out)
    (out / "images").mkdir(parents=True, exist_ok=True)
    data = ShapesVQA(image_size, patch, "train", seed)
    names = []
    for i in range(n):
        name = f"images/{i:05d}.png"
        data.render(data.sample(i)).save(out / name)
        names.append(name)
    if fmt.startswith("llava"):
        records = [llava_record(data, i, names[i]) for i in range(n)]
        if fmt == "llava-json":
            path = out / "train.json"
            path.write_text(json.dumps(records, indent=1))
        else:
            path = out / "train.jsonl"
            path.write_text("".join(json.dumps(r) + "\n" for r in records))
    elif fmt == "dpo-jsonl":
        path = out / "train.jsonl"
        path.write_text("".join(json.dumps(preference_record(data, i, names[i])) + "\n" for i in range(n)))
    elif fmt == "pairs-csv":
        path = out / "pairs.csv"
        with open(path, "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["image", "text"])
            w.writerows([names[i], caption(data, i)] for i in range(n))
    elif fmt == "pairs-jsonl":
        path = out / "pairs.jsonl"
        path.write_text("".join(json.dumps({"image": names[i], "text": caption(data, i)}) + "\n" for i in range(n)))
    else:
        import datasets
        rows = [llava_record(data, i, names[i]) for i in range(n)]
        # the PNG bytes live in the dataset itself, as in hub datasets
        images = [{"bytes": (out / r["image"]).read_bytes(), "path": None} for r in rows]
        ds = datasets.Dataset.from_dict({"image": images, "conversations": [r["conversations"] for r in rows]})
        ds = ds.cast_column("image", datasets.Image())
        if fmt == "parquet":
            path = out / "train.parquet"
            ds.to_parquet(str(path))
        else:
            path = out / "dataset"
            ds.save_to_disk(str(path))
    return path


def add_export_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("--format", default="llava-jsonl", choices=FORMATS + PREFERENCE_FORMATS)
    p.add_argument("--n", type=int, default=500, help="records (default: 500)")
    p.add_argument("--out", required=True, help="output folder (images/ and the data file go here)")
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--image-size", type=int, default=64, help="pixels (default: 64, the small preset's)")
    p.add_argument("--patch", type=int, default=16, help="shape cell size (default: 16, the small preset's patch)")
