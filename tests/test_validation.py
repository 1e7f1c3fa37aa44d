"""Validation during training: the pipeline's validation loss (DeepSpeed's eval_batch on every stage
and DP rank) equals the single-device reference model's mean over the set's answer tokens, at
PP=2 and PP=4 (DP=1), PP=1 x DP=2, and PP=1 x DP=1 (the --eval-split run); training losses are
bit-identical with validation on and off; the monitors configured in the DeepSpeed JSON
(tensorboard, csv_monitor) receive the run's numbers."""
from __future__ import annotations

import csv
import json
import shutil
from pathlib import Path

import pytest
import torch

from conftest import Run, train_run, write_ds_config
from mmpipe.data.batches import StepBatches, rank_batches
from mmpipe.data.dataset import prepare_eval
from mmpipe.data.export import export_shapes
from mmpipe.data.packing import sample_rowset
from mmpipe.model.builder import lm_loss_sum
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from rank_series import launch_series

STEPS = 3


@pytest.fixture(scope="module")
def data(tmp_path_factory) -> tuple[Path, Path]:
    """Training set: 120 shapes records. Validation set: 37 others (seed 9), a text-only record and a
    bad one: 38 good samples, not a multiple of any step's batch, so the last eval batch is padded."""
    root = tmp_path_factory.mktemp("data")
    train = export_shapes(root / "train", "llava-jsonl", 120, image_size=32, patch=8)
    val = export_shapes(root / "val", "llava-jsonl", 37, seed=9, image_size=32, patch=8)
    with open(val, "a") as f:
        f.write(json.dumps({"conversations": [{"from": "human", "value": "how many shapes are there"},
                                              {"from": "gpt", "value": "two"}]}) + "\n")
        f.write(json.dumps({"image": "images/nowhere.png", "conversations": [
            {"from": "human", "value": "<image>\nwhat shape is red"}, {"from": "gpt", "value": "circle"}]}) + "\n")
    return train, val


@pytest.fixture(scope="module")
def ds_config(tmp_path_factory) -> Path:
    return write_ds_config(tmp_path_factory.mktemp("cfg") / "ds.json", train_micro_batch_size_per_gpu=4,
                           gradient_accumulation_steps=2)


def _args(data, ds_config, *extra) -> list[str]:
    train, _ = data
    return ["--preset", "tiny", "--data", str(train), "--ds-config", str(ds_config), "--steps", str(STEPS),
            "--eval-samples", "0", "--save-every", "1", "--keep-checkpoints", "0", "--text-len", "24", *extra]


def _eval_args(data, ds_config, *extra) -> list[str]:
    return _args(data, ds_config, "--eval-data", str(data[1]), "--eval-every", "2", *extra)


def _rows(path: Path) -> list[dict]:
    with open(path, newline="") as f:
        return list(csv.DictReader(f))


