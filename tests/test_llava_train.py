"""`mmpipe train --preset llava-tiny`: the LLaVA family on the built-in shapes set, the image on
<image> placeholders after BOS. The 2-stage pipeline's losses equal the single-device reference's;
the layout of a sample with and without an image; the decoder positions positions/s counts."""
from __future__ import annotations

import numpy as np
import pytest

from conftest import train_run
from mmpipe.data.packing import FixedBlocks, RowShape, sample_sequence
from mmpipe.data.text import Encoded
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.reference import train_reference

TOL = 1e-5
STEPS = 3


def _args(cfg, *extra):
    return ["--preset", "llava-tiny", "--ds-config", str(cfg), "--steps", str(STEPS), "--eval-samples", "0",
            "--seed", "3", *extra]


def test_placeholders_after_bos_and_text_only_without():
    e = Encoded(np.array([1, 7, 8, 9, 2]), np.array([False, False, False, True, True]))
    shape = RowShape(max_images=1, text_len=6, images=FixedBlocks(image_len=3, image_id=50))
    ids, labels = sample_sequence(e, 1, shape)
    assert ids.tolist() == [1, 50, 50, 50, 7, 8, 9, 2]
    assert labels.tolist() == [-100] * 5 + [9, 2, -100]  # position p predicts p + 1's token
    ids, labels = sample_sequence(e, 0, shape)
    assert ids.tolist() == [1, 7, 8, 9, 2] and labels.tolist() == [-100, -100, 9, 2, -100]


def test_llava_tiny_pp2_equals_reference(tmp_path, equivalence_config):
    run = resolve(TrainArgs.from_argv(_args(equivalence_config, "--stages", "1")), world_size=1)
    assert run.model.image_token_id == len(run.data.tokenizer) - 1  # the built-in tokenizer's <image>
    _, ref = train_reference(run, seed=3, steps=STEPS)
    pp2 = train_run(tmp_path, *_args(equivalence_config, "--stages", "2")).check()
    assert pp2.summary["stages"] == 2
    losses = pp2.losses
    for step, want in enumerate(ref, start=1):
        assert losses[step] == pytest.approx(want, abs=TOL), step
    assert abs(ref[-1] - ref[0]) > 1e-3
    row = pp2.rows[-1]  # 16 placeholders + 12 text positions per sample
    assert float(row["positions_per_s"]) / float(row["samples_per_s"]) == pytest.approx(28, rel=0.01)
    # useful: each sample's own 16 + text positions, its text padding left out
    assert 16 < float(row["useful_tokens_per_s"]) / float(row["samples_per_s"]) < 28
    data = pp2.summary["data"]
    assert data["positions"] == data["rows_seen"] * 28 and data["samples_seen"] == data["rows_seen"]
    assert data["padding_share"] == pytest.approx(1 - data["useful_tokens"] / data["positions"])
