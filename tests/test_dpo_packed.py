"""--objective dpo with --pack (issue 56): a pair's chosen and rejected samples sit in rows 2i / 2i + 1 of one
micro-batch (the same pairs in the same segment order), balanced rows keep them together, each sample's log-prob is
the sum over its own tokens (held apart from its row-mates), the precomputed reference equals the live one, and the
packed PP=2 run (under --schedule zb-h1) equals the single-device loop, as do llava-tiny's PP=1 x TP=2 runs in the
same launch (the live reference with validation, and the precomputed one: docs/dpo.md, --tp)."""
from __future__ import annotations

import csv
import json
import math
import random
from pathlib import Path

import pytest
import torch

from conftest import assert_weights_moved, write_ds_config
from mmpipe.data.batches import StepBatches, micro_batch_indices, rank_batches
from mmpipe.data.dataset import prepare
from mmpipe.data.export import export_shapes
from mmpipe.model import ReferenceModel
from mmpipe.model.dpo import REWARDS, dpo_labels, row_logps
from mmpipe.model.objectives import dpo
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.feed import run_dataset, step_balance
from mmpipe.runtime.reference import train_reference
from rank_series import launch_series
from test_dpo import _recorded, validation_want

TOL = 1e-5
STEPS = 4
# AdamW's eps in the precomputed test and the launches: 1e-5, not 1e-8. Adam's first update of an element is
# lr g / (|g| + eps), whose slope at g = 0 is lr / eps: 0.01 / 1e-8 = 1e6, or 1e3 at eps 1e-5. Two runs that compute
# the same thing in another order differ by rounding, so an element whose gradient is near 0 takes its gradient's
# rounding into its weight times that slope: 1e-11 becomes 1e-5 at eps 1e-8, 1e-8 at 1e-5. Such elements: a key bias
# (softmax cancels its gradient: it is rounding alone; qwen3-vl's is the key third of a fused qkv bias), and the
# vision tower under DPO (both sides of a pair share the image, so the tower's gradient is the small difference of
# two near-equal ones). qwen3-vl-tiny PP=2, packed, 4 steps at lr 0.01, against the single-device loop: 1.04e-5 at
# eps 1e-8 (1.mlp.linear_fc1; the qkv bias's key third 5.4e-6; unpacked 2.7e-5), 5.6e-7 at 1e-5, every tensor still
# moved > 0.022. The precomputed test: its file's log-probs come from one-sample rows, the live copy's from packed
# rows, ~1e-6 apart on a log-prob of ~-20, so each pair's sigmoid weight differs by ~beta x 1e-6 / 4 = 2.5e-8 and an
# element whose gradient is the near-cancelling sum of the pairs' terms (~1e-1 each) by ~1e-9: up to 1e-3 at eps
# 1e-8 (measured 5.7e-5, 6.mlp.up_proj), 1e-6 at 1e-5 (measured 9.7e-7; every tensor moved > 0.02).
EPS = 1e-5
WORDS = "a the big small shape colour left right top bottom of in near far bright dark".split()


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """16 shapes pairs and 8 of longer, uneven prompts and answers (rows of uneven cost, which --balance reorders)."""
    d = tmp_path_factory.mktemp("packed_pairs")
    path = export_shapes(d, "dpo-jsonl", 16)
    rng = random.Random(0)
    with open(path, "a") as f:
        for i in range(8):
            words = " ".join(rng.choice(WORDS) for _ in range(rng.randint(2, 24)))
            f.write(json.dumps({"prompt": f"<image>\n{words}", "images": [f"images/{i:05d}.png"],
                                "chosen": " ".join(rng.choice(WORDS) for _ in range(rng.randint(1, 6))),
                                "rejected": " ".join(rng.choice(WORDS) for _ in range(rng.randint(7, 9)))}) + "\n")
    return path


def _config(path, eps: float = 1e-8):
    return write_ds_config(path, train_micro_batch_size_per_gpu=4, scheduler=None, gradient_accumulation_steps=2,
                           optimizer={"type": "AdamW", "params": {"lr": 0.01, "betas": [0.9, 0.95], "eps": eps,
                                                                  "weight_decay": 0.0, "torch_adam": True}})


