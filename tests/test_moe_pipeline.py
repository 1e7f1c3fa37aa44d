"""A Qwen3-VL-MoE model through the pipeline (issue 43, first slice; docs/moe.md): qwen3-vl-tiny's shape with every
decoder MLP 8 experts of width 32, top 2, untied head, the family's aux coefficient 0.001, trained with --pack on
tests/test_qwen3_vl_pipeline.py's LLaVA records of mixed image sizes (2 rows x 2 micro-batches a step, fp32).

Its layer list (19 layers) and the cut, 13, after decoder layer 1 (layers 10, 12 on stage 0; 14, 16 on stage 1):

     0 Qwen3PatchEmbed ... 8 Qwen3Merger  9 Qwen3Embed  10 moe decoder 0  11 DeepstackAdd0  12 moe decoder 1 |
    13 DeepstackAdd1  14 moe decoder 2  15 DeepstackAdd2  16 moe decoder 3  17 FinalNorm  18 MoeHead

so the float stage field moe_stats (the routers' per-row counts and probability sums of decoder layers 0 and 1)
crosses the cut beside hidden and DeepStack's sets 1 and 2, and the load-balancing loss's gradient flows back
through it to stage 0's routers. The tower is frozen (`--freeze vision`; DeepStack's mergers and the decoder train).
One PP=2 launch, checkpointed at step 2, and its resume from there:

- each step's loss, its LM part and its auxiliary part (train_log.csv's loss, lm_loss, aux_loss) equal the
  single-device loop's (1e-5), and so do the final weights, routers and experts included;
- only floats cross, moe_stats [2, 2, 8] among them, once per micro-batch each way;
- the resume from step 2 gives the uninterrupted run's losses and weights bit for bit;
- PP=2 x DP=2 x EP=2 (4 ranks, each stage's experts split over its 2 DP ranks) at GAS 1 equals the single-device
  loop of the same 4 rows a step, for the model with its head tied to the embedding (a Qwen3-VL-MoE saved with
  tie_word_embeddings, issue 53): the tied MoE head (moe.TiedMoeHead, DeepSpeed's partial on stage 1) gives the aux
  loss, and the embedding's two copies (stage 0, stage 1) train as one."""
from __future__ import annotations

import json
from collections import Counter

import numpy as np
import pytest
import torch
from PIL import Image

from conftest import assert_weights_moved, cut_at, train_run, write_ds_config
from fixtures_data import mixed_image_records
from mmpipe.config import load_preset
from mmpipe.model import moe
from mmpipe.model.builder import layer_specs
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference
from test_qwen3_vl_pipeline import ANSWER_WORDS, IMAGES, SIZES, TEXT, P
from test_qwen_data import save_tokenizer
from test_qwen_pipeline import assert_trained_as_reference, frozen_prefixes

TOL = 1e-5
STEPS, CUT, SEED, GAS = 5, 2, 5, 2  # step 1 runs at lr 0: 4 updates, the resume 3
L = 2 * IMAGES + P // 4 + TEXT  # 88 decoder positions a row
EXPERTS, TOP_K, EXPERT_FF = 8, 2, 32


def write_moe_set(root) -> list[str]:
    """The records, images, tokenizer and model JSONs (untied, and tied as qwen3-vl-moe-tied.json) under root; the
    arguments every run takes but --ds-config."""
    rng = np.random.default_rng(0)
    for k, (w, h) in enumerate(SIZES):
        Image.fromarray(rng.integers(0, 256, (h, w, 3), dtype=np.uint8)).save(root / f"{k}.png")
    records = mixed_image_records(36, len(SIZES), ANSWER_WORDS,
                                  lambda rnd, i: 1 + int(rnd.lognormvariate(0.8, 0.7)) % 10)
    (root / "data.json").write_text(json.dumps(records))
    save_tokenizer(root / "tok")
    model = load_preset("qwen3-vl-tiny").to_dict()
    model["text"].update(tie_embeddings=False, moe=dict(experts=EXPERTS, top_k=TOP_K, ff_dim=EXPERT_FF))
    (root / "qwen3-vl-moe-tiny.json").write_text(json.dumps(model))
    model["text"]["tie_embeddings"] = True
    (root / "qwen3-vl-moe-tied.json").write_text(json.dumps(model))
    return ["--preset", str(root / "qwen3-vl-moe-tiny.json"), "--data", str(root / "data.json"),
            "--tokenizer", str(root / "tok"), "--text-len", str(TEXT), "--pack", "--max-images", str(IMAGES),
            "--max-patches", str(P), "--eval-samples", "0", "--seed", str(SEED), "--data-workers", "0"]


