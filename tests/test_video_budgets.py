"""Whole-clip budgets and the clip sampling flags (issue 44): a clip whose smallest frames do not fit its share of
the row's P is sampled again with the video processor's own max_frames lowered (its fps rule, capped), said in the
data report, never truncated; one that fits not even at min_frames is a bad record saying so; --video-fps,
--video-min-frames, --video-max-frames, --video-min-pixels and --video-max-pixels are train / plan / generate flags
(one line and exit status 2 for a bad value) that reach transformers' processor: the grids and patches change as
the processor's own do. No model: the rules and the processors alone."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mmpipe.config import load_preset
from mmpipe.data.args import DataArgs
from mmpipe.data.patches import PatchRule, patch_rule
from mmpipe.data.records import BadRecord
from mmpipe.data.video import ClipInfo, Qwen3VideoRule, VideoRule, decode, media_grids, probe, video_rule
from qwen_models import PIXELS
from video_clips import moving_square, write_clip

MEAN, STD = (0.48145466, 0.4578275, 0.40821073), (0.26862954, 0.26130258, 0.27577711)
# P = 16 patches at p = 14: under a frame bound below min_pixels smart_resize makes a frame one merge unit (28 x 28,
# 2 x 2 patches), so a clip fits 4 temporal patches (8 frames); 30 frames at 10 fps sample 6 at 2 fps (3 temporal
# patches: fits), 60 at 10 fps sample 12 (6 temporal patches, 24 patches: over) -> sampled again at max_frames 8
P = 16


def _qwen2(p: int = P, **kw) -> VideoRule:
    return VideoRule(PatchRule(14, 2, 2, 3, PIXELS["min_pixels"], PIXELS["max_pixels"], p, MEAN, STD), **kw)


@pytest.fixture(scope="module")
def long_clip(tmp_path_factory):
    path = tmp_path_factory.mktemp("budget") / "long.mp4"
    write_clip(path, moving_square(60, 56, 56), 10)
    return path


def _meta(info: ClipInfo):
    from transformers.video_utils import VideoMetadata
    return VideoMetadata(total_num_frames=info.frames, fps=info.fps, width=info.width, height=info.height,
                         duration=info.seconds)


def test_a_long_clip_is_sampled_to_fewer_frames_by_the_processors_max_frames(long_clip):
    """12 frames sampled at 2 fps are 6 temporal patches of at least 4 patches: 24 > P = 16. The clip is sampled
    again by Qwen2VLVideoProcessor.sample_frames at max_frames 8 (the most that fit), and its patches are the
    processor's own on the decoded file at those settings (do_sample_frames, max_frames 8): nothing truncated."""
    from transformers import Qwen2VLVideoProcessor
    rule = _qwen2()
    info = probe(long_clip)
    assert (info.frames, info.fps) == (60, 10)
    clip = rule.clip(info)
    proc = Qwen2VLVideoProcessor(min_pixels=PIXELS["min_pixels"], max_pixels=rule.frame_cap(4), fps=2.0,
                                 max_frames=8, do_sample_frames=True, cap_pixels_per_frame=False)
    want = proc.sample_frames(_meta(info), fps=2.0)
    assert clip.indices == tuple(int(i) for i in want) == (0, 7, 15, 22, 30, 37, 45, 52)  # spread over the clip
    assert (clip.grid, clip.fewer) == ((4, 2, 2), 12)
    frames = np.stack([f for f in decode(long_clip, range(60))])
    out = proc(videos=[frames], video_metadata=[_meta(info)], return_tensors="pt")
    assert tuple(out["video_grid_thw"][0].tolist()) == clip.grid
    assert torch.equal(rule.patches(long_clip, clip), out["pixel_values_videos"].float())
    # sampled_fps follows the frames kept: 8 of 60 at 10 fps -> 2 / (8 / 6) = 1.5 s a temporal patch
    assert clip.seconds_per_grid == pytest.approx(1.5)
    # a clip that fits keeps the fps rule's frames
    assert _qwen2().clip(ClipInfo(30, 10.0, 56, 56)).fewer == 0


