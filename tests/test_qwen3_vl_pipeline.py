"""Qwen3-VL through the pipeline (issue 41): `mmpipe train --preset qwen3-vl-tiny --pack` on a LLaVA-format set of
images of mixed sizes and aspect ratios (grids differ within a row and a micro-batch), conversations of several
images and text-only records, with DeepStack's three merged feature sets carried as float stage fields from the
merger that makes each to the decoder add that reads it.

qwen3-vl-tiny's layer list (tower of 4 blocks, DeepStack after blocks 0, 1, 3; decoder of 4 layers):

     0 Qwen3PatchEmbed   1 block 0   2 DeepstackMerger0   3 block 1   4 DeepstackMerger1   5 block 2   6 block 3
     7 DeepstackMerger2  8 Qwen3Merger   9 Qwen3Embed   10 decoder 0   11 DeepstackAdd0   12 decoder 1
    13 DeepstackAdd1    14 decoder 2    15 DeepstackAdd2   16 decoder 3   17 FinalNorm   18 head

Two configurations, each equal to the single-device reference loop (losses and weights, fp32, 1e-5):

- PP=4, tower trained, cuts 5, 11, 13: inside the tower before the last DeepStack merger (stage 0 sends hidden and
  the two sets made so far), after decoder layer 0 before its add (all three sets cross), after decoder layer 1
  before its add (set 0 already added and dropped: two cross);
- PP=2, tower frozen, cut 5: inside the frozen tower after two trained DeepStack mergers (the tower's hidden, which
  carries no graph, crosses beside two sets that do: DeepSpeed's backward takes both, mmpipe.runtime.pipeline);
  checkpointed at step 2, and that checkpoint resumed to step 5 is bit-identical to the uninterrupted run.

Three launches in all (PP=4, PP=2, the resume): the cut run is a copy of PP=2's directory as its step-2 checkpoint
left it (tests/test_qwen_pipeline.py's way)."""
from __future__ import annotations

from collections import Counter

import pytest
import torch

from mmpipe.config import load_preset
from mmpipe.model import ReferenceModel
from mmpipe.model import qwen3_vl as q3
from mmpipe.model.builder import layer_specs
from mmpipe.runtime.checkpoint import load_reference
from test_qwen_data import WORDS
from test_qwen_pipeline import PackedSet, assert_trained_as_reference, loaders_agree, sample_image_counts

TOL = 1e-5
STEPS, CUT, SEED = 5, 2, 5  # step 1 runs at lr 0: 4 updates, the resume 3 (steps 3 to 5)
# (width, height) at patch 16: grids (t, h, w) 1x4x4, 1x4x6, 1x8x4, 1x6x8, 1x4x10, and 400x300 resized down to fit
# max_pixels 128 x 128 (16 384 px = 64 patches)
SIZES = [(64, 64), (96, 64), (64, 128), (128, 96), (160, 64), (400, 300)]
ANSWER_WORDS = WORDS[5:] + [f"w{i}" for i in range(40)]
P, TEXT, IMAGES = 128, 48, 4  # --max-patches, --text-len, --max-images
L = 2 * IMAGES + P // 4 + TEXT  # decoder positions per row: 2 specials per slot + 128 / 4 merged tokens + text = 88
PARTS = {4: [5, 11, 13], 2: [5]}


@pytest.fixture(scope="module")
def qwen3_set(tmp_path_factory):
    """The set and its runs (test_qwen_pipeline.PackedSet): 2 rows x 2 micro-batches a step."""
    return PackedSet(tmp_path_factory.mktemp("qwen3_pipe"), "qwen3-vl-tiny", SIZES, 36, STEPS, SEED, PARTS)


@pytest.fixture(scope="module")
def reference(qwen3_set):
    return qwen3_set.reference()


@pytest.fixture(scope="module")
def reference_frozen(qwen3_set):
    return qwen3_set.reference("--freeze", "vision")


@pytest.fixture(scope="module")
def pp4(qwen3_set):
    return qwen3_set.launch("pp4", 4)


@pytest.fixture(scope="module")
def pp2_frozen(qwen3_set):
    """Tower frozen; also the uninterrupted run of the resume test, so it checkpoints at the cut too."""
    return qwen3_set.launch("pp2", 2, "--freeze", "vision", "--save-every", str(CUT))


def test_rows_mix_grids_images_and_text_only(qwen3_set):
    """What the runs train on: packed rows whose image grids differ within a row and within each micro-batch,
    conversations of 2 and 3 images, text-only samples, each image's t h w / 4 placeholders; a later stage's loader
    (no image decoded) gives the first stage's grids."""
    run = qwen3_set.resolved()
    images_per_sample, text_only, mixed_rows = set(), 0, 0
    for pixels, ids, has_image, segments, tiling in loaders_agree(run, qwen3_set.root, SEED, STEPS):
        assert pixels.shape == (2, P, 3 * 2 * 16 * 16) and tiling.shape == (2, IMAGES, 3) and ids.shape == (2, L)
        n_tokens = (tiling.prod(-1) * (has_image > 0)).sum(-1) // 4
        assert torch.equal((ids == run.model.image_token_id).sum(-1), n_tokens)
        grids = [{tuple(g) for g in row.tolist() if any(g)} for row in tiling]
        assert len(set.union(*grids)) >= 2
        mixed_rows += sum(len(g) >= 2 for g in grids)
        for counts in sample_image_counts(has_image, segments):
            assert len(counts) >= 2  # packed
            images_per_sample.update(counts)
            text_only += counts.count(0)
    assert {0, 1, 2, 3} <= images_per_sample and text_only >= 2 and mixed_rows >= STEPS * run.gas


