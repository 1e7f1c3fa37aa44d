"""--schedule dualpipev at PP=4 (tests/test_dualpipev.py: PP=2, resume and reshaping). One launch of 4 CPU ranks:
qwen3-vl-tiny cut into 2 x 4 = 8 V stages, packed rows, the tower frozen (--freeze vision), LoRA adapters on the
decoder (--lora 8), and validation at the end (--eval-data shapes: DeepSpeed's DualPipeVEngine.eval_batch, its
forward-only DualPipeVSchedule, through mmpipe's float-only wire). Against the single-device reference (fp32, 3
updates at a constant LR): losses and weights within 1e-5, the frozen tensors bit-identical to the seed's init and
every trained one moved more than 10 x 1e-5; the validation loss is the pipeline's checkpoint run as one model over
the same set; only floats crossed, rank 0 sending per micro-batch its phase-0 output (and, training, its loss stage's
input gradient). DeepStack: features its mergers make in the tower cross the V to the decoder layers that add them.
The same launch's second run (tests/rank_series.py), PP=2 x DP=2 x EP=2 (tests/test_moe_pipeline.py's MoE model):
see its test."""
from __future__ import annotations

import csv
import math
from collections import Counter
from itertools import islice

import pytest
import torch

from conftest import assert_weights_moved, write_ds_config
from mmpipe.data.batches import StepBatches, rank_batches
from mmpipe.data.dataset import prepare_eval
from mmpipe.model import moe
from mmpipe.model.builder import ReferenceModel, layer_specs
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.feed import run_dataset
from mmpipe.runtime.reference import train_reference
from rank_series import launch_series
from test_moe_pipeline import recorded_reference, write_moe_set
from test_qwen_pipeline import assert_trained_as_reference

TOL = 1e-5
STEPS, SEED, PP, GAS, EVAL_N = 3, 4, 4, 8, 8  # GAS 8 = 2 x 4 ranks, DualPipeV's least at PP=4; one eval_batch


def _args(cfg, *extra: str) -> list[str]:
    return ["--preset", "qwen3-vl-tiny", "--ds-config", str(cfg), "--pack", "--text-len", "40", "--freeze", "vision",
            "--lora", "8", "--eval-data", "shapes", "--eval-samples", str(EVAL_N), "--seed", str(SEED),
            "--steps", str(STEPS), "--data-workers", "0", *extra]


def _reference_eval_loss(run, ckpt_dir, out_dir) -> float:
    """The pipeline's final checkpoint as one model over the validation set, as mmpipe.runtime.validation lays it out
    (the same rows and micro-batches, label-free repeats past the set): summed loss over its answer tokens."""
    evalset = prepare_eval(run.eval_data, run.model, out_dir, SEED, EVAL_N, verbose=False)
    model = load_reference(ckpt_dir, run.model).eval()
    calls = math.ceil(evalset.size / run.train_batch)
    batches = rank_batches(run_dataset(run, evalset, train=False), islice(StepBatches(0, run.micro, run.gas, 0, 1),
                                                                          calls * run.gas))
    with torch.no_grad():
        total = sum(float(run.objective.eval_sum(model(*inputs), labels)) for inputs, labels in batches)
    return total / evalset.answer_tokens()


MOE_GAS, CLIP = 4, 0.5  # GAS 4 = 2 x 2 ranks, DualPipeV's least at PP=2; the clip below every step's norm (asserted)
MOE_DS = {"train_micro_batch_size_per_gpu": 1, "gradient_clipping": CLIP, "scheduler": None}


