"""Checkpoint -> --resume continues the step count and the loss curve of an uninterrupted run."""
from __future__ import annotations

import json

import pytest

from conftest import EQUIV_STEPS, train_run, write_ds_config
from mmpipe.cli import main
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime import checkpoint


def test_resume_continues_step_count_and_losses(tmp_path):
    # The LR schedule's length is fixed in the config (not "auto" = this invocation's --steps), so
    # stopping at step 3 and resuming to step 6 follows one schedule, as a preempted job does.
    cfg = write_ds_config(
        tmp_path / "ds.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=3,
        scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": EQUIV_STEPS, "warmup_num_steps": 2,
                                                       "warmup_type": "linear", "warmup_min_ratio": 0.1}})
    common = ["--preset", "tiny", "--ds-config", str(cfg), "--eval-samples", "0", "--seed", "3", "--stages", "2"]
    full = train_run(tmp_path / "full", *common, "--steps", str(EQUIV_STEPS)).check()
    half = EQUIV_STEPS // 2
    first = train_run(tmp_path / "resumed", *common, "--steps", str(half)).check()
    assert sorted(first.losses) == list(range(1, half + 1))
    second = train_run(tmp_path / "resumed", *common, "--steps", str(EQUIV_STEPS), "--resume").check()
    assert second.summary["start_step"] == half
    losses = second.losses  # the CSV is appended to: one row per step, no repeats
    assert [int(r["step"]) for r in second.rows] == list(range(1, EQUIV_STEPS + 1))
    for step in range(1, EQUIV_STEPS + 1):
        # same data position, optimizer moments and LR schedule: the same numbers as never stopping
        assert losses[step] == pytest.approx(full.losses[step], abs=1e-6), step


def test_resume_refuses_another_row_layout_before_launch(tmp_path, capsys):
    """A checkpoint's data position counts samples of its rows: --resume with another --pack, --max-images,
    --loss-norm or --text-len is one line at the front door naming each change and its saved value (from a
    saved run's mmpipe_state.json; nothing is launched)."""
    out = tmp_path / "run"
    ckpt = out / "checkpoints"
    (ckpt / "global_step3").mkdir(parents=True)
    (ckpt / "latest").write_text("global_step3")
    saved = resolve(TrainArgs(output_dir=str(out), resume=True, preset="tiny"), 2)
    (ckpt / "global_step3" / checkpoint.STATE_FILE).write_text(json.dumps({"rows": checkpoint.row_layout(saved)}))
    checkpoint.check_same_rows(ckpt, saved)  # the same rows: resumable
    base = ["train", "--preset", "tiny", "--output-dir", str(out), "--resume", "--stages", "2", "--steps", "4"]
    for flags, said in ((["--pack", "--max-images", "2"], "--pack on (saved: off), --max-images 2 (saved: 1)"),
                        (["--loss-norm", "sample"], "--loss-norm sample (saved: token)"),
                        (["--text-len", "10"], "--text-len 10 (saved: 12)")):
        assert main(base + flags) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and err[0].startswith(f"mmpipe: error: --resume: {said}: "), err
        assert "global_step3 was written with other rows" in err[0]
    # a checkpoint written before the rows were saved is not second-guessed
    (ckpt / "global_step3" / checkpoint.STATE_FILE).write_text(json.dumps({"step": 3}))
    checkpoint.check_same_rows(ckpt, resolve(TrainArgs(output_dir=str(out), resume=True, preset="tiny", pack=True,
                                                       max_images=2), 2))
