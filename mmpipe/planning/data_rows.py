"""`mmpipe plan --pack --data FILE`: the step predicted from the data's own rows, spread over the DP ranks as
`mmpipe train --pack` spreads them (issue 57, docs/balance.md), not from one assumed row.

Without --data a packed row is costed as one sample filling its L positions: L^2 attention, the most a packed row can
cost, the same for every row (uniform rows). Its samples attend only within themselves, so the data's rows cost less
and not alike. With --data, plan reads the data as train does (its token index, mmpipe.data.index: no image is
opened; a train run's index is reused with --data-index RUN_DIR), packs PLAN_ROWS rows or more, whole steps of the
global batch (mmpipe.data.packing.RowPlan), prices each row layer by layer with the run's own cost model
(RowCosts.layer_flops, mmpipe.data.balance), and then

    each layer's FLOPs     = the mean row's (RowLoad.mean_rows): the split is balanced on the mean row
    each stage's seconds   x  busiest / mean, where busiest = over the steps, the mean of the largest DP rank's
                             stage FLOPs / its rows (the rows as balance.StepBalance.ranks spreads them: its own
                             assignment), and mean = the mean row's stage FLOPs

so the step is (m + P - 1) x the slowest stage's busiest-rank cost per micro-batch: the DP rank that finishes last
sets the step (the all-reduce waits for it). E.g. DP 2, micro-batches of 1 row, a step of rows costing 1, 2, 2, 3
(mean 2): stream order gives rank 0 rows 1 and 3 (1 + 2) and rank 1 rows 2 and 4 (2 + 3), busiest 5 / 2 = 2.5 a row,
1.25 x the mean; balanced, 3 + 1 and 2 + 2: 2 a row, the mean. Rows 1, 1, 1, 5: 3 a row either way, the floor no
layout goes under. At DP 1 the busiest rank holds the whole step: the mean.

The stages' busiest ranks are averaged over the steps one by one (each step's max over ranks, then the mean over
steps), not the max over stages of each step: a slight underestimate where one step's worst stage differs from
another's. Memory is unchanged: a packed row holds L positions' activations whatever it holds.
"""
from __future__ import annotations

import argparse
import contextlib
import dataclasses
import tempfile

import numpy as np

from ..config import ConfigError, ModelConfig
from ..data.args import DataArgs
from ..data.balance import RowCosts, StepBalance
from ..data.dataset import ROW_FLAGS, packed_image_slots, prepare, resolve_data
from ..data.image_kinds import image_kind
from ..data.packing import RowPlan, row_shape, sample_size
from ..flags import from_namespace

# rows priced: whole steps of the global batch, at least PLAN_ROWS of them (8 steps of 256, 64 of 32): the data's mean
# and spread; ~1 s to price and lay out at 256 rows a step
PLAN_ROWS = 2048
DATA_FLAGS = ("image_root", "tokenizer", "prompt_format", "overlong")  # what tokenises it, as train's flags say
SEED = 0  # the data order train's default --seed gives (the rows' mix is the data's whatever the seed)


