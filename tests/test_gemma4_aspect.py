"""The gemma4 family's images of any aspect ratio (issue 55; mmpipe.data.gemma4, mmpipe.model.gemma4): test_gemma4's
tiny transformers Gemma 4 with a 256-entry position table and an image processor at 70 soft tokens (4-px patches:
at most 630 patches an image, a side of up to 70 x 3 = 210 patches), so `mmpipe import --hf` takes its images as
transformers' Gemma4ImageProcessor makes them (vision.max_soft_tokens 70). Three images of 2:1, 1:3 and 1:1 get
grids of 15 x 33, 42 x 12 and 24 x 24 patches, 55, 56 and 64 soft tokens; read through mmpipe's own image kind, they
give transformers' logits, each image's block its own length. In-process, no launch."""
from __future__ import annotations

import json

import pytest
import torch

from mmpipe.cli import main
from mmpipe.config import config_from_dict
from mmpipe.runtime.checkpoint import load_reference
from test_gemma3 import _tokenizer
from test_gemma4 import BOI, EOI, IMG, LOGITS_TOL, _hf_model

TABLE, BUDGET = 256, 70
SIZES = [(64, 32), (30, 90), (50, 50)]  # (W, H): 2:1, 1:3, square
GRIDS = [(1, 15, 33), (1, 42, 12), (1, 24, 24)]  # transformers' get_aspect_ratio_preserving_size at 630 patches


def _hf_aspect_model():
    """test_gemma4's model (its weights and perturbations) with a position table of 256 (random, std 0.5) and a
    context of 512."""
    from transformers import Gemma4ForConditionalGeneration
    small = _hf_model()
    cfg = small.config
    cfg.vision_config.position_embedding_size = TABLE
    cfg.text_config.max_position_embeddings = 512  # a row of 3 images: 3 x 2 + 3 x 630 / 9 = 216 image positions
    model = Gemma4ForConditionalGeneration(cfg).eval()
    state = {k: v for k, v in small.state_dict().items() if "position_embedding_table" not in k}
    missing, unexpected = model.load_state_dict(state, strict=False)
    assert [m for m in missing if "position_embedding_table" not in m] == [] and unexpected == []
    with torch.no_grad():
        table = model.model.vision_tower.patch_embedder.position_embedding_table
        table.copy_(torch.randn(table.shape, generator=torch.Generator().manual_seed(7)) * 0.5)
    return model


@pytest.fixture(scope="module")
def aspect(tmp_path_factory):
    """(transformers' model, its directory, the imported model, the three PIL images)."""
    from PIL import Image
    from transformers import Gemma4ImageProcessor
    d = tmp_path_factory.mktemp("gemma4_aspect")
    hf = _hf_aspect_model()
    hf.save_pretrained(d / "hf")
    _tokenizer(d / "hf")
    Gemma4ImageProcessor(patch_size=4, max_soft_tokens=BUDGET, pooling_kernel_size=3).save_pretrained(d / "hf")
    assert main(["import", "--hf", str(d / "hf"), "--out", str(d / "run")]) == 0
    cfg = config_from_dict(json.loads((d / "run" / "model.json").read_text()), "gemma4")
    g = torch.Generator().manual_seed(11)
    images = []
    for i, (w, h) in enumerate(SIZES):
        images.append(Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy()))
        images[-1].save(d / f"{i}.png")
    return hf, d, load_reference(d / "run" / "checkpoints", cfg).eval(), images


def _prompts(n: int) -> list[list[int]]:
    """A prompt a row: BOS, two words, the image's block at position 3, two words."""
    return [[1, 10 + i, 20 + i, 30 + i, 40 + i] for i in range(n)]


