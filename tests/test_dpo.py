"""--objective dpo (issue 56): TRL's loss and rewards on the same log-probs, the pipeline equal to one device, the
reference weights (a frozen copy; with LoRA the adapters off), preference data with its bad pairs, the refusals."""
from __future__ import annotations

import collections
import copy
import csv
import dataclasses
import json
import math
from types import SimpleNamespace

import pytest
import torch
import torch.nn.functional as F

from conftest import assert_weights_moved, cut_at, refused, train_run, write_checkpoint, write_ds_config
from mmpipe.config import load_preset
from mmpipe.data.batches import StepBatches, rank_batches
from mmpipe.data.dataset import prepare, prepare_eval
from mmpipe.data.export import export_shapes
from mmpipe.model import ReferenceModel
from mmpipe.model.builder import IGNORE_INDEX, TiedCall
from mmpipe.model.dpo import REWARDS, row_logps
from mmpipe.model.lora import Lora, load_base
from mmpipe.model.objectives import dpo
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.feed import run_dataset
from mmpipe.runtime.preference import LiveReference, reference_model
from mmpipe.runtime.reference import train_reference

TOL = 1e-5
STEPS = 4  # 4 updates at a constant lr of 0.01: every trained tensor moves far past 10 x TOL
# bad pairs appended to the exported set: (record, the kind each of its two sides is counted under)
BAD = [({"prompt": "<image>\nwhat colour", "chosen": "red", "images": ["images/00000.png"]}, "missing_field"),
       ({"prompt": "<image>\nwhat colour", "chosen": "red", "rejected": "red", "images": ["images/00000.png"]},
        "equal_answers"),
       ({"prompt": "<image>\nwhat colour", "chosen": " ", "rejected": "red", "images": ["images/00000.png"]},
        "empty_answer")]
# the LLaVA-style shape of a pair: the conversation up to its last user turn, then the two answers
LLAVA_STYLE = {"image": "images/00001.png", "conversations": [{"from": "human", "value": "<image>\nwhat shape is red"}],
               "chosen": {"from": "gpt", "value": "circle"}, "rejected": "square"}


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    """16 good shapes pairs (TRL's format), one LLaVA-style pair, 3 bad pairs: 17 of 20 usable."""
    d = tmp_path_factory.mktemp("pairs")
    path = export_shapes(d, "dpo-jsonl", 16)
    with open(path, "a") as f:
        f.writelines(json.dumps(r) + "\n" for r in [LLAVA_STYLE] + [r for r, _ in BAD])
    return path


@pytest.fixture(scope="module")
def ds_config(tmp_path_factory):
    return write_ds_config(tmp_path_factory.mktemp("cfg") / "dpo.json", train_micro_batch_size_per_gpu=4,
                           scheduler=None, gradient_accumulation_steps=2, optimizer={"type": "AdamW", "params": {
                               "lr": 0.01, "betas": [0.9, 0.95], "eps": 1e-8, "weight_decay": 0.0,
                               "torch_adam": True}})


def _args(pairs, ds_config, out, *extra) -> list[str]:
    return ["--data", str(pairs), "--objective", "dpo", "--ds-config", str(ds_config), "--steps", str(STEPS),
            "--output-dir", str(out), "--eval-samples", "0", "--seed", "3", *extra]


def _first_micro_batch(run, out):
    samples = prepare(run.data, run.model, out, 0, verbose=False)
    batches = rank_batches(run_dataset(run, samples), StepBatches(0, run.micro, 1, 0, 1))
    inputs, labels = next(batches)
    batches.close()
    return inputs, labels[0]


