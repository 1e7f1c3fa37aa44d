"""The links a run uses, measured on its own ranks: point-to-point between consecutive stages of each
pipeline replica at the run's activation size (ping-pong: bandwidth and one-way latency), the
gradient all-reduce of each stage's data-parallel group, for an MoE model under `--ep N > 1` one
all-to-all across each expert-parallel group of each stage at what one MoE block exchanges per micro-batch, and
under `--tp N > 1` one all-reduce across each TP group of each stage (the ranks of one (stage, data) coordinate) at
what one split block's row-parallel output is, [micro, positions, D]: the collective a TP block runs 2 forward and 2
backward a micro-batch (docs/tensor_parallel.md), and under `--sp N > 1` each SP group's Ulysses all-to-alls of one
decoder block (q, k, v to heads, the output back to positions: docs/sequence_parallel.md). The ranks are laid out as
the engine's grid lays them (mmpipe.runtime.pipeline.grid_topology, the one place it is built): (pipe, data, model)
under --tp, (pipe, data, seq, model) under --sp with or without --tp (rank = ((pipe x dp + data) x sp + seq) x tp +
model, TP innermost), else PipeDataParallelTopology; a link is measured at every (seq, model) coordinate, the TP
groups along 'model' (one per (stage, data, seq)), the SP groups along 'seq' (one per (stage, data, model)). E.g.
PP 1 x SP 2 x TP 2: TP groups {0, 1}, {2, 3}; SP groups {0, 2}, {1, 3}.
Collective: every rank calls `measure`. Each row carries the planner's time for it (`planned_s`, from the
planner's device for this accelerator, mmpipe.check.loader.planner_device; None where there is none).

Pass rule (docs/check.md): a link fails when its bandwidth is under its backend's FLOOR, or under
MIN_SHARE of the median of the run's links of its kind (a slow pair among fast ones)."""
from __future__ import annotations

import os
import statistics
import time

import torch
import torch.distributed as dist
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe.topology import PipeDataParallelTopology

from ..model.sequence_parallel import _to_heads, _to_positions, padded
from ..model.tensor_parallel import Shard
from ..planning.costmodel import Device, tied_repeats
from ..planning.sequence_parallel import sp_layer_costs, sp_seconds
from ..planning.tensor_parallel import tp_layer_costs
from ..run_config import RunConfig
from ..runtime.feed import decoder_length
from ..runtime.pipeline import grid_topology
from ..runtime.trainer import DTYPES
from .loader import planner_device

SLOW_ENV = "MMPIPE_CHECK_SLOW_RANK"  # test hook: "R:SECONDS", rank R sleeps SECONDS before each of its sends
# bytes/s, named whatever the other links do: NCCL slower than ~10 Gbit Ethernet starves GPU stages; gloo
# (CPU ranks over TCP) measured 48 MB/s between two local ranks on a quiet 2-core machine and down to
# 7.2 MB/s for llava-tiny's small activations on a loaded one, so its floor (a link that is broken, not
# busy) sits below both; a slow pair among fast ones is caught by MIN_SHARE instead
FLOOR = {"nccl": 1e9, "gloo": 1e6}
MIN_SHARE = 0.5  # of the median of the run's links of the same kind
ALLREDUCE_CAP = 256 << 20  # bytes: a stage's gradients, up to this much, are all-reduced
ALL_TO_ALL_CAP = 256 << 20  # bytes: one MoE block's exchange, up to this much, goes round
REPS = 5


def _slow() -> float:
    spec = os.environ.get(SLOW_ENV, "")
    rank, _, seconds = spec.partition(":")
    return float(seconds or 0) if spec and int(rank) == dist.get_rank() else 0.0


def device() -> torch.device:
    """This rank's device: the accelerator's LOCAL_RANK device (cuda:N under NCCL), or the CPU."""
    return torch.device(get_accelerator().device_name(int(os.environ.get("LOCAL_RANK", "0"))))


def _timed_in(ranks: list[int], make) -> float | None:
    """Collective: on the group's ranks the seconds per call of make()'s function (_timed), None elsewhere; then a
    barrier, so the groups are timed one at a time."""
    dt = _timed(make(), REPS) if dist.get_rank() in ranks else None
    dist.barrier()
    return dt


