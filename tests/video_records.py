"""The LLaVA-style clip records the video tests share (tests/test_video*.py), and what they build from them:
conversations, packed rows of samples for the models, the four in-process records (a clip, a clip then an image, two
clips, an image), the pipeline runs' five kinds and the files those runs read (their clips, image, tokenizer and
DeepSpeed config)."""
from __future__ import annotations

import json

import numpy as np
import torch
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


def packed_row(samples, patch_dim: int, width: int, extra_patches: int = 8, extra_positions: int = 3):
    """One packed row (segments 1, 2, ...) of samples [(ids, [(patches, tiling)])] as the stage contract's first
    input, each medium's tiling cut to `width` columns, with an unused slot, zero patch padding and padding
    positions; and each sample's span."""
    ids = torch.cat([s[0] for s in samples])
    L = len(ids) + extra_positions
    segments, spans, at = torch.zeros(1, L, dtype=torch.long), [], 0
    for k, s in enumerate(samples):
        segments[0, at:at + len(s[0])] = k + 1
        spans.append((at, at + len(s[0])))
        at += len(s[0])
    media = [(k + 1, px, til) for k, s in enumerate(samples) for px, til in s[1]]
    M = len(media) + 1
    tiling, has_image = torch.zeros(1, M, width, dtype=torch.long), torch.zeros(1, M, dtype=torch.long)
    for j, (owner, _, til) in enumerate(media):
        tiling[0, j], has_image[0, j] = torch.tensor(til[:width]), owner
    n = sum(len(px) for _, px, _ in media)
    pixels = torch.zeros(1, n + extra_patches, patch_dim)
    pixels[0, :n] = torch.cat([px for _, px, _ in media])
    input_ids = torch.cat([ids, torch.zeros(extra_positions, dtype=torch.long)])[None]
    return (pixels, input_ids, has_image, segments, tiling), spans


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
