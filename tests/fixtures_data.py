"""Generated user data for the tests: good LLaVA records from the shapes set, plus one or more
records of every bad kind mmpipe must count and leave out."""
from __future__ import annotations

import json
import random
from pathlib import Path
from typing import Callable

from PIL import Image

from mmpipe.data.export import export_shapes

HUGE_LIMIT = 10_000  # --max-image-pixels for the fuzz run: the 64x64 = 4096-pixel images pass, 200x200 does not


def conv(q: str, a: str, marker: bool = True) -> list[dict]:
    return [{"from": "human", "value": ("<image>\n" if marker else "") + q}, {"from": "gpt", "value": a}]


def write_fuzz_set(root: Path, n_good: int = 40) -> tuple[Path, dict[str, int], list[int]]:
    """A JSONL mixing n_good good records (2 of them text-only) with bad ones.
    Returns (path, injected counts by kind, the record numbers (0-based lines) of the good ones)."""
    data = export_shapes(root, "llava-jsonl", n_good - 2)
    lines = data.read_text().splitlines()
    img = root / "images"
    (img / "corrupt.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)) * 4)
    png = (img / "00000.png").read_bytes()
    (img / "truncated.png").write_bytes(png[: len(png) // 2])
    (img / "empty.png").write_bytes(b"")
    Image.new("RGB", (200, 200), (10, 20, 30)).save(img / "huge.png")
    bad_json = [
        ("corrupt_image", {"image": "images/corrupt.png", "conversations": conv("what shape is red", "circle")}),
        ("corrupt_image", {"image": "images/truncated.png", "conversations": conv("what shape is red", "circle")}),
        ("missing_image", {"image": "images/nowhere.png", "conversations": conv("what shape is red", "circle")}),
        ("empty_image", {"image": "images/empty.png", "conversations": conv("what shape is red", "circle")}),
        ("huge_image", {"image": "images/huge.png", "conversations": conv("what shape is red", "circle")}),
        ("missing_field", {"image": "images/00001.png"}),
        ("missing_field", {"image": "images/00001.png",
                           "conversations": [{"from": "human"}, {"from": "gpt", "value": "x"}]}),
        ("empty_answer", {"image": "images/00001.png", "conversations": conv("what shape is red", "  ")}),
        ("unknown_role", {"image": "images/00001.png", "conversations": [{"from": "robot", "value": "<image>\nhi"},
                                                                         {"from": "gpt", "value": "circle"}]}),
        ("bad_turns", {"image": "images/00001.png", "conversations": conv("what shape is red", "circle")[:1] * 2}),
        ("image_marker", {"image": "images/00001.png",
                          "conversations": conv("what shape is red", "circle", marker=False)}),
        ("image_marker", {"conversations": conv("what shape is red", "circle")}),
        ("too_long", {"image": "images/00001.png", "conversations": conv("what shape is red " * 30, "circle")}),
    ]
    text_only = [{"conversations": conv("how many shapes are there", "two", marker=False)},
                 {"conversations": conv("what shape is red", "circle", marker=False)}]
    out = [*lines, *(json.dumps(r) for r in text_only)]
    injected: dict[str, int] = {}
    raw_lines = []
    for kind, rec in bad_json:
        injected[kind] = injected.get(kind, 0) + 1
        raw_lines.append(json.dumps(rec).encode())
    raw_lines.append(b'{"image": "images/00002.png", "conversations": [')  # cut off mid-record
    injected["bad_json"] = 1
    raw_lines.append(json.dumps({"image": "images/00002.png",
                                 "conversations": conv("what shape is \xff", "circle")}).encode().replace(
        b"\\u00ff", b"\xff"))  # a raw 0xff byte: not UTF-8
    injected["bad_encoding"] = 1
    # interleave the bad lines among the good ones, so positions in the file vary
    body = [s.encode() for s in out]
    for k, b in enumerate(raw_lines):
        body.insert(3 * k + 1, b)
    path = root / "fuzz.jsonl"
    path.write_bytes(b"\n".join(body) + b"\n")
    bad = set(raw_lines)
    return path, injected, [i for i, b in enumerate(body) if b not in bad]


def mixed_image_records(n: int, n_images: int, words: list[str],
                        answer_len: Callable[[random.Random, int], int]) -> list[dict]:
    """n LLaVA conversations of 0 (text-only), 1, 2 or 3 images (distinct files of 0.png .. {n_images - 1}.png),
    record i's answer answer_len(rnd, i) words of `words` (the dynamic-resolution pipeline tests' sets)."""
    rnd = random.Random(0)
    recs = []
    for i in range(n):
        answer = " ".join(rnd.choice(words) for _ in range(answer_len(rnd, i)))
        k = (0, 1, 2, 1, 3, 1)[i % 6]
        if not k:
            recs.append({"conversations": conv("what colour is it", answer, marker=False)})
            continue
        images = [f"{j}.png" for j in rnd.sample(range(n_images), k)]
        question = "what colour is " + " and ".join(["<image>"] * k)
        recs.append({"image": images if k > 1 else images[0], "conversations": conv(question, answer, marker=False)})
    return recs
