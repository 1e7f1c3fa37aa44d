"""Where the layer list is cut into pipeline stages.

DeepSpeed's own methods do not fit a VLM ('parameters' counts only trainable parameters, so a
frozen ViT weighs nothing; 'uniform' ignores that decoder blocks see image + text tokens), so
mmpipe computes the stage boundaries itself and hands them to PipelineModule (mmpipe.pipeline).
Methods (DeepSpeed JSON "pipeline": {"partition": ...}, or --partition):

    balanced    (default; DeepSpeed's "best" means this) min-max split of a per-layer cost:
                forward FLOPs from the tokens each layer sees, x3 for a trainable layer
                (forward + input and weight gradients), x2 for a frozen layer behind a trainable
                one (input gradients only), x1 for a frozen prefix (no backward at all).
    uniform     the same number of layers per stage (DeepSpeed's partition_uniform).
    parameters  balanced on all parameters, frozen ones included.
    a,b,...     explicit: the first layer index of stages 1, 2, ... (P - 1 numbers).

Every stage must hold a trainable parameter (DeepSpeed's optimizer refuses an empty one), so
balanced and parameters never cut a frozen run of layers off the trainable layer after it.
"""
from __future__ import annotations

from dataclasses import dataclass

from deepspeed.runtime import utils as ds_utils

from .config import ConfigError, ModelConfig
from .model.builder import layer_param_counts, layer_specs


@dataclass(frozen=True)
class LayerInfo:
    name: str
    group: str
    params: int
    trainable: bool
    tokens: int  # sequence positions this layer processes per sample
    cost: float  # relative time per sample (see module docstring)


def layer_table(cfg: ModelConfig, freeze: tuple[str, ...], text_len: int) -> list[LayerInfo]:
    specs, counts = layer_specs(cfg), layer_param_counts(cfg)
    n_img, seq = cfg.vision.n_tokens, cfg.vision.n_tokens + text_len  # e.g. 16 + 16 = 32 decoder positions
    rows, seen_trainable = [], False
    for spec, params in zip(specs, counts):
        group = spec.typename.group
        trainable = group not in freeze and params > 0
        seen_trainable |= trainable
        name = spec.typename.__name__
        tokens = seq if group == "text" else n_img
        flops = 2 * params * tokens  # a matmul costs 2 FLOPs per weight per token
        if name == "TextEmbed":
            flops = cfg.text.dim * tokens  # a lookup, not a matmul
        if name in ("VisionBlock", "DecoderBlock"):
            dim = cfg.vision.dim if group == "vision" else cfg.text.dim
            flops += 4 * tokens * tokens * dim  # q k^T and attn v
        mult = 3 if trainable else (2 if seen_trainable else 1)
        rows.append(LayerInfo(name, group, params, trainable, tokens, float(flops * mult)))
    return rows


def _units(table: list[LayerInfo]) -> list[list[int]]:
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


def compute_parts(table: list[LayerInfo], stages: int, method: str) -> list[int]:
    """Stage boundaries [0, b1, ..., n_layers] (DeepSpeed's `parts`)."""
    n = len(table)
    if stages > n:
        raise ConfigError(f"--stages: {stages} stages but the model has only {n} layers (valid: 1..{n})")
    method = "balanced" if method in ("best", "") else method
    if method == "uniform":
        parts = [int(p) for p in ds_utils.partition_uniform(num_items=n, num_parts=stages)]
    elif method in ("balanced", "parameters"):
        units = _units(table)
        if stages > len(units):
            raise ConfigError(f"--stages: {stages} stages but only {len(units)} groups of layers hold a trainable "
                              f"parameter (valid: 1..{len(units)}, or freeze less)")
        key = (lambda r: r.cost) if method == "balanced" else (lambda r: r.params)
        weights = [sum(key(table[i]) for i in u) for u in units]
        unit_parts = ds_utils.partition_balanced(weights=weights, num_parts=stages)
        parts = [units[int(p)][0] if int(p) < len(units) else n for p in unit_parts]
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


def check_trainable(table: list[LayerInfo], parts: list[int]) -> None:
    for s, (a, b) in enumerate(zip(parts, parts[1:])):
        if not any(r.trainable for r in table[a:b]):
            raise ConfigError(f"partition: stage {s} (layers {a}..{b - 1}: {table[a].name}..{table[b - 1].name}) "
                              f"would hold no trainable parameter; DeepSpeed cannot train it (freeze less, "
                              f"use fewer stages, or move the boundary)")


def describe(table: list[LayerInfo], parts: list[int]) -> list[dict]:
    """Per-stage summary for the log and summary.json."""
    total = sum(r.cost for r in table) or 1.0
    out = []
    for s, (a, b) in enumerate(zip(parts, parts[1:])):
        rows = table[a:b]
        out.append({"stage": s, "layers": [a, b - 1], "first": rows[0].name, "last": rows[-1].name,
                    "params": sum(r.params for r in rows),
                    "trainable_params": sum(r.params for r in rows if r.trainable),
                    "cost_share": round(sum(r.cost for r in rows) / total, 4)})
    return out
