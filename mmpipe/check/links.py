"""The links a run uses, measured on its own ranks: point-to-point between consecutive stages of each
pipeline replica at the run's activation size (ping-pong: bandwidth and one-way latency), and the
gradient all-reduce of each stage's data-parallel group. Collective: every rank calls `measure`.

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

from ..run_config import RunConfig
from ..runtime.feed import decoder_length
from ..runtime.trainer import DTYPES

SLOW_ENV = "MMPIPE_CHECK_SLOW_RANK"  # test hook: "R:SECONDS", rank R sleeps SECONDS before each of its sends
# bytes/s, named whatever the other links do: NCCL slower than ~10 Gbit Ethernet starves GPU stages; gloo
# (CPU ranks over TCP) measured 48 MB/s between two local ranks on a quiet 2-core machine and down to
# 7.2 MB/s for llava-tiny's small activations on a loaded one, so its floor (a link that is broken, not
# busy) sits below both; a slow pair among fast ones is caught by MIN_SHARE instead
FLOOR = {"nccl": 1e9, "gloo": 1e6}
MIN_SHARE = 0.5  # of the median of the run's links of the same kind
ALLREDUCE_CAP = 256 << 20  # bytes: a stage's gradients, up to this much, are all-reduced
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
        grads = sum(r.trainable_params for r in run.layers[run.parts[s]:run.parts[s + 1]])
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


def measure(run: RunConfig) -> list[dict]:
    """Collective. Each link's row, complete (timed by its first rank) on rank 0; others get []."""
    topo = PipeDataParallelTopology(num_pp=run.stages, num_dp=run.dp)  # the engine's rank layout
    dev, slow = device(), _slow()
    rows = _p2p(run, topo, dev, slow) + _allreduce(run, topo, dev)
    timed = [None] * dist.get_world_size()
    dist.all_gather_object(timed, [(r["seconds"], r["latency_s"]) for r in rows])
    if dist.get_rank() != 0:
        return []
    for i, r in enumerate(rows):  # each measurement from the rank that timed it (the pair's first / group's first)
        r["seconds"], r["latency_s"] = timed[r["ranks"][0]][i]
        r["bandwidth"] = r["bytes"] * r.get("bus_factor", 1.0) / r["seconds"]
    return judge(rows)


def judge(rows: list[dict]) -> list[dict]:
    floor = FLOOR.get(dist.get_backend(), min(FLOOR.values()))
    for kind in {r["kind"] for r in rows}:
        same = [r for r in rows if r["kind"] == kind]
        median = statistics.median(r["bandwidth"] for r in same)
        for r in same:
            r["ok"] = r["bandwidth"] >= floor and r["bandwidth"] >= MIN_SHARE * median
    return rows
