"""moondream's multi-crop preprocessing and stitch rule, checked against moondream's own code.

tests/fixtures/moondream_crops.json holds what moondream's moondream/torch/image_crops.py (its
Pillow path; commit in the file) computed for seeded images: the tiling of every size and
budget in a table, the crops' pixels (sha256 per crop, sums, 3 x 3 block means, a centre slice),
and its reconstruct_from_crops on patch-coordinate codes. It was made by a harness outside the
project; none of moondream's code is here. The libvips numbers in it document the other path.
"""
from __future__ import annotations

import hashlib
import json
import math
from pathlib import Path

import numpy as np
import PIL
import pytest
import torch
from PIL import Image

from mmpipe.config import VisionConfig
from mmpipe.data.crops import CropTransform, crop_tiling, cut_crops, overlap_crops, select_tiling
from mmpipe.model.crops import kept_span, merge_crop_features, pool_grid, stitch_grid, stitch_index, stitched_size

REF = json.loads((Path(__file__).parent / "fixtures" / "moondream_crops.json").read_text())
SAME_PILLOW = PIL.__version__ == REF["pillow"]  # then LANCZOS is bit-identical, not just close


def seeded_image(height: int, width: int, seed: int) -> Image.Image:
    # the fixture's own recipe (REF["image"]): PCG64 streams are stable across numpy versions
    return Image.fromarray(np.random.default_rng(seed).integers(0, 256, size=(height, width, 3), dtype=np.uint8))


# ---------------------------------------------------------------- tiling

def test_tiling_equals_moondream_for_every_recorded_size_and_budget():
    table = REF["tiling_table"]
    assert len(table) > 1000
    # select_tiling is moondream's rule exactly, on the image less its margins (2 x 4 x 14 = 112 px)
    # in 266 px windows ((27 - 8) x 14)
    wrong = [row for row in table if select_tiling(row[0] - 112, row[1] - 112, 266, row[2]) != tuple(row[3:])]
    assert wrong == []
    within = [row for row in table if row[3] * row[4] <= row[2]]
    wrong = [(h, w, k, (r, c), crop_tiling(h, w, k)) for h, w, k, r, c in within if crop_tiling(h, w, k) != (r, c)]
    assert wrong == [] and len(within) > 1300


def test_tiling_over_budget_in_moondream_is_capped():
    # moondream's rule gives 389 x 7561 px (height x width) 1 x 13 tiles at budget 12, and
    # 500 x 20000 px 1 x 21: more than 1 + 12 fixed slots hold. The longer side is cut to the budget.
    over = {(h, w, k): (r, c) for h, w, k, r, c in REF["tiling_table"] if r * c > k}
    assert over[(389, 7561, 12)] == (1, 13) and over[(7561, 389, 12)] == (13, 1) and over[(500, 20000, 12)] == (1, 21)
    assert crop_tiling(389, 7561, 12) == (1, 12) and crop_tiling(7561, 389, 12) == (12, 1)
    for (h, w, k), (r, c) in over.items():
        capped = crop_tiling(h, w, k)
        assert capped[0] * capped[1] <= k
        assert capped == ((1, k) if c > r else (k, 1)), (h, w, k)  # only a bumped-up 1 overflows


def test_select_tiling_worked_examples():
    # 640 x 900 px less 2 x 56 px margins = 528 x 788, in 266 px windows: needs 2 x 3, the aspect
    # at budget 12 gives floor(sqrt(12 * 528 / 788)) = 2 rows, floor(sqrt(12 * 788 / 528)) = 4 cols
    assert select_tiling(528, 788, 266, 12) == (2, 4)
    assert select_tiling(266, 5000, 266, 12) == (1, 1)  # one side fits one window: no tiling
    # 1888 x 1888 (2000 px less margins) needs ceil(1888 / 266) = 8 x 8 = 64 > 12: scaled by
    # sqrt(12 / 64) = 0.433 -> floor(8 x 0.433) = 3 per side
    assert select_tiling(1888, 1888, 266, 12) == (3, 3)
    with pytest.raises(ValueError, match="max_crops"):
        select_tiling(500, 500, 266, 0)


