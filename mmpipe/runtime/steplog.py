"""train_log.csv and summary.json: one writer for mmpipe.train, the engine-'dp' bench ranks and the
bench peers, so one reader (mmpipe.bench.run_variant, the scripts) serves every run."""
from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path

CSV_FIELDS = ["step", "loss", "lr", "samples_per_s", "tokens_per_s", "elapsed_s", "skipped", "loss_scale"]


class StepLog:
    """One row per optimizer step in OUT/train_log.csv, and the rates of summary.json.

    train_batch: samples per optimizer step; tokens_per_sample: decoder positions per sample (image +
    text, pads included). append: a resumed run adds to its log (the header goes only into an empty
    file). enabled=False (every rank but 0) writes nothing and keeps the step times and losses, so
    callers log on every rank alike. elapsed_s counts wall time from construction.
    """

    def __init__(self, out: Path, train_batch: int, tokens_per_sample: int, *, append: bool = False,
                 enabled: bool = True):
        self.out, self.train_batch, self.tokens_per_sample = Path(out), train_batch, tokens_per_sample
        self.enabled = enabled
        self.times: list[float] = []
        self.losses: list[float] = []
        self._file = self._csv = None
        if enabled:
            self.out.mkdir(parents=True, exist_ok=True)
            self._file = open(self.out / "train_log.csv", "a" if append else "w", newline="")
            self._csv = csv.DictWriter(self._file, CSV_FIELDS)
            if self._file.tell() == 0:
                self._csv.writeheader()
        self.t_start = time.perf_counter()

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def step(self, step: int, loss: float, dt: float, *, lr: float | None = None, skipped: str = "",
             loss_scale: float | None = None) -> None:
        """Step `step` took dt seconds. lr: None where the caller has no schedule to report (peers);
        loss_scale: fp16 only. Flushed per row: a crashed run's log has every finished step."""
        self.times.append(dt)
        self.losses.append(loss)
        if not self.enabled:
            return
        self._csv.writerow({
            "step": step, "loss": repr(loss), "lr": "" if lr is None else f"{lr:.6g}",
            "samples_per_s": f"{self.train_batch / dt:.1f}",
            "tokens_per_s": f"{self.train_batch * self.tokens_per_sample / dt:.0f}",
            "elapsed_s": f"{self.elapsed():.2f}", "skipped": skipped,
            "loss_scale": "" if loss_scale is None else f"{loss_scale:g}"})
        self._file.flush()

    def summary(self, **extra) -> dict:
        """summary.json's shared fields, then `extra` (which may override one, e.g. steps of a resumed
        run). Rates use the median step, the first step left out: it allocates buffers and exchanges
        shapes."""
        timed = self.times[1:] or self.times
        step_s = statistics.median(timed) if timed else float("nan")
        return {"steps": len(self.times), "final_loss": self.losses[-1] if self.losses else None,
                "samples_per_s": self.train_batch / step_s,
                "tokens_per_s": self.train_batch * self.tokens_per_sample / step_s, "step_time_s": step_s,
                "train_batch": self.train_batch, **extra}

    def write_summary(self, summary: dict) -> None:
        """Write summary.json (a finished run's marker for the bench) and close the log."""
        self.close()
        if self.enabled:
            (self.out / "summary.json").write_text(json.dumps(summary, indent=2) + "\n")

    def finish(self, **extra) -> None:
        self.write_summary(self.summary(**extra))

    def close(self) -> None:
        if self._file is not None:
            self._file.close()
