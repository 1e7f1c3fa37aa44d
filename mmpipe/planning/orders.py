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

DualPipeV's order (`dualpipev_orders`, DeepSeek-V3's schedule as DeepSpeed 0.19.8 runs it,
`deepspeed.runtime.pipe.schedule.DualPipeVSchedule`): 2p stages on p ranks, rank r running stage r
(phase 0, towards the last rank) and stage 2p - 1 - r (phase 1, back to rank 0, which computes the
loss). Each rank's sequence of F and B per phase is fixed by the schedule's eight steps (warm-up F0's,
F0 F1 pairs, B1 F1, the steady F0 B1 F1 B0, then the drain); DeepSpeed keeps W inside B, so there is
no W op. The times come from running those fixed sequences against the data dependencies (a
micro-batch's F on stage s needs its F on stage s - 1, its B on stage s needs its B on stage s + 1),
communication free: DeepSpeed batches a step's sends and receives (CommitP2P), so no blocking-p2p
stream is replayed. Unit times: a rank's F = 1, B = 2 per micro-batch as in 1F1B, split evenly over its
two stages (0.5 and 1 each). p = 2, m = 4: 13.5 against 1F1B's 15, ZB-H1's 13 and the bound 3m = 12
(idle 11.1% against 20.0% and 7.7%); p = 4, m = 8: 29.5 against 33, 29 and 24 (18.6% against 27.3%
and 17.2%). The idle time is 2p - 2.5 units for any m >= 2p (p >= 2: 1.5, 3.5, 5.5 at p = 2, 3, 4),
against 1F1B's 3(p - 1) (3, 6, 9) and this ZB-H1 order's 2p - 3 (1, 3, 5): DualPipeV, keeping W in B,
lands half a unit above ZB-H1, where DeepSeek's reference (W deferred) would fill more of it.
"""
from __future__ import annotations

from dataclasses import dataclass


@dataclass
class Op:
    kind: str  # "F", "B" or "W"
    mb: int
    start: float = 0.0
    end: float = 0.0
    phase: int = 0  # DualPipeV: 0 on the way out (stage r of rank r), 1 on the way back (stage 2p - 1 - r)


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


def dualpipev_sequence(ranks: int, micro_batches: int, rank: int) -> list[tuple[str, int]]:
    """Rank `rank`'s compute ops in DualPipeVSchedule's order, as (kind, phase): its eight steps with
    the W chunks (no compute: W stays in B) left out. n = ranks, r = rank:
        1. 2(n - r - 1) x F0            2. (r + 1) x F0 F1              3. (n - r - 1) x B1 F1
        4. (m - 2n + r + 1) x F0 B1 F1 B0                              5. (n - r - 1) x B1 F1 B0
        6. (r + 1) x B1 B0              7. (n - r - 1) x B0
    so each phase runs m F's and m B's (e.g. F0: 2(n - r - 1) + (r + 1) + (m - 2n + r + 1) = m)."""
    n, r, m = ranks, rank, micro_batches
    if m < 2 * n:
        raise ValueError(f"DualPipeV needs at least 2 x {n} micro-batches, got {m}")
    ops = [("F", 0)] * (2 * (n - r - 1)) + [("F", 0), ("F", 1)] * (r + 1) + [("B", 1), ("F", 1)] * (n - r - 1)
    ops += [("F", 0), ("B", 1), ("F", 1), ("B", 0)] * (m - 2 * n + r + 1)
    ops += [("B", 1), ("F", 1), ("B", 0)] * (n - r - 1) + [("B", 1), ("B", 0)] * (r + 1)
    return ops + [("B", 0)] * (n - r - 1)


def _v_chunk_times(ranks: int, weight_stages, times) -> list[dict[str, float]]:
    """Per (rank, phase) 2 r + phase: F and B seconds of one micro-batch. times: None (unit: a rank's
    F = 1, B + W = 2), per rank (its V pair's (F, B, W), halved onto its two stages: the pair balanced),
    or per stage, 2 p entries (stage s on rank min(s, 2p - 1 - s)); W joins B (no W op)."""
    p = ranks
    if times is None:
        times = [(1.0, 1.0, 1.0)] * p
    if len(times) == 2 * p:
        by_stage = [(f, b + (w if weight_stages[min(s, 2 * p - 1 - s)] else 0.0)) for s, (f, b, w) in enumerate(times)]
        return [{"F": by_stage[s][0], "B": by_stage[s][1]}
                for r in range(p) for s in (r, 2 * p - 1 - r)]
    return [{"F": f / 2, "B": (b + (w if weight_stages[r] else 0.0)) / 2}
            for r, (f, b, w) in enumerate(times) for _ in (0, 1)]


def dualpipev_orders(ranks: int, micro_batches: int, weight_stages, times=None) -> list[list[Op]]:
    """DualPipeV's order per rank (schedule_registry.DUALPIPEV's generator): `dualpipev_sequence`, timed
    against the data dependencies with each rank's ops run in that order (communication free)."""
    p, m = ranks, micro_batches
    chunk = _v_chunk_times(p, weight_stages, times)
    seqs = [dualpipev_sequence(p, m, r) for r in range(p)]
    done: dict[tuple, float] = {}  # (kind, stage, mb) -> end
    count = [{k: 0 for k in ("F0", "F1", "B0", "B1")} for _ in range(p)]
    pos, clock = [0] * p, [0.0] * p
    orders: list[list[Op]] = [[] for _ in range(p)]
    while any(pos[r] < len(seqs[r]) for r in range(p)):
        moved = False
        for r in range(p):
            while pos[r] < len(seqs[r]):
                kind, phase = seqs[r][pos[r]]
                mb, stage = count[r][f"{kind}{phase}"], r if phase == 0 else 2 * p - 1 - r
                need = _v_dependency(kind, stage, mb, p)
                if need is not None and need not in done:
                    break
                start = max(clock[r], done.get(need, 0.0))
                clock[r] = start + chunk[2 * r + phase][kind]
                done[(kind, stage, mb)] = clock[r]
                orders[r].append(Op(kind, mb, start, clock[r], phase))
                count[r][f"{kind}{phase}"] += 1
                pos[r] += 1
                moved = True
        if not moved:
            raise RuntimeError(f"DualPipeV order stalled at {pos} (p={p}, m={m})")  # cannot happen: a bug
    return orders


def _v_dependency(kind: str, stage: int, mb: int, ranks: int) -> tuple | None:
    """The op a micro-batch's `kind` on `stage` (of 2p) waits for: F on stage - 1, B on stage + 1 (the last
    stage's B: its own F, the loss); None for stage 0's F (the data)."""
    if kind == "F":
        return None if stage == 0 else ("F", stage - 1, mb)
    return ("F", stage, mb) if stage == 2 * ranks - 1 else ("B", stage + 1, mb)
