"""Rows: sequence packing and several images per sample (docs/packing.md).

Packed rows give the unpacked padded batch's loss and every gradient (moondream and LLaVA
families); a sample's logits do not depend on its row-mates; a 2-image LLaVA conversation gives
transformers' logits; packed pipelines (PP=1, PP=2) equal the single-device reference, also with
2-image records; a packed run stopped and resumed trains on the same rows; --loss-norm sample is
the mean of per-sample means. The cross-attention family packs too: packed == unpacked, PP=2 ==
reference."""
from __future__ import annotations

import csv
import dataclasses
import json
import random

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import ROOT, Run, cut_at, train_run, write_ds_config
from hf_models import IMAGE_TOKEN, n_features, save_hf
from mmpipe.config import config_from_dict, load_preset
from mmpipe.data.batches import collate
from mmpipe.data.crops import blank_image, make_transform
from mmpipe.data.image_kinds import image_kind
from mmpipe.data.packing import LossNorm, RowPlan, RowSet, answer_counts, row_shape, sample_rowset, sample_size
from mmpipe.data.text import Encoded
from mmpipe.hf.llava import import_llava
from mmpipe.model import ReferenceModel
from mmpipe.model.builder import IGNORE_INDEX, lm_loss
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference
from rank_series import launch_series
from test_multicrop import CROPS_TINY

TOL = 1e-5
WORDS = "red green blue yellow cyan magenta circle square triangle left right top bottom".split()


def _model_cfg(preset: str):
    cfg = load_preset(preset)
    return dataclasses.replace(cfg, image_token_id=cfg.text.vocab_size - 1) if image_kind(cfg).markers else cfg


class LongTail:
    """n samples of long-tailed length: BOS, a question, an answer of 1..~24 tokens (lognormal), with
    one image each, or none for every `text_only`-th sample."""
    pad_id = 0

    def __init__(self, cfg, n: int = 12, seed: int = 0, text_only: int = 0):
        rng = np.random.default_rng(seed)
        self.size, self.vocab = cfg.vision.image_size, cfg.text.vocab_size - 2
        self.items = []
        for i in range(n):
            q, a = rng.integers(2, 8), int(min(24, 1 + rng.lognormal(1.0, 0.9)))
            ids = np.concatenate([[1], rng.integers(3, self.vocab, q + a)]).astype(np.int64)
            target = np.array([False] * (1 + q) + [True] * a)
            self.items.append((ids, target, 0 if text_only and i % text_only == text_only - 1 else 1))

    def tokens(self, pos: int):
        ids, target, n = self.items[pos % len(self.items)]
        return Encoded(ids, target, image_at=np.array([1] * n, dtype=np.int64)), n

    def pixels(self, pos: int, k: int = 0):
        return torch.randn(3, self.size, self.size, generator=torch.Generator().manual_seed(pos * 7 + k))


class LongTailCrops(LongTail):
    """LongTail with moondream multi-crop images: random images of varied sizes, cut into crops."""

    def __init__(self, cfg, **kw):
        super().__init__(cfg, **kw)
        self.transform = make_transform(cfg.vision)

    def pixels(self, pos: int, k: int = 0):
        w, h = [(28, 28), (40, 60), (60, 40), (50, 90)][pos % 4]
        rgb = np.random.default_rng(pos).integers(0, 256, (h, w, 3), dtype=np.uint8)
        return self.transform(Image.fromarray(rgb))


def _packed(samples, cfg, n: int, text_len: int, max_images: int = 4, mode: str = "token", max_crops: int = 0):
    """All n samples packed: (batch, rows). One step of every row, GAS = DP = 1."""
    shape = row_shape(cfg, max_images, text_len)
    plan = RowPlan(sample_size(samples, shape), shape, pack=True, chunk=n)
    rows = next(r for r in range(1, n + 1) if sum(len(plan.row(i)) for i in range(r)) == n)
    norm = LossNorm(mode, rows, 1, 1, answer_counts(samples, plan))
    data = RowSet(samples, plan, blank=blank_image(cfg.vision.image_size, max_crops), norm=norm)
    return collate([data[r] for r in range(rows)]), [plan.row(r) for r in range(rows)]


def _grads(model, loss) -> dict[str, torch.Tensor]:
    model.zero_grad()
    loss.backward()
    return {k: p.grad.clone() for k, p in model.named_parameters()}


