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
    Shape,
    all_to_all,
    layer_costs,
    pair_image_rows,
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
from .sequence_parallel import cuts_tower, replicated_rows, sp_layer_costs, sp_seconds, sp_stage_rows
from .tensor_parallel import tp_layer_costs, tp_seconds

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
    tp: int = 1  # tensor-parallel ranks of each stage (`--tp`): its rows are one TP rank's (planning.tensor_parallel)
    sp: int = 1  # sequence-parallel ranks of each stage (`--sp`): its rows one SP rank's (planning.sequence_parallel)

    @property
    def throughput(self) -> float:
        return 0.0 if not self.step else (self.micro * self.gas * self.dp) / self.step["step_s"]


@dataclass(frozen=True)
class Training:
    """How a layout trains, beside its Shape: precision, ZeRO stage and device; the schedule(s) to predict (a record,
    records, or a name in schedule_registry.SCHEDULE_NAMES or 'both'); how the stages are cut ('balanced' / 'best':
    the min-max split that also fits device.memory, what `mmpipe plan` searches; 'uniform', 'parameters' or
    boundaries '3,7': as `mmpipe train` cuts them, whatever the memory says); and what the layers' costs take
    (checkpointing, frozen groups: costmodel.layer_costs, for predict_layout)."""
    precision: str
    zero: int
    device: Device
    schedule: Schedule | tuple[Schedule, ...] | str = BASELINE
    partition: str = "balanced"
    checkpointing: bool = False
    freeze: tuple[str, ...] = ()
    # --objective dpo's reference: "live" runs a forward-only pipeline pass before each step and holds a copy of each
    # stage's trained tensors (reference_pass_seconds, costmodel.reference_copy_bytes); "" / "precomputed": nothing
    reference: str = ""
    # `mmpipe plan --data`: the data's rows (planning.data_rows.RowLoad); each stage's seconds x its busiest DP
    # rank's cost over the mean row's (the rows' layer table is the mean row's); None: uniform rows
    load: object = None


def reference_pass_seconds(times: list[tuple[float, float]], gas: int, boundary_bytes: list[float],
                           device: Device) -> float:
    """dpo's live reference pass before each step: DeepSpeed's eval_batch, forwards alone through the pipeline,
    (m + P - 1) slots of the slowest stage's forward, its activations' send and the per-slot overhead. E.g. P = 2,
    m = 4, forwards 1 s, free p2p: 5 s, on top of 1F1B's 5 x 3 s = 15 s (forward + backward 3 s)."""
    slot = max(f for f, _ in times) + max(boundary_bytes, default=0.0) / device.link + device.microbatch_overhead
    return (gas + len(times) - 1) * slot


def _stage_rows(rows: list[LayerCost], parts: list[int], times, a2a: list[dict], shape: Shape,
                precision: str, zero: int, reference: bool = False) -> list[dict]:
    """Each stage's row of a layout: its layers, parameters, memory (stage_memory at the shape, precision and ZeRO
    stage) and times; an MoE model's (a2a: all_to_all's per stage) also the rank's own parameters (1 / ep of the
    experts) and its all-to-all per micro-batch."""
    out = []
    for s, ((a, b), (f, bw)) in enumerate(zip(zip(parts, parts[1:]), times)):
        mem = stage_memory(rows, parts, s, shape, precision, zero, reference=reference)
        out.append({"stage": s, "layers": [a, b - 1], "first": rows[a].name, "last": rows[b - 1].name,
                    "params": stage_params(rows[a:b]), "memory_gib": mem["total"] / GiB,
                    "activations_gib": mem["activations"] / GiB, "forward_ms": f * 1e3, "backward_ms": bw * 1e3})
        if a2a:
            experts = sum(r.expert_params for r in rows[a:b])
            out[-1].update(rank_params=out[-1]["params"] - experts + experts / shape.ep,
                           a2a_mib=2 * a2a[s]["bytes"] / 2 ** 20, a2a_ms=2 * a2a[s]["seconds"] * 1e3)
    return out


