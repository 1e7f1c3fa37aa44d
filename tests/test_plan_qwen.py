"""The Qwen2-VL / Qwen2.5-VL presets and `mmpipe plan` on them: every preset's parameter count is the
published one, the cost rules count each row's P patches (attention per image, per window) and what
autograd keeps, `--image-size` is the image processor's own grid, and qwen2.5-vl-72b plans onto 4 x 8
H100 in seconds without allocating a weight. All on the meta device or qwen-tiny."""
from __future__ import annotations

import json

import pytest
import torch
from PIL import Image

from mmpipe.config import PRESET_DIR, load_preset
from mmpipe.data.packing import row_shape
from mmpipe.model.builder import bound, layer_param_counts, layer_specs
from mmpipe.model.costs import PatchRow, attention_pairs
from mmpipe.planning.costmodel import layer_costs
from mmpipe.planning.images import patch_row
from test_plan import _saved_floats_per_sample, plan_in_a_fresh_process

QWEN = ["qwen2-vl-2b", "qwen2-vl-7b", "qwen2.5-vl-3b", "qwen2.5-vl-7b", "qwen2.5-vl-32b", "qwen2.5-vl-72b"]
BIG_72B = ["plan", "--preset", "qwen2.5-vl-72b", "--image-size", "1024x768", "--max-images", "4", "--max-patches",
           "16384", "--text-len", "1024", "--gpus-per-node", "8", "--nodes", "4", "--global-batch", "128",
           "--checkpointing", "--micro", "1"]


def _total(cfg) -> int:
    """Parameters with a tied head counted once (the TiedLayerSpec's later use shares the first's)."""
    seen, total = set(), 0
    for spec, n in zip(layer_specs(cfg), layer_param_counts(cfg)):
        key = getattr(spec, "key", None)
        total += 0 if key is not None and key in seen else n
        seen.add(key)
    return total


@pytest.mark.parametrize("preset", QWEN)
def test_each_preset_has_the_published_parameter_count(preset):
    """Within 1% of the count the model's Hub page reports (the preset's `_params`, its `_comment` says where
    it comes from), built on the meta device; e.g. qwen2.5-vl-72b 73.41 B for the published 73.4 B."""
    published = json.loads((PRESET_DIR / f"{preset}.json").read_text())["_params"]
    want = float(published.rstrip("B")) * 1e9
    assert abs(_total(load_preset(preset)) / want - 1) < 0.01, (preset, _total(load_preset(preset)), published)


def test_attention_counts_each_image_and_each_window():
    """Hand arithmetic: two images of 4 x 4 and 4 x 6 patches in a 64-patch row (24 padding patches, each
    attending to itself): full 16^2 + 24^2 + 24 = 856 pairs; qwen-tiny's windows of 4 x 4 patches cut the
    4 x 6 image into 4 x 4 + 4 x 2: 16^2 + 16^2 + 8^2 + 24 = 600."""
    v = load_preset("qwen-tiny").vision
    row = PatchRow(64, ((1, 4, 4), (1, 4, 6)))
    assert attention_pairs(v, row, full=True) == 16 ** 2 + 24 ** 2 + 24 == 856
    assert attention_pairs(v, row, full=False) == 16 ** 2 + 16 ** 2 + 8 ** 2 + 24 == 600
    big = load_preset("qwen2.5-vl-72b").vision  # a 54 x 74 grid in windows of 8 x 8 patches: 7 x 10 windows
    assert attention_pairs(big, PatchRow(3996, ((1, 54, 74),)), full=False) == (6 * 64 + 36) * (9 * 64 + 4)


def test_a_row_costs_its_patch_budget_not_its_image_slots():
    """The vision layers run on the row's P patches whatever M (the patch embedding and the MLPs scale with P,
    attention with each image's own patches: the two windowed blocks cheaper than the full one); the merger
    gives P / 4 tokens; the decoder runs the data's L = 2 M + P / 4 + text_len positions."""
    cfg = load_preset("qwen-tiny")
    rows = {m: layer_costs(cfg, (), 40, images=m, patches=PatchRow(64, ((1, 4, 4),) * m)) for m in (1, 2)}
    one, two = rows[1], rows[2]
    assert [r.name for r in one] == ["QwenPatchEmbed", "QwenVisionBlock", "QwenVisionBlock", "QwenMerger",
                                     "QwenEmbed", "QwenBlock", "QwenBlock", "FinalNorm", "LMHead"]
    assert [r.tokens for r in one] == [64, 64, 64, 16] + [2 + 16 + 40] * 5
    assert two[0] == one[0] and two[3] == one[3] and two[5].tokens == row_shape(cfg, 2, 40, 64).length == 4 + 16 + 40
    d, params = cfg.vision.dim, one[1].params
    for m, r in rows.items():  # block 0 windowed (4 x 4: one window per image), block 1 full
        pairs = m * 16 ** 2 + (64 - 16 * m)
        assert r[1].fwd_flops == r[2].fwd_flops == 2.0 * params * 64 + 4.0 * d * pairs
    wide = PatchRow(64, ((1, 8, 8),))  # 2 x 2 windows of 16 patches in block 0, 64^2 pairs in block 1
    w = layer_costs(cfg, (), 40, patches=wide)
    assert w[2].fwd_flops - w[1].fwd_flops == 4.0 * d * (64 ** 2 - 4 * 16 ** 2)