def _trl_loss(logits, labels, ref, kind: str, beta: float, rpo: float):
    """TRL's DPOTrainer._compute_loss (trl 1.16) on the same per-token log-probs: the batch as TRL lays it out
    ([chosen rows; rejected rows], completion_mask shifted by one), its precomputed-reference path, RPO as TRL 1.x
    writes it (loss_type [kind, "sft"], loss_weights [1, rpo_alpha]). Returns (loss, its logged metrics)."""
    from trl import DPOTrainer
    order = torch.cat([torch.arange(0, len(labels), 2), torch.arange(1, len(labels), 2)])
    labels, logits, ref = labels[order], logits[order], ref[order]
    mask = labels != IGNORE_INDEX
    # per-token log-probs by log_softmax + gather: not mmpipe's cross-entropy path
    lp = torch.log_softmax(logits.double(), -1).gather(-1, labels.clamp(min=0)[..., None])[..., 0] * mask
    zeros = torch.zeros_like(lp)
    outputs = SimpleNamespace(log_probs=lp, entropy=zeros, mean_logits=zeros, is_top1=zeros.bool())
    metrics = {"train": collections.defaultdict(list), "eval": collections.defaultdict(list)}
    trainer = SimpleNamespace(
        model=SimpleNamespace(training=True), aux_loss_enabled=False, ld_alpha=None, precompute_ref_logps=True,
        f_divergence_type="reverse_kl", beta=beta, use_weighting=False, label_smoothing=0.0, _metrics=metrics,
        _total_train_tokens=0, _tp_size=1,
        loss_types=[kind] + (["sft"] if rpo else []), loss_weights=[1.0] + ([rpo] if rpo else []),
        accelerator=SimpleNamespace(device="cpu", gather=lambda t: t, gather_for_metrics=lambda t: t))
    half = len(labels) // 2
    inputs = {"input_ids": torch.zeros(len(labels), labels.shape[1] + 1, dtype=torch.long),
              "attention_mask": torch.ones(len(labels), labels.shape[1] + 1, dtype=torch.long),
              "completion_mask": torch.cat([torch.zeros(len(labels), 1, dtype=torch.long), mask.long()], 1),
              "ref_chosen_logps": ref[:half].double(), "ref_rejected_logps": ref[half:].double()}
    loss = DPOTrainer._compute_loss(trainer, lambda **kw: outputs, inputs, False)
    return float(loss), {k: metrics["train"][k][-1] for k in REWARDS}


def test_loss_and_rewards_equal_trls(pairs, ds_config, tmp_path):
    """The first micro-batch of a tiny Qwen2.5-VL-style model (qwen-tiny: Qwen2.5's vision blocks) whose policy
    (seed 1) is not its reference (seed 2): loss and the four rewards equal TRL's for every loss kind and RPO."""
    run = resolve(TrainArgs.from_argv(_args(pairs, ds_config, tmp_path, "--preset", "qwen-tiny", "--stages", "1")),
                  world_size=1)
    inputs, labels = _first_micro_batch(run, tmp_path)
    with torch.no_grad():
        policy = ReferenceModel(run.model, seed=1)
        head = policy[-1].module if isinstance(policy[-1], TiedCall) else policy[-1]  # qwen-tiny: the embedding
        for w in head.parameters():  # a sharper head: log-probs far from the near-uniform reference's
            w.mul_(8)
        logits = policy(*inputs)
        ref = row_logps(ReferenceModel(run.model, seed=2)(*inputs), labels)
    seen = {}
    for kind, beta, rpo in [("sigmoid", 0.1, 0.0), ("sigmoid", 0.5, 0.7), ("ipo", 0.3, 0.0), ("hinge", 0.2, 0.0)]:
        objective = dpo(beta, kind, rpo)
        loss = float(objective.loss(logits, (labels, ref)))
        mine = {k: float(v) for k, v in objective.metrics().items()}
        trl_loss, trl = _trl_loss(logits, labels, ref, kind, beta, rpo)
        assert loss == pytest.approx(trl_loss, abs=TOL), (kind, beta, rpo)
        assert mine == pytest.approx(trl, abs=TOL), (kind, mine, trl)
        seen[kind, rpo] = loss, mine
    loss, mine = seen["sigmoid", 0.0]
    # policy != reference: not DPO's ln 2 at equal models (> 100 x TOL away), rewards away from 0
    assert abs(loss - math.log(2)) > 100 * TOL and abs(mine["rewards/margins"]) > 1e-2, (loss, mine)
    assert seen["sigmoid", 0.7][0] > 0  # (the RPO row's own beta 0.5 differs; its NLL term is what TRL's sft adds)


