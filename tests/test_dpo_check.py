"""`mmpipe check --objective dpo` (issue 56, deliver 5): the equivalence check runs DPO's live reference on both sides
(the pipeline's reference pass through both stages before each step; the single-device loop's frozen copy), so
pipeline == one device holds for DPO as for SFT, and a reference pass that is wrong fails it. Two forked gloo ranks
in-process (no launcher): llava-tiny PP=2, packed pairs."""
from __future__ import annotations

import contextlib
import json
import math
import os
from pathlib import Path

import torch.multiprocessing as mp

from conftest import write_ds_config
from mmpipe.data.dataset import prepare
from mmpipe.data.export import export_shapes
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve


def _argv(pairs: Path, cfg: Path, out: Path) -> list[str]:
    return ["--preset", "llava-tiny", "--stages", "2", "--objective", "dpo", "--beta", "0.5", "--data", str(pairs),
            "--pack", "--text-len", "24", "--ds-config", str(cfg), "--output-dir", str(out), "--eval-samples", "0",
            "--seed", "3"]  # --text-len 24: llava-tiny's 64 positions then hold 2 slots, 2 pairs a row (48: one)


def _check_rank(rank: int, store: str, argv: list[str], out: str) -> None:
    """One of two ranks: the equivalence check as is, then with the pipeline's reference pass planted to run the
    current policy's weights (a reference that moves with the policy); rank 0 writes both verdicts."""
    os.environ.update(OMP_NUM_THREADS="1", RANK=str(rank), LOCAL_RANK=str(rank), WORLD_SIZE="2")
    import deepspeed
    import torch.distributed as dist

    from mmpipe.check import equivalence
    from mmpipe.runtime import preference, trainer
    trainer.setup_torch()  # one thread before any op: a forked child must not enter the parent's OpenMP pool
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    deepspeed.init_distributed()
    args = TrainArgs.from_argv(argv)
    run = resolve(args, world_size=2)
    import torch
    good = equivalence.check(run, args, rank, torch.device("cpu"))
    preference.LiveReference.weights = lambda self: contextlib.nullcontext()  # this child's own class: no undo
    moved = equivalence.check(run, args, rank, torch.device("cpu"))
    if rank == 0:
        Path(out).write_text(json.dumps({"good": good, "moved": moved}))
    dist.destroy_process_group()


def test_check_runs_dpo_with_its_reference(tmp_path):
    """The check of a dpo run passes (3 steps, losses and each stage's gradient norm within fp32's 1e-5 / 1e-4 of the
    single-device loop), step 1's loss is ln 2 (policy == reference) and later steps move off it; planted, a
    reference pass that runs the policy's own weights gives ln 2 at every step and the check fails on the loss."""
    pairs = export_shapes(tmp_path / "pairs", "dpo-jsonl", 24)
    cfg = write_ds_config(tmp_path / "ds.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2,
                          scheduler=None, optimizer={"type": "AdamW", "params": {
                              "lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-5, "weight_decay": 0.0, "torch_adam": True}})
    argv = _argv(pairs, cfg, tmp_path / "run")
    run = resolve(TrainArgs.from_argv(argv), world_size=2)
    prepare(run.data, run.model, tmp_path / "run", 3, verbose=False)  # the index, as the front door builds it
    out = tmp_path / "verdicts.json"
    mp.start_processes(_check_rank, args=(str(tmp_path / "store"), argv, str(out)), nprocs=2, start_method="fork")
    got = json.loads(out.read_text())
    good, moved = got["good"], got["moved"]
    assert good["ok"] and good["steps"] == 3, good
    assert good["max_loss_rel_diff"] <= 1e-5 and good["max_grad_norm_rel_diff"] <= 1e-4, good
    assert good["worst_grad_norm"]["where"].startswith("stage ")  # fp32, no ZeRO: each stage's norm compared
    pipe, loop = good["losses"]["pipeline"], good["losses"]["reference"]
    assert abs(pipe[0] - math.log(2)) < 1e-6 and all(abs(x - math.log(2)) > 1e-3 for x in loop[1:]), good
    assert not moved["ok"] and moved["max_loss_rel_diff"] > 1e-3, moved
    assert all(abs(x - math.log(2)) < 1e-6 for x in moved["losses"]["pipeline"]), moved  # its own weights: z = 0