def plan_layout(rows: list[LayerCost], shape: Shape, training: Training, measured: dict | None = None) -> Layout:
    """One layout, predicted. shape.ep: an MoE model's expert-parallel ranks (`--ep`, dividing dp): each rank holds
    1 / ep of the experts' weights, gradients and optimizer states (costmodel.rank_state_bytes) and each MoE block
    adds its all-to-alls to the stage's forward and backward (costmodel.all_to_all); the step dict then carries
    a2a_s (the slowest stage's all-to-all seconds per micro-batch, forward + backward) and a2a_share (their share
    of the step: slots x a2a_s / step_s). training.partition: 'balanced' (or 'best') is the min-max split that also
    fits device.memory (what `mmpipe plan` searches); any other method is cut as `mmpipe train` cuts it.
    training.schedule: the record(s) to predict (the split is the same: it is chosen with 1F1B's memory). The Layout
    names the one `step` is for. measured: --profile's layer times at this micro-batch."""
    parts = _split(rows, shape, training)
    if isinstance(parts, Layout):  # no split: the reason
        return parts
    rows = sp_stage_rows(rows, parts)  # at SP: the tower split where one stage holds it, else whole on every rank
    t = training
    a2a = _exchange(rows, parts, shape, t)
    times = _loaded(stage_seconds(rows, parts, shape.micro, t.device, measured), parts, shape, t)
    if a2a:  # the exchange waits on the critical path: forward's two all-to-alls, backward's two
        times = [(f + x["seconds"], bw + x["seconds"]) for (f, bw), x in zip(times, a2a)]
    tp = tp_seconds(rows, parts, shape.micro, t.precision, shape.tp, t.device)
    if shape.tp > 1:  # each block waits on its all-reduces: Megatron's two forward, two backward
        times = [(f + x, bw + y) for (f, bw), (x, y) in zip(times, tp)]
    sp = sp_seconds(rows, parts, shape.micro, t.precision, shape.sp, t.device)
    if shape.sp > 1:  # each decoder block waits on its Ulysses all-to-alls: q, k, v and the output, each way
        times = [(f + x, bw + y) for (f, bw), (x, y) in zip(times, sp)]
    stage_rows = _stage_rows(rows, parts, times, a2a, shape, t.precision, t.zero, t.reference == "live")
    if shape.tp > 1:
        for r, (x, y) in zip(stage_rows, tp):
            r.update(tp_ms=(x + y) * 1e3)
    if shape.sp > 1:
        for r, (x, y) in zip(stage_rows, sp):
            r.update(sp_ms=(x + y) * 1e3)
    boundary, grad_bytes = _transfers(rows, parts, shape, t.precision)
    step = pipeline_step_seconds(times, shape.gas, boundary, grad_bytes, shape.dp * shape.sp, t.device)
    if t.reference == "live":  # dpo: the reference pass runs before every step, on its critical path
        step["reference_s"] = reference_pass_seconds(times, shape.gas, boundary, t.device)
        step["step_s"] += step["reference_s"]
    # a schedule that cannot run this many micro-batches (DualPipeV: GAS >= 2 x PP, DeepSpeed's) is not predicted
    ask = [s for s in asked(t.schedule) if shape.gas >= s.min_micro_per_rank * shape.stages]
    if not ask:
        sched = asked(t.schedule)[0]
        return Layout(stages=shape.stages, dp=shape.dp, micro=shape.micro, gas=shape.gas, parts=parts,
                      stage_rows=[], step=None, schedule=sched.name, ep=shape.ep, tp=shape.tp, sp=shape.sp,
                      reason=f"{sched} needs GAS >= {sched.min_micro_per_rank} x {shape.stages} stages")
    replayed = [s for s in ask if s is not BASELINE]
    own = _replayed(replayed, rows, parts, stage_rows, shape, t, measured) if replayed else {}
    for pred in [step, *own.values()] if a2a else []:
        pred.update(_a2a_share(pred, times, a2a, shape.gas))
    predictions = {s.name: own[s.name] if s in replayed else step for s in ask}
    for pred in predictions.values() if t.load is not None else []:  # the data's rows (--data): what they cost
        pred["rows"] = t.load.summary(parts, shape.dp, shape.micro)
    fitting = [s for s in ask if predictions[s.name].get("fits", True)]  # the baseline's split was cut to fit
    lay = dict(stages=shape.stages, dp=shape.dp, micro=shape.micro, gas=shape.gas, parts=parts, stage_rows=stage_rows,
               predictions=predictions, ep=shape.ep, tp=shape.tp, sp=shape.sp)
    if not fitting:  # the one schedule asked for holds more micro-batches than memory takes
        sched, mem = ask[0], own[ask[0].name]["memory_gib"]
        s = max(range(shape.stages), key=lambda i: mem[i])
        return Layout(**lay, step=None, schedule=sched.name,
                      reason=f"{sched} holds {own[sched.name]['in_flight'][s]} micro-batches on stage {s}: "
                             f"{mem[s]:.1f} GiB > {t.device.memory / GiB:.0f} GiB")
    chosen = min(fitting, key=lambda s: predictions[s.name]["step_s"])  # a tie: the earlier, the baseline
    return Layout(**lay, step=predictions[chosen.name], schedule=chosen.name)


