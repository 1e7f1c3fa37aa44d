"""One pipeline x data-parallel x micro-batch layout, predicted: its stage split, per-stage memory and
seconds, and the step (mmpipe.planning.costmodel). `mmpipe plan` searches over these; `mmpipe bench`
sets one beside each measured variant; `mmpipe plan --calibrate` fits the device's terms to them.

    step time  = (m + P - 1) x (slowest stage's forward + backward per micro-batch + its p2p
                 + the device's per-slot overhead) + the data-parallel gradient all-reduce
                 + the device's per-step overhead
    bubble     = (P - 1) / (m + P - 1)

With schedule 'zb-h1' or 'both' (`mmpipe plan --schedule`) the same layout is also predicted under
ZB-H1 (costmodel.zero_bubble_step_seconds: each stage's backward split into B and W, both
schedules' orders replayed with those seconds, ZB-H1's step = 1F1B's minus the replayed saving),
with its memory at the micro-batches its order holds in flight; 'both' recommends the faster.
"""
from __future__ import annotations

from dataclasses import dataclass, field

from ..config import ConfigError, ModelConfig
from .costmodel import (
    BYTES,
    Device,
    LayerCost,
    layer_costs,
    pipeline_step_seconds,
    stage_memory,
    stage_seconds,
    stage_split_seconds,
    zero_bubble_step_seconds,
)
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
    schedule: str = "1f1b"  # the schedule `step` is for: the one asked for, or with 'both' the faster one
    predictions: dict = field(default_factory=dict)  # schedule -> its step dict, for every schedule asked for

    @property
    def throughput(self) -> float:
        return 0.0 if not self.step else (self.micro * self.gas * self.dp) / self.step["step_s"]


def plan_layout(rows: list[LayerCost], *, stages: int, dp: int, micro: int, gas: int, precision: str, zero: int,
                device: Device, measured: dict | None = None, partition: str = "balanced",
                schedule: str = "1f1b") -> Layout:
    """One layout, predicted. partition: 'balanced' (or 'best') is the min-max split that also fits
    device.memory (what `mmpipe plan` searches); any other method ('uniform', 'parameters',
    boundaries '3,7') is cut as `mmpipe train` cuts it, whatever the memory says. schedule: '1f1b',
    'zb-h1' or 'both' (the split is the same: it is chosen with 1F1B's memory)."""
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
    if schedule == "1f1b":
        return Layout(stages, dp, micro, gas, parts, stage_rows, step, predictions={"1f1b": step})
    split = stage_split_seconds(rows, parts, micro, device, measured)
    weight_stages = [any(r.w_flops for r in rows[a:b]) for a, b in zip(parts, parts[1:])]
    zb = zero_bubble_step_seconds(split, weight_stages, gas, boundary, grad_bytes, dp, device)
    # ZB-H1 holds up to P micro-batches on every stage with W (1F1B: P - s): its memory, stage by stage
    zb_mem = [stage_memory(rows, parts, s, micro=micro, micro_batches=gas, precision=precision, zero_stage=zero,
                           dp=dp, micro_batches_in_flight=k)["total"] for s, k in enumerate(zb["in_flight"])]
    zb.update(memory_gib=[x / GiB for x in zb_mem], fits=max(zb_mem) <= device.memory)
    for r, (_, b, w), k, mem in zip(stage_rows, split, zb["in_flight"], zb_mem):
        r.update(input_backward_ms=b * 1e3, weight_backward_ms=w * 1e3, zb_in_flight=k, zb_memory_gib=mem / GiB)
    predictions = {"1f1b": step, "zb-h1": zb} if schedule == "both" else {"zb-h1": zb}
    if schedule == "zb-h1" and not zb["fits"]:
        s = max(range(stages), key=lambda i: zb_mem[i])
        return Layout(stages, dp, micro, gas, parts, stage_rows, None,
                      f"zb-h1 holds {zb['in_flight'][s]} micro-batches on stage {s}: {zb_mem[s] / GiB:.1f} GiB > "
                      f"{device.memory / GiB:.0f} GiB", "zb-h1", predictions)
    chosen = "zb-h1" if zb["fits"] and (schedule == "zb-h1" or zb["step_s"] < step["step_s"]) else "1f1b"
    return Layout(stages, dp, micro, gas, parts, stage_rows, predictions[chosen], "", chosen, predictions)


def predict_layout(cfg: ModelConfig, *, stages: int, dp: int, micro: int, gas: int, precision: str, zero: int,
                   checkpointing: bool, text_len: int, device: Device, partition: str = "balanced",
                   freeze: tuple[str, ...] = (), schedule: str = "1f1b", images: int = 1) -> Layout:
    """The planner's prediction for one layout of cfg, as `mmpipe plan` computes it for that layout
    (images: a row's image slots, `mmpipe plan --max-images`; micro counts rows)."""
    rows = layer_costs(cfg, freeze, text_len, checkpointing, images=images)
    return plan_layout(rows, stages=stages, dp=dp, micro=micro, gas=gas, precision=precision, zero=zero,
                       device=device, partition=partition, schedule=schedule)
