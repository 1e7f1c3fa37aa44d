"""Clips/s one loader worker decodes and samples (issue 44's loader benchmark; docs/video.md has the table).

Writes --clips test clips (a moving square, H.264 in MP4, --seconds s at --src-fps, --size px a side) to --work,
then times, per clip, in one process and one thread:

- index: mmpipe.data.video.probe (the container header) and VideoRule.clip (the grid, by transformers'
  Qwen2VLVideoProcessor.sample_frames and smart_resize): what index time does, no frame decoded;
- decode: mmpipe.data.video.decode of the sampled frames (PyAV decodes every frame up to the last sampled one);
- patches: transformers' Qwen2VLVideoProcessor on those frames (resize, normalise, patchify), at qwen2.5-vl-7b's
  settings (patch 14, merge 2, temporal 2, CLIP mean / std) and fps 2.

    python scripts/bench_video_loader.py                      # 8 s clips at 30 fps, 448 x 448: 16 frames sampled
    python scripts/bench_video_loader.py --clips 2 --repeats 1  # a smoke run

Prints one line per stage (median and range over clips x repeats) and the clips/s of a worker that does decode +
patches, and writes WORK/results.json.
"""
from __future__ import annotations

import argparse
import json
import os
import statistics
import sys
import time
from pathlib import Path

import torch

sys.path.insert(0, str(Path(__file__).resolve().parents[1] / "tests"))  # the tests' clip writer
from mmpipe.config import load_preset  # noqa: E402
from mmpipe.data.patches import patch_rule  # noqa: E402
from mmpipe.data.video import VideoRule, decode, probe  # noqa: E402
from video_clips import moving_square, write_clip  # noqa: E402


def main() -> None:
    ap = argparse.ArgumentParser(description=__doc__.split("\n")[0])
    ap.add_argument("--clips", type=int, default=6)
    ap.add_argument("--repeats", type=int, default=3)
    ap.add_argument("--seconds", type=float, default=8.0)
    ap.add_argument("--src-fps", type=int, default=30)
    ap.add_argument("--size", type=int, default=448)
    ap.add_argument("--fps", type=float, default=2.0, help="frames sampled per second")
    ap.add_argument("--preset", default="qwen2.5-vl-7b")
    ap.add_argument("--work", default="runs/bench_video_loader")
    a = ap.parse_args()
    torch.set_num_threads(1)
    work = Path(a.work)
    work.mkdir(parents=True, exist_ok=True)
    cfg = load_preset(a.preset)
    rule = VideoRule(patch_rule(cfg, 65536), fps=a.fps)  # a budget that bounds no frame: the clip's own size
    paths = []
    t0 = time.perf_counter()
    for k in range(a.clips):
        p = work / f"clip{k}.mp4"
        if not p.exists():
            write_clip(p, moving_square(int(a.seconds * a.src_fps), a.size, a.size, seed=k), a.src_fps)
        paths.append(p)
    write_s = time.perf_counter() - t0
    times = {"index": [], "decode": [], "patches": []}
    grid = None
    for _ in range(a.repeats):
        for p in paths:
            t = time.perf_counter()
            clip = rule.clip(probe(p))
            times["index"].append(time.perf_counter() - t)
            t = time.perf_counter()
            frames = decode(p, clip.indices)
            times["decode"].append(time.perf_counter() - t)
            t = time.perf_counter()
            out = rule.processor(clip)(videos=[frames], return_tensors="pt")
            times["patches"].append(time.perf_counter() - t)
            grid = clip.grid
            assert tuple(out["video_grid_thw"][0].tolist()) == grid
    per_clip = [d + q for d, q in zip(times["decode"], times["patches"])]
    result = {"clips": a.clips, "repeats": a.repeats, "seconds": a.seconds, "src_fps": a.src_fps, "size": a.size,
              "fps": a.fps, "frames_sampled": len(clip.indices), "grid": list(grid), "write_s": write_s,
              "load_avg": os.getloadavg(), "ms": {k: [1000 * x for x in v] for k, v in times.items()},
              "clips_per_s": 1 / statistics.median(per_clip)}
    print(f"{a.clips} clips of {a.seconds:g} s at {a.src_fps} fps, {a.size}x{a.size} (H.264 / MP4): "
          f"{len(clip.indices)} frames sampled at {a.fps:g} fps, grid {grid}, {a.repeats} repeats, "
          f"load {os.getloadavg()[0]:.1f}")
    for k, v in times.items():
        ms = sorted(1000 * x for x in v)
        print(f"  {k:8s} median {statistics.median(ms):8.2f} ms  [{ms[0]:.2f}-{ms[-1]:.2f}]")
    print(f"  one worker (decode + patches): {result['clips_per_s']:.2f} clips/s")
    (work / "results.json").write_text(json.dumps(result, indent=2) + "\n")


if __name__ == "__main__":
    main()
