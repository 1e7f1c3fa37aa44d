"""--tp for the families of patches (issue 54; plans in mmpipe.model.tp_plans, docs/tensor_parallel.md): one run
per family, all three in one launch (tests/rank_series.py), PP=2 x TP=2 (4 CPU ranks on gloo), `--pack`ed rows of
mixed image grids, text-only and multi-image
conversations (test_qwen_pipeline.PackedSet's set), 3 steps at a constant lr (every step updates), equal to the
single-device reference loop: each step's loss and the final weights gathered from the TP shards (fp32, 1e-5; a
rotary key bias 1e-4, test_qwen_pipeline's rule), and every trained tensor moved > 10 x 1e-5 from its init.

- qwen-tiny (Qwen2.5-VL): the tower split by heads with its window attention (block 0 windowed, block 1 full), its
  fused qkv by head groups, the SwiGLU tower MLP with biases; GQA decoder (4 heads / 2 kv), qkv biases, tied head.
- qwen3-vl-tiny, --freeze vision, cut 5 inside the frozen tower after two trained DeepStack mergers: the tower's
  hidden and DeepStack sets 0 and 1 (split mergers, whole outputs) cross the cut on each TP rank; the frozen tower
  stays its init bit for bit.
- qwen3.5-tiny: Gated DeltaNet split by key / value heads (3 linear layers), a gated full-attention layer (q with its
  output gate, q / k norms whose gradients are summed over TP)."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_weights_moved, write_ds_config
from mmpipe.model import ReferenceModel
from mmpipe.runtime.checkpoint import load_reference
from rank_series import launch_series
from test_qwen3_vl_pipeline import SIZES as QWEN3_SIZES
from test_qwen_pipeline import SIZES as QWEN2_SIZES
from test_qwen_pipeline import PackedSet, _weights_equal_within, frozen_prefixes

TOL = 1e-5
STEPS, SEED = 3, 5
# preset: (image sizes, flags, PP=2's cut or None: the planner's); qwen3-vl-tiny's cut 5 lies inside its tower after
# DeepStack mergers 0 and 1 (test_qwen3_vl_pipeline's layer list)
FAMILIES = {"qwen-tiny": (QWEN2_SIZES, (), None),
            "qwen3-vl-tiny": (QWEN3_SIZES, ("--freeze", "vision"), 5),
            "qwen3.5-tiny": (QWEN3_SIZES, (), None)}


# AdamW at eps 5e-3. TP sums each matmul's products in another order (the split matmuls, the all-reduces): the
# gradients differ from the whole model's by float rounding (test_tensor_parallel's in-process check: 2e-6 of a
# tensor's largest gradient, 4e-5 through Gated DeltaNet's fp32 chunked solves; in float64 3e-14 on two packed rows:
# the split is exact). Adam divides each element by its own size, so an element's update carries its gradient's
# rounding relative to that element, ~1% for some of qwen3.5-tiny's: measured after 3 steps, its embedding and first
# in_proj_qkv off by 5.3e-5 at eps 1e-8 (lr 5e-4; the patch embedding 6.1e-4, step 3's loss 4.0e-5), 3.6e-5 at eps
# 1e-3, 1.1e-4 at eps 1e-2 and lr 4e-3; 3.0e-6 at eps 5e-3 and lr 1e-3 (and 6.7e-7 at eps 1e-2, where 23 tensors
# moved < 10 x TOL). An element below eps moves by lr x g / eps, its rounding relative to eps only.
ADAM = {"type": "AdamW", "params": {"lr": 1e-3, "betas": [0.9, 0.95], "eps": 5e-3, "weight_decay": 0.0,
                                    "torch_adam": True}}
# At that eps the tensors whose gradients are small move less than 10 x TOL in 3 steps (measured: qwen3.5-tiny's
# Gated DeltaNet decay dt_bias 1.9e-5 / 5.3e-5, A_log 4.0e-5, in_proj_a 7.6e-5, its full-attention layer's q / k
# norms 3.8e-5, q_proj 8.5e-5, k_proj 9.5e-5, the norm before its MLP 9.7e-5; qwen3-vl-tiny's last DeepStack merger's
# norm 6.8e-5 / 7.8e-5): each must move > TOL and > 100 x its difference from the reference (qwen3.5-tiny's: >= 300 x,
# A_log equal), so their equality is not one of unmoved weights.
SLOW = {"qwen3-vl-tiny": ("7.norm.weight", "7.norm.bias"),
        "qwen3.5-tiny": ("linear_attn.dt_bias", "linear_attn.A_log", "linear_attn.in_proj_a.weight",
                         "self_attn.q_norm.weight", "self_attn.k_norm.weight", "8.self_attn.q_proj.weight",
                         "8.self_attn.k_proj.weight", "7.post_attention_layernorm.weight")}


@pytest.fixture(scope="module")
def launched(tmp_path_factory) -> dict:
    """Each family's PackedSet and its PP=2 x TP=2 run (the flags PackedSet.launch("tp", 2, "--tp", "2", *flags)
    gives), all three in one launch of 4 ranks (tests/rank_series.py: one run after the other in the same ranks, each
    as `mmpipe train` runs it, its own port, output and exit status; three launches before, ~20 s of start-up each):
    2 rows x 2 micro-batches a step, AdamW (ADAM) at a constant lr 1e-3 (no warm-up: 3 updates in 3 steps)."""
    sets, runs = {}, []
    for preset, (sizes, flags, cut) in FAMILIES.items():
        data = PackedSet(tmp_path_factory.mktemp(preset), preset, sizes, 36, STEPS, SEED, {2: [cut]} if cut else None)
        write_ds_config(data.root / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                        scheduler=None, optimizer=ADAM)  # PackedSet's config, its warm-up (step 1 at lr 0) removed
        cuts = ["--partition", str(cut)] if cut else []
        runs.append((data.root / "tp", [*data.args, "--stages", "2", "--steps", str(STEPS), *cuts, "--tp", "2",
                                        *flags], {}))
        sets[preset] = data
    return {preset: (sets[preset], run) for preset, run in zip(FAMILIES, launch_series(runs))}


@pytest.fixture(scope="module", params=list(FAMILIES))
def family(request, launched):
    """(preset, the reference's (model, losses), the PP=2 x TP=2 run, its flags) on the same rows."""
    preset, flags = request.param, FAMILIES[request.param][1]
    data, run = launched[preset]
    return preset, data.reference(*flags), run.check(), flags


def test_pp2_tp2_equals_single_device(family):
    preset, (ref_model, ref_losses), run, flags = family
    assert run.summary["stages"] == 2 and sorted(run.losses) == list(range(1, STEPS + 1))
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-3
    assert list(run.losses.values()) == pytest.approx(ref_losses, abs=TOL), (run.losses, ref_losses)
    model = torch.nn.Sequential(*load_reference(run.out / "checkpoints", ref_model.cfg))  # the TP shards gathered
    _weights_equal_within(model, ref_model, TOL)
    got, ref = model.state_dict(), ref_model.state_dict()
    init = ReferenceModel(ref_model.cfg, seed=SEED).state_dict()
    frozen, slow = frozen_prefixes(ref_model, flags), SLOW.get(preset, ())
    assert_weights_moved(got, init, TOL, frozen, no_gradient=slow)  # every other trained tensor > 10 x TOL
    for k in (k for k in got if k.endswith(slow)):
        moved, off = (got[k] - init[k]).abs().max().item(), (got[k] - ref[k]).abs().max().item()
        assert moved > TOL and moved > 100 * off, (k, moved, off)
    if flags:  # the frozen tower: its init, bit for bit, on the TP shards gathered
        tower = [k for k in init if k.startswith(frozen)]
        assert tower and all(torch.equal(got[k], init[k]) for k in tower)