def test_qwen3_clip_is_sampled_to_fewer_frames_by_its_processors_max_frames():
    """Qwen3-VL's rule (frames spread from the first to the last, its whole-clip pixel bound): the same lowering of
    its processor's max_frames, as Qwen3VLVideoProcessor samples with it."""
    from transformers import Qwen3VLVideoProcessor
    # p = 16, P = 16 patches (the clip's share of the row); 12 frames at 2 fps are 6 temporal patches of at least
    # 2 x 2: 24 > 16 -> 8 frames (4 x 2 x 2); at P = 8 (min_frames 2): 4 frames
    image = PatchRule(16, 2, 2, 3, 32 * 32, 32 * 32 * 4, 64, (0.5,) * 3, (0.5,) * 3)
    info = ClipInfo(60, 10.0, 64, 64)
    for p, frames in ((16, 8), (8, 4)):
        clip = Qwen3VideoRule(dataclasses.replace(image, row_patches=p), min_frames=2).clip(info)
        assert (clip.fewer, len(clip.indices), clip.grid) == (12, frames, (frames // 2, 2, 2)), p
        theirs = Qwen3VLVideoProcessor(min_frames=2, max_frames=frames).sample_frames(_meta(info), fps=2.0)
        assert clip.indices == tuple(int(i) for i in theirs)  # linspace over the whole clip, first to last


def test_a_clip_that_cannot_fit_at_min_frames_is_a_bad_record_and_the_report_says_what_was_dropped(long_clip):
    """min_frames 10 (two more temporal patches than fit): too_many_patches, its reason naming min_frames; the
    data report's clip line counts the clips sampled to fewer frames and the frames dropped."""
    from mmpipe.data.index import describe
    from mmpipe.data.records import VideoRef
    with pytest.raises(BadRecord) as e:
        _qwen2(min_frames=10).clip(probe(long_clip))
    assert e.value.kind == "too_many_patches"
    assert "10 frames (min_frames) of its smallest size still 20 > the 16" in e.value.reason, e.value.reason
    rule = dataclasses.replace(_qwen2().image, video=(2.0, 4, 768, 0, 0))
    grids, counts = media_grids([VideoRef(long_clip.name)], rule, long_clip.parent, 0)
    assert grids.tolist() == [[4, 2, 2]]
    assert (counts["clips_fewer_frames"], counts["clip_frames_dropped"], counts["clip_frames_sampled"]) == (1, 4, 8)
    stats = {"good": 1, "records": 1, "with_image": 1, "truncated": 0, "bad": 0, "first_bad": [], **counts}
    assert describe(stats)[1] == (
        "data: 1 clips: 8 of their 60 frames sampled (the family's video processor's fps rule); 1 clips' frames made "
        "smaller than their video processor makes them (their share of the row's --max-patches); 1 clips sampled to "
        "4 fewer frames than the fps rule gives, to fit their share of the row (the processor's max_frames lowered, "
        "not below min_frames)")


def test_sampling_flags_reach_the_processor():
    """--video-* set the model's vision.video_*, which the run's rule reads (patch_rule -> video_rule): the frames and
    grid are transformers' Qwen2VLVideoProcessor's at the model's own settings under those flags (fps 1 samples 6
    frames of the 60-frame clip, not 12; max_frames; max_pixels; min_frames), where the row's P does not bind; where
    it does (P = 256 over 6 temporal patches) the frames are smaller than the processor's (VideoRule.own); and the
    index key moves with the flags."""
    from transformers import Qwen2VLVideoProcessor

    from mmpipe.data.image_kinds import PATCHES
    cfg = load_preset("qwen-tiny")
    info = ClipInfo(60, 10.0, 112, 112)
    frames = np.zeros((60, 112, 112, 3), np.uint8)
    for flags, n in (({}, 12), (dict(video_fps=1.0), 6), (dict(video_max_frames=4), 4),
                     (dict(video_fps=1.0, video_max_pixels=28 * 28 * 2), 6),
                     (dict(video_min_frames=2, video_fps=0.2), 2)):
        v = DataArgs(**flags).with_video(cfg)
        rule = video_rule(patch_rule(v, 1 << 20))  # a row that holds any of these clips
        clip, vis = rule.clip(info), v.vision
        proc = Qwen2VLVideoProcessor(
            patch_size=vis.patch_size, merge_size=vis.merge_size, temporal_patch_size=vis.temporal_patch_size,
            min_pixels=vis.video_min_pixels or vis.min_pixels, max_pixels=vis.video_max_pixels or vis.max_pixels,
            fps=vis.video_fps, min_frames=vis.video_min_frames, max_frames=vis.video_max_frames,
            do_sample_frames=True, cap_pixels_per_frame=False)
        out = proc(videos=[frames], video_metadata=[_meta(info)], return_metadata=True, return_tensors="pt")
        assert clip.indices == tuple(int(i) for i in out["video_metadata"][0].frames_indices), flags
        assert len(clip.indices) == n and clip.grid == tuple(out["video_grid_thw"][0].tolist()), flags
        if flags:
            assert PATCHES.grid_key(patch_rule(v, 256), 1, 256) != PATCHES.grid_key(patch_rule(cfg, 256), 1, 256)
    assert PATCHES.grid_key(patch_rule(cfg, 256), 1, 256)[-1] != [2.0, 4, 768, 0, 0]  # defaults: old key
    rule = video_rule(patch_rule(cfg, 256))
    row, own = rule.clip(info), rule.own(info)
    assert row.grid[0] == own.grid[0] == 6 and row.grid[1] * row.grid[2] <= 256 // 6 < own.grid[1] * own.grid[2]
    rule = video_rule(patch_rule(DataArgs(video_min_pixels=84 * 84).with_video(cfg), 256))
    assert rule.processor(row).size.shortest_edge == 84 * 84  # the processor's own min_pixels


@pytest.mark.parametrize("argv, line", [
    (["--video-fps", "0"], "--video-fps: 0 must be a positive number of frames a second"),
    (["--video-min-frames", "0"], "--video-min-frames: 0 must be at least 1"),
    (["--video-max-frames", "3", "--video-min-frames", "4"],
     "--video-max-frames: 3 must be at least --video-min-frames (4) and a temporal patch (2 frames)"),
    (["--video-max-pixels", "100", "--video-min-pixels", "3136"],
     "--video-max-pixels: 100 must be 0 (none) or at least --video-min-pixels (3136)")])
def test_bad_sampling_flags_are_one_line_and_exit_2(capsys, argv, line):
    """train and plan refuse a bad value with one line (exit status 2), and a family without clips is named."""
    from mmpipe.cli import main
    assert main(["train", "--dry-run", "--preset", "qwen-tiny", *argv]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == [f"mmpipe: error: {line}"], err
    assert main(["plan", "--preset", "qwen-tiny", "--video-frames", "8", *argv]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == f"mmpipe: error: {line}"


def test_sampling_flags_in_plan_and_generate(capsys, tmp_path):
    """plan costs the clip at the flags' sampling (16 frames at --video-max-frames 8: 4 temporal patches, not 8);
    generate takes them with --video only; a family without clips refuses them."""
    import json

    from mmpipe.cli import main
    common = ["--preset", "qwen2.5-vl-7b", "--device", "h100-80gb", "--gpus-per-node", "8", "--global-batch", "256",
              "--video-frames", "16", "--video-size", "448x448", "--max-patches", "8192", "--text-len", "256", "--json"]
    assert main(["plan", *common, "--video-max-frames", "8"]) == 0
    assert json.loads(capsys.readouterr().out)[0]["image_grids"] == [[4, 32, 32]]
    assert main(["generate", "--checkpoint", str(tmp_path), "--prompt", "p", "--video-fps", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1] == (
        "mmpipe: error: --video-fps: a clip's sampling, for --video PATH only")
    assert main(["train", "--dry-run", "--preset", "llava-tiny", "--video-fps", "1"]) == 2
    assert capsys.readouterr().err.strip().splitlines()[-1].startswith(
        "mmpipe: error: --video-fps: the llava family reads no clips; only the ")
