"""Clips through the pipeline (issue 44): `mmpipe train --pack` at PP=2 on LLaVA records of clips (MP4 / H.264 and
Matroska / Motion JPEG, 7 and 13 frames), images and text, the qwen-tiny model with Qwen2.5-VL's absolute-time rotary
(vision.tokens_per_second 2, so every row's tiling carries the clips' steps), rows mixing clips and images, equals the
single-device reference loop (losses and weights, fp32, 1e-5; the decoder's key biases 1e-4 as in
tests/test_qwen_pipeline.py), and only floats cross the stage boundary; cut at step 2 and resumed, it is the
uninterrupted run bit for bit. Two launches."""
from __future__ import annotations

import json
import shutil
from pathlib import Path

import pytest
import torch

import mmpipe
from conftest import assert_weights_moved, train_run
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference
from test_qwen_pipeline import assert_trained_as_reference, loaders_agree
from video_records import pipeline_ds_config, write_pipeline_set

TOL = 1e-5
STEPS, CUT, SEED = 5, 2, 5  # step 1 runs at lr 0: 4 updates (issue 59), the resume 3


@pytest.fixture(scope="module")
def video_set(tmp_path_factory):
    """tests/video_records.py's 15 records (KINDS x 3: a clip, a clip then an image, two clips, an image, text;
    clips of 56 x 56 and 84 x 56 px)."""
    root = tmp_path_factory.mktemp("video_pipe")
    write_pipeline_set(root, (56, 56), (84, 56))
    preset = json.loads((Path(mmpipe.__file__).parent / "presets" / "qwen-tiny.json").read_text())
    preset["vision"]["tokens_per_second"] = 2
    (root / "model.json").write_text(json.dumps(preset))
    ds = pipeline_ds_config(root, STEPS)
    args = ["--preset", str(root / "model.json"), "--data", str(root / "data.json"), "--tokenizer", str(root / "tok"),
            "--ds-config", str(ds), "--text-len", "48", "--pack", "--max-images", "2", "--max-patches", "128",
            "--eval-samples", "0", "--seed", str(SEED), "--data-workers", "0"]
    return root, args


@pytest.fixture(scope="module")
def pp2(video_set):
    """PP=2, checkpointing at step CUT too (the resume test's cut)."""
    root, args = video_set
    return train_run(root / "pp2", *args, "--stages", "2", "--steps", str(STEPS), "--save-every", str(CUT)).check()


def test_pipeline_with_clips_equals_single_device(video_set, pp2):
    root, args = video_set
    run = resolve(TrainArgs.from_argv([*args, "--stages", "1", "--output-dir", str(root / "ref")]), world_size=1)
    assert run.model.vision.tokens_per_second == 2
    mixed = 0
    for _, _, has_image, _, tiling in loaders_agree(run, root, SEED, STEPS):  # a later stage's grids: the same
        assert tiling.shape[-1] == 4  # (t, h, w, step bits)
        used = tiling[..., 0] * (has_image > 0)
        mixed += int(((used > 1).any(-1) & (used == 1).any(-1)).sum())  # a clip and an image in one row
    assert mixed >= 1
    ref_model, ref_losses = train_reference(run, seed=SEED, steps=STEPS, out_dir=str(root / "ref"))
    assert sorted(pp2.losses) == list(range(1, STEPS + 1)) and abs(ref_losses[-1] - ref_losses[0]) > 1e-3
    assert list(pp2.losses.values()) == pytest.approx(ref_losses, abs=TOL)
    assert_trained_as_reference(pp2, ref_model, SEED, TOL)  # and every trained tensor moved > 10 x TOL
    pp2.assert_only_floats_crossed()


def test_resume_with_clips_is_bit_exact(video_set, pp2):
    """PP=2 cut after step CUT (its checkpoint) and resumed: the uninterrupted run's losses and weights, bit for bit
    (the same rows of clips, optimizer moments, schedule and RNG). The cut run is the uninterrupted one's directory
    as its step-CUT checkpoint left it, as in tests/test_qwen_pipeline.py; the resume is one launch."""
    root, args = video_set
    cut = root / "cut"
    shutil.copytree(pp2.out, cut)
    (cut / "checkpoints" / "latest").write_text(f"step{CUT}")
    shutil.rmtree(cut / "checkpoints" / f"step{STEPS}")
    (cut / "summary.json").unlink()
    log = (cut / "train_log.csv").read_text().splitlines(keepends=True)
    (cut / "train_log.csv").write_text("".join(log[:1 + CUT]))
    resumed = train_run(cut, *args, "--stages", "2", "--steps", str(STEPS), "--resume").check()
    assert resumed.summary["start_step"] == CUT and resumed.losses == pp2.losses
    cfg = resolve(TrainArgs.from_argv([*args, "--stages", "1", "--output-dir", str(root / "ref")]), world_size=1).model
    got, want = (torch.nn.Sequential(*load_reference(r.out / "checkpoints", cfg)).state_dict() for r in (resumed, pp2))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert_weights_moved(got, load_reference(resumed.out / "checkpoints", cfg, f"step{CUT}"), TOL)  # 3 updates


def test_loader_check_reports_clips_per_second(video_set):
    """`mmpipe check`'s loader check on the clip set (rank 0's measure, in process, against a given pipeline rate):
    clips/s beside rows/s and samples/s, at the set's clips per sample (12 clips in 15 records: 3 x (1 + 1 + 2))."""
    from mmpipe.check.loader import measure
    from mmpipe.check.report import summaries
    root, args = video_set
    run = resolve(TrainArgs.from_argv([*args, "--stages", "1", "--output-dir", str(root / "check")]), world_size=1)
    got = measure(run, SEED, str(root / "check"), measured=1.0)
    assert got["clips_per_s"] == pytest.approx(got["samples_per_s"] * 12 / 15)
    checks = {"loader": got, "env": {"ranks": 1, "backend": "gloo", "problems": []}, "links": {"rows": []},
              "equivalence": {"error": "not run"}}
    line = summaries(checks)["loader"]
    assert f"{got['clips_per_s']:.1f} clips/s at the set's clips per sample" in line
