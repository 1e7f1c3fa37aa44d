"""`mmpipe check --tp T --sp S` (issues 54 and 58; docs/check.md): on the engine's 4-axis grid (pipe, data, seq, model;
runtime.pipeline.grid_topology) each stage's TP groups (along 'model', one per SP rank) time one split block's
all-reduce and its SP groups (along 'seq', one per TP rank) one decoder block's Ulysses all-to-alls at the heads a TP
rank holds, each beside the planner's time; the equivalence check runs the TP x SP pipeline against the single-device
loop, each stage's gradient norm summed over its SP x TP ranks (the marks count SP rank 0's TP shares only)."""
from __future__ import annotations

import dataclasses
import json
import os
from pathlib import Path

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import write_ds_config
from forked_ranks import check_rank
from mmpipe.check import links, memory
from mmpipe.check.loader import planner_device
from mmpipe.data.dataset import prepare
from mmpipe.planning.sequence_parallel import sp_layer_costs, sp_seconds
from mmpipe.planning.tensor_parallel import tp_layer_costs
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve

FLAGS = ["--preset", "qwen-tiny", "--stages", "1", "--tp", "2", "--sp", "2", "--steps", "1"]


def _argv(tmp: Path) -> list[str]:
    """FLAGS at micro 4 x GAS 2, AdamW at a constant 5e-4 (no warm-up: step 1 updates), clip 1.0."""
    cfg = write_ds_config(tmp / "ds.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                          scheduler=None)
    return [*FLAGS, "--ds-config", str(cfg), "--output-dir", str(tmp / "run")]


def _worker(rank: int, tmp: str, argv: list[str]) -> None:
    """Rank `rank` of a PP=1 x SP=2 x TP=2 run's 4 (forked, gloo): `mmpipe check`'s link measurement and its
    equivalence, then the equivalence again with the once-a-step gradient sum over SP planted out (each SP rank steps
    on its positions' share); rank 0 writes the rows and both verdicts."""
    from mmpipe.check import equivalence
    from mmpipe.runtime import pipeline
    args, run = check_rank(rank, 4, tmp, argv)
    mem = memory.check(run, args, rank, torch.device("cpu"))  # --full-step's, first (as check.rank runs it)
    build = memory.build_engine

    def unsplit(*a):  # the planted fault: rank 1 keeps the whole of its largest sliced weight beside its slice
        engine = build(*a)
        if rank == 1:
            p = max(engine.module.parameters(), key=lambda p: p.numel())
            engine.module.register_parameter("whole", torch.nn.Parameter(torch.zeros(2 * p.shape[0], *p.shape[1:])))
        return engine

    memory.build_engine = unsplit  # this child's module: no undo
    whole = memory.check(run, args, rank, torch.device("cpu"))
    rows = links.measure(run)
    good = equivalence.check(run, args, rank, torch.device("cpu"))
    pipeline.sum_gradients_at_step = lambda engine, shard: None  # this child's module: no undo
    broken = equivalence.check(run, args, rank, torch.device("cpu"))
    if rank == 0:
        Path(tmp, "check.json").write_text(json.dumps({"rows": rows, "good": good, "broken": broken,
                                                             "memory": mem, "whole": whole}))
    dist.barrier()
    os._exit(0)


@pytest.fixture(scope="module")
def tp_x_sp(tmp_path_factory):
    """One launch of the 4 forked ranks (_worker) for both tests: (the run, what rank 0 wrote)."""
    tmp = tmp_path_factory.mktemp("tp_x_sp")
    argv = _argv(tmp)
    args = TrainArgs.from_argv(argv)
    run = resolve(args, world_size=4)
    prepare(run.data, run.model, tmp / "run", args.seed, verbose=False)  # the index, as the front door builds it
    mp.start_processes(_worker, args=(str(tmp), argv), nprocs=4, start_method="fork")
    return run, json.loads((tmp / "check.json").read_text())


def test_check_runs_tp_x_sp_links_and_equivalence(tp_x_sp):
    """qwen-tiny PP=1 x SP=2 x TP=2 (4 query heads, 2 KV heads: 2 and 1 a TP rank, the KV head repeated for the 2 SP
    ranks): two TP rows ({0, 1} at SP 0, {2, 3} at SP 1), each all-reducing [micro, L / SP, D] beside the ring's
    planned time, and two SP rows ({0, 2} at TP 0, {1, 3} at TP 1), each exchanging the planner's sp_a2a elements of
    one block at TP 2 x SP 2, planned at the forward all-to-all seconds of that block. Its equivalence: 3 steps
    against the single-device loop pass at fp32's 1e-5 / 1e-4 (the stage's norm over its 4 ranks); with the SP gradient
    sum planted out the norm is off and it fails, the first step's loss unchanged. By hand, `mmpipe check --preset
    qwen-tiny --tp 2 --sp 2` prints these rows (docs/check.md)."""
    run, got = tp_x_sp
    rows = {r["name"]: r for r in got["rows"]}
    assert sorted(rows) == ["stage 0 sp group (ranks 0, 2, dp 0, tp 0)", "stage 0 sp group (ranks 1, 3, dp 0, tp 1)",
                            "stage 0 tp group (ranks 0, 1, dp 0, sp 0)", "stage 0 tp group (ranks 2, 3, dp 0, sp 1)"]
    cpu, t = planner_device(), run.model.text
    costs = sp_layer_costs(run.model, tp_layer_costs(run.model, run.layers, 2), 2, 2)
    blocks = [c for c in costs if c.sp_a2a]
    assert len(blocks) == t.n_layers and all(c.sp_a2a == blocks[0].sp_a2a for c in blocks)
    length = blocks[0].tokens  # the row's decoder positions, a multiple of SP here (no padding)
    assert length % 2 == 0
    for name in ("stage 0 tp group (ranks 0, 1, dp 0, sp 0)", "stage 0 tp group (ranks 2, 3, dp 0, sp 1)"):
        r = rows[name]  # an SP rank's half of the row, all D wide, fp32
        assert r["kind"] == "tp all-reduce" and r["seconds"] > 0 and "ok" in r, r  # (its verdict: load-bound)
        assert r["bytes"] == run.micro * length // 2 * t.dim * 4
        assert r["planned_s"] == pytest.approx(r["bytes"] * 2 * (2 - 1) / 2 / cpu.link)
    dh = t.dim // t.n_heads
    for name in ("stage 0 sp group (ranks 0, 2, dp 0, tp 0)", "stage 0 sp group (ranks 1, 3, dp 0, tp 1)"):
        r = rows[name]  # q and the output: 2 heads of the TP rank; k and v: its 1 kv head repeated to 2 (kv_for_sp)
        assert r["kind"] == "sp all-to-all" and r["seconds"] > 0 and "ok" in r, r
        assert r["bytes"] == run.micro * length // 2 * (2 * 2 * dh + 2 * 2 * dh) * 4
        assert r["bytes"] == run.micro * blocks[0].sp_a2a * 4
        # the planner's forward all-to-all seconds of that block (sp_seconds): (SP - 1) / SP of the bytes / link
        assert r["planned_s"] == pytest.approx(sp_seconds([blocks[0]], [0, 1], run.micro, "fp32", 2, cpu)[0][0])
        assert r["planned_s"] == pytest.approx(r["bytes"] * (2 - 1) / 2 / cpu.link)
    good, broken = got["good"], got["broken"]
    print(f"\nTP 2 x SP 2 equivalence: loss {good['max_loss_rel_diff']:.1e}, "
          f"norm {good['max_grad_norm_rel_diff']:.1e}; SP sum planted out: norm {broken['max_grad_norm_rel_diff']:.1e}")
    assert good["ok"] and good["steps"] == 3, good
    assert good["max_loss_rel_diff"] <= 1e-5 and good["max_grad_norm_rel_diff"] <= 1e-4, good
    assert good["worst_grad_norm"]["where"] == "stage 0"  # fp32, ZeRO 0: the stage's norm, over its SP x TP ranks
    assert good["losses"]["pipeline"][2] != good["losses"]["pipeline"][0]  # it trained
    assert not broken["ok"] and broken["max_grad_norm_rel_diff"] > 1e-2, broken
    assert abs(broken["losses"]["pipeline"][0] - good["losses"]["pipeline"][0]) < 1e-6  # forward unchanged


def test_check_memory_at_tp_x_sp(tp_x_sp):
    """`mmpipe check --full-step` at TP 2 x SP 2: one step of the full qwen-tiny on the 4 ranks, each rank's peak beside
    the planner's one rank of the layout (memory.rank_rows: tp_layer_costs' slices, sp_layer_costs' L / SP positions)
    under check's CPU rule (x 3 + 256 MiB), and each rank's parameter bytes equal to the planner's weights (1%): a
    TP rank holds half of each split weight. With rank 1 keeping a whole weight beside its slice the memory check
    fails naming rank 1 only, though its process peak is still far under the CPU slack."""
    run, got = tp_x_sp
    mem, whole = got["memory"], got["whole"]
    states = memory.predicted_states(run)
    (stage,) = states
    whole_run = memory.predicted_states(dataclasses.replace(run, tp=1, sp=1))[0]
    assert stage["weights"] < 0.75 * whole_run["weights"]  # the split weights halved, the norms and tower whole
    # the decoder's L / 2 positions (its split part / 2 again); the tower's one image a row is one SP rank's, whole
    assert stage["activations"] < whole_run["activations"]
    print(f"\nTP 2 x SP 2 memory, rank: predicted {stage['total'] / 2**20:.2f} MiB (weights {stage['weights']} B, "
          f"activations {stage['activations']:.0f} B; TP 1 x SP 1 {whole_run['total'] / 2**20:.2f} MiB), measured "
          f"{[round(r['measured'] / 2**20, 1) for r in mem['ranks']]} MiB, weights "
          f"{[r['weights'] for r in mem['ranks']]} B; planted: {whole['error']}")
    assert mem["ok"] and mem["ran"] and mem["predicted_bytes"] == [stage["total"]], mem
    assert [r["rank"] for r in mem["ranks"]] == [0, 1, 2, 3]
    for r in mem["ranks"]:
        assert r["weights"] == pytest.approx(stage["weights"], rel=memory.WEIGHTS_TOLERANCE), r
        assert r["weights_ok"] and r["ok"] and r["measured"] > 0, r
    assert not whole["ok"], whole
    assert [r["rank"] for r in whole["ranks"] if not r["ok"]] == [1]
    assert whole["error"].startswith("rank 1 (stage 0) holds ") and "at tp 2 x sp 2" in whole["error"], whole["error"]
    bad = whole["ranks"][1]
    assert bad["measured"] <= bad["predicted"] * memory.TOLERANCE["cpu"] + memory.SLACK["cpu"]  # the peak cannot see it
