"""Rows balanced by predicted cost (issue 57, docs/balance.md): a step's rows spread over its DP ranks and their
micro-batches so that each rank's predicted work, tower and decoder apart, is as even as the data allows.

Packing gives every row the same positions, not the same work. In a packed row the decoder's linears run on all L
positions whatever the row holds, but attention runs within each sample (mmpipe.model.attention: the causal split
on CPU, a BlockMask on CUDA), so it costs the sum of the squares of its samples' lengths (and of the padding run,
one segment): one 1,600-position sample in a 2,048 row costs 1,600^2 + 448^2 = 2.76 M pairs, 32 samples of 64 cost
32 x 64^2 = 0.13 M. A dynamic-resolution tower (Qwen2-VL's patches) likewise attends within each image: a row of
one 64 x 64-patch image costs 4096^2 pairs, one of sixteen 16 x 16 images 16 x 256^2 = 1/16 of that. A tower of
fixed-size images encodes every one of a row's M slots (an unused one holds a blank image), the same work per row.

`RowCosts` prices a row from the run's own cost rules (mmpipe.model.costs through the family registry) and the
planner's layer table (run.layers: each layer's FLOPs at the row's geometry, forward + backward + recompute):

    decoder(row) = sum over decoder layers of k x (f(L) + b x (sum_i len_i^2 + pad^2 - L^2))

with f the layer's forward FLOPs at seq positions (its rule), k = its table FLOPs / forward FLOPs (3 trainable,
2 frozen behind a trainable layer, 1 a frozen prefix: forward only; + 1 recomputed), and b = f's quadratic
coefficient, the second difference (f(L + h) - 2 f(L) + f(L - h)) / 2 h^2, exact for the rules' polynomials in
seq (attention 4 seq^2 d, linears 2 params seq; a Gated DeltaNet layer is linear: b = 0). tower(row): the
table's FLOPs for a tower of fixed images (a constant), a per_row rule's own cost on the row's images (PatchRow of
their grids).

`assign` is greedy longest-processing-time over cost vectors (Graham's LPT, its 4/3 bound for one dimension), then
swaps: units largest first, each to the bin with room whose load it raises the squared sum least (in one dimension
the least loaded bin); then a unit of a bin holding some dimension's peak trades places with one of another bin
while that lowers the sum of the per-dimension peaks. A unit is `unit` consecutive rows kept in one micro-batch (1:
a row; 2: a preference pair). Normalised: per dimension the part above the cheapest unit's, over its sum, so a
dimension the same for every unit (a fixed tower) weighs nothing (equal counts balance it) and tower and decoder
weigh the same. E.g. 64 long-tailed rows over 4 ranks (tests/test_balance.py): each part within 1.7% of the floor
no layout goes under (the rank with the largest row and the smallest others).

`StepBalance` lays the step's B = micro x GAS x DP rows [base, base + B) out for mmpipe.data.batches: first over
the DP ranks (GAS x micro rows each), then each rank's over its GAS micro-batches (micro rows each), micro-batches
and their rows in stream order. The layout depends on the rows' costs alone (their token index: no image is
opened), ties broken by position, so every rank (first and last stage, every DP replica), the reference loop and a
resumed run derive the same one. The step's set of rows is unchanged, so LossNorm's weights, the data position
after the step and --resume are too (mmpipe.data.packing).
"""
from __future__ import annotations

import functools
from typing import Callable

import numpy as np

from ..model.builder import layer_param_counts, layer_specs
from ..model.costs import CropRow, PatchRow
from ..registry import family_of
from .image_kinds import image_kind
from .packing import sample_size

TOWER_INPUTS = ("pixels", "vision")  # what a tower layer takes in (planning.costmodel's PER_IMAGE_INPUTS)
SWAP_ROUNDS = 64  # improving swaps per assignment at most: each lowers the sum of the peaks, few are ever needed


