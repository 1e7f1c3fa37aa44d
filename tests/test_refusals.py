"""Bad runs are refused before any process group starts: one line naming the field, exit status 2."""
from __future__ import annotations

import json

import pytest

from conftest import mmpipe_train, write_ds_config
from mmpipe.cli import main
from mmpipe.config import PRESET_DIR
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import REPO_CONFIGS, resolve


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
    assert ("train_batch_size: 100 != train_micro_batch_size_per_gpu 16 x gradient_accumulation_steps 4 "
            "x dp 2 = 128") in err


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
    err = refuse(capsys, "--ds-config", str(tmp_path / "nope.json"))
    assert f"--ds-config: {tmp_path}/nope.json: file not found" in err


def test_shipped_configs_resolve_from_any_directory(tmp_path, monkeypatch, capsys):
    """`--ds-config ds_configs/NAME`, as the docs write it, from a directory without ds_configs/: the
    shipped NAME, as the default config is; a file of the user's by that path comes first; --help says so."""
    monkeypatch.chdir(tmp_path)
    run = resolve(TrainArgs(preset="tiny", ds_config="ds_configs/pp4_fp32.json"), 4)
    assert (run.ds_config_path, run.stages) == (str(REPO_CONFIGS / "pp4_fp32.json"), 4)
    (tmp_path / "ds_configs").mkdir()
    write_ds_config(tmp_path / "ds_configs" / "pp4_fp32.json", pipeline={"stages": 1})
    assert resolve(TrainArgs(preset="tiny", ds_config="ds_configs/pp4_fp32.json"), 1).stages == 1
    assert "ds_configs/nope.json: file not found" in refuse(capsys, "--ds-config", "ds_configs/nope.json")
    with pytest.raises(SystemExit):
        main(["train", "--help"])
    assert "the shipped NAME" in " ".join(capsys.readouterr().out.split())


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

    from conftest import ROOT
    from mmpipe.run_args import TrainArgs
    from mmpipe.run_config import resolve
    run = resolve(TrainArgs.from_argv(["--ds-config", str(ROOT / "ds_configs" / f"{name}.json"), "--preset", "tiny"]),
                  world_size=4 if name == "pp4_fp32" else 2)
    assert run.train_batch == run.micro * run.gas * run.dp
    assert run.stages == (4 if name == "pp4_fp32" else 2)


def test_missing_optimizer(tmp_path, capsys):
    cfg = write_ds_config(tmp_path / "noopt.json", optimizer=None)
    assert "optimizer: missing; set e.g." in refuse(capsys, "--ds-config", str(cfg))


def test_fp16_and_bf16_together(tmp_path, capsys):
    cfg = write_ds_config(tmp_path / "both.json", fp16={"enabled": True}, bf16={"enabled": True},
                          zero_optimization={"stage": 1})
    assert "fp16.enabled / bf16.enabled: both are on; choose one" in refuse(capsys, "--ds-config", str(cfg))


def test_non_positive_micro_batch(tmp_path, capsys):
    cfg = write_ds_config(tmp_path / "mb.json", train_micro_batch_size_per_gpu=0)
    assert "train_micro_batch_size_per_gpu: 0 must be a positive integer" in refuse(capsys, "--ds-config", str(cfg))


@pytest.mark.parametrize("flag,value,message", [
    ("--steps", "0", "--steps: 0 must be >= 1"),
    ("--save-every", "-1", "--save-every: -1 must be >= 0"),
    ("--keep-checkpoints", "-2", "--keep-checkpoints: -2 must be >= 0 (0 keeps all)"),
    ("--max-image-pixels", "0", "--max-image-pixels: 0 must be >= 1"),
    ("--data-workers", "-1", "--data-workers: -1 must be >= 0"),
    ("--text-len", "1", "--text-len: 1 must be between 2 and"),
    ("--text-len", "999", "--text-len: 999 must be between 2 and"),
])
def test_out_of_range_flags(capsys, flag, value, message):
    assert message in refuse(capsys, flag, value)


@pytest.mark.parametrize("config", ["cpu_bf16", "zero1_bf16"])
def test_nonfinite_skip_needs_fp32_without_zero(capsys, config):
    from conftest import ROOT
    err = refuse(capsys, "--nonfinite", "skip", "--ds-config", str(ROOT / "ds_configs" / f"{config}.json"))
    assert "--nonfinite: skip works with fp32 and ZeRO stage 0" in err