def _timed(fn, reps: int) -> float:
    """Seconds per call of fn after one warm-up call, the device synchronised around the timing."""
    fn()
    get_accelerator().synchronize()
    t0 = time.perf_counter()
    for _ in range(reps):
        fn()
    get_accelerator().synchronize()
    return (time.perf_counter() - t0) / reps


def _pingpong(a: int, b: int, t: torch.Tensor, slow: float) -> float | None:
    """One-way seconds per transfer of t between ranks a and b (on a; b returns None; others skip)."""
    rank = dist.get_rank()
    if rank not in (a, b):
        return None
    peer = b if rank == a else a

    def send():
        time.sleep(slow)
        dist.send(t, peer)

    def round_trip():
        if rank == a:
            send()
            dist.recv(t, peer)
        else:
            dist.recv(t, peer)
            send()
    dt = _timed(round_trip, REPS) / 2
    return dt if rank == a else None


def boundary_bytes(run: RunConfig, stage: int) -> int:
    """What stage `stage` sends forward per micro-batch: micro x the boundary layer's output (positions x dim) and the
    fields carried past it, in bytes as the planner counts them (costmodel's boundary_bytes: an MoE model's moe_stats
    travel as fp32 in every precision, route_stats' dtype, the rest at the precision's)."""
    last = run.layers[run.parts[stage + 1] - 1]
    if last.boundary_elems:
        return int(run.micro * last.boundary_bytes(run.precision))
    return int(run.micro * decoder_length(run) * run.model.text.dim) * DTYPES[run.precision].itemsize


def topology(run: RunConfig):
    """The engine's rank layout (runtime.pipeline.grid_topology; without TP or SP DeepSpeed's own)."""
    return grid_topology(run) or PipeDataParallelTopology(num_pp=run.stages, num_dp=run.dp)


_NAMES = {"seq": "sp", "model": "tp"}  # a grid axis's name in the rows


def _models(topo) -> list[dict]:
    """The coordinates past (pipe, data) a link is measured at: one {"seq": s, "model": m} (the axes the grid has) for
    each SP x TP rank of a stage, else one, {}."""
    axes = [a for a in ("seq", "model") if a in topo.get_axis_names()]
    out = [{}]
    for a in axes:
        out = [dict(at, **{a: i}) for at in out for i in range(topo.get_dim(a))]
    return out


def _model_name(topo, at: dict, skip: str = "") -> str:
    """', sp S, tp M': the axes of `at` wider than 1 but `skip` (a group's own axis)."""
    return "".join(f", {_NAMES[a]} {i}" for a, i in at.items() if a != skip and topo.get_dim(a) > 1)


def _axis_groups(run: RunConfig, topo, axis: str) -> list[tuple[int, int, dict, list[int], object]]:
    """Collective. Per data coordinate, stage and coordinate on the grid's other axis, its group along `axis` ('model':
    the TP ranks of one (stage, data, seq); 'seq': the SP ranks of one (stage, data, model)): (data, stage, the
    coordinate, ranks, group); every rank creates every group, in the same order. None where the axis is 1 wide."""
    if axis not in topo.get_axis_names() or topo.get_dim(axis) == 1:
        return []
    out = []
    for d in range(run.dp):
        for s in range(run.stages):
            for at in (at for at in _models(topo) if at[axis] == 0):
                ranks = [topo.get_rank(pipe=s, data=d, **dict(at, **{axis: i})) for i in range(topo.get_dim(axis))]
                out.append((d, s, at, ranks, dist.new_group(ranks)))
    return out


def _p2p(run: RunConfig, topo, dev: torch.device, slow: float) -> list[dict]:
    rows = []
    for at in _models(topo):  # under --tp / --sp each (SP, TP) rank sends to the same one of the next stage
        for d in range(run.dp):
            for s in range(run.stages - 1):
                a, b = topo.get_rank(pipe=s, data=d, **at), topo.get_rank(pipe=s + 1, data=d, **at)
                n = boundary_bytes(run, s) // DTYPES[run.precision].itemsize
                big = _pingpong(a, b, torch.zeros(n, dtype=DTYPES[run.precision], device=dev), slow)
                small = _pingpong(a, b, torch.zeros(1, dtype=DTYPES[run.precision], device=dev), slow)
                dist.barrier()
                name = f"stage {s} -> {s + 1} (ranks {a} <-> {b}, dp {d}{_model_name(topo, at)})"
                rows.append({"kind": "p2p", "name": name,
                             "ranks": [a, b], "bytes": n * DTYPES[run.precision].itemsize, "seconds": big,
                             "latency_s": small})
    return rows