def _recorded(run):
    """The run with its DPO loss wrapped to keep each micro-batch's rewards (the single-device per-step values)."""
    seen, loss = [], run.objective.loss

    def keep(logits, labels):
        out = loss(logits, labels)
        seen.append({k: float(v) for k, v in run.objective.metrics().items()})
        return out
    return dataclasses.replace(run, objective=dataclasses.replace(run.objective, loss=keep)), seen


@pytest.fixture(scope="module")
def eval_pairs(tmp_path_factory):
    """6 held-out pairs (another seed's shapes): 12 rows, two validation calls of 8 (the second padded by 2 pairs)."""
    return export_shapes(tmp_path_factory.mktemp("eval_pairs"), "dpo-jsonl", 6, seed=1)


@pytest.fixture(scope="module")
def pp2(pairs, eval_pairs, ds_config, tmp_path_factory):
    out = tmp_path_factory.mktemp("pp2")
    return train_run(out, *_pp2_args(pairs, eval_pairs, ds_config, out)).check()


def _pp2_args(pairs, eval_pairs, ds_config, out) -> list[str]:
    """The PP=2 run: validation pairs, a checkpoint after step 2 (the resume test's cut)."""
    return _args(pairs, ds_config, out, "--preset", "llava-tiny", "--stages", "2", "--eval-data", str(eval_pairs),
                 "--save-every", "2")


def test_pipeline_equals_single_device(pairs, ds_config, pp2, tmp_path):
    """PP=2 (the reference pass through both stages, then the step) == one device with a frozen copy as the
    reference: losses, the rewards of every step and the weights within 1e-5, fp32; the weights moved."""
    run = resolve(TrainArgs.from_argv(_args(pairs, ds_config, tmp_path, "--preset", "llava-tiny", "--stages", "1")),
                  world_size=1)
    run, seen = _recorded(run)
    model, losses = train_reference(run, seed=3, steps=STEPS, out_dir=str(tmp_path))
    got = pp2.losses
    assert sorted(got) == list(range(1, STEPS + 1))
    assert got[1] == pytest.approx(math.log(2), abs=TOL)  # step 1: the policy is the reference
    for step, ref in enumerate(losses, start=1):
        assert got[step] == pytest.approx(ref, abs=TOL), step
    for step, row in enumerate(pp2.rows, start=1):  # the engine's mean over the step's GAS micro-batches
        micro = seen[(step - 1) * run.gas:step * run.gas]
        assert {k: float(row[k]) for k in REWARDS} == pytest.approx(
            {k: sum(m[k] for m in micro) / run.gas for k in REWARDS}, abs=TOL), step
    # step 1: policy == reference, every reward 0; after an update the policy's log-probs move off the reference's
    assert [float(pp2.rows[0][k]) for k in REWARDS] == [0.0, 0.0, 0.0, 0.0]
    assert all(abs(float(r["rewards/chosen"])) > 100 * TOL for r in pp2.rows[1:])
    summary = pp2.summary
    assert all(summary[k] == pytest.approx(float(pp2.rows[-1][k]), abs=1e-12) for k in REWARDS)
    trained = load_reference(pp2.out / "checkpoints", run.model)
    diffs = {k: (v - model.state_dict()[k]).abs().max().item() for k, v in trained.state_dict().items()}
    assert max(diffs.values()) < TOL, max(diffs.items(), key=lambda kv: kv[1])
    # every trained tensor moved from the seed's init, except the CLIP tower's key biases (softmax cancels their
    # gradient: they move by rounding alone)
    assert_weights_moved(trained, ReferenceModel(run.model, seed=3), TOL, no_gradient=("k_proj.bias",))
    # the data: 17 of 20 pairs, each bad pair's two sides counted under its reason
    data = summary["data"]
    assert data["bad_by_kind"] == {kind: 2 for _, kind in BAD}
    assert data["good"] == 2 * 17 and data["records"] == 2 * 20


