"""Qwen3-VL clips through the pipeline (issue 44): `mmpipe train --pack --preset qwen3-vl-tiny` at PP=2 on
tests/test_video_pipeline.py's LLaVA records (clips in MP4 / H.264 and Matroska / Motion JPEG, a clip and an image, two
clips, images, text), each clip's temporal patches a (1, h, w) slot after its timestamp text, DeepStack's feature sets
crossing the cut, equals the single-device reference loop (losses and weights, fp32, 1e-5), and only floats cross the
stage boundary. The timestamps' words are unknown to this tokenizer (tests/test_qwen_data.py's), so each is one id:
the equality does not depend on which (tests/test_video_qwen3_vl.py checks the ids). Cut after step 2 (conftest.cut_at)
and resumed, it gives the uninterrupted run's losses and weights bit for bit. Two launches."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_weights_moved, cut_at, train_run
from mmpipe.data.dataset import prepare
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference
from test_qwen_pipeline import assert_trained_as_reference, loaders_agree, sample_image_counts
from video_records import pipeline_ds_config, write_pipeline_set

TOL = 1e-5
STEPS, CUT, SEED = 5, 2, 5  # step 1 runs at lr 0: 4 updates (issue 59), the resume 3


@pytest.fixture(scope="module")
def qwen3_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("video_qwen3_pipe")
    # patch 16: 64 x 64 and 96 x 64 frames are 4 x 4 and 4 x 6 patch grids; 4 and 8 frames sampled at 2 fps
    write_pipeline_set(root, (64, 64), (96, 64))
    ds = pipeline_ds_config(root, STEPS)
    # a slot per temporal patch: the two clips' record takes 2 + 4 slots
    args = ["--preset", "qwen3-vl-tiny", "--data", str(root / "data.json"), "--tokenizer", str(root / "tok"),
            "--ds-config", str(ds), "--text-len", "64", "--pack", "--max-images", "6", "--max-patches", "256",
            "--eval-samples", "0", "--seed", str(SEED), "--data-workers", "0", "--bad-records", "strict"]
    return root, args


@pytest.fixture(scope="module")
def pp2(qwen3_set):
    """PP=2, checkpointing at step CUT too (the resume test's cut)."""
    root, args = qwen3_set
    return train_run(root / "pp2", *args, "--stages", "2", "--steps", str(STEPS), "--save-every", str(CUT)).check()


def test_qwen3_vl_pipeline_with_clips_equals_single_device(qwen3_set, pp2):
    root, args = qwen3_set
    run = resolve(TrainArgs.from_argv([*args, "--stages", "1", "--output-dir", str(root / "ref")]), world_size=1)
    stats = prepare(run.data, run.model, str(root / "ref"), SEED, verbose=False).index.stats
    assert stats["clips"] == 12 and stats["bad"] == 0  # 3 x (1 + 1 + 2) clips, every record trained on
    counts = set()
    for _, _, has_image, segments, tiling in loaders_agree(run, root, SEED, STEPS):  # a later stage's: the same
        assert (tiling[..., 0] <= 1).all()  # Qwen3-VL: a temporal patch a slot
        counts.update(n for row in sample_image_counts(has_image, segments) for n in row)
    # slots a sample: text 0, an image 1, the short clip 2 (4 frames), the long clip (8 frames) and an image 5, both
    # clips 6: every kind trained on within the steps
    assert counts == {0, 1, 2, 5, 6}
    ref_model, ref_losses = train_reference(run, seed=SEED, steps=STEPS, out_dir=str(root / "ref"))
    assert sorted(pp2.losses) == list(range(1, STEPS + 1)) and abs(ref_losses[-1] - ref_losses[0]) > 1e-3
    assert list(pp2.losses.values()) == pytest.approx(ref_losses, abs=TOL)
    assert_trained_as_reference(pp2, ref_model, SEED, TOL)  # and every trained tensor moved > 10 x TOL
    pp2.assert_only_floats_crossed(per_forward=4)  # the cut is in the decoder: hidden + DeepStack's 3 sets


def test_qwen3_vl_resume_with_clips_is_bit_exact(qwen3_set, pp2):
    """PP=2 cut after step CUT (conftest.cut_at: its checkpoint, the log's first CUT steps) and resumed: the
    uninterrupted run's losses and weights bit for bit (the same rows of timestamped clips, DeepStack's sets crossing,
    optimizer moments, schedule and RNG). One launch."""
    root, args = qwen3_set
    cut = cut_at(pp2, root / "cut", CUT)
    resumed = train_run(cut, *args, "--stages", "2", "--steps", str(STEPS), "--resume").check()
    assert resumed.summary["start_step"] == CUT and resumed.losses == pp2.losses
    cfg = resolve(TrainArgs.from_argv([*args, "--stages", "1", "--output-dir", str(root / "ref")]), world_size=1).model
    got, want = (torch.nn.Sequential(*load_reference(r.out / "checkpoints", cfg)).state_dict() for r in (resumed, pp2))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    assert_weights_moved(got, load_reference(resumed.out / "checkpoints", cfg, f"step{CUT}"), TOL)  # 3 updates