def test_import_takes_any_aspect_ratio_with_transformers_logits(aspect):
    """A batch of the three images, one a row, read by the family's image kind (transformers' Gemma4ImageProcessor
    at the model's budget), each prompt's block as long as its image's grid says: mmpipe's logits equal
    transformers' on every real position within 1e-4; the stage tuple carries each slot's grid (tiling)."""
    from transformers import Gemma4ImageProcessor

    from mmpipe.data.image_kinds import image_kind
    from mmpipe.model.rows import sample_rows
    hf, d, model, images = aspect
    cfg = model.cfg
    assert cfg.vision.max_soft_tokens == BUDGET
    kind = image_kind(cfg)
    read = kind.one_image(cfg)
    pixels, tiling, grids = kind.stack(cfg, [read(im) for im in images])
    assert [tuple(g[0]) for g in grids] == GRIDS and tiling[:, 0].tolist() == [list(g) for g in GRIDS]
    prompts = [kind.with_images(p, cfg, [3], g) for p, g in zip(_prompts(3), grids)]
    assert [p.count(IMG) for p in prompts] == [55, 56, 64]
    assert all(p[3] == BOI and p[4 + p.count(IMG)] == EOI for p in prompts)
    width = max(len(p) for p in prompts)
    ids = torch.tensor([p + [0] * (width - len(p)) for p in prompts])
    real = torch.tensor([[1] * len(p) + [0] * (width - len(p)) for p in prompts])
    row_ids, has_image, segments = sample_rows(cfg, ids)
    segments = segments * real
    proc = Gemma4ImageProcessor.from_pretrained(d / "hf")(images=images, return_tensors="pt")
    with torch.no_grad():
        got = model(pixels, row_ids, has_image, segments, tiling)
        want = hf(input_ids=ids, attention_mask=real, pixel_values=proc["pixel_values"],
                  image_position_ids=proc["image_position_ids"], mm_token_type_ids=(ids == IMG).long()).logits
        swapped = model(pixels, row_ids, has_image, segments, tiling[..., [0, 2, 1]])  # each grid transposed
    diffs = [(got[b, :len(p)] - want[b, :len(p)]).abs().max().item() for b, p in enumerate(prompts)]
    assert max(diffs) < LOGITS_TOL, diffs
    # the oblong images' patches and token counts on cols x rows grids: the positions, pooling cells and rotary show
    assert min((swapped[b, :len(p)] - want[b, :len(p)]).abs().max().item() for b, p in enumerate(prompts[:2])) > 1e-2