def test_resume_restores_the_reference(pairs, eval_pairs, ds_config, pp2, tmp_path):
    """The PP=2 run cut after step 2 and resumed: steps 3 and 4's losses and rewards and the final weights equal the
    uninterrupted run's bit for bit. The live reference is rebuilt from the start's weights, not the checkpoint's: a
    reference taken from the resumed policy would give step 3 rewards of 0 and a loss of ln 2."""
    cut = cut_at(pp2, tmp_path / "cut", 2)
    resumed = train_run(cut, *_pp2_args(pairs, eval_pairs, ds_config, cut), "--resume").check()
    assert resumed.summary["start_step"] == 2
    assert [{k: r[k] for k in ("step", "loss", *REWARDS)} for r in resumed.rows] == [
        {k: r[k] for k in ("step", "loss", *REWARDS)} for r in pp2.rows]  # the logged strings, steps 1 .. 4
    assert all(abs(float(r["rewards/chosen"])) > 100 * TOL for r in resumed.rows[2:])  # not policy == reference
    cfg = resolve(TrainArgs.from_argv(_args(pairs, ds_config, tmp_path, "--preset", "llava-tiny", "--stages", "1")),
                  world_size=1).model
    a = load_reference(cut / "checkpoints", cfg).state_dict()
    b = load_reference(pp2.out / "checkpoints", cfg).state_dict()
    assert [k for k in a if not torch.equal(a[k], b[k])] == []
    step2 = load_reference(cut / "checkpoints", cfg, "step2").state_dict()
    assert max((a[k] - step2[k]).abs().max().item() for k in a) > 100 * TOL  # the resumed steps trained


def _load_layers(model, ckpt_dir):
    """trainer.load_run_weights for a single-device model: layer i from layer_{i:02d} of the latest checkpoint."""
    tag = (ckpt_dir / "latest").read_text().strip()
    for i, layer in enumerate(model):
        load_base(layer, torch.load(ckpt_dir / tag / f"layer_{i:02d}-model_states.pt", weights_only=True))


@pytest.mark.parametrize("lora,other", [(None, False), (Lora(2, 4.0), False), (Lora(2, 4.0), True)],
                         ids=["frozen-copy", "lora-adapters-off", "reference-run"])
def test_live_reference_is_the_starting_model(pairs, ds_config, tmp_path, lora, other):
    """LiveReference's weights(): inside it the stage computes the reference's logits: the starting model's, (a) from
    its frozen copy, (b) with LoRA the adapters off (plus a copy of the trained tensors outside --lora-groups); (d)
    --reference RUN's (another seed's model, every tensor copied); after it the policy's own again, unchanged."""
    run = resolve(TrainArgs.from_argv(_args(pairs, ds_config, tmp_path, "--preset", "llava-tiny", "--stages", "1")),
                  world_size=1)
    inputs, _ = _first_micro_batch(run, tmp_path)
    if other:  # a run directory holding the same model at another seed
        write_checkpoint(ReferenceModel(run.model, seed=7), tmp_path / "base")
        run = resolve(TrainArgs.from_argv(_args(pairs, ds_config, tmp_path, "--preset", "llava-tiny", "--stages", "1",
                                                "--reference", str(tmp_path / "base"))), world_size=1)
    run = dataclasses.replace(run, lora=lora)
    policy = ReferenceModel(run.model, seed=3, lora=lora)
    start = load_reference(tmp_path / "base" / "checkpoints", run.model) if other else copy.deepcopy(policy)
    live = LiveReference(SimpleNamespace(module=policy), run, _load_layers)
    assert reference_model(run, policy)(*inputs).equal(start(*inputs))  # the single-device loop's reference
    adapters = [p for n, p in policy.named_parameters() if "lora_" in n]
    assert bool(adapters) == (lora is not None) and live.copied == sum(
        p.numel() for n, p in policy.named_parameters() if (p.requires_grad or other) and "lora_" not in n)
    with torch.no_grad():
        for p in policy.parameters():  # training moved every trained tensor, the adapters' B included
            if p.requires_grad:
                p.add_(0.05 * torch.randn_like(p))
        moved = policy(*inputs)
        with live.weights():
            as_reference = policy(*inputs)
        assert torch.equal(as_reference, start(*inputs))
        assert torch.equal(policy(*inputs), moved) and (moved - as_reference).abs().max() > 1e-3
    assert all(p.requires_grad for p in adapters)  # switched back on, still trained


