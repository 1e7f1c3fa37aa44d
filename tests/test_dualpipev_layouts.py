"""--schedule dualpipev at PP=4 (tests/test_dualpipev.py: PP=2, resume and reshaping). One launch of 4 CPU ranks:
qwen3-vl-tiny cut into 2 x 4 = 8 V stages, packed rows, the tower frozen (--freeze vision), LoRA adapters on the
decoder (--lora 8), and validation at the end (--eval-data shapes: DeepSpeed's DualPipeVEngine.eval_batch, its
forward-only DualPipeVSchedule, through mmpipe's float-only wire). Against the single-device reference (fp32, 3
updates at a constant LR): losses and weights within 1e-5, the frozen tensors bit-identical to the seed's init and
every trained one moved more than 10 x 1e-5; the validation loss is the pipeline's checkpoint run as one model over
the same set; only floats crossed, rank 0 sending per micro-batch its phase-0 output (and, training, its loss stage's
input gradient). DeepStack: features its mergers make in the tower cross the V to the decoder layers that add them."""
from __future__ import annotations

import csv
import math
from collections import Counter
from itertools import islice

import pytest
import torch

from conftest import assert_weights_moved, train_run, write_ds_config
from mmpipe.data.batches import StepBatches, rank_batches
from mmpipe.data.dataset import prepare_eval
from mmpipe.model.builder import ReferenceModel
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.feed import run_dataset
from mmpipe.runtime.reference import train_reference

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


def test_pp4_frozen_tower_lora_deepstack_and_validation_equal_the_reference(tmp_path):
    cfg = write_ds_config(tmp_path / "g8.json", train_micro_batch_size_per_gpu=1, gradient_accumulation_steps=GAS,
                          scheduler=None)
    run = train_run(tmp_path / "pp4", *_args(cfg, "--stages", str(PP), "--schedule", "dualpipev")).check()
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
