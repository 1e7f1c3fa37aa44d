"""Clips as the checkpoint's own video processor sizes them (issue 53 item 1, issue 59 item 4).

A tiny Qwen2.5-VL and a tiny Qwen3-VL are saved by transformers with a video processor whose settings are not the
image processor's (pixel bounds, fps, min / max frames), beside their tokenizer and chat template, so that
transformers' AutoProcessor loads the whole processor from the directory. mmpipe imports the directory (its
video_preprocessor_config.json into vision.video_*), and for clips of odd frame counts at two rates:
- `mmpipe generate --video` (in-process) gives transformers' greedy answer (AutoProcessor + generate);
- the patches and grid a training row carries for the clip (the data side's media_grids / clip_patches at the run's
  default budget) are the processor's output on the decoded file;
- the same with --video-max-pixels given to mmpipe and the same bound to the processor;
- export writes the settings back (AutoProcessor of the export sizes the clips alike).
Every reference is the processor loaded from the directory at its own settings, never a bound mmpipe computed."""
from __future__ import annotations

import dataclasses

import numpy as np
import pytest
import torch

from mmpipe.cli import main
from mmpipe.data.args import DataArgs
from mmpipe.data.image_kinds import image_rule
from mmpipe.data.records import VideoRef
from mmpipe.data.video import clip_patches, media_count, media_grids, probe, video_rule, with_timestamps
from mmpipe.hf.commands import hf_reader
from qwen3_models import save_qwen3
from qwen_models import VIDEO, save_qwen, save_tokenizer
from test_video_qwen3_vl import _decoded
from video_clips import moving_square, write_clip

# (name, frames, width, height, fps): odd frame counts at two rates, each frame larger than the processors' bounds
CLIPS = [("a", 7, 168, 112, 3), ("b", 11, 140, 140, 5)]
# the video processors' own settings, each unlike the image processor's (Qwen2.5: 3136..12544 px an image, 16 merge
# units of 28 px; Qwen3: 1024..16384, a whole-clip bound of 16 units of 32 px): Qwen2.5's frames up to 12 units, so
# a clip of 2 temporal patches takes 24 units, more than one image's budget (16); Qwen3's whole clip up to 80 units
SETTINGS = {"qwen2_5": dict(size={"shortest_edge": 784 * 2, "longest_edge": 784 * 12}, fps=2.0, min_frames=2,
                            max_frames=6),
            "qwen3": dict(size={"shortest_edge": 1024, "longest_edge": 1024 * 80}, fps=2.0, min_frames=2,
                          max_frames=6)}
OVERRIDE = {"qwen2_5": 784 * 4, "qwen3": 1024 * 24}  # --video-max-pixels on both sides


def _video_processor(kind: str):
    from transformers import Qwen2VLVideoProcessor, Qwen3VLVideoProcessor
    if kind == "qwen2_5":
        return Qwen2VLVideoProcessor(do_sample_frames=True, cap_pixels_per_frame=False, **SETTINGS[kind])
    return Qwen3VLVideoProcessor(patch_size=16, image_mean=[0.5] * 3, image_std=[0.5] * 3, do_sample_frames=True,
                                 cap_pixels_per_frame=False, **SETTINGS[kind])


@pytest.fixture(scope="module", params=["qwen2_5", "qwen3"])
def saved(request, tmp_path_factory):
    """(kind, HF directory, transformers model, imported config, clip paths): the model, its image and video
    processors and its tokenizer (with the Qwen3-VL clips' timestamp words) saved by transformers."""
    kind, d = request.param, tmp_path_factory.mktemp(f"{request.param}_video")
    clips = {}
    for k, (name, n, w, h, fps) in enumerate(CLIPS):
        clips[name] = d / f"{name}.mp4"
        write_clip(clips[name], moving_square(n, w, h, seed=k), fps)
    hf = save_qwen("qwen2_5", d / "hf") if kind == "qwen2_5" else save_qwen3(d / "hf")
    _video_processor(kind).save_pretrained(d / "hf")
    assert (d / "hf" / "video_preprocessor_config.json").is_file()
    cfg = hf_reader(d / "hf")(d / "hf").cfg
    words = {}
    if kind == "qwen3":  # the timestamps' words get ids of their own, so the ids say which text stands where
        for name in clips:
            for flags in ({}, dict(video_max_pixels=OVERRIDE[kind])):
                stamps = _rows(DataArgs(**flags).with_video(cfg), clips[name])[2]
                for w in " ".join(stamps).split():
                    words.setdefault(w, None)
        words = {180 + i: w for i, w in enumerate(words)}
    save_tokenizer(d / "hf", words)
    return kind, d / "hf", hf.eval(), cfg, clips


