"""The links a run uses, measured on its own ranks: point-to-point between consecutive stages of each
pipeline replica at the run's activation size (ping-pong: bandwidth and one-way latency), the
gradient all-reduce of each stage's data-parallel group, and for an MoE model under `--ep N > 1` one
all-to-all across each expert-parallel group of each stage at what one MoE block exchanges per micro-batch.
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

from ..planning.costmodel import Device, tied_repeats
from ..run_config import RunConfig
from ..runtime.feed import decoder_length
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
    """What stage `stage` sends forward per micro-batch: micro x the boundary layer's output (positions x dim)."""
    last = run.layers[run.parts[stage + 1] - 1]
    elems = last.boundary_elems or decoder_length(run) * run.model.text.dim
    return int(run.micro * elems) * DTYPES[run.precision].itemsize


def _p2p(run: RunConfig, topo, dev: torch.device, slow: float) -> list[dict]:
    rows = []
    for d in range(run.dp):
        for s in range(run.stages - 1):
            a, b = topo.get_rank(pipe=s, data=d), topo.get_rank(pipe=s + 1, data=d)
            n = boundary_bytes(run, s) // DTYPES[run.precision].itemsize
            big = _pingpong(a, b, torch.zeros(n, dtype=DTYPES[run.precision], device=dev), slow)
            small = _pingpong(a, b, torch.zeros(1, dtype=DTYPES[run.precision], device=dev), slow)
            dist.barrier()
            rows.append({"kind": "p2p", "name": f"stage {s} -> {s + 1} (ranks {a} <-> {b}, dp {d})", "ranks": [a, b],
                         "bytes": n * DTYPES[run.precision].itemsize, "seconds": big, "latency_s": small})
    return rows


def _allreduce(run: RunConfig, topo, dev: torch.device) -> list[dict]:
    """Per stage, its DP group all-reduces the stage's gradient size (bus bandwidth, NCCL-tests' convention)."""
    rows = []
    if run.dp == 1:
        return rows
    for s in range(run.stages):
        ranks = [topo.get_rank(pipe=s, data=d) for d in range(run.dp)]
        group = dist.new_group(ranks)  # every rank creates every group, in the same order
        stage = run.layers[run.parts[s]:run.parts[s + 1]]
        grads = sum(r.trainable_params for r in stage) - tied_repeats(stage)[1]  # a tied module's gradient once
        n = max(1, min(grads * 4, ALLREDUCE_CAP) // 4)
        dt = None
        if dist.get_rank() in ranks:
            t = torch.zeros(n, dtype=torch.float32, device=dev)
            dt = _timed(lambda: dist.all_reduce(t, group=group), REPS)
        dist.barrier()
        rows.append({"kind": "all-reduce", "name": f"stage {s} dp group (ranks {', '.join(map(str, ranks))})",
                     "ranks": ranks, "bytes": n * 4, "seconds": dt, "latency_s": None,
                     "bus_factor": 2 * (run.dp - 1) / run.dp})
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
    for s in range(run.stages):
        nbytes = all_to_all_bytes(run, s)
        for b in range(run.dp // run.ep):
            ranks = [topo.get_rank(pipe=s, data=b * run.ep + i) for i in range(run.ep)]
            group = dist.new_group(ranks)  # every rank creates every group, in the same order
            if not nbytes:
                continue
            dt = None
            if dist.get_rank() in ranks:
                n = nbytes // DTYPES[run.precision].itemsize
                src = torch.zeros(n, dtype=DTYPES[run.precision], device=dev)
                dst = torch.empty_like(src)
                dt = _timed(lambda: dist.all_to_all_single(dst, src, group=group), REPS)
            dist.barrier()
            rows.append({"kind": "all-to-all", "name": f"stage {s} ep group (ranks {', '.join(map(str, ranks))})",
                         "ranks": ranks, "bytes": nbytes, "seconds": dt, "latency_s": None,
                         "bus_factor": (run.ep - 1) / run.ep})
    return rows


def planned_seconds(row: dict, device: Device | None) -> float | None:
    """The planner's time for a link row's transfer on `device` (mmpipe.planning.layout's arithmetic): p2p bytes /
    link; an all-reduce's bytes x 2 (dp - 1) / dp over the all-reduce link; an all-to-all's bytes x (ep - 1) / ep /
    link (costmodel.all_to_all). E.g. 90,112 B at EP 2 over the CPU's 5 GB/s: 45,056 / 5e9 = 9.0 us."""
    if device is None:
        return None
    link = device.allreduce_link or device.link if row["kind"] == "all-reduce" else device.link
    return row["bytes"] * row.get("bus_factor", 1.0) / link


def measure(run: RunConfig) -> list[dict]:
    """Collective. Each link's row, complete (timed by its first rank) on rank 0; others get []."""
    topo = PipeDataParallelTopology(num_pp=run.stages, num_dp=run.dp)  # the engine's rank layout
    dev, slow = device(), _slow()
    rows = _p2p(run, topo, dev, slow) + _allreduce(run, topo, dev) + _all_to_all(run, topo, dev)
    timed = [None] * dist.get_world_size()
    dist.all_gather_object(timed, [(r["seconds"], r["latency_s"]) for r in rows])
    if dist.get_rank() != 0:
        return []
    planner = planner_device()
    for i, r in enumerate(rows):  # each measurement from the rank that timed it (the pair's first / group's first)
        r["seconds"], r["latency_s"] = timed[r["ranks"][0]][i]
        r["bandwidth"] = r["bytes"] * r.get("bus_factor", 1.0) / r["seconds"]
        r["planned_s"] = planned_seconds(r, planner)
    return judge(rows)


def judge(rows: list[dict]) -> list[dict]:
    floor = FLOOR.get(dist.get_backend(), min(FLOOR.values()))
    for kind in {r["kind"] for r in rows}:
        same = [r for r in rows if r["kind"] == kind]
        median = statistics.median(r["bandwidth"] for r in same)
        for r in same:
            r["ok"] = r["bandwidth"] >= floor and r["bandwidth"] >= MIN_SHARE * median
    return rows