def test_a_lower_budget_caps_the_tiling_for_every_size():
    sizes = range(1, 4001, 61)
    for budget in range(1, 13):
        for h in sizes:
            for w in sizes:
                r, c = crop_tiling(h, w, budget)
                assert 1 <= r * c <= budget, (h, w, budget, r, c)
    assert crop_tiling(2000, 2000, 12) == (3, 3) and crop_tiling(2000, 2000, 4) == (2, 2)
    assert crop_tiling(2000, 2000, 1) == (1, 1)


# ---------------------------------------------------------------- pixels

@pytest.mark.parametrize("rec", REF["crops"], ids=lambda r: f"{r['height']}x{r['width']}-k{r['max_crops']}")
def test_crops_equal_moondreams_pillow_path(rec):
    crops, tiling = cut_crops(seeded_image(rec["height"], rec["width"], rec["seed"]), max_crops=rec["max_crops"])
    assert list(tiling) == rec["tiling"] and crops.shape == (rec["n_crops"], 378, 378, 3)
    sums = [int(c.astype(np.int64).sum()) for c in crops]
    # another Pillow may round a LANCZOS tap differently: sums to 1e-4, 126 px block means to 0.05 of 255
    assert sums == pytest.approx(rec["sum"], rel=1e-4)
    blocks = [c.astype(np.float64).reshape(3, 126, 3, 126, 3).mean(axis=(1, 3)) for c in crops]
    assert np.abs(np.array(blocks) - np.array(rec["pooled_3x3"])).max() <= 0.05
    centre = np.array([c[187:191, 187:191, 0] for c in crops], dtype=np.int64)
    assert np.abs(centre - np.array(rec["center_4x4_red"])).max() <= 1
    if SAME_PILLOW:
        assert [hashlib.sha256(np.ascontiguousarray(c).tobytes()).hexdigest() for c in crops] == rec["sha256"]


def test_a_one_tile_image_is_its_own_global_and_local_crop():
    # 378 px: 378 - 112 = 266 fits one window, so 1 x 1, resized to 1 x 266 + 112 = 378: no resampling
    img = seeded_image(378, 378, 5)
    crops, tiling = cut_crops(img)
    assert tiling == (1, 1) and crops.shape[0] == 2
    assert np.array_equal(crops[0], np.asarray(img)) and np.array_equal(crops[1], np.asarray(img))


def test_local_crops_stitch_back_into_the_resized_image():
    # at pixel level (patch = 1 px, margin 4 x 14 = 56 px) the local crops are windows of the resized
    # image, so the stitch rule must give that image back: the two modules agree on the geometry
    img = seeded_image(640, 900, 11)
    crops, (rows, cols) = cut_crops(img)
    assert (rows, cols) == (2, 4)
    stitched = stitch_grid(torch.from_numpy(crops[1:]), rows, cols, overlap_margin=56)
    resized = np.asarray(img.resize((4 * 266 + 112, 2 * 266 + 112), Image.Resampling.LANCZOS))
    assert stitched.shape == (644, 1176, 3) and np.array_equal(stitched.numpy(), resized)


@pytest.mark.parametrize("size,budget", [((640, 900), 12), ((2000, 2000), 4), ((50, 50), 12), ((300, 1200), 1)])
def test_fixed_slots_valid_mask_and_normalisation(size, budget):
    img = seeded_image(*size, 3)
    out = overlap_crops(img, max_crops=budget)
    raw, (rows, cols) = cut_crops(img, max_crops=budget)
    n = 1 + rows * cols
    assert out.pixels.shape == (1 + budget, 3, 378, 378) and out.pixels.dtype == torch.float32
    assert out.valid.dtype == torch.long and out.valid.tolist() == [1] * n + [0] * (budget + 1 - n)
    assert out.tiling == (rows, cols) and all(type(t) is int for t in out.tiling)
    # (x / 255 - 0.5) / 0.5: 0 -> -1, 255 -> 1; padding slots are zeros
    expect = torch.from_numpy(raw).permute(0, 3, 1, 2).float() / 255 * 2 - 1
    assert torch.allclose(out.pixels[:n], expect, atol=1e-6)
    assert not out.pixels[n:].any()


