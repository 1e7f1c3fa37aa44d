"""Pipeline schedules as pure timing: how long a step takes when a schedule's order (each stage's
forward (F), input-backward (B) and weight-backward (W) ops, mmpipe.planning.orders, made by the
generator its `Schedule` record carries) runs with given times. No torch, no DeepSpeed: `mmpipe plan
--schedule` predicts with it (mmpipe.planning.costmodel), and the runtime (mmpipe.runtime.schedule)
turns the same per-stage streams into DeepSpeed instructions.

How the order becomes per-stage streams (`stage_streams`): p2p is blocking (a send waits for the
matching receive), so each message gets one time T - the simulated start of the op that consumes
it - and both ends place it at T in their stream: every stage's stream is sorted by the global key
(time, messages before compute, stage pair, direction). The unfinished event with the smallest key
is then always runnable (a compute op: everything before it on its stage is done; a message: both
ends are at it), so the schedule cannot deadlock, for any p and m.

How long it takes with real times (`replay`): the runtime computes its order once, in units, and
then runs it with whatever the ops really cost. `replay` runs the streams that way: each stage
works through its stream in order, a compute op takes its stage's F, B or W seconds, a message
completes when both ends have reached it (blocking p2p, the transfer itself free). With unit times
it reproduces `simulate`'s makespan (p = 2, m = 4: 15 and 13, mmpipe.planning.orders); with
unequal ones it also shows the waits the blocking sends add when a stage reaches a message later
than the unit order expected.
"""
from __future__ import annotations

from .orders import Op, one_f_one_b_orders, stage_orders, zb_h1_orders
from .schedule_registry import Schedule, schedule_named

__all__ = ["Op", "one_f_one_b_orders", "peak_in_flight", "predict", "replay", "simulate", "stage_orders",
           "stage_streams", "zb_h1_orders"]


def simulate(stages: int, micro_batches: int, weight_stages, times=None, split: bool = True) -> dict:
    """Makespan and each stage's idle share of it, for the docs and the planner: the order's
    timeline with free communication and the optimizer step left out."""
    orders = stage_orders(stages, micro_batches, weight_stages, times, split)
    span = max(o[-1].end for o in orders)
    busy = [sum(op.end - op.start for op in o) for o in orders]
    return {"makespan": span, "idle": [1 - b / span for b in busy], "orders": orders}


# --------------------------------------------------------------------------------------- streams

def stage_streams(orders: list[list[Op]]) -> list[list[tuple]]:
    """Per stage, the sorted (key, kind, micro-batch) events: compute ops and the messages around them."""
    p = len(orders)
    events: list[list[tuple]] = [[] for _ in range(p)]
    for i, o in enumerate(orders):
        for op in o:
            events[i].append(((op.start, 1, 0, 0), op.kind, op.mb))
            if op.kind == "F" and i > 0:  # activation i-1 -> i, needed when F starts here
                key = (op.start, 0, i - 1, 0)
                events[i].append((key, "recv_act", op.mb))
                events[i - 1].append((key, "send_act", op.mb))
            if op.kind == "B" and i < p - 1:  # gradient i+1 -> i, needed when B starts here
                key = (op.start, 0, i, 1)
                events[i].append((key, "recv_grad", op.mb))
                events[i + 1].append((key, "send_grad", op.mb))
    for i in range(p):
        events[i].sort(key=lambda e: e[0])
        # the sender's message must come after the op that produced it
        pos = {(e[1], e[2]): n for n, e in enumerate(events[i])}
        for (kind, mb), n in pos.items():
            if kind == "send_act":
                assert pos[("F", mb)] < n
            elif kind == "send_grad":
                assert pos[("B", mb)] < n
    return events