@pytest.fixture(scope="module")
def ds_config(tmp_path_factory):
    return _config(tmp_path_factory.mktemp("cfg") / "dpo.json")


# --pack's row fits the model's context (mmpipe.data.dataset.context_slots): at the tiny presets' own (64, 256) and
# their default --text-len (48, 238) these pairs' rows would hold one image pair each; the rows these tests were
# measured on (3 slots, 96 positions; 17 slots and P 272, 340) take that much context. The context is no weight (rotary
# positions restart at every sample): the same model, the same rows
ROWS = {"llava-tiny": (96, 48), "qwen3-vl-tiny": (340, 238)}  # preset: (text.max_context, --text-len)


def _preset(pairs, preset: str) -> str:
    context, _ = ROWS[preset]
    cfg = json.loads((Path(__file__).parents[1] / "mmpipe" / "presets" / f"{preset}.json").read_text())
    cfg["text"]["max_context"] = context
    path = Path(pairs).parent / f"{preset}-{context}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


def _args(pairs, ds_config, out, *extra, preset: str = "llava-tiny") -> list[str]:
    return ["--data", str(pairs), "--objective", "dpo", "--ds-config", str(ds_config), "--steps", str(STEPS),
            "--output-dir", str(out), "--eval-samples", "0", "--seed", "3", "--preset", _preset(pairs, preset),
            "--text-len", str(ROWS[preset][1]), "--pack", *extra]


def _run(pairs, ds_config, out, *extra, preset: str = "llava-tiny"):
    return resolve(TrainArgs.from_argv(_args(pairs, ds_config, out, "--stages", "1", *extra, preset=preset)),
                   world_size=1)


def test_pairs_share_rows_and_micro_batches(pairs, ds_config, tmp_path):
    """Rows 2i / 2i + 1 hold the chosen / rejected sides of the same pairs in the same order, several a row; the
    balanced layout (--balance on, the default with --pack) moves rows between micro-batches, never a pair's two."""
    run = _run(pairs, ds_config, tmp_path)
    samples = prepare(run.data, run.model, tmp_path, 3, verbose=False)
    plan = run_dataset(run, samples).plan
    rows = [plan.row(r) for r in range(40)]
    for chosen, rejected in zip(rows[0::2], rows[1::2]):
        assert all(p % 2 == 0 for p in chosen) and rejected == [p + 1 for p in chosen], (chosen, rejected)
    assert max(len(r) for r in rows) > 2  # packed: several pairs a row
    balance = step_balance(run, samples, plan)
    assert run.data.balance and balance is not None
    reordered = 0
    for step in range(5):
        micro = micro_batch_indices(step, run.micro, run.gas, 0, 1, 0, balance.order)
        for m in micro:  # whole row pairs: (2i, 2i + 1) side by side
            assert all(c % 2 == 0 and r == c + 1 for c, r in zip(m[0::2], m[1::2])), micro
        batch = run.micro * run.gas
        reordered += [r for m in micro for r in m] != list(range(step * batch, (step + 1) * batch))
    assert reordered  # the balance moved some step's rows (else the check above would be vacuous)


