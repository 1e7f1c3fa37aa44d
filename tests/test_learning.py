"""The short version of the learning run (scripts/learning_curve.py holds the long one): the
default model, trained as a 2-stage pipeline for 1000 steps (~140 s here), reads the image - it
counts shapes, and its answers fall back to chance when the image is blanked out."""
from __future__ import annotations

from conftest import train_run


def test_two_stage_pipeline_learns_to_look_at_the_image(tmp_path):
    run = train_run(tmp_path, "--steps", "1000", "--eval-samples", "500").check()
    s = run.summary
    assert s["stages"] == 2 and s["preset"] == "small"
    chance = s["chance_accuracy"]
    assert chance <= 0.25
    # measured for this exact run (its LR schedule spans 1000 steps): 77.8% overall, counting 100%,
    # blank images 14%; at 700 steps it was 63% overall, too close to the bound to test there
    assert s["eval_per_type"]["count"] >= 0.85
    assert s["eval_accuracy"] >= 0.6
    # the same model with every image blanked is back near chance: the text alone does not answer
    assert s["blank_image_accuracy"] <= chance + 0.1
    assert s["final_loss"] < run.losses[1] / 5
