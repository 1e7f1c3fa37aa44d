"""The internvl family through the pipeline (issue 55), one launch: `mmpipe train --preset internvl-tiny --pack` on a
LLaVA-format set of images of five tilings (1 tile, 1 x 2, 2 x 1, 2 x 2 and 1 x 3 tiles of 28 px, each with its
thumbnail but the one-tile image; they differ within a row and a micro-batch), conversations of 1 to 3 images and
text-only records. PP=2 cut inside the tower (stage 0: the patch embedding and the first InternViT block; stage 1:
the second block, the projector that lays each image's crops onto its placeholders by the tilings its own loader
gives, the Qwen3 decoder, the head) equals the single-device reference loop (every step's loss, the final weights;
fp32, 1e-5) after 3 updates at nonzero lr, every trained tensor moved, only floats crossing the cut."""
from __future__ import annotations

import json

import pytest

from conftest import train_run, write_ds_config
from fixtures_data import mixed_image_records
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.reference import train_reference
from test_anyres_data import WORDS, tokenizer
from test_internvl import image
from test_qwen_pipeline import assert_trained_as_reference, loaders_agree, sample_image_counts

TOL = 1e-5
STEPS, SEED, T = 4, 5, 12  # step 1 runs at lr 0 (WarmupCosineLR): 3 updates
# (width, height): 1 tile, 1 x 2, 2 x 1, 2 x 2, 1 x 3 tiles (rows x cols) of 28 px
SIZES = [(30, 26), (60, 28), (28, 62), (70, 66), (90, 30)]
ANSWER_WORDS = WORDS[6:18]


@pytest.fixture(scope="module")
def internvl_set(tmp_path_factory):
    """(root, the arguments every run shares): 2 rows x 2 micro-batches a step, a fixed-length LR schedule."""
    root = tmp_path_factory.mktemp("internvl_pipe")
    for k, (w, h) in enumerate(SIZES):
        image(w, h, k).save(root / f"{k}.png")
    (root / "data.json").write_text(json.dumps(mixed_image_records(30, len(SIZES), ANSWER_WORDS,
                                                                   lambda rnd, i: 1 + i % 6)))
    tokenizer().save_pretrained(root / "tok")
    ds = write_ds_config(root / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                         scheduler={"type": "WarmupCosineLR",
                                    "params": {"total_num_steps": 2 * STEPS, "warmup_num_steps": 1,
                                               "warmup_type": "linear", "warmup_min_ratio": 0.5}})
    args = ["--preset", "internvl-tiny", "--data", str(root / "data.json"), "--tokenizer", str(root / "tok"),
            "--ds-config", str(ds), "--text-len", "40", "--pack", "--max-images", "4", "--max-tiles", str(T),
            "--eval-samples", "0", "--seed", str(SEED), "--data-workers", "0"]
    return root, args


def _resolved(internvl_set):
    root, args = internvl_set
    return resolve(TrainArgs.from_argv([*args, "--stages", "1", "--output-dir", str(root / "ref")]), world_size=1)


@pytest.fixture(scope="module")
def reference(internvl_set):
    return train_reference(_resolved(internvl_set), seed=SEED, steps=STEPS, out_dir=str(internvl_set[0] / "ref"))


@pytest.fixture(scope="module")
def pp2(internvl_set):
    root, args = internvl_set  # layers: 0 patch embed, 1-2 InternViT blocks, 3 projector, 4 embed, 5-6 decoder, 7-8
    return train_run(root / "pp2", *args, "--stages", "2", "--steps", str(STEPS), "--partition", "2").check()


def test_rows_mix_tilings_images_and_text_only(internvl_set):
    """What the run trains on: packed rows whose tilings differ within a row and a micro-batch, samples of 0 to 3
    images; a later stage's loader (no image decoded) gives the first stage's tilings."""
    run = _resolved(internvl_set)
    images_per_sample, text_only, mixed_rows = set(), 0, 0
    for pixels, ids, has_image, segments, tiling in loaders_agree(run, internvl_set[0], SEED, STEPS):
        assert pixels.shape == (2, T, 3, 28, 28) and tiling.shape[-1] == 4
        crops = ((1 + tiling[..., 2] * tiling[..., 3]) * (has_image > 0)).sum(-1)
        assert (crops <= T).all() and all(not pixels[b, c:].any() for b, c in enumerate(crops.tolist()))
        grids = [{tuple(g[2:]) for g in row.tolist() if any(g)} for row in tiling]
        assert len(set.union(*grids)) >= 2
        mixed_rows += sum(len(g) >= 2 for g in grids)
        for counts in sample_image_counts(has_image, segments):
            images_per_sample.update(counts)
            text_only += counts.count(0)
    assert {0, 1, 2} <= images_per_sample and text_only >= 2 and mixed_rows >= STEPS


def test_pp2_cut_inside_the_tower_equals_single_device(pp2, reference):
    """Each step's loss and the final weights are the reference loop's (fp32, 1e-5), every trained tensor moved
    > 10 x 1e-5 from the seed's init; one float message per micro-batch forward, the tower's [B x T, 1 + 16, 16]."""
    ref_model, ref_losses = reference
    assert sorted(pp2.losses) == list(range(1, STEPS + 1)) and abs(ref_losses[-1] - ref_losses[0]) > 1e-3
    assert list(pp2.losses.values()) == pytest.approx(ref_losses, abs=TOL)
    assert_trained_as_reference(pp2, ref_model, SEED, TOL)
    pp2.assert_only_floats_crossed(per_forward=1)
    assert pp2.summary["parts"] == [0, 2, 9]
    assert {shape for kind, _, shape in pp2.wire(0) if kind == "data"} == {f"{2 * T}x17x16"}