def test_row_plan_holds_every_sample_once_within_the_row():
    """First-fit over chunks: every stream position in exactly one row, in stream order inside a row,
    no row over its positions or image slots, and the same rows from a fresh plan (what every rank
    and a resumed run compute)."""
    rng = np.random.default_rng(0)
    sizes = [(int(16 * k + rng.integers(3, 60)), int(k)) for k in rng.integers(0, 3, 500)]  # 0..2 images
    shape = row_shape(_model_cfg("llava-tiny"), 3, 64)  # 3 x 16 + 64 = 112 positions
    plan = RowPlan(lambda p: sizes[p % 500], shape, pack=True, chunk=100)
    rows, covered = [], 0
    while covered < 500:  # chunks 0..4 hold positions 0..499
        rows.append(plan.row(len(rows)))
        covered += len(rows[-1])
    assert sorted(sum(rows, [])) == list(range(500))
    assert all(sum(sizes[p][0] for p in row) <= 112 and sum(sizes[p][1] for p in row) <= 3 for row in rows)
    assert all(row == sorted(row) for row in rows) and len(rows) < 500 / 2
    fresh = RowPlan(lambda p: sizes[p % 500], shape, pack=True, chunk=100)
    assert [fresh.row(r) for r in reversed(range(len(rows)))][::-1] == rows
    assert RowPlan(lambda p: sizes[p], shape, pack=False).row(7) == [7]


def _open_gates(model) -> None:
    """The cross-attention family's gates, 0 at initialisation (the image would not count), opened."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("_gate"):
                p.fill_(0.7)


@pytest.mark.parametrize("preset,text_only", [("tiny", 4), ("llava-tiny", 4), ("crops", 0), ("tiny-xattn", 4)])
def test_packed_rows_equal_the_unpacked_batch(preset, text_only):
    """Per answer token over the batch: packed rows' loss and every weight's gradient equal one sample
    per row's, fp32, 1e-5; text-only samples among them ("crops": moondream multi-crop, each image's
    1 + 4 crop slots and tiling in its image slot; "tiny-xattn": each sample's text cross-attends to
    its own images only)."""
    cfg = config_from_dict(CROPS_TINY, "crops-tiny") if preset == "crops" else _model_cfg(preset)
    samples, n, text_len = (LongTailCrops if preset == "crops" else LongTail)(cfg, text_only=text_only), 12, 40
    model = ReferenceModel(cfg, seed=5)
    _open_gates(model)
    b = collate([sample_rowset(samples, cfg, text_len)[i] for i in range(n)])
    logits = model(b["pixels"], b["input_ids"], b["has_image"], b["segments"], b.get("tiling"))
    ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), b["labels"].flatten(), ignore_index=IGNORE_INDEX,
                                           reduction="sum")
    loss_u = ce / (b["labels"] != IGNORE_INDEX).sum()
    g_u = _grads(model, loss_u)

    p, rows = _packed(samples, cfg, n, text_len, max_crops=cfg.vision.crop_slots - 1)
    assert len(rows) < n / 2 and sorted(sum(rows, [])) == list(range(n))  # several samples share each row
    assert (p["segments"].amax(dim=1) >= 2).all()
    logits = model(p["pixels"], p["input_ids"], p["has_image"], p["segments"], p.get("tiling"))
    loss_p = lm_loss(logits, (p["labels"], p["weights"]))
    g_p = _grads(model, loss_p)
    assert loss_p.item() == pytest.approx(loss_u.item(), abs=TOL)
    for k in g_u:
        assert (g_u[k] - g_p[k]).abs().max().item() < TOL, k


@pytest.mark.parametrize("preset", ["tiny", "llava-tiny", "tiny-xattn"])
def test_a_sample_does_not_see_its_row_mates(preset):
    """The first sample's logits are the same whoever shares its row (and equal its logits alone)."""
    cfg = _model_cfg(preset)
    model = ReferenceModel(cfg, seed=2).eval()
    _open_gates(model)
    a, b = LongTail(cfg, n=4, seed=1), LongTail(cfg, n=4, seed=9)
    b.items[0] = a.items[0]  # same first sample, different row-mates (and their images)
    outs = []
    for samples in (a, b):
        p, rows = _packed(samples, cfg, 4, 60)
        assert rows[0][:2] == [0, 1]
        with torch.no_grad():
            logits = model(p["pixels"], p["input_ids"], p["has_image"], p["segments"])[0]
        mine = p["segments"][0] == 1
        outs.append((logits[mine], logits[~mine & (p["segments"][0] > 0)]))
    assert (outs[0][0] - outs[1][0]).abs().max().item() < 1e-6
    assert outs[0][1].shape != outs[1][1].shape or (outs[0][1] - outs[1][1]).abs().max().item() > 1e-3


