"""`mmpipe plot`: runs' train_log.csv (and eval_log.csv where there is one) drawn as one four-panel PNG."""
from __future__ import annotations

import csv
import math
import struct
from pathlib import Path

import pytest

from mmpipe.cli import main as cli_main
from mmpipe.config import ConfigError
from mmpipe.runtime.curves import build_figure, plot_runs
from mmpipe.runtime.steplog import CSV_FIELDS

STEPS = 20


def fake_run(path: Path, *, lr: bool, nan_step: int | None = None, evals: bool = False, speed: float = 60.0,
             steps: int = STEPS) -> Path:
    """A run directory as StepLog writes it: a falling loss, a warmup-then-decay lr (or none, like a bench
    peer), a slow first step, `speed` samples/s after it; optionally one skipped step with a nan loss and a
    4-row eval_log.csv."""
    path.mkdir(parents=True)
    with open(path / "train_log.csv", "w", newline="") as f:
        w = csv.DictWriter(f, CSV_FIELDS)
        w.writeheader()
        for step in range(1, steps + 1):
            loss = math.nan if step == nan_step else 4.0 * math.exp(-step * speed / 480) + 0.5 + 0.1 * (-1) ** step
            rate = 1e-3 * min(step / 4, 1.0) * (1 - step / (2 * steps))
            w.writerow({"step": step, "loss": repr(loss), "lr": f"{rate:.6g}" if lr else "",
                        "samples_per_s": speed / 3 if step == 1 else speed + step % 3,
                        "useful_tokens_per_s": 8000, "positions_per_s": 9000,
                        "elapsed_s": f"{30 * step / speed:.2f}", "skipped": "nonfinite" if step == nan_step else "",
                        "loss_scale": ""})
    if evals:
        with open(path / "eval_log.csv", "w", newline="") as f:
            w = csv.writer(f)
            w.writerow(["step", "eval_loss", "eval_samples", "eval_tokens", "elapsed_s"])
            for step in (5, 10, 15, 20):
                w.writerow([step, 4.0 * math.exp(-step / 8) + 0.7, 64, 9000, 0.5 * step + 0.2])
    return path


@pytest.fixture
def runs(tmp_path) -> list[Path]:
    return [fake_run(tmp_path / "bf16", lr=True, nan_step=7, evals=True),
            fake_run(tmp_path / "hf-peer", lr=False, speed=40.0)]


def png_size(path: Path) -> tuple[int, int]:
    data = path.read_bytes()
    assert data[:8] == b"\x89PNG\r\n\x1a\n" and data[12:16] == b"IHDR"
    return struct.unpack(">II", data[16:24])


def test_plot_runs_writes_one_png(runs, tmp_path):
    out = plot_runs(runs, tmp_path / "plots" / "curves.png")
    assert out == tmp_path / "plots" / "curves.png"
    assert png_size(out) == (1300, 850)  # figsize 13 x 8.5 in at 100 dpi


def test_figure_panels_lines_and_legends(runs):
    fig = build_figure(runs)
    by_step, by_time, lr_ax, speed_ax = fig.axes
    assert [ax.get_title() for ax in fig.axes] == [
        "Loss by step (validation dashed)", "Loss by wall time (validation dashed)", "Learning rate", "Throughput"]
    assert by_time.get_xlabel() == "wall time (s)"
    # loss panels: bf16 train + bf16 validation + hf-peer train; one line per run in the others
    assert [len(ax.get_lines()) for ax in fig.axes] == [3, 3, 2, 2]
    legends = [[t.get_text() for t in ax.get_legend().get_texts()] for ax in fig.axes]
    assert legends[0] == ["bf16 (1 non-finite left out)", "bf16 validation", "hf-peer"]
    assert legends[1] == ["bf16", "bf16 validation", "hf-peer"]
    assert legends[2] == ["bf16", "hf-peer (not logged)"]  # the peer logs no lr
    assert legends[3] == ["bf16", "hf-peer"]

    train, val, _ = by_step.get_lines()
    assert len(train.get_xdata()) == STEPS - 1 and all(map(math.isfinite, train.get_ydata()))  # the nan left out
    assert train.get_linestyle() == "-" and val.get_linestyle() == "--" and val.get_marker() == "o"
    assert list(val.get_xdata()) == [5, 10, 15, 20]
    assert train.get_color() == val.get_color() != by_step.get_lines()[2].get_color()  # one colour per run
    assert len(lr_ax.get_lines()[1].get_xdata()) == 0


