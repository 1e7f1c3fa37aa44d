"""The gemma4 family through the pipeline (issue 55), one launch: `mmpipe train` of gemma4-tiny with images of any
aspect ratio (vision.max_soft_tokens 70: at most 630 patches of 4 px an image, transformers' Gemma4ImageProcessor's
grids 15 x 33, 39 x 15, 24 x 24, 18 x 30 and 30 x 18 patches, 55 to 65 soft tokens, for the records' 48 x 24,
24 x 60, 24 x 24, 40 x 24 and 24 x 40 images) on LLaVA records of one image each, packed 2-3 samples a row (3 slots,
a patch budget of 3 x 630). PP=4 with three cuts (layers: 0 patch embed, 1-2 tower, 3 projector, 4 embed,
5 SlidingBlock, 6 SlidingStore, 7 GlobalStore, 8 SlidingShared, 9 GlobalShared, 10 norm, 11 head):
- 2, inside the tower (stage 0: the patch embedding and tower block 0);
- 6, where only the per-layer inputs cross beside hidden (stage 1: tower block 1, the projector, the embedding that
  makes them, decoder layer 0);
- 8, between the K/V producers (stage 2: layers 1 and 2, which make the sliding and the full K/V) and their consumers
  (stage 3: layers 3-4, which reuse them, the norm, the head): the per-layer inputs and both shared K/V cross.
Each rank's messages are counted by shape, floats only; each step's loss and the final weights equal the
single-device reference loop's (fp32, 1e-5) after 3 updates at nonzero lr, every trained tensor moved. It replaces
the PP=2 launch cut at 8 alone (whose K/V and per-layer checks are this one's last cut): 79 s against its 58 s, back
to back at load ~15 (about 14 -> 19 s alone)."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import Run, mmpipe_train
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.reference import train_reference
from test_gemma3 import _tokenizer
from test_qwen_pipeline import assert_trained_as_reference

TOL, STEPS, SEED, MICRO, TEXT_LEN = 1e-5, 4, 3, 2, 30
IMG, BUDGET = 60, 70
SIZES = [(48, 24), (24, 60), (24, 24), (40, 24), (24, 40)]  # (W, H), as patch grids (rows, cols):
GRIDS = {(15, 33), (39, 15), (24, 24), (18, 30), (30, 18)}
CUTS = "2,6,8"


def _records(d) -> str:
    """16 LLaVA records, an image each of SIZES in turn and a question / answer of 1-3 words."""
    g = torch.Generator().manual_seed(0)
    (d / "img").mkdir()
    lines = []
    for i in range(16):
        w, h = SIZES[i % len(SIZES)]
        Image.fromarray((torch.rand(h, w, 3, generator=g) * 255).byte().numpy()).save(d / "img" / f"{i}.png")
        q, a = (torch.randint(40, IMG, (1 + i % 3,), generator=g).tolist() for _ in range(2))  # no w1x: BOS w1
        lines.append(json.dumps({"image": f"img/{i}.png", "conversations": [
            {"from": "human", "value": "<image>\n" + " ".join(f"w{t}" for t in q)},
            {"from": "gpt", "value": " ".join(f"w{t}" for t in a)}]}) + "\n")
    (d / "data.jsonl").write_text("".join(lines))
    return str(d / "data.jsonl")


def _aspect_preset(d) -> str:
    """gemma4-tiny with vision.max_soft_tokens 70, a 210-entry position table (a side of up to 210 patches; 39 here) and
    a context of 512 (3 x (2 + 70) image positions and 30 text)."""
    from mmpipe.config import load_preset
    data = load_preset("gemma4-tiny").to_dict()
    data["vision"] |= {"max_soft_tokens": BUDGET, "position_table": 210}
    data["text"]["max_context"] = 512
    (d / "gemma4-aspect.json").write_text(json.dumps(data))
    return str(d / "gemma4-aspect.json")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The one launch (PP=4 at CUTS) and its single-device reference, on the same packed rows."""
    from conftest import write_ds_config
    d = tmp_path_factory.mktemp("gemma4_train")
    _tokenizer(d / "tok")
    ds = write_ds_config(d / "ds.json", train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=2,
                         scheduler={"type": "WarmupCosineLR",
                                    "params": {"total_num_steps": 2 * STEPS, "warmup_num_steps": 1,
                                               "warmup_type": "linear", "warmup_min_ratio": 0.5}})
    args = ["--preset", _aspect_preset(d), "--data", _records(d), "--tokenizer", str(d / "tok"), "--ds-config",
            str(ds), "--text-len", str(TEXT_LEN), "--pack", "--max-images", "3", "--steps", str(STEPS),
            "--eval-samples", "0", "--seed", str(SEED), "--data-workers", "0"]
    rc = resolve(TrainArgs.from_argv(args + ["--stages", "1", "--output-dir", str(d / "ref")]), world_size=1)
    reference = train_reference(rc, seed=SEED, steps=STEPS, out_dir=str(d / "ref"))
    pp4 = Run(d / "pp4", mmpipe_train(["--output-dir", str(d / "pp4"), *args, "--stages", "4", "--partition", CUTS],
                                      MMPIPE_WIRE_LOG=str(d / "pp4"))).check()
    return rc, reference, pp4