def _allreduce(run: RunConfig, topo, dev: torch.device) -> list[dict]:
    """Per stage, its DP group all-reduces the stage's gradient size (bus bandwidth, NCCL-tests' convention)."""
    rows = []
    if run.dp == 1:
        return rows
    for at in _models(topo):  # (a TP rank's DP group: its slices' gradients; counted whole, an upper bound)
        for s in range(run.stages):
            ranks = [topo.get_rank(pipe=s, data=d, **at) for d in range(run.dp)]
            group = dist.new_group(ranks)  # every rank creates every group, in the same order
            stage = run.layers[run.parts[s]:run.parts[s + 1]]
            grads = sum(r.trainable_params for r in stage) - tied_repeats(stage)[1]  # a tied module's gradient once
            n = max(1, min(grads * 4, ALLREDUCE_CAP) // 4)
            dt = None
            if dist.get_rank() in ranks:
                t = torch.zeros(n, dtype=torch.float32, device=dev)
                dt = _timed(lambda: dist.all_reduce(t, group=group), REPS)
            dist.barrier()
            rows.append({"kind": "all-reduce",
                         "name": f"stage {s} dp group (ranks {', '.join(map(str, ranks))}{_model_name(topo, at)})",
                         "ranks": ranks, "bytes": n * 4, "seconds": dt, "latency_s": None,
                         "bus_factor": 2 * (run.dp - 1) / run.dp})
    return rows


def _positions(run: RunConfig) -> int:
    """The decoder positions one rank holds: the row's, or under --sp its 1/SP slice of the row padded to a multiple
    of SP (mmpipe.model.sequence_parallel.padded)."""
    return padded(decoder_length(run), Shard(None, 0, run.sp)) // run.sp if run.sp > 1 else decoder_length(run)


def tp_allreduce_bytes(run: RunConfig) -> int:
    """One TP all-reduce of a split block: its row-parallel output, micro x the rank's decoder positions x D x element
    bytes (mmpipe.planning.tensor_parallel.tp_seconds counts 2 forward and 2 backward of these a block and
    micro-batch; under --sp an SP rank's positions, L / SP: the planner's tp_ar_fwd / sp). E.g. llava-tiny at micro 4,
    84 positions, D 64, fp32: 4 x 84 x 64 x 4 = 86,016 B; qwen-tiny at TP 2 x SP 2, micro 4, 88 positions (44 a rank),
    D 64: 4 x 44 x 64 x 4 = 45,056 B."""
    return int(run.micro * _positions(run) * run.model.text.dim) * DTYPES[run.precision].itemsize


def _tp_allreduce(run: RunConfig, topo, dev: torch.device) -> list[dict]:
    """Per stage and data coordinate, its TP group all-reduces one block's output (tp_allreduce_bytes): the ring's
    2 (tp - 1) / tp of the bytes cross each rank's link (bus_factor), the planner's count."""
    rows = []
    if run.tp <= 1:
        return rows
    n = tp_allreduce_bytes(run) // DTYPES[run.precision].itemsize

    def make(group):
        t = torch.zeros(n, dtype=DTYPES[run.precision], device=dev)
        return lambda: dist.all_reduce(t, group=group)
    for d, s, at, ranks, group in _axis_groups(run, topo, "model"):
        dt = _timed_in(ranks, lambda: make(group))
        rows.append({"kind": "tp all-reduce",
                     "name": f"stage {s} tp group (ranks {', '.join(map(str, ranks))}, dp {d}"
                             f"{_model_name(topo, at, 'model')})",
                     "ranks": ranks, "bytes": n * DTYPES[run.precision].itemsize, "seconds": dt,
                     "latency_s": None, "bus_factor": 2 * (run.tp - 1) / run.tp})
    return rows


def sp_shapes(run: RunConfig) -> list[tuple[int, ...]]:
    """Ulysses' four all-to-alls of one decoder block and micro-batch as each SP rank sends them (UlyssesMask:
    DeepSpeed's DistributedAttention; the planner's sp_a2a counts the same): q [micro, L / SP, H, Dh], k and v
    [micro, L / SP, Hkv, Dh] to heads, the output [micro, L, H / SP, Dh] back to positions; L the row padded to a
    multiple of SP. Under --tp the heads a TP rank holds: H / TP, and Hkv / TP (1 where TP does not divide Hkv)
    repeated up to SP where fewer (sequence_parallel.kv_for_sp; the planner's sp_layer_costs). E.g. qwen-tiny (H 4,
    Hkv 2, Dh 16) at micro 2, SP 2, L 88: [2, 44, 4, 16], 2 x [2, 44, 2, 16], [2, 88, 2, 16]: 16,896 elements; at
    TP 2 x SP 2: [2, 44, 2, 16], 2 x [2, 44, 2, 16] (1 kv head repeated for 2 SP ranks), [2, 88, 1, 16]: 11,264."""
    t, sp, tp = run.model.text, run.sp, run.tp
    dh, length = t.dim // t.n_heads, padded(decoder_length(run), Shard(None, 0, sp))
    kv = t.kv_heads // tp if t.kv_heads % tp == 0 else 1
    kv = kv if kv % sp == 0 else sp
    return [(run.micro, length // sp, h, dh) for h in (t.n_heads // tp, kv, kv)] + [
        (run.micro, length, t.n_heads // tp // sp, dh)]


def sp_rows(run: RunConfig) -> list:
    """run.layers as one (SP, TP) rank holds them, the planner's: tp_layer_costs then sp_layer_costs."""
    tp_rows = tp_layer_costs(run.model, run.layers, run.tp, run.sequence_parallel)
    return sp_layer_costs(run.model, tp_rows, run.sp, run.tp)


def sp_block(run: RunConfig, stage: int) -> int | None:
    """The index in run.layers of `stage`'s decoder block with the most all-to-all elements (the planner's sp_a2a at
    the run's SP and TP), None for a stage without one (a tower's stage)."""
    rows = sp_rows(run)
    blocks = [i for i in range(run.parts[stage], run.parts[stage + 1]) if rows[i].sp_a2a]
    return max(blocks, key=lambda i: rows[i].sp_a2a) if blocks else None


def _sp_all_to_all(run: RunConfig, topo, dev: torch.device) -> list[dict]:
    """Per stage with decoder blocks and data coordinate, its SP group runs one block's Ulysses exchange (sp_shapes,
    through mmpipe.model.sequence_parallel's own calls of DeepSpeed's _SeqAllToAll): (sp - 1) / sp of the bytes
    leave each rank (bus_factor); the row names the block whose planned time it is set beside (planned_seconds)."""
    if run.sp <= 1:
        return []
    size = DTYPES[run.precision].itemsize
    nbytes = sum(torch.Size(s).numel() for s in sp_shapes(run)) * size

    def make(group, ranks):
        shard = Shard(group, ranks.index(dist.get_rank()), run.sp)
        q, k, v, o = (torch.zeros(s, dtype=DTYPES[run.precision], device=dev) for s in sp_shapes(run))
        return lambda: (_to_heads(q, shard), _to_heads(k, shard), _to_heads(v, shard), _to_positions(o, shard))
    rows = []
    for d, s, at, ranks, group in _axis_groups(run, topo, "seq"):
        block = sp_block(run, s)
        if block is None:
            continue
        dt = _timed_in(ranks, lambda: make(group, ranks))
        rows.append({"kind": "sp all-to-all",
                     "name": f"stage {s} sp group (ranks {', '.join(map(str, ranks))}, dp {d}"
                             f"{_model_name(topo, at, 'seq')})",
                     "ranks": ranks, "bytes": nbytes, "seconds": dt, "latency_s": None,
                     "bus_factor": (run.sp - 1) / run.sp, "layer": block})
    return rows


def all_to_all_bytes(run: RunConfig, stage: int) -> int:
    """One all-to-all of one MoE block of `stage`, per micro-batch (mmpipe.model.moe.Experts.exchange; the size
    mmpipe.planning.costmodel.all_to_all counts, two of them each way): micro x positions x top_k x D x element
    bytes, rounded down to a multiple of ep elements (equal splits); 0 for a stage without MoE blocks. E.g. the MoE
    pipeline test's model, 88 positions x top 2 x D 64 at micro 2, fp32: 2 x 11,264 x 4 = 90,112 B."""
    elems = max((r.a2a_elems for r in run.layers[run.parts[stage]:run.parts[stage + 1]]), default=0.0)
    size = DTYPES[run.precision].itemsize
    n = min(int(run.micro * elems), ALL_TO_ALL_CAP // size) // run.ep * run.ep
    return n * size


def _all_to_all(run: RunConfig, topo, dev: torch.device) -> list[dict]:
    """Per stage with MoE blocks, each EP group (the --ep consecutive DP ranks mmpipe.runtime.experts.shard_experts
    groups) exchanges one block's rows with torch's all_to_all_single, equal splits: (ep - 1) / ep of the bytes
    leave each rank (bus_factor, as the planner counts them)."""
    rows = []
    if run.ep <= 1:
        return rows
    for at, s in ((at, s) for at in _models(topo) for s in range(run.stages)):  # EP groups per (SP, TP) coordinate
        nbytes = all_to_all_bytes(run, s)
        for b in range(run.dp // run.ep):
            ranks = [topo.get_rank(pipe=s, data=b * run.ep + i, **at) for i in range(run.ep)]
            group = dist.new_group(ranks)  # every rank creates every group, in the same order
            if not nbytes:
                continue
            dt = _timed_in(ranks, lambda: _exchange(nbytes // DTYPES[run.precision].itemsize, run.precision, dev,
                                                    group))
            rows.append({"kind": "all-to-all", "name": f"stage {s} ep group (ranks {', '.join(map(str, ranks))})",
                         "ranks": ranks, "bytes": nbytes, "seconds": dt, "latency_s": None,
                         "bus_factor": (run.ep - 1) / run.ep})
    return rows


def _exchange(n: int, precision: str, dev: torch.device, group):
    src = torch.zeros(n, dtype=DTYPES[precision], device=dev)
    dst = torch.empty_like(src)
    return lambda: dist.all_to_all_single(dst, src, group=group)


def planned_seconds(row: dict, device: Device | None, run: RunConfig) -> float | None:
    """The planner's time for a link row's transfer on `device` (mmpipe.planning.layout's arithmetic): p2p bytes /
    link; an all-reduce's bytes x 2 (dp - 1) / dp over the all-reduce link; an all-to-all's bytes x (ep - 1) / ep /
    link (costmodel.all_to_all); a TP all-reduce's bytes x 2 (tp - 1) / tp / link (planning.tensor_parallel.tp_seconds:
    TP stays inside a node); an SP all-to-all row's block's forward exchange, the planner's own sp_seconds of it (one
    (SP, TP) rank's row of run.layers[row["layer"]], sp_rows). E.g. 90,112 B at EP 2 over the CPU's 5 GB/s:
    45,056 / 5e9 = 9.0 us."""
    if device is None:
        return None
    if row["kind"] == "sp all-to-all":
        block = sp_rows(run)[row["layer"]]
        return sp_seconds([block], [0, 1], run.micro, run.precision, run.sp, device)[0][0]
    link = device.allreduce_link or device.link if row["kind"] == "all-reduce" else device.link
    return row["bytes"] * row.get("bus_factor", 1.0) / link


def measure(run: RunConfig) -> list[dict]:
    """Collective. Each link's row, complete (timed by its first rank) on rank 0; others get []."""
    topo = topology(run)  # the engine's rank layout
    dev, slow = device(), _slow()
    rows = (_p2p(run, topo, dev, slow) + _allreduce(run, topo, dev) + _all_to_all(run, topo, dev)
            + _tp_allreduce(run, topo, dev) + _sp_all_to_all(run, topo, dev))
    timed = [None] * dist.get_world_size()
    dist.all_gather_object(timed, [(r["seconds"], r["latency_s"]) for r in rows])
    if dist.get_rank() != 0:
        return []
    planner = planner_device()
    for i, r in enumerate(rows):  # each measurement from the rank that timed it (the pair's first / group's first)
        r["seconds"], r["latency_s"] = timed[r["ranks"][0]][i]
        r["bandwidth"] = r["bytes"] * r.get("bus_factor", 1.0) / r["seconds"]
        r["planned_s"] = planned_seconds(r, planner, run)
    return judge(rows)


def judge(rows: list[dict]) -> list[dict]:
    floor = FLOOR.get(dist.get_backend(), min(FLOOR.values()))
    for kind in {r["kind"] for r in rows}:
        same = [r for r in rows if r["kind"] == kind]
        median = statistics.median(r["bandwidth"] for r in same)
        for r in same:
            r["ok"] = r["bandwidth"] >= floor and r["bandwidth"] >= MIN_SHARE * median
    return rows