def test_refusals(pairs, ds_config, tmp_path, capsys):
    """One line each, exit 2, before any rank starts."""
    base = _args(pairs, ds_config, tmp_path, "--preset", "llava-tiny", "--stages", "1")
    lines = refused([*base, "--beta", "0"], capsys)
    assert lines[-1].endswith("--beta: 0.0 must be > 0 (DPO's KL weight; TRL's default 0.1)"), lines
    sft = export_shapes(tmp_path / "sft", "llava-jsonl", 4)
    lines = refused(["--data", str(sft), *base[2:]], capsys)
    assert len(lines) == 1 and "holds no preference pairs" in lines[0], lines
    assert "has no preference pairs" in refused([*base[2:], "--data", "shapes"], capsys)[-1]
    odd = write_ds_config(tmp_path / "odd.json", train_micro_batch_size_per_gpu=3, gradient_accumulation_steps=1)
    assert "must be even" in refused([*base, "--ds-config", str(odd)], capsys)[-1]
    from mmpipe.cli import main
    assert main(["check", *base, "--dry-run"]) == 0  # check runs dpo with its reference (tests/test_dpo_check.py)
    capsys.readouterr()
    assert main(["check", *base, "--beta", "0"]) == 2 and capsys.readouterr().err.strip().splitlines()[-1].endswith(
        "--beta: 0.0 must be > 0 (DPO's KL weight; TRL's default 0.1)")  # check refuses as train does
    write_checkpoint(ReferenceModel(load_preset("tiny")), tmp_path / "tiny")
    assert refused([*base, "--reference", str(tmp_path / "tiny")], capsys)[-1].startswith(
        f"mmpipe: error: --reference: {tmp_path / 'tiny'} holds another model than this run trains (")
    assert refused([*base, "--reference", str(tmp_path)], capsys)[-1] == (
        f"mmpipe: error: --reference: {tmp_path} has no model.json (give an mmpipe run directory, e.g. "
        f"`mmpipe import --out`)")


