"""The llava_next family's data side (mmpipe.data.anyres, the index's tilings, rows with a crop budget): images
through transformers' own LlavaNextImageProcessor / LlavaOnevisionImageProcessor, each image's block of as many
placeholders as transformers' processor (and model) gives it, for a 1 x 2, a 2 x 1 and a 2 x 2 grid and an image
over OneVision's cap; OneVision's several-image samples base crops only; packed rows within three budgets
(positions, image slots, crops); later stages' rows without decoding any image; bad inputs counted with their
reason. The tiny processors and models are tests/llava_next_models.py's (56 px crops, pinpoints up to 2 x 2)."""
from __future__ import annotations

import dataclasses
import json

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import (
    LlavaNextForConditionalGeneration,
    LlavaNextProcessor,
    LlavaOnevisionForConditionalGeneration,
    LlavaOnevisionProcessor,
    LlavaOnevisionVideoProcessor,
    PreTrainedTokenizerFast,
)

from llava_next_models import CROP, feature_counts, hf_config, image, processor
from mmpipe.config import ConfigError, load_preset
from mmpipe.data import images as images_module
from mmpipe.data.anyres import tile_rule
from mmpipe.data.args import DataArgs
from mmpipe.data.dataset import prepare, resolve_data
from mmpipe.data.packing import RowPlan, RowSet, row_shape, sample_size

WORDS = ["<unk>", "<s>", "</s>", "<pad>", "USER:", "ASSISTANT:", "what", "colour", "is", "it", "and", "this", "red",
         "blue", "green", "a", "long", "story", "<image>"]
TEMPLATE = ("{{ bos_token }}{% for m in messages %}{% if m['role'] == 'user' %}USER: {{ m['content'] }} "
            "{% else %}ASSISTANT: {{ m['content'] }}{{ eos_token }} {% endif %}{% endfor %}"
            "{% if add_generation_prompt %}ASSISTANT:{% endif %}")
# (width, height): 1 x 2 tiles, 2 x 1, 2 x 2 (OneVision: 8 x 8 features pooled to 5 x 5), 1 x 1
SIZES = {"wide.png": (100, 40), "tall.png": (40, 100), "big.png": (100, 100), "small.png": (56, 56)}
GRIDS = {"wide.png": (1, 2), "tall.png": (2, 1), "big.png": (2, 2), "small.png": (1, 1)}
STATS = dict(mean=(0.48, 0.45, 0.4), std=(0.27, 0.26, 0.28))  # llava_next_models.processor's


def config(kind: str):
    """llava-next-tiny, the image statistics of the tiny processors; 'onevision': its SigLIP-side settings and
    anyres_max 2 (hf_config('onevision')'s)."""
    cfg = load_preset("llava-next-tiny")
    v = dataclasses.replace(cfg.vision, **STATS)
    if kind == "onevision":
        v = dataclasses.replace(v, kind="siglip", feature_layer=-1, feature_select="full", anyres_max=2)
    return dataclasses.replace(cfg, vision=v)


