"""Per-stage forward/backward time and the pipeline's idle (bubble) fraction, measured.

Why our own timers: DeepSpeed's `wall_clock_breakdown` crashes non-last stages in 0.19.8
(and `flops_profiler` forces it on), see ../shared/DEEPSPEED_NOTES.md.

How it works
------------
`PipelineEngine._exec_schedule` runs every instruction of the 1F1B schedule through
`self._INSTRUCTION_MAP[type(cmd)]` (a class-level dict of plain functions). `instrument(engine)`
gives the engine INSTANCE its own copy of that dict, each function wrapped in a
`time.perf_counter()` timer; the class dict is left untouched, so other engines in the process
are not affected. It also wraps, on the instance, `train_batch` (the wall time of one optimizer
step, the denominator of every fraction) and `_aggregate_total_loss` (the end-of-step loss
broadcast, see below).

What is measured, per rank (= one stage of one data-parallel replica)
---------------------------------------------------------------------
Wall time, summed over one `train_batch` call, per category:

  forward   ForwardPass     the stage's layers; on the last stage also `loss_fn`
  backward  BackwardPass    autograd through the stage
  recv      RecvActivation, RecvGrad
  send      SendActivation, SendGrad
                            point-to-point transfers. On gloo BOTH block until the peer has
                            posted the matching call (checked: a 1-element dist.send returns
                            only when the receiver calls dist.recv, 100 ms later if it is 100 ms
                            late), so a stage waiting for its neighbour shows up in recv (the
                            neighbour has not produced yet) or in send (the neighbour is busy
                            and has not asked yet). E.g. a last stage behind a slow first stage
                            waits mostly in SendGrad, not in RecvActivation. The time also
                            contains the copy of the message itself (small on one host)
  load      LoadMicroBatch  `next(data_iter)` on the first/last stage (data loading, collation)
  reduce    ReduceGrads, ReduceTiedGrads  (data-parallel and tied-weight all-reduces: with DP
                            this also contains waiting for the slowest replica)
  step      OptimizerStep   clipping, optimizer update, LR scheduler (and with
                            `--nonfinite skip` the guard's all-reduce, a global sync point)
  loss_sync `_aggregate_total_loss`: the last stage broadcasts the loss to its pipeline
                            after the schedule (gloo broadcast blocks the source too, until
                            every stage has arrived); a stage that finishes early waits here
  other     total - all of the above (schedule bookkeeping, buffer setup, Python overhead)

Only instructions executed INSIDE a counted `train_batch` call are accumulated: `eval_batch`
(which runs the same instruction map) and the first `skip_steps` calls (warm-up: shape
exchange, buffer allocation, allocator growth, first optimizer-state creation) are excluded.

`report()` gives per-step averages in milliseconds and
  busy_fraction = (forward + backward + step + load + reduce) / total
  idle_fraction = (recv + send + loss_sync) / total
                  the share of the step spent blocked in pipeline communication: the 1F1B
                  fill/drain bubble, waiting caused by a slower neighbour, and the transfers
  recv_fraction = recv / total, send_fraction = send / total (the parts of idle_fraction)
busy + idle <= 1; the rest is `other`.
On a GPU, `synchronize=True` (the default when the accelerator is not the CPU) synchronizes
the device after each instruction, so kernels are charged to the instruction that launched them
(otherwise the time would mostly land in whichever instruction next blocks on the device).
That removes the host's run-ahead of the device, so a synchronized run is slightly slower.

Checked on 2 CPU ranks (gloo), m=4: two equal stages (20 ms sleep per micro-batch forward
on each) measured a bubble of 0.22 against the 1F1B theory (p-1)/(m+p-1) = 0.20; with only
stage 0 slow, stage 1 was idle 0.92 of the step (63 ms of 96 in SendGrad, 24 in
RecvActivation) and stage 0 0.08.

Caveats
-------
* idle_fraction counts waiting in the pipeline's own communication (p2p and the loss
  broadcast). Waiting in a data-parallel all-reduce (`reduce`, for the slowest replica of the
  same stage) or in the `--nonfinite skip` guard's all-reduce (`step`) counts as busy.
  Time spent between train_batch calls (logging, checkpoints) is in no step at all; a rank
  that is late because of it makes its neighbours wait at the start of the next step.
* On one host the transfers are memory copies, so idle is nearly all waiting; across
  machines idle_fraction also contains real transfer time.
* On a CPU machine the ranks compete for the same cores (and memory bandwidth): a stage's
  compute time depends on what its neighbours do at the same moment, and with more ranks
  than cores "idle" also contains being descheduled. Use OMP_NUM_THREADS=1 (torchrun's
  default) and read the numbers as relative, not as what a GPU cluster would show.
* The first steps are slower (warm-up): pass `skip_steps` (or call `start_measuring()`).
* The timers add two perf_counter calls per instruction (microseconds), negligible next to
  a forward pass of a real model.
"""
from __future__ import annotations