def test_sample_normalisation_is_the_mean_of_per_sample_means():
    cfg = _model_cfg("tiny")
    samples = LongTail(cfg)
    model = ReferenceModel(cfg, seed=5)
    p, rows = _packed(samples, cfg, 12, 40, mode="sample")
    with torch.no_grad():
        logits = model(p["pixels"], p["input_ids"], p["has_image"], p["segments"])
        loss = lm_loss(logits, (p["labels"], p["weights"])).item()
        ce = torch.nn.functional.cross_entropy(logits.flatten(0, 1), p["labels"].flatten(),
                                               ignore_index=IGNORE_INDEX, reduction="none").view_as(p["labels"])
    labelled = p["labels"] != IGNORE_INDEX
    means = [ce[r][labelled[r] & (p["segments"][r] == s)].mean().item()
             for r in range(len(rows)) for s in range(1, len(rows[r]) + 1)]
    assert len(means) == 12 and len({round(m, 4) for m in means}) > 1
    assert loss == pytest.approx(sum(means) / len(means), abs=TOL)
    token_mean = (ce[labelled].sum() / labelled.sum()).item()
    assert abs(loss - token_mean) > 1e-3  # the two normalisations differ on unequal answers


@pytest.mark.parametrize("kind", ["siglip_llama", "clip_qwen2"])
def test_two_image_conversation_gives_transformers_logits(kind, tmp_path):
    """Two <image> blocks in one conversation, each image at its own placeholders; then the same
    conversation packed beside another one: its logits do not move."""
    hf = save_hf(kind, tmp_path)
    model, _ = import_llava(tmp_path)
    n = n_features(kind)
    g = torch.Generator().manual_seed(3)
    text = torch.randint(3, IMAGE_TOKEN, (8,), generator=g)
    ids = torch.cat([torch.ones(1), text[:2], torch.full((n,), IMAGE_TOKEN), text[2:5], torch.full((n,), IMAGE_TOKEN),
                     text[5:]]).long()[None]  # [1, 1 + 2 + 16 + 3 + 16 + 3]
    px = torch.randn(2, 3, 32, 32, generator=g)
    with torch.no_grad():
        ref = hf(input_ids=ids, pixel_values=px).logits
        got = model(px[None], ids, torch.ones(1, 2, dtype=torch.long), torch.ones_like(ids))
        assert (got - ref).abs().max().item() < 1e-4
        other = torch.cat([torch.ones(1), text[:4], torch.full((n,), IMAGE_TOKEN), text[4:]]).long()[None]
        row = torch.cat([other, ids, torch.zeros(1, 5, dtype=torch.long)], dim=1)
        seg = torch.cat([torch.full_like(other, 1), torch.full_like(ids, 2), torch.zeros(1, 5, dtype=torch.long)], 1)
        pixels = torch.cat([torch.randn(1, 3, 32, 32, generator=g), px, torch.zeros(1, 3, 32, 32)])[None]  # M = 4
        packed = model(pixels, row, torch.tensor([[1, 1, 1, 0]]), seg)
    mine = packed[0, other.shape[1]:other.shape[1] + ids.shape[1]]
    assert (mine - ref[0]).abs().max().item() < 1e-4


# ---- through the pipeline ------------------------------------------------------------------------