def test_packed_log_probs_and_loss_are_the_pairs(pairs, ds_config, tmp_path):
    """A packed micro-batch's per-sample log-probs equal the same samples' own rows' (each the sum over its own
    tokens, held apart from its row-mates by the segments; 1e-5), and its DPO loss and rewards those of the same pairs
    laid out one sample a row."""
    run = _run(pairs, ds_config, tmp_path)
    samples = prepare(run.data, run.model, tmp_path, 3, verbose=False)
    data = run_dataset(run, samples)
    batches = rank_batches(data, StepBatches(0, run.micro, 1, 0, 1))
    inputs, labels = next(batches)
    batches.close()
    model, ref_model = ReferenceModel(run.model, seed=1), ReferenceModel(run.model, seed=2)
    with torch.no_grad():
        for w in model[-1].parameters():  # a sharper head: log-probs far from uniform
            w.mul_(8)
        labels = dpo_labels(inputs, labels, None, True)
        ref = row_logps(ref_model(*inputs), labels)
        labels = dpo_labels(inputs, labels, ref, True)
        logits = model(*inputs)
        packed = row_logps(logits, labels)
        held = [data.plan.row(r) for r in range(run.micro)]
        # one sample a row, each pair's chosen then rejected side by side
        positions = [p for c, r in zip(held[0::2], held[1::2]) for pair in zip(c, r) for p in pair]
        one = rank_batches(run_dataset(run, samples, train=False), [positions])
        one_inputs, one_labels = next(one)
        one.close()
        one_logits = model(*one_inputs)
        alone = dict(zip(positions, row_logps(one_logits, one_labels).tolist()))
        ref_alone = dict(zip(positions, row_logps(ref_model(*one_inputs), one_labels).tolist()))
    assert packed.shape == (run.micro, max(len(h) for h in held)) and len(positions) > run.micro
    for b, h in enumerate(held):
        assert packed[b, :len(h)].tolist() == pytest.approx([alone[p] for p in h], abs=TOL), b
        assert (packed[b, len(h):] == 0).all()
    objective = dpo(0.1, "sigmoid", 0.5)
    loss, rewards = float(objective.loss(logits, labels)), objective.metrics()
    # the same pairs one sample a row: (chosen, rejected) side by side, the reference's log-probs from their own rows
    ref_one = torch.tensor([ref_alone[p] for p in positions])
    loss_one = float(objective.loss(one_logits, (one_labels, ref_one)))
    assert loss == pytest.approx(loss_one, abs=TOL) and abs(loss - math.log(2)) > 100 * TOL
    assert {k: float(v) for k, v in rewards.items()} == pytest.approx(
        {k: float(v) for k, v in objective.metrics().items()}, abs=TOL)


def test_precomputed_equals_live_packed(pairs, tmp_path):
    """`mmpipe score-reference` (one sample a row) read into packed micro-batches, by each row's samples: the
    single-device loop equals the live frozen copy's (losses and weights 1e-5, 4 updates)."""
    from mmpipe.cli import main
    ds_config = _config(tmp_path / "eps.json", EPS)
    assert main(["score-reference", *_args(pairs, ds_config, tmp_path / "score", "--stages", "1")]) == 0
    scored = tmp_path / "score" / "data" / "reference_logps.npz"
    got = {}
    for name, extra in (("live", ()), ("pre", ("--reference-logps", str(scored)))):
        run = _run(pairs, ds_config, tmp_path / name, *extra)
        got[name] = train_reference(run, seed=3, steps=STEPS, out_dir=str(tmp_path / name))
    (live, live_losses), (pre, pre_losses) = got["live"], got["pre"]
    assert pre_losses == pytest.approx(live_losses, abs=TOL) and abs(pre_losses[-1] - pre_losses[0]) > 1e-3
    diffs = {k: (v - live.state_dict()[k]).abs().max().item() for k, v in pre.state_dict().items()}
    assert max(diffs.values()) < TOL, max(diffs.items(), key=lambda kv: kv[1])


