"""A precision the device cannot run is refused before launch (front door) or before
deepspeed.initialize (each rank), with one line naming the device and what to use instead; both
answers of the accelerator are faked here, so every path runs on every machine."""
from __future__ import annotations

import os
import subprocess
import sys

import pytest

from conftest import ROOT, Run, write_ds_config
from mmpipe import cli
from mmpipe.runtime import precision
from mmpipe.runtime.precision import Device

EPYC = Device("cpu", "AMD EPYC 7B13", fp16=False, bf16=True)
SAPPHIRE = Device("cpu", "Intel(R) Xeon(R) Platinum 8480+", fp16=True, bf16=True)
V100 = Device("cuda", "Tesla V100-SXM2-32GB", fp16=True, bf16=False, capability=(7, 0))
T4 = Device("cuda", "Tesla T4", fp16=True, bf16=False, capability=(7, 5))
P100 = Device("cuda", "Tesla P100-PCIE-16GB", fp16=False, bf16=False, capability=(6, 0))
A100 = Device("cuda", "NVIDIA A100-SXM4-80GB", fp16=True, bf16=True, capability=(8, 0))


def _env(**extra):
    return dict(os.environ, OMP_NUM_THREADS="1", PYTHONUNBUFFERED="1", **extra)


@pytest.mark.parametrize("device,prec,ok", [
    (EPYC, "fp16", False), (EPYC, "bf16", True), (EPYC, "fp32", True), (SAPPHIRE, "fp16", True),
    (V100, "bf16", False), (T4, "bf16", False), (V100, "fp16", True), (P100, "fp16", False),
    (A100, "bf16", True), (A100, "fp16", True)])
def test_which_precision_runs_where(device, prec, ok):
    assert (precision.problem(prec, device) is None) == ok


def test_fp16_on_a_cpu_without_it_suggests_bf16():
    msg = precision.problem("fp16", EPYC)
    assert msg.startswith("fp16.enabled: AMD EPYC 7B13 (cpu) has no fp16 kernels") and "\n" not in msg
    assert "ds_configs/zero1_bf16.json" in msg and "ds_configs/cpu_fp32.json" in msg


def test_bf16_on_a_gpu_without_it_suggests_fp16():
    msg = precision.problem("bf16", V100)
    assert msg.startswith("bf16.enabled: Tesla V100-SXM2-32GB (compute capability 7.0) has no bf16")
    assert "ds_configs/zero1_fp16.json" in msg


@pytest.mark.parametrize("device,config,expect", [
    (V100, "zero1_bf16.json", "bf16.enabled: Tesla V100-SXM2-32GB (compute capability 7.0) has no bf16"),
    (EPYC, "zero1_fp16.json", "fp16.enabled: AMD EPYC 7B13 (cpu) has no fp16 kernels")])
def test_front_door_refuses_before_launch(monkeypatch, capsys, tmp_path, device, config, expect):
    monkeypatch.setattr(precision, "this_device", lambda: device)
    rc = cli.main(["train", "--ds-config", str(ROOT / "ds_configs" / config), "--output-dir", str(tmp_path / "r")])
    err = capsys.readouterr().err.splitlines()
    assert rc == 2 and len(err) == 1 and err[0].startswith(f"mmpipe: error: {expect}")
    assert not (tmp_path / "r").exists()


def test_front_door_passes_what_the_device_runs(monkeypatch, capsys, tmp_path):
    monkeypatch.setattr(precision, "this_device", lambda: A100)
    monkeypatch.setattr(cli.shutil, "which", lambda name: None)  # stop right after the checks
    rc = cli.main(["train", "--ds-config", str(ROOT / "ds_configs" / "zero1_bf16.json"),
                   "--output-dir", str(tmp_path / "r")])
    assert rc == 2 and "deepspeed launcher not found" in capsys.readouterr().err


def test_this_device_asks_deepspeeds_accelerator_and_the_fake_reaches_it(monkeypatch):
    """In this process (a fresh interpreter per answer cost ~3 s of imports each): the fake sets answers on
    DeepSpeed's accelerator singleton, which deepspeed.initialize asks as well; after each answer the
    singleton's own answers are restored, as a new process would start with them."""
    from deepspeed.accelerator import get_accelerator
    acc = get_accelerator()

    def ask(**env) -> list[str]:
        with monkeypatch.context() as m:
            for key, value in env.items():
                m.setenv(key, value)
            try:
                d = precision.this_device()
                return [d.kind, str(d.fp16), str(d.bf16), str(bool(get_accelerator().is_fp16_supported()))]
            finally:
                for name in ("is_fp16_supported", "is_bf16_supported"):
                    vars(acc).pop(name, None)  # what the fake set on the instance: the class's answers again
    real = str(bool(acc.is_fp16_supported()))
    assert ask() == ["cpu", real, "True", real]
    assert ask(MMPIPE_FAKE_ACCELERATOR="fp16=1,bf16=0") == ["cpu", "True", "False", "True"]
    assert ask(MMPIPE_FAKE_ACCELERATOR="fp16=0") == ["cpu", "False", "True", "False"]
    assert ask(MMPIPE_FAKE_ACCELERATOR="rank1:fp16=1", RANK="0") == ["cpu", real, "True", real]  # rank 1's only
    assert ask(MMPIPE_FAKE_ACCELERATOR="rank1:fp16=1", RANK="1") == ["cpu", "True", "True", "True"]


