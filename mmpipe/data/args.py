"""The data flags of a training run (docs/data.md), declared once as fields."""
from __future__ import annotations

import dataclasses
import math
from dataclasses import dataclass

from ..config import ConfigError, ModelConfig
from ..flags import flag
from .images import DEFAULT_MAX_PIXELS
from .packing import LOSS_NORMS
from .text import OVERLONG
from .tokenizer import PROMPT_FORMATS

POLICIES = ("skip", "strict")
GROUP = "data (see docs/data.md)"
VIDEO = "video sampling (see docs/video.md; default: the model's vision.video_*, the processors' own)"
# the clip sampling flags: train, plan and generate take them (DataArgs.with_video sets the model's vision.video_*)
VIDEO_FLAGS = ("video_fps", "video_min_frames", "video_max_frames", "video_min_pixels", "video_max_pixels")


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
                      "follow from --text-len and the data, as many as the model's context holds beside "
                      "--text-len (docs/packing.md)", group=GROUP)
    balance: str = flag("on", "with --pack, spread each step's rows over the DP ranks and their micro-batches so "
                        "each rank's predicted cost (tower and decoder apart) is even (on, the default), or keep them "
                        "in stream order (off); the step's rows are the same set either way (docs/balance.md)",
                        choices=("on", "off"), group=GROUP)
    loss_norm: str = flag("token", "the step's loss: the mean over the global batch's answer tokens (token, the "
                          "default; packed == unpacked) or over its samples, each its own mean (sample)",
                          choices=LOSS_NORMS, group=GROUP)
    video_fps: float | None = flag(None, "frames sampled per second of a clip, the video processor's fps (default: 2)",
                                   metavar="FPS", group=VIDEO)
    video_min_frames: int | None = flag(None, "frames sampled from a clip at least, the processor's min_frames "
                                        "(default: 4); also the fewest a clip over its share of the row is sampled "
                                        "down to before it is a bad record", metavar="N", group=VIDEO)
    video_max_frames: int | None = flag(None, "frames sampled from a clip at most, the processor's max_frames "
                                        "(default: 768)", metavar="N", group=VIDEO)
    video_min_pixels: int | None = flag(None, "the video processor's lower pixel bound: a frame's min_pixels "
                                        "(Qwen2-VL family), the whole clip's size shortest_edge (Qwen3-VL) "
                                        "(default: vision.min_pixels)", metavar="PX", group=VIDEO)
    video_max_pixels: int | None = flag(None, "the video processor's upper pixel bound: a frame's max_pixels "
                                        "(Qwen2-VL family), the whole clip's size longest_edge (Qwen3-VL); a clip "
                                        "also keeps to its share of --max-patches (default: that share and "
                                        "vision.max_pixels)", metavar="PX", group=VIDEO)

    def with_video(self, model: ModelConfig) -> ModelConfig:
        """The model under the --video-* flags (its vision.video_* fields, which the clip rule reads,
        mmpipe.data.video.video_rule); ConfigError, one line per bad value, for a family that reads no clips or a
        value the processor cannot take."""
        given = {k: getattr(self, k) for k in VIDEO_FLAGS if getattr(self, k) is not None}
        if not given:
            return model
        names = [f"--{k.replace('_', '-')}" for k in given]
        v = model.vision
        takes = {f.name for f in dataclasses.fields(v)}  # the clip sampling fields its section declares
        if not takes & set(VIDEO_FLAGS):
            from ..registry import families
            readers = list(dict.fromkeys(f.family for f in families() if "video" in f.media))
            raise ConfigError(f"{', '.join(names)}: the {model.family} family reads no clips; only the "
                              f"{', '.join(readers)} families do")
        fixed = [n for n, k in zip(names, given) if k not in takes]
        if fixed:
            raise ConfigError(f"{', '.join(fixed)}: {_frames_unbounded(model)}")
        new = dataclasses.replace(v, **given)
        problems = []
        if not (math.isfinite(new.video_fps) and new.video_fps > 0):
            problems.append(f"--video-fps: {new.video_fps:g} must be a positive number of frames a second")
        if new.video_min_frames < 1:
            problems.append(f"--video-min-frames: {new.video_min_frames} must be at least 1")
        temporal = v.temporal_patch_size if "temporal_patch_size" in takes else 1  # OneVision: a frame a crop
        if new.video_max_frames < max(1, new.video_min_frames, temporal):
            problems.append(f"--video-max-frames: {new.video_max_frames} must be at least --video-min-frames "
                            f"({new.video_min_frames})" + (f" and a temporal patch ({temporal} frames)"
                                                           if temporal > 1 else ""))
        min_px, max_px = (getattr(new, k) if k in takes else 0 for k in ("video_min_pixels", "video_max_pixels"))
        if min_px < 0:
            problems.append(f"--video-min-pixels: {new.video_min_pixels} must be at least 0 (0: vision.min_pixels)")
        if max_px < 0 or 0 < max_px < min_px:
            problems.append(f"--video-max-pixels: {new.video_max_pixels} must be 0 (none) or at least "
                            f"--video-min-pixels ({new.video_min_pixels})")
        if problems:
            raise ConfigError("\n".join(problems))
        return dataclasses.replace(model, vision=new)


def _frames_unbounded(model: ModelConfig) -> str:
    """Why a family's clip frames take no pixel bound, in its own words: Gemma 4's are sized by the video processor's
    soft-token budget (vision.video_soft_tokens: at most 9 x that many patches a frame, its aspect kept); OneVision's
    and InternVL's are the tower's crop."""
    v = model.vision
    if hasattr(v, "video_soft_tokens"):
        return (f"the {model.family} family's clip frames are sized by vision.video_soft_tokens ({v.video_soft_tokens} "
                f"soft tokens a frame, Gemma4VideoProcessor's max_soft_tokens), not by pixels; set it in the model's "
                f"JSON (or the checkpoint's video processor config, read by `mmpipe import --hf`), or sample fewer "
                f"frames (--video-max-frames)")
    return (f"the {model.family} family's clip frames are its tower's crop (vision.image_size {v.image_size} px), not "
            f"bounded by pixels")