def _longtail_llava(root, n: int = 48, two_images_every: int = 0):
    """A LLaVA-format JSON in the built-in tokenizer's words: answers of lognormal length (1..20
    words), small PNG images; every `two_images_every`-th record has two images and two markers."""
    rnd = random.Random(0)
    (root / "img").mkdir(parents=True)
    for i in range(8):
        Image.new("RGB", (40, 40), tuple(rnd.randrange(256) for _ in range(3))).save(root / "img" / f"{i}.png")
    recs = []
    for i in range(n):
        answer = " ".join(rnd.choice(WORDS) for _ in range(min(20, 1 + int(rnd.lognormvariate(1.0, 0.8)))))
        two = two_images_every and i % two_images_every == 0
        q = "<image>\nwhat shape is red" + (" <image> and blue" if two else "")
        recs.append({"image": [f"img/{i % 8}.png", f"img/{(i + 3) % 8}.png"] if two else f"img/{i % 8}.png",
                     "conversations": [{"from": "human", "value": q}, {"from": "gpt", "value": answer}]})
    (root / "data.json").write_text(json.dumps(recs))
    return root / "data.json"


@pytest.fixture(scope="module")
def pack_data(tmp_path_factory):
    root = tmp_path_factory.mktemp("packdata")
    return root, _longtail_llava(root, two_images_every=5)


def _preset(root, name: str) -> str:
    """The preset with room for a packed row of 4 image slots + 40 text positions (max_context 64 -> 4 x 16 + 40 = 104:
    --pack's row fits the context, mmpipe.data.dataset.context_slots; the context is no weight, rotary positions
    restart at every sample)."""
    cfg = json.loads((ROOT / "mmpipe" / "presets" / f"{name}.json").read_text())
    cfg["text"]["max_context"] = 104
    (root / f"{name}.json").write_text(json.dumps(cfg))
    return str(root / f"{name}.json")


def _args(root, data, preset: str, *extra: str) -> list[str]:
    cfg = write_ds_config(root / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                          scheduler=None)  # the optimizer's own LR from step 1: weights move
    return ["--preset", _preset(root, preset), "--ds-config", str(cfg), "--data", str(data), "--text-len", "40",
            "--pack", "--eval-samples", "0", "--seed", "4", "--steps", "3", "--data-workers", "0", *extra]


def _llava_args(root, data, *extra: str) -> list[str]:
    """The LLaVA PP=2 run with the 2-image records (--max-images 3), logging the samples it trains on."""
    return _args(root, data, "llava-tiny", "--max-images", "3", "--log-samples", "--stages", "2", *extra)


@pytest.fixture(scope="module")
def two_rank_runs(pack_data, tmp_path_factory) -> dict[str, Run]:
    """Every 2-rank run of this file but the resume, one launch (tests/rank_series.py: one run after the other in the
    same two ranks, each as `mmpipe train` runs it, its own port, output and exit status): the packed PP=2 runs of
    tiny, llava-tiny and tiny-xattn (the reference test's three cases; llava-tiny's is also the resume test's
    uninterrupted run, checkpointed after every step and logging its samples: the resume test resumes a copy of it cut
    after step 1) and the llava-tiny PP=1 x DP=2 run (the DP test's). Four launches before, ~15 s of start-up each."""
    data, runs = pack_data[1], []
    for preset, images in PP2_CASES:
        root = tmp_path_factory.mktemp(f"pp2_{preset}")
        if preset == "llava-tiny":
            argv = [*_llava_args(root, data), "--save-every", "1"]
        else:
            argv = [*_args(root, data, preset, *(["--max-images", images] if images else [])), "--stages", "2"]
        runs.append((root / "pp2", argv, {}))
    root = tmp_path_factory.mktemp("dp2")
    runs.append((root / "dp2", [*_args(root, data, "llava-tiny", "--max-images", "3", "--stages", "1"), "--dp", "2"],
                 {}))
    return dict(zip([*(preset for preset, _ in PP2_CASES), "dp2"], launch_series(runs)))


@pytest.fixture(scope="module")
def llava_pp2(two_rank_runs) -> Run:
    """The packed LLaVA PP=2 run: the reference test's LLaVA case and the resume test's uninterrupted run."""
    return two_rank_runs["llava-tiny"].check()


PP2_CASES = [("tiny", None), ("llava-tiny", "3"), ("tiny-xattn", "4")]