class RowCosts:
    """Row position -> (tower, decoder) predicted FLOPs (forward + backward + recompute) of that row."""

    def __init__(self, cfg, shape, layers: list, plan, samples):
        """shape: the run's RowShape; layers: the run's LayerCost table (run.layers, in layer_specs order);
        plan: the RowPlan the rows come from; samples: their source (token index and grids only)."""
        self.plan, self.samples, self.shape = plan, samples, shape
        self.size = sample_size(samples, shape)
        family = family_of(cfg)
        self.row_kind = {"patches": PatchRow, "tiles": CropRow}.get(image_kind(cfg).name)
        n = shape.vision_budget if self.row_kind else family.tower_tokens(cfg)
        self.tower_fixed, self.dec_length, self.dec_quadratic = 0.0, 0.0, 0.0
        self.tower_rows: list[tuple[float, Callable]] = []  # (k, row -> Cost) of the per_row tower layers
        # the same terms layer by layer (layer_flops): a row's FLOPs = fixed + length + quadratic x its q, plus its
        # per_row tower layers' (tower_at: their indices, in tower_rows' order)
        self.fixed, self.length, self.quadratic = (np.zeros(len(layers)) for _ in range(3))
        self.tower_at: list[int] = []
        for i, (spec, params, r) in enumerate(zip(layer_specs(cfg), layer_param_counts(cfg), layers, strict=True)):
            rule = family.cost_rule(spec)
            k = r.flops / r.fwd_flops if r.fwd_flops else 0.0
            at = functools.partial(rule.cost_of, cfg, params, n)
            if rule.takes in TOWER_INPUTS and rule.per_row and self.row_kind:  # priced on each row's own images
                self.tower_rows.append((k, functools.partial(at, shape.length, kwargs=spec.module_kwargs)))
                self.tower_at.append(i)
            elif rule.takes in TOWER_INPUTS:
                self.tower_fixed += r.flops  # every row's M slots: the same (a kind of no row: the table's)
                self.fixed[i] = r.flops
            else:
                empty = self.row_kind(shape.vision_budget) if self.row_kind else None
                length, quadratic = _curve(lambda seq: at(seq, empty, spec.module_kwargs).fwd, shape.length)
                self.dec_length += k * length
                self.dec_quadratic += k * quadratic
                self.length[i], self.quadratic[i] = k * length, k * quadratic

    def lengths(self, r: int) -> list[int]:
        """Row r's attention segments: each sample's decoder positions, then the padding's (0: none)."""
        lens = [int(self.size(p)[0]) for p in self.plan.row(r)]
        return lens + [self.shape.length - sum(lens)]

    def __call__(self, r: int) -> tuple[float, float]:
        lens, L = self.lengths(r), self.shape.length
        decoder = self.dec_length + self.dec_quadratic * (sum(x * x for x in lens) - L * L)
        return self._tower(r), decoder

    def layer_flops(self, r: int) -> np.ndarray:
        """Row r's FLOPs layer by layer (forward + backward + recompute, in layer_specs order), the terms __call__
        sums: its tower layers' add up to its tower, the others' to its decoder. `mmpipe plan --data` prices each
        stage of a split with them (mmpipe.planning.data_rows)."""
        lens, L = self.lengths(r), self.shape.length
        out = self.fixed + self.length + self.quadratic * float(sum(x * x for x in lens) - L * L)
        if self.tower_rows:
            out[self.tower_at] += np.asarray(self._row_tower_layers(self._grids(r)))
        return out

    def _tower(self, r: int) -> float:
        if not self.tower_rows:
            return self.tower_fixed
        return self.tower_fixed + self._row_tower(self._grids(r))

    def _grids(self, r: int) -> tuple:
        """The grids (or tilings) of row r's images, its samples' in row order."""
        grids = []
        for p in self.plan.row(r):
            enc, n_images = self.samples.tokens(p)
            grids += [tuple(int(x) for x in g) for g in enc.grids[:int(n_images)]]
        return tuple(grids)

    def _row_tower(self, grids: tuple) -> float:
        return sum(self._row_tower_layers(grids))

    @functools.lru_cache(maxsize=4096)
    def _row_tower_layers(self, grids: tuple) -> tuple[float, ...]:
        """Each per_row tower layer's FLOPs on a row of these images (tower_rows' order)."""
        width = 3 if self.row_kind is PatchRow else 4  # (t, h, w); tiles' (orig_h, orig_w, rows, cols)
        row = self.row_kind(self.shape.vision_budget, tuple(g[:width] for g in grids))
        return tuple(k * cost(row=row).fwd for k, cost in self.tower_rows)


