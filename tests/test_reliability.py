"""A job dies — SIGKILL between checkpoints, a crash mid-save, a NaN batch — and loses at most the
work since its last checkpoint, never a checkpoint; a clean stop resumes exactly, also under another
stage count; a tampered checkpoint is refused."""
from __future__ import annotations

import hashlib
import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

import pytest
import torch

from conftest import ROOT, Run, fixed_schedule_config, train_run
from mmpipe.config import load_preset
from mmpipe.runtime.checkpoint import latest_tag, load_reference

STEPS = 12


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    return fixed_schedule_config(tmp_path_factory.mktemp("cfg") / "ds.json", STEPS)


def _args(cfg, *extra):
    return ["--preset", "tiny", "--ds-config", str(cfg), "--eval-samples", "0", "--seed", "2", "--stages", "2", *extra]


@pytest.fixture(scope="module")
def uninterrupted(tmp_path_factory, cfg):
    return train_run(tmp_path_factory.mktemp("full"), *_args(cfg, "--steps", str(STEPS))).check()


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


def _tree_digest(path: Path) -> str:
    h = hashlib.sha256()
    for f in sorted(p for p in path.rglob("*") if p.is_file()):
        h.update(str(f.relative_to(path)).encode() + f.read_bytes())
    return h.hexdigest()


def test_sigkill_between_checkpoints_then_resume_equals_the_uninterrupted_run(tmp_path, cfg, uninterrupted):
    out = tmp_path / "run"
    cmd = [sys.executable, "-m", "mmpipe.cli", "train", "--output-dir", str(out),
           *_args(cfg, "--steps", str(STEPS), "--save-every", "3")]
    job = subprocess.Popen(cmd, cwd=ROOT, env=_env(), stdout=subprocess.PIPE, stderr=subprocess.STDOUT, text=True)
    log = out / "train_log.csv"
    deadline = time.time() + 300
    while time.time() < deadline and (not log.is_file() or len(log.read_text().splitlines()) < 1 + 4):
        time.sleep(0.01)  # wait for step 4: past the step-3 checkpoint
    # SIGKILL the last stage's rank, as the OOM killer would
    rank1 = subprocess.run(["pgrep", "-f", f"mmpipe.train --local_rank=1 .*{out}"], capture_output=True, text=True)
    os.kill(int(rank1.stdout.split()[0]), signal.SIGKILL)
    job.communicate(timeout=120)
    assert job.returncode != 0 and not (out / "summary.json").exists()
    killed_at = len(log.read_text().splitlines()) - 1
    assert killed_at < STEPS, "the run finished before the kill"
    last_good = int(latest_tag(out / "checkpoints")[4:])
    assert 3 <= last_good <= killed_at and last_good % 3 == 0
    resumed = train_run(out, *_args(cfg, "--steps", str(STEPS), "--resume")).check()
    assert resumed.summary["start_step"] == last_good
    # one row per step, and every loss exactly the uninterrupted run's (fp32, CPU: bit for bit)
    assert [int(r["step"]) for r in resumed.rows] == list(range(1, STEPS + 1))
    assert resumed.losses == uninterrupted.losses


def test_killed_during_a_save_keeps_the_previous_checkpoint_latest(tmp_path, cfg, uninterrupted):
    out = tmp_path / "run"
    crashed = Run(out, subprocess.run(
        [sys.executable, "-m", "mmpipe.cli", "train", "--output-dir", str(out),
         *_args(cfg, "--steps", str(STEPS), "--save-every", "2")],
        cwd=ROOT, env=_env(MMPIPE_FAULT="kill-in-save:4:1"), capture_output=True, text=True, timeout=300))
    assert crashed.proc.returncode != 0
    ckpt = out / "checkpoints"
    assert latest_tag(ckpt) == "step2" and (ckpt / ".tmp-step4").is_dir()
    model = load_reference(ckpt, load_preset("tiny"))  # the previous checkpoint loads, whole
    assert all(torch.isfinite(p).all() for p in model.parameters())
    resumed = train_run(out, *_args(cfg, "--steps", str(STEPS), "--save-every", "2", "--resume")).check()
    assert "removed" in resumed.proc.stdout and not (ckpt / ".tmp-step4").exists()
    assert resumed.summary["start_step"] == 2 and resumed.losses == uninterrupted.losses


@pytest.fixture(scope="module")
def stopped_at_4(tmp_path_factory, cfg):
    """A 2-stage run stopped cleanly after step 4 (the schedule fixed at 12 steps): each test resumes a copy."""
    return train_run(tmp_path_factory.mktemp("cut") / "run", *_args(cfg, "--steps", "4")).check()