@pytest.mark.parametrize("preset,images", PP2_CASES)
def test_packed_pipeline_equals_reference(preset, images, pack_data, two_rank_runs, tmp_path):
    """A PP=2 packed run == the single-device reference (losses, weights; 1e-5): the rows cross a stage
    boundary (PP=1 == the reference is tests/test_pipeline_equivalence.py's, on one-sample rows). The LLaVA
    run also carries the 2-image records (--max-images 3); the moondream run is --pack alone: its family
    takes one image per sample (the 2-image records are bad), and a row's image slots follow from the
    data: 40 text positions / ~10 per sample -> 4 slots, several samples a row. The cross-attention run
    packs too (--max-images 4: its rows' slots), each sample's text attending to its own image only."""
    root, data = pack_data
    args = _args(tmp_path, data, preset, *(["--max-images", images] if images else []))
    run = resolve(TrainArgs.from_argv(args + ["--stages", "1", "--output-dir", str(tmp_path / "ref")]), world_size=1)
    assert run.max_images == int(images or 4)
    model, ref = train_reference(run, seed=4, steps=3, out_dir=str(tmp_path / "ref"))
    r = two_rank_runs[preset].check()  # these flags, --stages 2 (llava-tiny's: its samples logged, saved every step)
    assert list(r.losses.values()) == pytest.approx(ref, abs=TOL)
    got = torch.nn.Sequential(*load_reference(r.out / "checkpoints", run.model))
    for (k, a), b in zip(model.state_dict().items(), got.state_dict().values()):
        assert _weight_diff(k, a, b) < TOL, k
    r.assert_only_floats_crossed()  # PP=2: input_ids, has_image [B, M] and segments come from each stage's loader
    s = r.summary["data"]
    assert s["samples_seen"] > 2 * s["rows_seen"] == 2 * 3 * 2 * 2  # 3 steps x 4 rows, > 2 samples per row
    assert s["bad_by_kind"] == ({} if preset == "llava-tiny" else {"too_many_images": 10})


def _weight_diff(name: str, a: torch.Tensor, b: torch.Tensor) -> float:
    """The key third of a fused qkv bias is left out: its gradient is rounding noise (softmax cancels
    it), which Adam normalises to full-size steps (tests/test_pipeline_equivalence.py)."""
    d = (a - b).abs()
    if name.endswith("attn.qkv.bias"):
        d = torch.cat([d[: len(d) // 3], d[2 * len(d) // 3:]])
    return d.max().item()


def test_packed_dp2_equals_one_replica_accumulating_twice(pack_data, two_rank_runs, tmp_path):
    """The loss weights carry GAS x DP: two replicas at GAS 2 train on the same rows per step as one
    at GAS 4 (rows are sharded like samples), so the losses and weights agree."""
    root, data = pack_data
    args = _args(tmp_path, data, "llava-tiny", "--max-images", "3", "--stages", "1")
    cfg4 = write_ds_config(tmp_path / "gas4.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=4,
                           scheduler=None)
    run = resolve(TrainArgs.from_argv(args + ["--ds-config", str(cfg4)]), world_size=1)
    model, ref = train_reference(run, seed=4, steps=3, out_dir=str(tmp_path / "ref"))
    dp2 = two_rank_runs["dp2"].check()  # these flags, --dp 2
    assert dp2.summary["dp"] == 2
    assert list(dp2.losses.values()) == pytest.approx(ref, abs=TOL)
    got = torch.nn.Sequential(*load_reference(dp2.out / "checkpoints", run.model))
    for (k, a), b in zip(model.state_dict().items(), got.state_dict().values()):
        assert _weight_diff(k, a, b) < TOL, k


def test_packed_resume_trains_on_the_same_rows(pack_data, llava_pp2, tmp_path):
    """The LLaVA PP=2 run stopped after step 1 and resumed to 3: the same losses, the same rows. (The stopped run is
    a copy of the uninterrupted one cut after its step-1 checkpoint, its logs cut there too: no scheduler, so a run
    of --steps 1 would have saved the same checkpoint; the resumed run drops the copy's later sample rows itself.)"""
    root, data = pack_data
    args = _llava_args(tmp_path, data)
    resumed = train_run(cut_at(llava_pp2, tmp_path / "cut", 1), *args, "--resume").check()
    assert resumed.summary["start_step"] == 1
    assert resumed.losses == pytest.approx(llava_pp2.losses, abs=TOL)

    def seen(run):
        with open(run.out / "samples_dp0.csv") as f:
            return [(r["position"], r["sample"], r["row"]) for r in csv.DictReader(f)]
    assert seen(resumed) == seen(llava_pp2)
    assert len(seen(llava_pp2)) > 3 * 4  # more samples than rows (3 steps x 4 rows)
