"""The pipeline schedules, one `Schedule` record each: everything that differs between them is a
field of the record, and the record itself, not its name, is what the planner, the bench and the
runtime pass around (`--schedule` / `pipeline.schedule` / a sweep variant's "schedule" are looked up
here once, at the edge: `schedule_named`, `asked`).

    ONE_F_ONE_B   1f1b: DeepSpeed's own TrainSchedule; the planner's closed form (the baseline)
    ZB_H1         zb-h1: zero-bubble ZB-H1, the backward split into B and W (docs/schedules.md)
    DUALPIPEV     dualpipev: DeepSeek-V3's DualPipeV as DeepSpeed 0.19.8 ships it: 2p stages in a V on p
                  ranks, its own module (DualPipeVModule) and engine (DualPipeVEngine), DeepSpeed's own
                  DualPipeVSchedule running (mmpipe.runtime.dualpipev)

A record carries its order generator, `orders(p, m, weight_stages, times)`: each stage's F, B (and
W) ops in the order it runs them (mmpipe.planning.orders). The planner replays that order with
predicted seconds (schedules.predict); the runtime (mmpipe.runtime.schedule.OrderSchedule) turns
the same order, whatever schedule made it, into DeepSpeed instructions: no per-schedule runtime
code. The one exception is `deepspeed_native`: 1F1B runs as DeepSpeed's own TrainSchedule, the
engine untouched (its order here is what the planner replays; it equals DeepSpeed's in the
micro-batches each stage holds, P - s). DualPipeV is native too, with its own module class (`module`):
the V's two stages per rank (`stages_per_rank`), and DeepSpeed's engine for it (`engine`), which
`deepspeed.initialize` picks from the module's class.

A new schedule: its order generator (a function like orders.zb_h1_orders) and a record below.
"""
from __future__ import annotations

from collections.abc import Callable
from dataclasses import dataclass

from .orders import Op, dualpipev_orders, one_f_one_b_orders, zb_h1_orders

# (stages p, micro-batches m, weight_stages[i]: stage i has weight-gradient work, times[i] = (F, B, W) or
# None for unit times) -> each stage's ops in order, with simulated start / end
OrderGenerator = Callable[..., list[list[Op]]]


@dataclass(frozen=True)
class Schedule:
    """One pipeline schedule: its name, its order and what the planner, the calibration and the runtime ask of it."""
    name: str   # --schedule, the DeepSpeed JSON's pipeline.schedule, a bench variant's and results row's "schedule"
    short: str  # its label in `mmpipe plan`'s columns and stage-row keys ('zb GiB', zb_memory_gib)
    # B (input gradient) and W (weight gradients) as separate ops. The planner replays the order with
    # split=this, holds memory at that order's peak micro-batches in flight (up to P on a stage with W,
    # against 1F1B's P - s), and adds the device's split_overhead to every W: the one term a variant
    # of a splitting schedule fits in `mmpipe plan --calibrate` (calibrate.fit_split, on top of the
    # baseline's fit). The runtime splits the trainable linears' backward and stashes
    # (input, grad_output) from B to W (mmpipe.runtime.schedule).
    split_backward: bool
    order: OrderGenerator  # its order generator; call it as `orders(...)`
    # the runtime leaves the engine's own schedule in place instead of translating `orders`
    deepspeed_native: bool = False
    # the PipelineModule class the runtime builds ("module:Class"), and the class of the engine
    # deepspeed.initialize returns for it (it picks DualPipeVEngine for a DualPipeVModule)
    module: str = "mmpipe.runtime.pipeline:VLMPipeline"
    engine: str = "PipelineEngine"
    stages_per_rank: int = 1  # pipeline stages (parts of the layer list) each pipeline rank holds: the V's 2
    min_micro_per_rank: int = 0  # gradient accumulation steps >= this x pipeline ranks (0: any; DualPipeV: 2)
    # the order's own start / end times are its prediction (no blocking-p2p replay of it): DualPipeV's
    # sends and receives are batched per step (CommitP2P), its order is timed by its data dependencies
    timed_order: bool = False
    # (run feature, why this schedule refuses it): RunConfig's check names each feature a run asks for
    refuses: tuple[tuple[str, str], ...] = ()

    def orders(self, stages: int, micro_batches: int, weight_stages, times=None) -> list[list[Op]]:
        """Each stage's compute ops (F, B, W) in the order this schedule runs them (unit times by default)."""
        return self.order(stages, micro_batches, weight_stages, times)

    def problems(self, ranks: int, micro_batches: int, features: dict[str, bool]) -> list[str]:
        """One line per reason this schedule cannot run a pipeline of `ranks` ranks with `micro_batches`
        gradient accumulation steps and these features (name -> asked for)."""
        out = [f"--schedule {self.name}: {why}" for feature, why in self.refuses if features.get(feature)]
        if micro_batches < self.min_micro_per_rank * ranks:
            need = self.min_micro_per_rank * ranks
            out.append(f"--schedule {self.name}: gradient_accumulation_steps {micro_batches} < "
                       f"{self.min_micro_per_rank} x {ranks} stages; DeepSpeed's {self.engine} needs at least {need} "
                       f"micro-batches per step")
        return out

    def __str__(self) -> str:  # messages and f-strings print the name
        return self.name