@pytest.fixture(scope="module")
def moe_set(tmp_path_factory):
    root = tmp_path_factory.mktemp("moe_pipe")
    args = write_moe_set(root)
    ds = write_ds_config(root / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=GAS,
                         scheduler={"type": "WarmupCosineLR",
                                    "params": {"total_num_steps": 2 * STEPS, "warmup_num_steps": 1,
                                               "warmup_type": "linear", "warmup_min_ratio": 0.5}})
    return root, [*args, "--ds-config", str(ds)]


def _resolved(moe_set, *extra: str, out: str = "ref"):
    root, args = moe_set
    return resolve(TrainArgs.from_argv([*args, "--stages", "1", "--freeze", "vision", *extra,
                                        "--output-dir", str(root / out)]), world_size=1)


def recorded_reference(run, seed: int, steps: int, per_step: int, out_dir) -> tuple:
    """The single-device loop of an MoE run and what it records: (model, losses, each step's auxiliary term: the mean
    over its per_step micro-batches of what the head, MoeHead or TiedMoeHead, gave, as DeepSpeed averages the loss;
    each step's global gradient norm as the loop clips it). test_moe_ep and test_tp_moe compare their launches to it."""
    seen, norms, clip = [], [], torch.nn.utils.clip_grad_norm_

    def clipping(params, max_norm, *a, **k):
        norms.append(clip(params, max_norm, *a, **k).item())
        return norms[-1]
    with pytest.MonkeyPatch.context() as patch:
        for cls, name in ((moe.MoeHead, "forward"), (moe.TiedMoeHead, "__call__")):
            def recording(*args, _run=getattr(cls, name)):
                out = _run(*args)
                seen.append(out[1].item())
                return out
            patch.setattr(cls, name, recording)
        patch.setattr(torch.nn.utils, "clip_grad_norm_", clipping)
        model, losses = train_reference(run, seed=seed, steps=steps, out_dir=str(out_dir))
    return model, losses, [sum(seen[per_step * s:per_step * (s + 1)]) / per_step for s in range(steps)], norms


def _reference(moe_set, *extra: str, out: str = "ref"):
    """The single-device loop, and each step's auxiliary term (recorded_reference)."""
    return recorded_reference(_resolved(moe_set, *extra, out=out), SEED, STEPS, GAS, moe_set[0] / out)[:3]


@pytest.fixture(scope="module")
def reference(moe_set, monkeypatch_module):
    return _reference(moe_set)


@pytest.fixture(scope="module")
def monkeypatch_module():
    with pytest.MonkeyPatch.context() as mp:
        yield mp


def _launch(moe_set, name: str, *extra: str):
    root, args = moe_set
    return train_run(root / name, *args, "--stages", "2", "--steps", str(STEPS), "--partition", "13",
                     "--freeze", "vision", *extra).check()


@pytest.fixture(scope="module")
def pp2(moe_set):
    return _launch(moe_set, "pp2", "--save-every", str(CUT))


def test_the_cut_falls_between_two_pairs_of_moe_blocks(moe_set):
    kinds = [s.typename for s in layer_specs(_resolved(moe_set).model)]
    blocks = [i for i, k in enumerate(kinds) if k is moe.Qwen3MoeBlock]
    assert blocks == [10, 12, 14, 16] and kinds[-1] is moe.MoeHead


def test_pipeline_equals_single_device_loss_aux_and_weights(pp2, reference):
    ref_model, ref_losses, ref_aux = reference
    rows = pp2.rows
    assert [int(r["step"]) for r in rows] == list(range(1, STEPS + 1))
    assert [float(r["loss"]) for r in rows] == pytest.approx(ref_losses, abs=TOL)
    assert [float(r["aux_loss"]) for r in rows] == pytest.approx(ref_aux, abs=TOL)
    assert [float(r["lm_loss"]) for r in rows] == pytest.approx([a - b for a, b in zip(ref_losses, ref_aux)], abs=TOL)
    assert all(a > 1e-3 * 0.5 for a in ref_aux)  # coef 0.001 x aux (1 when balanced): present in every step
    assert_trained_as_reference(pp2, ref_model, SEED, TOL)  # and every trained tensor moved > 10 x TOL
    got = torch.nn.Sequential(*load_reference(pp2.out / "checkpoints", ref_model.cfg))
    init = type(ref_model)(ref_model.cfg, seed=SEED)
    for i in range(1 + ref_model.cfg.vision.n_layers + len(ref_model.cfg.vision.deepstack_indexes)):
        if getattr(init[i], "group", None) == "vision":  # --freeze vision: the tower as it started
            assert all(torch.equal(a, b) for a, b in zip(got[i].state_dict().values(), init[i].state_dict().values()))
    for i in (10, 12, 14, 16):  # every stage's routers and experts trained
        for name in ("mlp.gate.weight", "mlp.experts.gate_up_proj", "mlp.experts.down_proj"):
            assert not torch.equal(got[i].state_dict()[name], init[i].state_dict()[name]), (i, name)