class RowLoad:
    """A set of packed rows as the planner prices them: per layer the mean row's FLOPs, and per split and layout each
    stage's FLOPs a row on the step's busiest DP rank, balanced (mode 'balanced', what train runs by default), in
    stream order ('stream', --balance off) or the mean row ('mean': what the split alone predicts)."""

    def __init__(self, costs, batch: int, steps: int = 0, mode: str = "balanced", padding: float = 0.0,
                 source: str = ""):
        """costs: row -> (tower, decoder) FLOPs, and .layer_flops(row) -> FLOPs per layer (RowCosts); rows 0 ..
        batch x steps - 1, batch = the global batch's rows (steps 0: enough for PLAN_ROWS). padding: the rows'
        padding share (the report's)."""
        assert mode in ("balanced", "stream", "mean"), mode
        steps = steps or -(-PLAN_ROWS // batch)
        rows = batch * steps
        self.layers = np.array([costs.layer_flops(r) for r in range(rows)], dtype=np.float64)  # [rows, layers]
        self.pair = np.array([costs(r) for r in range(rows)], dtype=np.float64)  # [rows, (tower, decoder)]
        self.mean = self.layers.mean(axis=0)
        self.batch, self.steps, self.mode, self.padding, self.source = batch, steps, mode, padding, source
        self._ranks: dict[tuple, np.ndarray] = {}

    def with_mode(self, mode: str) -> "RowLoad":
        """The same rows, factors of another mode (the priced rows shared)."""
        new = object.__new__(RowLoad)
        new.__dict__.update(self.__dict__)
        new.mode = mode
        return new

    def mean_rows(self, table: list) -> list:
        """The planner's layer table (costmodel.LayerCost rows, layer_specs order) at the mean row: each layer's
        forward, backward and W FLOPs x mean / its table FLOPs (the table's row: one sample filling L)."""
        out = []
        for r, m in zip(table, self.mean, strict=True):
            k = m / r.flops if r.flops else 1.0
            out.append(dataclasses.replace(r, fwd_flops=r.fwd_flops * k, bwd_flops=r.bwd_flops * k,
                                           w_flops=r.w_flops * k))
        return out

    def _rank_sums(self, dp: int, micro: int, balanced: bool) -> np.ndarray:
        """[steps, dp, layers]: each step's DP ranks' FLOPs layer by layer, the rows spread by StepBalance.ranks
        (the runtime's own assignment; stream order depends on the micro-batch size, balanced rows do not)."""
        key = (dp, 0 if balanced else micro, balanced)
        if key not in self._ranks:
            step = StepBalance(None, micro, self.batch // (micro * dp), dp)
            sums = [[self.layers[s * self.batch + np.asarray(r, dtype=np.int64)].sum(axis=0)
                     for r in step.ranks(self.pair[s * self.batch:(s + 1) * self.batch], balanced)]
                    for s in range(self.steps)]
            self._ranks[key] = np.array(sums)
        return self._ranks[key]

    def busiest(self, parts: list[int], dp: int, micro: int, balanced: bool = True) -> np.ndarray:
        """[stages]: each stage's FLOPs a row on the step's busiest DP rank for that stage, the mean over the steps
        (module docstring). parts: the split's layer boundaries [0, .., layers]."""
        stages = np.add.reduceat(self._rank_sums(dp, micro, balanced), parts[:-1], axis=2)  # [steps, dp, stages]
        return stages.max(axis=1).mean(axis=0) / (self.batch // dp)

    def stage_mean(self, parts: list[int]) -> np.ndarray:
        return np.add.reduceat(self.mean, parts[:-1])

    def factors(self, parts: list[int], dp: int, micro: int) -> list[float]:
        """Each stage's seconds factor over the mean row's (mode): busiest / mean, 1 where a stage costs nothing."""
        if self.mode == "mean":
            return [1.0] * (len(parts) - 1)
        mean = self.stage_mean(parts)
        busy = self.busiest(parts, dp, micro, self.mode == "balanced")
        return [float(b / m) if m > 0 else 1.0 for b, m in zip(busy, mean)]

    def summary(self, parts: list[int], dp: int, micro: int) -> dict:
        """The layout's rows, for --json and the printed line: per stage the busiest DP rank's cost over the mean
        row's, balanced (what the step uses) and in stream order (--balance off)."""
        mean = self.stage_mean(parts)
        ratio = {b: [round(float(x / m), 4) if m > 0 else 1.0 for x, m in
                     zip(self.busiest(parts, dp, micro, b == "balanced"), mean)] for b in ("balanced", "stream")}
        return {"mode": self.mode, "steps": self.steps, "rows": self.batch * self.steps,
                "mean_row_flops": float(self.mean.sum()), "padding_share": round(self.padding, 4),
                "busiest_over_mean": ratio}


def data_flags(args) -> DataArgs:
    """The train data flags plan was given (--data, the row's, what tokenises it), the rest train's defaults."""
    return dataclasses.replace(from_namespace(DataArgs, args, only=ROW_FLAGS + DATA_FLAGS), data=args.data)


def train_argv(args) -> tuple[str, ...]:
    """--data and the tokenising flags given, as `mmpipe train` takes them (plan's printed train command)."""
    out, default = ["--data", args.data], DataArgs()
    for name in DATA_FLAGS:
        if getattr(args, name) != getattr(default, name):
            out += ["--" + name.replace("_", "-"), str(getattr(args, name))]
    return tuple(out)


def read_data(args, cfg: ModelConfig, folder: str) -> tuple:
    """(the data's options as train resolves them, the flags with --max-images and an unset row budget as train
    derives them from the data under --pack alone: packed_image_slots). ConfigError, a line a problem."""
    if not args.pack:
        raise ConfigError("--data: only with --pack (a row of one sample costs its full row whatever it holds; "
                          "packed rows are priced from the data)")
    given = [f for f, v in (("--image-size", args.image_size), ("--video-frames", args.video_frames),
                            ("--profile", args.profile)) if v]
    if given:
        raise ConfigError(f"--data: not with {', '.join(given)} (the data's own rows are costed, from --device's "
                          f"peak x --efficiency)")
    opts = resolve_data(data_flags(args), cfg)
    if not opts.auto_slots:
        return opts, args
    opts = packed_image_slots(opts, cfg, folder, SEED)
    ns = argparse.Namespace(**vars(args))  # the user's namespace stays as given
    ns.max_images = opts.max_images
    kind = image_kind(cfg)
    if opts.auto_budget and kind.flag:
        setattr(ns, kind.flag, opts.vision_budget)
    print(f"note: --pack without --max-images: the data fills a row's {opts.max_images} image slots, as `mmpipe "
          f"train --pack` derives them; planned at --max-images {opts.max_images}")
    return opts, ns


def row_load(opts, cfg: ModelConfig, table: list, images: int, text_len: int, budget: int, batch: int,
             folder: str) -> RowLoad:
    """The data's first steps of `batch` packed rows (PLAN_ROWS at least), priced (RowCosts on the planner's
    table)."""
    samples = prepare(opts, cfg, folder, SEED, verbose=False)
    shape = row_shape(cfg, images, text_len, budget)
    costs = RowCosts(cfg, shape, table, RowPlan(sample_size(samples, shape), shape, pack=True), samples)
    load = RowLoad(costs, batch, source=opts.name)
    load.padding = float(np.mean([costs.lengths(r)[-1] for r in range(batch * load.steps)]) / shape.length)
    return load


def scratch(folder: str | None, dry_run: bool = False):
    """Where the index is read or built: a train run's folder (--data-index), else a temporary one; under --dry-run
    always a temporary one (a dry run writes nothing of the user's)."""
    if folder and not dry_run:
        return contextlib.nullcontext(folder)
    return tempfile.TemporaryDirectory(prefix="mmpipe-plan-")


def rows_line(load: RowLoad | None, best) -> str:
    """What `mmpipe plan --pack` assumed of its rows: uniform rows (no --data), or the data's, balanced."""
    if load is None:
        return ("rows: assumed uniform, each costed as one sample filling its positions (L^2 attention: the most a "
                "packed row costs); give --data FILE to price the data's own rows, spread over the DP ranks as "
                "`mmpipe train --pack` balances them (docs/balance.md)")
    head = (f"rows: {load.batch * load.steps} packed rows of {load.source} ({load.steps} steps of {load.batch}): "
            f"the mean row {load.mean.sum() / 1e9:.4g} GFLOP, padding share {load.padding:.1%}")
    if best is None or not best.step or "rows" not in best.step:
        return head
    r = best.step["rows"]["busiest_over_mean"]
    return (f"{head}; the step is costed at each stage's busiest DP rank with the rows spread as `mmpipe train "
            f"--pack` spreads them ({load.mode}); the best layout's busiest rank / mean row, per stage: balanced "
            f"{', '.join(f'{x:.3f}' for x in r['balanced'])}, stream order (--balance off) "
            f"{', '.join(f'{x:.3f}' for x in r['stream'])}")