def test_crop_transform_uses_the_vision_config_and_any_image_mode():
    vision = VisionConfig(image_size=378, patch_size=14, dim=32, n_layers=1, n_heads=2, ff_dim=64)
    t = CropTransform(vision, max_crops=6)
    assert t.slots == 7
    grey = Image.fromarray(np.full((700, 500), 255, dtype=np.uint8), mode="L")
    out = t(grey)
    assert out.pixels.shape == (7, 3, 378, 378) and out.tiling == crop_tiling(700, 500, 6)
    assert torch.equal(out.pixels[out.valid.bool()], torch.ones(int(out.valid.sum()), 3, 378, 378))
    with pytest.raises(ValueError, match="overlap margin"):
        CropTransform(vision, overlap_margin=14)  # 2 x 14 >= 27 patches: no stride left
    with pytest.raises(ValueError, match="max_crops"):
        CropTransform(vision, max_crops=0)


# ---------------------------------------------------------------- stitch (model side)

def coded(rows: int, cols: int, grid: int = 27) -> torch.Tensor:
    """[rows*cols, g, g, 1] features holding crop * 10000 + local row * 100 + local col."""
    k = torch.arange(rows * cols).view(-1, 1, 1)
    y, x = torch.arange(grid).view(1, -1, 1), torch.arange(grid).view(1, 1, -1)
    return (k * 10000 + y * 100 + x).unsqueeze(-1)


@pytest.mark.parametrize("rec", REF["stitch"], ids=lambda r: "x".join(map(str, r["tiling"])))
def test_stitch_equals_moondreams_reconstruction(rec):
    rows, cols = rec["tiling"]
    got = stitch_grid(coded(rows, cols), rows, cols, overlap_margin=4)[..., 0]
    assert list(got.shape) == rec["shape"]
    if rec["codes"] is not None:
        assert got.tolist() == rec["codes"]
    assert hashlib.sha256(got.to(torch.int64).numpy().tobytes()).hexdigest() == rec["codes_sha256"]
    g = torch.Generator().manual_seed(rec["features_seed"])
    feats = torch.randn(rows * cols, 27, 27, 4, generator=g, dtype=torch.float64)
    pooled = pool_grid(stitch_grid(feats, rows, cols, 4), 27)
    assert pooled.shape == (729, 4)
    assert pooled.sum().item() == pytest.approx(rec["pooled_sum"], abs=1e-9)
    assert pooled.abs().sum().item() == pytest.approx(rec["pooled_abs_sum"], rel=1e-12)
    assert torch.allclose(pooled[:3], torch.tensor(rec["pooled_first_rows"], dtype=torch.float64), atol=1e-12)
    assert torch.allclose(pooled[-3:], torch.tensor(rec["pooled_last_rows"], dtype=torch.float64), atol=1e-12)


