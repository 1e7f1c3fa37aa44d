"""--tp x --sp: Megatron tensor parallelism and Ulysses sequence parallelism in one stage (issue 58's TP x SP;
docs/sequence_parallel.md, "TP x SP").

- In process: the grid (runtime.pipeline.grid_topology), axes (pipe, data, seq, model), TP innermost: the TP, SP, DP and
  stage-to-stage groups of PP 2 x DP 2 x SP 2 x TP 2.
- In process, 2 gloo ranks: qwen-tiny's tied head under TP 2 and the SP plan returns TiledLogits of its vocab slice;
  their tiled vocab-parallel loss and gradients equal the whole vocabulary's (1e-6).
- In process: the refusals at the front door, one line each, exit 2 (SP not dividing the heads a TP rank holds,
  Gated DeltaNet's key heads a TP rank holds, --sequence-parallel with --sp), and the dry run's layout line (train's
  and `mmpipe check`'s: check runs TP x SP, tests/test_check_tp_sp.py).
- One launch: qwen-tiny PP=1 x SP=2 x TP=2 (4 gloo ranks) on packed rows, a sample cut by the SP slice, the clip
  engaged, fp32: every step's loss and the final weights equal the single-device loop's (1e-5). qwen-tiny's 2 KV heads
  are 1 a TP rank, repeated for the 2 SP ranks (sequence_parallel.kv_for_sp); the head is vocab-split, its loss the
  vocab-parallel cross-entropy of each SP rank's slice a tile of positions at a time (3 tiles a micro-batch), summed
  over SP; the gradients summed over SP (every weight)
  and TP (the TP-summed ones) once a step; the norm counts every parameter once (a norm counting the SP copies twice
  clips as at CLIP / sqrt(2), and a clip at sqrt(2) x CLIP ends > 10 x TOL away). The checkpoint is per TP shard,
  named as a TP-only run's.
"""
from __future__ import annotations

import functools
import json
import os
from types import SimpleNamespace

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp
import torch.nn.functional as F
from deepspeed.pipe import TiedLayerSpec

from conftest import assert_weights_moved, refused, write_ds_config
from mmpipe.config import load_preset
from mmpipe.model import ReferenceModel
from mmpipe.model.builder import layer_specs
from mmpipe.model.sequence_parallel import TILE_ENV, TiledLogits, parallelize_sequence
from mmpipe.model.tensor_parallel import Shard, parallelize
from mmpipe.registry import family_of
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.pipeline import grid_topology
from test_qwen_pipeline import SIZES, PackedSet, _weights_equal_within, loaders_agree
from test_tp_combos import OPTIMIZER as CLIPPED_ADAM

TOL, CLIP = 1e-5, 0.05
STEPS, SEED = 3, 5


def test_grid_puts_tp_innermost_then_sp():
    """rank = ((pipe x DP + data) x SP + seq) x TP + model: the TP group of a rank is its neighbours (Megatron's order,
    inside a node), the SP group strides by TP, the DP group by SP x TP, a stage's sends go to the same (data, seq,
    model) rank of the next stage."""
    topo = grid_topology(SimpleNamespace(stages=2, dp=2, sp=2, tp=2))
    assert topo.get_axis_names() == ["pipe", "data", "seq", "model"]
    assert topo.get_axis_comm_lists("model")[:2] == [[0, 1], [2, 3]]
    assert topo.get_axis_comm_lists("seq")[:2] == [[0, 2], [1, 3]]
    assert topo.get_axis_comm_lists("data")[:2] == [[0, 4], [1, 5]]
    assert topo.get_axis_comm_lists("pipe")[:2] == [[0, 8], [1, 9]]
    assert grid_topology(SimpleNamespace(stages=2, dp=1, sp=1, tp=2)).get_axis_names() == ["pipe", "data", "model"]
    assert grid_topology(SimpleNamespace(stages=2, dp=1, sp=1, tp=1)) is None


