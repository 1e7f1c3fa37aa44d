"""--schedule dualpipev (mmpipe.runtime.dualpipev): DeepSpeed's own DualPipeVModule / DualPipeVEngine over
mmpipe's layer list. Launches: llava-tiny, packed rows, PP=2 (2 x 2 stages in a V: rank 0 holds the vision tower and
the LM head with its tied embedding) equals the single-device reference (fp32, losses and weights 1e-5, 3 updates at
a constant LR, every trained tensor moved) and sends floats only; its checkpoints (one a step) resume: under
DualPipeV bit for bit (cut after step 2) and under 1F1B (cut after step 1: another layer-to-rank map; weights carried,
moments restarted, said so). Two launches of 2 ranks (tests/rank_series.py): the PP=2 run with the --init-from
test's two runs, then the two resumes.
tests/test_dualpipev_layouts.py: PP=4, qwen3-vl-tiny, frozen tower, LoRA, validation. In-process: the planner's
DualPipeV order is DeepSpeed's DualPipeVSchedule's, its unit-time bubble, the V's split balancing each rank's pair
of stages, `mmpipe plan`'s V-pair split, and the refusals."""
from __future__ import annotations

import itertools
import json
import random
import re
from pathlib import Path

import pytest
import torch
from deepspeed.runtime.pipe import schedule as ds

from conftest import Run, assert_weights_moved, cut_at, refused, write_checkpoint, write_ds_config
from mmpipe.cli import main, parser
from mmpipe.config import load_preset
from mmpipe.model.builder import ReferenceModel
from mmpipe.planning import request as plan_request
from mmpipe.planning.costmodel import layer_costs
from mmpipe.planning.orders import dualpipev_orders, one_f_one_b_orders, zb_h1_orders
from mmpipe.planning.partition import compute_parts
from mmpipe.planning.schedule_registry import DUALPIPEV, schedule_named
from mmpipe.planning.schedules import predict
from mmpipe.planning.vpairs import pair_loads, v_pair_split
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference
from rank_series import launch_series

TOL = 1e-5
STEPS = 3
SEED = 4
V2 = ("--stages", "2", "--schedule", "dualpipev")
SAVE = ("--save-every", "1", "--keep-checkpoints", "0")
RESTARTED = "the optimizer state (AdamW moments) starts again from zero"


def _preset(cfg) -> str:
    """llava-tiny with text.max_context 5 x 16 + 40 = 120: the built-in set at --text-len 40 gives a packed row 5 image
    slots, and --pack's row fits the context (mmpipe.data.dataset.context_slots; at llava-tiny's own 64, one slot). The
    context is no weight (rotary positions restart at every sample): the same model."""
    model = load_preset("llava-tiny").to_dict()
    model["text"]["max_context"] = 120
    path = Path(cfg).parent / "llava-tiny-120.json"
    path.write_text(json.dumps(model))
    return str(path)


def _args(cfg, *extra: str) -> list[str]:
    return ["--preset", _preset(cfg), "--ds-config", str(cfg), "--pack", "--text-len", "40", "--eval-samples", "0",
            "--seed", str(SEED), "--steps", str(STEPS), "--data-workers", "0", *extra]


@pytest.fixture(scope="module")
def cfg(tmp_path_factory):
    # GAS 4 = 2 x 2 ranks, DualPipeV's least; no scheduler: the optimizer's own LR from step 1, so 3 updates
    return write_ds_config(tmp_path_factory.mktemp("cfg") / "dpv.json", train_micro_batch_size_per_gpu=2,
                           gradient_accumulation_steps=4, scheduler=None)