def _loaded(times: list[tuple], parts: list[int], shape: Shape, training: Training) -> list[tuple]:
    """Each stage's (forward, backward[, W]) seconds a micro-batch x its busiest DP rank's cost over the mean row's
    (training.load: `mmpipe plan --data`, planning.data_rows), unchanged for uniform rows (None)."""
    if training.load is None:
        return times
    k = training.load.factors(parts, shape.dp, shape.micro)
    return [tuple(x * f for x in stage) for stage, f in zip(times, k)]


def _split(rows: list[LayerCost], shape: Shape, training: Training) -> list[int] | Layout:
    """The layout's stage boundaries as training.partition cuts them ('balanced': the min-max split whose every
    stage fits the device's memory), or a Layout saying why there are none. At SP with the tower split
    (LayerCost.replicated) the balanced split is the better of two: the best keeping the tower on one stage (its
    split costs) and the best over any cut at the replicated tower's costs (exact for a cut inside it, an upper
    bound otherwise), each priced as sp_stage_rows runs it."""
    units, t, stages = trainable_units(rows), training, shape.stages
    none = dict(stages=stages, dp=shape.dp, micro=shape.micro, gas=shape.gas, parts=None, stage_rows=[], step=None,
                ep=shape.ep, tp=shape.tp, sp=shape.sp)
    if stages > len(units):
        return Layout(**none, reason=f"only {len(units)} groups of layers hold a trainable parameter")
    if t.partition not in ("balanced", "best", ""):
        return compute_parts(rows, stages, t.partition)
    tower = any(r.replicated is not None for r in rows)
    found = [p for p in ([_balanced(rows, shape, t, True), _balanced(replicated_rows(rows), shape, t, False)]
                         if tower else [_balanced(rows, shape, t, False)]) if p is not None]
    if found:
        return min(found, key=lambda p: _bottleneck(sp_stage_rows(rows, p), p))  # a tie: the first (tower whole)
    whole = stage_memory(rows, [0, len(rows)], 0, shape, t.precision, t.zero, reference=t.reference == "live")
    whole = whole["total"]
    need = (f"it needs {whole / GiB:.1f} GiB" if stages == 1 else
            f"an even share would be ~{whole / stages / GiB:.1f} GiB")
    return Layout(**none, reason=f"no split fits {t.device.memory / GiB:.0f} GiB ({need})")


def _balanced(rows: list[LayerCost], shape: Shape, t: Training, keep_tower: bool) -> list[int] | None:
    """The min-max split of rows whose every stage fits the device's memory (keep_tower: and holds all of the split
    tower or none of it: cuts_tower), or None."""
    units, stages = trainable_units(rows), shape.stages
    ranges = RangeMemory(rows, t.precision, micro=shape.micro, micro_batches=shape.gas, zero_stage=t.zero,
                         dp=shape.dp, ep=shape.ep, reference=t.reference == "live")  # stage_memory of a range

    def fits(s, i, j):  # stage s = the layers of units i..j-1
        a, b = units[i][0], units[j - 1][-1] + 1
        return ranges.total(a, b, s, stages) <= t.device.memory and not (keep_tower and cuts_tower(rows, a, b))
    try:
        return compute_parts(rows, stages, "balanced", fits)
    except ConfigError:
        return None


def _bottleneck(rows: list[LayerCost], parts: list[int]) -> float:
    """The largest stage's FLOPs (the balanced split's measure)."""
    return max(sum(r.flops for r in rows[a:b]) for a, b in zip(parts, parts[1:]))


def _exchange(rows: list[LayerCost], parts: list[int], shape: Shape, training: Training) -> list[dict]:
    """An MoE model's all-to-all per stage (costmodel.all_to_all); [] for a dense model (no a2a_elems)."""
    if not any(r.a2a_elems for r in rows):
        return []
    return all_to_all(rows, parts, shape.micro, training.precision, shape.ep, training.device)


