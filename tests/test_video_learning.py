"""A learnable synthetic video task (issue 44): "which way does the circle move", left or right, on clips written here
with PyAV (MP4 / H.264, tests/video_clips.py's writer). qwen-tiny (Qwen2-VL's temporal index) trained by the
single-device reference loop on LLaVA records of clips, then `mmpipe eval` answers held-out clips as it answers any
held-out file (greedy, exact match, mmpipe/inference/scoring.py).

Every clip comes with its time reverse (the same frames backwards) answered the other way, in training and held out.
The two clips of a pair hold the same frames: only their order (which comes first) tells the direction. A model
blind to the order gives both clips of a pair the same answer and scores exactly half of them, whatever it has
learned; a guesser scores Binomial(N, 1/2). The test asks for 75% of N = 100 held-out clips (50 pairs): at least 25
pairs answered both right, and a coin's chance of 75 or more of 100 is 2.8e-7. Measured: 100%, 50 of 50 pairs
(docs/video.md)."""
from __future__ import annotations

import json
import time

import numpy as np
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast

from conftest import write_checkpoint, write_ds_config
from mmpipe.cli import main as cli_main
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.reference import train_reference
from test_qwen_data import SPECIALS, TEMPLATE
from video_clips import write_clip

WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "which", "way", "does", "the", "circle",
         "move", "left", "right"]
QUESTION = "<video>\nwhich way does the circle move"
FRAMES, SIZE, RADIUS, SPEED, FPS = 4, 56, 7, 10, 2  # 4 frames at 2 fps: all sampled, grid (2, 4, 4), 8 decoder tokens
TRAIN_PAIRS, HELD_PAIRS, STEPS, SEED = 64, 50, 200, 0
ACCURACY = 0.75  # of 2 x HELD_PAIRS held-out clips; chance 0.5 (module docstring)


def save_tokenizer(path) -> None:
    """A word-level Qwen-like tokenizer holding the question's and answers' words, the vision specials at qwen-tiny's
    ids 197 .. 199 (tests/test_qwen_data.py's, other words)."""
    vocab = WORDS + [f"w{i}" for i in range(197 - len(WORDS))] + ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(vocab)}, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)


def moving_circle(rng: np.random.Generator) -> np.ndarray:
    """uint8 [FRAMES, SIZE, SIZE, 3]: a white disc of RADIUS px on a dark background, moving SPEED px a frame to the
    right from a random place, at a random height. SPEED 10 moves it most of its width between the two frames of a
    temporal patch; at 5 to 8 px the loss stayed at the answers' prior for 200 steps in 4 of 5 runs (docs/video.md)."""
    out = np.full((FRAMES, SIZE, SIZE, 3), 20, np.uint8)
    colour = 250
    y = rng.integers(RADIUS, SIZE - RADIUS)
    x0 = rng.integers(RADIUS, SIZE - RADIUS - SPEED * (FRAMES - 1))
    yy, xx = np.mgrid[:SIZE, :SIZE]
    for i in range(FRAMES):
        out[i][(yy - y) ** 2 + (xx - x0 - SPEED * i) ** 2 <= RADIUS ** 2] = colour
    return out


def write_pairs(root, name: str, pairs: int, seed: int):
    """A LLaVA file of `pairs` clips and their reverses, each answered with its direction."""
    rng, records = np.random.default_rng(seed), []
    for i in range(pairs):
        right = moving_circle(rng)
        for answer, frames in (("right", right), ("left", right[::-1])):
            write_clip(root / f"{name}{i}{answer}.mp4", np.ascontiguousarray(frames), FPS)
            records.append({"video": f"{name}{i}{answer}.mp4",
                            "conversations": [{"from": "human", "value": QUESTION}, {"from": "gpt", "value": answer}]})
    path = root / f"{name}.json"
    path.write_text(json.dumps(records))
    return path


def test_qwen_tiny_learns_which_way_the_circle_moves(tmp_path):
    save_tokenizer(tmp_path / "tok")
    train, held = write_pairs(tmp_path, "train", TRAIN_PAIRS, SEED), write_pairs(tmp_path, "held", HELD_PAIRS, 1)
    # 16 clips a step (one a row), AdamW at 3e-3: at the shipped 5e-4 the loss had not even come down to the
    # answers' prior after 100 steps
    ds = write_ds_config(tmp_path / "ds.json", train_micro_batch_size_per_gpu=16, gradient_accumulation_steps=1,
                         optimizer={"type": "AdamW", "params": {"lr": 3e-3, "betas": [0.9, 0.95], "eps": 1e-8,
                                                                "weight_decay": 0.0, "torch_adam": True}},
                         scheduler={"type": "WarmupCosineLR",
                                    "params": {"total_num_steps": STEPS, "warmup_num_steps": 5,
                                               "warmup_type": "linear", "cos_min_ratio": 0.05}})
    args = ["--preset", "qwen-tiny", "--data", str(train), "--tokenizer", str(tmp_path / "tok"), "--ds-config",
            str(ds), "--text-len", "48", "--max-images", "1", "--max-patches", "32", "--eval-samples", "0",
            "--seed", str(SEED), "--data-workers", "0", "--stages", "1", "--output-dir", str(tmp_path / "run")]
    run = resolve(TrainArgs.from_argv(args), world_size=1)
    started = time.process_time()
    model, losses = train_reference(run, seed=SEED, steps=STEPS, out_dir=str(tmp_path / "run"))
    print(f"trained {STEPS} steps in {time.process_time() - started:.1f} s of CPU; loss {losses[0]:.3f} -> "
          f"{losses[-1]:.3f}")
    write_checkpoint(model, tmp_path / "run")
    out = tmp_path / "eval" / "answers.jsonl"
    assert cli_main(["eval", "--checkpoint", str(tmp_path / "run"), "--data", str(held), "--tokenizer",
                     str(tmp_path / "tok"), "--out", str(out), "--max-new-tokens", "2", "--text-len", "48"]) == 0
    lines = [json.loads(line) for line in out.read_text().splitlines()]
    summary = json.loads(out.with_name("answers.summary.json").read_text())
    assert summary["n"] == 2 * HELD_PAIRS and summary["bad_records"] == 0
    assert all(line["has_image"] for line in lines)  # every prompt held its clip
    # the model answers the question's way (one of the two words), so half is the chance line
    assert {line["answer"] for line in lines} <= {"left", "right"}
    both = sum(a["score"] and b["score"] for a, b in zip(lines[::2], lines[1::2]))  # pairs told apart by order
    print(f"held out: {summary['exact']:.2f} of {summary['n']} clips, {both} of {HELD_PAIRS} pairs both right")
    assert summary["exact"] >= ACCURACY