def reference_eval_loss(run_dir: Path, argv: list[str], step: int) -> float:
    """The single-device model of checkpoint `step`, on the same validation samples: summed
    cross-entropy over every answer token / their number."""
    run = resolve(TrainArgs.from_argv(argv), world_size=1)
    evalset = prepare_eval(run.eval_data, run.model, run_dir, 0, 0, verbose=False)
    model = load_reference(run_dir / "checkpoints", run.model, tag=f"step{step}").eval()
    batches = rank_batches(sample_rowset(evalset, run.model, run.text_len), StepBatches(0, 8, 1, 0, 1))
    total = 0.0
    with torch.no_grad():
        for _ in range(-(-evalset.size // 8)):
            inputs, labels = next(batches)
            total += float(lm_loss_sum(model(*inputs), labels))
    return total / evalset.answer_tokens()


@pytest.fixture(scope="module")
def two_rank_runs(tmp_path_factory, data, ds_config) -> dict[str, Run]:
    """The 2-rank runs, one launch (tests/rank_series.py: one run after the other in the same two ranks, each as
    `mmpipe train` runs it): PP=2 without validation (the baseline), PP=1 x DP=2 validated, and PP=2 validated with
    the monitors on (pp2_validated)."""
    base, dp2, pp2 = (tmp_path_factory.mktemp(name) for name in ("base", "dp2", "pp2"))
    runs = [(base / "run", _args(data, ds_config, "--stages", "2"), {}),
            (dp2 / "run", _eval_args(data, ds_config, "--stages", "1", "--dp", "2"), {}),
            (pp2 / "run", _eval_args(data, _monitored_config(pp2), "--stages", "2"), {})]
    return dict(zip(("baseline", "dp2", "pp2"), launch_series(runs)))


@pytest.fixture(scope="module")
def baseline(two_rank_runs) -> Run:
    return two_rank_runs["baseline"].check()


def _monitored_config(root: Path) -> Path:
    """ds_config's batches with DeepSpeed's tensorboard and csv_monitor sections on, writing under root."""
    return write_ds_config(root / "ds.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                           tensorboard={"enabled": True, "output_path": str(root / "tb"), "job_name": "run"},
                           csv_monitor={"enabled": True, "output_path": str(root / "csv"), "job_name": "run"})


@pytest.fixture(scope="module")
def pp2_validated(two_rank_runs) -> Run:
    """PP=2 with validation and the monitors on: the (2, 1) layout below, the monitors' test and the
    resume test's first part."""
    return two_rank_runs["pp2"].check()


@pytest.mark.parametrize("stages,dp", [(2, 1), (4, 1), (1, 2)])  # PP=1 DP=1: test_eval_split_holds_...
def test_validation_loss_equals_the_reference_and_training_is_untouched(tmp_path, data, ds_config, baseline,
                                                                        request, stages, dp):
    if (stages, dp) == (2, 1):
        run = request.getfixturevalue("pp2_validated")
    elif (stages, dp) == (1, 2):
        run = request.getfixturevalue("two_rank_runs")["dp2"]
    else:
        run = train_run(tmp_path / "run", *_eval_args(data, ds_config, "--stages", str(stages), "--dp", str(dp)))
    out = run.check().out
    rows = _rows(out / "eval_log.csv")
    assert [int(r["step"]) for r in rows] == [2, 3]  # every 2 steps and at the end
    assert {(r["eval_samples"], r["eval_tokens"]) for r in rows} == {(rows[0]["eval_samples"], rows[0]["eval_tokens"])}
    assert int(rows[0]["eval_samples"]) == 38  # 37 + the text-only record; the bad one counted and left out
    bad = (out / "eval_data" / "bad_records.jsonl").read_text().splitlines()
    assert len(bad) == 1 and "missing_image" in bad[0]
    argv = _eval_args(data, ds_config, "--output-dir", str(out), "--stages", "1")
    for r in rows:
        assert float(r["eval_loss"]) == pytest.approx(reference_eval_loss(out, argv, int(r["step"])), abs=1e-5)
    assert run.summary["eval_loss"] == float(rows[-1]["eval_loss"]) and run.summary["eval_step"] == STEPS
    if stages > 1:  # eval_batch's messages as well: each stage reads its integer tensors itself
        run.assert_only_floats_crossed(per_forward=None)
    if (stages, dp) == (2, 1):  # the same layout without validation (nor monitors): bit-identical training
        assert run.losses == baseline.losses


def test_monitors_receive_the_runs_numbers(pp2_validated):
    """tensorboard and csv_monitor sections of the DeepSpeed JSON: DeepSpeed's own train_loss / lr,
    and mmpipe's throughput, validation loss and per-stage timing, keyed by samples trained."""
    out = pp2_validated.out
    tb, csvd = out.parent / "tb", out.parent / "csv"
    from tensorboard.backend.event_processing.event_accumulator import EventAccumulator
    acc = EventAccumulator(str(tb / "run"))
    acc.Reload()
    tags = set(acc.Tags()["scalars"])
    per_step = {"Train/Samples/train_loss", "Train/Samples/lr", "Train/Samples/samples_per_s",
                "Train/Samples/useful_tokens_per_s", "Train/Samples/positions_per_s"}
    assert per_step | {"Eval/Samples/eval_loss", "Timing/measured_bubble", "Timing/stage0/forward_ms_per_micro",
                       "Timing/stage1/backward_ms_per_micro"} <= tags
    for tag in per_step:  # one event per optimizer step, at 8, 16, 24 samples
        assert [e.step for e in acc.Scalars(tag)] == [8, 16, 24], tag
    evals = acc.Scalars("Eval/Samples/eval_loss")
    assert [e.step for e in evals] == [16, 24]
    logged = [float(r["eval_loss"]) for r in _rows(out / "eval_log.csv")]
    assert [e.value for e in evals] == pytest.approx(logged, rel=1e-6)
    assert [e.value for e in acc.Scalars("Train/Samples/train_loss")] == pytest.approx(
        list(Run(out, None).losses.values()), rel=1e-6)
    assert (csvd / "run" / "Eval_Samples_eval_loss.csv").is_file()


def test_eval_split_holds_records_out_of_training(tmp_path, data, ds_config):
    """--eval-split 0.25 of 120 records: 30 held out, the same for every seed; none of them trained on.
    The run is the PP=1 DP=1 layout of the validation-loss test: its loss equals the reference's."""
    out = tmp_path / "run"
    argv = _args(data, ds_config, "--eval-split", "0.25", "--log-samples", "--stages", "1")
    run = train_run(out, *argv, "--steps", "12").check()
    rows = _rows(out / "eval_log.csv")
    assert [int(r["step"]) for r in rows] == [12]  # at the end
    assert run.summary["eval_loss"] == float(rows[0]["eval_loss"]) and run.summary["eval_step"] == 12
    assert int(rows[0]["eval_samples"]) == 30
    ref = reference_eval_loss(out, [*argv, "--output-dir", str(out)], 12)
    assert float(rows[0]["eval_loss"]) == pytest.approx(ref, abs=1e-5)

    def held_out(seed: str) -> set[int]:
        run = resolve(TrainArgs.from_argv([*argv, "--output-dir", str(out), "--seed", seed]),
                      world_size=1)
        evalset = prepare_eval(run.eval_data, run.model, out, int(seed), 0, verbose=False)
        return {evalset.row(p) for p in range(evalset.size)}
    held = held_out("0")
    assert len(held) == 30 and held_out("5") == held
    trained = {int(r["row"]) for r in _rows(out / "samples_dp0.csv")}
    assert len(trained) == 90 and not trained & held  # 12 steps x 8 = 96 positions: one epoch of the other 90


def test_a_resumed_run_validates_each_step_once(tmp_path, data, pp2_validated):
    """Validation after a resume appends to eval_log.csv; each validated step appears once. A copy of the
    3-step PP=2 run (validated at 2 and 3) resumed to 5: validated again at 4 and 5 only."""
    out = tmp_path / "run"
    shutil.copytree(pp2_validated.out, out)
    cfg = _monitored_config(tmp_path)
    train_run(out, *_eval_args(data, cfg, "--stages", "2", "--steps", "5", "--resume")).check()
    assert [int(r["step"]) for r in _rows(out / "eval_log.csv")] == [2, 3, 4, 5]


@pytest.mark.parametrize("extra,expect", [
    (["--eval-every", "2"], "--eval-every: there is nothing to validate on; give --eval-data or --eval-split"),
    (["--eval-split", "1.5"], "--eval-split: 1.5 must be a fraction between 0 and 1"),
    (["--eval-split", "0.2", "--eval-data", "VAL"], "--eval-split / --eval-data: give one"),
    (["--eval-data", "/nonexistent/val.jsonl"], "--eval-data: '/nonexistent/val.jsonl' is neither"),
    (["--eval-data", "shapes"], "--eval-data: 'shapes' and --data"),
    (["--eval-data", "VAL", "--eval-every", "-1"], "--eval-every: -1 must be >= 0"),
])
def test_bad_validation_flags_are_refused(tmp_path, capsys, data, ds_config, extra, expect):
    from mmpipe.cli import main
    extra = [str(data[1]) if a == "VAL" else a for a in extra]
    assert main(["train", *_args(data, ds_config, "--output-dir", str(tmp_path / "o"), *extra)]) == 2
    err = capsys.readouterr().err
    assert expect in err and err.startswith("mmpipe: error:"), err
