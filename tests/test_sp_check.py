"""`mmpipe check --sp N` (issue 58 deliver 5, docs/sequence_parallel.md): each stage's SP group times one decoder
block's Ulysses all-to-alls (q, k, v to heads, the output back to positions) beside the planner's time for them, and
the equivalence check runs the SP pipeline against the single-device loop."""
from __future__ import annotations

import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import write_ds_config
from forked_ranks import check_rank
from mmpipe.check import links
from mmpipe.check.loader import planner_device
from mmpipe.data.dataset import prepare
from mmpipe.planning.sequence_parallel import sp_layer_costs, sp_seconds
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve

FLAGS = ["--preset", "qwen-tiny", "--stages", "1", "--sp", "2", "--steps", "1"]


def _argv(tmp: Path) -> list[str]:
    """FLAGS at micro 4 x GAS 2, AdamW at a constant 5e-4 (no warm-up: step 1 updates), clip 1.0."""
    cfg = write_ds_config(tmp / "ds.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                          scheduler=None)
    return [*FLAGS, "--ds-config", str(cfg), "--output-dir", str(tmp / "run")]


def _links_worker(rank: int, tmp: str, argv: list[str]) -> None:
    """SP rank `rank` of a PP=1 x SP=2 run (forked, gloo): `mmpipe check`'s link measurement and its equivalence, then
    the equivalence again with the once-a-step gradient sum over SP planted out (each rank steps on its positions'
    share); rank 0 writes the rows and both verdicts."""
    from mmpipe.check import equivalence
    from mmpipe.runtime import pipeline
    args, run = check_rank(rank, 2, tmp, argv)
    rows = links.measure(run)
    good = equivalence.check(run, args, rank, torch.device("cpu"))
    pipeline.sum_gradients_at_step = lambda engine, shard: None  # this child's module: no undo
    broken = equivalence.check(run, args, rank, torch.device("cpu"))
    if rank == 0:
        Path(tmp, "links.json").write_text(json.dumps({"rows": rows, "good": good, "broken": broken}))
    dist.barrier()
    os._exit(0)


def test_check_times_the_sp_all_to_all_and_runs_the_equivalence(tmp_path):
    """qwen-tiny PP=1 x SP=2 (GQA: 4 query heads, 2 KV heads): one row, the stage's SP group, timed, its bytes the
    planner's count of one block's exchange (sp_a2a elements a sample x micro), its planned time that block's
    forward all-to-all seconds (sp_seconds of its row). Its equivalence at SP 2: 3 steps against the
    single-device loop (the loss, the stage's gradient norm: SP rank 0's, every weight replicated) pass at fp32's
    1e-5 / 1e-4; with the SP gradient sum planted out the norm is off and it fails. By hand, `mmpipe check --preset
    qwen-tiny --stages 1 --sp 2 --steps 1` prints this row (docs/sequence_parallel.md)."""
    argv = _argv(tmp_path)
    args = TrainArgs.from_argv(argv)
    run = resolve(args, world_size=2)
    prepare(run.data, run.model, tmp_path / "run", args.seed, verbose=False)  # the index, as the front door builds it
    mp.start_processes(_links_worker, args=(str(tmp_path), argv), nprocs=2, start_method="fork")
    got = json.loads((tmp_path / "links.json").read_text())
    rows = got["rows"]
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
    # the block's own forward all-to-all (sp_seconds of its row: (SP - 1) / SP of the bytes / link), not the stage's,
    # which since eab59a5 adds the split tower's all-gather
    forward = sp_seconds([blocks[0]], [0, 1], run.micro, run.precision, 2, planner_device())[0][0]
    assert r["planned_s"] == pytest.approx(forward, rel=1e-12) == r["bytes"] * (2 - 1) / 2 / planner_device().link
    good, broken = got["good"], got["broken"]
    assert good["ok"] and good["steps"] == 3, good
    assert good["max_loss_rel_diff"] <= 1e-5 and good["max_grad_norm_rel_diff"] <= 1e-4, good
    assert good["worst_grad_norm"]["where"] == "stage 0"  # fp32, ZeRO 0: the stage's norm, over its SP ranks
    assert good["losses"]["pipeline"][2] != good["losses"]["pipeline"][0]  # it trained
    assert not broken["ok"] and broken["max_grad_norm_rel_diff"] > 1e-2, broken
    assert abs(broken["losses"]["pipeline"][0] - good["losses"]["pipeline"][0]) < 1e-6  # forward unchanged
