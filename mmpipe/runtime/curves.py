"""Training curves as one PNG (`mmpipe plot RUN [RUN ...]`): each run's train_log.csv, and its eval_log.csv
where validation wrote one, overlaid in four panels: loss by step, loss by wall time, learning rate, throughput."""
from __future__ import annotations

import argparse
import csv
import itertools
import math
from pathlib import Path

from ..config import ConfigError, fail
from ..flags import print_plan

TRAIN_COLUMNS = ("step", "loss", "lr", "samples_per_s", "elapsed_s")
EVAL_COLUMNS = ("step", "eval_loss", "elapsed_s")
SMOOTH_ABOVE = 100  # points; fewer are read one by one, more are drawn faint under their running mean


def _number(cell: str | None) -> float:
    """A CSV cell as a float. Empty (a bench peer's lr), cut short (a crashed run's last row) or unreadable
    is NaN, which the plot leaves out like the 'nan'/'inf' loss of a skipped step."""
    try:
        return float(cell)
    except (TypeError, ValueError):
        return math.nan


def _read(path: Path, columns: tuple[str, ...]) -> dict[str, list[float]]:
    with open(path, newline="") as f:
        reader = csv.DictReader(f)
        missing = [c for c in columns if c not in (reader.fieldnames or ())]
        if missing:
            raise ConfigError(f"{path}: no column {', '.join(missing)} (has: {', '.join(reader.fieldnames or ())})")
        rows = list(reader)
    return {c: [_number(row.get(c)) for row in rows] for c in columns}


def _wall_time(elapsed: list[float]) -> list[float]:
    """elapsed_s starts again at 0 when a run resumes (a new StepLog); carry each earlier segment's time
    forward so the curve keeps moving right instead of jumping back to the origin."""
    out: list[float] = []
    offset = 0.0
    for t in elapsed:
        if out and t + offset < out[-1]:
            offset = out[-1]
        out.append(t + offset)
    return out


def read_run(run_dir: Path) -> tuple[dict[str, list[float]], dict[str, list[float]] | None]:
    """(train columns, eval columns or None): the columns of TRAIN_COLUMNS / EVAL_COLUMNS as floats, NaN where
    a cell is empty or not a number, elapsed_s made monotonic across resumes."""
    train_csv = run_dir / "train_log.csv"
    if not run_dir.is_dir():
        raise ConfigError(f"{run_dir}: no such directory")
    if not train_csv.is_file():
        raise ConfigError(f"{run_dir}: no train_log.csv (not a run directory, or no step logged yet)")
    train = _read(train_csv, TRAIN_COLUMNS)
    clock, train["elapsed_s"] = train["elapsed_s"], _wall_time(train["elapsed_s"])
    evals = _read(run_dir / "eval_log.csv", EVAL_COLUMNS) if (run_dir / "eval_log.csv").is_file() else None
    if evals is not None:
        # validation reads the training clock, so an evaluation moves by the same offset as its step's row
        offsets = {step: wall - t for step, t, wall in zip(train["step"], clock, train["elapsed_s"])}
        evals["elapsed_s"] = [t + offsets.get(step, 0.0) for step, t in zip(evals["step"], evals["elapsed_s"])]
    return train, evals


def _running_mean(ys: list[float], half: int) -> list[float]:
    """Mean of each point and up to `half` neighbours either side (fewer at the ends), from prefix sums."""
    sums = [0.0, *itertools.accumulate(ys)]
    spans = [(max(0, i - half), min(len(ys), i + half + 1)) for i in range(len(ys))]
    return [(sums[b] - sums[a]) / (b - a) for a, b in spans]


def _line(ax, xs: list[float], ys: list[float], label: str, *, smooth: bool = False, **style) -> None:
    """Plot the finite (x, y) points. A run with nothing to show still gets its (empty) line, so every panel's
    legend names every run and says why one is missing. smooth: past SMOOTH_ABOVE points a step-to-step noisy
    series (loss, throughput) hides the trend and the other runs under it; draw it faint, and over it its
    running mean, the line the legend names."""
    points = [(x, y) for x, y in zip(xs, ys) if math.isfinite(x) and math.isfinite(y)]
    xs, ys = [x for x, _ in points], [y for _, y in points]
    if smooth and len(points) > SMOOTH_ABOVE:
        half = len(points) // 100
        ax.plot(xs, ys, alpha=0.2, linewidth=0.8, **style)
        ys, label = _running_mean(ys, half), f"{label}, mean of {2 * half + 1} steps"
    ax.plot(xs, ys, label=label if points else f"{label} (not logged)", **style)