def test_generate_equals_transformers_greedy_on_any_aspect_ratio(aspect, capsys):
    """`mmpipe generate --checkpoint HF_DIR` with the three images in one batch (their blocks 55, 56 and 64 soft
    tokens long, so the rows differ in length): transformers' greedy answers for each image alone, its processor's
    pixels and positions, up to 12 new tokens (past the 6-position window, the shared layers reading their
    producers)."""
    from transformers import AutoTokenizer, Gemma4ImageProcessor
    hf, d, _, images = aspect
    tok, proc = AutoTokenizer.from_pretrained(d / "hf"), Gemma4ImageProcessor.from_pretrained(d / "hf")
    argv, want = ["generate", "--checkpoint", str(d / "hf"), "--max-new-tokens", "12"], []
    for i, (image, (_, rows, cols)) in enumerate(zip(images, GRIDS)):
        argv += ["--image", str(d / f"{i}.png"), "--prompt", f"<image>\nw{40 + i} w{50 + i}"]
        ids = torch.tensor([[1, 4, BOI] + [IMG] * (rows * cols // 9) + [EOI, 40 + i, 50 + i, 5]])
        px = proc(images=[image], return_tensors="pt")
        with torch.no_grad():
            out = hf.generate(input_ids=ids, pixel_values=px["pixel_values"],
                              image_position_ids=px["image_position_ids"], mm_token_type_ids=(ids == IMG).long(),
                              max_new_tokens=12, do_sample=False)
        want.append(tok.decode(out[0, ids.shape[1]:], skip_special_tokens=True).strip())
    capsys.readouterr()
    assert main(argv) == 0
    got = [json.loads(line)["answer"] for line in capsys.readouterr().out.splitlines()]
    assert got == want
    assert len(set(got)) > 1 and max(len(a.split()) for a in got) > 6  # answers differ, and past the window


def test_packed_training_row_gives_each_samples_transformers_logits(aspect, tmp_path):
    """The training data path: two records (one with the 2:1 and 1:3 images, one with the square) indexed, packed
    into one row (--pack, 3 image slots, the default patch budget 3 x 630) and batched as the pipeline's stage
    tuple (pixels [1, P, 48], tiling [1, 3, 3]): each sample's logits in the row equal transformers' on that
    sample alone (its ids as the row holds them, its images through transformers' processor) within 1e-4."""
    from transformers import Gemma4ImageProcessor

    from mmpipe.data.args import DataArgs
    from mmpipe.data.batches import StepBatches, rank_batches
    from mmpipe.data.dataset import prepare, resolve_data
    from mmpipe.data.packing import RowPlan, RowSet, row_shape, sample_size
    from test_qwen_data import conv
    hf, d, model, images = aspect
    cfg = model.cfg
    records = [{"image": [str(d / "0.png"), str(d / "1.png")], "conversations": conv("<image> w20 <image> w21", "w30")},
               {"image": str(d / "2.png"), "conversations": conv("<image> w22", "w32 w33")}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    args = DataArgs(data=str(tmp_path / "data.jsonl"), tokenizer=str(d / "hf"), text_len=40, data_workers=0,
                    max_images=3, pack=True)
    opts = resolve_data(args, cfg)
    samples = prepare(opts, cfg, tmp_path / "out", seed=0, verbose=False)
    shape = row_shape(cfg, 3, opts.text_len, opts.vision_budget)
    rows = RowSet(samples, RowPlan(sample_size(samples, shape), shape, pack=True))
    inputs, _ = next(rank_batches(rows, StepBatches(0, 1, 1, 0, 1)))
    pixels, ids, has_image, segments, tiling = inputs
    assert pixels.shape == (1, 3 * 630, 48) and sorted(tuple(g) for g in tiling[0].tolist()) == sorted(GRIDS)
    proc = Gemma4ImageProcessor.from_pretrained(d / "hf")
    counts = []
    with torch.no_grad():
        got = model(*inputs)
        for seg in (1, 2):
            where = segments[0] == seg
            owned = [images[GRIDS.index(tuple(g))] for g, o in zip(tiling[0].tolist(), has_image[0].tolist())
                     if o == seg]  # the sample's images in its slots' order
            counts.append(len(owned))
            px = proc(images=owned, return_tensors="pt")
            sample = ids[0, where][None]
            want = hf(input_ids=sample, pixel_values=px["pixel_values"], image_position_ids=px["image_position_ids"],
                      mm_token_type_ids=(sample == IMG).long()).logits
            assert (got[0, where] - want[0]).abs().max().item() < LOGITS_TOL, seg
    assert sorted(counts) == [1, 2]  # both samples, each with its own images


def test_export_keeps_the_soft_token_budget(aspect, tmp_path):
    """`mmpipe export` of the imported run writes transformers' Gemma4ImageProcessor at the run's budget beside the
    weights, so importing the export reads images as the run did (vision.max_soft_tokens 70, not the square a
    directory without it gets)."""
    from transformers import Gemma4ImageProcessor

    from mmpipe.hf.gemma4 import hf_gemma4_config
    _, d, _, _ = aspect
    assert main(["export", "--checkpoint", str(d / "run"), "--out", str(tmp_path / "hf")]) == 0
    proc = Gemma4ImageProcessor.from_pretrained(tmp_path / "hf")
    assert (proc.max_soft_tokens, proc.patch_size, proc.pooling_kernel_size) == (BUDGET, 4, 3)
    assert hf_gemma4_config(tmp_path / "hf")[1].vision.max_soft_tokens == BUDGET


def test_plan_rows_hold_images_at_the_budget(aspect, capsys):
    """`mmpipe plan` of the imported model: each image slot takes the decoder positions of an image at the budget's
    largest, its brackets and 70 soft tokens (2 x 72 + 32 text), not the 2 brackets alone, and the tower its 630
    patches (not the 96-px square's 576)."""
    from mmpipe.planning.costmodel import layer_costs
    _, d, model, _ = aspect
    rows = layer_costs(model.cfg, (), text_len=32, images=2)
    assert [r.tokens for r in rows[:5]] == [2 * 630] * 4 + [176]
    capsys.readouterr()
    assert main(["plan", "--preset", str(d / "run" / "model.json"), "--gpus-per-node", "2", "--text-len", "32",
                 "--max-images", "2"]) == 0
    assert "decoder positions per row: 2 image slots x 72 + 32 text = 176" in capsys.readouterr().out


def test_a_sample_over_its_patch_share_is_a_bad_record_and_a_bad_budget_one_line(aspect, tmp_path):
    """--max-patches 900 with 2 images a sample: each may take 450 patches (the processor never shrinks an image to
    share the row), so the record whose 2:1 image makes 495 is refused, too_many_patches, counted and listed, the
    square alone kept; --max-patches 1000 (not a multiple of a soft token's 9 patches) is one line."""
    from mmpipe.config import ConfigError
    from mmpipe.data.args import DataArgs
    from mmpipe.data.dataset import prepare, resolve_data
    from test_qwen_data import conv
    _, d, model, _ = aspect
    records = [{"image": [str(d / "0.png"), str(d / "1.png")], "conversations": conv("<image> w20 <image> w21", "w30")},
               {"image": str(d / "2.png"), "conversations": conv("<image> w22", "w32 w33")}]
    (tmp_path / "data.jsonl").write_text("".join(json.dumps(r) + "\n" for r in records))
    flags = dict(data=str(tmp_path / "data.jsonl"), tokenizer=str(d / "hf"), text_len=40, data_workers=0,
                 max_images=2)
    samples = prepare(resolve_data(DataArgs(**flags, max_patches=900), model.cfg), model.cfg, tmp_path / "out",
                      seed=0, verbose=False)
    assert (samples.index.stats["good"], samples.index.stats["bad_by_kind"]) == (1, {"too_many_patches": 1})
    bad = json.loads((tmp_path / "out" / "data" / "bad_records.jsonl").read_text().splitlines()[0])
    assert "64x32 makes a 15x33 patch grid, 495 patches > the 450" in bad["reason"], bad
    with pytest.raises(ConfigError) as e:
        resolve_data(DataArgs(**flags, max_patches=1000), model.cfg)
    assert str(e.value) == "--max-patches: 1000 must be a positive multiple of pool^2 = 9 (a soft token's patches)"
