"""--schedule zb-h1 (mmpipe.runtime.schedule): the order is deadlock-free, bounded in memory and shorter
than 1F1B's; in real runs it gives the single-device reference's losses and weights (fp32, 1e-5) at PP=2 x
DP=2 (chosen in the DeepSpeed JSON, with activation checkpointing; against one replica accumulating twice) and
at PP=4 with --freeze vision; the reference is what 1F1B is tested equal to in
tests/test_pipeline_equivalence.py (and, two replicas as one at twice the GAS, in tests/test_packing.py),
computed here in-process instead of a second launch; with bf16 / fp16 + ZeRO-1, which the fp32 reference
loop does not cover, it gives 1F1B's; a bad value is refused."""
from __future__ import annotations

import itertools
import json

import pytest
from deepspeed.accelerator import get_accelerator
from deepspeed.runtime.pipe import schedule as ds

from conftest import assert_weights_moved, refused, write_ds_config
from mmpipe.config import load_preset
from mmpipe.model import ReferenceModel
from mmpipe.planning.schedule_registry import BASELINE, ONE_F_ONE_B, SCHEDULES, ZB_H1, schedule_named
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference
from mmpipe.runtime.schedule import OrderSchedule, install, simulate, stage_orders
from rank_series import launch_series
from test_pipeline_equivalence import _max_weight_diff, assert_vision_frozen
from test_precision import half_unmovable
from test_qwen_pipeline import frozen_prefixes

TOL = 1e-5
STEPS = 4


def _run_stream(streams):
    """Execute every stage's instruction stream with blocking-p2p semantics (a send and its receive
    complete together, neither before both stages have reached them); returns the number of rounds.
    Raises on deadlock or a receive that does not match the next send."""
    pos = [0] * len(streams)
    rounds = 0
    while any(pos[i] < len(s) for i, s in enumerate(streams)):
        rounds += 1
        moved = False
        for i, s in enumerate(streams):
            while pos[i] < len(s) and s[pos[i]][1] in ("F", "B", "W"):
                pos[i] += 1
                moved = True
        for i, s in enumerate(streams):
            if pos[i] >= len(s):
                continue
            _, kind, mb = s[pos[i]]
            if kind.startswith("send"):
                j = i + 1 if kind == "send_act" else i - 1
                want = "recv_act" if kind == "send_act" else "recv_grad"
                if pos[j] < len(streams[j]) and streams[j][pos[j]][1:] == (want, mb):
                    pos[i] += 1
                    pos[j] += 1
                    moved = True
        assert moved, f"deadlock at {pos}"
    return rounds


@pytest.mark.parametrize("p,m", list(itertools.product([1, 2, 3, 4], [1, 2, 3, 4, 5, 8, 9])))
def test_zb_h1_order_is_complete_bounded_and_deadlock_free(p, m):
    for weights in itertools.product([True, False], repeat=p):
        orders = stage_orders(p, m, weights)
        for i, order in enumerate(orders):
            kinds = ["F", "B", "W"] if weights[i] else ["F", "B"]
            assert sorted((op.kind, op.mb) for op in order) == sorted((k, mb) for k in kinds for mb in range(m))
            done = {k: 0 for k in kinds}
            for n, op in enumerate(order):
                assert op.mb == done[op.kind]  # each kind in micro-batch order
                done[op.kind] += 1
                # memory: at most p micro-batches between their forward and their last backward op
                assert done["F"] - done[kinds[-1]] <= p
                if i == p - 1 and op.kind == "F":  # the last stage's loss is consumed by the very next B
                    assert order[n + 1].kind == "B" and order[n + 1].mb == op.mb
        schedules = [OrderSchedule(m, p, i, weights, ZB_H1) for i in range(p)]
        _run_stream([s.stream for s in schedules])
        for s in schedules:
            assert s.buffers <= max(2, p)
        assert simulate(p, m, weights)["makespan"] <= simulate(p, m, weights, split=False)["makespan"]


