"""The built-in synthetic VQA set: coloured shapes on a grid, questions only the image can answer.

Each image holds 1-4 shapes, each of a different kind, a different colour and in a different
quarter of the image. Every shape is centred in one cell of the patch grid (64 px / patch 16 ->
4 x 4 cells, 14 px shapes), so one image token sees one whole shape: "which shape has which
colour" is local to a token, and "where" is carried by the learned position embedding.
Five question types, drawn in turn (index % 5), so an eval split of 5k samples has k of each:

    count              how many shapes are there         -> one | two | three | four         (chance 1/4)
    colour_of_shape    what colour is the <shape>        -> <colour>                         (chance 1/6)
    shape_of_colour    what shape is <colour>            -> <shape>                          (chance 1/5)
    where_is_shape     where is the <shape>              -> top-left | top-right | ...       (chance 1/4)
    colour_at_quarter  what colour is in the <quarter>   -> <colour>                         (chance 1/6)

Each question ends on the word that names what to look up, and the answer follows it directly
(prompt format in mmpipe.data.tokenizer): see docs/shapes.md for why there is no "answer:"
separator between them.

Blind guessing (the best answer per question without the image) scores ~21% overall.
Sample (split, index) is a pure function of (seed, split, index): deterministic, any order,
any rank; the "eval" split is drawn from its own stream and is held out from training.
"""
from __future__ import annotations

import random
from dataclasses import dataclass

from PIL import Image, ImageDraw

# Every colour has the same channel sum (R + G + B = 420): a shape is then the same
# brightness pattern whatever its colour, so "which shape" and "which colour" are separate
# features of a patch, and the model's work is binding them, not untangling them.
COLOURS = {"red": (250, 85, 85), "green": (70, 250, 100), "blue": (80, 100, 240),
           "yellow": (210, 210, 0), "magenta": (210, 0, 210), "cyan": (0, 200, 220)}
SHAPES = ["circle", "square", "triangle", "cross", "diamond"]
QUARTERS = ["top-left", "top-right", "bottom-left", "bottom-right"]
COUNTS = ["one", "two", "three", "four"]
QUESTION_TYPES = ["count", "colour_of_shape", "shape_of_colour", "where_is_shape", "colour_at_quarter"]
BACKGROUND = (25, 25, 25)
OUTLINE = (255, 255, 255)
VOCABULARY = sorted({w for phrase in (
    "how many shapes are there", "what colour is the", "what shape is", "where is the", "in the",
    *COLOURS, *SHAPES, *QUARTERS, *COUNTS) for w in phrase.split()})


@dataclass(frozen=True)
class Shape:
    kind: str
    colour: str
    quarter: int
    box: tuple[int, int, int, int]  # x0, y0, x1, y1 in pixels


@dataclass(frozen=True)
class Sample:
    shapes: tuple[Shape, ...]
    qtype: str
    question: str
    answer: str


class ShapesVQA:
    """Index -> Sample, and Sample -> PIL image. `image_size` and `patch` come from the vision config."""

    def __init__(self, image_size: int, patch: int, split: str = "train", seed: int = 0):
        grid = image_size // patch
        if image_size % patch or grid % 2:
            raise ValueError(f"shapes task needs an even patch grid, got {image_size} px / patch {patch}")
        self.image_size, self.patch, self.grid = image_size, patch, grid
        self.split, self.seed = split, seed

    def sample(self, index: int) -> Sample:
        rng = random.Random(f"{self.seed}/{self.split}/{index}")  # string seeds hash stably (sha512)
        n = rng.randint(1, 4)
        kinds, colours, quarters = rng.sample(SHAPES, n), rng.sample(list(COLOURS), n), rng.sample(range(4), n)
        shapes = tuple(Shape(k, c, q, self._box(rng, q)) for k, c, q in zip(kinds, colours, quarters))
        qtype = QUESTION_TYPES[index % len(QUESTION_TYPES)]
        s = rng.choice(shapes)
        question, answer = {
            "count": ("how many shapes are there", COUNTS[n - 1]),
            "colour_of_shape": (f"what colour is the {s.kind}", s.colour),
            "shape_of_colour": (f"what shape is {s.colour}", s.kind),
            "where_is_shape": (f"where is the {s.kind}", QUARTERS[s.quarter]),
            "colour_at_quarter": (f"what colour is in the {QUARTERS[s.quarter]}", s.colour),
        }[qtype]
        return Sample(shapes, qtype, question, answer)

    def _box(self, rng: random.Random, quarter: int) -> tuple[int, int, int, int]:
        half, p = self.grid // 2, self.patch
        row = rng.randrange(half) + (half if quarter >= 2 else 0)
        col = rng.randrange(half) + (half if quarter % 2 else 0)
        # One size, centred in its cell: each (shape, colour) is one pixel pattern per cell
        # (patch 16 -> 14 px shapes with a 1 px margin).
        size = max(4, p - 2)
        x0, y0 = col * p + (p - size) // 2, row * p + (p - size) // 2
        return (x0, y0, x0 + size - 1, y0 + size - 1)

    def render(self, sample: Sample) -> Image.Image:
        img = Image.new("RGB", (self.image_size, self.image_size), BACKGROUND)
        draw = ImageDraw.Draw(img)
        for s in sample.shapes:
            # A white outline (the same pixels for every colour) around a coloured fill: the
            # outline makes the shape a colour-independent pattern that a linear patch
            # embedding reads directly; the fill carries the colour.
            self._draw(draw, s.kind, s.box, OUTLINE)
            x0, y0, x1, y1 = s.box
            self._draw(draw, s.kind, (x0 + 1, y0 + 1, x1 - 1, y1 - 1), COLOURS[s.colour])
        return img

    @staticmethod
    def _draw(draw: ImageDraw.ImageDraw, kind: str, box, fill) -> None:
        x0, y0, x1, y1 = box
        cx, cy = (x0 + x1) / 2, (y0 + y1) / 2
        if kind == "circle":
            draw.ellipse(box, fill=fill)
        elif kind == "square":
            draw.rectangle(box, fill=fill)
        elif kind == "triangle":
            draw.polygon([(cx, y0), (x1, y1), (x0, y1)], fill=fill)
        elif kind == "diamond":
            draw.polygon([(cx, y0), (x1, cy), (cx, y1), (x0, cy)], fill=fill)
        else:  # cross: two bars a third of the size wide
            w = max(1, (x1 - x0 + 1) / 3)
            draw.rectangle((cx - w / 2, y0, cx + w / 2, y1), fill=fill)
            draw.rectangle((x0, cy - w / 2, x1, cy + w / 2), fill=fill)

    def blank(self) -> Image.Image:
        return Image.new("RGB", (self.image_size, self.image_size), BACKGROUND)
