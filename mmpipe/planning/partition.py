"""Where the layer list is cut into pipeline stages.

DeepSpeed's own methods do not fit a VLM ('parameters' counts only trainable parameters, so a
frozen ViT weighs nothing; 'uniform' ignores that decoder blocks see image + text tokens), so
mmpipe computes the stage boundaries itself and hands them to PipelineModule (mmpipe.runtime.pipeline).
Methods (DeepSpeed JSON "pipeline": {"partition": ...}, or --partition):

    balanced    (default; DeepSpeed's "best" means this) the exact min-max contiguous split of
                each layer's forward + backward (+ recompute) FLOPs (mmpipe.planning.costmodel: the tokens
                each layer sees, x3 for a trainable layer, x2 for a frozen layer behind a
                trainable one, x1 for a frozen prefix that runs no backward), optionally also
                subject to a memory limit per stage.
    uniform     the same number of layers per stage (DeepSpeed's partition_uniform).
    parameters  balanced on all parameters, frozen ones included.
    a,b,...     explicit: the first layer index of stages 1, 2, ... (P - 1 numbers).

Every stage must hold a trainable parameter (DeepSpeed's optimizer refuses an empty one), so
balanced and parameters never cut a frozen run of layers off the trainable layer after it.
"""
from __future__ import annotations

from typing import Callable

from deepspeed.runtime import utils as ds_utils

from ..config import ConfigError, ModelConfig
from ..model.lora import Lora
from .costmodel import LayerCost, layer_costs, pair_image_rows, stage_params, tied_repeats
from .images import patch_row
from .vpairs import v_pair_split


def layer_table(cfg: ModelConfig, freeze: tuple[str, ...], text_len: int, checkpointing: bool = False,
                lora: Lora | None = None, images: int = 1, budget: int = 0, pairs: bool = False) -> list[LayerCost]:
    """The run's layer costs per row: images = --max-images image slots (1: one-sample rows), the decoder
    on images x N_dec + text_len positions (costmodel.layer_costs). budget: the row's vision budget in its image
    kind's unit (0: train's default): a family of patches' P, its images the preset's image_size, resized to fit;
    tiles' T crops, its images the largest pinpoint (mmpipe.planning.images.crop_row). pairs: --objective dpo's
    rows (costmodel.pair_image_rows: a sharing family's tower runs each pair's images once, half a row's)."""
    rows = layer_costs(cfg, freeze, text_len, checkpointing, lora, images, patch_row(cfg, images, budget))
    return pair_image_rows(cfg, rows) if pairs else rows


def trainable_units(table: list[LayerCost]) -> list[list[int]]:
    """Group layers so each unit holds a trainable layer: a frozen run joins the trainable layer
    after it (or before it, at the end of the list)."""
    units, pending = [], []
    for i, row in enumerate(table):
        pending.append(i)
        if row.trainable:
            units.append(pending)
            pending = []
    if pending:
        if not units:
            return [pending]
        units[-1].extend(pending)
    return units


def min_max_split(weights: list[float], parts: int, fits: Callable[[int, int, int], bool] | None = None
                  ) -> list[int] | None:
    """Exact min-max contiguous split by dynamic programming: boundaries [0, b1, ..., len(weights)]
    minimising the largest part's sum, over the splits where fits(stage, first, end) holds for every
    part (e.g. its memory fits the device); among those, the most even one (least sum of squares),
    so a tie never leaves a near-empty stage idle. None when no split fits. O(parts x n^2)."""
    n = len(weights)
    prefix = [0.0]
    for w in weights:
        prefix.append(prefix[-1] + w)

    def solve(combine, ok):
        """best[s][j]: the best value when the first s parts cover items [0, j)."""
        inf = float("inf")
        best = [[inf] * (n + 1) for _ in range(parts + 1)]
        cut = [[-1] * (n + 1) for _ in range(parts + 1)]
        best[0][0] = 0.0
        for s in range(1, parts + 1):
            for j in range(s, n - (parts - s) + 1):
                for i in range(s - 1, j):
                    part = prefix[j] - prefix[i]
                    if best[s - 1][i] == inf or not ok(s - 1, i, j, part):
                        continue
                    value = combine(best[s - 1][i], part)
                    if value < best[s][j]:
                        best[s][j], cut[s][j] = value, i
        if best[parts][n] == inf:
            return None, None
        bounds, j = [n], n
        for s in range(parts, 0, -1):
            j = cut[s][j]
            bounds.append(j)
        return best[parts][n], bounds[::-1]

    def fit(s, i, j, part):
        return fits is None or fits(s, i, j)
    bottleneck, bounds = solve(max, fit)
    if bounds is None:
        return None
    tol = 1e-9 * max(1.0, abs(bottleneck))
    _, even = solve(lambda acc, part: acc + part * part,
                    lambda s, i, j, part: part <= bottleneck + tol and fit(s, i, j, part))
    return even or bounds


