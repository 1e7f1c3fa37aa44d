"""`mmpipe check --sp N` (issue 58 deliver 5, docs/sequence_parallel.md): each stage's SP group times one decoder
block's Ulysses all-to-alls (q, k, v to heads, the output back to positions) beside the planner's time for them."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmpipe.check import links
from mmpipe.check.loader import planner_device
from mmpipe.planning.sequence_parallel import sp_layer_costs, sp_seconds
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve

FLAGS = ["--preset", "qwen-tiny", "--stages", "1", "--sp", "2", "--steps", "1"]


def _links_worker(rank: int, tmp: str, run) -> None:
    """SP rank `rank` of a PP=1 x SP=2 run (forked, gloo): `mmpipe check`'s link measurement; rank 0 writes its rows."""
    from deepspeed.comm import comm as ds_comm
    from deepspeed.comm.torch import TorchBackend
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    ds_comm.cdb = TorchBackend("gloo", ds_comm.default_pg_timeout, None)  # (the check's ranks: deepspeed's own init)
    rows = links.measure(run)
    if rank == 0:
        Path(tmp, "links.json").write_text(json.dumps(rows))
    dist.barrier()
    os._exit(0)


def test_check_times_the_sp_all_to_all_against_its_plan(tmp_path):
    """qwen-tiny PP=1 x SP=2 (GQA: 4 query heads, 2 KV heads): one row, the stage's SP group, timed, its bytes the
    planner's count of one block's exchange (sp_a2a elements a sample x micro), its planned time the stage's
    forward all-to-all seconds (sp_seconds) over its decoder blocks. By hand, `mmpipe check --preset qwen-tiny
    --stages 1 --sp 2 --steps 1` prints this row (docs/sequence_parallel.md)."""
    run = resolve(TrainArgs.from_argv(FLAGS), world_size=2)  # once, here: the forked ranks inherit it
    mp.start_processes(_links_worker, args=(str(tmp_path), run), nprocs=2, start_method="fork")
    rows = json.loads((tmp_path / "links.json").read_text())
    assert [r["name"] for r in rows] == ["stage 0 sp group (ranks 0, 1, dp 0)"], rows
    r = rows[0]
    costs = sp_layer_costs(run.model, run.layers, 2)
    blocks = [c for c in costs if c.sp_a2a]
    assert len(blocks) == run.model.text.n_layers and all(c.sp_a2a == blocks[0].sp_a2a for c in blocks)
    t = run.model.text  # q and the output [L / 2, D], k and v [L / 2, kv] a sample, fp32
    kv = t.dim // t.n_heads * t.kv_heads
    assert r["bytes"] == run.micro * costs[r["layer"]].tokens // 2 * (2 * t.dim + 2 * kv) * 4
    assert r["bytes"] == run.micro * blocks[0].sp_a2a * 4
    assert r["kind"] == "sp all-to-all" and r["seconds"] > 0 and r["ok"]
    forward = sp_seconds(costs, run.parts, run.micro, run.precision, 2, planner_device())[0][0]
    assert r["planned_s"] == pytest.approx(forward / len(blocks), rel=1e-12)