def test_fp16_config_refused_with_one_line_and_exit_2():
    """The issue's command, with the CPU's fp16 answer faked off (it is off for real on an AMD EPYC)."""
    proc = subprocess.run([sys.executable, "-m", "mmpipe.cli", "train", "--ds-config", "ds_configs/zero1_fp16.json",
                           "--steps", "2", "--output-dir", "/nonexistent/never-written"], cwd=ROOT,
                          env=_env(MMPIPE_FAKE_ACCELERATOR="fp16=0"), capture_output=True, text=True, timeout=120)
    assert proc.returncode == 2 and proc.stdout == ""
    assert len(proc.stderr.splitlines()) == 1 and proc.stderr.startswith("mmpipe: error: fp16.enabled: ")


def test_a_rank_whose_device_differs_stops_every_rank_with_one_line(two_rank_runs):
    """A multi-host run where one host lacks bf16: the front door (here) passes, rank 1 does not;
    rank 0 names that host and rank in one line, every rank exits 2 before deepspeed.initialize.
    (two_rank_runs' last run: --ds-config ds_configs/zero1_bf16.json --preset tiny --steps 2 --eval-samples 0,
    MMPIPE_FAKE_ACCELERATOR=rank1:bf16=0 in its ranks.)"""
    run = two_rank_runs["differs"]
    out, proc = run.out, run.proc
    log = proc.stdout + proc.stderr
    errors = [ln for ln in log.splitlines() if ln.startswith("mmpipe: error:")]
    import socket
    assert errors == [f"mmpipe: error: host {socket.gethostname()}, rank 1: bf16.enabled: "
                      f"{precision.this_device().name} (cpu) does not run bf16; use fp32 (ds_configs/cpu_fp32.json)"]
    assert proc.returncode != 0 and "Traceback" not in log and "return code = 2" in log
    assert not (out / "checkpoints").exists()


def _overflow_args(root) -> list[str]:
    """The fp16 run's flags but --output-dir: ZeRO-1, the loss scale from 2^8, 4 steps; run with
    MMPIPE_FAULT=nan-batch:3 (step 3's pixels NaN: an overflow)."""
    cfg = write_ds_config(root / "fp16.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                          zero_optimization={"stage": 1},
                          fp16={"enabled": True, "loss_scale": 0, "initial_scale_power": 8, "hysteresis": 1})
    return ["--preset", "tiny", "--ds-config", str(cfg), "--eval-samples", "0", "--steps", "4"]


def _overflow_run(tmp_path, fake: str | None) -> Run:
    env = _env(MMPIPE_FAULT="nan-batch:3", **({precision.FAKE_ENV: fake} if fake else {}))
    return Run(tmp_path / "run", subprocess.run(
        [sys.executable, "-m", "mmpipe.cli", "train", "--output-dir", str(tmp_path / "run"), *_overflow_args(tmp_path)],
        cwd=ROOT, env=env, capture_output=True, text=True, timeout=300)).check()


def _assert_overflow_accounting(run: Run) -> None:
    assert run.summary["skipped_steps"] == 1
    rows = run.rows
    assert [r["skipped"] for r in rows] == ["", "", "fp16_overflow", ""]
    # the scale starts at 2^8, halves at the overflow (hysteresis 1), and the LR schedule holds still: the step
    # after the skipped one uses the skipped step's rate (each row's lr is the rate its step used)
    assert [float(r["loss_scale"]) for r in rows] == [256, 256, 128, 128]
    assert rows[3]["lr"] == rows[2]["lr"] != rows[1]["lr"]


def _fp16_kernels() -> bool:
    return precision.this_device().fp16


@pytest.mark.skipif(not _fp16_kernels(), reason=f"{precision.this_device().describe()} has no fp16 kernels "
                                                "(DeepSpeed's accelerator: is_fp16_supported() is False)")
def test_fp16_overflow_steps_are_counted(tmp_path):
    _assert_overflow_accounting(_overflow_run(tmp_path, None))