def test_only_floats_cross_and_moe_stats_is_one_of_them(pp2):
    """Cut 13 (after decoder layer 1, before DeepStack's add 1): hidden 2x88x64, sets 1 and 2 (2x32x64 each) and
    moe_stats 2x2x8, forward from rank 0 and their gradients back from rank 1, once per micro-batch."""
    cut = [f"2x{L}x64", "2x32x64", "2x32x64", f"2x2x{EXPERTS}"]
    pp2.assert_only_floats_crossed(per_forward=len(cut))
    micro = GAS * STEPS
    for rank in (0, 1):
        sent = [shape for kind, _, shape in pp2.wire(rank) if kind == "data"]
        assert Counter(sent) == Counter(cut * micro), (rank, Counter(sent))


def test_resume_is_bit_exact(moe_set, pp2):
    cut_at(pp2, moe_set[0] / "cut", CUT)
    resumed = _launch(moe_set, "cut", "--resume")
    assert resumed.summary["start_step"] == CUT
    assert resumed.rows == [{**r, **{k: resumed.rows[i][k] for k in ("samples_per_s", "useful_tokens_per_s",
                                                                      "positions_per_s", "elapsed_s")}}
                            for i, r in enumerate(pp2.rows)]  # loss, lm_loss, aux_loss, lr: every step equal
    cfg = _resolved(moe_set).model
    got, want = (torch.nn.Sequential(*load_reference(r.out / "checkpoints", cfg)).state_dict()
                 for r in (resumed, pp2))
    assert got.keys() == want.keys() and all(torch.equal(got[k], want[k]) for k in want)
    cut = load_reference(resumed.out / "checkpoints", cfg, f"step{CUT}")  # the 3 resumed steps trained
    assert_weights_moved(got, cut, TOL, frozen_prefixes(cut, ["--freeze"]))


def test_tied_pp2_dp2_ep2_equals_single_device(moe_set, monkeypatch):
    """Four ranks: two pipelines of two stages, each stage's experts split over its two DP ranks (ranks 0 / 1 hold
    experts 0..3 / 4..7 of stage 0's blocks, ranks 2 / 3 those of stage 1's), the tower frozen, at GAS 1, so a step
    trains the same 4 rows as the reference's 2 micro-batches: losses, aux losses and weights equal (1e-5). The head
    is tied: the tied MoE head on stage 1 gives the aux loss, and the embedding trains as one tensor."""
    root, args = moe_set
    tied = ["--preset", str(root / "qwen3-vl-moe-tied.json")]
    ref_model, ref_losses, ref_aux = _reference((root, [*args, *tied]), out="ref_tied")
    assert isinstance(layer_specs(ref_model.cfg)[-1].forward_fn, moe.TiedMoeHead)
    gas1 = write_ds_config(root / "gas1.json", **{**json.loads((root / "ds.json").read_text()),
                                                   "gradient_accumulation_steps": 1})
    run = _launch(moe_set, "pp2dp2ep2", "--dp", "2", "--ep", "2", "--ds-config", str(gas1), *tied)
    for rank, experts in ((0, "0..3"), (1, "4..7"), (2, "0..3"), (3, "4..7")):
        assert f"mmpipe: rank {rank}: experts {experts} of 8 in each MoE block (--ep 2)" in run.proc.stdout
    assert [float(r["loss"]) for r in run.rows] == pytest.approx(ref_losses, abs=TOL)
    assert [float(r["aux_loss"]) for r in run.rows] == pytest.approx(ref_aux, abs=TOL)
    assert_trained_as_reference(run, ref_model, SEED, TOL)
