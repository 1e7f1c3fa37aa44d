"""--objective dpo: the tower encodes each pair's images once (issue 56, Deliver 2). A pair's chosen and rejected rows
(2i, 2i + 1) hold the same images in the same slots, so the micro-batch carries them once (pixels [B / 2, ...]) and
the layer that places the tower's output reads slot (2i + s, m) from image (i, m): the tower embeds half the patches
it embedded with an image per side, and the loss and every gradient (the tower's the sum of its two uses) equal the
twice-encoded path's. In process: one packed, balanced micro-batch per family, policy and reference of other seeds."""
from __future__ import annotations

import copy
import json

import pytest
import torch

from conftest import write_ds_config
from mmpipe.config import PRESET_DIR
from mmpipe.data.batches import StepBatches, rank_batches
from mmpipe.data.dataset import prepare
from mmpipe.data.export import export_shapes
from mmpipe.model import ReferenceModel
from mmpipe.model.dpo import dpo_labels, row_logps
from mmpipe.model.objectives import dpo
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.feed import run_dataset, share_pair_images, step_order

TOL = 1e-6
# the crop families' gradients reach 3 to 10 here (each image's crops laid out by its tiling, the head x 8), where
# fp32's rounding of the two paths' summation orders is ~4e-7 of that (1.4e-6 / 3.3e-6 apart in fp32): their models
# run in float64 (3.6e-15 / 4.6e-9 apart: InternViT's RMSNorm computes in float32 either way)
FLOAT64 = ("llava-next-tiny", "internvl-tiny")


@pytest.fixture(scope="module")
def pairs(tmp_path_factory):
    d = tmp_path_factory.mktemp("image_once")
    return export_shapes(d, "dpo-jsonl", 12), write_ds_config(d / "ds.json", train_micro_batch_size_per_gpu=4,
                                                              gradient_accumulation_steps=1)


def _run(pairs, out, preset: str):
    data, ds_config = pairs
    return resolve(TrainArgs.from_argv(
        ["--data", str(data), "--objective", "dpo", "--ds-config", str(ds_config), "--steps", "1", "--output-dir",
         str(out), "--stages", "1", "--eval-samples", "0", "--seed", "3", "--preset", preset, "--pack",
         "--text-len", "24"]), world_size=1)  # the context then holds several pairs' images a row (llava-tiny 2)


def _micro_batch(data, run, samples):
    """The first micro-batch of the run's balanced layout (its rows reordered by cost, pairs kept whole)."""
    batches = rank_batches(data, StepBatches(0, run.micro, 1, 0, 1, step_order(run, samples, data.plan)))
    try:
        return next(batches)
    finally:
        batches.close()


def _loss_and_grads(model, ref_model, inputs, labels):
    """The DPO (+ RPO) loss of one micro-batch and every parameter's gradient; the tower's patches (the first vision
    layer's output rows x tokens) counted by a hook."""
    patches = []
    hook = model[0].register_forward_hook(lambda m, a, out: patches.append(out[0].shape[0] * out[0].shape[1]))
    try:
        model.zero_grad()
        with torch.no_grad():
            labels = dpo_labels(inputs, labels, None, True)
            labels = dpo_labels(inputs, labels, row_logps(ref_model(*inputs), labels), True)
        loss = dpo(0.1, "sigmoid", 0.5).loss(model(*inputs), labels)
        loss.backward()
    finally:
        hook.remove()
    return float(loss.detach()), {k: p.grad.clone() for k, p in model.named_parameters()}, patches[0]


def _preset(preset: str, tmp_path) -> str:
    """A preset name, or "gemma4-tiny-list": gemma4-tiny with images as patch lists (max_soft_tokens 70: at most 630
    patches an image, each slot's grid in tiling), the tower's grids read for the even rows (rows.tower_rows)."""
    if preset != "gemma4-tiny-list":
        return preset
    cfg = json.loads((PRESET_DIR / "gemma4-tiny.json").read_text())
    cfg["vision"].update(max_soft_tokens=70, position_table=210)  # sides of up to 210 patches
    path = tmp_path / f"{preset}.json"
    path.write_text(json.dumps(cfg))
    return str(path)


@pytest.mark.parametrize("preset", ["llava-tiny", "qwen-tiny", "gemma4-tiny", "gemma4-tiny-list", "llava-next-tiny",
                                    "internvl-tiny", "tiny-xattn"])
def test_tower_encodes_each_pair_once(preset, pairs, tmp_path):
    run = _run(pairs, tmp_path, _preset(preset, tmp_path))
    assert share_pair_images(run)
    samples = prepare(run.data, run.model, tmp_path, 3, verbose=False)
    once = run_dataset(run, samples)
    twice = copy.copy(once)
    twice.share_pairs = False  # today's path before this change: every row its own images
    (px1, *ints1), labels1 = _micro_batch(once, run, samples)
    (px2, *ints2), labels2 = _micro_batch(twice, run, samples)
    assert all(torch.equal(a, b) for a, b in zip((*ints1, *labels1), (*ints2, *labels2)))  # the same rows
    # the premise: a pair's two rows read the same images; carried once, they are the chosen rows'
    assert torch.equal(px2[0::2], px2[1::2]) and torch.equal(px1, px2[0::2])
    model, ref_model = ReferenceModel(run.model, seed=1), ReferenceModel(run.model, seed=2)
    if preset in FLOAT64:
        model, ref_model = model.double(), ref_model.double()
    with torch.no_grad():
        for w in model[-1].parameters():  # a sharper head: log-probs far from uniform, the loss far from ln 2
            w.mul_(8)
        for k, w in [*model.named_parameters(), *ref_model.named_parameters()]:
            if k.endswith(("attn_gate", "mlp_gate")):  # cross-attention's gates open (0 at init: the image unread)
                w.fill_(0.5)
    loss1, grads1, patches1 = _loss_and_grads(model, ref_model, (px1, *ints1), labels1)
    loss2, grads2, patches2 = _loss_and_grads(model, ref_model, (px2, *ints2), labels2)
    assert 2 * patches1 == patches2 > 0
    assert loss1 == pytest.approx(loss2, abs=TOL)
    tower = {f"{i}." for i, layer in enumerate(model) if getattr(layer, "group", "") in ("vision", "projector")}
    tower_grads = [k for k in grads1 if k.split(".")[0] + "." in tower]
    assert tower_grads and max(grads2[k].abs().max().item() for k in tower_grads) > 1e3 * TOL  # the tower trains
    worst = max(grads1, key=lambda k: (grads1[k] - grads2[k]).abs().max().item())
    assert (grads1[worst] - grads2[worst]).abs().max().item() < TOL, worst


def test_a_rejected_row_must_follow_its_chosen_row(pairs, tmp_path):
    """A micro-batch whose rejected row is not right after its chosen row (whose images it reads) is refused, never
    given another pair's image."""
    run = _run(pairs, tmp_path, "llava-tiny")
    data = run_dataset(run, prepare(run.data, run.model, tmp_path, 3, verbose=False))
    batches = rank_batches(data, [[1, 0, 2, 3]])
    with pytest.raises(ValueError, match="each chosen row followed by its rejected row"):
        next(batches)
    batches.close()