@pytest.mark.parametrize("stages", [2, 1, 4])
def test_resume_under_another_stage_count(tmp_path, cfg, uninterrupted, stopped_at_4, stages):
    """A clean stop and --resume continues the step count and the loss curve: under the same stage count
    every later loss is the uninterrupted run's, bit for bit, and the log has one row per step; under
    another, the first loss after loading is (same weights, data position and LR)."""
    out = tmp_path / "run"
    shutil.copytree(stopped_at_4.out, out)
    if stages == 2:
        resumed = train_run(out, *_args(cfg, "--steps", "6", "--resume")).check()
        assert resumed.summary["start_step"] == 4
        assert [int(r["step"]) for r in resumed.rows] == list(range(1, 7))
        assert resumed.losses == {s: uninterrupted.losses[s] for s in range(1, 7)}
        return
    moved = train_run(out, *_args(cfg, "--steps", "5", "--resume", "--stages", str(stages))).check()
    assert f"this run is {stages} x dp 1" in moved.proc.stdout and "starts again from zero" in moved.proc.stdout
    assert moved.summary["start_step"] == 4 and moved.summary["stages"] == stages
    # same weights, data position and LR: the first loss after loading is the 2-stage run's
    assert moved.losses[5] == uninterrupted.losses[5]
    assert moved.rows[-1]["lr"] == uninterrupted.rows[4]["lr"]


def test_nan_batch_stops_the_run_and_leaves_the_last_checkpoint_untouched(tmp_path, cfg):
    out = tmp_path / "run"
    proc = subprocess.run([sys.executable, "-m", "mmpipe.cli", "train", "--output-dir", str(out),
                           *_args(cfg, "--steps", str(STEPS), "--save-every", "2")],
                          cwd=ROOT, env=_env(MMPIPE_FAULT="nan-batch:5"), capture_output=True, text=True, timeout=300)
    assert proc.returncode != 0
    assert ("mmpipe: error: step 5: the loss is nan (fp32); stopping before any further checkpoint, so `latest` "
            "(step4) is the last good state.") in proc.stderr
    ckpt = out / "checkpoints"
    assert latest_tag(ckpt) == "step4" and sorted(p.name for p in ckpt.iterdir()) == ["latest", "step2", "step4"]
    digest = _tree_digest(ckpt / "step4")
    # what was written at step 4 is what a fresh load reads: nothing after it touched the files
    resumed = train_run(out, *_args(cfg, "--steps", "5", "--resume")).check()
    assert resumed.summary["start_step"] == 4 and _tree_digest(ckpt / "step4") == digest


def test_nan_batch_skipped_and_counted_when_configured(tmp_path, cfg, uninterrupted):
    run = Run(tmp_path / "run", subprocess.run(
        [sys.executable, "-m", "mmpipe.cli", "train", "--output-dir", str(tmp_path / "run"),
         *_args(cfg, "--steps", "6", "--nonfinite", "skip")],
        cwd=ROOT, env=_env(MMPIPE_FAULT="nan-batch:5"), capture_output=True, text=True, timeout=300)).check()
    assert run.summary["nonfinite_steps"] == 1 and run.summary["skipped_steps"] == 0
    rows = run.rows
    assert [r["skipped"] for r in rows] == ["", "", "", "", "nonfinite", ""]
    assert rows[4]["lr"] == rows[3]["lr"] != rows[5]["lr"]  # the skipped step did not advance the schedule
    # no update at step 5: step 6 sees step 4's weights, as the uninterrupted run's step 5 did
    assert run.losses[6] != uninterrupted.losses[6]
    assert all(run.losses[s] == uninterrupted.losses[s] for s in range(1, 5))


class _RunsCode:
    """What a tampered checkpoint could hold: unpickling it would run a shell command."""

    def __init__(self, marker: Path):
        self.marker = marker

    def __reduce__(self):
        return os.system, (f"touch {self.marker}",)


def test_a_tampered_checkpoint_is_refused_not_run(tmp_path, cfg, stopped_at_4):
    out = tmp_path / "run"
    shutil.copytree(stopped_at_4.out, out)
    victim = out / "checkpoints" / "step4" / "mp_rank_01_model_states.pt"
    state = torch.load(victim, weights_only=True)
    marker = tmp_path / "pwned"
    state["client_state"] = _RunsCode(marker)
    torch.save(state, victim)
    proc = train_run(out, *_args(cfg, "--steps", "5", "--resume")).proc
    assert proc.returncode != 0 and not marker.exists()
    assert f"mmpipe: error: {victim}: refused to load: it holds objects other than tensors and plain data" in (
        proc.stdout + proc.stderr)
