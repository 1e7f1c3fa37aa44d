"""The V's balanced split: 2p contiguous stages on p ranks, rank r holding stage r and stage 2p - 1 - r
(DualPipeV, `--schedule dualpipev`), cut so the largest RANK load is least, not the largest stage.

Why not the per-stage min-max split (partition.min_max_split): a rank's time is the sum of its two
stages, and it pairs the first stage with the last, the second with the second-to-last, and so on. In
a VLM the first stage is the vision tower (cheap when frozen: forward only) and the last holds the LM
head (a vocabulary-wide matmul), so equal stages are not what equal ranks need. E.g. weights
[1, 1, 4, 4, 1, 1] on 2 ranks: the per-stage min-max split is [1+1 | 4 | 4 | 1+1] (largest stage 4),
ranks 2 + 2 = 4 and 4 + 4 = 8; `v_pair_split` gives [1 | 1 | 4 | 4+1+1], ranks 1 + 6 = 7 and 1 + 4 = 5.

How (`v_pair_split`): bisection on the bottleneck T; for a T, which (i, j) - the left stages end at i,
the right stages start at j - are reachable after k outer pairs, a boolean n x n table, level by
level from the outside in (a pair's left part [i, i2) and right part [j2, j) together <= T); the
innermost pair (stages p - 1 and p, both on rank p - 1) is one contiguous run [i, j) cut in two, its sum
<= T. Each level is O(n^2) interval marks of length n (numpy); 40 bisection steps.
"""
from __future__ import annotations

import numpy as np


def _prefix(weights) -> np.ndarray:
    return np.concatenate([[0.0], np.cumsum(np.asarray(weights, dtype=float))])


def _levels(pre: np.ndarray, ranks: int, limit: float) -> list[np.ndarray]:
    """reach[k][i, j]: after k outer pairs the left stages can end at i and the right ones start at j."""
    n, tol = len(pre) - 1, 1e-9 * max(1.0, abs(limit))
    reach = np.zeros((n + 1, n + 1), dtype=bool)
    reach[0, n] = True
    levels = [reach]
    for k in range(ranks - 1):
        inner = 2 * (ranks - 1 - k)  # stages still to place inside this pair, one unit each at least
        nxt = np.zeros_like(reach)
        for i in np.flatnonzero(reach.any(axis=1)):
            js = np.flatnonzero(reach[i])
            for i2 in range(i + 1, n + 1):
                room = limit - (pre[i2] - pre[i])
                if room < -tol:
                    break
                # right part [j2, j): pre[j] - pre[j2] <= room, j2 < j, and inner units left in [i2, j2)
                lo = np.maximum(np.searchsorted(pre, pre[js] - room - tol, side="left"), i2 + inner)
                marks = np.zeros(n + 2, dtype=int)
                ok = lo < js
                np.add.at(marks, lo[ok], 1)
                np.add.at(marks, js[ok], -1)
                nxt[i2] |= np.cumsum(marks)[: n + 1] > 0
        reach = nxt
        levels.append(reach)
    return levels


def _feasible(pre: np.ndarray, ranks: int, limit: float) -> list[int] | None:
    """Boundaries [0, b1, ..., n] of 2 x ranks nonempty stages, every rank's pair <= limit; None if none."""
    tol = 1e-9 * max(1.0, abs(limit))
    levels = _levels(pre, ranks, limit)
    last = [(i, j) for i, j in zip(*np.nonzero(levels[-1])) if j - i >= 2 and pre[j] - pre[i] <= limit + tol]
    if not last:
        return None
    i, j = min(last)
    lefts, rights = [i], [j]
    for reach in reversed(levels[:-1]):  # a predecessor whose pair with (i, j) fits
        i, j = next((a, b) for a, b in zip(*np.nonzero(reach))
                    if a < i and b > j and (pre[i] - pre[a]) + (pre[b] - pre[j]) <= limit + tol)
        lefts.append(i)
        rights.append(j)
    a, b = lefts[0], rights[0]  # the innermost run, cut where its halves are most even
    mid = min(range(a + 1, b), key=lambda c: abs((pre[c] - pre[a]) - (pre[b] - pre[c])))
    return [int(x) for x in lefts[::-1] + [mid] + rights]


def pair_loads(weights, bounds: list[int]) -> list[float]:
    """Each rank's load under `bounds` (2p stages): stage r + stage 2p - 1 - r."""
    pre = _prefix(weights)
    stages = [float(pre[b] - pre[a]) for a, b in zip(bounds, bounds[1:])]
    return [stages[r] + stages[len(stages) - 1 - r] for r in range(len(stages) // 2)]


def v_pair_split(weights, ranks: int) -> list[int] | None:
    """Boundaries [0, b1, ..., len(weights)] of 2 x ranks contiguous nonempty stages whose largest rank load
    (stage r + stage 2 x ranks - 1 - r) is least (to 1e-9 of the total); None with fewer than 2 x ranks weights."""
    if len(weights) < 2 * ranks:
        return None
    pre = _prefix(weights)
    lo, hi = float(pre[-1]) / ranks, float(pre[-1])  # no rank below the mean; one rank could hold everything
    best = _feasible(pre, ranks, hi)
    for _ in range(40):
        mid = (lo + hi) / 2
        bounds = _feasible(pre, ranks, mid)
        if bounds is None:
            lo = mid
        else:
            best, hi = bounds, mid
    return best


def describe_pairs(rows, parts: list[int]) -> str:
    """`mmpipe plan`'s V-pair split in words: each rank's two stages (stage r and stage 2p - 1 - r) with their layers
    and the rank's share of the FLOPs (rows: the plan's LayerCost table, frozen layers costed forward only), then the
    largest rank load over the mean, e.g. 'rank 0: stage 0 layers 0..2 (QwenPatchEmbed..DeepstackMerger) + stage 3
    layers 13..18 (DeepstackAdd..LMHead), 26% of the FLOPs; ...; max / mean rank load 1.028'."""
    flops = [r.flops for r in rows]
    loads, n = pair_loads(flops, parts), len(parts) - 1
    total = sum(loads) or 1.0

    def stage(s: int) -> str:
        a, b = parts[s], parts[s + 1]
        return f"stage {s} layers {a}..{b - 1} ({rows[a].name}..{rows[b - 1].name})"
    ranks = [f"rank {r}: {stage(r)} + {stage(n - 1 - r)}, {loads[r] / total:.0%} of the FLOPs" for r in range(n // 2)]
    return "; ".join(ranks) + f"; max / mean rank load {max(loads) / (total / len(loads)):.3f}"