def test_fp16_overflow_accounting_on_any_cpu(two_rank_runs):
    """The same guarantee where the CPU lacks oneDNN's fp16 kernels: DeepSpeed's gate is faked open, so
    torch's generic (slow) fp16 CPU ops compute, and DeepSpeed's ZeRO-1 loss scaler and mmpipe's
    step log are what is tested."""
    _assert_overflow_accounting(two_rank_runs["overflow"].check())  # MMPIPE_FAKE_ACCELERATOR=fp16=1 in its ranks


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory):
    """Three 2-rank runs in one launch (tests/rank_series.py: one run after the other in the same ranks, each as
    `mmpipe train` runs it, its own port, environment, output and exit status): the bf16 resume test's uninterrupted
    run (bf16_full, first: no fake in its ranks' environment), the fp16 overflow run with DeepSpeed's fp16 gate faked
    open in its ranks (overflow: MMPIPE_FAKE_ACCELERATOR=fp16=1, MMPIPE_FAULT=nan-batch:3; the fake stays set on
    those processes' accelerator, which only the last run's ranks meet after it: a bf16 check reads the bf16 answer
    alone), and a bf16 run whose rank 1 lacks bf16 (differs: MMPIPE_FAKE_ACCELERATOR=rank1:bf16=0; every rank exits
    2, so it ends the launch, last). The front doors run in this process, where the device's answer is faked by
    precision.this_device's fp16 answer set (the bf16 runs' checks read only bf16), leaving DeepSpeed's accelerator
    here untouched."""
    import dataclasses

    from rank_series import launch_series
    root = tmp_path_factory.mktemp("prec")
    real = precision.this_device()
    with pytest.MonkeyPatch.context() as patch:
        patch.setattr(precision, "this_device", lambda: dataclasses.replace(real, fp16=True))
        full, overflow, differs = launch_series([
            (root / "full", [*_bf16_args(root), "--save-every", "2"], {}),
            (root / "overflow", _overflow_args(root), {precision.FAKE_ENV: "fp16=1", "MMPIPE_FAULT": "nan-batch:3"}),
            (root / "differs", ["--ds-config", str(ROOT / "ds_configs" / "zero1_bf16.json"), "--preset", "tiny",
                                "--steps", "2", "--eval-samples", "0"], {precision.FAKE_ENV: "rank1:bf16=0"})])
    return {"bf16_full": full, "overflow": overflow, "differs": differs}


def half_unmovable(state: dict) -> tuple[str, ...]:
    """The names of the tensors a few AdamW updates need not move in bf16: every element >= 0.5 in size (the norms'
    weights, 1.0 at init), where bf16's spacing is >= 2^-8 = 3.9e-3, so 3 updates at lr <= 5e-4 (<= 1.5e-3, under half
    of it) round back to the stored value (their fp32 copies, in the optimizer's state, move). Also used for fp16,
    whose spacing there (2^-11) a few updates may or may not cross."""
    return tuple(k for k, v in state.items() if v.is_floating_point() and v.numel() and v.abs().min() >= 0.5)


def _bf16_args(root) -> list[str]:
    """The bf16 run's flags but --output-dir and --save-every: ZeRO 0, DP=2, 5 steps of a schedule fixed at 8."""
    cfg = write_ds_config(root / "bf16.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=1,
                          bf16={"enabled": True}, zero_optimization={"stage": 0},
                          scheduler={"type": "WarmupCosineLR", "params": {"total_num_steps": 8, "warmup_num_steps": 1,
                                                                          "warmup_type": "linear"}})
    return ["--preset", "tiny", "--ds-config", str(cfg), "--eval-samples", "0", "--seed", "2", "--stages", "1",
            "--dp", "2", "--steps", "5"]


def test_bf16_zero0_resume_at_dp2_is_bit_exact(tmp_path, two_rank_runs):
    """DeepSpeed's bf16 optimizer keeps each DP rank's part of the fp32 weights and AdamW moments in a file of its
    own, at ZeRO 0 (ds_configs/cpu_bf16.json) as at ZeRO 1; DeepSpeed 0.19.8's ZeRO-0 load reads neither them nor,
    without a KeyError, the stage file (mmpipe.runtime.checkpoint.resume reads them). A bf16 run at DP=2 stopped
    after step 2 and resumed gives the uninterrupted run's steps 3 to 5 and weights bit for bit, and those 3 steps moved
    every weight (issue 59). (bf16 at ZeRO 1, DeepSpeed's own load: tests/test_moe_ep.py's bf16 resume.)"""
    import torch

    from conftest import assert_weights_moved, cut_at, train_run
    from mmpipe.config import load_preset
    from mmpipe.runtime.checkpoint import load_reference
    full = two_rank_runs["bf16_full"].check()  # _bf16_args, --save-every 2
    resumed = train_run(cut_at(full, tmp_path / "cut", 2), *_bf16_args(tmp_path), "--resume").check()
    assert resumed.summary["start_step"] == 2 and resumed.losses == full.losses
    got, want = (load_reference(r.out / "checkpoints", load_preset("tiny")).state_dict() for r in (resumed, full))
    assert all(torch.equal(got[k], want[k]) for k in want)
    # bit-exact, so any bound says the 3 resumed steps trained: each bf16 tensor moved > 10 x 1e-6, but those whose
    # stored value 3 updates cannot change (half_unmovable: the norms' weights)
    cut = load_reference(resumed.out / "checkpoints", load_preset("tiny"), "step2").state_dict()
    assert_weights_moved(got, cut, 1e-6, no_gradient=half_unmovable(cut))