@pytest.fixture(scope="module")
def first_launch(cfg, tmp_path_factory) -> dict[str, Run]:
    """The runs that need no other run's files, one launch of 2 ranks (tests/rank_series.py: one run after the other
    in the same ranks, each as `mmpipe train` runs it, its own port, output and exit status): the PP=2 DualPipeV run
    (pp2) and the --init-from test's 1F1B and DualPipeV runs from the same files (init_f1b / init_dpv)."""
    root = tmp_path_factory.mktemp("dpv")
    src = root / "src"
    write_checkpoint(ReferenceModel(load_preset("tiny"), seed=99), src)  # not the runs' own seed: every weight read
    init = ["--preset", "tiny", "--ds-config", str(cfg), "--eval-samples", "0", "--seed", str(SEED), "--steps", "1",
            "--data-workers", "0", "--stages", "2", "--init-from", str(src)]
    runs = [(root / "pp2", _args(cfg, *V2, *SAVE), {}), (root / "init_f1b", init, {}),
            (root / "init_dpv", [*init, "--schedule", "dualpipev"], {})]
    return dict(zip(("pp2", "init_f1b", "init_dpv"), launch_series(runs)))


@pytest.fixture(scope="module")
def pp2(first_launch) -> Run:
    """The PP=2 DualPipeV run, a checkpoint after every step: the reference test's run and the resumes' source."""
    return first_launch["pp2"].check()


@pytest.fixture(scope="module")
def resumes(cfg, pp2, tmp_path_factory) -> dict[str, Run]:
    """pp2 cut after step 2 resumed under DualPipeV (same) and cut after step 1 resumed under 1F1B (f1b), one launch
    of 2 ranks (tests/rank_series.py), each run its own copy of pp2's files."""
    root = tmp_path_factory.mktemp("resumes")
    runs = [(cut_at(pp2, root / "same", 2), _args(cfg, *V2, *SAVE, "--resume"), {}),
            (cut_at(pp2, root / "f1b", 1), _args(cfg, "--stages", "2", "--schedule", "1f1b", "--resume"), {})]
    return dict(zip(("same", "f1b"), launch_series(runs)))


def test_pp2_packed_equals_single_device_reference(cfg, pp2):
    run, out = pp2, pp2.out.parent
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


def _layer_files(run, tag: str) -> dict[str, dict]:
    return {p.name: torch.load(p, weights_only=True) for p in sorted((run.out / "checkpoints" / tag).glob("layer_*"))}


def test_resume_under_dualpipev_is_bit_exact(pp2, resumes):
    """Cut after step 2 and resumed under DualPipeV: step 3's loss and every layer file both ranks write (each its two
    V stages') equal the uninterrupted run's bit for bit (the optimizer moments, RNG and data position restored)."""
    resumed = resumes["same"].check()
    assert resumed.summary["start_step"] == 2 and RESTARTED not in resumed.proc.stdout
    assert resumed.losses == pp2.losses
    got, want = _layer_files(resumed, "step3"), _layer_files(pp2, "step3")
    assert got.keys() == want.keys()
    for name, state in want.items():
        assert state.keys() == got[name].keys() and all(torch.equal(v, got[name][k]) for k, v in state.items()), name
    parts, layers = pp2.summary["parts"], {int(name[6:8]) for name in want}
    for rank in (0, 1):  # stage r and stage 3 - r: some layer file of each
        for stage in (rank, 3 - rank):
            assert layers & set(range(parts[stage], parts[stage + 1])), (rank, stage, sorted(layers))


def _assert_reshaped(moved, source, cut: int, was: str, now: str) -> None:
    """`source`'s step-`cut` checkpoint resumed under another layout (`moved`): said so with both layouts, the moments
    restarted; the weights carried (the next step's loss is the source's: the same weights, data position and
    LR), and the steps after it trained (every trained tensor moved > 1e-6 from the cut's weights)."""
    out = moved.proc.stdout
    assert f"was written by {was}" in out and f"this run is {now}" in out and RESTARTED in out, out[-2000:]
    assert moved.summary["start_step"] == cut and sorted(moved.losses) == list(range(1, STEPS + 1))
    assert moved.losses[cut + 1] == pytest.approx(source.losses[cut + 1], abs=1e-6)
    model = resolve(TrainArgs.from_argv(["--preset", "llava-tiny", "--stages", "1"]), world_size=1).model
    got, at_cut = (load_reference(moved.out / "checkpoints", model, tag) for tag in (None, f"step{cut}"))
    assert_weights_moved(got, at_cut, 1e-7, no_gradient=("self_attn.k_proj.bias",))