def tokenizer() -> PreTrainedTokenizerFast:
    tok = Tokenizer(models.WordLevel({w: i for i, w in enumerate(WORDS)}, unk_token="<unk>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, bos_token="<s>", eos_token="</s>", pad_token="<pad>",
                                   unk_token="<unk>", additional_special_tokens=["<image>"])
    fast.chat_template = TEMPLATE
    return fast


def hf_processor(kind: str):
    """transformers' whole processor (image processor + placeholder expansion), as the published configs set it."""
    if kind == "next":
        return LlavaNextProcessor(image_processor=processor(kind), tokenizer=tokenizer(), patch_size=14,
                                  vision_feature_select_strategy="default", num_additional_image_tokens=1)
    return LlavaOnevisionProcessor(image_processor=processor(kind), tokenizer=tokenizer(),
                                   video_processor=LlavaOnevisionVideoProcessor(), num_image_tokens=16,
                                   vision_feature_select_strategy="full", vision_aspect_ratio="anyres_max_2")


def hf_placeholders(kind: str, images: list) -> list[int]:
    """Each image's placeholder count in the ids transformers' processor makes of '<image> and ... <image> what'."""
    proc = hf_processor(kind)
    text = " and ".join(["<image>"] * len(images)) + " what"
    ids = proc(text=text, images=[images], return_tensors="pt").input_ids[0]
    return runs(ids.numpy() == proc.image_token_id)


def runs(mask: np.ndarray) -> list[int]:
    """Lengths of the runs of True, in order: each image's placeholder block."""
    edges = np.flatnonzero(np.diff(np.r_[0, mask.astype(int), 0]))
    return (edges[1::2] - edges[::2]).tolist()


@pytest.mark.parametrize("kind", ["next", "onevision"])
def test_tiles_pixels_and_positions_are_transformers(kind):
    """Per image, from its size alone: the grid is transformers' select_best_resolution, the positions what its
    processor puts in the text and what its model lays out; the crops are its image processor's."""
    cfg = config(kind)
    rule = tile_rule(cfg, 0, 2)
    model_cls = LlavaNextForConditionalGeneration if kind == "next" else LlavaOnevisionForConditionalGeneration
    torch.manual_seed(0)
    model = model_cls(hf_config(kind)).eval()
    for name, (w, h) in SIZES.items():
        im = image(w, h, 1)
        ref = processor(kind)(images=[im], return_tensors="pt")
        crops, grid = rule.patches(im)
        assert rule.grid(w, h) == grid and grid[:4] == (h, w, *GRIDS[name]), name
        assert torch.equal(crops, ref["pixel_values"][0]) and len(crops) == 1 + GRIDS[name][0] * GRIDS[name][1]
        assert [grid[4]] == hf_placeholders(kind, [im]) == feature_counts(model, ref["pixel_values"],
                                                                           ref["image_sizes"]), name
    big = rule.grid(100, 100)[4]
    assert big == (16 + 5 * 6 if kind == "onevision" else 16 + 8 * 9)  # OneVision: over 2 x 16, pooled to 5 x 5
    # two images in one sample: OneVision encodes each as its base crop only (N + 1), NeXT tiles both
    pair = [image(100, 40, 2), image(40, 100, 3)]
    ref = processor(kind)(images=[pair], return_tensors="pt")
    got = [rule.patches(im, 2) for im in pair]
    want = hf_placeholders(kind, pair)
    assert [g[4] for _, g in got] == want == feature_counts(model, ref["pixel_values"], ref["image_sizes"])
    for k, (crops, grid) in enumerate(got):
        assert torch.equal(crops, ref["pixel_values"][k][:len(crops)])
        assert grid[2:4] == ((0, 0) if kind == "onevision" else GRIDS[["wide.png", "tall.png"][k]])


@pytest.mark.parametrize("kind", ["next", "onevision"])
def test_a_rows_image_positions_bound_every_images_count(kind):
    """TileRule.image_positions is at least transformers' count of any image size (unpadding, OneVision's pooling
    never add positions), and reached for LLaVA-NeXT by an image of the largest pinpoint's shape."""
    rule = tile_rule(config(kind), 0, 1)
    rng = np.random.default_rng(0)
    sizes = [(int(w), int(h)) for w, h in rng.integers(8, 400, (300, 2))] + [(112, 112), (112, 56), (56, 112)]
    counts = [rule.count(h, w) for w, h in sizes]
    assert max(counts) <= rule.image_positions()
    if kind == "next":
        assert rule.count(112, 112) == rule.image_positions() == 16 + 8 * 9


def test_default_budgets_hold_the_largest_sample():
    """T and the image positions by default: NeXT M x (1 + 4) crops and M x 88 positions; OneVision one tiled image
    (5 crops, 62 positions at most) or M base crops of 17 positions, whichever is more."""
    assert tile_rule(config("next"), 0, 2).row_budget(2) == (10, 176)
    assert tile_rule(config("onevision"), 0, 4).row_budget(4) == (5, 68)
    assert tile_rule(config("onevision"), 0, 1).row_budget(1) == (5, 62)
    shape = row_shape(config("next"), 2, 40)
    assert (shape.vision_budget, shape.length, shape.images.crop) == (10, 176 + 40, (3, CROP, CROP))


def conv(*turns: str) -> list[dict]:
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]


GOOD = [{"image": "wide.png", "conversations": conv("<image>\nwhat colour is it", "red")},
        {"image": ["tall.png", "small.png"], "conversations": conv("what colour is <image> and <image>", "blue")},
        {"conversations": conv("what colour is it", "green")},
        {"image": "big.png", "conversations": conv("what colour is this <image>", "red and blue")},
        {"image": "small.png", "conversations": conv("<image> what colour is it", "blue")}]
BAD = [("corrupt_image", {"image": "bad.png", "conversations": conv("<image> what colour is it", "red")}),
       ("image_marker", {"image": "wide.png", "conversations": conv("<image> what <image> colour", "red")}),
       ("too_many_tiles", {"image": ["big.png", "big.png"], "conversations": conv("<image> <image> what", "red")}),
       ("bad_aspect", {"image": "line.png", "conversations": conv("<image> what colour", "red")}),
       ("too_many_images", {"image": ["wide.png"] * 3, "conversations": conv("<image> <image> <image>", "red")}),
       ("too_long", {"image": "wide.png", "conversations": conv("<image> " + "a long story " * 20, "red")})]
