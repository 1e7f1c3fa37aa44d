"""LLaVA-OneVision clips through the pipeline (issue 44): `mmpipe train --pack` at PP=2 on tests/video_records.py's
LLaVA records (clips in MP4 / H.264 and Matroska / Motion JPEG, a clip and an image, two clips, images, text) with the
tiny OneVision (llava-next-tiny's shape as tests/llava_next_models.py's 'onevision': SigLIP side, feature layer -1,
'full', anyres_max 2; 56 px crops, g = 4 features a side pooled to 2 x 2 for a frame): each clip a slot of F frames'
crops of the row's T, tiling (0, 0, -1, 1 - F), F x 4 + 1 positions; rows mixing clips and tiled images; the two
clips' record over its share of T sampled to fewer frames. Equals the single-device reference loop (losses and
weights, fp32, 1e-5), and only floats cross the stage boundary. One launch."""
from __future__ import annotations

import json
from pathlib import Path

import pytest
import torch

import mmpipe
from conftest import train_run
from mmpipe.data.dataset import prepare
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference
from test_anyres_data import tokenizer
from test_qwen_pipeline import assert_trained_as_reference, loaders_agree
from video_records import pipeline_ds_config, write_pipeline_set

TOL = 1e-5
STEPS, SEED, T = 4, 5, 12  # step 1 runs at lr 0: 3 updates (issue 59)


def test_onevision_pipeline_with_clips_equals_single_device(tmp_path):
    root = tmp_path
    # short.mp4: 7 frames at 3 fps -> 4 sampled at 2 fps; long.mkv: 13 -> 8; both squashed to the 56 px crop
    write_pipeline_set(root, (56, 56), (84, 56))
    tokenizer().save_pretrained(root / "tok")  # the LLaVA word-level one (its <image>), over video_records' qwen one
    preset = json.loads((Path(mmpipe.__file__).parent / "presets" / "llava-next-tiny.json").read_text())
    preset["vision"].update(kind="siglip", feature_layer=-1, feature_select="full", anyres_max=2)
    (root / "model.json").write_text(json.dumps(preset))
    ds = pipeline_ds_config(root, STEPS)
    args = ["--preset", str(root / "model.json"), "--data", str(root / "data.json"), "--tokenizer", str(root / "tok"),
            "--ds-config", str(ds), "--text-len", "48", "--pack", "--max-images", "4", "--max-tiles", str(T),
            "--eval-samples", "0", "--seed", str(SEED), "--data-workers", "0", "--bad-records", "strict"]
    pp2 = train_run(root / "pp2", *args, "--stages", "2", "--steps", str(STEPS)).check()
    run = resolve(TrainArgs.from_argv([*args, "--stages", "1", "--output-dir", str(root / "ref")]), world_size=1)
    assert run.model.vision.anyres_max == 2
    stats = prepare(run.data, run.model, str(root / "ref"), SEED, verbose=False).index.stats
    # 3 x (1 + 1 + 2) clips, every record trained on; the two clips' record: T / 2 = 6 crops each, long.mkv 8 -> 6
    assert stats["clips"] == 12 and stats["bad"] == 0 and stats["clips_fewer_frames"] == 3
    frames, mixed = set(), 0
    for pixels, _, has_image, _, tiling in loaders_agree(run, root, SEED, STEPS):  # a later stage's: the same
        assert pixels.shape == (2, T, 3, 56, 56) and tiling.shape[-1] == 4
        used = has_image > 0
        clip, image = used & (tiling[..., 2] < 0), used & (tiling[..., 2] >= 0)
        frames.update((1 - tiling[..., 3][clip]).tolist())
        mixed += int((clip.any(-1) & image.any(-1)).sum())  # a clip and an image in one row
        crops = ((1 + tiling[..., 2] * tiling[..., 3]) * used).sum(-1)
        assert (crops <= T).all() and all(not pixels[b, c:].any() for b, c in enumerate(crops.tolist()))
    assert frames == {4, 6, 8} and mixed >= 1  # short, long beside short (fewer), long beside the image
    ref_model, ref_losses = train_reference(run, seed=SEED, steps=STEPS, out_dir=str(root / "ref"))
    assert sorted(pp2.losses) == list(range(1, STEPS + 1)) and abs(ref_losses[-1] - ref_losses[0]) > 1e-3
    assert list(pp2.losses.values()) == pytest.approx(ref_losses, abs=TOL)
    got = torch.nn.Sequential(*load_reference(pp2.out / "checkpoints", ref_model.cfg))
    # and every trained tensor moved > 10 x TOL but the SigLIP tower's key biases: no rotary there, so softmax
    # cancels their gradient (they move by rounding, ~2.6e-7)
    tower_k_bias = tuple(f"{i}.self_attn.k_proj.bias" for i, layer in enumerate(ref_model) if layer.group == "vision")
    assert_trained_as_reference(pp2, ref_model, SEED, TOL, no_gradient=tower_k_bias)
    ref = ref_model.state_dict()
    errs = {"loss": max(abs(a - b) for a, b in zip(pp2.losses.values(), ref_losses)),
            "weights": max((v - ref[k]).abs().max().item() for k, v in got.state_dict().items())}
    print(f"onevision clips PP=2 vs single device: {errs}")
    pp2.assert_only_floats_crossed(per_forward=1)