def _tiled_head_worker(rank: int, tmp: str) -> None:
    """qwen-tiny's tied head split by its TP plan (2 ranks: V / 2 = 100 rows each), then by its SP plan: it returns
    TiledLogits of the TP rank's rows; their loss over 70 positions in tiles of 32 against the whole vocabulary's."""
    torch.set_num_threads(1)
    os.environ[TILE_ENV] = str(16 * 200 * 4)  # 12,800 B of fp32 logits a tile: 32 positions of 100
    from deepspeed.comm import comm as ds_comm
    from deepspeed.comm.torch import TorchBackend
    dist.init_process_group("gloo", init_method=f"file://{tmp}/store", rank=rank, world_size=2)
    ds_comm.cdb = TorchBackend("gloo", ds_comm.default_pg_timeout, None)  # the vocab-parallel loss's collectives
    cfg = load_preset("qwen-tiny")
    family, tied = family_of(cfg), [s for s in layer_specs(cfg) if isinstance(s, TiedLayerSpec)]
    torch.manual_seed(SEED)
    embed = tied[0].build()
    whole = embed.embed_tokens.weight.detach().clone()
    tp = Shard(dist.group.WORLD, rank, 2)
    parallelize(embed, family.tp_plan, tp)
    head = parallelize(functools.partial(tied[-1].forward_fn, embed), family.tp_plan, tp)
    head = parallelize_sequence([head], Shard(None, 0, 1), family.sp_plan)[0]
    g = torch.Generator().manual_seed(1)
    hidden = torch.randn(2, 35, cfg.text.dim, generator=g)
    labels = torch.randint(0, whole.shape[0], (2, 35), generator=g)
    labels[:, :4] = -100  # ignored (the prompt's positions)
    weights = torch.rand(2, 35, generator=g)
    mine, ref = hidden.clone().requires_grad_(), hidden.clone().requires_grad_()
    w_ref = whole.clone().requires_grad_()
    tiled = head((mine,))
    loss = tiled.loss(labels, weights)
    loss.backward()
    ce = F.cross_entropy((ref @ w_ref.T).flatten(0, 1), labels.flatten(), reduction="none")
    want = (ce * weights.flatten()).sum()
    want.backward()
    rows = slice(rank * 100, (rank + 1) * 100)
    out = {"tiled": isinstance(tiled, TiledLogits) and tiled.shard is tp, "tile": tiled.tile,
           "loss": abs(loss.item() - want.item()) / abs(want.item()),
           "hidden": float((mine.grad - ref.grad).abs().max() / ref.grad.abs().max()),
           "weight": float((embed.embed_tokens.weight.grad - w_ref.grad[rows]).abs().max() / w_ref.grad.abs().max())}
    with open(f"{tmp}/tiled{rank}.json", "w") as f:
        json.dump(out, f)
    dist.barrier()
    os._exit(0)  # as test_sequence_parallel's workers: no destructors at exit


def test_tiled_vocab_parallel_loss_equals_the_whole_vocabulary(tmp_path):
    """Under TP x SP the head stays tiled (nothing holds [L / SP, V / TP] logits at once): the tied head, split by TP
    (its embedding's 1/TP of the vocabulary) and wrapped by SP, hands the loss its hidden (entering the TP region) and
    the rank's rows; the tiles' vocab-parallel cross-entropy equals the whole vocabulary's, its hidden and weight
    gradients too (1e-6 relative; fp32)."""
    mp.spawn(_tiled_head_worker, args=(str(tmp_path),), nprocs=2, join=True)
    for rank in (0, 1):
        got = json.loads((tmp_path / f"tiled{rank}.json").read_text())
        assert got.pop("tiled") and got.pop("tile") == 32, got
        assert max(got.values()) < 1e-6, (rank, got)


