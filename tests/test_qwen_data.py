"""The Qwen2-VL family's data side (mmpipe.data.patches, the index's grids, rows with a patch budget):
images through transformers' own Qwen2VLImageProcessor, each image's bracketed block of t h w / 4
placeholders at its marker, packed rows within three budgets (positions, image slots, patches), later
stages' rows without decoding any image, and bad inputs counted with their reason."""
from __future__ import annotations

import json

import numpy as np
import pytest
import torch
from PIL import Image
from tokenizers import Tokenizer, models, pre_tokenizers
from transformers import PreTrainedTokenizerFast, Qwen2VLImageProcessor

from mmpipe.config import ConfigError, load_preset
from mmpipe.data import images as images_module
from mmpipe.data.args import DataArgs
from mmpipe.data.dataset import prepare, resolve_data
from mmpipe.data.packing import RowPlan, RowSet, row_shape, sample_size
from mmpipe.data.patches import patch_rule
from mmpipe.model import IGNORE_INDEX

START, END, PAD = 197, 198, 199  # qwen-tiny's <|vision_start|>, <|vision_end|>, <|image_pad|>
WORDS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "user", "assistant", "what", "colour", "is", "it", "and",
         "this", "red", "blue", "green", "a", "long", "story"]
SPECIALS = ["<|endoftext|>", "<|im_start|>", "<|im_end|>", "<|vision_start|>", "<|vision_end|>", "<|image_pad|>"]
# Qwen's chat template without the default system turn
TEMPLATE = ("{% for m in messages %}<|im_start|>{{ m['role'] }}\n{{ m['content'] }}<|im_end|>\n{% endfor %}"
            "{% if add_generation_prompt %}<|im_start|>assistant\n{% endif %}")
SIZES = {"a.png": (56, 56), "b.png": (84, 56), "c.png": (112, 56), "d.png": (400, 300)}  # (width, height)
P = 96  # --max-patches: one image up to 64 patches (max_pixels 112 x 112), two images 48 each


def save_tokenizer(path) -> None:
    """A Qwen-like tokenizer: no BOS, the vision specials at qwen-tiny's ids 197 .. 199."""
    filler = [f"w{i}" for i in range(START - len(WORDS))]
    vocab = {w: i for i, w in enumerate(WORDS + filler + ["<|vision_start|>", "<|vision_end|>", "<|image_pad|>"])}
    tok = Tokenizer(models.WordLevel(vocab, unk_token="<|endoftext|>"))
    tok.pre_tokenizer = pre_tokenizers.WhitespaceSplit()
    fast = PreTrainedTokenizerFast(tokenizer_object=tok, eos_token="<|im_end|>", pad_token="<|endoftext|>",
                                   additional_special_tokens=SPECIALS)
    fast.chat_template = TEMPLATE
    fast.save_pretrained(path)


def conv(*turns: str) -> list[dict]:
    return [{"from": "human" if i % 2 == 0 else "gpt", "value": t} for i, t in enumerate(turns)]


GOOD = [{"image": "a.png", "conversations": conv("<image>\nwhat colour is it", "red")},
        {"image": ["b.png", "c.png"], "conversations": conv("what colour is <image> and <image>", "blue and green")},
        {"conversations": conv("what colour is it", "green")},
        {"image": "d.png", "conversations": conv("what colour is this <image>", "red")},
        {"image": "a.png", "conversations": conv("<image> what colour is it", "blue")}]
BAD = [("corrupt_image", {"image": "bad.png", "conversations": conv("<image> what colour is it", "red")}),
       ("image_marker", {"image": "a.png", "conversations": conv("<image> what <image> colour", "red")}),
       ("too_many_patches", {"image": "thin.png", "conversations": conv("<image> what colour", "red")}),
       ("bad_aspect", {"image": "line.png", "conversations": conv("<image> what colour", "red")}),
       ("too_long", {"image": "a.png", "conversations": conv("<image> " + "a long story " * 20, "red")})]


