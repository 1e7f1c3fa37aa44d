"""The pipeline schedules, one `Schedule` record each: what differs between them, asked through the
record rather than by comparing the `--schedule` / `pipeline.schedule` strings.

    ONE_F_ONE_B   1f1b: DeepSpeed's own TrainSchedule; the planner's closed form (the baseline)
    ZB_H1         zb-h1: zero-bubble ZB-H1, the backward split into B and W (docs/schedules.md)

The names are declared here once: `mmpipe train --schedule` (mmpipe.run_args, checked in
run_config.resolve), `mmpipe plan --schedule` and a sweep variant's "schedule" read SCHEDULE_NAMES.

Each record is the planning half of the schedule; its runtime half (the DeepSpeed PipeSchedule and
instruction handlers that make an engine run it) is mmpipe.runtime.schedule.INSTALLERS[record].
It is not a field here because this module sits in planning/, below run_args (which builds the flag
from SCHEDULE_NAMES) and runtime/: a field holding the engine hook would pull DeepSpeed's engine and torch
into the planner and the argument parser, an upward import (tests/test_architecture.py), and a
lazy look-up by module path would be the same dependency, hidden. tests/test_schedules.py checks
that every record has its runtime half.

A new schedule: its order in mmpipe.planning.schedules (stage_orders, if it is not 1F1B's or
ZB-H1's), a record below, its installer in mmpipe.runtime.schedule.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule: its name and what the planner, the calibration and the runtime ask of it."""
    name: str   # --schedule, the DeepSpeed JSON's pipeline.schedule, a bench variant's and results row's "schedule"
    short: str  # its label in `mmpipe plan`'s columns and stage-row keys ('zb GiB', zb_memory_gib)
    # B (input gradient) and W (weight gradients) as separate ops. The planner replays the order
    # schedules.stage_orders makes with split=this, holds memory at that order's peak micro-batches in
    # flight (up to P on a stage with W, against 1F1B's P - s), and adds the device's split_overhead to
    # every W: the one term a variant of a splitting schedule fits in `mmpipe plan --calibrate`
    # (calibrate.fit_split, on top of the baseline's fit). The runtime splits the trainable linears'
    # backward and stashes (input, grad_output) from B to W (mmpipe.runtime.schedule).
    split_backward: bool


ONE_F_ONE_B = Schedule("1f1b", "1f1b", split_backward=False)
ZB_H1 = Schedule("zb-h1", "zb", split_backward=True)

SCHEDULES = (ONE_F_ONE_B, ZB_H1)  # the baseline first: plan's columns and predictions follow this order
SCHEDULE_NAMES = tuple(s.name for s in SCHEDULES)
# The schedule costmodel.pipeline_step_seconds' closed form ((m + P - 1) slots) describes, the default
# everywhere, and the one whose variants `mmpipe plan --calibrate` fits by least squares (efficiency,
# the per-slot and per-step overheads, the all-reduce's bandwidth). Every other schedule is predicted
# as a change to its step: both orders replayed with the stages' seconds (costmodel.replayed_step_seconds).
BASELINE = ONE_F_ONE_B
BOTH = "both"  # `mmpipe plan --schedule both`: every schedule, side by side, recommending the faster


def schedule_named(name: str) -> Schedule:
    for s in SCHEDULES:
        if s.name == name:
            return s
    raise ValueError(f"unknown schedule {name!r} (valid: {', '.join(SCHEDULE_NAMES)})")


def asked(name: str) -> tuple[Schedule, ...]:
    """The schedules `mmpipe plan --schedule name` predicts: that one, or with 'both' every one."""
    return SCHEDULES if name == BOTH else (schedule_named(name),)


def row_schedule(name: object) -> Schedule:
    """The schedule a bench results row ran: rows from before the column (and anything unknown) ran the baseline."""
    return next((s for s in SCHEDULES if s.name == name), BASELINE)