ONE_F_ONE_B = Schedule("1f1b", "1f1b", split_backward=False, order=one_f_one_b_orders, deepspeed_native=True)
ZB_H1 = Schedule("zb-h1", "zb", split_backward=True, order=zb_h1_orders)
# What DualPipeV refuses, and why (docs/schedules.md, "DualPipeV"): nothing mmpipe's layer list carries (--tp is
# refused for every schedule but 1F1B and zb-h1 by RunConfig's TP check; DeepSpeed's DualPipeVEngine asserts on
# pipe_partitioned). Validation runs: DualPipeVEngine.eval_batch through the V's wire; an MoE model with --ep: the
# expert groups are the DP ranks of the rank's pipe coordinate, which both its stages share, and the shards are found
# in the whole module, both phases (tests/test_dualpipev_layouts.py).
DUALPIPEV_REFUSES: tuple[tuple[str, str], ...] = ()
DUALPIPEV = Schedule("dualpipev", "dpv", split_backward=False, order=dualpipev_orders, deepspeed_native=True,
                     module="mmpipe.runtime.dualpipev:VLMDualPipeV", engine="DualPipeVEngine", stages_per_rank=2,
                     min_micro_per_rank=2, timed_order=True, refuses=DUALPIPEV_REFUSES)

SCHEDULES = (ONE_F_ONE_B, ZB_H1, DUALPIPEV)  # the baseline first: plan's columns and predictions follow this order
SCHEDULE_NAMES = tuple(s.name for s in SCHEDULES)
# The schedule costmodel.pipeline_step_seconds' closed form ((m + P - 1) slots) describes, the default
# everywhere, and the one whose variants `mmpipe plan --calibrate` fits by least squares (efficiency,
# the per-slot and per-step overheads, the all-reduce's bandwidth). Every other schedule is predicted
# as a change to its step: both orders replayed with the stages' seconds (costmodel.replayed_step_seconds).
BASELINE = ONE_F_ONE_B
BOTH = "both"  # `mmpipe plan --schedule both`: 1F1B and ZB-H1 (one stage per rank), side by side, the faster
ALL = "all"  # `mmpipe plan --schedule all`: every schedule, DualPipeV's V too


def schedule_named(name: str | Schedule) -> Schedule:
    """The record of a name (a record is itself); an unknown name is a ValueError naming the valid ones."""
    if isinstance(name, Schedule):
        return name
    for s in SCHEDULES:
        if s.name == name:
            return s
    raise ValueError(f"unknown schedule {name!r} (valid: {', '.join(SCHEDULE_NAMES)})")


def asked(which: str | Schedule | tuple[Schedule, ...]) -> tuple[Schedule, ...]:
    """The schedules a prediction is asked for: a record, several, or `mmpipe plan --schedule`'s
    name ('all': every one; 'both': those with one stage per rank, 1F1B and ZB-H1)."""
    if isinstance(which, tuple):
        return which
    if which == ALL:
        return SCHEDULES
    return tuple(s for s in SCHEDULES if s.stages_per_rank == 1) if which == BOTH else (schedule_named(which),)


def row_schedule(name: object) -> Schedule:
    """The schedule a bench results row ran: rows from before the column (and anything unknown) ran the baseline."""
    return next((s for s in SCHEDULES if s.name == name), BASELINE)