def test_tp_sp_refusals_one_line_each(capsys):
    err = refused(["--preset", "qwen-tiny", "--tp", "2", "--sp", "4", "--steps", "1"], capsys)
    assert any("--sp: 4 does not divide qwen-tiny's 4 attention heads (text.n_heads) (2 a TP rank at --tp 2)" in line
               for line in err), err
    err = refused(["--preset", "qwen3.5-tiny", "--tp", "2", "--sp", "2", "--steps", "1"], capsys)
    assert any("--sp: 2 does not divide qwen3.5-tiny's 2 Gated DeltaNet key heads" in line and "1 a TP rank" in line
               for line in err), err
    err = refused(["--preset", "qwen-tiny", "--tp", "2", "--sp", "2", "--sequence-parallel", "--steps", "1"], capsys)
    assert any("--sp: 2 with --sequence-parallel: both split the row's positions" in line for line in err), err
    from mmpipe.cli import main
    assert main(["check", "--preset", "qwen-tiny", "--tp", "2", "--sp", "2", "--steps", "1", "--dry-run"]) == 0
    assert "2 stages x dp 1 x tp 2 x sp 2 = 8 ranks" in capsys.readouterr().out
    assert main(["train", "--preset", "qwen-tiny", "--tp", "2", "--sp", "2", "--stages", "1", "--steps", "1",
                 "--dry-run"]) == 0
    assert "1 stages x dp 1 x tp 2 x sp 2 = 4 ranks" in capsys.readouterr().out


@pytest.fixture(scope="module")
def qwen_tp_sp(tmp_path_factory):
    with pytest.MonkeyPatch.context() as patch:
        # the ranks' loss in tiles of 32 positions (a TP rank's V / 2 = 100 logits of 16 x 200 x 4 B): 3 a micro-batch
        patch.setenv(TILE_ENV, str(16 * 200 * 4))
        return _qwen_tp_sp(tmp_path_factory)


def _qwen_tp_sp(tmp_path_factory):
    """qwen-tiny PP=1 x SP=2 x TP=2 (4 ranks) on packed rows, clipped at CLIP, and the single-device loop on the same
    rows (micro 2 x GAS 2, AdamW at a constant lr) clipped at CLIP and at sqrt(2) x CLIP."""
    data = PackedSet(tmp_path_factory.mktemp("tpsp"), "qwen-tiny", SIZES, 36, STEPS, SEED)
    refs = []
    for clip in (CLIP * 2 ** 0.5, CLIP):  # ds.json ends at CLIP: the launch's
        write_ds_config(data.root / "ds.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2,
                        scheduler=None, optimizer=CLIPPED_ADAM, gradient_clipping=clip)
        refs.append(data.reference())
    return data, refs[1], refs[0][1], data.launch("tpsp", 1, "--tp", "2", "--sp", "2")


def test_pp1_sp2_tp2_equals_single_device(qwen_tp_sp):
    data, (ref_model, ref_losses), other_losses, run = qwen_tp_sp
    cut = 0  # rows whose SP slice (half of each row) cuts a sample
    for _, _, _, segments, _ in loaders_agree(data.resolved(), data.root, SEED, STEPS):
        half = segments.shape[1] // 2
        cut += int(((segments[:, half - 1] == segments[:, half]) & (segments[:, half] > 0)).sum())
        assert int(segments.max()) >= 3  # packed: 3+ samples a row
    assert cut >= 1
    assert abs(other_losses[-1] - ref_losses[-1]) > 10 * TOL  # the clip engaged and its norm reaches the losses
    assert run.summary["stages"] == 1 and sorted(run.losses) == list(range(1, STEPS + 1))
    assert list(run.losses.values()) == pytest.approx(ref_losses, abs=TOL), (run.losses, ref_losses)
    ckpt = run.out / "checkpoints"
    tag = ckpt / (ckpt / "latest").read_text().strip()
    # per TP shard, independent of SP: SP rank 0 writes a TP-only run's names; DeepSpeed's stage files one a rank
    layers = {p.name.split("-", 1)[1] for p in tag.glob("layer_*")}
    assert layers == {"model_00-model_states.pt", "model_01-model_states.pt"}, layers
    assert sorted(p.name for p in tag.glob("mp_rank_*")) == [f"mp_rank_0{r}_model_states.pt" for r in range(4)]
    model = torch.nn.Sequential(*load_reference(ckpt, ref_model.cfg))  # the TP shards gathered
    _weights_equal_within(model, ref_model, TOL)
    assert_weights_moved(model.state_dict(), ReferenceModel(ref_model.cfg, seed=SEED).state_dict(), TOL)
