"""--schedule dualpipev (mmpipe.runtime.dualpipev): DeepSpeed's own DualPipeVModule / DualPipeVEngine over
mmpipe's layer list. One launch: llava-tiny, packed rows, PP=2 (2 x 2 stages in a V: rank 0 holds the vision
tower and the LM head with its tied embedding) equals the single-device reference (fp32, losses and weights
1e-5, 3 updates at a constant LR, every trained tensor moved) and sends floats only. In-process: the planner's
DualPipeV order is DeepSpeed's DualPipeVSchedule's, its unit-time bubble, the V's split balancing each rank's pair
of stages, and the refusals."""
from __future__ import annotations

import itertools
import random

import pytest
from deepspeed.runtime.pipe import schedule as ds

from conftest import assert_weights_moved, refused, train_run, write_ds_config
from mmpipe.model.builder import ReferenceModel
from mmpipe.planning.orders import dualpipev_orders, one_f_one_b_orders, zb_h1_orders
from mmpipe.planning.partition import compute_parts
from mmpipe.planning.schedule_registry import DUALPIPEV, schedule_named
from mmpipe.planning.schedules import predict
from mmpipe.planning.vpairs import pair_loads, v_pair_split
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference

TOL = 1e-5
STEPS = 3
SEED = 4


def _args(cfg, *extra: str) -> list[str]:
    return ["--preset", "llava-tiny", "--ds-config", str(cfg), "--pack", "--text-len", "40", "--eval-samples", "0",
            "--seed", str(SEED), "--steps", str(STEPS), "--data-workers", "0", *extra]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    # GAS 4 = 2 x 2 ranks, DualPipeV's least; no scheduler: the optimizer's own LR from step 1, so 3 updates
    return write_ds_config(tmp_path_factory.mktemp("cfg") / "dpv.json", train_micro_batch_size_per_gpu=2,
                           gradient_accumulation_steps=4, scheduler=None)


def test_pp2_packed_equals_single_device_reference(cfg, tmp_path_factory):
    out = tmp_path_factory.mktemp("dpv")
    run = train_run(out / "pp2", *_args(cfg, "--stages", "2", "--schedule", "dualpipev")).check()
    s = run.summary
    assert s["stages"] == 2 and len(s["parts"]) == 2 * 2 + 1  # 4 stages: rank 0 holds 0 and 3, rank 1 1 and 2
    assert s["data"]["samples_seen"] > s["data"]["rows_seen"] == STEPS * 2 * 4  # several samples a row
    # floats only on the wire; rank 0 sends per micro-batch its phase-0 output and its loss stage's input gradient
    run.assert_only_floats_crossed(per_forward=2)
    ref_run = resolve(TrainArgs.from_argv(_args(cfg, "--stages", "1", "--output-dir", str(out / "ref"))),
                      world_size=1)
    ref_model, ref_losses = train_reference(ref_run, seed=SEED, steps=STEPS, out_dir=str(out / "ref"))
    assert list(run.losses.values()) == pytest.approx(ref_losses, abs=TOL)
    trained = load_reference(run.out / "checkpoints", ref_run.model)
    ref_state = ref_model.state_dict()
    diffs = {k: (v - ref_state[k]).abs().max().item() for k, v in trained.state_dict().items()}
    assert max(diffs.values()) < TOL, max(diffs.items(), key=lambda kv: kv[1])
    # it trained: every tensor moved > 10 x TOL from the seed's init, but the CLIP tower's key biases (no rotary:
    # softmax cancels their gradient; they moved 4.6e-7 and 1.1e-6 here, rounding)
    assert_weights_moved(trained, ReferenceModel(ref_run.model, seed=SEED), TOL, no_gradient=("self_attn.k_proj.bias",))


def _ds_sequence(p: int, m: int, rank: int) -> list[tuple[str, int, int]]:
    """DeepSpeed's DualPipeVSchedule for one rank: its ForwardPass / BackwardPass as (kind, phase, micro-batch)."""
    out = []
    for cmds in ds.DualPipeVSchedule(micro_batches=m, stages=p, stage_id=rank).steps():
        for c in cmds:
            if isinstance(c, (ds.ForwardPass, ds.BackwardPass)):
                buf = c.buffer_id  # phase x m + micro-batch
                out.append(("F" if isinstance(c, ds.ForwardPass) else "B", c.kwargs["phase"], buf % m))
    return out


@pytest.mark.parametrize("p,m", [(1, 2), (2, 4), (2, 5), (3, 6), (3, 8), (4, 8), (4, 16)])
def test_planner_order_is_deepspeeds_dualpipev_schedule(p, m):
    """The order the planner times is the one DeepSpeed runs, op for op on every rank; each phase of a rank
    runs every micro-batch's F and B once, F before B."""
    orders = dualpipev_orders(p, m, [True] * p)
    for r in range(p):
        assert [(op.kind, op.phase, op.mb) for op in orders[r]] == _ds_sequence(p, m, r), (p, m, r)
        for phase in (0, 1):
            ops = [op for op in orders[r] if op.phase == phase]
            assert sorted(op.mb for op in ops if op.kind == "F") == list(range(m))
            assert sorted(op.mb for op in ops if op.kind == "B") == list(range(m))


