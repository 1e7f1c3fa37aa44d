"""--sp with an MoE model and --ep (issue 58's "PP=1 x SP=2 x DP=2 for a MoE preset with EP=2";
docs/sequence_parallel.md, "MoE and expert parallelism under SP").

One launch: tests/test_moe_pipeline.py's Qwen3-VL-MoE (qwen3-vl-tiny's shape, every decoder MLP 8 experts of width 32,
top 2, untied head, aux coefficient 0.001) on its packed rows of mixed image grids (88 decoder positions, rows with a
sample across the SP cut at 44), PP=1 x DP=2 x SP=2 with EP=2 (4 ranks: each SP rank's slice of the row routed to
the experts of its EP group, the DP ranks of its SP coordinate), micro 2 x GAS 1, clipped at CLIP every step, AdamW at
test_tp_combos' eps 1e-4 (where the clip's scale reaches the update), 3 steps at a constant lr, against the
single-device loop over the same 4 rows a step (micro 2 x GAS 2): each step's loss and aux loss, and every final
weight, within 1e-5; every trained tensor moved more than 10 x that; each rank held half the experts. The untied MoE
head's loss is tiled (MoeHead -> TiledLogits), 6 tiles of 16 positions a micro-batch."""
from __future__ import annotations

import pytest
import torch

from conftest import assert_weights_moved, train_run, write_ds_config
from mmpipe.model import ReferenceModel
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from test_moe_pipeline import recorded_reference, write_moe_set
from test_qwen_pipeline import _weights_equal_within, frozen_prefixes
from test_tp_combos import OPTIMIZER as CLIPPED_ADAM

STEPS, SEED, TOL = 3, 5, 1e-5
CLIP = 0.5  # below every step's global gradient norm (10.5, 3.1, 2.5: asserted): each step is clipped
pytestmark = pytest.mark.usefixtures("small_tiles")  # conftest's: the launch's loss in tiles of 16 positions


@pytest.fixture(scope="module")
def sp_moe(tmp_path_factory):
    """The single-device loop (model, losses, aux terms, norms) and the PP=1 x DP=2 x SP=2 x EP=2 launch."""
    root = tmp_path_factory.mktemp("sp_moe")
    # rows in stream order (--balance off): a balanced layout depends on DP (test_moe_ep's reason)
    args = [*write_moe_set(root), "--stages", "1", "--balance", "off", "--freeze", "vision"]
    common = {"train_micro_batch_size_per_gpu": 2, "scheduler": None, "optimizer": CLIPPED_ADAM,
              "gradient_clipping": CLIP}
    ref_ds = write_ds_config(root / "gas2.json", gradient_accumulation_steps=2, **common)
    run = resolve(TrainArgs.from_argv([*args, "--ds-config", str(ref_ds), "--output-dir", str(root / "ref")]),
                  world_size=1)
    reference = recorded_reference(run, SEED, STEPS, 2, root / "ref")
    ds = write_ds_config(root / "gas1.json", gradient_accumulation_steps=1, **common)
    launch = train_run(root / "sp2_ep2", *args, "--ds-config", str(ds), "--dp", "2", "--sp", "2", "--ep", "2",
                       "--steps", str(STEPS)).check()
    return reference, launch


def test_pp1_sp2_dp2_ep2_equals_single_device(sp_moe):
    """Each SP rank routes its slice's tokens to its EP group's experts; the router statistics are summed over SP
    (the aux loss counts the whole row's tokens, once); the clip counts each expert shard on SP rank 0 only."""
    (ref_model, ref_losses, ref_aux, norms), run = sp_moe
    assert len(norms) == STEPS and min(norms) > CLIP, norms
    # ranks (data x 2 + SP rank): EP groups {0, 2} and {1, 3}, the DP ranks of one SP coordinate
    for rank, experts in ((0, "0..3"), (1, "0..3"), (2, "4..7"), (3, "4..7")):
        assert f"mmpipe: rank {rank}: experts {experts} of 8 in each MoE block (--ep 2)" in run.proc.stdout
    assert min(ref_aux) > 1e-3 * 1.5, ref_aux  # the term is there (coefficient 0.001 x a loss >= 1)
    assert [float(r["loss"]) for r in run.rows] == pytest.approx(ref_losses, abs=TOL)
    assert [float(r["aux_loss"]) for r in run.rows] == pytest.approx(ref_aux, abs=TOL)
    model = torch.nn.Sequential(*load_reference(run.out / "checkpoints", ref_model.cfg))
    assert model[10].mlp.experts.gate_up_proj.shape[0] == 8  # whole experts in the layer files
    _weights_equal_within(model, ref_model, TOL)
    ref = ref_model.state_dict()
    print("sp_moe: losses", max(abs(float(r["loss"]) - x) for r, x in zip(run.rows, ref_losses)), "aux",
          max(abs(float(r["aux_loss"]) - x) for r, x in zip(run.rows, ref_aux)), "weights",
          max((v - ref[k]).abs().max().item() for k, v in model.state_dict().items()), "norms", norms)
    assert_weights_moved(model, ReferenceModel(ref_model.cfg, seed=SEED), TOL, frozen_prefixes(model, ["--freeze"]))

