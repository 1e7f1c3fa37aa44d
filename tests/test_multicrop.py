"""moondream multi-crop in the pipeline (issue 17): a small moondream-shaped model with a 4-crop budget,
imported through `mmpipe import --moondream`, fine-tuned in 2 stages on images of several sizes (so
the tilings differ within a micro-batch and some crop slots are padding). The pipeline equals the
single-device reference; with --freeze vision the tower stays bit-identical to the import; without
it, the gradient reaches every crop's encoder through the stitching. moondream's own numbers for the
crop rule and the full vision path are tests/test_crops.py's and tests/test_moondream_real.py's."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image
from safetensors.torch import save_file

from conftest import refused, train_run, write_ds_config
from mmpipe.cli import main
from mmpipe.config import config_from_dict
from mmpipe.data.crops import crop_tiling
from mmpipe.data.export import export_shapes
from mmpipe.hf.moondream import export_moondream
from mmpipe.model import ReferenceModel
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference

STEPS = 3
TOL = 1e-5
# 28 px crops of 7 px patches: a 4 x 4 grid, 1-patch margins, so a crop adds a 2-patch (14 px) window;
# at most 4 local crops: 1 + 4 = 5 slots of 16 tokens per image
CROPS_TINY = {
    "family": "moondream",
    "vision": {"image_size": 28, "patch_size": 7, "dim": 16, "n_layers": 2, "n_heads": 2, "ff_dim": 32,
               "ln_eps": 1e-5, "crop_features": 2, "max_crops": 4, "overlap_margin": 1},
    "text": {"dim": 32, "n_layers": 2, "n_heads": 2, "ff_dim": 64, "vocab_size": 64, "max_context": 64,
             "partial_rotary_factor": 0.5},
    "proj_inner_dim": 32,
}
SIZES = [(28, 28), (40, 60), (60, 40), (50, 90), (90, 50), (44, 44)]  # width x height


@pytest.fixture(scope="module")
def setup(tmp_path_factory):
    d = tmp_path_factory.mktemp("crops")
    (d / "crops-tiny.json").write_text(json.dumps(CROPS_TINY))
    cfg = config_from_dict(CROPS_TINY, "crops-tiny")
    save_file(export_moondream(ReferenceModel(cfg, seed=5)), str(d / "md.safetensors"))
    assert main(["import", "--moondream", str(d / "md.safetensors"), "--preset", str(d / "crops-tiny.json"),
                 "--out", str(d / "imported")]) == 0
    data = export_shapes(d / "data", "llava-jsonl", 48)
    for i, path in enumerate(sorted((d / "data" / "images").glob("*.png"))):  # squash to varied sizes
        Image.open(path).resize(SIZES[i % len(SIZES)]).save(path)
    tilings = {crop_tiling(h, w, 4, 1, 28, 7) for w, h in SIZES}
    assert len(tilings) >= 3 and any(r * c > 1 for r, c in tilings)  # several tilings, padding slots in a batch
    ds = write_ds_config(d / "ds.json", train_micro_batch_size_per_gpu=4, gradient_accumulation_steps=2)
    return d, data, ds


def _args(d, data, ds, *extra):
    return ["--init-from", str(d / "imported"), "--data", str(data), "--ds-config", str(ds), "--steps", str(STEPS),
            "--seed", "2", *extra]


@pytest.mark.parametrize("freeze,cut", [(("--freeze", "vision"), ()), ((), ("--partition", "2"))],
                         ids=["freeze_vision", "all_trained"])
def test_two_stage_multi_crop_equals_reference(setup, tmp_path, freeze, cut):
    """all_trained cuts inside the tower (stage 1 from the second ViT block on): the Projector's stage
    reads the tiling from its own loader, since only floats cross (mmpipe.runtime.wire)."""
    d, data, ds = setup
    args = _args(d, data, ds, *freeze)
    run = resolve(TrainArgs.from_argv([*args, "--stages", "1"]), world_size=1)
    assert run.model.vision.crop_slots == 5
    ref_model, ref_losses = train_reference(run, seed=2, steps=STEPS, out_dir=str(tmp_path / "ref"))
    pp2 = train_run(tmp_path / "pp2", *args, "--stages", "2", *cut).check()
    pp2.assert_only_floats_crossed()
    assert not cut or pp2.summary["parts"][1] == 2
    for step, want in enumerate(ref_losses, start=1):
        assert pp2.losses[step] == pytest.approx(want, abs=TOL), step
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-4
    trained = load_reference(pp2.out / "checkpoints", run.model)
    imported = load_reference(d / "imported" / "checkpoints", run.model)
    n_vision = CROPS_TINY["vision"]["n_layers"] + 2  # patch embedding, blocks, final norm
    for i, (mine, ref, base) in enumerate(zip(trained, ref_model, imported)):
        for k, v in mine.state_dict().items():
            assert (v - ref.state_dict()[k]).abs().max() < TOL, (i, k)
            if i < n_vision:
                assert torch.equal(v, base.state_dict()[k]) == bool(freeze), (i, k)  # frozen: bit-identical


def test_crop_budget_flag(setup, tmp_path, capsys):
    d, data, ds = setup
    run = resolve(TrainArgs.from_argv([*_args(d, data, ds), "--max-crops", "2"]), world_size=2)
    assert run.model.vision.crop_slots == 3
    # the vision side costs per crop slot: 3 slots of 16 tokens
    assert run.layers[1].tokens == 3 * 16 and run.layers[1].name == "VisionBlock"
    bad = refused(["--output-dir", str(tmp_path / "bad"), *_args(d, data, ds), "--max-crops", "9"], capsys)
    assert "--max-crops: 9 must be between 0 and the model's vision.max_crops 4" in "\n".join(bad)
    aug = refused(["--output-dir", str(tmp_path / "aug"), *_args(d, data, ds), "--augment"], capsys)
    assert "--augment: multi-crop images" in "\n".join(aug)