import time
from collections import defaultdict
from typing import Any

CATEGORIES = ("forward", "backward", "recv", "send", "load", "reduce", "step", "loss_sync", "other")
BUSY = ("forward", "backward", "step", "load", "reduce")
IDLE = ("recv", "send", "loss_sync")

_ATTR = "_mmpipe_stage_timer"


def _category_map() -> dict[type, str]:
    from deepspeed.runtime.pipe import schedule as s
    return {
        s.ForwardPass: "forward", s.BackwardPass: "backward",
        s.RecvActivation: "recv", s.RecvGrad: "recv",
        s.SendActivation: "send", s.SendGrad: "send",
        # DualPipeV (--schedule dualpipev): its Send/Recv only queue; CommitP2P launches the step's batch and waits
        s.CommitP2P: "recv",
        s.LoadMicroBatch: "load",
        s.ReduceGrads: "reduce", s.ReduceTiedGrads: "reduce",
        s.OptimizerStep: "step",
    }


def _default_sync() -> bool:
    try:
        from deepspeed.accelerator import get_accelerator
        return get_accelerator().device_name() != "cpu"
    except Exception:  # pragma: no cover - no accelerator layer
        return False


class StageTimer:
    """Accumulates wall time per instruction category for one engine (= this rank's stage).

    Create with `instrument(engine, ...)`, not directly.
    """

    def __init__(self, skip_steps: int = 0, synchronize: bool | None = None):
        self.skip_steps = int(skip_steps)
        self.synchronize = _default_sync() if synchronize is None else bool(synchronize)
        self.stage_id = 0
        self.num_stages = 1
        self.micro_batches = 1
        self.global_rank = 0
        self.dp_id = 0
        self._sync_fn = None
        self._measuring = True
        self._in_step = False
        self._calls = 0           # train_batch calls since instrument()/start_measuring()
        self._cur: dict[str, float] = defaultdict(float)
        self._cur_n: dict[str, int] = defaultdict(int)
        self._reset_totals()
        self._engine = None
        self._saved: dict[str, Any] = {}

    # -------------------------------------------------------------- control
    def _reset_totals(self) -> None:
        self.steps = 0
        self._sum: dict[str, float] = defaultdict(float)
        self._n: dict[str, int] = defaultdict(int)
        self._total = 0.0
        self._step_totals: list[float] = []

    def start_measuring(self, skip_steps: int = 0) -> None:
        """Forget everything measured so far; count from the next train_batch call, after
        `skip_steps` further calls."""
        self._reset_totals()
        self._calls = 0
        self.skip_steps = int(skip_steps)
        self._measuring = True

    def stop_measuring(self) -> None:
        """Stop counting (the totals so far are kept for report())."""
        self._measuring = False

    # -------------------------------------------------------------- hooks
    def _now(self) -> float:
        if self._sync_fn is not None:
            self._sync_fn()
        return time.perf_counter()

    def _add(self, cat: str, dt: float) -> None:
        if self._in_step:
            self._cur[cat] += dt
            self._cur_n[cat] += 1

    def _begin_step(self) -> None:
        self._cur = defaultdict(float)
        self._cur_n = defaultdict(int)
        self._in_step = True

    def _end_step(self, total: float, ok: bool) -> None:
        self._in_step = False
        self._calls += 1
        if not ok or not self._measuring or self._calls <= self.skip_steps:
            return
        self.steps += 1
        self._total += total
        self._step_totals.append(total)
        for k, v in self._cur.items():
            self._sum[k] += v
        for k, v in self._cur_n.items():
            self._n[k] += v

    # -------------------------------------------------------------- results
    def report(self) -> dict:
        """This rank's per-step averages (ms). With no measured step, times and fractions are None."""
        n = self.steps
        row: dict[str, Any] = {
            "stage": self.stage_id, "num_stages": self.num_stages, "global_rank": self.global_rank,
            "dp_id": self.dp_id, "micro_batches": self.micro_batches, "steps": n,
        }
        if n == 0:
            for c in CATEGORIES:
                row[f"{c}_ms"] = None
            row.update(total_ms=None, total_ms_median=None, forward_ms_per_micro=None, backward_ms_per_micro=None,
                       busy_fraction=None, idle_fraction=None, recv_fraction=None, send_fraction=None,
                       calls_per_step={})
            return row
        ms = {c: 1000.0 * self._sum.get(c, 0.0) / n for c in CATEGORIES if c != "other"}
        total = 1000.0 * self._total / n
        ms["other"] = max(0.0, total - sum(ms.values()))
        for c in CATEGORIES:
            row[f"{c}_ms"] = ms[c]
        st = sorted(self._step_totals)
        row["total_ms"] = total
        mid = len(st) // 2
        row["total_ms_median"] = 1000.0 * (st[mid] if len(st) % 2 else (st[mid - 1] + st[mid]) / 2)
        row["forward_ms_per_micro"] = ms["forward"] / self.micro_batches
        row["backward_ms_per_micro"] = ms["backward"] / self.micro_batches
        row["busy_fraction"] = sum(ms[c] for c in BUSY) / total if total > 0 else 0.0
        row["idle_fraction"] = sum(ms[c] for c in IDLE) / total if total > 0 else 0.0
        row["recv_fraction"] = ms["recv"] / total if total > 0 else 0.0
        row["send_fraction"] = ms["send"] / total if total > 0 else 0.0
        row["calls_per_step"] = {c: self._n[c] / n for c in CATEGORIES if self._n.get(c)}
        return row

    # -------------------------------------------------------------- removal
    def detach(self) -> None:
        """Undo instrument(): the engine goes back to the class instruction map and train_batch."""
        eng = self._engine
        if eng is None:
            return
        for name, had, old in self._saved.values():
            if had:
                eng.__dict__[name] = old
            else:
                eng.__dict__.pop(name, None)
        eng.__dict__.pop(_ATTR, None)
        self._engine = None


