"""Expert parallelism's dispatch (issue 43; docs/moe.md), the layer alone: two gloo processes, each holding 4 of the
8 experts (mmpipe.model.moe.Experts.shard) and its own 300 tokens, exchange them by all-to-all and give exactly
what one process with all 8 experts gives on the 600 tokens: each token's output, the gradient of each token and of
every expert's weights (each shard's gradient gathers both ranks' tokens). Also with every token of both ranks
forced onto the experts of rank 1 (uneven splits, rank 0's experts idle): nothing dropped.

Then in training: `mmpipe train --stages 1 --dp 2 --ep 2` on tests/test_moe_pipeline.py's MoE model and records
(2 rows x GAS 2 per rank) equals the single-device loop at GAS 4 on the same rows (losses, aux losses and weights,
1e-5), the checkpoint holding all 8 experts whole; and the flag's bad inputs are one line each."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from conftest import refused, train_run, write_ds_config
from mmpipe.model.moe import Experts, TopKRouter
from mmpipe.run_args import TrainArgs
from mmpipe.run_config import resolve
from mmpipe.runtime.checkpoint import load_reference
from mmpipe.runtime.reference import train_reference
from test_moe_pipeline import write_moe_set
from test_qwen_pipeline import _weights_equal_within

E, TOP_K, D, FF, N = 8, 2, 32, 16, 300


def _layer():
    torch.manual_seed(0)
    return TopKRouter(D, E, TOP_K, True), Experts(D, FF, E)


def _tokens(rank: int) -> torch.Tensor:
    return torch.randn(N, D, generator=torch.Generator().manual_seed(100 + rank))


def _probe(rank: int) -> torch.Tensor:  # a fixed random cotangent: the loss is sum(y x probe)
    return torch.randn(N, D, generator=torch.Generator().manual_seed(200 + rank))


def _routes(router, x, forced: bool):
    if forced:  # all to experts 5 and 6, rank 1's under EP = 2
        return torch.tensor([[5, 6]]).expand(len(x), 2), torch.tensor([[0.6, 0.4]]).expand(len(x), 2)
    return router(x)[1:]


def _rank(rank: int, store: str, forced: bool, dispatch: str, out: str):
    os.environ["OMP_NUM_THREADS"] = "1"
    torch.set_num_threads(1)
    dist.init_process_group("gloo", init_method=f"file://{store}", rank=rank, world_size=2)
    router, experts = _layer()
    experts.dispatch = dispatch
    experts.shard(dist.group.WORLD)
    x = _tokens(rank).requires_grad_()
    y = experts(x, *_routes(router, x, forced))
    (y * _probe(rank)).sum().backward()
    torch.save({"y": y.detach(), "x_grad": x.grad, "gate_up": experts.gate_up_proj.grad,
                "down": experts.down_proj.grad}, f"{out}/rank{rank}.pt")
    dist.destroy_process_group()


@pytest.mark.parametrize("forced, dispatch", [(False, "grouped"), (False, "loop"), (True, "grouped")])
def test_two_expert_parallel_ranks_equal_one_with_every_expert(tmp_path, forced, dispatch):
    mp.start_processes(_rank, args=(str(tmp_path / "store"), forced, dispatch, str(tmp_path)), nprocs=2,
                       start_method="fork")
    got = [torch.load(tmp_path / f"rank{r}.pt") for r in (0, 1)]
    router, experts = _layer()
    x = torch.cat([_tokens(0), _tokens(1)]).requires_grad_()
    y = experts(x, *_routes(router, x, forced))
    (y * torch.cat([_probe(0), _probe(1)])).sum().backward()
    close = dict(atol=1e-6, rtol=1e-5)
    torch.testing.assert_close(torch.cat([g["y"] for g in got]), y.detach(), **close)
    torch.testing.assert_close(torch.cat([g["x_grad"] for g in got]), x.grad, **close)
    torch.testing.assert_close(torch.cat([g["gate_up"] for g in got]), experts.gate_up_proj.grad, **close)
    torch.testing.assert_close(torch.cat([g["down"] for g in got]), experts.down_proj.grad, **close)
    if forced:
        assert got[0]["gate_up"].abs().sum() == 0 and (experts.gate_up_proj.grad[5:7].abs() > 0).all()


STEPS, SEED = 3, 5


def _ds(path, gas: int):
    return str(write_ds_config(path, train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=gas,
                               gradient_clipping=0, scheduler=None))


def test_pp1_dp2_ep2_equals_single_device(tmp_path, monkeypatch):
    """Each rank holds 4 of the 8 experts of every MoE block; the step's loss, aux_loss and every weight equal one
    process with all experts accumulating the same 4 micro-batches (a replica at GAS 4: the loss weights carry
    GAS x DP), and the saved layer files hold whole [8, ...] expert tensors."""
    from mmpipe.model import moe
    args = write_moe_set(tmp_path)
    seen = []
    forward = moe.MoeHead.forward

    def recording(self, a):
        out = forward(self, a)
        seen.append(out[1].item())
        return out
    monkeypatch.setattr(moe.MoeHead, "forward", recording)
    run = resolve(TrainArgs.from_argv([*args, "--stages", "1", "--ds-config", _ds(tmp_path / "gas4.json", 4),
                                       "--output-dir", str(tmp_path / "ref")]), world_size=1)
    ref_model, ref_losses = train_reference(run, seed=SEED, steps=STEPS, out_dir=str(tmp_path / "ref"))
    ref_aux = [sum(seen[4 * s:4 * s + 4]) / 4 for s in range(STEPS)]
    ep = train_run(tmp_path / "ep2", *args, "--ds-config", _ds(tmp_path / "gas2.json", 2), "--stages", "1",
                   "--dp", "2", "--ep", "2", "--steps", str(STEPS)).check()
    assert ep.summary["dp"] == 2
    for rank, experts in ((0, "0..3"), (1, "4..7")):  # each rank held half the experts: the all-to-all ran
        assert f"mmpipe: rank {rank}: experts {experts} of 8 in each MoE block (--ep 2)" in ep.proc.stdout
    assert [float(r["loss"]) for r in ep.rows] == pytest.approx(ref_losses, abs=1e-5)
    assert [float(r["aux_loss"]) for r in ep.rows] == pytest.approx(ref_aux, abs=1e-5)
    got = torch.nn.Sequential(*load_reference(ep.out / "checkpoints", run.model))
    assert got[10].mlp.experts.gate_up_proj.shape[0] == 8
    _weights_equal_within(got, ref_model, 1e-5)


@pytest.mark.parametrize("extra, line", [
    (["--ep", "4"], "--ep: 4 does not divide the 2 data-parallel replicas"),
    (["--ep", "0"], "--ep: 0 must be >= 1"),
    (["--ep", "2", "--preset", "qwen3-vl-tiny"], "--ep: 2 on qwen3-vl-tiny, a dense model (no text.moe)"),
])
def test_bad_ep_is_one_line(tmp_path, capsys, extra, line):
    args = write_moe_set(tmp_path)
    lines = refused([*args, "--ds-config", _ds(tmp_path / "ds.json", 2), "--stages", "1", "--dp", "2", *extra],
                    capsys)
    assert any(line in ln for ln in lines) and len(lines) == 1, lines


def test_ep_with_clipping_is_one_line_for_now(tmp_path, capsys):
    """DeepSpeed 0.19.8's clip takes each rank's norm for the whole model's, which shards make wrong: refused."""
    args = write_moe_set(tmp_path)
    ds = write_ds_config(tmp_path / "clip.json", train_micro_batch_size_per_gpu=2, gradient_accumulation_steps=2)
    lines = refused([*args, "--ds-config", str(ds), "--stages", "1", "--dp", "2", "--ep", "2"], capsys)
    assert lines == ["mmpipe: error: --ep: 2 runs with fp32, zero_optimization.stage 0, gradient_clipping 0 and "
                     "without --resume for now (here: fp32, ZeRO 0, gradient_clipping 1.0; docs/moe.md)"]
