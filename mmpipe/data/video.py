"""Clips: a video file -> its grid at index time, from the container's metadata alone, and its pixels when a row is
built, through transformers' own video processors, which this module calls rather than copies. Decoding is PyAV's
(`av` on PyPI; its wheels bundle FFmpeg, so it installs on a fresh machine; docs/video.md says why not torchvision or
decord).

It holds the two ways a family reads a clip, each the clip half of an image kind (mmpipe.data.image_kinds: the kind
calls them, nothing here tests a rule's type):

- patches (Qwen2-VL / Qwen2.5-VL / Qwen3-VL; the `patches` kind): `media_grids`, `clip_patches`, `with_timestamps`,
  on VideoRule and Qwen3VideoRule (below);
- tiles (LLaVA-OneVision; the `tiles` kind): `onevision_grids`, `onevision_frames`, each frame a base crop pooled as
  the model reads it, sampled by `onevision_sample` to the crops and positions the sample's images leave
  (`onevision_share`);

and what both share: `probe` (the stream header), `decode`, `clip_path`, `media_count`, the index's CLIP_COUNTS.

Patches. A clip of F frames at r fps and W x H pixels:

- frames: the processor samples `fps` frames a second (Qwen2.5-VL's 2.0), at least min_frames and at most
  max_frames, floored to a multiple of temporal_patch_size (2): n frames, uniformly spaced (sample_frames);
- frame size: smart_resize of H x W between the video processor's min_pixels and its max_pixels (its own config's,
  which `mmpipe import` keeps in vision.video_*, else the images'), or a smaller per-frame bound where the clip's share
  of the row's P patches over its n / 2 temporal patches is smaller, so a long clip is sampled into smaller frames,
  never truncated (VideoRule.own: the clip at the processor's size alone);
- fewer frames: a clip whose smallest frames still exceed its share is sampled again with the processor's max_frames
  lowered (sample_frames' own parameter: the same fps rule, capped) to the most frames that fit, down to its
  min_frames; one that fits not even then is a bad record (too_many_patches) saying so;
- grid (t, h, w) = (n / 2, h' / p, w' / p) patches, t h w / merge^2 decoder positions;
- Qwen2.5-VL's temporal rotary step: tokens_per_second x temporal_patch_size / sampled_fps positions per temporal
  patch, sampled_fps = n / F x r (transformers' VideoMetadata.sampled_fps), carried to the decoder as its float32
  bits (step_bits; mmpipe.model.qwen2_vl.time_steps reads them back).

Nothing here decodes at index time: `probe` opens the container and reads its stream header (frame count, or its
duration x rate where the container does not store a count: Matroska / WebM), so later stages know every clip's
grid and positions without decoding it, as images' grids come from their size alone (mmpipe.data.patches).
"""
from __future__ import annotations

import collections
import dataclasses
import functools
import math
from dataclasses import dataclass
from pathlib import Path

import numpy as np
import torch

from .patches import PatchRule
from .records import BadRecord, with_markers

DEFAULT_FPS = 2.0        # Qwen2.5-VL's and Qwen3-VL's preprocessor_config.json ("fps": 2.0)
DEFAULT_MIN_FRAMES = 4   # Qwen2VLVideoProcessor's defaults
DEFAULT_MAX_FRAMES = 768


@dataclass(frozen=True)
class ClipInfo:
    """What a container's header says of its first video stream."""
    frames: int
    fps: float
    width: int
    height: int

    @property
    def seconds(self) -> float:
        return self.frames / self.fps


def probe(path) -> ClipInfo:
    """The clip's frame count, rate and size from its container, without decoding a frame; BadRecord bad_video for a
    file PyAV cannot open, empty_video for one without a video stream (an MP4 written with no frame has none) or a
    stream of no frames."""
    import av
    try:
        with av.open(str(path)) as container:
            if not container.streams.video:
                raise BadRecord("empty_video", f"video {path}: no video stream (no frame written)")
            stream = container.streams.video[0]
            rate = stream.average_rate or stream.guessed_rate
            frames = int(stream.frames)
            if not frames and rate and container.duration:  # Matroska / WebM store no count: duration x rate
                frames = round(container.duration / av.time_base * float(rate))
            width, height = stream.codec_context.width, stream.codec_context.height
    except BadRecord:
        raise
    except (av.FFmpegError, OSError, ValueError) as e:
        raise BadRecord("bad_video", f"video {path}: {' '.join(str(e).split())}") from None
    if frames <= 0 or not rate or not width or not height:
        raise BadRecord("empty_video", f"video {path}: {frames} frames at {rate} fps, {width}x{height} in its header")
    return ClipInfo(frames, float(rate), width, height)


def step_bits(step: float) -> int:
    """A float32 step as the int32 of its bits, a tiling entry (mmpipe.model.qwen2_vl.time_steps reads it back)."""
    return int(torch.tensor(step, dtype=torch.float32).view(torch.int32))


@dataclass(frozen=True)
class Clip:
    """A clip as the index records it: the frames sampled, the grid, the temporal rotary step (float32)."""
    indices: tuple[int, ...]
    grid: tuple[int, int, int]
    step: float
    seconds_per_grid: float  # temporal_patch_size / sampled_fps (transformers' second_per_grid_ts)
    fewer: int = 0  # > 0: the frames the fps rule sampled, more than fit the clip's share: fewer were (VideoRule.clip)
    bound: int = 0  # the max_pixels its frames were resized with (VideoRule.frame_bound), which its patches take

    @property
    def tiling(self) -> tuple[int, int, int, int]:
        """The slot's tiling: (t, h, w, step's float32 bits)."""
        return (*self.grid, step_bits(self.step))


