"""train_log.csv and summary.json: one writer for mmpipe.train, the engine-'dp' bench ranks and the
bench peers, so one reader (mmpipe.bench.run_variant, the scripts) serves every run.

Three rates per step, because a row is not a sample once samples are packed (mmpipe.data.packing):

    samples_per_s        real samples / s (a packed row holds several; one-sample rows: rows / s)
    useful_tokens_per_s  the samples' own decoder positions / s (their text and image positions, no
                         padding): what packing raises
    positions_per_s      decoder positions computed / s, padding included = rows x positions per row / s

E.g. 64 one-sample rows of 28 positions (16 image + 12 text) whose samples hold 1586 positions, in
0.25 s: 64 / 0.25 = 256 samples/s, 1586 / 0.25 = 6344 useful tokens/s, 64 x 28 / 0.25 = 7168
positions/s; padding share 1 - 1586 / 1792 = 11.5%. The counts come from the caller
(mmpipe.runtime.feed.StepCounts over the step's rows).
"""
from __future__ import annotations

import csv
import json
import statistics
import time
from pathlib import Path

CSV_FIELDS = ["step", "loss", "lr", "samples_per_s", "useful_tokens_per_s", "positions_per_s", "elapsed_s", "skipped",
              "loss_scale"]


class StepLog:
    """One row per optimizer step in OUT/train_log.csv, and the rates of summary.json.

    train_batch: rows per optimizer step (micro x GAS x DP; one sample each in the classic layout);
    positions_per_row: decoder positions per row (image + text, pads included; mmpipe.runtime.feed.
    decoder_length). append: a resumed run adds to its log (the header goes only into an empty file).
    enabled=False (every rank but 0) writes nothing and keeps the step times and losses, so callers
    log on every rank alike. elapsed_s counts wall time from construction.
    """

    def __init__(self, out: Path, train_batch: int, positions_per_row: int, *, append: bool = False,
                 enabled: bool = True, aux: bool = False, logged: tuple[str, ...] = ()):
        self.out, self.train_batch, self.positions_per_row = Path(out), train_batch, positions_per_row
        self.enabled = enabled
        self.times: list[float] = []
        self.losses: list[float] = []
        self.samples: list[int] = []  # real samples of each step (rank 0: the counting rank)
        self.useful: list[int] = []   # their own decoder positions, padding not counted
        self.last_logged: dict[str, float] = {}  # the objective's values of the last step (--objective dpo: rewards)
        self._file = self._csv = None
        if enabled:
            self.out.mkdir(parents=True, exist_ok=True)
            self._file = open(self.out / "train_log.csv", "a" if append else "w", newline="")
            # aux (an MoE model, mmpipe.model.moe): loss = lm_loss + aux_loss, the load-balancing term apart
            self._csv = csv.DictWriter(self._file, CSV_FIELDS + (["lm_loss", "aux_loss"] if aux else []) + list(logged))
            if self._file.tell() == 0:
                self._csv.writeheader()
        self.t_start = time.perf_counter()

    @property
    def positions_per_step(self) -> int:
        return self.train_batch * self.positions_per_row  # e.g. 64 rows x 28 = 1792, pads included

    def elapsed(self) -> float:
        return time.perf_counter() - self.t_start

    def step(self, step: int, loss: float, dt: float, counts: tuple[int, int] | None = None, *,
             lr: float | None = None, skipped: str = "", loss_scale: float | None = None,
             aux_loss: float | None = None, logged: dict[str, float] | None = None) -> None:
        """Step `step` took dt seconds and trained counts = (samples, useful): real samples holding useful decoder
        positions of their own (feed.StepCounts over its rows; needed where the log is enabled, ignored
        elsewhere). lr: the rate the step's update used, None where the caller has no schedule to report (peers);
        loss_scale: fp16 only. Flushed per row: a crashed run's log has every finished step."""
        self.times.append(dt)
        self.losses.append(loss)
        self.last_logged = dict(logged or {})
        if not self.enabled:
            return
        if counts is None:
            raise ValueError("StepLog.step: an enabled log needs the step's samples and useful positions")
        samples, useful = counts
        self.samples.append(samples)
        self.useful.append(useful)
        rates = self.rates()
        moe = {} if aux_loss is None else {"lm_loss": repr(loss - aux_loss), "aux_loss": repr(aux_loss)}
        self._csv.writerow({
            **moe, "step": step, "loss": repr(loss), "lr": "" if lr is None else f"{lr:.6g}",
            "samples_per_s": f"{rates['samples_per_s']:.1f}",
            "useful_tokens_per_s": f"{rates['useful_tokens_per_s']:.0f}",
            "positions_per_s": f"{rates['positions_per_s']:.0f}",
            "elapsed_s": f"{self.elapsed():.2f}", "skipped": skipped,
            "loss_scale": "" if loss_scale is None else f"{loss_scale:g}",
            **{k: repr(v) for k, v in self.last_logged.items()}})
        self._file.flush()

    def rates(self) -> dict:
        """The last step's rates (an enabled log: the counts are there)."""
        dt = self.times[-1]
        return {"samples_per_s": self.samples[-1] / dt, "useful_tokens_per_s": self.useful[-1] / dt,
                "positions_per_s": self.positions_per_step / dt}

    def summary(self, **extra) -> dict:
        """summary.json's shared fields, then `extra` (which may override one, e.g. steps of a resumed
        run). Rates: the timed steps' mean count per step over their median step time, the first step
        left out (it allocates buffers and exchanges shapes); one-sample rows: train_batch / median step,
        as before packing. None where the log counted nothing (a disabled rank)."""
        timed = self.times[1:] or self.times
        step_s = statistics.median(timed) if timed else float("nan")

        def per_s(counts: list[int]) -> float | None:
            counted = counts[1:] or counts
            return statistics.fmean(counted) / step_s if counted else None
        return {"steps": len(self.times), "final_loss": self.losses[-1] if self.losses else None,
                "samples_per_s": per_s(self.samples), "useful_tokens_per_s": per_s(self.useful),
                "positions_per_s": self.positions_per_step / step_s, "step_time_s": step_s,
                "train_batch": self.train_batch, "decoder_length": self.positions_per_row, **self.last_logged,
                **extra}

    def seen(self, before: tuple[int, int] = (0, 0), rows_before: int = 0) -> dict:
        """summary.json's data counts over the whole run: this log's steps, plus `before` (samples,
        useful positions) in the `rows_before` rows a resumed run consumed before it (StepCounts over
        [0, rows_before)). padding_share = 1 - useful / positions, e.g. 1 - 1586 / (64 x 28) = 11.5%."""
        rows = rows_before + len(self.samples) * self.train_batch
        positions = rows * self.positions_per_row
        useful = before[1] + sum(self.useful)
        return {"samples_seen": before[0] + sum(self.samples), "rows_seen": rows, "useful_tokens": useful,
                "positions": positions, "padding_share": 1 - useful / positions if positions else None}

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


DATA_KEYS = ("records", "good", "bad", "bad_by_kind", "truncated", "first_bad")
CLIP_KEYS = ("clips", "clip_frames", "clip_frames_sampled", "clips_resized", "clips_fewer_frames",
             "clip_frames_dropped")


def data_counts(stats: dict) -> dict:
    """summary.json's data counts from the index's stats, images and clips apart (as the data report prints them):
    with_image / images count images alone (the index counts every medium's slot: a clip's, or a Qwen3-VL clip's one
    per temporal patch, less its clip_slots, and the records whose media are all clips), clips and their frames on
    their own; e.g. 16 clips and 8 images in 24 records: 8 with an image, 8 images, 16 clips (not 24 with an
    image)."""
    out = {k: stats[k] for k in DATA_KEYS}
    out["with_image"] = stats["with_image"] - stats.get("clip_only_records", 0)
    out["images"] = stats.get("images", stats["with_image"]) - stats.get("clip_slots", 0)
    if stats.get("clips"):
        out.update({k: stats[k] for k in CLIP_KEYS if k in stats})
    return out