def test_zb_h1_shortens_the_unit_timeline():
    # F = B = W = 1: 1F1B (m + p - 1) x 3; ZB-H1 3m + (p - 1), the paper's (p - 1)(F + B - W) bubble
    assert simulate(2, 4, [True, True], split=False)["makespan"] == 15
    assert simulate(2, 4, [True, True])["makespan"] == 13
    assert simulate(2, 8, [True, True])["makespan"] == 25
    assert simulate(4, 4, [True] * 4)["makespan"] == 15
    assert simulate(4, 8, [True] * 4)["makespan"] == 29  # 1F1B: 33; the no-bubble bound: 24


def _compute(schedule) -> list[tuple[str, int | None]]:
    """A PipeSchedule's compute instructions per step, in order: (kind, micro-batch where it says)."""
    return [(type(c).__name__, c.kwargs.get("micro_batch_id")) for cmds in schedule.steps() for c in cmds
            if isinstance(c, (ds.ForwardPass, ds.BackwardPass))]


def test_every_schedule_runs_from_its_record_and_an_unknown_name_is_refused():
    """A record's order is all the runtime needs: the one translator (OrderSchedule) turns any record's
    order into a complete, deadlock-free instruction stream, so a new schedule is a record, no engine
    code. 1F1B stays DeepSpeed's own TrainSchedule (install leaves the engine alone), and its order put
    through the translator gives TrainSchedule's own forward / backward sequence on every stage."""
    for sched in (s for s in SCHEDULES if s.stages_per_rank == 1):  # DualPipeV runs DeepSpeed's own: test_dualpipev
        for p, m in [(1, 3), (2, 4), (3, 5), (4, 8)]:
            weights = [True] * p
            streams = [OrderSchedule(m, p, i, weights, sched) for i in range(p)]
            _run_stream([s.stream for s in streams])
            for s in streams:
                kinds = [k for k, _ in _compute(s)]
                assert kinds.count("ForwardPass") == m
                split = ["BackwardInput", "BackwardWeight"] if sched.split_backward else ["BackwardPass"]
                assert all(kinds.count(k) == m for k in split) and set(kinds) == {"ForwardPass", *split}
    for p, m in itertools.product([1, 2, 3, 4], [1, 2, 3, 4, 5, 8]):
        for i in range(p):
            ours = [k for k, _ in _compute(OrderSchedule(m, p, i, [True] * p, ONE_F_ONE_B))]
            assert ours == [k for k, _ in _compute(ds.TrainSchedule(m, p, i))], (p, m, i)
    assert BASELINE.deepspeed_native and install(None, BASELINE) is None  # the engine untouched
    assert not ZB_H1.deepspeed_native and str(ZB_H1) == "zb-h1" and schedule_named("zb-h1") is ZB_H1
    with pytest.raises(ValueError, match=r"unknown schedule 'gpipe' \(valid: 1f1b, zb-h1, dualpipev\)"):
        schedule_named("gpipe")


def _args(cfg, schedule, *extra):
    flag = ["--schedule", schedule] if schedule else []  # None: the config's pipeline.schedule
    return ["--preset", "tiny", "--ds-config", str(cfg), "--steps", str(STEPS), "--eval-samples", "0", "--seed", "3",
            *flag, *extra]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    d = tmp_path_factory.mktemp("cfg")
    return write_ds_config(d / "sched.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4,
                           scheduler=SCHED)


# steps 2-4 at lr 5e-5, 2.75e-4, ~5e-4 (step 1 at 0): 3 updates that move every weight > 1e-4 (issue 59)
SCHED = {"type": "WarmupCosineLR", "params": {"total_num_steps": "auto", "warmup_num_steps": 2,
                                              "warmup_type": "linear", "warmup_min_ratio": 0.1}}


def _pair(tmp_path_factory, name, cfg, *extra):
    """The same run under 1f1b and zb-h1, one launch (tests/rank_series.py: one run after the other in the same
    ranks, each as `mmpipe train` runs it)."""
    schedules = ("1f1b", "zb-h1")
    runs = launch_series([(tmp_path_factory.mktemp(f"{name}-{s}") / "run", _args(cfg, s, *extra), {})
                          for s in schedules])
    runs = {s: r.check() for s, r in zip(schedules, runs)}
    assert "mmpipe: schedule zb-h1:" in runs["zb-h1"].proc.stdout
    return runs