@dataclass(frozen=True)
class VideoRule:
    """The video processor's settings for one run: the image rule (patch, merge, temporal, pixels, P) and the
    frame sampling. tokens_per_second: Qwen2.5-VL's vision_config.tokens_per_second (the absolute-time temporal
    rotary), 0 for Qwen2-VL, whose temporal position is the temporal patch's index (step 1)."""
    image: PatchRule
    fps: float = DEFAULT_FPS
    min_frames: int = DEFAULT_MIN_FRAMES
    max_frames: int = DEFAULT_MAX_FRAMES
    tokens_per_second: int = 0
    min_pixels: int = 0  # the video processor's own pixel bounds (0: the images', vision.min_pixels / max_pixels):
    max_pixels: int = 0  # Qwen2-VL's of a frame, Qwen3-VL's of the whole clip (its size shortest / longest_edge)

    def sample(self, info: ClipInfo) -> np.ndarray:
        """The frame indices the processor samples from the clip (its sample_frames on the header's metadata);
        BadRecord empty_video for a clip too short to give one temporal patch."""
        from transformers.video_utils import VideoMetadata
        meta = VideoMetadata(total_num_frames=info.frames, fps=info.fps, width=info.width, height=info.height,
                             duration=info.seconds)
        try:
            idx = self.processor(None).sample_frames(meta, fps=self.fps)
        except (ValueError, ZeroDivisionError) as e:  # fewer frames than a temporal patch: num_frames 0
            raise BadRecord("empty_video", f"video of {info.frames} frames at {info.fps:g} fps: no "
                                           f"{self.image.temporal} frames to sample ({' '.join(str(e).split())})")
        if len(idx) < self.image.temporal:
            raise BadRecord("empty_video", f"video of {info.frames} frames at {info.fps:g} fps: {len(idx)} frames "
                                           f"sampled, fewer than a temporal patch ({self.image.temporal})")
        return np.asarray(idx, dtype=np.int64)

    @property
    def least_pixels(self) -> int:
        """The processor's min_pixels: --video-min-pixels, else the images' (at least one merge unit)."""
        return max(self.min_pixels, self.image.factor ** 2) if self.min_pixels else self.image.min_pixels

    @property
    def most_pixels(self) -> int:
        """The processor's max_pixels: --video-max-pixels or the checkpoint's video processor's
        (vision.video_max_pixels), else the images' (vision.max_pixels: the video processor transformers builds from
        preprocessor_config.json where a checkpoint has no video config); 0: none."""
        return self.max_pixels or self.image.max_pixels

    def row_units(self, n_media: int = 1) -> int:
        """The merge units of the row's P that one of a sample's n_media media may take (P / n, whole units): the
        row's bound alone, for a clip's frames are bounded by the video processor's pixels (most_pixels), not by
        one image's."""
        return self.image.row_patches // max(1, n_media) // (self.image.merge * self.image.merge)

    def frame_cap(self, temporal_patches: int, n_media: int = 1) -> int:
        """max_pixels of one frame: the processor's own (most_pixels, as it is: smart_resize reads it unrounded), or
        less where the clip's share of P over its temporal patches is less (whole merge units), e.g. P = 256 at
        p = 14, merge 2, 4 temporal patches: 64 units / 4 = 16 units x 784 = 12544 px a frame."""
        unit = self.image.merge * self.image.merge * self.image.patch * self.image.patch
        cap = self.row_units(n_media) // max(1, temporal_patches) * unit
        return min(cap, self.most_pixels) if self.most_pixels else cap

    def own(self, info: ClipInfo) -> Clip:
        """The clip as its video processor alone makes it: no row's P to share (what `generate --video` answers on,
        and what the data report compares a row's clip with)."""
        return dataclasses.replace(self, image=dataclasses.replace(self.image, row_patches=1 << 40)).clip(info)

    def clip(self, info: ClipInfo, n_media: int = 1) -> Clip:
        """The clip's sampled frames, grid and step, by the processor's rules: its fps sampling, frames made smaller
        to fit the clip's share of the row, then, where even its smallest frames do not fit, fewer frames (the
        processor's max_frames lowered to the most that fit, not below its min_frames: Clip.fewer); BadRecord for a
        clip they refuse or one that does not fit even at min_frames frames of the smallest size."""
        idx = self.sample(info)
        grid, share = self._grid(info, len(idx), n_media)
        fewer = 0
        if int(np.prod(grid)) > share:
            fewer, idx, grid = self._fewer(info, len(idx), n_media, share, grid)
        r = self.image
        sampled_fps = len(idx) / info.frames * info.fps  # transformers' VideoMetadata.sampled_fps
        seconds = float(np.float32(r.temporal / sampled_fps))  # second_per_grid_ts, a float32 tensor in transformers
        step = float(np.float32(self.tokens_per_second * np.float32(seconds))) if self.tokens_per_second else 1.0
        return Clip(tuple(int(i) for i in idx), grid, step, seconds, fewer, self.frame_bound(info, len(idx), n_media))

    def _grid(self, info: ClipInfo, frames: int, n_media: int) -> tuple[tuple[int, int, int], int]:
        """(the grid of `frames` sampled frames, the patches the clip may take: its share of P)."""
        r = self.image
        try:
            h, w = self.frame_size(info, frames, n_media)
        except ValueError as e:  # the processor's 200:1 aspect limit
            raise BadRecord("bad_aspect", f"video {info.width}x{info.height}: {' '.join(str(e).split())}") from None
        t = math.ceil(frames / r.temporal)  # the processor pads a last odd frame by repeating it
        return (t, h // r.patch, w // r.patch), self.row_units(n_media) * r.merge * r.merge

    def _fewer(self, info: ClipInfo, frames: int, n_media: int, share: int, grid) -> tuple[int, np.ndarray, tuple]:
        """(frames sampled at first, the indices, grid) of the clip sampled with the processor's max_frames lowered
        to the most frames (a bisection over max_frames) whose grid fits the share; BadRecord too_many_patches where
        not even max(min_frames, a temporal patch) frames fit."""
        least = max(self.min_frames, self.image.temporal)

        def at(m: int):
            idx = dataclasses.replace(self, max_frames=m).sample(info)
            return idx, self._grid(info, len(idx), n_media)[0]
        lo_idx, lo_grid = at(least)
        if least >= frames or int(np.prod(lo_grid)) > share:
            raise BadRecord("too_many_patches", f"video {info.width}x{info.height}, {frames} frames sampled: a "
                                                f"{'x'.join(map(str, grid))} patch grid, {int(np.prod(grid))} patches, "
                                                f"and {len(lo_idx)} frames (min_frames) of its smallest size still "
                                                f"{int(np.prod(lo_grid))} > the {share} one of a sample's {n_media} "
                                                f"media may take (--max-patches, vision.max_pixels)")
        lo, hi = least, frames - 1  # lo fits, frames does not
        while lo < hi:
            mid = (lo + hi + 1) // 2
            if int(np.prod(at(mid)[1])) <= share:
                lo = mid
            else:
                hi = mid - 1
        idx, g = at(lo)
        return frames, idx, g

    def frame_bound(self, info: ClipInfo, frames: int, n_media: int = 1) -> int:
        """The max_pixels the processor resizes the clip's `frames` frames with: its own (most_pixels) where the
        frames it makes at that bound fit the clip's share of the row, else the share (row_bound). Checked on the
        result, not the bound: smart_resize scales by sqrt(H W / bound) and floors, so its own result given again as
        the bound can come out smaller (168 x 112 at 9408 px -> 56 x 112 = 6272; at 6272 -> 56 x 84)."""
        row, most = self.row_bound(frames, n_media), self.most_pixels
        if not most or most <= row:
            return most or row
        return most if self.fits(*self.resized(info, frames, most), frames, row) else row

    def row_bound(self, frames: int, n_media: int = 1) -> int:
        """The clip's share of the row as a bound on a frame's pixels (frame_cap without the processor's own)."""
        unit = self.image.merge * self.image.merge * self.image.patch * self.image.patch
        return self.row_units(n_media) // max(1, math.ceil(frames / self.image.temporal)) * unit

    @staticmethod
    def fits(h: int, w: int, frames: int, bound: int) -> bool:
        return h * w <= bound  # a frame's pixels

    def resized(self, info: ClipInfo, frames: int, bound: int) -> tuple[int, int]:
        """(h', w') of the clip's frames: Qwen2VLVideoProcessor's smart_resize at a frame's max_pixels `bound`."""
        from transformers.models.qwen2_vl.video_processing_qwen2_vl import smart_resize
        r = self.image
        return smart_resize(info.height, info.width, factor=r.factor, min_pixels=self.least_pixels,
                            max_pixels=max(bound, r.factor * r.factor))

    def frame_size(self, info: ClipInfo, frames: int, n_media: int = 1) -> tuple[int, int]:
        """(h', w') of the clip's frames: the processor's resize at frame_bound."""
        return self.resized(info, frames, self.frame_bound(info, frames, n_media))

    def processor(self, clip: Clip | None, n_media: int = 1):
        """transformers' video processor at the clip's frame bound (None: any bound, for its sample_frames)."""
        return _processor(self, clip.bound if clip else 0)

    def patches(self, path, clip: Clip, n_media: int = 1) -> torch.Tensor:
        """float32 [t h w, patch_dim]: the clip's sampled frames decoded (PyAV) and made into patches by the
        processor, at the frame bound its index grid was made with; BadRecord bad_video if the file no longer
        decodes to them."""
        frames = decode(path, clip.indices)
        out = self.processor(clip, n_media)(videos=[frames], return_tensors="pt")
        got = tuple(int(g) for g in out["video_grid_thw"][0])
        if got != clip.grid:
            raise BadRecord("bad_video", f"video {path}: decodes to a {got} grid, its index says {clip.grid}")
        return out["pixel_values_videos"].float()


@dataclass(frozen=True)
class Qwen3VideoRule(VideoRule):
    """Qwen3-VL's clips, through transformers' Qwen3VLVideoProcessor: its sample_frames (frames spread evenly from the
    first to the last, any count: an odd last temporal patch repeats its frame), its smart_resize, which bounds the
    whole clip's pixels (the clip's share of P x p^2 x temporal_patch_size: its frames' pixels), and no temporal
    rotary step: each temporal patch is a block of its own after its timestamp text (timestamps), so a clip takes
    t slots of grid (1, h, w) in a row (frame_grids)."""

    def resized(self, info: ClipInfo, frames: int, bound: int) -> tuple[int, int]:
        """Qwen3VLVideoProcessor's smart_resize at a whole-clip bound."""
        from transformers.models.qwen3_vl.video_processing_qwen3_vl import smart_resize
        r = self.image
        return smart_resize(frames, info.height, info.width, temporal_factor=r.temporal, factor=r.factor,
                            min_pixels=self.least_pixels, max_pixels=bound)

    def row_bound(self, frames: int, n_media: int = 1) -> int:
        r = self.image  # the clip's share of P over all its frames (patches x p^2 x temporal_patch_size)
        return self.row_units(n_media) * r.merge * r.merge * r.patch * r.patch * r.temporal

    def fits(self, h: int, w: int, frames: int, bound: int) -> bool:
        t = self.image.temporal  # the clip's pixels over its temporal patches' frames
        return math.ceil(frames / t) * t * h * w <= bound

    def clip_pixels(self, n_media: int = 1) -> int:
        """The clip's pixels over all its frames: the processor's own size longest_edge (most_pixels: its video
        config's, --video-max-pixels, else the images'; a whole-clip bound), or less where the clip's share of P
        is less (its merge units x merge^2 x p^2 x temporal_patch_size)."""
        r = self.image
        share = self.row_units(n_media) * r.merge * r.merge * r.patch * r.patch * r.temporal
        return min(share, self.most_pixels) if self.most_pixels else share

    def clip(self, info: ClipInfo, n_media: int = 1) -> Clip:
        c = super().clip(info, n_media)
        return dataclasses.replace(c, step=0.0)  # no absolute-time rotary: the timestamps say the time

    def processor(self, clip: Clip | None, n_media: int = 1):
        return _qwen3_processor(self, clip.bound if clip else self.clip_pixels(n_media))

    def timestamps(self, info: ClipInfo, clip: Clip) -> list[str]:
        """The text before each temporal patch's block, as Qwen3VLProcessor writes it (its replace_video_token on the
        clip's grid and sampled frames): e.g. ['<0.3 seconds>', '<1.2 seconds>']."""
        from transformers import Qwen3VLProcessor
        from transformers.video_utils import VideoMetadata
        meta = VideoMetadata(total_num_frames=info.frames, fps=info.fps, width=info.width, height=info.height,
                             frames_indices=list(clip.indices))
        # replace_video_token reads only the processor's markers and its video processor's merge / temporal sizes:
        # a processor object without a tokenizer serves, with the markers blank so only the timestamps remain
        proc = Qwen3VLProcessor.__new__(Qwen3VLProcessor)
        proc.video_processor, proc.vision_start_token, proc.vision_end_token, proc.video_token = \
            self.processor(clip), "", "", ""
        grid = torch.tensor([[clip.grid[0], self.image.merge, self.image.merge]])
        text = proc.replace_video_token({"video_grid_thw": grid, "video_metadata": [meta]}, 0)
        return [f"<{part}" for part in text.split("<")[1:]]

    @staticmethod
    def frame_grids(clip: Clip) -> list[tuple[int, int, int]]:
        """The clip's slots in a row: one (1, h, w) per temporal patch, as transformers' Qwen3-VL get_rope_index
        splits a video's grid; the tower attends within each frame either way."""
        return [(1, *clip.grid[1:])] * clip.grid[0]


@functools.lru_cache(maxsize=16)
def _qwen3_processor(rule: VideoRule, clip_pixels: int):
    from transformers import Qwen3VLVideoProcessor
    r = rule.image
    return Qwen3VLVideoProcessor(patch_size=r.patch, merge_size=r.merge, temporal_patch_size=r.temporal,
                                 size={"shortest_edge": rule.least_pixels, "longest_edge": clip_pixels},
                                 image_mean=list(r.mean), image_std=list(r.std), fps=rule.fps,
                                 min_frames=rule.min_frames, max_frames=rule.max_frames, do_sample_frames=False,
                                 cap_pixels_per_frame=False)


@functools.lru_cache(maxsize=16)
def _processor(rule: VideoRule, max_pixels: int):
    """transformers' video processor at the run's settings; frames are sampled at index time (sample), so the call
    takes exactly the decoded frames (do_sample_frames False)."""
    from transformers import Qwen2VLVideoProcessor
    r = rule.image
    return Qwen2VLVideoProcessor(patch_size=r.patch, merge_size=r.merge, temporal_patch_size=r.temporal,
                                 min_pixels=rule.least_pixels, max_pixels=max(max_pixels, r.factor * r.factor),
                                 image_mean=list(r.mean), image_std=list(r.std), fps=rule.fps,
                                 min_frames=rule.min_frames, max_frames=rule.max_frames, do_sample_frames=False,
                                 cap_pixels_per_frame=False)


def decode(path, indices) -> np.ndarray:
    """uint8 [n, H, W, 3]: the frames at `indices` (sorted, as sample gives them), decoded in one pass with PyAV
    (a frame index is its place in decoding order); BadRecord bad_video for a file that stops short or fails."""
    import av
    want, out = sorted(set(int(i) for i in indices)), {}
    try:
        with av.open(str(path)) as container:
            for k, frame in enumerate(container.decode(video=0)):
                if k in want:
                    out[k] = frame.to_ndarray(format="rgb24")
                if k >= want[-1]:
                    break
    except (av.FFmpegError, OSError, ValueError) as e:
        raise BadRecord("bad_video", f"video {path}: {' '.join(str(e).split())}") from None
    if len(out) < len(want):
        raise BadRecord("bad_video", f"video {path}: decoded {len(out)} of the {len(want)} frames its header promised")
    return np.stack([out[int(i)] for i in indices])


def record_clips(videos: list, marker_count: int, root, rule: VideoRule, n_media: int = 1) -> list[tuple]:
    """[(path, ClipInfo, Clip)] of a LLaVA-style record's `"video"` paths (relative to root) against its user turns'
    <video> markers, from the headers alone; BadRecord video_marker where the markers and the videos disagree (a
    marker without a clip, a clip without a marker), else each clip's own refusal (probe, VideoRule.clip)."""
    if marker_count != len(videos):
        raise BadRecord("video_marker", f"{marker_count} <video> marker(s) for {len(videos)} video(s)")
    out = []
    for v in videos:
        path = Path(root) / v
        if not path.is_file():
            raise BadRecord("bad_video", f"video {v}: no such file under {root}")
        info = probe(path)
        out.append((path, info, rule.clip(info, n_media)))
    return out


def video_rule(image_rule: PatchRule) -> VideoRule:
    """The run's clip rule from its image rule: Qwen3-VL's (its tower) or Qwen2-VL's, at the run's sampling
    (vision.video_*, the --video-* flags; the processors' defaults for a rule without them) and the model's
    tokens_per_second."""
    fps, least, most, min_px, max_px = image_rule.video or (DEFAULT_FPS, DEFAULT_MIN_FRAMES, DEFAULT_MAX_FRAMES, 0, 0)
    sampling = dict(fps=fps, min_frames=least, max_frames=most, min_pixels=min_px, max_pixels=max_px)
    if image_rule.timestamps:
        return Qwen3VideoRule(image_rule, **sampling)
    return VideoRule(image_rule, tokens_per_second=image_rule.tokens_per_second, **sampling)


def media_count(media: list) -> int:
    """A sample's media as they share the row's P: each image, each clip once (its temporal patches' slots too)."""
    from .records import VideoRef
    return sum(1 for m in media if not isinstance(m, VideoRef) or m.frame <= 0)


def media_grids(media: list, rule: PatchRule, image_root, max_pixels: int) -> tuple[np.ndarray, dict]:
    """(int64 [n, rule.grid_width], clip counts): the grids of a sample's images and clips (VideoRef) in their order,
    each within its share of P (a sample's media share the row as its images do, media_count): an image's from its
    size (the columns after (t, h, w) zero), a clip's from its container header (and its step's float32 bits where
    the rule scales time; a Qwen3-VL clip's temporal patch j, its own slot: (1, h, w)), nothing decoded; and what the
    data report says of the clips (CLIP_COUNTS: clips, their frames, the frames sampled, the clips whose frames were
    made smaller than their own size). BadRecord for a medium its rule refuses."""
    from .images import check_image
    from .records import VideoRef
    n, clips, out, counts = media_count(media), video_rule(rule), [], dict.fromkeys(CLIP_COUNTS, 0)
    for m in media:
        if isinstance(m, VideoRef):
            info = probe(clip_path(m, image_root))
            clip = clips.clip(info, n)
            out.append(((1, *clip.grid[1:]) if m.frame >= 0 else clip.tiling)[:rule.grid_width])
            if m.frame <= 0:  # a clip once, not once per temporal-patch slot
                smaller = clip.grid[1:] != clips.own(info).grid[1:]  # its frames: the row's share, not the processor
                for key, add in zip(CLIP_COUNTS, (1, info.frames, len(clip.indices), int(smaller), int(clip.fewer > 0),
                                                  clip.fewer and clip.fewer - len(clip.indices))):
                    counts[key] += add
        else:
            w, h = check_image(m, image_root, max_pixels)
            out.append((*rule.grid(w, h, n), 0)[:rule.grid_width])
    return np.array(out, dtype=np.int64).reshape(-1, rule.grid_width), slot_counts(media, counts)


def slot_counts(media: list, counts: dict) -> dict:
    """counts with the sample's image slots its clips take (clip_slots: a clip's one, a Qwen3-VL clip's one per
    temporal patch) and whether clips are all its media (clip_only_records), so that the run's summary counts its
    images and clips apart (mmpipe.runtime.steplog.data_counts)."""
    from .records import VideoRef
    slots = sum(isinstance(m, VideoRef) for m in media)
    return dict(counts, clip_slots=slots, clip_only_records=int(slots == len(media) > 0))


# the index's clip counts (DataIndex.stats), summed over the good records: mmpipe.data.index.describe's line
CLIP_COUNTS = ("clips", "clip_frames", "clip_frames_sampled", "clips_resized", "clips_fewer_frames",
               "clip_frames_dropped", "clip_slots", "clip_only_records")


def clip_path(ref, image_root) -> Path:
    """A clip's file under the data's image root; BadRecord bad_video where there is none."""
    path = Path(image_root or ".") / ref.path
    if not path.is_file():
        raise BadRecord("bad_video", f"video {ref.path}: no such file under {image_root or '.'}")
    return path


def with_timestamps(rec, rule: PatchRule, image_root, marker: str):
    """Qwen3-VL's clips in a record (rule.timestamps; else rec unchanged): each clip's marker becomes, per temporal
    patch, its timestamp text and a marker of its own (`<0.3 seconds><image><1.7 seconds><image>`), and the clip
    its temporal patches (VideoRef frame j), so the text is tokenized with the timestamps in place, as
    Qwen3VLProcessor writes the prompt, and each temporal patch is a slot of grid (1, h, w). The k-th marker of the
    user turns is the k-th medium (mmpipe.data.sources.with_videos)."""
    import dataclasses as dc

    from .records import VideoRef
    if not rule.timestamps or not any(isinstance(m, VideoRef) and m.frame < 0 for m in rec.images):
        return rec
    clips, n = video_rule(rule), media_count(rec.images)
    texts, media = [], []
    for m in rec.images:
        if isinstance(m, VideoRef) and m.frame < 0:
            info = probe(clip_path(m, image_root))
            clip = clips.clip(info, n)
            texts.append("".join(f"{stamp}{marker}" for stamp in clips.timestamps(info, clip)))
            media += [VideoRef(m.path, j) for j in range(clip.grid[0])]
        else:
            texts.append(marker)
            media.append(m)
    return dc.replace(rec, messages=with_markers(rec.messages, marker, texts), images=media)


# Decoded clips kept per loader process, the most recently read first, up to this many bytes of patches: a Qwen3-VL
# clip's temporal-patch slots, read one after the other for its row, decode it once, and a set of clips read again
# every epoch decodes each once while it fits (decoding and the video processor take ~40 ms a 4-frame 56 px clip
# here, the model's step on it ~1 ms). 256 MiB holds ~6 clips of 16 frames at 448 px (8 x 32 x 32 patches x 1176
# floats x 4 B = 38.5 MB each), thousands of small ones.
CLIP_CACHE_BYTES = 256 * 2 ** 20
_clip_cache: collections.OrderedDict = collections.OrderedDict()
_cached = [0]  # bytes of patches in _clip_cache


def _clip_patches(path: Path, rule: PatchRule, n_media: int) -> tuple[tuple, torch.Tensor]:
    """(the clip's tiling, its patches), from the cache when this process read the clip lately."""
    key = (path, rule, n_media)
    if key in _clip_cache:
        _clip_cache.move_to_end(key, last=False)
        return _clip_cache[key]
    clips = video_rule(rule)
    clip = clips.clip(probe(path), n_media)
    got = clip.tiling, clips.patches(path, clip, n_media)
    _clip_cache[key] = got
    _clip_cache.move_to_end(key, last=False)
    _cached[0] += got[1].nbytes
    while len(_clip_cache) > 1 and _cached[0] > CLIP_CACHE_BYTES:
        _cached[0] -= _clip_cache.popitem(last=True)[1][1].nbytes  # the least recently read
    return got


def clip_patches(ref, rule: PatchRule, image_root, n_media: int, grid) -> torch.Tensor:
    """A record's clip (VideoRef) as the model reads it: its patches (a Qwen3-VL temporal patch's: its share of
    them), the frames sampled again from the header and decoded; BadRecord bad_video if they no longer give the
    index's grid."""
    tiling, patches = _clip_patches(clip_path(ref, image_root), rule, n_media)
    want = tuple(int(g) for g in grid)
    got = ((1, *tiling[1:3]) if ref.frame >= 0 else tiling)[:len(want)]
    if tuple(got) != want:
        raise BadRecord("bad_video", f"video {ref.path}: gives grid {got}, the index recorded {want}")
    if ref.frame < 0:
        return patches
    per = tiling[1] * tiling[2]
    return patches[ref.frame * per:(ref.frame + 1) * per]


# ---- LLaVA-OneVision (the llava_next family's any-resolution tiles at vision.anyres_max > 0) ----------------------
#
# A clip is F frames sampled by transformers' LlavaOnevisionVideoProcessor.sample_frames (its fps rule at
# vision.video_fps; num_frames = min_frames / max_frames where the fps rule gives fewer / more), each resized to the
# tower's crop (image_size x image_size) by that processor: a slot of F crops of the row's T (--max-tiles), tiling
# (0, 0, -1, 1 - F) (mmpipe.model.llava_next.clip_tiling) and LlavaOnevisionProcessor's count of F ceil(g / 2)^2 + 1
# positions. Its frames cannot be made smaller (a crop is the tower's size): a clip over its share of the row (the
# crops of T and the positions the sample's images and text leave, over its clips: onevision_share) is sampled to fewer
# frames (num_frames = the share), not below min_frames; then it is a bad record (too_many_tiles). The images of a
# sample with a clip are tiled as transformers tiles them (batch_num_images counts images, not clips).


def onevision_grids(media: list, rule, image_root, max_pixels: int, spare: int = 0) -> tuple[np.ndarray, dict]:
    """media_grids for tiles: int64 [n, 5] (the images' TileRule grids, each clip's (*clip_tiling(F), positions)),
    and the clip counts; BadRecord unsupported_media for LLaVA-NeXT (anyres_max 0: transformers' LlavaNext reads no
    clips), too_many_tiles for a clip that does not fit at min_frames. spare: text positions the sample leaves."""
    from ..model.llava_next import clip_tiling
    from .images import check_image
    from .records import VideoRef
    if not rule.anyres_max:
        raise BadRecord("unsupported_media", "a video for LLaVA-NeXT (vision.anyres_max 0), whose model reads no "
                                             "clips; LLaVA-OneVision's does")
    images = [m for m in media if not isinstance(m, VideoRef)]
    sizes = {id(m): check_image(m, image_root, max_pixels) for m in images}
    grids = {id(m): rule.grid(*sizes[id(m)], len(images)) for m in images}
    clips = [m for m in media if isinstance(m, VideoRef)]
    share = onevision_share(rule, list(grids.values()), len(clips), spare)
    out, counts = [], dict.fromkeys(CLIP_COUNTS, 0)
    for m in media:
        if not isinstance(m, VideoRef):
            out.append(grids[id(m)])
            continue
        info = probe(clip_path(m, image_root))
        frames, fewer = onevision_sample(rule, info, share)
        out.append((*clip_tiling(frames), _onevision_count(rule, frames)))
        for key, add in zip(CLIP_COUNTS, (1, info.frames, frames, int(info.width * info.height > rule.size ** 2),
                                          int(fewer > 0), fewer and fewer - frames)):
            counts[key] += add
    return np.array(out, dtype=np.int64).reshape(-1, 5), slot_counts(media, counts)


def _onevision_settings(rule) -> tuple[float, int, int]:
    fps, least, most = (rule.video or (DEFAULT_FPS, DEFAULT_MIN_FRAMES, DEFAULT_MAX_FRAMES))[:3]
    return fps, least, most


def onevision_share(rule, grids: list, clips: int, spare: int = 0) -> int:
    """The frames each of a sample's `clips` clips may take beside its images (their TileRule `grids`), over the
    clips: the crops they leave of T, and the decoder positions they leave of the row's, at ceil(g / 2)^2 a frame
    and one newline a clip. The row's: at least TileRule.image_positions (room for its largest image) + --text-len;
    the sample's text takes --text-len - spare of it. E.g. llava-onevision-qwen2-7b, T = 37, a 1024 x 768 image beside
    (7 crops, 4725 positions), spare 0: 30 crops, but (8829 - 4725 - 1) // 196 = 20 frames."""
    from ..model.llava_next import pooled_side
    n = max(1, clips)
    crops = (rule.row_tiles - sum(rule.crops(g) for g in grids)) // n
    room = (rule.image_positions() + max(0, spare) - sum(rule.positions(g) for g in grids)) // n
    return min(crops, (room - 1) // pooled_side(rule.side) ** 2)


def onevision_sample(rule, info: ClipInfo, share: int) -> tuple[int, int]:
    """(frames sampled, the fps rule's count where more than fit the share: 0 when none were dropped)."""
    fps, least, most = _onevision_settings(rule)
    proc, meta = _onevision_processor(rule), _metadata(info)
    n = len(proc.sample_frames(meta, fps=fps))  # its fps rule: max(1, int(F / r x fps)) frames
    n = min(max(n, least), most, info.frames)
    if n <= share:
        return n, 0
    floor = min(least, info.frames)
    if share < floor:
        raise BadRecord("too_many_tiles", f"video {info.width}x{info.height}, {info.frames} frames: {n} frames sampled "
                                          f"take {n} crops, and even {floor} (min_frames) > the {max(share, 0)} the "
                                          f"row's {rule.row_tiles} crops (--max-tiles) and its positions leave it "
                                          f"beside the sample's images")
    return share, n


def onevision_frames(path, rule, rows: int, cols: int) -> torch.Tensor:
    """float32 [F, C, S, S]: a clip's F = 1 - cols frames (its index grid's), sampled by the processor at
    num_frames F, decoded (PyAV) and resized / normalised by LlavaOnevisionVideoProcessor."""
    if rows >= 0:
        raise BadRecord("bad_video", f"video {path}: the index recorded an image's tiling for it")
    frames, proc = 1 - cols, _onevision_processor(rule)
    idx = proc.sample_frames(_metadata(probe(path)), num_frames=frames)
    out = proc(videos=[decode(path, [int(i) for i in idx])], return_tensors="pt")["pixel_values_videos"][0]
    return out.float()


def _metadata(info: ClipInfo):
    from transformers.video_utils import VideoMetadata
    return VideoMetadata(total_num_frames=info.frames, fps=info.fps, width=info.width, height=info.height,
                         duration=info.seconds)


def _onevision_count(rule, frames: int) -> int:
    """Decoder positions of a clip of `frames` frames: LlavaOnevisionProcessor's own count."""
    from .anyres import _counter
    return int(_counter(rule)._get_num_multimodal_tokens(video_sizes=[[frames, rule.size, rule.size]])
               ["num_video_tokens"][0])


@functools.lru_cache(maxsize=8)
def _onevision_processor(rule):
    from transformers import LlavaOnevisionVideoProcessor
    return LlavaOnevisionVideoProcessor(size={"height": rule.size, "width": rule.size}, image_mean=list(rule.mean),
                                        image_std=list(rule.std), do_sample_frames=False)


# ---- Frames as images (Gemma 4, InternVL) --------------------------------------------------------------------------
#
# Their processors take a clip as a run of frames, each an image of its own with text before it: Gemma4Processor
# writes `mm:ss <start_of_image><|video|> x n<end_of_image>` per frame, joined by spaces, n the frame's soft tokens at
# its video processor's max_soft_tokens; InternVLProcessor `Frame{i}: <img><IMG_CONTEXT> x 256</img>` per frame,
# joined by newlines, each frame one crop of the tile size. So a clip's marker becomes that text with an image marker
# per frame (`frames_laid_out`, the text from the processor's own replace_video_token), the clip its frames
# (VideoRef frame j: a slot of its own, as a Qwen3-VL temporal patch), each slot's grid and pixels the family's
# (its kind: frame_grid, the video processor). Frames sampled: n = max(1, int(F / r x fps)) of a clip of F frames at
# r fps (transformers' default_sample_indices_fn count at vision.video_fps), at least video_min_frames and at most
# video_max_frames, never more than F; which n: the family's video processor's own sample_frames at num_frames n
# (Gemma4VideoProcessor: i F // n; InternVLVideoProcessor: the middle of each of n equal spans).


def frame_indices(proc, info: ClipInfo, sampling: tuple) -> np.ndarray:
    """The frames `proc` (a transformers video processor) samples from the clip at sampling (fps, min_frames,
    max_frames), e.g. 7 frames at 3 fps, 2 fps: int(7 / 3 x 2) = 4 frames; BadRecord empty_video where it
    samples none."""
    fps, least, most = sampling
    n = min(max(max(1, int(info.frames / info.fps * fps)), least), most, info.frames)
    try:
        idx = np.asarray(proc.sample_frames(_metadata(info), num_frames=n), dtype=np.int64)
    except (ValueError, ZeroDivisionError) as e:
        raise BadRecord("empty_video", f"video of {info.frames} frames at {info.fps:g} fps: no frames to sample "
                                       f"({' '.join(str(e).split())})") from None
    if not len(idx):
        raise BadRecord("empty_video", f"video of {info.frames} frames at {info.fps:g} fps: no frames sampled")
    return idx


def frames_laid_out(rec, kind, rule, image_root, marker: str):
    """A record whose clips (VideoRef, frame -1) are laid out as the kind's processor writes them: each clip's marker
    the processor's text with `marker` per frame (kind.frame_text), the clip its sampled frames VideoRef(path, j);
    rec unchanged without clips. The k-th marker of the user turns is the k-th medium."""
    import dataclasses as dc

    from .records import VideoRef
    if not any(isinstance(m, VideoRef) and m.frame < 0 for m in rec.images):
        return rec
    texts, media = [], []
    for m in rec.images:
        if isinstance(m, VideoRef) and m.frame < 0:
            info = probe(clip_path(m, image_root))
            idx = frame_indices(kind.video_processor(rule), info, rule.video)
            texts.append(kind.frame_text(info, idx, marker))
            media += [VideoRef(m.path, j) for j in range(len(idx))]
        else:
            texts.append(marker)
            media.append(m)
    return dc.replace(rec, messages=with_markers(rec.messages, marker, texts), images=media)


def frames_grids(media: list, kind, rule, image_root, max_pixels: int) -> tuple[np.ndarray, dict]:
    """(int64 [n, grid width], clip counts) of a laid-out sample's media (frames_laid_out): each image's grid by the
    rule, each frame's by kind.frame_grid from its clip's header, all n media sharing the row's budget as images
    (kind.check_sample: too_many_tiles / too_many_patches over it); nothing decoded."""
    from .images import check_image
    from .records import VideoRef
    out, counts, n = [], dict.fromkeys(CLIP_COUNTS, 0), len(media)
    for m in media:
        if isinstance(m, VideoRef):
            info = probe(clip_path(m, image_root))
            out.append(kind.frame_grid(rule, info, n))
            if m.frame <= 0:  # a clip once, not once per frame
                idx = frame_indices(kind.video_processor(rule), info, rule.video)
                for key, add in zip(CLIP_COUNTS, (1, info.frames, len(idx))):
                    counts[key] += add
        else:
            w, h = check_image(m, image_root, max_pixels)
            out.append(rule.grid(w, h, n))
    grids = np.array(out, dtype=np.int64).reshape(n, -1)
    kind.check_sample(rule, grids, media)
    return grids, slot_counts(media, counts)


def frame_pixels(ref, kind, rule, image_root) -> torch.Tensor:
    """The video processor's output for frame ref.frame of its clip: all the clip's sampled frames decoded (PyAV) and
    processed at once (kind.video_processor, frames given, not sampled again), kept in the loader's clip cache, so a
    clip's frame slots decode it once."""
    path = clip_path(ref, image_root)
    key = ("frames", path, rule)
    if key not in _clip_cache:
        proc = kind.video_processor(rule)
        idx = frame_indices(proc, probe(path), rule.video)
        out = proc(videos=[decode(path, [int(i) for i in idx])], do_sample_frames=False,
                   return_tensors="pt")["pixel_values_videos"]
        _clip_cache[key] = (tuple(int(i) for i in idx), _per_frame(out))
        _cached[0] += _clip_cache[key][1].nbytes
        while len(_clip_cache) > 1 and _cached[0] > CLIP_CACHE_BYTES:
            _cached[0] -= _clip_cache.popitem(last=True)[1][1].nbytes
    _clip_cache.move_to_end(key, last=False)
    frames = _clip_cache[key][1]
    if not 0 <= ref.frame < len(frames):
        raise BadRecord("bad_video", f"video {ref.path}: no frame {ref.frame} among its {len(frames)} sampled")
    return frames[ref.frame]


def _per_frame(out: torch.Tensor) -> torch.Tensor:
    """float32 [frames, ...]: a video processor's pixel_values_videos, frames first (InternVL's [1, F, C, S, S],
    Gemma 4's [F, patches, patch_dim])."""
    return (out[0] if out.shape[0] == 1 and out.dim() == 5 else out).float()