T = 8  # --max-tiles: two 2 x 2 images (10 crops) do not fit, any other record does


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("anyres_data")
    for k, (name, (w, h)) in enumerate({**SIZES, "line.png": (500, 20)}.items()):
        image(w, h, k).save(root / name)
    (root / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    (root / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in GOOD + [r for _, r in BAD]))
    tokenizer().save_pretrained(root / "tok")
    return root


def load(root, out, kind="next", **flags):
    cfg = config(kind)
    args = DataArgs(data=str(root / "data.jsonl"), tokenizer=str(root / "tok"), text_len=40, data_workers=0, **flags)
    opts = resolve_data(args, cfg)
    return cfg, opts, prepare(opts, cfg, out, seed=0, verbose=False)


def names_of(record: dict) -> list[str]:
    im = record.get("image")
    return im if isinstance(im, list) else [im] * (im is not None)


def test_packed_rows_hold_each_samples_placeholders_crops_and_tilings(data, tmp_path):
    cfg, opts, samples = load(data, tmp_path, max_images=2, max_tiles=T, pack=True)
    shape = row_shape(cfg, 2, opts.text_len, opts.vision_budget)
    assert (opts.vision_budget, shape.length) == (T, 2 * 88 + 40)
    plan = RowPlan(sample_size(samples, shape), shape, pack=True, chunk=len(samples.index))
    rows = RowSet(samples, plan)
    files = {name: Image.open(data / name).convert("RGB") for name in SIZES}
    seen, r = [], 0
    while len(seen) < len(GOOD):
        item, positions = rows[r], plan.row(r)
        seen += positions
        # the three budgets: positions, image slots, crops
        assert item["input_ids"].shape == (shape.length,) and item["pixels"].shape == (T, 3, CROP, CROP)
        used = [t for t in item["tiling"] if any(t)]
        assert len(item["tiling"]) == 2 and sum(1 + t[2] * t[3] for t in used) <= T
        slot, crop = 0, 0
        for seg, pos in enumerate(positions, start=1):
            names = names_of(GOOD[samples.row(pos)])
            ids = item["input_ids"][item["segments"] == seg]
            want = hf_placeholders("next", [files[n] for n in names]) if names else []
            assert runs(ids == cfg.image_token_id) == want
            ref = processor("next")(images=[files[n] for n in names], return_tensors="pt") if names else None
            for k, name in enumerate(names):
                (w, h), (rows_, cols) = SIZES[name], GRIDS[name]
                assert tuple(item["tiling"][slot]) == (h, w, rows_, cols) and item["has_image"][slot] == seg
                n = 1 + rows_ * cols
                assert torch.equal(item["pixels"][crop:crop + n], ref["pixel_values"][k][:n])
                slot, crop = slot + 1, crop + n
        assert item["has_image"][slot:].tolist() == [0] * (2 - slot) and not item["pixels"][crop:].any()
        r += 1
    assert sorted(seen) == list(range(len(GOOD))) and r < len(GOOD)  # packed: fewer rows than samples


def test_later_stage_rows_carry_the_tilings_without_decoding_an_image(data, tmp_path, monkeypatch):
    cfg, opts, samples = load(data, tmp_path, max_images=2, max_tiles=T)
    shape = row_shape(cfg, 2, opts.text_len, opts.vision_budget)
    plan = RowPlan(sample_size(samples, shape), shape, pack=False)
    first = [RowSet(samples, plan)[r] for r in range(len(GOOD))]

    def no_decoding(*a, **k):
        raise AssertionError("a later stage opened an image")
    monkeypatch.setattr(images_module.Image, "open", no_decoding)
    monkeypatch.setattr("mmpipe.data.samples.open_image", no_decoding)
    later = RowSet(samples, plan, need_images=False)
    for r, want in enumerate(first):
        item = later[r]
        assert "pixels" not in item and item["tiling"] == want["tiling"]
        assert np.array_equal(item["input_ids"], want["input_ids"]) and np.array_equal(item["labels"], want["labels"])
    assert sorted(t for w in first for t in w["tiling"] if any(t)) == sorted(
        [(40, 100, 1, 2), (100, 40, 2, 1), (56, 56, 1, 1), (100, 100, 2, 2), (56, 56, 1, 1)])