def test_precomputed_reference_equals_live(pairs, ds_config, tmp_path, capsys):
    """(c) `mmpipe score-reference` writes every side's reference log-prob beside the data index; the single-device
    loop trained with --reference-logps (no reference model) equals the one with the live frozen copy (losses and
    weights 1e-6, 4 updates). Another model's or another index's file is refused by fingerprint, one line, exit 2."""
    from mmpipe.cli import main
    flags = ("--preset", "llava-tiny", "--stages", "1")
    assert main(["score-reference", *_args(pairs, ds_config, tmp_path / "score", *flags)]) == 0
    scored = tmp_path / "score" / "data" / "reference_logps.npz"
    assert "34 answers (17 pairs) scored" in capsys.readouterr().out
    runs = {}
    for name, extra in (("live", ()), ("pre", ("--reference-logps", str(scored)))):
        run = resolve(TrainArgs.from_argv(_args(pairs, ds_config, tmp_path / name, *flags, *extra)), world_size=1)
        runs[name] = train_reference(run, seed=3, steps=STEPS, out_dir=str(tmp_path / name))
    (live, live_losses), (pre, pre_losses) = runs["live"], runs["pre"]
    assert pre_losses[0] == pytest.approx(math.log(2), abs=1e-6)  # step 1: policy == reference
    # the runs trained: the last loss moved from ln 2 by far more than the 1e-6 the two runs are compared at (5.7e-5
    # here over 4 updates on the export's pairs, whose wrong answers have no order to learn without the image)
    assert pre_losses == pytest.approx(live_losses, abs=1e-6) and abs(pre_losses[-1] - live_losses[0]) > 20e-6
    diffs = {k: (v - live.state_dict()[k]).abs().max().item() for k, v in pre.state_dict().items()}
    assert max(diffs.values()) < 1e-6, max(diffs.items(), key=lambda kv: kv[1])
    assert_weights_moved(pre, ReferenceModel(run.model, seed=3), TOL, no_gradient=("k_proj.bias",))
    # refused by fingerprint: another seed's weights; another data file (the first 12 pairs of the same set)
    base = _args(pairs, ds_config, tmp_path / "other", *flags, "--reference-logps", str(scored))
    lines = refused([*base, "--seed", "4"], capsys)
    assert lines[-1].startswith(f"mmpipe: error: --reference-logps: {scored} was scored with another reference "
                                f"model (weights fingerprint "), lines
    write_checkpoint(ReferenceModel(run.model, seed=7), tmp_path / "base")  # --reference RUN: its layer files' bytes
    assert "was scored with another reference model" in refused([*base, "--reference", str(tmp_path / "base")],
                                                                capsys)[-1]
    fewer = pairs.parent / "fewer.jsonl"  # beside the images the records name
    fewer.write_text("".join(pairs.read_text().splitlines(keepends=True)[:12]))
    lines = refused([*base, "--data", str(fewer)], capsys)
    assert lines[-1].startswith(f"mmpipe: error: --reference-logps: {scored} was scored on another data index"), lines
    assert refused([*base[:-1], str(tmp_path / "none.npz")], capsys)[-1] == (
        f"mmpipe: error: --reference-logps: {tmp_path / 'none.npz'} is not a file (`mmpipe score-reference` writes "
        f"one; docs/dpo.md)")
    assert refused([*base, "--objective", "sft"], capsys)[-1] == (
        "mmpipe: error: --reference-logps: only --objective dpo reads reference log-probs (this run's objective is "
        "sft)")