def _assert_split(run) -> None:
    """zb-h1 really split the backward: B and W per micro-batch on a stage with trainable linears, and
    only the hidden state crossed the boundaries."""
    run.assert_only_floats_crossed()
    calls = [r["calls_per_step"] for r in run.summary["stage_timing"]["per_stage"]]
    gas = run.summary["gradient_accumulation"]
    assert any(c["backward"] == 2 * gas for c in calls), calls


def _zb_args(cfg, *extra, zb_cfg=None) -> list[str]:
    """The zb-h1 run's flags (zb_cfg: a config whose pipeline.schedule picks it, no flag)."""
    return _args(zb_cfg, None, *extra) if zb_cfg else _args(cfg, "zb-h1", *extra)


PP4 = ("--stages", "4", "--freeze", "vision")
DP2 = ("--stages", "2", "--dp", "2")


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory, cfg):
    """The two zb-h1 runs of 4 ranks, one launch (tests/rank_series.py): PP=4 with the tower frozen, and PP=2 x DP=2
    with zb-h1 and activation checkpointing chosen in the JSON (zb.json; gas8.json, its reference's config: one
    replica at twice the GAS)."""
    root = tmp_path_factory.mktemp("zb4")
    zb = json.loads(cfg.read_text())
    zb["pipeline"].update(schedule="zb-h1", activation_checkpoint_interval=1)
    (root / "zb.json").write_text(json.dumps(zb))
    gas8 = json.loads(cfg.read_text())
    gas8["gradient_accumulation_steps"] *= 2
    (root / "gas8.json").write_text(json.dumps(gas8))
    pp4, dp2 = launch_series([(root / "pp4", _zb_args(cfg, *PP4), {}),
                              (root / "dp2", _zb_args(cfg, *DP2, zb_cfg=root / "zb.json"), {})])
    return {"pp4": pp4, "dp2": dp2, "gas8": root / "gas8.json"}


def _assert_equals_reference(zb, cfg, *extra, ref_cfg=None):
    """The zb-h1 run `zb` (of _zb_args(cfg, *extra)) against the fp32 single-device reference of the same run
    (ref_cfg: its config, when not cfg): losses and weights at 1e-5."""
    zb.check()
    assert "mmpipe: schedule zb-h1:" in zb.proc.stdout
    _assert_split(zb)
    flags = dict(zip(extra[::2], extra[1::2]), **{"--stages": "1"})  # the same run on one device
    flags.pop("--dp", None)  # one replica: ref_cfg accumulates the replicas' micro-batches
    argv = _args(ref_cfg or cfg, "1f1b", *(x for kv in flags.items() for x in kv))
    run = resolve(TrainArgs.from_argv(argv), world_size=1)
    ref_model, ref_losses = train_reference(run, seed=3, steps=STEPS)
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-3  # it trained
    assert sorted(zb.losses) == list(range(1, STEPS + 1))
    for step, ref in enumerate(ref_losses, start=1):
        assert zb.losses[step] == pytest.approx(ref, abs=TOL), step
    trained = load_reference(zb.out / "checkpoints", run.model)
    assert _max_weight_diff(trained, ref_model, skip_key_bias=True) < TOL
    # and compares training (steps 2-4 at lr > 0; issue 59): every trained tensor moved > 10 x TOL
    assert_weights_moved(trained, ReferenceModel(run.model, seed=3), TOL, frozen_prefixes(ref_model, extra))
    return zb