@pytest.fixture(scope="module")
def four_rank_runs(tmp_path_factory) -> dict:
    """Both tests' runs, one launch of 4 ranks (tests/rank_series.py: one run after the other in the same ranks, each
    as `mmpipe train` runs it, its own port, output and exit status): qwen3-vl-tiny PP=4 (pp4: the run and its ds
    config) and the MoE model at PP=2 x DP=2 x EP=2 (moe: the run and its flags but the ds config). Two launches
    before, each ~15-20 s of start-up."""
    pp4_root, moe_root = tmp_path_factory.mktemp("pp4"), tmp_path_factory.mktemp("moe")
    cfg = write_ds_config(pp4_root / "g8.json", train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=GAS,
                          scheduler=None)
    moe_args = [*write_moe_set(moe_root), "--balance", "off", "--freeze", "vision", "--steps", str(STEPS), "--seed",
                str(SEED)]
    moe_cfg = write_ds_config(moe_root / "dpv.json", gradient_accumulation_steps=MOE_GAS, **MOE_DS)
    pp4, moe_run = launch_series([
        (pp4_root / "pp4", _args(cfg, "--stages", str(PP), "--schedule", "dualpipev"), {}),
        (moe_root / "dpv", [*moe_args, "--ds-config", str(moe_cfg), "--stages", "2", "--schedule", "dualpipev",
                            "--dp", "2", "--ep", "2"], {})])
    return {"pp4": (pp4, cfg), "moe": (moe_run, moe_args)}


def test_pp4_frozen_tower_lora_deepstack_and_validation_equal_the_reference(tmp_path, four_rank_runs):
    run, cfg = four_rank_runs["pp4"]  # _args(cfg, "--stages", PP, "--schedule", "dualpipev")
    run = run.check()
    s = run.summary
    ref_run = resolve(TrainArgs.from_argv(_args(cfg, "--stages", "1", "--output-dir", str(tmp_path / "ref"))),
                      world_size=1)
    parts, names = s["parts"], [r.name for r in ref_run.layers]
    assert s["stages"] == PP and len(parts) == 2 * PP + 1 and s["freeze"] == ["vision"]
    # DeepStack crosses the V: each DeepstackAdd is on another V stage than the DeepstackMerger feeding it
    stage_of = lambda i: next(k for k in range(2 * PP) if parts[k] <= i < parts[k + 1])  # noqa: E731
    mergers = [stage_of(i) for i, n in enumerate(names) if n == "DeepstackMerger"]
    adds = [stage_of(i) for i, n in enumerate(names) if n == "DeepstackAdd"]
    assert len(mergers) == len(adds) == 3 and all(a > m for m, a in zip(mergers, adds)), (parts, mergers, adds)
    # floats only; rank 0's phase-0 output, the tower's hidden state (the vision width), crossed once per training
    # micro-batch and once per validation micro-batch (eval_batch ran the V)
    run.assert_only_floats_crossed(per_forward=None)
    sent = Counter(shape for kind, _, shape in run.wire(0) if kind == "data")
    assert sum(n for shape, n in sent.items() if shape.endswith(f"x{ref_run.model.vision.dim}")) == GAS * (STEPS + 1)
    ref_model, ref_losses = train_reference(ref_run, seed=SEED, steps=STEPS, out_dir=str(tmp_path / "ref"))
    assert list(run.losses.values()) == pytest.approx(ref_losses, abs=TOL)
    trained = load_reference(run.out / "checkpoints", ref_run.model).state_dict()
    ref_state = ref_model.state_dict()
    diffs = {k: (v - ref_state[k]).abs().max().item() for k, v in trained.items()}
    assert trained.keys() == ref_state.keys() and max(diffs.values()) < TOL, max(diffs.items(), key=lambda kv: kv[1])
    # the frozen tower and the LoRA base weights are the seed's, bit for bit; every trained tensor moved
    init = ReferenceModel(ref_run.model, seed=SEED, freeze=ref_run.freeze, lora=ref_run.lora)
    frozen = [n for n, p in init.named_parameters() if not p.requires_grad]
    init_state = init.state_dict()
    assert frozen and all(torch.equal(trained[n], init_state[n]) for n in frozen)
    assert any(n.startswith("0.") for n in frozen)  # the tower's patch embedding among them
    assert_weights_moved(trained, init_state, TOL, frozen=tuple(frozen))
    # validation through the V: the pipeline's loss is its checkpoint's as one model
    with open(run.out / "eval_log.csv") as f:
        assert [(int(r["step"]), float(r["eval_loss"])) for r in csv.DictReader(f)] == [(STEPS, s["eval_loss"])]
    want = _reference_eval_loss(ref_run, run.out / "checkpoints", tmp_path / "ref")
    assert s["eval_loss"] == pytest.approx(want, abs=TOL) and s["eval_samples_validated"] == EVAL_N