def test_world_size_not_a_multiple_of_stages(capsys):

    from mmpipe.config import ConfigError
    from mmpipe.run_args import TrainArgs
    from mmpipe.run_config import resolve
    with pytest.raises(ConfigError, match=r"--stages: world size 3 is not a multiple of 2 stages"):
        resolve(TrainArgs.from_argv(["--preset", "tiny"]), world_size=3)


def test_data_that_does_not_exist(tmp_path, capsys):
    assert f"--data: '{tmp_path}/x.jsonl' is neither 'shapes' nor an existing file" in refuse(
        capsys, "--data", str(tmp_path / "x.jsonl"))


def test_data_of_unknown_format(tmp_path, capsys):
    (tmp_path / "x.txt").write_text("hello")
    assert "--data: cannot tell the format of" in refuse(capsys, "--data", str(tmp_path / "x.txt"))


def test_data_config_with_unknown_key(tmp_path, capsys):
    (tmp_path / "d.json").write_text('{"format": "pairs", "path": "d.json", "colums": {}}')
    assert "unknown key(s) ['colums']" in refuse(capsys, "--data", str(tmp_path / "d.json"))


def test_tokenizer_with_the_builtin_set(tmp_path, capsys):
    err = refuse(capsys, "--tokenizer", str(tmp_path))
    assert err.strip() == ("mmpipe: error: --tokenizer: the built-in shapes set uses the built-in tokenizer; "
                           "drop --tokenizer")


def test_tokenizer_directory_missing(tmp_path, capsys):
    from mmpipe.data.export import export_shapes
    data = export_shapes(tmp_path / "d", "llava-jsonl", 2)
    assert f"--tokenizer: {tmp_path}/none is not a directory" in refuse(
        capsys, "--data", str(data), "--tokenizer", str(tmp_path / "none"))


def test_vocabulary_smaller_than_the_builtin_tokenizer(tmp_path, capsys):
    import json

    from mmpipe.config import PRESET_DIR
    preset = json.loads((PRESET_DIR / "tiny.json").read_text())
    preset["text"]["vocab_size"] = 16
    (tmp_path / "p.json").write_text(json.dumps(preset))
    assert "text.vocab_size: 16 is smaller than the tokenizer's" in refuse(capsys, "--preset", str(tmp_path / "p.json"))


@pytest.mark.parametrize("scale, says", [(0, "0 must be > 0"), ("20x", "'20x' is not a number")])
def test_bad_cross_attention_gate_scale(tmp_path, capsys, scale, says):
    preset = json.loads((PRESET_DIR / "tiny-xattn.json").read_text())
    path = tmp_path / "xattn.json"
    path.write_text(json.dumps({**preset, "cross_attn_gate_scale": scale}))
    assert f"cross_attn_gate_scale: {says}" in refuse(capsys, "--preset", str(path))


def test_monitor_without_its_package(tmp_path, capsys, monkeypatch):
    """A tensorboard / wandb section on a machine without the package: one line each before launch (DeepSpeed
    would import it in every rank after it); csv_monitor needs no package."""
    import importlib.util
    find_spec = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: None if name in ("tensorboard", "wandb") else find_spec(name, *a))
    on = {"enabled": True, "output_path": str(tmp_path / "mon"), "job_name": "j"}
    cfg = write_ds_config(tmp_path / "tb.json", tensorboard=on, wandb={"enabled": True}, csv_monitor=on)
    err = refuse(capsys, "--ds-config", str(cfg))
    assert "tensorboard.enabled: the tensorboard package is not installed" in err
    assert "wandb.enabled: the wandb package is not installed" in err
    assert len(err.strip().splitlines()) == 2  # and none for csv_monitor
    from mmpipe.run_args import TrainArgs
    from mmpipe.run_config import resolve
    ok = write_ds_config(tmp_path / "csv.json", csv_monitor=on, tensorboard={"enabled": False})
    assert resolve(TrainArgs.from_argv(["--ds-config", str(ok), "--preset", "tiny"]), world_size=2).ds_config[
        "csv_monitor"]["enabled"]
