"""A checkpoint's video processor settings <-> a frames-as-images family's vision.video_* fields (Gemma 4, InternVL:
mmpipe.data.video). transformers saves a video processor as video_preprocessor_config.json (a processor's
save_pretrained may put it in processor_config.json's "video_processor" section instead); AutoVideoProcessor reads
either. What mmpipe reads from it, and writes back on export:

    fps               -> vision.video_fps          (frames sampled a second of a clip)
    num_frames        -> vision.video_max_frames   (Gemma4VideoProcessor's default 32: the most frames a clip gives)
    max_soft_tokens   -> vision.video_soft_tokens  (Gemma4VideoProcessor only: a frame's soft-token budget, 70)

A key the file lacks (or holds as null) keeps mmpipe's default. vision.video_min_frames has no field in either
processor: it stays mmpipe's (4, or --video-min-frames), lowered to num_frames where that is fewer.
"""
from __future__ import annotations

import dataclasses
from pathlib import Path

from ..config import ModelConfig
from .llava import _fail, settings_file

VIDEO_FILE = "video_preprocessor_config.json"


def video_settings(path: Path) -> tuple[dict, str | None]:
    """(the directory's video processor settings, the file they came from): video_preprocessor_config.json, else the
    video_processor section of processor_config.json; ({}, None) without either."""
    for name, section in ((VIDEO_FILE, None), ("processor_config.json", "video_processor")):
        f = Path(path) / name
        if f.is_file():
            d = settings_file(f)
            d = d.get(section) if section else d
            if d is None:
                continue
            if not isinstance(d, dict):
                _fail(str(f), "not a JSON object of video processor settings")
            return d, name
    return {}, None


def with_video_settings(cfg: ModelConfig, path: Path, soft_tokens: tuple[int, ...] = ()) -> tuple[ModelConfig, str]:
    """cfg with the directory's video processor settings in its vision.video_* fields, and a note of what was read
    ('' without a file). soft_tokens: the max_soft_tokens the family accepts (Gemma 4's); () for a family without
    the key. One line naming the file for a value the processor could not take."""
    d, name = video_settings(path)
    if name is None:
        return cfg, ""
    v, new = cfg.vision, {}
    fps, frames, tokens = d.get("fps"), d.get("num_frames"), d.get("max_soft_tokens") if soft_tokens else None
    if fps is not None:
        if not isinstance(fps, (int, float)) or isinstance(fps, bool) or fps <= 0:
            _fail(f"{path}/{name}", f"fps {fps!r} is not a positive number of frames a second")
        new["video_fps"] = float(fps)
    if frames is not None:
        if not isinstance(frames, int) or isinstance(frames, bool) or frames < 1:
            _fail(f"{path}/{name}", f"num_frames {frames!r} is not a positive whole number of frames")
        new.update(video_max_frames=frames, video_min_frames=min(v.video_min_frames, frames))
    if tokens is not None:
        if tokens not in soft_tokens:
            _fail(f"{path}/{name}", f"max_soft_tokens {tokens!r} is not one of {soft_tokens}")
        if tokens * v.pool > v.position_table:  # as vision.max_soft_tokens: a thin frame's side, budget x pool
            _fail(f"{path}/{name}", f"max_soft_tokens {tokens} makes frame sides of up to {tokens * v.pool} patches, "
                                    f"past the {v.position_table}-entry position table")
        new["video_soft_tokens"] = int(tokens)
    cfg = dataclasses.replace(cfg, vision=dataclasses.replace(v, **new))
    return cfg, f"clips: {', '.join(f'{k} {getattr(cfg.vision, k):g}' for k in new) or 'defaults'} from {name}"


def video_kwargs(cfg: ModelConfig) -> dict:
    """with_video_settings' inverse: the video processor's fps and num_frames (and max_soft_tokens where the vision
    section has video_soft_tokens), for its constructor."""
    v = cfg.vision
    out = dict(fps=v.video_fps, num_frames=v.video_max_frames)
    if hasattr(v, "video_soft_tokens"):
        out["max_soft_tokens"] = v.video_soft_tokens
    return out