@pytest.fixture(scope="module")
def data(tmp_path_factory):
    root = tmp_path_factory.mktemp("qwen_data")
    rng = np.random.default_rng(0)
    for name, (w, h) in {**SIZES, "thin.png": (28, 2000), "line.png": (10, 2500)}.items():
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / name)
    (root / "bad.png").write_bytes(b"\x89PNG\r\n\x1a\n" + bytes(range(256)))
    path = root / "data.jsonl"
    path.write_text("".join(json.dumps(r) + "\n" for r in GOOD + [r for _, r in BAD]))
    save_tokenizer(root / "tok")
    return root


def load(root, out, **flags):
    cfg = load_preset("qwen-tiny")
    args = DataArgs(data=str(root / "data.jsonl"), tokenizer=str(root / "tok"), text_len=40, data_workers=0, **flags)
    opts = resolve_data(args, cfg)
    return cfg, opts, prepare(opts, cfg, out, seed=0, verbose=False)


def processor(cfg, max_pixels: int) -> Qwen2VLImageProcessor:
    v = cfg.vision
    return Qwen2VLImageProcessor(patch_size=14, merge_size=2, temporal_patch_size=2, min_pixels=v.min_pixels,
                                 max_pixels=max_pixels, image_mean=list(v.mean), image_std=list(v.std))


def test_grid_and_patches_are_the_image_processors(data):
    cfg = load_preset("qwen-tiny")
    rule = patch_rule(cfg, P)
    want_grids = {"a.png": (1, 4, 4), "b.png": (1, 4, 6), "c.png": (1, 4, 8), "d.png": (1, 6, 8)}  # d: 400x300 down
    for name, (w, h) in SIZES.items():
        image = Image.open(data / name).convert("RGB")
        ref = processor(cfg, cfg.vision.max_pixels)(images=[image], return_tensors="pt")
        patches, grid = rule.patches(image)
        assert rule.grid(w, h) == grid == tuple(ref["image_grid_thw"][0].tolist()) == want_grids[name]
        assert patches.shape == (np.prod(grid), 1176) and torch.equal(patches, ref["pixel_values"])
        assert rule.positions(grid) == np.prod(grid) // 4
    # a sample's images share the row: two images of a P = 96 row get 48 patches each at most
    assert rule.cap(2) == 48 * 196 and rule.grid(400, 300, 2) == (1, 6, 8) and rule.grid(600, 300, 2) == (1, 4, 8)