def test_stitch_puts_every_patch_at_its_image_position_and_drops_the_overlaps():
    rows, cols, grid, m = 3, 3, 27, 4
    stride = grid - 2 * m  # 19 patches = 266 px between crop origins
    # crop (i, j)'s local patch (p, q) is patch (i*19 + p, j*19 + q) of the resized image
    i = torch.arange(rows).repeat_interleave(cols).view(-1, 1, 1, 1)
    j = torch.arange(cols).repeat(rows).view(-1, 1, 1, 1)
    p, q = torch.arange(grid).view(1, -1, 1, 1), torch.arange(grid).view(1, 1, -1, 1)
    feats = torch.cat(torch.broadcast_tensors(i * stride + p, j * stride + q, i * cols + j), dim=-1)
    out = stitch_grid(feats, rows, cols, m)
    assert out.shape == (65, 65, 3)  # 3 x 19 + 2 x 4
    ys, xs = torch.meshgrid(torch.arange(65), torch.arange(65), indexing="ij")
    assert torch.equal(out[..., 0], ys) and torch.equal(out[..., 1], xs)  # in order, each patch once
    # overlaps split in the middle: tile row 0 owns stitched rows 0..22 (27 - 4), row 1 owns 23..41
    # (19 = its window), row 2 owns 42..64 (the last 23); so a corner crop keeps 23 x 23 patches,
    # an edge crop 23 x 19, the centre one 19 x 19; 4 x 529 + 4 x 437 + 361 = 65^2
    owner = out[..., 2]
    assert torch.equal(owner[:, 0].unique_consecutive(), torch.tensor([0, 3, 6]))
    assert owner[22, 0] == 0 and owner[23, 0] == 3 and owner[41, 0] == 3 and owner[42, 0] == 6
    counts = torch.bincount(owner.flatten(), minlength=9).tolist()
    assert counts == [529, 437, 529, 437, 361, 437, 529, 437, 529]


def test_kept_spans_and_sizes():
    assert [kept_span(i, 3, 27, 4) for i in range(3)] == [(0, 23), (4, 23), (4, 27)]
    assert kept_span(0, 1, 27, 4) == (0, 27)
    assert [stitched_size(n, 27, 4) for n in (1, 2, 4)] == [27, 46, 84]
    crop, y, x = stitch_index(2, 1, 27, 4)
    assert crop.shape == (46, 27) and crop[22, 0] == 0 and crop[23, 0] == 1 and y[23, 0] == 4
    with pytest.raises(ValueError, match="needs 6 crops"):
        stitch_grid(torch.zeros(5, 27, 27, 1), 2, 3, 4)


def test_merge_reads_only_valid_slots_and_puts_global_first():
    b, k, grid, d = 2, 6, 27, 4
    feats = torch.randn(b, 1 + k, grid * grid, d, dtype=torch.float64, requires_grad=True)
    tiling = torch.tensor([[2, 3], [1, 1]])  # sample 0 fills all 6 local slots, sample 1 only 1
    with torch.no_grad():
        feats[1, 2:] = float("nan")  # padding must not leak into the output
    out = merge_crop_features(feats, tiling, overlap_margin=4)
    assert out.shape == (b, 729, 2 * d) and torch.isfinite(out).all()
    assert torch.equal(out[:, :, :d], feats[:, 0])
    local0 = feats[0, 1:7].reshape(6, grid, grid, d)
    assert torch.equal(out[0, :, d:], pool_grid(stitch_grid(local0, 2, 3, 4), grid))
    # a 1 x 1 tiling stitches to the crop itself (27 x 27) and pooling 27 -> 27 is the identity
    assert torch.allclose(out[1, :, d:], feats[1, 1])
    out.sum().backward()
    assert not feats.grad[1, 2:].any() and feats.grad[0].abs().sum() > 0
    with pytest.raises(ValueError, match="local slots"):
        merge_crop_features(feats.detach(), torch.tensor([[3, 3], [1, 1]]), 4)


def test_fixture_provenance():
    assert len(REF["moondream_commit"]) == 40 and REF["file"] == "moondream/torch/image_crops.py"
    # libvips (moondream's default when pyvips imports) resamples differently from Pillow's LANCZOS;
    # the fixture records by how much, for docs/data.md: identical for a 378 px image (no resize)
    diffs = {(r["height"], r["width"], r["max_crops"]): r["vips_vs_pil"] for r in REF["crops"]}
    assert diffs[(378, 378, 12)]["smooth_max_abs"] == 0
    assert math.isclose(max(d["smooth_mean_abs"] for d in diffs.values()), 3.272)