def test_moe_pp2_dp2_ep2_equals_the_reference(tmp_path, four_rank_runs):
    """An MoE model with expert parallelism through the V: 4 ranks, PP=2 x DP=2 x EP=2, each rank's experts split
    over its pipe coordinate's 2 DP ranks in BOTH its stages. The cut [0, 11, 15, 18, 19] puts MoE block 16 on rank
    1's phase-1 stage (stage 2 of 4) and the MoE head on rank 0's (stage 3): the shards of a phase-1 block and the
    aux loss of a head that is not on the last rank. Packed rows in stream order (--balance off: which rows share a
    micro-batch sets the aux loss), fp32 at ZeRO 0, 3 updates at a constant LR, every step clipped by the global norm.
    Against the single-device loop of the same 8 rows a step (GAS 8): losses, aux losses and weights within 1e-5,
    every trained tensor moved by more than 10 x that, the checkpoint's experts whole."""
    root = tmp_path
    run, args = four_rank_runs["moe"]  # args, --ds-config (GAS MOE_GAS), --stages 2 --schedule dualpipev --dp 2 --ep 2
    run = run.check()
    ref_cfg = write_ds_config(root / "ref.json", gradient_accumulation_steps=2 * MOE_GAS, **MOE_DS)  # DP 2 x GAS 4
    ref_run = resolve(TrainArgs.from_argv([*args, "--ds-config", str(ref_cfg), "--stages", "1",
                                           "--output-dir", str(root / "ref")]), world_size=1)
    parts, names = run.summary["parts"], [s.typename for s in layer_specs(ref_run.model)]
    blocks = [i for i, k in enumerate(names) if k is moe.Qwen3MoeBlock]
    assert parts[2] <= blocks[-1] < parts[3] and names[-1] is moe.MoeHead, (parts, blocks)  # a block on stage 2
    for rank, experts in ((0, "0..3"), (1, "4..7"), (2, "0..3"), (3, "4..7")):
        assert f"mmpipe: rank {rank}: experts {experts} of 8 in each MoE block (--ep 2)" in run.proc.stdout
    # each rank's optimizer holds its two stages' trainable tensors with 1/2 of every MoE block's experts, the phase-1
    # stage's too (rank 1 holding block 16's 8 experts whole, replicated, would count 24,576 more: 137,248)
    init = ReferenceModel(ref_run.model, seed=SEED, freeze=ref_run.freeze, lora=ref_run.lora)
    held = lambda k: sum(p.numel() // (2 if ".experts." in n else 1) for i in range(parts[k], parts[k + 1])  # noqa: E731
                         for n, p in init[i].named_parameters() if p.requires_grad)
    assert run.summary["optimizer_params"] == [held(r) + held(3 - r) for r in (0, 1)]
    ref_model, ref_losses, ref_aux, norms = recorded_reference(ref_run, SEED, STEPS, 2 * MOE_GAS, root / "ref")
    assert len(norms) == STEPS and min(norms) > CLIP, norms
    assert [float(r["loss"]) for r in run.rows] == pytest.approx(ref_losses, abs=TOL)
    assert [float(r["aux_loss"]) for r in run.rows] == pytest.approx(ref_aux, abs=TOL)
    assert all(a > 1e-3 * 0.5 for a in ref_aux)  # coef 0.001 x aux (1 when balanced): present in every step
    got = load_reference(run.out / "checkpoints", ref_model.cfg)
    assert all(got[i].mlp.experts.gate_up_proj.shape[0] == 8 for i in blocks)  # both phases' shards gathered whole
    assert_trained_as_reference(run, ref_model, SEED, TOL)  # weights 1e-5, every trained tensor moved > 10 x TOL