def expected_ids(tok, record: dict, grids: list) -> list[int]:
    """What Qwen2-VL's processor gives: the chat template with <|vision_start|><|image_pad|><|vision_end|> at
    each marker (the first user turn's start without one), then each <|image_pad|> as t h w / 4 of them."""
    text = "<|vision_start|><|image_pad|><|vision_end|>"
    msgs = [{"role": "user" if t["from"] == "human" else "assistant", "content": t["value"].strip()}
            for t in record["conversations"]]
    n_images = len(record["image"]) if isinstance(record.get("image"), list) else int("image" in record)
    for m in msgs:
        m["content"] = m["content"].replace("<image>", text)
    if n_images and not any(text in m["content"] for m in msgs):
        msgs[0]["content"] = text * n_images + msgs[0]["content"]
    ids, k = [], 0
    for t in tok(tok.apply_chat_template(msgs, tokenize=False), add_special_tokens=False).input_ids:
        ids += [PAD] * (int(np.prod(grids[k])) // 4) if t == PAD else [t]
        k += t == PAD
    return ids


def test_packed_rows_hold_each_samples_tokens_labels_patches_and_grids(data, tmp_path):
    cfg, opts, samples = load(data, tmp_path, max_images=2, max_patches=P, pack=True)
    assert opts.vision_budget == P and opts.image_text == "<|vision_start|><|image_pad|><|vision_end|>"
    shape = row_shape(cfg, 2, opts.text_len, opts.vision_budget)
    assert shape.length == 2 * 2 + P // 4 + 40
    plan = RowPlan(sample_size(samples, shape), shape, pack=True, chunk=len(samples.index))
    rows = RowSet(samples, plan)
    ref = {name: processor(cfg, cap)(images=[Image.open(data / name).convert("RGB")], return_tensors="pt")
           for name, cap in (("a.png", 12544), ("b.png", 48 * 196), ("c.png", 48 * 196), ("d.png", 12544))}
    seen, r = [], 0
    while len(seen) < len(GOOD):
        item, positions = rows[r], plan.row(r)
        seen += positions
        used = [tuple(g) for g in item["tiling"] if any(g)]
        # the three budgets: positions, image slots, patches
        assert item["input_ids"].shape == (shape.length,) and item["pixels"].shape == (P, 1176)
        assert len(item["tiling"]) == 2 and sum(np.prod(g) for g in used) <= P
        slot, patch = 0, 0
        for seg, pos in enumerate(positions, start=1):
            record = GOOD[samples.row(pos)]
            names = record["image"] if isinstance(record.get("image"), list) else [record.get("image")] * (
                "image" in record)
            grids = [tuple(ref[n]["image_grid_thw"][0].tolist()) for n in names]
            where = np.flatnonzero(item["segments"] == seg)
            ids, labels = item["input_ids"][where], item["labels"][where]
            assert ids.tolist() == expected_ids(opts.tokenizer, record, grids)
            # labels: each answer token and its <|im_end|>, predicted from the position before
            answer = [t for t in labels.tolist() if t != IGNORE_INDEX]
            want = opts.tokenizer(record["conversations"][1]["value"], add_special_tokens=False).input_ids + [2]
            assert answer == want
            for name, grid in zip(names, grids):
                assert tuple(item["tiling"][slot]) == grid and item["has_image"][slot] == seg
                n = int(np.prod(grid))
                assert torch.equal(item["pixels"][patch:patch + n], ref[name]["pixel_values"])
                slot, patch = slot + 1, patch + n
        assert item["has_image"][slot:].tolist() == [0] * (2 - slot) and not item["pixels"][patch:].any()
        r += 1
    assert sorted(seen) == list(range(len(GOOD))) and r < len(GOOD)  # packed: fewer rows than samples


def test_later_stage_rows_carry_the_grids_without_decoding_an_image(data, tmp_path, monkeypatch):
    cfg, opts, samples = load(data, tmp_path, max_images=2, max_patches=P)
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
    assert sorted(tuple(g) for w in first for g in w["tiling"] if any(g)) == sorted(
        [(1, 4, 4), (1, 4, 6), (1, 4, 8), (1, 6, 8), (1, 4, 4)])


def test_bad_inputs_are_counted_and_listed_with_their_reason(data, tmp_path):
    _, _, samples = load(data, tmp_path, max_images=2, max_patches=P)
    stats = samples.index.stats
    assert stats["good"] == len(GOOD) and stats["bad"] == len(BAD)
    assert stats["bad_by_kind"] == {kind: 1 for kind, _ in BAD}
    lines = [json.loads(line) for line in (tmp_path / "data" / "bad_records.jsonl").read_text().splitlines()]
    assert [b["kind"] for b in lines] == [kind for kind, _ in BAD]
    thin = lines[2]["reason"]
    assert "28x2000" in thin and "132 patches > the 64" in thin and "--max-patches" in thin


@pytest.mark.parametrize("flags, message", [
    ({"max_patches": 90}, "--max-patches: 90 must be a multiple of merge_size^2 = 4"),
    ({"max_patches": 8}, "at least 16"),
])
def test_bad_patch_budget_is_one_line(data, tmp_path, flags, message):
    with pytest.raises(ConfigError) as e:
        load(data, tmp_path, **flags)
    assert message in str(e.value) and len(str(e.value).splitlines()) == 1


def test_other_families_refuse_a_patch_budget():
    with pytest.raises(ConfigError, match="the llava family's images are a fixed size; only the qwen2_vl, qwen3_vl, "
                                          "qwen3_5 families take a patch budget"):
        resolve_data(DataArgs(max_patches=64), load_preset("llava-tiny"))


def test_builtin_tokenizer_puts_the_image_block_after_bos():
    """The built-in shapes set with the family: its 112 px images are 8 x 8 grids, one block of 16 right after BOS."""
    cfg = load_preset("qwen-tiny")
    opts = resolve_data(DataArgs(), cfg)
    samples = prepare(opts, cfg, "unused", seed=0)
    shape = row_shape(cfg, 1, opts.text_len, opts.vision_budget)
    assert opts.vision_budget == 64 and shape.length == 2 + 16 + opts.text_len
    item = RowSet(samples, RowPlan(sample_size(samples, shape), shape, pack=False))[0]
    assert item["input_ids"][1:19].tolist() == [START] + [PAD] * 16 + [END] and item["tiling"] == [(1, 8, 8)]
    assert item["pixels"].shape == (64, 1176) and item["pixels"].abs().sum() > 0


def test_a_record_without_markers_gets_its_images_first_and_no_bos(data):
    """Pairs and other marker-less records: one image block per image at the start of the first user turn, where
    Qwen's chat template puts an image item; a tokenizer without BOS gets none added."""
    from mmpipe.data.text import ConversationEncoder
    opts = resolve_data(DataArgs(data=str(data / "data.jsonl"), tokenizer=str(data / "tok")), load_preset("qwen-tiny"))
    encoder = ConversationEncoder(opts.tokenizer, 40, markers=True, image_text=opts.image_text)
    enc = encoder.encode([("user", "what colour is it"), ("assistant", "red")], n_images=2)
    tok = opts.tokenizer
    assert tok.convert_ids_to_tokens(enc.ids[:4].tolist()) == ["<|im_start|>", "user", "what", "colour"]
    assert enc.image_at.tolist() == [2, 2]


def test_reference_model_trains_on_a_packed_micro_batch(data, tmp_path):
    """End to end: packed rows -> rank_batches' stage tuple (pixels [B, P, 1176], input_ids, has_image, segments,
    tiling [B, M, 3]) -> the family's ReferenceModel: a finite loss with gradients reaching the patch embedding."""
    from mmpipe.data.batches import StepBatches, rank_batches
    from mmpipe.model import ReferenceModel
    from mmpipe.model.builder import lm_loss
    cfg, opts, samples = load(data, tmp_path, max_images=2, max_patches=P, pack=True)
    shape = row_shape(cfg, 2, opts.text_len, opts.vision_budget)
    rows = RowSet(samples, RowPlan(sample_size(samples, shape), shape, pack=True))
    inputs, labels = next(rank_batches(rows, StepBatches(0, 2, 1, 0, 1)))
    assert [tuple(x.shape) for x in inputs] == [(2, P, 1176), (2, shape.length), (2, 2), (2, shape.length), (2, 2, 3)]
    model = ReferenceModel(cfg, seed=0)
    loss = lm_loss(model(*inputs), labels)
    loss.backward()
    assert torch.isfinite(loss) and labels.ne(IGNORE_INDEX).sum() > 0
    assert type(model[0]).__name__ == "QwenPatchEmbed" and model[0].proj.weight.grad.abs().sum() > 0


def test_pack_alone_sizes_slots_and_patches_from_the_data(data, tmp_path):
    """--pack, no --max-images / --max-patches: 3 good image samples of 16, 48 and 16 patches (mean 80 / 3) and
    short texts give M = 3 slots and P = 3 x 80 / 3 = 80 patches (above one 64-patch image): L = 6 + 20 + 40."""
    from mmpipe.data.dataset import packed_image_slots
    cfg, opts, _ = load(data, tmp_path, pack=True)
    assert opts.auto_slots and opts.auto_budget and opts.vision_budget == 64
    opts = packed_image_slots(opts, cfg, tmp_path, seed=0)
    assert (opts.max_images, opts.vision_budget) == (3, 80)
    assert row_shape(cfg, opts.max_images, opts.text_len, opts.vision_budget).length == 66
