"""Bad runs are refused before any process group starts: one line naming the field, exit status 2."""
from __future__ import annotations

import pytest

from conftest import mmpipe_train, write_ds_config
from mmpipe.cli import main


def refuse(capsys, *argv) -> str:
    rc = main(["train", "--preset", "tiny", "--steps", "2", *argv])
    err = capsys.readouterr().err
    assert rc == 2, err
    lines = [ln for ln in err.splitlines() if ln.strip()]
    assert lines and all(ln.startswith("mmpipe: error: ") for ln in lines), err
    return err


def test_zero2_with_pipeline(tmp_path, capsys):
    cfg = write_ds_config(tmp_path / "z2.json", zero_optimization={"stage": 2})
    assert "zero_optimization.stage: 2 cannot run with a pipeline" in refuse(capsys, "--ds-config", str(cfg))


def test_zero3_with_one_stage_pipeline(tmp_path, capsys):
    cfg = write_ds_config(tmp_path / "z3.json", zero_optimization={"stage": 3})
    assert "zero_optimization.stage: 3" in refuse(capsys, "--ds-config", str(cfg), "--stages", "1")


def test_zero_stage_not_a_number(tmp_path, capsys):
    cfg = write_ds_config(tmp_path / "zx.json", zero_optimization={"stage": "one"})
    assert "zero_optimization.stage: 'one' is not a ZeRO stage" in refuse(capsys, "--ds-config", str(cfg))


def test_fp16_without_zero1(tmp_path, capsys):
    cfg = write_ds_config(tmp_path / "fp16.json", fp16={"enabled": True})
    assert "fp16.enabled: fp16 needs zero_optimization.stage 1" in refuse(capsys, "--ds-config", str(cfg))


def test_train_batch_size_mismatch(tmp_path, capsys):
    # 16 micro x 4 GAS x 2 DP = 128, not 100
    cfg = write_ds_config(tmp_path / "tb.json", train_batch_size=100)
    err = refuse(capsys, "--ds-config", str(cfg), "--dp", "2")
    assert "train_batch_size: 100 != train_micro_batch_size_per_gpu 16 x gradient_accumulation_steps 4 x dp 2 = 128" in err


def test_more_stages_than_layers(capsys):
    assert "--stages: 20 stages but the model has only 9 layers" in refuse(capsys, "--stages", "20")


def test_zero_stages(capsys):
    assert "--stages: 0 must be a positive integer" in refuse(capsys, "--stages", "0")


def test_stage_without_trainable_parameter(capsys):
    # layers 0..2 are PatchEmbed + 2 vision blocks: frozen, and cut off as stage 0
    err = refuse(capsys, "--freeze", "vision", "--partition", "3")
    assert "stage 0 (layers 0..2: PatchEmbed..VisionBlock) would hold no trainable parameter" in err


def test_everything_frozen(capsys):
    err = refuse(capsys, "--freeze", "vision,projector,text", "--stages", "1")
    assert "would hold no trainable parameter" in err


def test_missing_config_file(tmp_path, capsys):
    assert f"--ds-config: file not found: {tmp_path}/nope.json" in refuse(capsys, "--ds-config", str(tmp_path / "nope.json"))


def test_unknown_preset(capsys):
    err = refuse(capsys, "--preset", "moondream-7b")
    assert "--preset: unknown preset 'moondream-7b' (valid: " in err and "moondream-2b" in err


def test_unknown_freeze_group(capsys):
    assert "--freeze: unknown group(s) ['eyes']" in refuse(capsys, "--freeze", "eyes")


def test_resume_without_checkpoint(tmp_path, capsys):
    assert "--resume: no checkpoint in" in refuse(capsys, "--resume", "--output-dir", str(tmp_path))


def test_several_problems_each_get_a_line(tmp_path, capsys):
    cfg = write_ds_config(tmp_path / "bad.json", zero_optimization={"stage": 2}, fp16={"enabled": True})
    err = refuse(capsys, "--ds-config", str(cfg), "--steps", "0")
    assert len(err.strip().splitlines()) == 3, err


def test_command_line_refusal_has_no_traceback(tmp_path):
    cfg = write_ds_config(tmp_path / "z2.json", zero_optimization={"stage": 2})
    proc = mmpipe_train(["--preset", "tiny", "--ds-config", str(cfg)], timeout=120)
    assert proc.returncode == 2
    lines = proc.stderr.strip().splitlines()
    assert len(lines) == 1 and lines[0].startswith("mmpipe: error: zero_optimization.stage: 2"), proc.stderr
    assert "deepspeed" not in proc.stdout  # nothing was launched


@pytest.mark.parametrize("name", ["cpu_fp32", "cpu_bf16", "zero1_bf16", "zero1_fp16", "pp4_fp32"])
def test_shipped_configs_resolve(name):
    import argparse

    from conftest import ROOT
    from mmpipe.run_config import add_train_args, resolve
    p = argparse.ArgumentParser()
    add_train_args(p)
    run = resolve(p.parse_args(["--ds-config", str(ROOT / "ds_configs" / f"{name}.json"), "--preset", "tiny"]),
                  world_size=4 if name == "pp4_fp32" else 2)
    assert run.train_batch == run.micro * run.gas * run.dp
    assert run.stages == (4 if name == "pp4_fp32" else 2)
