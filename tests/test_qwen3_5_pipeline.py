"""Qwen3.5 through the pipeline (issue 45): `mmpipe train --preset qwen3.5-tiny --pack` on a LLaVA-format set of
images of mixed sizes and text-only records, several samples per row, so every Gated DeltaNet layer restarts its
convolution and its recurrent state at sample starts inside a row (rows of 88 positions: the delta rule's chunk edge
at 64 falls inside a row too) on whichever stage it lands.

qwen3.5-tiny's layer list (tower of 2 blocks; decoder layers linear, linear, linear, full):

     0 Qwen3PatchEmbed   1, 2 tower blocks   3 Qwen3Merger   4 Qwen3Embed   5, 6, 7 DeltaNetBlock
     8 GatedAttentionBlock   9 Qwen35FinalNorm   10 head

Two configurations, each equal to the single-device reference loop (losses and weights, fp32, 1e-5):

- PP=4, cuts 5, 6, 8, everything trained: tower + embedding | linear layer 0 | linear layers 1, 2 | the
  full-attention layer and head (a cut before the first linear layer, one between two linear layers, one between a
  linear and the full layer);
- PP=2, cut 8, the tower frozen (--freeze vision): between the last linear layer and the full one; checkpointed at
  step 2, and that checkpoint resumed to step 5 is bit-identical to the uninterrupted run.

5 steps: DeepSpeed's WarmupCosineLR runs step 1 at lr 0, so the runs carry 4 real updates and the resume 3 (steps 3 to
5); each comparison also asserts the weights moved by more than 10 x its tolerance (conftest.assert_weights_moved).

Only `hidden` crosses a cut: a linear layer's state lives inside the layer and restarts at each sample, so no
recurrent state or convolution window travels between stages. Three launches in all (PP=4, PP=2, the resume): the
cut run is a copy of PP=2's directory as its step-2 checkpoint left it (tests/test_qwen3_vl_pipeline.py's way)."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_weights_moved
from mmpipe.config import load_preset
from mmpipe.model import ReferenceModel
from mmpipe.model import qwen3_5 as q35
from mmpipe.model.builder import layer_specs
from mmpipe.runtime.checkpoint import load_reference
from test_qwen_data import WORDS
from test_qwen_pipeline import PackedSet, _weights_equal_within, loaders_agree

TOL = 1e-5
STEPS, CUT, SEED = 5, 2, 7
SIZES = [(64, 64), (96, 64), (64, 128), (128, 96)]  # grids 1x4x4, 1x4x6, 1x8x4, 1x6x8 at patch 16
ANSWER_WORDS = WORDS[5:] + [f"w{i}" for i in range(40)]
P, TEXT, IMAGES = 128, 48, 4  # --max-patches, --text-len, --max-images
L = 2 * IMAGES + P // 4 + TEXT  # decoder positions per row: 2 specials per slot + 128 / 4 merged tokens + text = 88
PARTS = {4: [5, 6, 8], 2: [8]}


@pytest.fixture(scope="module")
def qwen3_5_set(tmp_path_factory):
    """The set and its runs (test_qwen_pipeline.PackedSet): 2 rows x 2 micro-batches a step."""
    return PackedSet(tmp_path_factory.mktemp("qwen3_5_pipe"), "qwen3.5-tiny", SIZES, 24, STEPS, SEED, PARTS)


@pytest.fixture(scope="module")
def reference(qwen3_5_set):
    return qwen3_5_set.reference()


@pytest.fixture(scope="module")
def reference_frozen(qwen3_5_set):
    return qwen3_5_set.reference("--freeze", "vision")


@pytest.fixture(scope="module")
def pp4(qwen3_5_set):
    return qwen3_5_set.launch("pp4", 4)


@pytest.fixture(scope="module")
def pp2(qwen3_5_set):
    """Tower frozen; also the uninterrupted run of the resume test, so it checkpoints at the cut too."""
    return qwen3_5_set.launch("pp2", 2, "--freeze", "vision", "--save-every", str(CUT))


def test_the_cuts_fall_between_the_layer_kinds():
    """The explicit cuts fall where the names say on qwen3.5-tiny's layer list (a changed list would otherwise
    silently move them): 5 between the embedding and the first linear layer, 6 between two linear layers, 8 between
    the last linear layer and the full-attention one."""
    kinds = [s.typename for s in layer_specs(load_preset("qwen3.5-tiny"))]
    assert kinds[4:10] == [q35.Qwen3Embed, q35.DeltaNetBlock, q35.DeltaNetBlock, q35.DeltaNetBlock,
                           q35.GatedAttentionBlock, q35.Qwen35FinalNorm]


def test_rows_pack_several_samples(qwen3_5_set):
    """What the runs train on: every row holds at least two samples (so a linear layer restarts inside it), rows mix
    image grids and text-only samples, and a later stage's loader gives the first stage's integer tensors."""
    run = qwen3_5_set.resolved()
    grids, text_only = set(), 0
    for pixels, ids, has_image, segments, tiling in loaders_agree(run, qwen3_5_set.root, SEED, STEPS):
        assert pixels.shape == (2, P, 3 * 2 * 16 * 16) and ids.shape == (2, L)
        for b in range(2):
            n = int(segments[b].max())
            assert n >= 2, segments[b]
            text_only += sum(int((has_image[b] == s).sum()) == 0 for s in range(1, n + 1))
        grids |= {tuple(g) for g in tiling.reshape(-1, 3).tolist() if any(g)}
    assert len(grids) >= 3 and text_only >= 1


def _vision(model) -> list[int]:
    """The tower's layers: what --freeze vision keeps at their initial weights."""
    return [i for i, layer in enumerate(model) if getattr(layer, "group", None) == "vision"]


