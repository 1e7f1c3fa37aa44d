"""The vision side of a dynamic-resolution row for the planner (the Qwen2-VL family, image kind patches):
`mmpipe plan --image-size WxH` and `--max-patches P` -> the row's PatchRow (mmpipe.model.costs), through
the data side's own rule (mmpipe.data.patches: transformers' Qwen2-VL smart_resize, called, not copied).

A row holds --max-images M images of that size (default 1; `--image-size 1024x768,512x512`: images of
those sizes in turn, M default their number), each resized as training resizes it: to
multiples of patch x merge px (28) between vision.min_pixels and vision.max_pixels, and, when M of them
would not fit the row's P patches, further down to P / M each. E.g. qwen2.5-vl-72b, 1024x768, M = 4,
P = 16384: 1036 x 756 px, a 54 x 74-patch grid, 3996 patches and 999 decoder positions each; 15984 of the
16384 patches used. Without --image-size the image is vision.image_size square (the presets: the largest
the processor makes), without --max-patches P is train's default (mmpipe.data.patches.default_patch_budget).

The any-resolution family (LLaVA-NeXT / OneVision, vision.grid_pinpoints) -> the row's CropRow: its crop budget T
(--max-tiles, default train's: mmpipe.data.anyres) and each image's tiling as transformers' processor picks it
(select_best_resolution), e.g. llava-onevision-qwen2-72b, 1024x768: 2 x 3 tiles of 384 px, 7 crops and 4725
decoder positions. Without --image-size the image is the largest pinpoint (the most tiles and positions).
"""
from __future__ import annotations

import re
from dataclasses import dataclass

import numpy as np

from ..config import ConfigError, ModelConfig
from ..data.anyres import tile_rule
from ..data.image_kinds import image_kind
from ..data.patches import patch_rule
from ..data.records import BadRecord
from ..model.costs import CropRow, PatchRow
from ..registry import families


def sized_families() -> list[str]:
    """The families whose images take any size in a row budget (a kind with a budget flag: Qwen2-VL's patches,
    LLaVA-NeXT's tiles), from the family registry: those `--image-size` costs and `mmpipe check` has no profile for."""
    return list(dict.fromkeys(f.family for f in families() if f.kind.flag is not None))


def families_words(names: list[str]) -> str:
    """['a'] -> 'the a family'; ['a', 'b'] -> 'the a and b families'."""
    return f"the {names[0]} family" if len(names) == 1 else f"the {', '.join(names[:-1])} and {names[-1]} families"


def parse_image_sizes(text: str) -> list[tuple[int, int]]:
    """'1024x768,512x512' -> [(1024, 768), (512, 512)] (parse_image_size of each)."""
    return [parse_image_size(part) for part in (text or "").split(",")]


def parse_image_size(text: str) -> tuple[int, int]:
    """'1024x768' -> (1024, 768): width x height in pixels, both >= 1; ConfigError in one line otherwise."""
    m = re.fullmatch(r"\s*(\d+)\s*[xX×]\s*(\d+)\s*", text or "")
    if not m or min(int(m[1]), int(m[2])) < 1:
        raise ConfigError(f"--image-size: {text!r} is not WIDTHxHEIGHT in pixels, both at least 1 (e.g. 1024x768)")
    return int(m[1]), int(m[2])


def patch_row(cfg: ModelConfig, images: int = 1, budget: int = 0,
              sizes: list[tuple[int, int]] | None = None) -> PatchRow | CropRow | None:
    """The row's patch budget and its `images` images, of `sizes` (width, height) in turn (default the
    preset's vision.image_size square), each grid as the data makes it (patch_rule(...).grid); None for a
    fixed-resolution family. ConfigError for a size the processor refuses (an aspect over 200:1).
    budget: the row's, in its kind's unit (P patches; tiles: T crops, the result a CropRow; 0: train's default)."""
    row = {"tiles": crop_row, "patches": _patch_row}.get(image_kind(cfg).name)  # fixed-size images: no row
    return None if row is None else row(cfg, images, budget, sizes)


def _patch_row(cfg: ModelConfig, images: int, budget: int, sizes: list[tuple[int, int]] | None) -> PatchRow:
    v, images = cfg.vision, max(1, images)
    p = budget or image_kind(cfg).budget(cfg, None, images, [])
    sizes, rule, grids = sizes or [(v.image_size, v.image_size)], patch_rule(cfg, p), []
    for width, height in (sizes[k % len(sizes)] for k in range(images)):
        try:
            grids.append(rule.grid(width, height, images))
        except BadRecord as e:
            raise ConfigError(f"--image-size {width}x{height}: {e} (--max-patches {p}, --max-images {images})"
                              ) from None
    return PatchRow(p, tuple(grids))


