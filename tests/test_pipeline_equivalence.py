"""Pipeline == single device: same seed and data give the same losses and weights for the
reference loop, PP=1, PP=2 and PP=4 (every stage training); the gradient crosses the stage
boundary. That --freeze vision keeps the tower bit-identical is
assert_vision_frozen, run on test_schedules.py's frozen PP=4 run (a launch fewer than a run of its own)."""
from __future__ import annotations

import pytest
import torch

from conftest import EQUIV_STEPS, assert_weights_moved, train_run
from mmpipe.config import load_preset
from mmpipe.model import ReferenceModel
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference

TOL = 1e-5


def _run_args(ds_config, *extra):
    return ["--preset", "tiny", "--ds-config", str(ds_config), "--steps", str(EQUIV_STEPS), "--eval-samples", "0",
            "--seed", "3", *extra]


@pytest.fixture(scope="module")
def reference(equivalence_config):
    args = TrainArgs.from_argv(_run_args(equivalence_config, "--stages", "1"))
    run = resolve(args, world_size=1)
    return train_reference(run, seed=3, steps=EQUIV_STEPS)


@pytest.fixture(scope="module")
def pp1(tmp_path_factory, equivalence_config):
    return train_run(tmp_path_factory.mktemp("pp1"), *_run_args(equivalence_config, "--stages", "1")).check()


@pytest.fixture(scope="module")
def pp2(tmp_path_factory, equivalence_config):
    return train_run(tmp_path_factory.mktemp("pp2"), *_run_args(equivalence_config, "--stages", "2")).check()


@pytest.fixture(scope="module")
def pp4(tmp_path_factory, equivalence_config):
    """4 stages: middle stages receive the hidden state and pass it on, every stage trains."""
    return train_run(tmp_path_factory.mktemp("pp4"), *_run_args(equivalence_config, "--stages", "4")).check()


def _max_weight_diff(a: torch.nn.Module, b: torch.nn.Module, skip_key_bias: bool = False) -> float:
    sa, sb = a.state_dict(), b.state_dict()
    assert sa.keys() == sb.keys()
    diffs = []
    for k in sa:
        d = (sa[k] - sb[k]).abs()
        if skip_key_bias and k.endswith("attn.qkv.bias"):
            # The key bias adds q.b_k to every score of a row, which softmax cancels: its gradient
            # is exactly 0 in exact arithmetic and ~1e-10 rounding noise in floats. Adam divides
            # that noise by its own RMS (eps 1e-8), so these 1/3 of the bias entries random-walk
            # ~1e-5 per step whatever the stage count. Query and value biases are compared.
            d = torch.cat([d[: len(d) // 3], d[2 * len(d) // 3:]])
        diffs.append(d.max().item())
    return max(diffs)


def test_losses_match_reference(reference, pp1, pp2, pp4):
    _, ref_losses = reference
    assert len(ref_losses) == EQUIV_STEPS
    assert pp4.summary["stages"] == 4 and len(pp4.summary["parts"]) == 5
    for run in (pp1, pp2, pp4):
        losses = run.losses
        assert sorted(losses) == list(range(1, EQUIV_STEPS + 1))
        for step, ref in enumerate(ref_losses, start=1):
            assert losses[step] == pytest.approx(ref, abs=TOL), (run.out, step)
    # the run really trained: the loss moved
    assert abs(ref_losses[-1] - ref_losses[0]) > 1e-3


def test_only_floats_cross_stage_boundaries(pp2, pp4):
    """The wire carries the hidden state alone, one message per micro-batch forward (and its gradient
    back): every stage reads input_ids and has_image from its own loader (mmpipe.runtime.wire)."""
    for run in (pp2, pp4):
        run.assert_only_floats_crossed(per_forward=1)
    assert {shape for kind, _, shape in pp4.wire(2) if kind == "data"} == {"4x28x32"}  # a middle stage's [B, T, D]


def test_weights_match_reference(reference, pp1, pp2, pp4):
    ref_model, _ = reference
    cfg = load_preset("tiny")
    for run in (pp1, pp2, pp4):
        model = load_reference(run.out / "checkpoints", cfg)
        assert _max_weight_diff(model, ref_model, skip_key_bias=True) < TOL
        # EQUIV_STEPS 6, step 1 at lr 0 (WarmupCosineLR): 5 updates moved every tensor by more than 10 x TOL
        assert_weights_moved(model, ReferenceModel(cfg, seed=3), TOL)


def test_pp2_puts_vision_on_stage0_and_its_weights_change(pp2):
    parts = pp2.summary["parts"]
    assert len(parts) == 3 and parts[1] > 1 + load_preset("tiny").vision.n_layers  # the ViT is all on stage 0
    cfg = load_preset("tiny")
    init = ReferenceModel(cfg, seed=3)
    trained = load_reference(pp2.out / "checkpoints", cfg)
    for idx in range(cfg.vision.n_layers + 2):  # patch embedding, vision blocks, final norm
        assert _max_weight_diff(init[idx], trained[idx]) > 0, f"vision layer {idx} did not train"


def assert_vision_frozen(run, seed: int) -> None:
    """A `--preset tiny --freeze vision` run's tower is bit-identical to its initial weights (seed) and
    the projector after it trained (test_schedules.py's frozen PP=4 run)."""
    cfg = load_preset("tiny")
    init = ReferenceModel(cfg, seed=seed)
    trained = load_reference(run.out / "checkpoints", cfg)
    n_vision = cfg.vision.n_layers + 2
    for idx in range(n_vision):
        for k, v in init[idx].state_dict().items():
            assert torch.equal(v, trained[idx].state_dict()[k]), f"frozen layer {idx} {k} changed"
    assert _max_weight_diff(init[n_vision], trained[n_vision]) > 0  # the projector trained
    assert run.summary["freeze"] == ["vision"]