def test_the_cuts_are_where_the_issue_asks():
    """The explicit cuts above fall where the names say on qwen3-vl-tiny's layer list (a changed list would
    otherwise silently move them): 5 inside the tower before the last DeepStack merger, 11 and 13 between decoder
    layers 0 and 2 (each before an add), 9 between the merger and the text embedding."""
    kinds = [s.typename for s in layer_specs(load_preset("qwen3-vl-tiny"))]
    blocks = [i for i, k in enumerate(kinds) if k is q3.Qwen3Block]
    assert kinds[4] is q3.DEEPSTACK_MERGERS[1] and kinds[5] is q3.Qwen3VisionBlock
    assert kinds.index(q3.DEEPSTACK_MERGERS[2]) == 7  # the last merger, after the cut at 5
    assert blocks[0] < 11 < 13 < blocks[2] and kinds[11] is q3.DEEPSTACK_ADDS[0] and kinds[13] is q3.DEEPSTACK_ADDS[1]
    assert kinds[8] is q3.Qwen3Merger and kinds[9] is q3.Qwen3Embed


@pytest.mark.parametrize("name, ref", [("pp4", "reference"), ("pp2_frozen", "reference_frozen")])
def test_pipeline_equals_single_device(name, ref, request):
    """PP=4 with the tower trained, PP=2 with it frozen: each step's loss and the final weights are the reference
    loop's on the same rows (fp32, 1e-5), every DeepStack set crossing the cuts between its merger and its add."""
    run, (ref_model, ref_losses) = request.getfixturevalue(name), request.getfixturevalue(ref)
    assert run.summary["parts"] == [0, *PARTS[run.summary["stages"]], len(ref_model)]
    assert sorted(run.losses) == list(range(1, STEPS + 1)) and abs(ref_losses[-1] - ref_losses[0]) > 1e-3
    assert list(run.losses.values()) == pytest.approx(ref_losses, abs=TOL)
    assert_trained_as_reference(run, ref_model, SEED, TOL)  # and every trained tensor moved > 10 x TOL


def test_only_floats_cross_and_each_set_travels_from_its_merger_to_its_add(pp4, pp2_frozen):
    """Only float tensors cross, one message per field live at the cut per micro-batch: hidden, then each DeepStack
    set made before the cut and not yet added, [B, P / 4, D_text] = 2 x 32 x 64 each:

        PP=4  cut 5 (tower):                hidden 2x128x32 (P patches of D_v), sets 0, 1
              cut 11 (after decoder 0):     hidden 2x88x64 (L positions), sets 0, 1, 2
              cut 13 (after decoder 1):     hidden 2x88x64, sets 1, 2 (set 0 added at 11 and dropped)
        PP=2  cut 5 (frozen tower):         hidden 2x128x32, sets 0, 1

    Rank r sends its cut's tensors forward and the gradients of the cut before it backward, once per micro-batch
    (GAS 2 x 5 steps = 10), and a forward comes first. With a set left out the receiving stage's tuple would not
    unpack; with one kept after its add every later cut would send it."""
    ds, row = "2x32x64", f"2x{L}x64"
    cuts = {"pp4": [["2x128x32", ds, ds], [row, ds, ds, ds], [row, ds, ds]], "pp2": [["2x128x32", ds, ds]]}
    micro = 2 * STEPS
    for run, name in ((pp4, "pp4"), (pp2_frozen, "pp2")):
        run.assert_only_floats_crossed(per_forward=len(cuts[name][0]))
        for rank in range(len(cuts[name]) + 1):
            forward = cuts[name][rank] if rank < len(cuts[name]) else []
            backward = cuts[name][rank - 1] if rank > 0 else []
            sent = [shape for kind, _, shape in run.wire(rank) if kind == "data"]
            assert Counter(sent) == Counter((forward + backward) * micro), (name, rank, Counter(sent))
            assert sent[:len(forward)] == forward, (name, rank, sent[:4])


def test_frozen_tower_is_bit_identical_and_trained_tower_moves(pp4, pp2_frozen, reference_frozen):
    """--freeze vision keeps the patch embedding and the tower's blocks at their initial weights through the
    pipeline while DeepStack's mergers (group projector) train; with the tower trained every tower tensor moves."""
    cfg = reference_frozen[0].cfg
    init = ReferenceModel(cfg, seed=SEED)
    frozen, trained = (load_reference(r.out / "checkpoints", cfg) for r in (pp2_frozen, pp4))
    vision = [i for i, layer in enumerate(init) if getattr(layer, "group", None) == "vision"]
    assert len(vision) == 1 + cfg.vision.n_layers and pp2_frozen.summary["freeze"] == ["vision"]
    for i in vision:
        for k, v in init[i].state_dict().items():
            assert torch.equal(frozen[i].state_dict()[k], v), (i, k)
            assert not torch.equal(trained[i].state_dict()[k], v), (i, k)
    for i, layer in enumerate(init):
        if isinstance(layer, q3.DeepstackMerger):
            assert not torch.equal(frozen[i].linear_fc1.weight, layer.linear_fc1.weight), i


def test_resume_is_bit_exact(qwen3_set, pp2_frozen):
    """PP=2 cut after step 2 (its checkpoint) and resumed to the end: the uninterrupted run's losses and weights, bit
    for bit (test_qwen_pipeline.PackedSet.assert_resume_bit_exact)."""
    qwen3_set.assert_resume_bit_exact(pp2_frozen, CUT, 2, "--freeze", "vision")