def _new_timer(engine, skip_steps: int, synchronize: bool | None) -> StageTimer:
    """A StageTimer for this engine, with the engine's stage, rank and micro-batch count."""
    timer = StageTimer(skip_steps=skip_steps, synchronize=synchronize)
    timer._engine = engine
    timer.stage_id = int(getattr(engine, "stage_id", 0))
    timer.num_stages = int(getattr(engine, "num_stages", 1))
    timer.micro_batches = int(getattr(engine, "micro_batches", 1) or 1)
    timer.global_rank = int(getattr(engine, "global_rank", 0))
    grid = getattr(engine, "grid", None)
    try:
        timer.dp_id = int(grid.get_data_parallel_id()) if grid is not None else 0
    except Exception:
        timer.dp_id = 0
    if timer.synchronize:
        from deepspeed.accelerator import get_accelerator
        timer._sync_fn = get_accelerator().synchronize
    return timer


def _wrap_instruction(timer: StageTimer, fn, cat: str):
    """`fn` (a plain function of the instruction map) with its wall time added to `cat`."""
    def timed(self, *args, **kwargs):
        t0 = timer._now()
        try:
            return fn(self, *args, **kwargs)
        finally:
            timer._add(cat, timer._now() - t0)
    timed.__name__ = getattr(fn, "__name__", "instr")
    timed.__wrapped__ = fn
    return timed


def _wrap_train_batch(timer: StageTimer, train_batch):
    """`train_batch` (bound method or an earlier instance wrapper) timed as one step."""
    def timed_train_batch(*args, **kwargs):
        if timer._in_step:                    # re-entrant call: count only the outer one
            return train_batch(*args, **kwargs)
        timer._begin_step()
        ok = False
        t0 = timer._now()
        try:
            out = train_batch(*args, **kwargs)
            ok = True
            return out
        finally:
            timer._end_step(timer._now() - t0, ok)
    return timed_train_batch