def test_activation_memory_matches_what_autograd_keeps():
    """Every qwen-tiny layer's act_elems (per row) equals the float elements its forward leaves for autograd,
    counted with saved-tensor hooks on a row of two images (4 x 4 and 6 x 4 patches, 24 padding) and two samples."""
    cfg = load_preset("qwen-tiny")
    P, L, grids = 64, 40, torch.tensor([[1, 4, 4], [1, 6, 4]])
    rows = layer_costs(cfg, (), L - 2 * 2 - P // 4, images=2, patches=PatchRow(P, ((1, 4, 4), (1, 6, 4))))
    assert rows[5].tokens == L

    def ints(batch):
        ids = torch.randint(0, 190, (batch, L))
        ids[:, 2:12] = cfg.image_token_id  # (16 + 24) / 4 merged tokens
        segments = torch.ones(batch, L, dtype=torch.long)
        segments[:, 30:] = 2
        return ids, torch.ones(batch, 2, dtype=torch.long), segments, grids.expand(batch, 2, 3).clone()
    shapes = {"QwenPatchEmbed": (P, cfg.vision.patch_dim), "QwenVisionBlock": (P, cfg.vision.dim),
              "QwenMerger": (P, cfg.vision.dim), "QwenEmbed": (P // 4, cfg.text.dim)}
    for i, (spec, row) in enumerate(zip(layer_specs(cfg)[:-1], rows)):  # the head's loss is test_plan's
        shape = shapes.get(row.name, (L, cfg.text.dim))

        def make(batch, shape=shape, grad=row.name != "QwenPatchEmbed"):
            return torch.randn(batch, *shape, requires_grad=grad), *ints(batch)
        assert _saved_floats_per_sample(bound(spec.build(), cfg, i), make) == row.act_elems, row.name


def test_image_size_is_the_image_processors_grid():
    """--image-size gives the grid transformers' Qwen2VLImageProcessor makes of an image that size (1024x768:
    1036 x 756 px, 54 x 74 patches), and M images that would not fit the row's P are resized down by the
    same rule (4 of them in 8192 patches: 2048 each at most)."""
    from transformers import Qwen2VLImageProcessor
    cfg = load_preset("qwen2.5-vl-72b")
    v = cfg.vision
    proc = Qwen2VLImageProcessor(min_pixels=v.min_pixels, max_pixels=v.max_pixels, patch_size=v.patch_size,
                                 merge_size=v.merge_size, temporal_patch_size=v.temporal_patch_size)
    for w, h in ((1024, 768), (300, 1200), (57, 41)):
        grid = tuple(proc(images=[Image.new("RGB", (w, h))], return_tensors="pt")["image_grid_thw"][0].tolist())
        assert patch_row(cfg, 1, 65536, [(w, h)]).grids == (grid,), (w, h)
    assert patch_row(cfg, 1, 65536, [(1024, 768)]).grids == ((1, 54, 74),)
    small = patch_row(cfg, 4, 8192, [(1024, 768)])
    assert len(small.grids) == 4 and small.used <= 8192 and all(h * w <= 2048 for _, h, w in small.grids)


def test_plan_qwen2_5_vl_72b_fits_4_nodes_of_8_h100_without_allocating():
    preset = BIG_72B[2]  # plan --preset P ...
    layouts, rss_gb = plan_in_a_fresh_process([preset], BIG_72B[3:])[preset]
    fits = [lay for lay in layouts if lay["step"]]
    assert fits and fits[0]["stages"] * fits[0]["dp"] == 32
    assert max(max(r["memory_gib"] for r in lay["stage_rows"]) for lay in fits) <= 75.0
    assert {lay["decoder_length"] for lay in layouts} == {4 * 2 + 16384 // 4 + 1024}
    assert layouts[0]["max_patches"] == 16384 and layouts[0]["image_grids"] == [[1, 54, 74]] * 4
    assert rss_gb < 2.0  # 73 B bf16 weights would be 147 GB


def test_plan_prints_the_images_grid_and_the_rows_budgets(capsys):
    from mmpipe.cli import main
    assert main(["plan", "--preset", "qwen-tiny", "--device", "a100-80gb", "--gpus-per-node", "2", "--global-batch",
                 "8", "--micro", "2", "--image-size", "84x56", "--max-images", "2", "--max-patches", "64",
                 "--text-len", "40"]) == 0
    out = capsys.readouterr().out
    assert "2 images of 84x56 px -> 84x56 px (4 x 6 patches, 6 image tokens each)" in out
    assert ("vision patches per row: 48 of --max-patches 64 (25% padding); decoder positions per row: 2 x 2 brackets"
            " + 16 image (12 used) + 40 text = 60") in out


@pytest.mark.parametrize("bad", ["1024", "0x5", "axb"])
def test_a_bad_image_size_is_one_line(bad, capsys):
    from mmpipe.cli import main
    assert main(["plan", "--preset", "qwen-tiny", "--image-size", bad]) == 2
    out = capsys.readouterr()
    assert out.out == "" and out.err.strip().splitlines() == [
        f"mmpipe: error: --image-size: {bad!r} is not WIDTHxHEIGHT in pixels, both at least 1 (e.g. 1024x768)"]


def test_image_size_and_profile_are_refused_where_they_mean_nothing(capsys):
    """--image-size on a fixed-size family is one line naming the families that do take it: every family whose
    images take any size in a row budget (the registry's, so a new one is named too), each of which plans it."""
    from mmpipe.cli import main
    from mmpipe.registry import families
    takers = sorted({f.family for f in families() if f.kind.flag is not None})
    assert takers == ["internvl", "llava_next", "qwen2_vl", "qwen3_5", "qwen3_vl"]
    for preset, px in (("llava-tiny", 32), ("llava-1.5-7b", 336)):
        assert main(["plan", "--preset", preset, "--image-size", "64x64"]) == 2
        assert capsys.readouterr().err.strip().splitlines() == [
            f"mmpipe: error: --image-size: the llava family resizes every image to {px} px square; only the qwen2_vl, "
            f"llava_next, qwen3_vl, qwen3_5 and internvl families (images of any size in a row budget) cost an image "
            f"size"]
    for preset in ("qwen-tiny", "llava-next-tiny", "internvl-tiny"):  # the families named: each costs an image size
        assert main(["plan", "--preset", preset, "--image-size", "64x64", "--gpus-per-node", "1"]) == 0, preset
        assert load_preset(preset).family in takers and "64x64 px" in capsys.readouterr().out
    assert main(["plan", "--preset", "qwen-tiny", "--profile"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1 and err[0].startswith("mmpipe: error: --profile: not for a dynamic-resolution preset"), err


def test_nothing_fits_names_the_rows_budgets_first(capsys):
    from mmpipe.cli import main
    assert main(["plan", "--preset", "qwen-tiny", "--gpus-per-node", "1", "--micro", "1", "--global-batch", "1",
                 "--gpu-mem", "0.001", "--max-patches", "64", "--text-len", "40"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert len(err) == 1, err
    assert "(try a smaller --max-patches than 64 or --text-len than 40, --checkpointing" in err[0], err


def test_mixed_image_sizes_in_one_row(capsys):
    """--image-size W1xH1,W2xH2: a row holds one image of each size (M defaults to their number), each resized
    as the data resizes it (qwen-tiny, P = 64 over 2 images: at most 32 patches each, so 112x112 becomes 4 x 4);
    more sizes than --max-images is one line."""
    from mmpipe.cli import main
    base = ["plan", "--preset", "qwen-tiny", "--gpus-per-node", "2", "--global-batch", "8", "--micro", "2",
            "--max-patches", "64", "--text-len", "40"]
    assert main(base + ["--image-size", "84x56,112x112", "--json"]) == 0
    layouts = json.loads(capsys.readouterr().out)
    assert layouts[0]["image_grids"] == [[1, 4, 6], [1, 4, 4]] and layouts[0]["decoder_length"] == 2 * 2 + 16 + 40
    assert main(base + ["--image-size", "84x56,112x112,56x56", "--max-images", "2"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "mmpipe: error: --image-size: 3 sizes for --max-images 2: a row holds one image of each (give --max-images 3 "
        "or more)"]