def replay(streams: list[list[tuple]], durations: list[dict[str, float]]) -> dict:
    """Run `stage_streams`' events with durations[i] = {"F": s, "B": s, "W": s} on stage i and
    blocking p2p (a message completes at max(sender's clock, receiver's clock), both clocks move
    there). Returns the makespan, each stage's busy seconds and idle share, and the ops with their
    replayed start/end. Raises on a deadlock (cannot happen for stage_streams' output: a bug)."""
    p = len(streams)
    pos, clock, busy = [0] * p, [0.0] * p, [0.0] * p
    ops: list[list[Op]] = [[] for _ in range(p)]
    while any(pos[i] < len(streams[i]) for i in range(p)):
        moved = False
        for i, s in enumerate(streams):  # compute ops run as soon as the stage reaches them
            while pos[i] < len(s) and s[pos[i]][1] in ("F", "B", "W"):
                _, kind, mb = s[pos[i]]
                d = durations[i][kind]
                ops[i].append(Op(kind, mb, clock[i], clock[i] + d))
                clock[i] += d
                busy[i] += d
                pos[i] += 1
                moved = True
        for i, s in enumerate(streams):  # a send completes with its receive, when both ends are at it
            if pos[i] >= len(s) or not s[pos[i]][1].startswith("send"):
                continue
            _, kind, mb = s[pos[i]]
            j, want = (i + 1, "recv_act") if kind == "send_act" else (i - 1, "recv_grad")
            if pos[j] < len(streams[j]) and streams[j][pos[j]][1:] == (want, mb):
                clock[i] = clock[j] = max(clock[i], clock[j])
                pos[i] += 1
                pos[j] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"pipeline streams deadlocked at {pos}")  # cannot happen: a bug
    span = max(clock)
    return {"makespan": span, "busy": busy, "idle": [1 - b / span if span else 0.0 for b in busy], "ops": ops}


def peak_in_flight(order: list[Op], has_w: bool) -> int:
    """Most micro-batches between their F and their last backward op (W, or B without W) on one
    stage: how many micro-batches' activations (and W stashes) the stage holds at once."""
    f = done = peak = 0
    for op in order:
        if op.kind == "F":
            f += 1
            peak = max(peak, f - done)
        elif op.kind == ("W" if has_w else "B"):
            done += 1
    return peak


def predict(schedule: Schedule | str, micro_batches: int, times: list[tuple[float, float, float]],
            weight_stages: list[bool]) -> dict:
    """`schedule`'s step (a record, or a name in schedule_registry.SCHEDULE_NAMES) on len(times) stages,
    times[i] = (F, B, W) seconds of stage i (W 0 where weight_stages[i] is False): the order the
    runtime runs (the record's unit-time `orders`; 1F1B: B and W one op of B + W seconds) replayed
    with these times. Also the order's peak micro-batches in flight per stage."""
    schedule = schedule_named(schedule)  # a name from outside (a test, a caller's flag): its record
    p, split = len(times), schedule.split_backward
    weight_stages = [bool(w) for w in weight_stages]
    if schedule.timed_order:  # its order timed with these seconds is the prediction (DualPipeV: no p2p replay)
        return _timed(schedule.orders(p, micro_batches, weight_stages, times))
    orders = schedule.orders(p, micro_batches, weight_stages)
    durations = [{"F": f, "B": b if split and weight_stages[i] else b + w, "W": w}
                 for i, (f, b, w) in enumerate(times)]
    out = replay(stage_streams(orders), durations)
    out["in_flight"] = [peak_in_flight(o, split and weight_stages[i]) for i, o in enumerate(orders)]
    return out


def _timed(orders: list[list[Op]]) -> dict:
    """predict's answer from an order that carries its own times (one list per rank): its makespan, busy
    seconds and idle share per rank, and the micro-batches in flight. A V rank holds two stages, each about
    half of a 1F1B stage's layers, so its in-flight count is its stage activations over 2, rounded up."""
    span = max(o[-1].end for o in orders if o)
    busy = [sum(op.end - op.start for op in o) for o in orders]
    in_flight = []
    for o in orders:
        live = peak = 0
        for op in o:
            live += 1 if op.kind == "F" else -1
            peak = max(peak, live)
        in_flight.append(-(-peak // 2))
    return {"makespan": span, "busy": busy, "idle": [1 - b / span if span else 0.0 for b in busy],
            "ops": orders, "in_flight": in_flight}
