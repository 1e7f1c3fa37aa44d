"""One pipeline x data-parallel x micro-batch layout, predicted: its stage split, per-stage memory and
seconds, and the step (mmpipe.planning.costmodel). `mmpipe plan` searches over these; `mmpipe bench`
sets one beside each measured variant; `mmpipe plan --calibrate` fits the device's terms to them.

    step time  = (m + P - 1) x (slowest stage's forward + backward per micro-batch + its p2p
                 + the device's per-slot overhead) + the data-parallel gradient all-reduce
                 + the device's per-step overhead
    bubble     = (P - 1) / (m + P - 1)
"""
from __future__ import annotations

from dataclasses import dataclass

from ..config import ConfigError, ModelConfig
from .costmodel import BYTES, Device, LayerCost, layer_costs, pipeline_step_seconds, stage_memory, stage_seconds
from .partition import compute_parts, trainable_units

GiB = 2 ** 30
# `--device cpu`: one rank per core shares the host's memory; ranks talk over gloo on the loopback
CPU_LINK = 5e9
CPU_EFFICIENCY = 0.5


@dataclass
class Layout:
    stages: int
    dp: int
    micro: int
    gas: int
    parts: list[int] | None
    stage_rows: list[dict]
    step: dict | None
    reason: str = ""

    @property
    def throughput(self) -> float:
        return 0.0 if not self.step else (self.micro * self.gas * self.dp) / self.step["step_s"]


def plan_layout(rows: list[LayerCost], *, stages: int, dp: int, micro: int, gas: int, precision: str, zero: int,
                device: Device, measured: dict | None = None, partition: str = "balanced") -> Layout:
    """One layout, predicted. partition: 'balanced' (or 'best') is the min-max split that also fits
    device.memory (what `mmpipe plan` searches); any other method ('uniform', 'parameters',
    boundaries '3,7') is cut as `mmpipe train` cuts it, whatever the memory says."""
    units = trainable_units(rows)
    if stages > len(units):
        return Layout(stages, dp, micro, gas, None, [], None,
                      f"only {len(units)} groups of layers hold a trainable parameter")

    def unit_parts(s, i, j):  # layer boundaries of units i..j-1 as stage s
        return [units[i][0], units[j - 1][-1] + 1]

    def fits(s, i, j):
        a, b = unit_parts(s, i, j)
        fake = [0] * s + [a, b] + [b] * (stages - s - 1)  # stage s = layers [a, b)
        mem = stage_memory(rows, fake, s, micro=micro, micro_batches=gas, precision=precision, zero_stage=zero, dp=dp)
        return mem["total"] <= device.memory

    try:
        parts = compute_parts(rows, stages, "balanced", fits) if partition in ("balanced", "best", "") else \
            compute_parts(rows, stages, partition)
    except ConfigError:
        if partition not in ("balanced", "best", ""):
            raise
        whole = stage_memory(rows, [0, len(rows)], 0, micro=micro, micro_batches=gas, precision=precision,
                             zero_stage=zero, dp=dp)["total"]
        need = (f"it needs {whole / GiB:.1f} GiB" if stages == 1 else
                f"an even share would be ~{whole / stages / GiB:.1f} GiB")
        return Layout(stages, dp, micro, gas, None, [], None, f"no split fits {device.memory / GiB:.0f} GiB ({need})")
    times = stage_seconds(rows, parts, micro, device, measured)
    stage_rows = []
    for s, ((a, b), (f, bw)) in enumerate(zip(zip(parts, parts[1:]), times)):
        mem = stage_memory(rows, parts, s, micro=micro, micro_batches=gas, precision=precision, zero_stage=zero, dp=dp)
        stage_rows.append({"stage": s, "layers": [a, b - 1], "first": rows[a].name, "last": rows[b - 1].name,
                           "params": sum(r.params for r in rows[a:b]), "memory_gib": mem["total"] / GiB,
                           "activations_gib": mem["activations"] / GiB, "forward_ms": f * 1e3, "backward_ms": bw * 1e3})
    boundary = [rows[b - 1].boundary_elems * micro * BYTES[precision] for b in parts[1:-1]]
    grad_bytes = max(sum(r.trainable_params for r in rows[a:b])
                     for a, b in zip(parts, parts[1:])) * BYTES[precision]
    step = pipeline_step_seconds(times, gas, boundary, grad_bytes, dp, device)
    return Layout(stages, dp, micro, gas, parts, stage_rows, step)


def predict_layout(cfg: ModelConfig, *, stages: int, dp: int, micro: int, gas: int, precision: str, zero: int,
                   checkpointing: bool, text_len: int, device: Device, partition: str = "balanced",
                   freeze: tuple[str, ...] = ()) -> Layout:
    """The planner's prediction for one layout of cfg, as `mmpipe plan` computes it for that layout."""
    rows = layer_costs(cfg, freeze, text_len, checkpointing)
    return plan_layout(rows, stages=stages, dp=dp, micro=micro, gas=gas, precision=precision, zero=zero,
                       device=device, partition=partition)