def test_onevision_rows_give_a_several_image_samples_images_their_base_crop_only(data, tmp_path):
    """The record of two images: tilings (h, w, 0, 0), one crop and 16 + 1 positions each, as transformers has it."""
    cfg, opts, samples = load(data, tmp_path, "onevision", max_images=2)
    assert opts.vision_budget == 5  # one tiled image (1 + 4) or two base crops
    shape = row_shape(cfg, 2, opts.text_len, opts.vision_budget)
    rows = RowSet(samples, RowPlan(sample_size(samples, shape), shape, pack=False))
    pos = next(p for p in range(len(samples.index)) if samples.row(p) == 1)  # two big images: good here
    item = rows[pos]
    assert item["tiling"] == [(100, 40, 0, 0), (56, 56, 0, 0)]
    assert int((item["input_ids"] == cfg.image_token_id).sum()) == 2 * 17
    pair = [Image.open(data / n).convert("RGB") for n in ("tall.png", "small.png")]
    ref = processor("onevision")(images=[pair], return_tensors="pt")["pixel_values"]
    assert torch.equal(item["pixels"][:2], ref[:, 0]) and not item["pixels"][2:].any()


def test_bad_inputs_are_counted_and_listed_with_their_reason(data, tmp_path):
    _, _, samples = load(data, tmp_path, max_images=2, max_tiles=T)
    stats = samples.index.stats
    assert stats["good"] == len(GOOD) and stats["bad"] == len(BAD)
    assert stats["bad_by_kind"] == {kind: 1 for kind, _ in BAD}
    lines = [json.loads(line) for line in (tmp_path / "data" / "bad_records.jsonl").read_text().splitlines()]
    assert [b["kind"] for b in lines] == [kind for kind, _ in BAD]
    assert "2 images make 10 crops (base crops + tiles) > the row's 8 (--max-tiles)" in lines[2]["reason"]
    assert "500x20" in lines[3]["reason"] and "unpadding" in lines[3]["reason"]


@pytest.mark.parametrize("preset, flags, message", [
    ("llava-next-tiny", {"max_tiles": 0}, "--max-tiles: 0 must be >= 1"),
    # a budget the family's images do not take: named with the one they take, and the families taking the flag's
    ("llava-next-tiny", {"max_patches": 64}, "--max-patches: the llava_next family's images take a crop budget "
                                             "(--max-tiles); only the qwen2_vl, qwen3_vl, qwen3_5 families take "
                                             "a patch budget"),
    ("llava-tiny", {"max_tiles": 8}, "--max-tiles: the llava family's images are a fixed size; only the llava_next, "
                                     "internvl families take a crop budget"),
    ("qwen-tiny", {"max_tiles": 8}, "--max-tiles: the qwen2_vl family's images take a patch budget (--max-patches); "
                                    "only the llava_next, internvl families take a crop budget"),
])
def test_a_bad_crop_budget_is_one_line(preset, flags, message):
    with pytest.raises(ConfigError) as e:
        resolve_data(DataArgs(**flags), load_preset(preset))
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1


def test_reference_model_trains_on_a_packed_micro_batch(data, tmp_path):
    """End to end: packed rows -> rank_batches' stage tuple (pixels [B, T, 3, S, S], input_ids, has_image,
    segments, tiling [B, M, 4]) -> the family's ReferenceModel: a finite loss, gradients reaching the tower."""
    from mmpipe.data.batches import StepBatches, rank_batches
    from mmpipe.model import IGNORE_INDEX, ReferenceModel
    from mmpipe.model.builder import lm_loss
    cfg, opts, samples = load(data, tmp_path, max_images=2, max_tiles=T, pack=True)
    shape = row_shape(cfg, 2, opts.text_len, opts.vision_budget)
    rows = RowSet(samples, RowPlan(sample_size(samples, shape), shape, pack=True))
    inputs, labels = next(rank_batches(rows, StepBatches(0, 2, 1, 0, 1)))
    assert [tuple(x.shape) for x in inputs] == [(2, T, 3, CROP, CROP), (2, shape.length), (2, 2), (2, shape.length),
                                                (2, 2, 4)]
    model = ReferenceModel(cfg, seed=0)
    loss = lm_loss(model(*inputs), labels)
    loss.backward()
    assert torch.isfinite(loss) and labels.ne(IGNORE_INDEX).sum() > 0
    assert next(model[0].parameters()).grad.abs().sum() > 0



def test_pack_alone_sizes_slots_and_the_crop_budget_from_the_data(data, tmp_path):
    """--pack, no --max-images / --max-tiles: the data's mean sample sets M (mmpipe.data.dataset.packed_image_slots)
    and T follows it (M x 5 crops), on the same index: the index's refusals never depend on the slots chosen."""
    from mmpipe.data.dataset import packed_image_slots
    cfg, opts, samples = load(data, tmp_path, pack=True)
    assert opts.auto_budget and (opts.max_images, opts.vision_budget) == (1, 5)
    packed = packed_image_slots(opts, cfg, tmp_path, seed=0)
    assert packed.max_images > 1 and packed.vision_budget == 5 * packed.max_images
    assert prepare(packed, cfg, tmp_path, seed=0, verbose=False).index.stats == samples.index.stats
