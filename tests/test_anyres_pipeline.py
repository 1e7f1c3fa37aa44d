"""The llava_next family through the pipeline (issue 33): `mmpipe train --preset llava-next-tiny --pack` on a
LLaVA-format set of images of mixed aspect ratios (1 x 2, 2 x 1, 2 x 2 and 1 x 1 tile grids, which differ within a
row and a micro-batch), conversations of 2 and 3 images, text-only records. PP=2 and PP=4 equal the single-device
reference loop (losses, weights; fp32, 1e-5) while only floats cross the stage boundaries and every stage takes
the tilings from its own loader (PP=4 cut after the tower: the projector, which lays the tiles out by them, runs
on stage 1). Two launches in all."""
from __future__ import annotations

import json

import pytest

from conftest import train_run, write_ds_config
from fixtures_data import mixed_image_records
from llava_next_models import image
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.reference import train_reference
from test_anyres_data import WORDS, tokenizer
from test_qwen_pipeline import assert_trained_as_reference, loaders_agree, sample_image_counts

TOL = 1e-5
STEPS, SEED, T = 4, 5, 12  # step 1 runs at lr 0 (WarmupCosineLR): 3 updates
# (width, height): tile grids 1 x 2, 2 x 1, 2 x 2, 1 x 1, 1 x 2 (rows x cols)
SIZES = [(100, 40), (40, 100), (100, 100), (56, 56), (150, 70)]
ANSWER_WORDS = WORDS[6:18]


def _records(n: int) -> list[dict]:
    """n conversations of 0 (text-only), 1, 2 or 3 images (distinct sizes), answers of 1..6 words."""
    return mixed_image_records(n, len(SIZES), ANSWER_WORDS, lambda rnd, i: 1 + i % 6)


@pytest.fixture(scope="module")
def anyres_set(tmp_path_factory):
    """(root, the arguments every run shares): 2 rows x 2 micro-batches a step, a fixed-length LR schedule."""
    root = tmp_path_factory.mktemp("anyres_pipe")
    for k, (w, h) in enumerate(SIZES):
        image(w, h, k).save(root / f"{k}.png")
    (root / "data.json").write_text(json.dumps(_records(30)))
    tokenizer().save_pretrained(root / "tok")
    ds = write_ds_config(root / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                         scheduler={"type": "WarmupCosineLR",
                                    "params": {"total_num_steps": 2 * STEPS, "warmup_num_steps": 1,
                                               "warmup_type": "linear", "warmup_min_ratio": 0.5}})
    args = ["--preset", "llava-next-tiny", "--data", str(root / "data.json"), "--tokenizer", str(root / "tok"),
            "--ds-config", str(ds), "--text-len", "40", "--pack", "--max-images", "4", "--max-tiles", str(T),
            "--eval-samples", "0", "--seed", str(SEED), "--data-workers", "0"]
    return root, args


def _resolved(anyres_set):
    root, args = anyres_set
    return resolve(TrainArgs.from_argv([*args, "--stages", "1", "--output-dir", str(root / "ref")]), world_size=1)


@pytest.fixture(scope="module")
def reference(anyres_set):
    return train_reference(_resolved(anyres_set), seed=SEED, steps=STEPS, out_dir=str(anyres_set[0] / "ref"))


PARTS = {2: (), 4: ("--partition", "3,5,7")}  # PP=4: tower | AnyresProjector, AnyresEmbed | 2 LlamaBlocks | head


@pytest.fixture(scope="module")
def runs(anyres_set):
    root, args = anyres_set
    return {stages: train_run(root / f"pp{stages}", *args, "--stages", str(stages), "--steps", str(STEPS),
                              *PARTS[stages]).check() for stages in (2, 4)}


def test_rows_mix_aspect_ratios_images_and_text_only(anyres_set):
    """What the runs train on: packed rows whose tile grids differ within a row and within each micro-batch,
    conversations of 2 and 3 images, text-only samples, each row's placeholders its images' counts; a later
    stage's loader (no image decoded) gives the first stage's tilings."""
    run = _resolved(anyres_set)
    images_per_sample, text_only, mixed_rows = set(), 0, 0
    for pixels, ids, has_image, segments, tiling in loaders_agree(run, anyres_set[0], SEED, STEPS):
        assert pixels.shape == (2, T, 3, 56, 56) and tiling.shape == (2, 4, 4)
        crops = ((1 + tiling[..., 2] * tiling[..., 3]) * (has_image > 0)).sum(-1)
        assert (crops <= T).all() and all(not pixels[b, c:].any() for b, c in enumerate(crops.tolist()))
        grids = [{tuple(g[2:]) for g in row.tolist() if any(g)} for row in tiling]
        assert len(set.union(*grids)) >= 2  # tile grids differ within the micro-batch
        mixed_rows += sum(len(g) >= 2 for g in grids)  # and within a row
        for counts in sample_image_counts(has_image, segments):
            images_per_sample.update(counts)
            text_only += counts.count(0)
    assert {0, 1, 2, 3} <= images_per_sample and text_only >= 2 and mixed_rows >= STEPS


@pytest.mark.parametrize("stages", [2, 4])
def test_pipeline_equals_single_device(stages, runs, reference):
    """PP=2 and PP=4: each step's loss and the final weights are the reference loop's on the same rows (fp32)."""
    run, (ref_model, ref_losses) = runs[stages], reference
    assert sorted(run.losses) == list(range(1, STEPS + 1)) and abs(ref_losses[-1] - ref_losses[0]) > 1e-3
    assert list(run.losses.values()) == pytest.approx(ref_losses, abs=TOL)
    # and every tensor moved > 10 x TOL but the CLIP tower's key biases: no rotary there, so softmax cancels their
    # gradient and they move by rounding alone (3.3e-7 to 4.0e-7 measured)
    assert_trained_as_reference(run, ref_model, SEED, TOL, no_gradient=("self_attn.k_proj.bias",))


def test_only_floats_cross_and_the_projector_takes_the_tilings_from_its_loader(runs):
    """One float message per micro-batch forward, never an integer tensor. PP=4's stage 1 holds the projector: it
    receives the tower's features of the row's T crops, [B x T, 1 + N, D_v], and lays each image's tiles out by
    the tilings its own loader gives (no image decoded there); the reference match above holds with it."""
    for run in runs.values():
        run.assert_only_floats_crossed(per_forward=1)
    assert runs[4].summary["parts"] == [0, 3, 5, 7, 9]
    shapes = {shape for kind, _, shape in runs[4].wire(0) if kind == "data"}
    assert shapes == {f"{2 * T}x17x32"}, shapes