def _wrap_aggregate(timer: StageTimer, agg):
    """`_aggregate_total_loss` with its wall time added to loss_sync."""
    def timed_agg(*args, **kwargs):
        t0 = timer._now()
        try:
            return agg(*args, **kwargs)
        finally:
            timer._add("loss_sync", timer._now() - t0)
    return timed_agg


def instrument(engine, skip_steps: int = 0, synchronize: bool | None = None) -> StageTimer:
    """Time every pipeline instruction and every train_batch call of this engine instance.

    Returns the StageTimer (the same one if the engine is already instrumented; then
    `skip_steps` restarts the measurement via start_measuring). Call after deepspeed.initialize.
    """
    existing = engine.__dict__.get(_ATTR)
    if existing is not None:
        existing.start_measuring(skip_steps)
        return existing

    timer = _new_timer(engine, skip_steps, synchronize)
    cats = _category_map()
    d = engine.__dict__
    for name in ("_INSTRUCTION_MAP", "train_batch", "_aggregate_total_loss"):
        timer._saved[name] = (name, name in d, d.get(name))

    # our own map: a copy of the one the engine sees now (the class's, or a subclass's)
    base_map = engine._INSTRUCTION_MAP
    # a subclass of an instruction (mmpipe.runtime.schedule's B and W are BackwardPasses) times as its base
    d["_INSTRUCTION_MAP"] = {k: _wrap_instruction(timer, fn, next((cats[c] for c in k.__mro__ if c in cats), "other"))
                             for k, fn in base_map.items()}
    d["train_batch"] = _wrap_train_batch(timer, engine.train_batch)

    agg = getattr(engine, "_aggregate_total_loss", None)
    if agg is not None:
        d["_aggregate_total_loss"] = _wrap_aggregate(timer, agg)

    d[_ATTR] = timer
    return timer


# ------------------------------------------------------------------ gathering

_AVG_SKIP = {"stage", "num_stages", "global_rank", "dp_id", "micro_batches", "steps", "calls_per_step"}


def _average(reports: list[dict]) -> dict:
    first = reports[0]
    row: dict[str, Any] = {"stage": first["stage"], "num_stages": first["num_stages"],
                           "micro_batches": first["micro_batches"],
                           "ranks": sorted(r["global_rank"] for r in reports), "replicas": len(reports),
                           "steps": min(r["steps"] for r in reports)}
    for k in first:
        if k in _AVG_SKIP:
            continue
        vals = [r[k] for r in reports if isinstance(r.get(k), (int, float))]
        row[k] = sum(vals) / len(vals) if vals else None
    row["calls_per_step"] = first.get("calls_per_step", {})
    return row


def gather_stage_report(engine, timer: StageTimer) -> list[dict] | None:
    """Collective: EVERY rank must call it (all_gather_object on the default group).

    Returns on global rank 0 one row per pipeline stage, sorted by stage: the fields of
    StageTimer.report() averaged over the data-parallel replicas of that stage, plus
    `ranks` (global ranks averaged) and `replicas`; `steps` is the smallest count among them.
    Returns None on the other ranks. Without torch.distributed initialized: [this rank's row].
    """
    import torch.distributed as dist

    rep = timer.report()
    rep["stage"] = int(getattr(engine, "stage_id", rep["stage"]))
    # what this rank's optimizer updates (a ZeRO / bf16 wrapper's inner optimizer: its fp32 shards)
    opt = getattr(engine, "optimizer", None)
    opt = getattr(opt, "optimizer", opt)
    rep["optimizer_params"] = sum(p.numel() for g in getattr(opt, "param_groups", []) for p in g["params"])
    if not (dist.is_available() and dist.is_initialized()):
        return [_average([rep])]
    reports: list = [None] * dist.get_world_size()
    dist.all_gather_object(reports, rep)
    if dist.get_rank() != 0:
        return None
    by_stage: dict[int, list[dict]] = defaultdict(list)
    for r in reports:
        by_stage[r["stage"]].append(r)
    return [_average(by_stage[s]) for s in sorted(by_stage)]