def compute_parts(table: list[LayerCost], stages: int, method: str,
                  fits: Callable[[int, int, int], bool] | None = None, v_ranks: int = 0) -> list[int]:
    """Stage boundaries [0, b1, ..., n_layers] (DeepSpeed's `parts`). `fits(stage, first_unit,
    end_unit)` may restrict balanced/parameters splits (a memory limit, see mmpipe.planning.plan).
    v_ranks: the stages are DualPipeV's V on that many ranks (stages = 2 x v_ranks, rank r holding stage r
    and 2 x v_ranks - 1 - r): balanced / parameters then balance the ranks' pairs (mmpipe.planning.vpairs),
    without `fits`."""
    n = len(table)
    if stages > n:
        raise ConfigError(f"--stages: {stages} stages but the model has only {n} layers (valid: 1..{n})")
    method = "balanced" if method in ("best", "") else method
    if method == "uniform":
        parts = [int(p) for p in ds_utils.partition_uniform(num_items=n, num_parts=stages)]
    elif method in ("balanced", "parameters"):
        units = trainable_units(table)
        if stages > len(units):
            raise ConfigError(f"--stages: {stages} stages but only {len(units)} groups of layers hold a trainable "
                              f"parameter (valid: 1..{len(units)}, or freeze less)")
        key = (lambda r: r.flops) if method == "balanced" else (lambda r: r.params)
        weights = [sum(key(table[i]) for i in u) for u in units]
        unit_parts = v_pair_split(weights, v_ranks) if v_ranks else min_max_split(weights, stages, fits)
        if unit_parts is None:
            raise ConfigError(f"partition: no split of the model into {stages} stages fits the memory limit "
                              f"(more stages, a smaller micro-batch, activation checkpointing, or ZeRO-1)")
        parts = [units[p][0] if p < len(units) else n for p in unit_parts]
    else:
        try:
            inner = [int(x) for x in method.split(",")]
        except ValueError:
            raise ConfigError(f"pipeline.partition: '{method}' is not a method (valid: balanced, uniform, "
                              f"parameters, or comma-separated first-layer indices of stages 1..P-1)") from None
        parts = [0] + inner + [n]
        if len(inner) != stages - 1 or any(b <= a for a, b in zip(parts, parts[1:])):
            raise ConfigError(f"pipeline.partition: '{method}' must be {stages - 1} increasing layer indices "
                              f"between 1 and {n - 1} for {stages} stages")
    return parts


def check_trainable(table: list[LayerCost], parts: list[int]) -> None:
    for s, (a, b) in enumerate(zip(parts, parts[1:])):
        if not any(r.trainable for r in table[a:b]):
            raise ConfigError(f"partition: stage {s} (layers {a}..{b - 1}: {table[a].name}..{table[b - 1].name}) "
                              f"would hold no trainable parameter; DeepSpeed cannot train it (freeze less, "
                              f"use fewer stages, or move the boundary)")


def describe(table: list[LayerCost], parts: list[int]) -> list[dict]:
    """Per-stage summary for the log and summary.json."""
    total = sum(r.flops for r in table) or 1.0
    out = []
    for s, (a, b) in enumerate(zip(parts, parts[1:])):
        rows = table[a:b]
        out.append({"stage": s, "layers": [a, b - 1], "first": rows[0].name, "last": rows[-1].name,
                    "params": stage_params(rows),
                    "trainable_params": sum(r.trainable_params for r in rows) - tied_repeats(rows)[1],
                    "cost_share": round(sum(r.flops for r in rows) / total, 4)})
    return out