def test_labels_and_resumed_wall_time(runs):
    # a resumed run appends to its logs and its clock starts again from 0: wall time keeps going forward, the
    # evaluations (on the training clock) with it
    with open(runs[0] / "train_log.csv", "a", newline="") as f:
        csv.DictWriter(f, CSV_FIELDS).writerow({"step": STEPS + 1, "loss": "0.6", "lr": "1e-4", "samples_per_s": 60,
                                                 "useful_tokens_per_s": 8000, "positions_per_s": 9000,
                                                 "elapsed_s": "0.40"})
    with open(runs[0] / "eval_log.csv", "a", newline="") as f:
        csv.writer(f).writerow([STEPS + 1, 0.9, 64, 9000, 0.45])
    fig = build_figure(runs, labels=["ours", "transformers"])
    assert [t.get_text() for t in fig.axes[3].get_legend().get_texts()] == ["ours", "transformers"]
    train, val, _ = fig.axes[1].get_lines()
    assert list(train.get_xdata())[-2:] == [10.0, 10.4] and list(val.get_xdata())[-2:] == [10.2, 10.45]
    with pytest.raises(ConfigError, match="--labels: 1 names for 2 runs"):
        build_figure(runs, labels=["ours"])


def test_long_noisy_series_are_drawn_faint_under_their_running_mean(tmp_path):
    run = fake_run(tmp_path / "long", lr=True, nan_step=50, steps=300)
    by_step, _, lr_ax, speed_ax = build_figure([run]).axes
    raw, mean = by_step.get_lines()
    assert raw.get_alpha() == 0.2 and len(raw.get_xdata()) == 299 and raw.get_label().startswith("_")  # no legend
    assert mean.get_label() == "long (1 non-finite left out), mean of 5 steps"
    late = list(mean.get_ydata())[200:-2]  # where the loss has flattened, the +-0.1 zigzag is averaged out
    assert max(abs(a - b) for a, b in zip(late, late[1:])) < 0.05
    assert len(speed_ax.get_lines()) == 2 and len(lr_ax.get_lines()) == 1  # the lr schedule is smooth already


def run_cli(argv: list[str]) -> int:
    return cli_main(["plot", *argv])  # the command line as typed, shared flags (--dry-run) included


def test_main_plot_defaults_to_the_first_run(runs, capsys):
    assert run_cli([str(r) for r in runs]) == 0
    assert capsys.readouterr().out.strip() == str(runs[0] / "curves.png")
    assert png_size(runs[0] / "curves.png") == (1300, 850)


@pytest.mark.parametrize("case, message", [
    ("no_log", "no train_log.csv (not a run directory, or no step logged yet)"),
    ("missing", "no such directory"),
    ("bad_out", "--out: "),
])
def test_main_plot_refuses_in_one_line(runs, tmp_path, capsys, case, message):
    (tmp_path / "empty").mkdir()
    argv = {"no_log": [str(runs[0]), str(tmp_path / "empty")], "missing": [str(tmp_path / "nope")],
            "bad_out": [str(runs[0]), "--out", str(tmp_path / "curves.jpg")]}[case]
    assert run_cli(argv) == 2
    err = capsys.readouterr().err.splitlines()
    assert len(err) == 1 and err[0].startswith("mmpipe: error: ") and message in err[0]
    assert not (runs[0] / "curves.png").exists()