def _transfers(rows: list[LayerCost], parts: list[int], shape: Shape, precision: str) -> tuple[list[float], float]:
    """(each boundary's activation bytes a micro-batch, the largest stage's all-reduce bytes: _ring_bytes)."""
    boundary = [rows[b - 1].boundary_bytes(precision) * shape.micro for b in parts[1:-1]]
    grad = max(_ring_bytes(rows[a:b], shape.dp, shape.ep) for a, b in zip(parts, parts[1:])) * BYTES[precision]
    return boundary, grad


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


def _replayed(schedules: list[Schedule], rows: list[LayerCost], parts: list[int], stage_rows: list[dict],
              shape: Shape, training: Training, measured: dict | None) -> dict[str, dict]:
    """name -> the step of each schedule predicted by replaying its order (costmodel.replayed_step_seconds),
    with its memory at the micro-batches its order holds in flight (ZB-H1: up to P on every stage with W,
    1F1B: P - s), stage by stage; each stage row gains its B and W seconds and each schedule's memory."""
    t = training
    split = _loaded(stage_split_seconds(rows, parts, shape.micro, t.device, measured), parts, shape, t)
    a2a = _exchange(rows, parts, shape, t)
    if a2a:  # the exchange in F and in B (the input gradients need the returned rows), none in W
        split = [(f + x["seconds"], b + x["seconds"], w) for (f, b, w), x in zip(split, a2a)]
    if shape.tp > 1:  # TP's all-reduces: forward's in F, the input gradients' in B
        tp = tp_seconds(rows, parts, shape.micro, t.precision, shape.tp, t.device)
        split = [(f + x, b + y, w) for (f, b, w), (x, y) in zip(split, tp)]
    if shape.sp > 1:  # SP's all-to-alls: forward's in F, the input gradients' in B
        sp = sp_seconds(rows, parts, shape.micro, t.precision, shape.sp, t.device)
        split = [(f + x, b + y, w) for (f, b, w), (x, y) in zip(split, sp)]
    weight_stages = [any(r.w_flops for r in rows[a:b]) for a, b in zip(parts, parts[1:])]
    for r, (_, b, w) in zip(stage_rows, split):
        r.update(input_backward_ms=b * 1e3, weight_backward_ms=w * 1e3)
    boundary, grad_bytes = _transfers(rows, parts, shape, t.precision)
    out = {}
    for sched in schedules:
        pred = replayed_step_seconds(sched, split, weight_stages, shape.gas, boundary, grad_bytes, shape.dp * shape.sp,
                                     t.device)
        mem = [stage_memory(rows, parts, s, shape, t.precision, t.zero, k, t.reference == "live")["total"]
               for s, k in enumerate(pred["in_flight"])]
        if t.reference == "live":  # the same reference pass before the step, whatever the step's schedule
            pred["reference_s"] = reference_pass_seconds([(f, b + w) for f, b, w in split], shape.gas, boundary,
                                                         t.device)
            pred["step_s"] += pred["reference_s"]
        pred.update(memory_gib=[x / GiB for x in mem], fits=max(mem) <= t.device.memory)
        for r, k, m in zip(stage_rows, pred["in_flight"], mem):
            r.update({f"{sched.short}_in_flight": k, f"{sched.short}_memory_gib": m / GiB})
        out[sched.name] = pred
    return out


def predict_layout(cfg: ModelConfig, shape: Shape, training: Training, text_len: int, images: int = 1,
                   budget: int = 0) -> Layout:
    """The planner's prediction for one layout of cfg, as `mmpipe plan` computes it for that layout
    (images: a row's image slots, `mmpipe plan --max-images`; micro counts rows; budget: the row's vision budget,
    0 its default)."""
    t = training
    rows = layer_costs(cfg, t.freeze, text_len, t.checkpointing, images=images, patches=patch_row(cfg, images, budget))
    # dpo: a sharing family's tower once a pair, under --sp too (plan.pair_rows)
    rows = pair_image_rows(cfg, rows) if t.reference else rows
    # at TP > 1 one TP rank's rows, at SP > 1 one SP rank's of those
    return plan_layout(sp_layer_costs(cfg, tp_layer_costs(cfg, rows, shape.tp), shape.sp, shape.tp, images), shape, t)
