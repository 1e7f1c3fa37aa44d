"""Expert parallelism's dispatch (issue 43; docs/moe.md), the layer alone: two gloo processes, each holding 4 of the
8 experts (mmpipe.model.moe.Experts.shard) and its own 300 tokens, exchange them by all-to-all and give exactly
what one process with all 8 experts gives on the 600 tokens: each token's output, the gradient of each token and of
every expert's weights (each shard's gradient gathers both ranks' tokens). Also with every token of both ranks
forced onto the experts of rank 1 (uneven splits, rank 0's experts idle): nothing dropped. Not yet wired into
training (`--ep`: docs/moe.md, what does not yet)."""
from __future__ import annotations

import os

import pytest
import torch
import torch.distributed as dist
import torch.multiprocessing as mp

from mmpipe.model.moe import Experts, TopKRouter

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
