"""The LLaVA-style clip records the video tests share (tests/test_video*.py), and the files the pipeline tests write
for them: conversations, the four in-process records (a clip, a clip then an image, two clips, an image), the
pipeline runs' five kinds, their clips, image, tokenizer and DeepSpeed config."""
from __future__ import annotations

import json

import numpy as np
from PIL import Image

from video_clips import moving_square, write_clip


def conv(*turns: str) -> list[dict]:
    """A LLaVA conversation: human, gpt, human, ... turns."""
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]


# LLaVA-style records: a clip alone, a clip then an image, two clips of different lengths and frame sizes, an image
# alone (short.mp4 and long.mkv the tests' two clips, a.png an image)
GOOD = [{"video": "short.mp4", "conversations": conv("<video>\nw5 w6", "w7")},
        {"video": "long.mkv", "image": "a.png", "conversations": conv("w8 <video> w9 <image>", "w10 w11")},
        {"video": ["long.mkv", "short.mp4"], "conversations": conv("<video> w12 <video> w13", "w14")},
        {"image": "a.png", "conversations": conv("<image> w15", "w16")}]

# the pipeline runs' records: a clip, a clip then an image, two clips, an image, text: 5 kinds (x 3 = 15 records),
# answers of 1..3 words
KINDS = [{"video": "short.mp4", "conversations": conv("<video>\nwhat colour is it", "red")},
         {"video": "long.mkv", "image": "a.png", "conversations": conv("<video> and <image> what", "blue and green")},
         {"video": ["long.mkv", "short.mp4"], "conversations": conv("<video> is it <video>", "green")},
         {"image": "a.png", "conversations": conv("<image> what colour", "red and blue")},
         {"conversations": conv("what colour is it", "blue")}]


def write_pipeline_set(root, short: tuple[int, int], long: tuple[int, int]) -> None:
    """root/short.mp4 (7 frames, MP4 / H.264) and root/long.mkv (13 frames, Matroska / Motion JPEG) of these
    (width, height) at 3 fps, root/a.png of long's size, root/data.json (KINDS x 3) and root/tok (the word-level
    tokenizer of tests/test_qwen_data.py)."""
    from test_qwen_data import save_tokenizer
    write_clip(root / "short.mp4", moving_square(7, *short, seed=0), 3)
    write_clip(root / "long.mkv", moving_square(13, *long, seed=1), 3)
    pixels = np.random.default_rng(0).integers(0, 256, (long[1], long[0], 3), dtype=np.uint8)
    Image.fromarray(pixels).save(root / "a.png")
    (root / "data.json").write_text(json.dumps(KINDS * 3))
    save_tokenizer(root / "tok")


def pipeline_ds_config(root, steps: int):
    """root/ds.json: 2 rows a micro-batch, 2 micro-batches a step, WarmupCosineLR over 2 x steps (1 warm-up step)."""
    from conftest import write_ds_config
    return write_ds_config(root / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                           scheduler={"type": "WarmupCosineLR",
                                      "params": {"total_num_steps": 2 * steps, "warmup_num_steps": 1,
                                                 "warmup_type": "linear", "warmup_min_ratio": 0.5}})
