"""The data flags of a training run (docs/data.md), declared once as fields."""
from __future__ import annotations

from dataclasses import dataclass

from ..flags import flag
from .images import DEFAULT_MAX_PIXELS
from .packing import LOSS_NORMS
from .text import OVERLONG
from .tokenizer import PROMPT_FORMATS

POLICIES = ("skip", "strict")
GROUP = "data (see docs/data.md)"


@dataclass(frozen=True)
class DataArgs:
    data: str = flag("shapes", "'shapes' (built-in synthetic VQA, the default), a LLaVA .json/.jsonl, a pairs "
                     ".csv/.jsonl, a .parquet, a saved HF dataset or image folder, or a data config JSON", group=GROUP)
    image_root: str | None = flag(None, "folder relative image paths start from (default: the data file's)",
                                  group=GROUP)
    tokenizer: str | None = flag(None, "local tokenizer directory for AutoTokenizer (default: the built-in "
                                 "word-level tokenizer)", group=GROUP)
    prompt_format: str | None = flag(None, "how a sample's prompt is laid out: chat (the tokenizer's chat template) or "
                                     "moondream (moondream2's token-id query/caption templates; needs its own "
                                     "tokenizer, --tokenizer DIR). Default: the tokenizer's own (moondream for one "
                                     "saved by `mmpipe import --moondream --tokenizer`, else chat)",
                                     choices=PROMPT_FORMATS, group=GROUP)
    text_len: int | None = flag(None, "text tokens per sample, padded (default: shapes 12; else what the model's "
                                "context leaves after BOS + image)", group=GROUP)
    bad_records: str = flag("skip", "skip: count, list and leave out bad records (default); strict: stop before "
                            "training", choices=POLICIES, group=GROUP)
    overlong: str = flag("skip", "text over --text-len: skip it as a bad record (default) or truncate it if its "
                         "first answer token fits", choices=OVERLONG, group=GROUP)
    max_images: int | None = flag(None, "image slots per row: images per sample at most (a record with more is a bad "
                                  "record, too_many_images; above 1 needs the LLaVA family, which places each image at "
                                  "its <image> marker), and with --pack the images of a row's samples together "
                                  "(default: 1; with --pack, as many as the data's mean sample fills a row with, "
                                  "docs/packing.md)", metavar="N", group=GROUP)
    max_patches: int | None = flag(None, "vision patches per row, a dynamic-resolution family's (qwen2_vl) patch "
                                   "budget, a multiple of merge_size^2; larger images are resized down to fit by the "
                                   "image processor's own rule (default: --max-images images at vision.max_pixels, "
                                   "docs/packing.md)", metavar="P", group=GROUP)
    max_tiles: int | None = flag(None, "vision crops per row, the any-resolution family's (llava_next) crop budget: "
                                 "each image's base crop and tiles; a sample needing more is a bad record, "
                                 "too_many_tiles (default: room for --max-images images at the largest pinpoint; "
                                 "OneVision: for one tiled image or --max-images base crops, docs/anyres.md)",
                                 metavar="T", group=GROUP)
    max_image_pixels: int = flag(DEFAULT_MAX_PIXELS, "refuse larger images, a decompression-bomb guard "
                                 f"(default: {DEFAULT_MAX_PIXELS})", group=GROUP)
    resize: str = flag("pad", "pad to square with the mean colour, then resize (default), or squash to square",
                       choices=("pad", "squash"), group=GROUP)
    augment: bool = flag(False, "light crop / colour jitter (off by default; no flips)", group=GROUP)
    data_workers: int = flag(2, "loader worker processes on the first stage (default: 2)", group=GROUP)
    log_samples: bool = flag(False, "write OUTPUT_DIR/samples_dpD.csv: the stream position and record of every "
                             "sample trained on", group=GROUP)
    pack: bool = flag(False, "pack several whole samples into each fixed-length row (max-images x image positions "
                      "+ --text-len), each attending only to itself; without --max-images a row's image slots "
                      "follow from --text-len and the data (docs/packing.md)", group=GROUP)
    loss_norm: str = flag("token", "the step's loss: the mean over the global batch's answer tokens (token, the "
                          "default; packed == unpacked) or over its samples, each its own mean (sample)",
                          choices=LOSS_NORMS, group=GROUP)