@pytest.mark.parametrize("preset", ["llava-tiny", "qwen3-vl-tiny"])
def test_packed_pipeline_equals_single_device(preset, pairs, tmp_path):
    """PP=2 with packed pairs (the live reference's pass through both stages, balanced rows) under --schedule zb-h1
    (its split backward; the reference pass is DeepSpeed's inference schedule whatever trains; DeepSpeed's own 1F1B
    is tests/test_dpo.py's launch) == the single-device loop: losses, every step's four rewards, validation and the
    weights within 1e-5, fp32, the vision tower trained (AdamW eps 1e-5: EPS above); every trained tensor moved.
    llava-tiny's launch runs two PP=1 x TP=2 (1F1B) trains after it in the same ranks (tests/rank_series.py), the
    same: one with the live reference (its copies split as the layers, its record and the DPO loss vocab-parallel)
    and validation; one reading `mmpipe score-reference --tp 2`'s file (one process, whole: TP 1's file)."""
    ds_config = _config(tmp_path / "eps.json", EPS)
    run, seen = _recorded(_run(pairs, ds_config, tmp_path, preset=preset))
    model, losses = train_reference(run, seed=3, steps=STEPS, out_dir=str(tmp_path))
    held = export_shapes(tmp_path / "held", "dpo-jsonl", 6, seed=1)  # validation: one sample a row, even packed
    tp2, val = ("--stages", "1", "--tp", "2"), ("--eval-data", str(held))
    layouts = {"pp2": ("--stages", "2", "--schedule", "zb-h1", *val), "tp2": (*tp2, *val),
               "tp2pre": (*tp2, "--reference-logps", str(tmp_path / "score" / "data" / "reference_logps.npz"))}
    if preset == "llava-tiny":
        from mmpipe.cli import main
        assert main(["score-reference", *_args(pairs, ds_config, tmp_path / "score", *tp2)]) == 0
    names = ["pp2", "tp2", "tp2pre"] if preset == "llava-tiny" else ["pp2"]
    runs = dict(zip(names, launch_series([(tmp_path / n, _args(pairs, ds_config, tmp_path / n, *layouts[n],
                                                               preset=preset), {}) for n in names])))
    assert "mmpipe: schedule zb-h1:" in runs["pp2"].check().proc.stdout
    want = validation_want(_run(pairs, ds_config, tmp_path / "val", *val, preset=preset), runs["pp2"].out,
                           tmp_path / "val")
    for name, got in runs.items():
        _assert_equals(got.check(), run, seen, losses, model, None if name == "tp2pre" else want)
    if "tp2" in runs:  # each TP rank saved its half of every split layer (the checkpoint gathered above)
        assert len(list((runs["tp2"].out / "checkpoints" / f"step{STEPS}").glob("layer_*-model_01-*"))) > 4


def _assert_equals(got, run, seen, losses, model, want) -> None:
    """A launched run's losses, rewards, last validation (want; None: the precomputed reference, no validation) and
    gathered weights == the single-device loop's (TOL). The precomputed file's log-probs come from one-sample rows,
    the loop's from packed rows (~1e-7 apart): at step 1 (policy == reference) every reward is that rounding (~1e-8),
    so its share of pairs with chosen > rejected is a coin flip there (measured 0.28 apart); from step 2 on equal."""
    evals = list(csv.DictReader(open(got.out / "eval_log.csv"))) if want else [{"eval_tokens": 6}]
    assert int(evals[-1]["eval_tokens"]) == 6 and {k: float(evals[-1][k]) for k in want or {}} == pytest.approx(
        want or {}, abs=TOL), got.out
    assert got.losses[1] == pytest.approx(math.log(2), abs=TOL)  # step 1: the policy is the reference
    assert [got.losses[s] for s in range(1, STEPS + 1)] == pytest.approx(losses, abs=TOL), got.out
    for step, row in enumerate(got.rows, start=1):  # the engine's mean over the step's GAS micro-batches
        micro = seen[(step - 1) * run.gas:step * run.gas]
        keys = [k for k in REWARDS if want or step > 1 or k != "rewards/accuracies"]
        assert {k: float(row[k]) for k in keys} == pytest.approx(
            {k: sum(m[k] for m in micro) / run.gas for k in keys}, abs=TOL), (got.out, step)
    assert all(abs(float(r["rewards/margins"])) > 100 * TOL for r in got.rows[1:])
    assert got.summary["data"]["balance"]["applied"]
    trained = load_reference(got.out / "checkpoints", run.model)  # a TP run's shards gathered
    diffs = {k: (v - model.state_dict()[k]).abs().max().item() for k, v in trained.state_dict().items()}
    assert max(diffs.values()) < TOL, (got.out, max(diffs.items(), key=lambda kv: kv[1]))
    assert_weights_moved(trained, ReferenceModel(run.model, seed=3), TOL, no_gradient=("k_proj.bias",))