def build_figure(run_dirs: list[Path], labels: list[str] | None = None):
    """The four-panel matplotlib Figure of `run_dirs` (one colour per run); the CSVs are checked first."""
    run_dirs = [Path(d) for d in run_dirs]
    runs = [read_run(d) for d in run_dirs]
    if labels is None:
        labels = [d.resolve().name for d in run_dirs]
        if len(set(labels)) < len(labels):  # e.g. two machines' runs/default: the paths as given tell them apart
            labels = [str(d) for d in run_dirs]
    elif len(labels) != len(run_dirs):
        raise ConfigError(f"--labels: {len(labels)} names for {len(run_dirs)} runs; give one per run")

    # matplotlib is heavy and only this command needs it. A bare Figure on the Agg canvas draws to files
    # without pyplot, so no global backend or open-figure state changes under a caller.
    from matplotlib.backends.backend_agg import FigureCanvasAgg
    from matplotlib.figure import Figure
    from matplotlib.ticker import MaxNLocator

    fig = Figure(figsize=(13, 8.5), layout="constrained")
    FigureCanvasAgg(fig)
    (by_step, by_time), (lr_ax, speed_ax) = fig.subplots(2, 2)
    # wall time in the unit that keeps the tick labels short: seconds, minutes or hours
    longest = max((t for train, _ in runs for t in train["elapsed_s"] if math.isfinite(t)), default=0.0)
    scale, unit = (3600.0, "h") if longest > 2 * 3600 else (60.0, "min") if longest > 120 else (1.0, "s")
    val_style = dict(linestyle="--", marker="o", markersize=4, zorder=3)  # above every run's noisier training line

    for i, (label, (train, evals)) in enumerate(zip(labels, runs)):
        colour = f"C{i}"
        dropped = sum(not math.isfinite(v) for v in train["loss"])
        # say how many losses were left out: a NaN step must not vanish without a trace
        _line(by_step, train["step"], train["loss"], label + (f" ({dropped} non-finite left out)" if dropped else ""),
              smooth=True, color=colour)
        _line(by_time, [t / scale for t in train["elapsed_s"]], train["loss"], label, smooth=True, color=colour)
        if evals is not None:
            _line(by_step, evals["step"], evals["eval_loss"], f"{label} validation", color=colour, **val_style)
            _line(by_time, [t / scale for t in evals["elapsed_s"]], evals["eval_loss"], f"{label} validation",
                  color=colour, **val_style)
        _line(lr_ax, train["step"], train["lr"], label, color=colour)
        _line(speed_ax, train["step"], train["samples_per_s"], label, smooth=True, color=colour)

    for ax, title, xlabel, ylabel in [
            (by_step, "Loss by step (validation dashed)", "step", "loss"),
            (by_time, "Loss by wall time (validation dashed)", f"wall time ({unit})", "loss"),
            (lr_ax, "Learning rate", "step", "learning rate"),
            (speed_ax, "Throughput", "step", "samples / s")]:
        ax.set(title=title, xlabel=xlabel, ylabel=ylabel)
        ax.grid(alpha=0.3)
        ax.legend(fontsize=8)
    for ax in (by_step, lr_ax, speed_ax):
        ax.xaxis.set_major_locator(MaxNLocator(integer=True))  # steps are whole: no tick at step 2.5
    lr_ax.ticklabel_format(axis="y", style="sci", scilimits=(-2, 3))  # 3e-4 reads better than 0.0003
    speed_ax.set_ylim(bottom=0)  # throughput read against zero, not against its own noise
    return fig


def plot_runs(run_dirs: list[Path], out_png: Path, labels: list[str] | None = None) -> Path:
    """Write the training curves of `run_dirs` to `out_png` (one PNG, four panels); returns its path."""
    fig = build_figure(run_dirs, labels)
    out_png = Path(out_png)
    out_png.parent.mkdir(parents=True, exist_ok=True)
    fig.savefig(out_png, dpi=100)
    return out_png


def add_plot_args(p: argparse.ArgumentParser) -> None:
    p.add_argument("runs", nargs="+", metavar="RUN", help="run directories, each with a train_log.csv")
    p.add_argument("--out", default=None, help="the PNG to write (default: curves.png in the first RUN)")
    p.add_argument("--labels", default=None, help="comma-separated legend names, one per RUN (default: their names)")


def main_plot(args) -> int:
    runs = [Path(r) for r in args.runs]
    out = Path(args.out) if args.out else runs[0] / "curves.png"
    labels = [s.strip() for s in args.labels.split(",")] if args.labels else None
    try:
        if out.suffix.lower() != ".png":
            raise ConfigError(f"--out: {out} is not a .png file")
        if args.dry_run:  # the figure is drawn (every log checked), not saved
            build_figure(runs, labels)
            return print_plan(f"plot {len(runs)} run(s)", runs=", ".join(str(r.resolve()) for r in runs),
                              out=out.resolve())
        print(plot_runs(runs, out, labels))
    except ConfigError as e:
        return fail(e)
    except OSError as e:  # unreadable log, unwritable --out: one line, not a traceback
        return fail(ConfigError(f"{e.filename or out}: {e.strerror}"))
    return 0