def _rows(cfg, path):
    """(patches, grids, timestamps) the data side gives a training row for the clip at the run's default budget
    (one medium a sample: mmpipe.data.image_kinds' budget for a sample of one image)."""
    from mmpipe.data.image_kinds import one_image_budget
    from mmpipe.data.records import Record
    from mmpipe.data.text import IMAGE_MARKER
    rule = image_rule(cfg, one_image_budget(cfg) * 8)  # a row with room for the clip at the processor's size
    rec = with_timestamps(Record("r", [("user", f"{IMAGE_MARKER}\nw7")], [VideoRef(path.name)]), rule, path.parent,
                          IMAGE_MARKER)
    grids, _ = media_grids(rec.images, rule, path.parent, 0)
    n = media_count(rec.images)
    patches = torch.cat([clip_patches(m, rule, path.parent, n, g) for m, g in zip(rec.images, grids)])
    return patches, grids, _stamps(rec)


def _stamps(rec) -> list[str]:
    import re
    return re.findall(r"<[0-9.]+ seconds>", rec.messages[0][1])


def _theirs(d, path, max_pixels: int | None = None):
    """transformers' AutoProcessor loaded from d on the decoded clip, at its own settings (or its size's
    longest_edge given as max_pixels, the override): its output for one user turn of the clip and 'w7 w8'."""
    from transformers import AutoProcessor
    proc = AutoProcessor.from_pretrained(d)
    if max_pixels is not None:
        size = dict(proc.video_processor.size.__dict__)
        proc.video_processor.size = type(proc.video_processor.size)(**{**size, "longest_edge": max_pixels})
    frames, meta = _decoded(path)
    text = proc.tokenizer.apply_chat_template(
        [{"role": "user", "content": "<|vision_start|><|video_pad|><|vision_end|>\nw7 w8"}], tokenize=False,
        add_generation_prompt=True)
    return proc(text=[text], videos=[frames], video_metadata=[meta], return_tensors="pt")


def _hf_answer(hf, out, tokens: int = 5) -> list[int]:
    kw = {k: out[k] for k in ("pixel_values_videos", "video_grid_thw", "second_per_grid_ts") if k in out}
    ids = out["input_ids"]
    with torch.no_grad():
        got = hf.generate(input_ids=ids, **kw, mm_token_type_ids=(ids == VIDEO).int() * 2, max_new_tokens=tokens,
                          min_new_tokens=tokens, do_sample=False)
    return got[0, ids.shape[1]:].tolist()