def crop_row(cfg: ModelConfig, images: int = 1, budget: int = 0,
             sizes: list[tuple[int, int]] | None = None) -> CropRow:
    """The any-resolution row: T crops (budget, 0: train's default for `images`) and its `images` images of
    `sizes` in turn (default the largest pinpoint), each tiled as the data tiles it (TileRule.sample_grids);
    ConfigError in one line for images the row cannot hold (too_many_tiles) or the tiles cannot take."""
    images = max(1, images)
    rule = image_kind(cfg).rule(cfg, budget, images)  # the family's tile rule (LLaVA-NeXT's, InternVL's)
    if not sizes:  # train's cost table: images of the largest pinpoint T holds, as many as it holds
        crops = {(h, w): 1 + (h // rule.size) * (w // rule.size) for h, w in rule.pinpoints}
        fits = sorted((p for p, n in crops.items() if n <= rule.row_tiles), key=lambda p: -p[0] * p[1])
        if not fits:
            return CropRow(rule.row_tiles, ())
        h, w = fits[0]
        sizes, images = [(w, h)], max(1, min(images, rule.row_tiles // crops[fits[0]]))
    take = [sizes[k % len(sizes)] for k in range(images)]
    try:
        grids = rule.sample_grids(take)
    except BadRecord as e:
        raise ConfigError(f"--image-size {','.join(f'{w}x{h}' for w, h in sizes)}: {e} (--max-images {images})"
                          ) from None
    return CropRow(rule.row_tiles, tuple(tuple(int(x) for x in g[:4]) for g in grids))


def crop_words(cfg: ModelConfig, run, row: CropRow) -> str:
    """`mmpipe plan`'s header words for an any-resolution row: each size's tiles, crops and decoder positions; a
    OneVision clip's tiling (rows -1, clip_row) its frames sampled, each a base crop pooled, and its positions."""
    images = tuple(t for t in row.tilings if t[2] >= 0 and not is_frame(t))
    clips = [t for t in row.tilings if t[2] < 0]
    rule, m = image_kind(cfg).rule(cfg, row.crops, len(images) or 1), len(images)
    words = [frame_words(cfg, run, len(row.tilings))] if any(map(is_frame, row.tilings)) else []  # InternVL's
    for _, _, rows, cols in clips:  # at most one: --video-frames
        from ..model.llava_next import image_feature_count, pooled_side
        v, frames, side = cfg.vision, 1 - cols, pooled_side(cfg.vision.grid)
        size = run.video_size or "vision.image_size"
        words.append(f"a clip of {run.video_frames} frames of {size} px -> {frames} frames sampled, each a "
                     f"{rule.size} px crop pooled to {side} x {side} ({frames} crops, {frames} x {side ** 2} + 1 = "
                     f"{image_feature_count(v, 0, 0, rows, cols)} image tokens)")
    if not images:
        return words[0]
    kinds = dict.fromkeys(images)  # in order, once each
    image = [f"{w}x{h} px ({r} x {c} tiles of {rule.size} px, {1 + r * c} crops, "
             f"{rule.count(h, w, m)} image tokens{' each' if len(kinds) == 1 and m > 1 else ''})"
             for h, w, r, c in kinds]
    image = f"{m} image{'s' if m > 1 else ''} " + ("of " + image[0] if len(kinds) == 1 else "(" + "; ".join(image)
                                                                                            + ")")
    return " + ".join(words + [image])


def crop_line(cfg: ModelConfig, row: CropRow, text_len: int, length: int) -> str:
    """An any-resolution row's budgets: crops used of T, image positions used of the row's (a clip's: its
    frames' pooled features and one newline, image_feature_count)."""
    from ..model.llava_next import image_feature_count
    # images: a clip does not count (transformers' batch_num_images), nor an InternVL frame (one crop, 256 + 2)
    m = sum(1 for t in row.tilings if t[2] >= 0 and not is_frame(t))
    rule = image_kind(cfg).rule(cfg, row.crops, m or 1)
    used = sum(1 + r * c for _, _, r, c in row.tilings)
    tokens = sum(rule.per_crop + 2 if is_frame((h, w, r, c)) else rule.count(h, w, m) if r >= 0 else
                 image_feature_count(cfg.vision, h, w, r, c) for h, w, r, c in row.tilings)
    return (f"vision crops per row: {used} of --max-tiles {row.crops} ({1 - used / row.crops:.0%} padding); decoder "
            f"positions per row: {length - text_len} image ({tokens} used) + {text_len} text = {length}")


def clip_refusal(cfg: ModelConfig) -> str | None:
    """Why plan cannot cost cfg's clips (None: it can): LLaVA-NeXT's model reads none (anyres_max 0; the data side
    refuses them alike, mmpipe.data.video.onevision_grids), nor Gemma 4 at a fixed square (mmpipe.data.gemma4); clips
    of patches, OneVision's and frames as images (Gemma 4, InternVL: frame_clip) are costed."""
    kind = image_kind(cfg)
    if kind.frames_as_images and not hasattr(kind, "frame_grid"):  # Gemma 4 at a fixed square (data.gemma4)
        return (f"--video-frames: the {cfg.family} family at a fixed square (vision.max_soft_tokens 0) reads no clips: "
                f"its frames are images of a soft-token budget; plan a model JSON with vision.max_soft_tokens (an "
                f"import of a checkpoint whose image processor has max_soft_tokens)")
    if kind.frames_as_images or kind.name == "patches" or cfg.vision.anyres_max:  # frames as images: frame_clip
        return None
    return (f"--video-frames: LLaVA-NeXT (vision.anyres_max 0) reads no clips; only LLaVA-OneVision's (the "
            f"{cfg.family} family at vision.anyres_max > 0) do")


def clip_row(cfg: ModelConfig, budget: int, frames: int, size: tuple[int, int], images: int,
             sizes: list[tuple[int, int]] | None) -> PatchRow | CropRow | None:
    """`mmpipe plan --video-frames N --video-size WxH`: a row of the budget (P patches, or T crops for OneVision)
    holding `images` images of `sizes` (in turn) and one clip of N frames of W x H sampled, each made by the data side's
    own rules. Patches: the images and the clip share P as images + 1 media, the images' grids as patch_row's, the
    clip's by mmpipe.data.video (the family's video processor's sampling and resize): its grid (t, h, w), or
    Qwen3-VL's t slots of (1, h, w), after the images. OneVision: onevision_clip_row. Frames as images (Gemma 4,
    InternVL): frames_clip_row. ConfigError for an image or a clip the rules refuse."""
    from ..data.video import ClipInfo, video_rule
    if clip_refusal(cfg):
        raise ConfigError(clip_refusal(cfg))
    if image_kind(cfg).frames_as_images:
        return frames_clip_row(cfg, budget, frames, size, images, sizes)
    if image_kind(cfg).name == "tiles":
        return onevision_clip_row(cfg, budget, frames, size, images, sizes)
    patches = patch_row(cfg, max(1, images), budget, sizes).patches
    rule = patch_rule(cfg, patches)
    clips, n, grids = video_rule(rule), images + 1, []
    try:
        for width, height in ((sizes or [])[k % len(sizes)] for k in range(images)) if sizes else ():
            grids.append(rule.grid(width, height, n))
        clip = clips.clip(ClipInfo(frames, clips.fps, *size), n)  # N frames at the sampling rate: N sampled
    except BadRecord as e:
        raise ConfigError(f"--video-frames {frames} --video-size {size[0]}x{size[1]}: {e} (--max-patches {patches}, "
                          f"{images} image(s) beside the clip)") from None
    frame_slots = [(1, *clip.grid[1:])] * clip.grid[0] if rule.timestamps else [clip.grid]
    return PatchRow(patches, tuple(grids) + tuple(frame_slots))


def onevision_clip_row(cfg: ModelConfig, budget: int, frames: int, size: tuple[int, int], images: int,
                       sizes: list[tuple[int, int]] | None) -> CropRow:
    """A LLaVA-OneVision row of T = `budget` crops (0: train's default for images + 1 media): `images` images of
    `sizes` tiled as the data tiles a sample's images (TileRule.sample_grids: batch_num_images counts the images, not
    the clip), then one clip of N frames (at the sampling rate: the fps rule gives N) sampled by the data side's rule
    (mmpipe.data.video.onevision_sample: vision.video_fps / min / max frames, the --video-* flags; fewer frames where
    N is over the crops or the positions the images leave, onevision_share, the text taking all of --text-len), its
    tiling (0, 0, -1, 1 - F): F base crops through the tower and projector, F x ceil(g / 2)^2 + 1 decoder positions
    (image_feature_count). E.g. llava-onevision-qwen2-7b, 16 frames: T = 37, 16 crops, 16 x 196 + 1 = 3137
    positions; beside a 1024 x 768 image (7 crops, 4725 positions) 32 frames -> (8829 - 4725 - 1) // 196 = 20."""
    from ..data.video import ClipInfo, onevision_sample, onevision_share
    from ..model.llava_next import clip_tiling
    rule = tile_rule(cfg, budget, images + 1)
    take = [sizes[k % len(sizes)] for k in range(images)] if sizes and images else []
    try:
        grids = rule.sample_grids(take) if take else []
        share = onevision_share(rule, list(grids), 1)  # the data side's, its text filling --text-len
        sampled, _ = onevision_sample(rule, ClipInfo(frames, rule.video[0], *size), share)
    except BadRecord as e:
        raise ConfigError(f"--video-frames {frames} --video-size {size[0]}x{size[1]}: {e} (--max-tiles "
                          f"{rule.row_tiles}, {images} image(s) beside the clip)") from None
    tilings = tuple(tuple(int(x) for x in g[:4]) for g in grids) + (clip_tiling(sampled),)
    return CropRow(rule.row_tiles, tilings)


# ---- Frames as images (Gemma 4, InternVL: mmpipe.data.video) -------------------------------------------------------
#
# A clip of N frames of W x H at the sampling rate (so the fps rule gives N) is the n frames the family's video
# processor samples (n = N within vision.video_min / max_frames), each an image slot of its own after the text its
# processor writes (Gemma4Processor: `mm:ss ` of the frame's time; InternVLProcessor: `FrameK: `): the row holds
# images + n media, each frame costed as an image of the frame's grid (Gemma 4: at vision.video_soft_tokens, e.g. a
# 1280 x 720 frame at 70: 18 x 33 patches (video processor's aspect-kept resize), 66 soft tokens + 2 brackets;
# InternVL: one crop of the tile size, 256 + 2), the data side's rules called: frame_indices, kind.frame_grid,
# kind.frame_text, kind.check_sample, the row's blocks. The frame text is text: it counts in --text-len.

FRAME_MARK = "\x00"  # a frame's place in its processor's text (split on it: the text before each frame)


@dataclass(frozen=True)
class FrameClip:
    """A clip as the data side lays it out: each sampled frame's grid (as the index records it), its decoder positions
    (its block: brackets and placeholders) and the processor's text before it."""
    frames: int                   # N, --video-frames
    size: tuple[int, int]         # (W, H), --video-size
    grids: tuple[tuple[int, ...], ...]
    blocks: tuple[int, ...]
    texts: tuple[str, ...]

    @property
    def sampled(self) -> int:
        return len(self.grids)

    @property
    def positions(self) -> int:
        """The clip's image positions: its frames' blocks, e.g. 4 frames of 63 soft tokens: 4 x 65 = 260."""
        return sum(self.blocks)

    def text_tokens(self, tok) -> int:
        """The frame text's tokens under tok (the planner has no tokenizer: --text-len holds them)."""
        return sum(len(tok(t, add_special_tokens=False)["input_ids"]) for t in self.texts)


def _sampled(cfg: ModelConfig, frames: int, size: tuple[int, int], budget: int, fps: float = 0.0):
    """(the clip's header, the frames the family's video processor samples from it): N frames of size at fps (0: the
    sampling rate, as --video-frames means them)."""
    from ..data.video import ClipInfo, frame_indices
    kind = image_kind(cfg)
    rule = kind.rule(cfg, budget or kind.budget(cfg, None, 1, []))
    info = ClipInfo(frames, fps or rule.video[0], *size)  # at the sampling rate: the fps rule alone would give N
    return info, frame_indices(kind.video_processor(rule), info, rule.video)


def clip_media(cfg: ModelConfig, frames: int, size: tuple[int, int]) -> int:
    """The media a clip is among a row's (its default budget, --max-images' slots): a frame each where frames are
    images (Gemma 4, InternVL), else one (Qwen's patches, OneVision's crops)."""
    if not image_kind(cfg).frames_as_images:
        return 1
    try:
        return len(_sampled(cfg, frames, size, 0)[1])
    except BadRecord as e:
        raise ConfigError(f"--video-frames {frames}: {e}") from None


def frame_clip(cfg: ModelConfig, frames: int, size: tuple[int, int], images: int = 0, budget: int = 0,
               sizes: list[tuple[int, int]] | None = None, fps: float = 0.0) -> tuple[FrameClip, object, list]:
    """(the clip, its rule, the images' grids) of `images` images of `sizes` (in turn) and a clip of N frames of
    size (at fps; 0: the sampling rate) in a row of `budget` (P patches, T crops; 0: the default for images + n
    media), by the data side's rules; ConfigError in one line where they refuse it (too_many_patches,
    too_many_tiles, bad_aspect)."""
    from ..data.records import VideoRef
    kind = image_kind(cfg)
    info, idx = _sampled(cfg, frames, size, budget, fps)
    media = images + len(idx)
    budget = budget or kind.budget(cfg, None, media, [])
    rule = kind.rule(cfg, budget, media)
    square = (cfg.vision.image_size, cfg.vision.image_size)
    take = [sizes[k % len(sizes)] if sizes else square for k in range(images)]
    blocks = kind.blocks(cfg, media, budget)
    try:
        grids = [tuple(int(x) for x in rule.grid(w, h, media)) for w, h in take]
        grids += [tuple(int(x) for x in kind.frame_grid(rule, info, media))] * len(idx)
        kind.check_sample(rule, np.array(grids, dtype=np.int64), [None] * images + [VideoRef("", j) for j in
                                                                                      range(len(idx))])
    except BadRecord as e:
        flag = kind.flag.replace("_", "-")
        raise ConfigError(f"--video-frames {frames} --video-size {size[0]}x{size[1]}: {e} (--{flag} {budget}, "
                          f"{images} image(s) beside the clip)") from None
    texts = kind.frame_text(info, idx, FRAME_MARK).split(FRAME_MARK)[:len(idx)]
    clip = FrameClip(frames, size, tuple(grids[images:]), tuple(blocks.block_len(g) for g in grids[images:]),
                     tuple(texts))
    return clip, rule, grids[:images]


def frames_clip_row(cfg: ModelConfig, budget: int, frames: int, size: tuple[int, int], images: int,
                    sizes: list[tuple[int, int]] | None) -> CropRow | None:
    """The row of a frames-as-images clip (frame_clip): InternVL's CropRow of T crops, its images' tilings then each
    frame's (h, w, 0, -1): one crop, no tiles, no thumbnail; Gemma 4's None: the planner costs its images as fixed
    slots of the processor's largest (2 + max_soft_tokens positions, 9 x max_soft_tokens patches each), as train's
    default row (--max-patches M x 9 x max_soft_tokens) holds them, so its row is the images + n frame slots."""
    clip, rule, grids = frame_clip(cfg, frames, size, images, budget, sizes)
    if image_kind(cfg).name != "tiles":
        return None
    frame_tilings = tuple((g[0], g[1], 0, -1) for g in clip.grids)
    return CropRow(rule.row_tiles, tuple(tuple(g[:4]) for g in grids) + frame_tilings)


def is_frame(tiling) -> bool:
    """An InternVL clip frame's tiling in a CropRow (frames_clip_row): rows 0, cols -1."""
    return tiling[2] == 0 and tiling[3] < 0


def frame_words(cfg: ModelConfig, run, slots: int = 0) -> str:
    """`mmpipe plan`'s header words for a frames-as-images clip: its frames, each one's grid and positions, and the
    text before each (in --text-len)."""
    size = parse_image_size(run.video_size) if run.video_size else (cfg.vision.image_size,) * 2
    images = max(0, slots - clip_media(cfg, run.video_frames, size))
    clip, _, _ = frame_clip(cfg, run.video_frames, size, images, 0, parse_image_sizes(run.image_size)
                            if run.image_size else None)
    v, grids = cfg.vision, dict.fromkeys(clip.grids)
    if image_kind(cfg).name == "tiles":
        each = f"one {v.image_size} px crop, {clip.blocks[0]} positions"
    else:
        each = "; ".join(f"{h} x {w} patches, {(h * w) // v.pool ** 2} soft tokens" for _, h, w in grids)
        each += f" at vision.video_soft_tokens {v.video_soft_tokens}, + 2 brackets"
    text = clip.texts[-1].strip() if clip.texts else ""
    return (f"a clip of {run.video_frames} frames of {run.video_size or 'vision.image_size'} px -> {clip.sampled} "
            f"frames sampled, each an image slot ({each}) after its text (e.g. {text!r}, in --text-len): "
            f"{clip.positions} image positions")
