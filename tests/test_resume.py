"""Checkpoint -> --resume continues the step count and the loss curve of an uninterrupted run."""
from __future__ import annotations

import pytest

from conftest import EQUIV_STEPS, train_run, write_ds_config


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