def test_eval_preference_accuracy(pairs, ds_config, tmp_path, capsys):
    """`mmpipe eval --objective dpo` on a pair file: each pair's two summed answer log-probs equal the training rows'
    (row_logps over the training stream's micro-batch of the same sides), the accuracy is the share with the chosen
    one higher; with --reference, TRL's four rewards of those pairs; 3 bad pairs skipped; no pairs: one line, exit 2."""
    from mmpipe.cli import main
    run = resolve(TrainArgs.from_argv(_args(pairs, ds_config, tmp_path, "--preset", "llava-tiny", "--stages", "1")),
                  world_size=1)
    policy, ref = ReferenceModel(run.model, seed=1), ReferenceModel(run.model, seed=2)
    with torch.no_grad():
        for w in policy[-1].parameters():  # a sharper head: the two answers' log-probs clearly apart
            w.mul_(8)
    write_checkpoint(policy, tmp_path / "policy")
    write_checkpoint(ref, tmp_path / "ref")
    out = tmp_path / "ev" / "pairs.jsonl"
    assert main(["eval", "--objective", "dpo", "--checkpoint", str(tmp_path / "policy"), "--data", str(pairs),
                 "--out", str(out), "--reference", str(tmp_path / "ref"), "--beta", "0.2", "--batch-size", "6"]) == 0
    said = capsys.readouterr().out
    lines = [json.loads(x) for x in out.read_text().splitlines()]
    summary = json.loads((tmp_path / "ev" / "pairs.summary.json").read_text())
    # the training side: the stream's rows (shuffled by pair), each side's log-prob by its source row
    samples = prepare(run.data, run.model, tmp_path, 0, verbose=False)
    batches = rank_batches(run_dataset(run, samples), StepBatches(0, 34, 1, 0, 1))
    inputs, labels = next(batches)
    batches.close()
    with torch.no_grad():
        mine, theirs = row_logps(policy(*inputs), labels), row_logps(ref(*inputs), labels)
    by_row = {samples.row(p): (float(mine[p]), float(theirs[p])) for p in range(34)}
    assert len(lines) == summary["pairs"] == 17 and summary["bad_pairs"] == 3
    for line in lines:
        c, r = by_row[2 * line["pair"]], by_row[2 * line["pair"] + 1]
        assert [line["chosen_logp"], line["rejected_logp"], line["ref_chosen_logp"], line["ref_rejected_logp"]] == \
            pytest.approx([c[0], r[0], c[1], r[1]], abs=TOL), line
    correct = [by_row[2 * x["pair"]][0] > by_row[2 * x["pair"] + 1][0] for x in lines]
    assert summary["accuracy"] == sum(correct) / 17 and 0 < sum(correct) < 17, correct  # neither side always wins
    assert f"preference accuracy {sum(correct) / 17:.3f} ({sum(correct)}/17 pairs" in said
    chosen = [0.2 * (by_row[2 * x["pair"]][0] - by_row[2 * x["pair"]][1]) for x in lines]
    rejected = [0.2 * (by_row[2 * x["pair"] + 1][0] - by_row[2 * x["pair"] + 1][1]) for x in lines]
    assert summary["rewards/chosen"] == pytest.approx(sum(chosen) / 17, abs=TOL)
    assert summary["rewards/accuracies"] == pytest.approx(sum(a > b for a, b in zip(chosen, rejected)) / 17, abs=1e-6)
    sft = export_shapes(tmp_path / "sft", "llava-jsonl", 4)
    assert main(["eval", "--objective", "dpo", "--checkpoint", str(tmp_path / "policy"), "--data", str(sft),
                 "--out", str(out)]) == 2
    err = [x for x in capsys.readouterr().err.splitlines() if x.strip()]
    assert len(err) == 1 and "holds no preference pairs" in err[0], err


def validation_want(run, out, tmp_path, seed: int = 3) -> dict:
    """The validation of `run`'s 6 held-out pairs (--eval-data) by the final weights of the run in `out` against the
    starting model (its reference): the mean sigmoid DPO loss and TRL's four rewards, computed here, beta 0.1."""
    evalset = prepare_eval(run.eval_data, run.model, tmp_path, seed, 0, verbose=False)
    assert evalset.size == 12
    batches = rank_batches(run_dataset(run, evalset, train=False), [list(range(12))])
    inputs, labels = next(batches)
    batches.close()
    with torch.no_grad():
        pol = row_logps(load_reference(out / "checkpoints", run.model)(*inputs), labels).double()
        ref = row_logps(ReferenceModel(run.model, seed=seed)(*inputs), labels).double()
    chosen, rejected = 0.1 * (pol[0::2] - ref[0::2]), 0.1 * (pol[1::2] - ref[1::2])
    return {"eval_loss": float(-F.logsigmoid(chosen - rejected).mean()), "rewards/chosen": float(chosen.mean()),
            "rewards/rejected": float(rejected.mean()), "rewards/margins": float((chosen - rejected).mean()),
            "rewards/accuracies": float((chosen > rejected).double().mean())}


def test_validation_pairs(pairs, eval_pairs, ds_config, pp2, tmp_path):
    """The PP=2 run's validation after its last step (--eval-data: 6 held-out pairs, the live reference's pass
    through both stages first): the loss is the mean sigmoid DPO loss over the pairs and the four rewards TRL's,
    computed here from the run's final weights and the starting model (its reference), 1e-5; the two padding pairs
    of the second call count for nothing."""
    run = resolve(TrainArgs.from_argv(_args(pairs, ds_config, tmp_path, "--preset", "llava-tiny", "--stages", "1",
                                            "--eval-data", str(eval_pairs))), world_size=1)
    want = validation_want(run, pp2.out, tmp_path)
    rows = list(csv.DictReader(open(pp2.out / "eval_log.csv")))
    assert [int(r["step"]) for r in rows] == [STEPS] and int(rows[0]["eval_tokens"]) == 6  # the pairs counted
    assert {k: float(rows[0][k]) for k in want} == pytest.approx(want, abs=TOL)
    assert abs(want["rewards/margins"]) > 100 * TOL  # the policy moved off its reference
    summary = pp2.summary
    assert summary["eval_loss"] == pytest.approx(want["eval_loss"], abs=TOL)
    assert {k: summary[f"eval_{k}"] for k in REWARDS} == pytest.approx({k: want[k] for k in REWARDS}, abs=TOL)