def test_unit_time_bubble_against_1f1b_and_zb_h1():
    """A rank's F = 1, B = 2 per micro-batch (its two stages half each): DualPipeV idles 2p - 2.5 units for any
    m (1F1B: 3(p - 1), ZB-H1's order: 2p - 3); p = 2, m = 4: 13.5 against 15 and 13, bound 12."""
    def span(orders):
        return max(o[-1].end for o in orders)
    for p in (2, 3, 4):
        for m in (2 * p, 8, 16):
            v = dualpipev_orders(p, m, [True] * p)
            assert span(v) - 3 * m == pytest.approx(2 * p - 2.5), (p, m)
            assert span(one_f_one_b_orders(p, m, [True] * p)) - 3 * m == 3 * (p - 1)
            assert span(zb_h1_orders(p, m, [True] * p)) - 3 * m == 2 * p - 3
    # the planner's prediction is that order timed with the stages' seconds; a slower last rank stretches it
    assert predict(DUALPIPEV, 4, [(1, 1, 1)] * 2, [True] * 2)["makespan"] == 13.5
    assert predict(DUALPIPEV, 4, [(1, 1, 1), (2, 2, 2)], [True] * 2)["makespan"] > 13.5 + 4 * 3 * 0.5


def test_refusals(tmp_path, capsys, cfg):
    """Bad input gets one line each: too few micro-batches for DeepSpeed's DualPipeV (>= 2 x stages), a model DualPipeV
    cannot split into 2 x stages parts, validation and an MoE model (not wired for the V); the record knows its module
    and engine."""
    assert schedule_named("dualpipev") is DUALPIPEV and DUALPIPEV.engine == "DualPipeVEngine"
    few = write_ds_config(tmp_path / "few.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=3)
    lines = refused(["--output-dir", str(tmp_path / "a"), *_args(few, "--stages", "2", "--schedule", "dualpipev")],
                    capsys)
    assert lines == ["mmpipe: error: --schedule dualpipev: gradient_accumulation_steps 3 < 2 x 2 stages; DeepSpeed's "
                     "DualPipeVEngine needs at least 4 micro-batches per step"]
    gas16 = write_ds_config(tmp_path / "g16.json", train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=16)
    lines = refused(["--output-dir", str(tmp_path / "b"), *_args(gas16, "--stages", "8", "--schedule", "dualpipev")],
                    capsys)
    assert len(lines) == 1 and lines[0].endswith("(--schedule dualpipev cuts 2 x 8 ranks = 16 stages)"), lines
    for extra, why in ((["--eval-data", "shapes", "--eval-samples", "4"], "validation (--eval-data / --eval-split)"),
                       (["--preset", "qwen3-vl-30b-a3b"], "an MoE model's expert groups and reduction")):
        lines = refused(["--output-dir", str(tmp_path / "c"), *_args(cfg, "--stages", "2", "--schedule", "dualpipev"),
                         *extra], capsys)
        assert len(lines) == 1 and lines[0].startswith(f"mmpipe: error: --schedule dualpipev: {why}"), lines


def test_v_pair_split_is_the_least_largest_rank_load():
    """v_pair_split's largest rank load (stage r + stage 2p - 1 - r) is the least any split has (all splits tried,
    random weights); and on qwen3-vl-tiny with the tower frozen it is what `mmpipe train --schedule dualpipev` cuts,
    more even over the ranks than the per-stage min-max split (max / mean rank load 1.028 against 1.132)."""
    rnd = random.Random(1)
    for _ in range(60):
        p = rnd.choice([1, 2, 3])
        w = [rnd.choice([0.5, 1, 2, 3, 6, 8]) for _ in range(rnd.randint(2 * p, 9))]
        best = min(max(pair_loads(w, [0, *c, len(w)])) for c in itertools.combinations(range(1, len(w)), 2 * p - 1))
        b = v_pair_split(w, p)
        assert len(b) == 2 * p + 1 and b[0] == 0 and b[-1] == len(w) and all(x < y for x, y in zip(b, b[1:]))
        assert max(pair_loads(w, b)) == pytest.approx(best), (w, p, b)
    assert v_pair_split([1, 1, 4, 4, 1, 1], 2) == [0, 1, 2, 3, 6]  # ranks 7, 5; per stage [0, 2, 3, 4, 6]: 4, 8
    run = resolve(TrainArgs.from_argv(["--preset", "qwen3-vl-tiny", "--stages", "2", "--schedule", "dualpipev",
                                       "--pack", "--freeze", "vision"]), world_size=2)
    flops = [r.flops for r in run.layers]
    per_stage = compute_parts(run.layers, 4, "balanced")
    assert run.parts == compute_parts(run.layers, 4, "balanced", None, 2) != per_stage

    def spread(parts):
        loads = pair_loads(flops, parts)
        return max(loads) / (sum(loads) / len(loads))
    assert spread(run.parts) < 1.03 < 1.13 < spread(per_stage)