def test_pp4_cuts_in_the_tower_across_per_layer_inputs_and_kv_equal_single_device(trained):
    rc, (ref_model, ref_losses), pp4 = trained
    assert rc.model.vision.max_soft_tokens == BUDGET
    with np.load(pp4.out / "data" / "index.npz") as z:  # the run's images, each at its own aspect ratio
        assert {tuple(g[1:]) for g in z["grids"].tolist()} == GRIDS
    assert sorted(pp4.losses) == list(range(1, STEPS + 1)) and abs(ref_losses[-1] - ref_losses[0]) > 1e-3
    assert list(pp4.losses.values()) == pytest.approx(ref_losses, abs=TOL)
    # layer_scalar is a buffer (transformers' nn.Buffer, read from the checkpoint, never trained): left out
    assert_trained_as_reference(pp4, ref_model, SEED, TOL, no_gradient=("layer_scalar",))
    assert pp4.summary["parts"] == [0, 2, 6, 8, 12]
    f = pp4.summary["gradient_accumulation"] * STEPS  # forward micro-batches each rank ran
    pp4.assert_only_floats_crossed(per_forward=1)  # every rank sent floats only; rank 0 one a micro-batch
    sent = {r: Counter(shape for kind, _, shape in pp4.wire(r) if kind == "data") for r in range(4)}
    L = int(next(iter(sent[3])).split("x")[1])  # the row's decoder positions: 3 x (2 + 70) + 30 = 246
    tower, hidden, per_layer = f"{MICRO}x{3 * 9 * BUDGET}x16", f"{MICRO}x{L}x32", f"{MICRO}x{L}x40"
    # rank 0 -> 1, inside the tower: its hidden over the row's 3 x 630 patches, 16 wide
    assert sent[0] == {tower: f}, sent[0]
    # rank 1: forward hidden 32 a position and the per-layer inputs (5 layers x 8 = 40); backward the tower's gradient
    assert sent[1] == {hidden: f, per_layer: f, tower: f}, sent[1]
    # rank 2: forward hidden, the sliding and the full K/V (32 a position each: 2 x 2 heads of 8, 2 x 1 head of 16,
    # [B, L, 2 x H_kv x Dh]) and the per-layer inputs; backward the gradients of hidden and of the per-layer inputs
    assert sent[2] == {hidden: 3 * f + f, per_layer: f + f}, sent[2]
    # rank 3 (the last stage): backward only, the gradients of hidden, both K/V and the per-layer inputs
    assert sent[3] == {hidden: 3 * f, per_layer: f}, sent[3]
    assert L == 3 * (2 + BUDGET) + TEXT_LEN