def test_planner_counts_the_reference():
    """`mmpipe plan --dpo-reference`: live adds its forward-only pass before each step, (m + P - 1) slots of the
    slowest stage's forward + its activations' send + the slot overhead, and a copy of each stage's trained weights to
    its memory (a frozen tower holds none); precomputed adds nothing (llava-tiny, --freeze vision, PP=2, m = 8)."""
    from mmpipe.planning.costmodel import KNOWN_DEVICES, Shape, layer_costs
    from mmpipe.planning.layout import Training, plan_layout
    cfg, dev, shape = load_preset("llava-tiny"), KNOWN_DEVICES["h100-80gb"], Shape(2, 1, 4, 8)
    rows = layer_costs(cfg, ("vision",), 32)
    base, pre, live = (plan_layout(rows, shape, Training("bf16", 0, dev, freeze=("vision",), reference=r))
                       for r in ("", "precomputed", "live"))
    assert pre.step == base.step and pre.stage_rows == base.stage_rows and live.parts == base.parts
    forward = max(r["forward_ms"] for r in base.stage_rows) / 1e3
    extra = (8 + 2 - 1) * (forward + base.step["p2p_s"] / 2 + dev.microbatch_overhead)  # p2p_s: send + gradient back
    assert live.step["reference_s"] == pytest.approx(extra) and extra > 0.2 * base.step["step_s"]
    assert live.step["step_s"] == pytest.approx(base.step["step_s"] + extra)
    model = ReferenceModel(cfg, freeze=("vision",))
    one = [plan_layout(rows, Shape(1, 1, 4, 8), Training("bf16", 0, dev, freeze=("vision",), reference=r))
           for r in ("", "live")]  # PP=1: the tied embedding and head in one stage, one copy
    for base, live in ((base, live), one):
        for s, (a, b) in enumerate(zip(base.parts, base.parts[1:])):
            # a stage holds its own copy of a tied module (llava-tiny's head on stage 1: the embedding's weight)
            trained = {id(p): p.numel() for layer in list(model)[a:b] for p in
                       (layer.module if isinstance(layer, TiedCall) else layer).parameters() if p.requires_grad}
            more = (live.stage_rows[s]["memory_gib"] - base.stage_rows[s]["memory_gib"]) * 2 ** 30
            assert more == pytest.approx(2 * sum(trained.values()), rel=1e-9), s  # bf16 weights: 2 bytes each
    assert sum(p.numel() for p in model.parameters() if not p.requires_grad) > 0  # the frozen tower is not copied


def test_plan_front_door_reads_dpo_reference(capsys):
    """`mmpipe plan --dpo-reference live` through the command line: every predicted step carries the reference pass
    (a PlanSpec field order once dropped the flag's value on the way in); precomputed carries none."""
    from mmpipe.cli import main
    argv = ["plan", "--preset", "llava-tiny", "--gpus-per-node", "2", "--global-batch", "8", "--micro", "2",
            "--json", "--dpo-reference"]
    steps = {}
    for ref in ("live", "precomputed"):
        assert main([*argv, ref]) == 0
        steps[ref] = [lay["step"] for lay in json.loads(capsys.readouterr().out) if lay.get("step")]
    assert steps["live"] and all(s["reference_s"] > 0 for s in steps["live"])
    assert steps["precomputed"] and not any("reference_s" in s for s in steps["precomputed"])