def _curve(f: Callable[[int], float], L: int) -> tuple[float, float]:
    """(f(L), b): a layer's forward FLOPs at the row's L positions and its coefficient of seq^2, the second
    difference (f(L + h) - 2 f(L) + f(L - h)) / 2 h^2, h = L / 2: exact for a polynomial of degree 2 (attention's
    4 seq^2 d over linears' 2 params seq), 0 for a layer linear in seq."""
    h = max(1, L // 2)
    return f(L), max(0.0, (f(L + h) - 2 * f(L) + f(L - h)) / (2 * h * h))


def _normalised(costs: np.ndarray) -> np.ndarray:
    """[n, dims] -> each dimension's part above its cheapest unit, over that part's sum (0 where all are equal)."""
    var = costs - costs.min(axis=0, keepdims=True)
    total = var.sum(axis=0, keepdims=True)
    return np.divide(var, total, out=np.zeros_like(var), where=total > 0)


def assign(costs: np.ndarray, bins: int, cap: int) -> list[list[int]]:
    """Units (rows of costs [n, dims], n = bins x cap) -> bins of exactly cap unit indices each, ascending, with
    each dimension's largest normalised load as low as greedy LPT and improving swaps make it. Greedy: units
    largest first, each to the bin with room whose load it raises the squared sum least (the lowest load . unit:
    in one dimension the least loaded bin, Graham's LPT). Deterministic: ties go to the lower unit and bin."""
    n = len(costs)
    assert n == bins * cap, (n, bins, cap)
    if bins == 1:
        return [list(range(n))]
    v = _normalised(np.asarray(costs, dtype=np.float64).reshape(n, -1))
    load = np.zeros((bins, v.shape[1]))
    members: list[list[int]] = [[] for _ in range(bins)]
    for i in sorted(range(n), key=lambda i: (-v[i].sum(), i)):  # largest first
        score = load @ v[i] + 1e-12 * load.sum(axis=1)  # a dimension-free unit: the emptiest bin
        score[[len(m) >= cap for m in members]] = np.inf
        b = int(np.argmin(score))
        members[b].append(i)
        load[b] += v[i]
    _improve(v, members, load)
    return [sorted(m) for m in members]


def _spread(load: np.ndarray) -> tuple[float, float]:
    """What the swaps lower: the sum over dimensions of the largest bin's load, then the loads' squared sum."""
    return float(load.max(axis=0).sum()), float((load * load).sum())


def _lower(x: tuple[float, float], y: tuple[float, float], eps: float = 1e-12) -> bool:
    """x < y as _spread's pairs compare, float noise (eps) aside."""
    return x[0] < y[0] - eps or (abs(x[0] - y[0]) <= eps and x[1] < y[1] - eps)


def _improve(v: np.ndarray, members: list[list[int]], load: np.ndarray) -> None:
    """Swap a unit of a bin that holds some dimension's largest load with a unit of another bin, the swap that
    lowers _spread most, while one does."""
    for _ in range(SWAP_ROUNDS):
        now, best = _spread(load), None
        for a in sorted(set(np.argmax(load, axis=0).tolist())):
            for b in range(len(members)):
                if b == a:
                    continue
                rest = np.delete(load, [a, b], axis=0).max(axis=0) if len(members) > 2 else np.zeros(load.shape[1])
                ia, ib = np.array(members[a]), np.array(members[b])
                d = v[ib][None, :, :] - v[ia][:, None, :]  # [i in a, j in b, dims]: a gains unit j, loses unit i
                new_a, new_b = load[a] + d, load[b] - d
                peak = np.maximum(np.maximum(new_a, new_b), rest).sum(axis=2)
                sq = (new_a * new_a).sum(axis=2) + (new_b * new_b).sum(axis=2) - (load[a] ** 2).sum() - (
                    load[b] ** 2).sum()
                i, j = np.unravel_index(int(np.lexsort((sq.ravel(), peak.ravel()))[0]), peak.shape)
                cand = (float(peak[i, j]), now[1] + float(sq[i, j]))
                if _lower(cand, best[0] if best else now):
                    best = (cand, a, b, int(i), int(j), d[i, j])
        if best is None:
            return
        _, a, b, i, j, d = best
        members[a][i], members[b][j] = members[b][j], members[a][i]
        load[a] += d
        load[b] -= d


class StepBalance:
    """The step starting at row `base` -> its B rows in slot order: slot (m x DP + d) x micro + i is row i of
    micro-batch m of DP rank d (mmpipe.data.batches.micro_batch_indices' layout)."""

    def __init__(self, cost: Callable[[int], tuple[float, float]], micro: int, gas: int, dp: int, unit: int = 1):
        """unit: consecutive rows that stay together in one micro-batch (it divides micro)."""
        if micro % unit:
            raise ValueError(f"a unit of {unit} rows does not divide micro-batches of {micro}")
        self.cost, self.micro, self.gas, self.dp, self.unit = cost, micro, gas, dp, unit
        self.batch = micro * gas * dp

    def costs(self, base: int) -> np.ndarray:
        """[B, 2]: each row's (tower, decoder) FLOPs, rows base .. base + B - 1."""
        return np.array([self.cost(r) for r in range(base, base + self.batch)], dtype=np.float64)

    @functools.lru_cache(maxsize=8)
    def order(self, base: int) -> tuple[int, ...]:
        return tuple(base + i for i in self.layout(self.costs(base)))

    def ranks(self, costs: np.ndarray, balanced: bool = True) -> list[list[int]]:
        """Each DP rank's row offsets (0 .. B - 1, ascending) for a step of these costs: the balanced layout's first
        level (assign over the ranks, what sets each rank's load), or stream order's (rank d holds micro-batch m's
        slot m x DP + d: the offsets o with (o // micro) % DP = d)."""
        if not balanced:
            return [[o for o in range(self.batch) if (o // self.micro) % self.dp == d] for d in range(self.dp)]
        u = self.unit
        units = costs.reshape(-1, u, costs.shape[1]).sum(axis=1)  # a unit's rows together, as layout's
        return [[k * u + j for k in mine for j in range(u)]
                for mine in assign(units, self.dp, self.gas * self.micro // u)]

    def layout(self, costs: np.ndarray) -> list[int]:
        """Row offsets (0 .. B - 1) in slot order for rows of these costs."""
        u = self.unit
        units = costs.reshape(-1, u, costs.shape[1]).sum(axis=1)  # a unit's rows together
        per_rank, per_micro = self.gas * self.micro // u, self.micro // u
        ranks = assign(units, self.dp, per_rank)
        slots = [[] for _ in range(self.dp * self.gas)]
        for d, mine in enumerate(ranks):
            micros = assign(units[mine], self.gas, per_micro)
            for m, idx in enumerate(sorted(micros, key=lambda g: g[0])):  # micro-batches in stream order
                slots[m * self.dp + d] = [mine[k] * u + j for k in idx for j in range(u)]
        return [r for s in slots for r in s]

    def unevenness(self, base: int) -> dict:
        """max / mean predicted cost over the step's DP ranks and over its micro-batches, in stream order (before)
        and balanced (after): total, tower and decoder apart, e.g. {"rank": (1.31, 1.02), ...}."""
        costs = self.costs(base)
        plain = list(range(self.batch))
        return {key: (ratio(costs, plain, self, level, part), ratio(costs, self.layout(costs), self, level, part))
                for key, (level, part) in LEVELS.items()}


LEVELS = {"rank": ("rank", None), "rank_tower": ("rank", 0), "rank_decoder": ("rank", 1),
          "micro": ("micro", None)}


def ratio(costs: np.ndarray, order: list[int], step: StepBalance, level: str, part: int | None) -> float:
    """max / mean of the loads of a layout's DP ranks (level "rank") or micro-batches ("micro"); part: tower (0),
    decoder (1) or their sum (None). 1.0 where every load is 0."""
    per_slot = costs[order].sum(axis=1) if part is None else costs[order][:, part]
    micro = per_slot.reshape(step.gas, step.dp, step.micro).sum(axis=2)  # [m, d]
    loads = micro.sum(axis=0) if level == "rank" else micro.ravel()
    mean = loads.mean()
    return float(loads.max() / mean) if mean > 0 else 1.0


def run_unevenness(step: StepBalance, first_row: int, rows: int, known: dict | None = None) -> dict:
    """Over the steps of rows [first_row, first_row + rows): per LEVELS key, before and after, the p50 / p90 / max of
    the steps' max / mean (summary.json's data.balance). known: steps' unevenness already counted, by first row."""
    bases = range(first_row, first_row + rows - step.batch + 1, step.batch)
    seen = [(known or {}).get(b) or step.unevenness(b) for b in bases]
    out: dict = {"steps": len(seen)}
    for key in LEVELS:
        for i, when in enumerate(("before", "after")):
            xs = np.array([s[key][i] for s in seen]) if seen else np.ones(1)
            out.setdefault(key, {})[when] = {"p50": round(float(np.percentile(xs, 50)), 4),
                                             "p90": round(float(np.percentile(xs, 90)), 4),
                                             "max": round(float(xs.max()), 4)}
    return out


def describe_balance(stats: dict, on: bool) -> str:
    """The data report's line, e.g. `data: rows balanced by predicted cost (--balance on): per-rank max/mean p50
    1.31 -> 1.02, p90 1.52 -> 1.04, max 1.60 -> 1.05 over 30 steps; per micro-batch p50 1.40 -> 1.10`."""
    r, m = stats["rank"], stats["micro"]
    how = "rows balanced by predicted cost (--balance on)" if on else "rows in stream order (--balance off)"
    return (f"data: {how}: per-rank predicted cost max/mean p50 {r['before']['p50']:.2f} -> {r['after']['p50']:.2f}, "
            f"p90 {r['before']['p90']:.2f} -> {r['after']['p90']:.2f}, max {r['before']['max']:.2f} -> "
            f"{r['after']['max']:.2f} over {stats['steps']} steps; per micro-batch p50 {m['before']['p50']:.2f} -> "
            f"{m['after']['p50']:.2f} (before: stream order, after: balanced)")