def _assert_same(runs, tol=TOL, weight_tol=TOL, half=False):
    a, b = runs["1f1b"], runs["zb-h1"]
    a.assert_only_floats_crossed()  # the hidden state alone, either schedule
    _assert_split(b)
    la, lb = a.losses, b.losses
    assert sorted(la) == sorted(lb) == list(range(1, STEPS + 1))
    for step in la:
        assert lb[step] == pytest.approx(la[step], abs=tol), step
    assert abs(la[STEPS] - la[1]) > 1e-3  # it trained
    cfg = load_preset("tiny")
    sa = load_reference(a.out / "checkpoints", cfg).state_dict()
    sb = load_reference(b.out / "checkpoints", cfg).state_dict()
    diff = max((sa[k].float() - sb[k].float()).abs().max().item() for k in sa)
    assert diff <= weight_tol
    # SCHED's 3 updates (~8e-4 of AdamW movement) moved each tensor > 1e-4, but, in bf16 / fp16 (half), those whose
    # stored value they need not change (test_precision.half_unmovable: the norms' weights at 1.0)
    init = ReferenceModel(cfg, seed=3).state_dict()
    assert_weights_moved(sa, init, TOL, no_gradient=half_unmovable(init) if half else ())
    return sa, sb


def test_pp2_bf16_zero1_equal(tmp_path_factory, tmp_path):
    bf = write_ds_config(tmp_path / "bf.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4,
                         bf16={"enabled": True}, zero_optimization={"stage": 1}, scheduler=SCHED)
    # measured bit-identical here: W runs the same bf16 matmul autograd would, and its result reaches
    # ZeRO-1's fp32 accumulators through the same gradient hook, in the same micro-batch order
    _assert_same(_pair(tmp_path_factory, "bf16", bf, "--stages", "2"), half=True)


@pytest.mark.skipif(not get_accelerator().is_fp16_supported(),
                    reason=f"this {get_accelerator().device_name()} has no fp16 kernels (DeepSpeed refuses fp16)")
def test_pp2_fp16_zero1_equal(tmp_path_factory, tmp_path):
    fp = write_ds_config(tmp_path / "fp.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4,
                         fp16={"enabled": True, "initial_scale_power": 16}, zero_optimization={"stage": 1},
                         scheduler=SCHED)
    runs = _pair(tmp_path_factory, "fp16", fp, "--stages", "2")
    _assert_same(runs, tol=1e-2, weight_tol=1e-2, half=True)
    assert runs["zb-h1"].summary["skipped_steps"] == runs["1f1b"].summary["skipped_steps"]


def test_pp4_freeze_vision_equal(four_rank_runs, cfg):
    """4 stages, the vision tower frozen: stages whose linears take no gradient run F and B only."""
    zb = _assert_equals_reference(four_rank_runs["pp4"], cfg, *PP4)
    assert_vision_frozen(zb, seed=3)  # the tower bit-identical, the projector trained


def test_pp2_dp2_schedule_from_the_json_with_activation_checkpointing_equal(four_rank_runs, cfg):
    """One launch, three guarantees: pipeline.schedule in the DeepSpeed JSON picks zb-h1 (no flag);
    activation_checkpoint_interval recomputes each layer's forward inside the split backward; and two
    replicas at GAS 4 train on the same samples per step as one at GAS 8 (micro-batch m of replica d is
    the slice m x 2 + d), so the reference at GAS 8 is the DP=2 run's. zb-h1 without checkpointing, fp32:
    test_pp4_freeze_vision_equal (and, at PP=2, test_pp2_bf16_zero1_equal's bf16 pair). (The run shares its
    launch with test_pp4_freeze_vision_equal's: four_rank_runs.)"""
    run = _assert_equals_reference(four_rank_runs["dp2"], cfg, *DP2, ref_cfg=four_rank_runs["gas8"])
    assert run.summary["dp"] == 2


def test_bad_schedule_refused(tmp_path, capsys, cfg):
    lines = refused(["--output-dir", str(tmp_path), *_args(cfg, "gpipe")], capsys)
    assert lines == ["mmpipe: error: --schedule: 'gpipe' is not a schedule (valid: 1f1b, zb-h1, dualpipev)"]


def test_schedule_from_the_config(tmp_path, capsys, cfg):
    bad = write_ds_config(tmp_path / "bad.json", pipeline={"stages": 2, "schedule": "zb-h3"})
    lines = refused(["--output-dir", str(tmp_path / "o"), "--preset", "tiny", "--ds-config", str(bad),
                     "--steps", "1"], capsys)
    assert "pipeline.schedule: 'zb-h3' is not a schedule" in "\n".join(lines)
