"""A pipeline schedule's order: each stage's forward (F), backward or input-backward (B) and
weight-backward (W) ops, in the order it runs them. Pure Python, no torch: each `Schedule` record
(mmpipe.planning.schedule_registry) carries its generator (`zb_h1_orders`, `one_f_one_b_orders`);
mmpipe.planning.schedules replays an order with real times, and mmpipe.runtime.schedule turns it
into DeepSpeed instructions.

How the ZB-H1 order is made (`stage_orders`): a list-scheduling simulation of all stages with unit
times F = B = W = 1 (a linear layer's three matmuls cost the same: 2 FLOPs per weight per token
each), where a free stage does, in priority, the ready B (it unblocks the stage upstream), else
the next F if its input is there and fewer than p micro-batches are in flight on the stage
(forward done, W not done: 1F1B's peak, reached on its stage 0, so memory stays at 1F1B's bound),
else a pending W. With W deferred this way the B's run up the pipeline at the pace of B alone, and
each stage fills its drain with the W's it held back. In units: p = 2, m = 4: 1F1B takes
(m + p - 1) x 3 = 15, ZB-H1 13 = 3m + (p - 1) (the paper's (p - 1)(F + B - W) bubble), the
no-bubble bound 3m = 12; p = 4, m = 8: 33, 29 (the paper's hand-made order: 27), 24 (`simulate`).
split=False gives 1F1B's order from the same priorities (B and W one op, p - i in flight on stage i).
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Op:
    kind: str  # "F", "B" or "W"
    mb: int
    start: float = 0.0
    end: float = 0.0


def stage_orders(stages: int, micro_batches: int, weight_stages: list[bool] | tuple[bool, ...],
                 times: list[tuple[float, float, float]] | None = None, split: bool = True) -> list[list[Op]]:
    """Each stage's compute ops in order, with simulated start/end times.

    times[i] = (F, B, W) of stage i (default 1, 1, 1; a stage without W work: W's time joins B).
    split=False is 1F1B: B and W as one op (DeepSpeed's BackwardPass), same priorities and bound."""
    p, m = stages, micro_batches
    times = times or [(1.0, 1.0, 1.0)] * p
    dur = []
    for i in range(p):
        f, b, w = times[i]
        has_w = split and weight_stages[i]
        dur.append({"F": f, "B": b if has_w else b + (w if weight_stages[i] else 0.0), "W": w})
    has_w = [split and weight_stages[i] for i in range(p)]
    # micro-batches in flight (forward done, W - or, without W, B - not done): 1F1B holds p - i on
    # stage i; ZB-H1 lets every stage hold up to p, 1F1B's peak (stage 0's), so memory stays at
    # 1F1B's bound while the later stages can hold W's back into their drain
    limit = [p if split else p - i for i in range(p)]
    f_end = [[None] * m for _ in range(p)]  # when F(k) on stage i ended
    b_end = [[None] * m for _ in range(p)]
    nf, nb, nw = [0] * p, [0] * p, [0] * p
    free = [0.0] * p
    orders: list[list[Op]] = [[] for _ in range(p)]
    t = 0.0
    while any(nw[i] < m if has_w[i] else nb[i] < m for i in range(p)):
        for i in range(p):
            if free[i] > t:
                continue
            op = None
            k = nb[i]
            if k < nf[i]:  # B(k) needs F(k) here and B(k) downstream
                ready = f_end[i][k] if i == p - 1 else b_end[i + 1][k]
                if ready is not None and ready <= t:
                    op = Op("B", k)
            in_flight = nf[i] - (nw[i] if has_w[i] else nb[i])
            if op is None and nf[i] < m and in_flight < limit[i]:
                ready = 0.0 if i == 0 else f_end[i - 1][nf[i]]
                if ready is not None and ready <= t:
                    op = Op("F", nf[i])
            if op is None and has_w[i] and nw[i] < nb[i]:
                op = Op("W", nw[i])
            if op is None:
                continue
            op.start, op.end = t, t + dur[i][op.kind]
            free[i] = op.end
            if op.kind == "F":
                f_end[i][op.mb] = op.end
                nf[i] += 1
            elif op.kind == "B":
                b_end[i][op.mb] = op.end
                nb[i] += 1
            else:
                nw[i] += 1
            orders[i].append(op)
        later = [free[i] for i in range(p) if free[i] > t]
        if not later:
            raise RuntimeError(f"pipeline order stalled at t={t} (p={p}, m={m})")  # cannot happen: a bug
        t = min(later)
    return orders


def zb_h1_orders(stages: int, micro_batches: int, weight_stages, times=None) -> list[list[Op]]:
    """ZB-H1's order: the backward split into B and W (schedule_registry.ZB_H1's generator)."""
    return stage_orders(stages, micro_batches, weight_stages, times, split=True)


def one_f_one_b_orders(stages: int, micro_batches: int, weight_stages, times=None) -> list[list[Op]]:
    """1F1B's order: B and W one op, p - i micro-batches in flight on stage i (schedule_registry.ONE_F_ONE_B's)."""
    return stage_orders(stages, micro_batches, weight_stages, times, split=False)
