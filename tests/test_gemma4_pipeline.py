"""The gemma4 family through the pipeline (issue 55), one launch: `mmpipe train --preset gemma4-tiny --pack` on LLaVA
records of one 24 px image each, packed 2-3 samples a row. PP=2 cut between the K/V producers and their consumers
(stage 0: the tower, the projector, the embedding and decoder layers 0-2, whose layers 1 and 2 make the sliding and
the full K/V; stage 1: decoder layers 3-4, which reuse them, the norm, the head): the per-layer inputs and both
shared K/V cross the cut beside hidden, floats only, and each step's loss and the final weights equal the
single-device reference loop's (fp32, 1e-5) after 3 updates at nonzero lr, every trained tensor moved."""
from __future__ import annotations

import json
from collections import Counter

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
IMG = 60
# layers: 0 patch embed, 1-2 tower, 3 projector, 4 embed, 5 SlidingBlock, 6 SlidingStore, 7 GlobalStore,
# 8 SlidingShared, 9 GlobalShared, 10 norm, 11 head
CUT = "8"


def _records(d) -> str:
    """16 LLaVA records, a 24 px image each and a question / answer of 1-3 words."""
    g = torch.Generator().manual_seed(0)
    (d / "img").mkdir()
    lines = []
    for i in range(16):
        Image.fromarray((torch.rand(24, 24, 3, generator=g) * 255).byte().numpy()).save(d / "img" / f"{i}.png")
        q, a = (torch.randint(40, IMG, (1 + i % 3,), generator=g).tolist() for _ in range(2))  # no w1x: BOS w1
        lines.append(json.dumps({"image": f"img/{i}.png", "conversations": [
            {"from": "human", "value": "<image>\n" + " ".join(f"w{t}" for t in q)},
            {"from": "gpt", "value": " ".join(f"w{t}" for t in a)}]}) + "\n")
    (d / "data.jsonl").write_text("".join(lines))
    return str(d / "data.jsonl")


@pytest.fixture(scope="module")
def trained(tmp_path_factory):
    """The one launch (PP=2 at CUT) and its single-device reference, on the same packed rows."""
    from conftest import write_ds_config
    d = tmp_path_factory.mktemp("gemma4_train")
    _tokenizer(d / "tok")
    ds = write_ds_config(d / "ds.json", train_micro_batch_size_per_gpu=MICRO, gradient_accumulation_steps=2,
                         scheduler={"type": "WarmupCosineLR",
                                    "params": {"total_num_steps": 2 * STEPS, "warmup_num_steps": 1,
                                               "warmup_type": "linear", "warmup_min_ratio": 0.5}})
    args = ["--preset", "gemma4-tiny", "--data", _records(d), "--tokenizer", str(d / "tok"), "--ds-config", str(ds),
            "--text-len", str(TEXT_LEN), "--pack", "--max-images", "3", "--steps", str(STEPS), "--eval-samples", "0",
            "--seed", str(SEED), "--data-workers", "0"]
    rc = resolve(TrainArgs.from_argv(args + ["--stages", "1", "--output-dir", str(d / "ref")]), world_size=1)
    reference = train_reference(rc, seed=SEED, steps=STEPS, out_dir=str(d / "ref"))
    pp2 = Run(d / "pp2", mmpipe_train(["--output-dir", str(d / "pp2"), *args, "--stages", "2", "--partition", CUT],
                                      MMPIPE_WIRE_LOG=str(d / "pp2"))).check()
    return reference, pp2


def test_pp2_cut_between_kv_producer_and_consumer_equals_single_device(trained):
    (ref_model, ref_losses), pp2 = trained
    assert sorted(pp2.losses) == list(range(1, STEPS + 1)) and abs(ref_losses[-1] - ref_losses[0]) > 1e-3
    assert list(pp2.losses.values()) == pytest.approx(ref_losses, abs=TOL)
    # layer_scalar is a buffer (transformers' nn.Buffer, read from the checkpoint, never trained): left out
    assert_trained_as_reference(pp2, ref_model, SEED, TOL, no_gradient=("layer_scalar",))
    assert pp2.summary["parts"] == [0, 8, 12]
    # four floats a micro-batch: hidden and each K/V 32 a position (the sliding K/V 2 x 2 heads of 8, the full one
    # 2 x 1 head of 16: [B, L, 2 x H_kv x Dh]), per_layer 5 layers x 8 = 40
    pp2.assert_only_floats_crossed(per_forward=4)
    sent = Counter(shape for kind, _, shape in pp2.wire(0) if kind == "data")
    L = int(next(iter(sent)).split("x")[1])  # the row's positions
    micro = pp2.summary["gradient_accumulation"] * STEPS
    assert sent == {f"{MICRO}x{L}x32": 3 * micro, f"{MICRO}x{L}x40": micro}, sent
