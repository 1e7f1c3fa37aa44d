"""One pipeline x data-parallel x micro-batch layout, predicted: its stage split, per-stage memory and
seconds, and the step (mmpipe.planning.costmodel). `mmpipe plan` searches over these; `mmpipe bench`
sets one beside each measured variant; `mmpipe plan --calibrate` fits the device's terms to them.

    step time  = (m + P - 1) x (slowest stage's forward + backward per micro-batch + its p2p
                 + the device's per-slot overhead) + the data-parallel gradient all-reduce
                 + the device's per-step overhead
    bubble     = (P - 1) / (m + P - 1)

With schedule 'zb-h1' or 'both' (`mmpipe plan --schedule`) the same layout is also predicted under
ZB-H1 (costmodel.replayed_step_seconds: each stage's backward split into B and W, both
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
    RangeMemory,
    all_to_all,
    layer_costs,
    pipeline_step_seconds,
    replayed_step_seconds,
    stage_memory,
    stage_params,
    stage_seconds,
    stage_split_seconds,
    tied_repeats,
)
from .images import patch_row
from .partition import compute_parts, trainable_units
from .schedule_registry import BASELINE, Schedule, asked

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
    schedule: str = BASELINE.name  # the name of the schedule `step` is for: the one asked for, or the faster one
    predictions: dict = field(default_factory=dict)  # schedule -> its step dict, for every schedule asked for
    ep: int = 1  # expert-parallel ranks (`--ep`): an MoE model's experts split over groups of ep of the dp ranks

    @property
    def throughput(self) -> float:
        return 0.0 if not self.step else (self.micro * self.gas * self.dp) / self.step["step_s"]


def _stage_rows(rows: list[LayerCost], parts: list[int], times, a2a: list[dict], **memory) -> list[dict]:
    """Each stage's row of a layout: its layers, parameters, memory (stage_memory with `memory`'s settings) and
    times; an MoE model's (a2a: all_to_all's per stage) also the rank's own parameters (1 / ep of the experts) and
    its all-to-all per micro-batch."""
    out = []
    for s, ((a, b), (f, bw)) in enumerate(zip(zip(parts, parts[1:]), times)):
        mem = stage_memory(rows, parts, s, **memory)
        out.append({"stage": s, "layers": [a, b - 1], "first": rows[a].name, "last": rows[b - 1].name,
                    "params": stage_params(rows[a:b]), "memory_gib": mem["total"] / GiB,
                    "activations_gib": mem["activations"] / GiB, "forward_ms": f * 1e3, "backward_ms": bw * 1e3})
        if a2a:
            experts = sum(r.expert_params for r in rows[a:b])
            out[-1].update(rank_params=out[-1]["params"] - experts + experts / memory["ep"],
                           a2a_mib=2 * a2a[s]["bytes"] / 2 ** 20, a2a_ms=2 * a2a[s]["seconds"] * 1e3)
    return out


def plan_layout(rows: list[LayerCost], *, stages: int, dp: int, micro: int, gas: int, precision: str, zero: int,
                device: Device, measured: dict | None = None, partition: str = "balanced",
                schedule: Schedule | tuple[Schedule, ...] | str = BASELINE, ep: int = 1) -> Layout:
    """One layout, predicted. ep: an MoE model's expert-parallel ranks (`--ep`, dividing dp): each rank holds
    1 / ep of the experts' weights, gradients and optimizer states (costmodel.rank_state_bytes) and each MoE block
    adds its all-to-alls to the stage's forward and backward (costmodel.all_to_all); the step dict then carries
    a2a_s (the slowest stage's all-to-all seconds per micro-batch, forward + backward) and a2a_share (their share
    of the step: slots x a2a_s / step_s). partition: 'balanced' (or 'best') is the min-max split that also fits
    device.memory (what `mmpipe plan` searches); any other method ('uniform', 'parameters',
    boundaries '3,7') is cut as `mmpipe train` cuts it, whatever the memory says. schedule: the record
    (or records) to predict, or a name in schedule_registry.SCHEDULE_NAMES or 'both' (the split is the
    same: it is chosen with 1F1B's memory). The Layout names the one `step` is for."""
    units = trainable_units(rows)
    if stages > len(units):
        return Layout(stages, dp, micro, gas, None, [], None,
                      f"only {len(units)} groups of layers hold a trainable parameter", ep=ep)
    moe = any(r.a2a_elems for r in rows)

    def unit_parts(s, i, j):  # layer boundaries of units i..j-1 as stage s
        return [units[i][0], units[j - 1][-1] + 1]

    memory = dict(micro=micro, micro_batches=gas, zero_stage=zero, dp=dp, ep=ep)  # what stage_memory counts by
    ranges = RangeMemory(rows, precision, **memory)  # stage_memory of any range, in O(1)

    def fits(s, i, j):  # stage s = the layers of units i..j-1
        return ranges.total(*unit_parts(s, i, j), s, stages) <= device.memory

    try:
        parts = compute_parts(rows, stages, "balanced", fits) if partition in ("balanced", "best", "") else \
            compute_parts(rows, stages, partition)
    except ConfigError:
        if partition not in ("balanced", "best", ""):
            raise
        whole = stage_memory(rows, [0, len(rows)], 0, precision=precision, **memory)["total"]
        need = (f"it needs {whole / GiB:.1f} GiB" if stages == 1 else
                f"an even share would be ~{whole / stages / GiB:.1f} GiB")
        return Layout(stages, dp, micro, gas, None, [], None, f"no split fits {device.memory / GiB:.0f} GiB ({need})",
                      ep=ep)
    a2a = all_to_all(rows, parts, micro, precision, ep, device) if moe else []
    times = stage_seconds(rows, parts, micro, device, measured)
    if moe:  # the exchange waits on the critical path: forward's two all-to-alls, backward's two
        times = [(f + x["seconds"], bw + x["seconds"]) for (f, bw), x in zip(times, a2a)]
    stage_rows = _stage_rows(rows, parts, times, a2a, precision=precision, **memory)
    boundary = [rows[b - 1].boundary_elems * micro * BYTES[precision] for b in parts[1:-1]]
    grad_bytes = max(_ring_bytes(rows[a:b], dp, ep) for a, b in zip(parts, parts[1:])) * BYTES[precision]
    step = pipeline_step_seconds(times, gas, boundary, grad_bytes, dp, device)
    ask = asked(schedule)
    replayed = [s for s in ask if s is not BASELINE]
    own = _replayed(replayed, rows, parts, stage_rows, micro=micro, gas=gas, precision=precision, zero=zero, dp=dp,
                    device=device, measured=measured, boundary=boundary, grad_bytes=grad_bytes, ep=ep,
                    a2a=a2a) if replayed else {}
    for pred in [step, *own.values()] if moe else []:
        pred.update(_a2a_share(pred, times, a2a, gas))
    predictions = {s.name: own[s.name] if s in replayed else step for s in ask}
    fitting = [s for s in ask if predictions[s.name].get("fits", True)]  # the baseline's split was cut to fit
    if not fitting:  # the one schedule asked for holds more micro-batches than memory takes
        sched, mem = ask[0], own[ask[0].name]["memory_gib"]
        s = max(range(stages), key=lambda i: mem[i])
        return Layout(stages, dp, micro, gas, parts, stage_rows, None,
                      f"{sched} holds {own[sched.name]['in_flight'][s]} micro-batches on stage {s}: "
                      f"{mem[s]:.1f} GiB > {device.memory / GiB:.0f} GiB", sched.name, predictions, ep)
    chosen = min(fitting, key=lambda s: predictions[s.name]["step_s"])  # a tie: the earlier, the baseline
    return Layout(stages, dp, micro, gas, parts, stage_rows, predictions[chosen.name], "", chosen.name, predictions,
                  ep)


def _ring_bytes(rows: list[LayerCost], dp: int, ep: int) -> float:
    """A stage's gradient elements as pipeline_step_seconds' ring all-reduce over dp ranks counts them (it charges
    2 (dp - 1) / dp x the bytes): the replicated ones all-reduced over dp; under expert parallelism a rank's 1 / ep of
    the expert gradients over their expert-data-parallel group of g = dp / ep ranks, 2 (g - 1) / g x their bytes,
    entered here scaled to the dp ring's factor. ep = 1: the stage's trainable parameters, as before."""
    trainable = sum(r.trainable_params for r in rows) - tied_repeats(rows)[1]  # a tied module's gradient once
    if ep == 1:
        return trainable
    experts = sum(r.expert_trainable for r in rows)
    g = dp // ep
    return trainable - experts + experts / ep * ((g - 1) / g) / ((dp - 1) / dp)


def _a2a_share(step: dict, times: list[tuple[float, float]], a2a: list[dict], gas: int) -> dict:
    """The all-to-all's part of a step: a2a_s, the all-to-all seconds (forward + backward) per micro-batch of the
    stage that sets the slot (the slowest), and a2a_share = slots x a2a_s / step_s; a2a_bytes: that stage's bytes
    per micro-batch, both directions."""
    s = max(range(len(times)), key=lambda i: times[i][0] + times[i][1])
    a2a_s = 2 * a2a[s]["seconds"]
    return {"a2a_s": a2a_s, "a2a_bytes": 2 * a2a[s]["bytes"], "a2a_share": step["slots"] * a2a_s / step["step_s"]}


def _replayed(schedules: list[Schedule], rows: list[LayerCost], parts: list[int], stage_rows: list[dict], *,
              micro: int, gas: int, precision: str, zero: int, dp: int, device: Device, measured: dict | None,
              boundary: list[float], grad_bytes: float, ep: int = 1, a2a: list[dict] | None = None
              ) -> dict[str, dict]:
    """name -> the step of each schedule predicted by replaying its order (costmodel.replayed_step_seconds),
    with its memory at the micro-batches its order holds in flight (ZB-H1: up to P on every stage with W,
    1F1B: P - s), stage by stage; each stage row gains its B and W seconds and each schedule's memory."""
    split = stage_split_seconds(rows, parts, micro, device, measured)
    if a2a:  # the exchange in F and in B (the input gradients need the returned rows), none in W
        split = [(f + x["seconds"], b + x["seconds"], w) for (f, b, w), x in zip(split, a2a)]
    weight_stages = [any(r.w_flops for r in rows[a:b]) for a, b in zip(parts, parts[1:])]
    for r, (_, b, w) in zip(stage_rows, split):
        r.update(input_backward_ms=b * 1e3, weight_backward_ms=w * 1e3)
    out = {}
    for sched in schedules:
        pred = replayed_step_seconds(sched, split, weight_stages, gas, boundary, grad_bytes, dp, device)
        mem = [stage_memory(rows, parts, s, micro=micro, micro_batches=gas, precision=precision, zero_stage=zero,
                            dp=dp, micro_batches_in_flight=k, ep=ep)["total"] for s, k in enumerate(pred["in_flight"])]
        pred.update(memory_gib=[x / GiB for x in mem], fits=max(mem) <= device.memory)
        for r, k, m in zip(stage_rows, pred["in_flight"], mem):
            r.update({f"{sched.short}_in_flight": k, f"{sched.short}_memory_gib": m / GiB})
        out[sched.name] = pred
    return out


def predict_layout(cfg: ModelConfig, *, stages: int, dp: int, micro: int, gas: int, precision: str, zero: int,
                   checkpointing: bool, text_len: int, device: Device, partition: str = "balanced",
                   freeze: tuple[str, ...] = (), schedule: Schedule | tuple[Schedule, ...] | str = BASELINE,
                   images: int = 1, budget: int = 0, ep: int = 1) -> Layout:
    """The planner's prediction for one layout of cfg, as `mmpipe plan` computes it for that layout
    (images: a row's image slots, `mmpipe plan --max-images`; micro counts rows; budget: the row's vision budget,
    0 its default)."""
    rows = layer_costs(cfg, freeze, text_len, checkpointing, images=images, patches=patch_row(cfg, images, budget))
    return plan_layout(rows, stages=stages, dp=dp, micro=micro, gas=gas, precision=precision, zero=zero,
                       device=device, partition=partition, schedule=schedule, ep=ep)