@pytest.mark.parametrize("override", [False, True])
def test_training_rows_carry_the_processors_patches_and_grid(saved, override):
    """The imported model's vision.video_* are the saved video processor's; a training row's clip (its frames,
    grid, patches) is the processor's output on the decoded file, at its own settings or both given the same
    max_pixels. Where the row's share is smaller, the frames are smaller and the data report counts it."""
    kind, d, _, cfg, clips = saved
    s = SETTINGS[kind]
    v = cfg.vision
    assert (v.video_min_pixels, v.video_max_pixels, v.video_fps, v.video_min_frames, v.video_max_frames) == (
        s["size"]["shortest_edge"], s["size"]["longest_edge"], s["fps"], s["min_frames"], s["max_frames"])
    run = DataArgs(video_max_pixels=OVERRIDE[kind]).with_video(cfg) if override else cfg
    for name, path in clips.items():
        patches, grids, _ = _rows(run, path)
        out = _theirs(d, path, OVERRIDE[kind] if override else None)
        t, h, w = out["video_grid_thw"][0].tolist()
        assert [tuple(g[:3]) for g in grids.tolist()] == ([(t, h, w)] if kind == "qwen2_5" else [(1, h, w)] * t), name
        assert torch.equal(patches, out["pixel_values_videos"].float()), name
    # the row's share binds: a budget of a quarter of the clip's patches makes its frames smaller, and says so
    rule = video_rule(image_rule(run, 1))
    info = probe(clips["a"])
    own = rule.own(info)
    small = dataclasses.replace(rule, image=dataclasses.replace(rule.image, row_patches=int(np.prod(own.grid)) // 2))
    assert small.clip(info).grid[1:] != own.grid[1:] or small.clip(info).fewer


def test_generate_on_a_clip_gives_autoprocessor_and_generate(saved, capsys, monkeypatch):
    """`mmpipe generate --checkpoint HF_DIR --video CLIP` answers on the clip transformers' AutoProcessor (loaded
    from the directory) makes (its patches and grid) and gives its answer with generate, greedy, for each clip;
    with --video-max-pixels as with the processor given that bound; no stderr line for a clip its context holds."""
    import mmpipe.inference.generate as gen
    kind, d, hf, _, clips = saved
    from transformers import AutoTokenizer
    tok, seen, real = AutoTokenizer.from_pretrained(d), [], gen.generate

    def spy(model, pixels, prompt, sampling, **kw):
        seen.append((pixels, kw["tiling"]))
        return real(model, pixels, prompt, sampling, **kw)
    monkeypatch.setattr(gen, "generate", spy)
    for (name, path), override in zip(clips.items(), (None, OVERRIDE[kind])):  # each clip once: the rows test has both
        flags = ["--video-max-pixels", str(override)] if override else []
        assert main(["generate", "--checkpoint", str(d), "--video", str(path), "--prompt", "w7 w8",
                     "--max-new-tokens", "5", *flags]) == 0
        got, out = capsys.readouterr(), _theirs(d, path, override)
        pixels, tiling = seen.pop()
        t, h, w = out["video_grid_thw"][0].tolist()
        assert [tuple(g[:3]) for g in tiling[0].tolist()] == ([(t, h, w)] if kind == "qwen2_5" else
                                                              [(1, h, w)] * t), (name, override)
        n = t * h * w
        assert torch.equal(pixels[0, :n].float(), out["pixel_values_videos"].float()), (name, override)
        want = _hf_answer(hf, out)
        assert got.out.strip() == tok.decode(want, skip_special_tokens=True).strip() != "", (name, override)
        assert "smaller" not in got.err


def test_export_writes_the_video_settings_back(saved, tmp_path):
    """import -> export: the export's video_preprocessor_config.json gives AutoProcessor the same clips (grid and
    patches) as the source directory's."""
    kind, d, _, _, clips = saved
    assert main(["import", "--hf", str(d), "--out", str(tmp_path / "run")]) == 0
    assert main(["export", "--checkpoint", str(tmp_path / "run"), "--out", str(tmp_path / "out")]) == 0
    save_tokenizer(tmp_path / "out")
    for path in clips.values():
        a, b = _theirs(d, path), _theirs(tmp_path / "out", path)
        assert torch.equal(a["video_grid_thw"], b["video_grid_thw"])
        assert torch.equal(a["pixel_values_videos"], b["pixel_values_videos"])



def test_generate_says_when_the_context_makes_a_clip_smaller(saved, tmp_path, capsys):
    """A model whose context cannot hold the clip at its processor's size (its run's model.json given a max_context
    of 14 positions, 56 patches, for clip a's 64 at the processor's size): generate answers on smaller frames and
    says so in one stderr line."""
    import json
    kind, d, _, _, clips = saved
    assert main(["import", "--hf", str(d), "--out", str(tmp_path / "run")]) == 0
    cfg = json.loads((tmp_path / "run" / "model.json").read_text())
    cfg["text"]["max_context"] = 14
    (tmp_path / "run" / "model.json").write_text(json.dumps(cfg))
    capsys.readouterr()
    assert main(["generate", "--checkpoint", str(tmp_path / "run"), "--tokenizer", str(d), "--video",
                 str(clips["a"]), "--prompt", "w7 w8", "--max-new-tokens", "2"]) == 0
    err = [line for line in capsys.readouterr().err.splitlines() if "--video" in line]
    assert len(err) == 1 and err[0].startswith(f"mmpipe: generate: --video: {clips['a']}: the clip's ") and \
        err[0].endswith("is over the model's context (14 positions): its frames are made smaller to fit"), err