def test_dualpipev_checkpoint_resumes_under_1f1b(pp2, resumes):
    """pp2's step-1 checkpoint (DualPipeV, parts [0, 2, 5, 6, 9]: rank 0 holds layers 0..1 and 6..8) resumed under
    1F1B (parts [0, 6, 9]: rank 0 holds layers 0..5) for steps 2 and 3."""
    moved = resumes["f1b"]
    v, line = pp2.summary["parts"], moved.check().summary["parts"]
    assert len(v) == 5 and len(line) == 3
    _assert_reshaped(moved, pp2, 1, f"2 stages x dp 1 (parts {v}", f"2 x dp 1 (parts {line}")


def test_init_from_loads_both_parts_of_each_rank(first_launch):
    """--init-from under the V: each rank holds stage r and 2p - 1 - r, and both parts take the checkpoint's weights
    (load_run_weights read only the active part's: rank 0's head and rank 1's stage 2 kept their random init, step 1's
    loss 4.3407 against 1F1B's 4.5898). moondream's tiny, one step each: the same first loss as 1F1B's from the same
    files, bit for bit (the same weights, data and order; the loss is the step's mean over its micro-batches)."""
    f1b, dpv = first_launch["init_f1b"].check(), first_launch["init_dpv"].check()  # the same flags, 1 step each
    assert list(dpv.losses.values()) == list(f1b.losses.values())


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


def test_refusals(tmp_path, capsys):
    """Bad input gets one line each: too few micro-batches for DeepSpeed's DualPipeV (>= 2 x stages), a model DualPipeV
    cannot split into 2 x stages parts (an MoE model runs: tests/test_dualpipev_layouts.py); the record knows its module
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


def test_plan_shows_the_v_pair_split(capsys):
    """`mmpipe plan --schedule all` (or dualpipev) prints each rank's two V stages, cut as `mmpipe train --schedule
    dualpipev` cuts them (compute_parts with v_ranks: each rank's pair balanced, not each stage), frozen-aware (a frozen
    layer costs its forward only): qwen3-vl-tiny on 2 ranks, [0, 3, 11, 13, 19] with the tower frozen, [0, 1, 11, 13,
    19] trained; the per-stage split is [0, 11, 13, 15, 19] both ways. --schedule 1f1b prints none."""
    argv = ["plan", "--preset", "qwen3-vl-tiny", "--gpus-per-node", "2", "--global-batch", "8"]

    def v_parts(*extra: str) -> list[int] | None:
        capsys.readouterr()
        assert main([*argv, *extra]) == 0
        lines = [ln for ln in capsys.readouterr().out.splitlines() if ln.startswith("dualpipev's V at PP=2")]
        if not lines:
            return None
        found = re.findall(r"stage (\d) layers (\d+)\.\.(\d+)", lines[0])
        stages = sorted((int(s), int(a), int(b)) for s, a, b in found)
        assert [s for s, _, _ in stages] == [0, 1, 2, 3] and lines[0].index("rank 1: stage 1") > 0, lines[0]
        return [a for _, a, _ in stages] + [stages[-1][2] + 1]

    spec = plan_request.resolve(parser().parse_args([*argv, "--freeze", "vision"])).spec
    rows = layer_costs(spec.cfg, spec.freeze, spec.text_len, spec.checkpointing, spec.lora, spec.images, spec.row)
    frozen = v_parts("--freeze", "vision", "--schedule", "all")
    assert frozen == compute_parts(rows, 4, "balanced", v_ranks=2) != compute_parts(rows, 4, "balanced")
    assert v_parts("--schedule", "dualpipev") not in (None, frozen)
    assert v_parts("--freeze", "vision", "--schedule", "1f1b") is None