def pipeline_summary(rows: list[dict], micro_batches: int, stages: int) -> dict:
    """Whole-pipeline view of gather_stage_report's rows.

    per_stage        the rows as given
    compute_ms       forward_ms + backward_ms per stage (per step)
    max_over_mean    max(compute_ms) / mean(compute_ms): 1.0 = perfectly balanced stages; the
                     pipeline runs at the pace of the slowest stage, so this is the slowdown
                     from imbalance alone
    slowest_stage    the stage with the largest compute_ms
    measured_bubble  mean over stages (each stage weighted equally, DP replicas already averaged)
                     of idle_fraction = (time blocked in Send/Recv Activation/Grad and in the
                     end-of-step loss broadcast) / train_batch wall time. It contains the
                     schedule's fill/drain bubble AND waiting caused by stage imbalance or CPU
                     contention, plus the transfers themselves; it excludes waiting in
                     data-parallel all-reduces (see the module docstring). Comparable to
                     theory_bubble only for balanced stages; imbalance raises it
    theory_bubble    (p-1)/(m+p-1): the idle share of an ideal 1F1B pipeline with p equal stages
                     and m micro-batches, free communication
    step_ms          the largest total_ms over stages (all stages take part in every step)
    """
    p, m = int(stages), int(micro_batches)
    compute = [(r.get("forward_ms") or 0.0) + (r.get("backward_ms") or 0.0) for r in rows]
    idles = [r["idle_fraction"] for r in rows if isinstance(r.get("idle_fraction"), (int, float))]
    totals = [r["total_ms"] for r in rows if isinstance(r.get("total_ms"), (int, float))]
    mean_c = sum(compute) / len(compute) if compute else 0.0
    return {
        "stages": p,
        "micro_batches": m,
        "per_stage": rows,
        "compute_ms": compute,
        "max_over_mean": (max(compute) / mean_c) if mean_c > 0 else None,
        "slowest_stage": rows[compute.index(max(compute))]["stage"] if compute and mean_c > 0 else None,
        "measured_bubble": sum(idles) / len(idles) if idles else None,
        "theory_bubble": (p - 1) / (m + p - 1) if m + p - 1 > 0 else None,
        "step_ms": max(totals) if totals else None,
    }


def format_summary(summary: dict) -> str:
    """A few lines for the run log."""
    measured = min((r.get("steps") or 0) for r in summary["per_stage"]) if summary["per_stage"] else 0
    lines = [f"mmpipe: stage timing (ms per step, {summary['micro_batches']} micro-batches; "
             f"steps measured {measured})",
             f"  {'stage':>5} {'fwd':>8} {'bwd':>8} {'recv':>8} {'send':>7} {'load':>7} {'reduce':>7} {'step':>7}"
             f" {'lossync':>7} {'total':>8} {'busy':>5} {'idle':>5}"]

    def f(v, w, prec=1):
        return f"{v:>{w}.{prec}f}" if isinstance(v, (int, float)) else f"{'-':>{w}}"
    for r in summary["per_stage"]:
        lines.append(f"  {r['stage']:>5} {f(r.get('forward_ms'), 8)} {f(r.get('backward_ms'), 8)} "
                     f"{f(r.get('recv_ms'), 8)} {f(r.get('send_ms'), 7)} {f(r.get('load_ms'), 7)} "
                     f"{f(r.get('reduce_ms'), 7)} {f(r.get('step_ms'), 7)} {f(r.get('loss_sync_ms'), 7)} "
                     f"{f(r.get('total_ms'), 8)} {f(r.get('busy_fraction'), 5, 2)} {f(r.get('idle_fraction'), 5, 2)}")
    mom, mb, tb = summary.get("max_over_mean"), summary.get("measured_bubble"), summary.get("theory_bubble")
    lines.append(f"  compute max/mean {f(mom, 0, 2).strip()} (slowest stage {summary.get('slowest_stage')}); "
                 f"bubble measured {f(mb, 0, 3).strip()} vs 1F1B theory {f(tb, 0, 3).strip()}")
    return "\n".join(lines)