@pytest.mark.parametrize("name, ref", [("pp4", "reference"), ("pp2", "reference_frozen")])
def test_pipeline_equals_single_device(name, ref, request):
    """PP=4 (cuts 5, 6, 8) and PP=2 (cut 8, tower frozen): each step's loss and the final weights are the reference
    loop's on the same packed rows (fp32, 1e-5)."""
    run, (ref_model, ref_losses) = request.getfixturevalue(name), request.getfixturevalue(ref)
    assert run.summary["parts"] == [0, *PARTS[run.summary["stages"]], len(ref_model)]
    assert sorted(run.losses) == list(range(1, STEPS + 1)) and abs(ref_losses[-1] - ref_losses[0]) > 1e-3
    assert list(run.losses.values()) == pytest.approx(ref_losses, abs=TOL)
    got = torch.nn.Sequential(*load_reference(run.out / "checkpoints", ref_model.cfg))
    _weights_equal_within(got, ref_model, TOL)
    # every trained tensor moved by more than 10 x TOL (the frozen tower is test_frozen_tower_...'s). Broken on
    # purpose (MMPIPE_TEST_BREAK=no_update PYTHONPATH=tests/breaks: AdamW.step a no-op in the ranks and the
    # reference) every comparison above passed and this failed: PP=2, 61 of 61 trained tensors moved 0 (run once)
    frozen = tuple(f"{i}." for i in _vision(ref_model)) if run.summary["freeze"] else ()
    assert_weights_moved(got, ReferenceModel(ref_model.cfg, seed=SEED), TOL, frozen)


def test_only_hidden_crosses(pp4, pp2):
    """One float message per cut and micro-batch, the row's hidden [2, 88, 64]: no recurrent state, convolution
    window or integer tensor crosses (the segments, ids and grids come from each stage's own loader)."""
    row = f"2x{L}x64"
    for run in (pp4, pp2):
        run.assert_only_floats_crossed(per_forward=1)
        for rank in range(run.summary["stages"]):
            assert {shape for kind, _, shape in run.wire(rank) if kind == "data"} == {row}, rank


def test_frozen_tower_is_bit_identical_and_trained_tower_moves(pp4, pp2, reference_frozen):
    """--freeze vision keeps the patch embedding and the tower's blocks at their initial weights through the
    pipeline, while the merger and every Gated DeltaNet layer train; with the tower trained every tower tensor
    moves."""
    cfg = reference_frozen[0].cfg
    init = ReferenceModel(cfg, seed=SEED)
    frozen, trained = (load_reference(r.out / "checkpoints", cfg) for r in (pp2, pp4))
    vision = _vision(init)
    assert len(vision) == 1 + cfg.vision.n_layers and pp2.summary["freeze"] == ["vision"]
    for i in vision:
        for k, v in init[i].state_dict().items():
            assert torch.equal(frozen[i].state_dict()[k], v), (i, k)
            assert not torch.equal(trained[i].state_dict()[k], v), (i, k)
    for i, layer in enumerate(init):
        if isinstance(layer, q35.Qwen3Merger):
            assert not torch.equal(frozen[i].linear_fc1.weight, layer.linear_fc1.weight), i
        if isinstance(layer, q35.DeltaNetBlock):  # its decays and its short convolution
            assert not torch.equal(frozen[i].linear_attn.A_log, layer.linear_attn.A_log), i
            assert not torch.equal(frozen[i].linear_attn.conv1d.weight, layer.linear_attn.conv1d.weight), i


def test_resume_is_bit_exact(qwen3_5_set, pp2):
    """PP=2 cut after step 2 (its checkpoint) and resumed to the end: the uninterrupted run's losses and weights, bit
    for bit, over 3 resumed updates that moved every trained tensor by more than 10 x TOL from the cut's weights
    (test_qwen_pipeline.PackedSet.assert_resume_bit_exact). A resume that trained nothing would pass the first check
    alone: with AdamW.step a no-op (MMPIPE_TEST_BREAK=no_update) the first passed and the second failed, 61 of 61
    tensors moved 0."""
    qwen3_5_set.assert_resume_bit_exact(pp2, CUT, 2, "--freeze", "vision")
