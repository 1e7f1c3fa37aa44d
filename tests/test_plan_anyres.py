"""The LLaVA-NeXT / LLaVA-OneVision presets and `mmpipe plan` on them (issue 33): every preset's parameter count is
the published one, `--image-size` is transformers' image processor's tiling and its processor's token count, a row
costs its T crops and the data's L, and llava-onevision-qwen2-72b plans onto 4 x 8 H100 in seconds without
allocating a weight. All on the meta device or llava-next-tiny."""
from __future__ import annotations

import json

import pytest
from PIL import Image

from mmpipe.config import PRESET_DIR, load_preset
from mmpipe.data.anyres import tile_rule
from mmpipe.data.packing import row_shape
from mmpipe.model.costs import CropRow
from mmpipe.planning.costmodel import layer_costs
from mmpipe.planning.images import crop_row
from test_plan import plan_in_a_fresh_process
from test_plan_qwen import _total

ANYRES = ["llava-v1.6-mistral-7b", "llava-v1.6-vicuna-13b", "llava-onevision-qwen2-0.5b", "llava-onevision-qwen2-7b",
          "llava-onevision-qwen2-72b"]
BIG_72B = ["plan", "--preset", "llava-onevision-qwen2-72b", "--image-size", "1024x768", "--text-len", "1024",
           "--gpus-per-node", "8", "--nodes", "4", "--global-batch", "128", "--checkpointing", "--micro", "1"]


@pytest.mark.parametrize("preset", ANYRES)
def test_each_preset_has_the_published_parameter_count(preset):
    """Within 1% of the count the model's Hub page reports (the preset's `_params`; docs/models.md says where the
    shapes come from), built on the meta device: mmpipe's tower stops at the feature layer, so the CLIP towers
    count one block fewer than transformers' checkpoint (llava-v1.6-mistral-7b 7.554 B for 7.57 B)."""
    published = json.loads((PRESET_DIR / f"{preset}.json").read_text())["_params"]
    want = float(published.rstrip("BM")) * (1e9 if published.endswith("B") else 1e6)
    assert abs(_total(load_preset(preset)) / want - 1) < 0.01, (preset, _total(load_preset(preset)), published)


def test_image_size_is_the_image_processors_tiling():
    """--image-size gives the tiles transformers' LlavaNextImageProcessor cuts of an image that size (llava-v1.6's
    pinpoints: 1024x768 -> 2 x 2, 300x1200 -> 3 x 1, 2000x300 -> 1 x 3) and the positions its processor counts."""
    from transformers import LlavaNextImageProcessor
    cfg = load_preset("llava-v1.6-mistral-7b")
    v = cfg.vision
    proc = LlavaNextImageProcessor(size={"shortest_edge": 336}, crop_size={"height": 336, "width": 336},
                                   image_grid_pinpoints=[list(p) for p in v.grid_pinpoints])
    want = {(1024, 768): (2, 2), (300, 1200): (3, 1), (2000, 300): (1, 3), (57, 41): (1, 2)}
    for (w, h), grid in want.items():
        crops = proc(images=[Image.new("RGB", (w, h))], return_tensors="pt")["pixel_values"].shape[1]
        row = crop_row(cfg, 1, 0, [(w, h)])
        assert row.tilings == ((h, w, *grid),) and crops == 1 + grid[0] * grid[1], (w, h)
    assert tile_rule(cfg).count(768, 1024) == 576 + 48 * 49 - 2 * 6 * 49  # unpadded: 48 x 36 features + newlines


def test_a_row_costs_its_crop_budget_and_the_datas_length():
    """The tower runs on the row's T crops whatever they hold (llava-next-tiny: 17 positions a 56 px crop with the
    class token), the decoder on the data's L = the largest sample's image positions + text_len."""
    cfg = load_preset("llava-next-tiny")
    one = layer_costs(cfg, (), 40, images=1, patches=crop_row(cfg, 1))
    two = layer_costs(cfg, (), 40, images=2, patches=CropRow(10, ((40, 100, 1, 2), (56, 56, 1, 1))))
    assert one[0].tokens == 5 * 17 and two[0].tokens == 10 * 17
    assert one[-1].tokens == row_shape(cfg, 1, 40).length == 88 + 40
    assert two[-1].tokens == row_shape(cfg, 2, 40, 10).length == 2 * 88 + 40


def test_plan_llava_onevision_72b_fits_4_nodes_of_8_h100_without_allocating():
    preset = BIG_72B[2]  # plan --preset P ...
    layouts, rss_gb = plan_in_a_fresh_process([preset], BIG_72B[3:])[preset]
    fits = [lay for lay in layouts if lay["step"]]
    assert fits and fits[0]["stages"] * fits[0]["dp"] == 32
    assert max(max(r["memory_gib"] for r in lay["stage_rows"]) for lay in fits) <= 75.0
    # one image: 6 x 6 pinpoints -> T = 37 crops; positions: 729 + the pooled bound 7938 + 162 newlines
    assert {lay["decoder_length"] for lay in layouts} == {729 + 7938 + 162 + 1024}
    assert layouts[0]["max_tiles"] == 37 and layouts[0]["image_tilings"] == [[768, 1024, 2, 3]]
    assert rss_gb < 2.0  # 73 B bf16 weights would be 147 GB


def test_plan_prints_the_images_tiles_and_the_rows_budgets(capsys):
    from mmpipe.cli import main
    assert main(["plan", "--preset", "llava-next-tiny", "--device", "a100-80gb", "--gpus-per-node", "2",
                 "--global-batch", "8", "--micro", "2", "--image-size", "100x40,40x100", "--text-len", "40"]) == 0
    out = capsys.readouterr().out
    assert ("2 images (100x40 px (1 x 2 tiles of 56 px, 3 crops, 52 image tokens); 40x100 px (2 x 1 tiles of 56 px, "
            "3 crops, 56 image tokens))") in out
    assert ("vision crops per row: 6 of --max-tiles 10 (40% padding); decoder positions per row: 176 image (108 used)"
            " + 40 text = 216") in out


def test_images_the_row_cannot_hold_are_one_line(capsys):
    from mmpipe.cli import main
    base = ["plan", "--preset", "llava-next-tiny", "--gpus-per-node", "2", "--text-len", "40"]
    assert main(base + ["--image-size", "100x100", "--max-tiles", "3"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "mmpipe: error: --image-size 100x100: image 100x100 makes 5 crops (base + 2 x 2 tiles) > the row's 3 "
        "(--max-tiles) (--max-images 1)"]
    assert main(base + ["--max-tiles", "0"]) == 2
    err = capsys.readouterr().err.strip().splitlines()
    assert err == ["mmpipe: error: --max-tiles: 0 must be >= 1 (crops per row: each image's base crop and its tiles)"]
    assert main(["plan", "--preset", "qwen-tiny", "--max-tiles", "4"]) == 2
    assert capsys.readouterr().err.strip().splitlines() == [
        "mmpipe: error: --max-tiles: the qwen2_vl family's images take a patch budget (--max-patches); only the "
        "llava_next, internvl families take a crop budget"]
