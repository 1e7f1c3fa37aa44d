"""Expert parallelism (`--ep N`, issue 43; docs/moe.md): an MoE model's experts split over groups of N data-parallel
ranks of each stage, the tokens exchanged by all-to-all (mmpipe.model.moe.Experts.exchange).

Groups, for each stage's DP ranks d = 0 .. DP - 1 (DeepSpeed's topology: rank = stage x DP + d):

    expert-parallel (EP) group      d in {b N, ..., b N + N - 1}, for b = 0 .. DP / N - 1: the ranks that split the
                                    experts (rank i of the group keeps experts [i E / N, (i + 1) E / N)) and exchange
                                    their tokens
    expert-data-parallel group      d in {i, i + N, i + 2N, ...}: the ranks holding the same shard

Gradients: DeepSpeed's data-parallel all-reduce averages every weight over all DP ranks; an expert shard is not a
replica there, so it is left out of it (its parameters marked off for the reduction's duration) and reduced as the
single-device step would have it instead: its gradient already sums the tokens of its whole EP group (the
all-to-all's backward brings them), so it is summed over its expert-data-parallel group and divided by DP, the same
mean over the global batch as the other weights' (DeepSpeed's own `_reduce_expert_gradients` scales the same way).
DeepSpeed's initial broadcast of the weights from DP rank 0 leaves the shards out (ds_optim_param).
Checkpoints: every rank gathers its EP group's shards into whole tensors for the save (the layer files, written by
DP rank 0, then hold all E experts, as a run without EP writes them), then returns to its shard.
"""
from __future__ import annotations

import contextlib

import torch
import torch.distributed as dist

from ..model.moe import Experts


def shard_experts(layers, topo, ep: int) -> tuple[list[tuple[torch.nn.Parameter, object]], object]:
    """Split every Experts module of this stage's layers over its EP group: ((parameter, expert-data-parallel group)
    of each shard, the EP group). Collective over the world (every rank creates every group, in one order)."""
    stages, dp, me = topo.get_dim("pipe"), topo.get_dim("data"), dist.get_rank()
    ep_group = edp_group = None
    for s in range(stages):
        for b in range(dp // ep):
            ranks = [topo.get_rank(pipe=s, data=b * ep + i) for i in range(ep)]
            group = dist.new_group(ranks)
            ep_group = group if me in ranks else ep_group
        for i in range(ep):
            ranks = [topo.get_rank(pipe=s, data=b * ep + i) for b in range(dp // ep)]
            group = dist.new_group(ranks)
            edp_group = group if me in ranks else edp_group
    shards = []
    for layer in layers:
        for m in layer.modules() if isinstance(layer, torch.nn.Module) else ():
            if isinstance(m, Experts):
                m.shard(ep_group)
                for w in (m.gate_up_proj, m.down_proj):
                    # DeepSpeed's initialize broadcasts every weight from DP rank 0 to make replicas equal, which
                    # would give every rank rank 0's shard; it leaves out what it marks as unique per shard
                    # (deepspeed/runtime/engine.py _broadcast_model, ds_optim_param: its OptimizedLinear's mark)
                    w.ds_optim_param = True
                    shards.append((w, edp_group))
    return shards, ep_group


@contextlib.contextmanager
def gathered(layers):
    """Every sharded Experts of these layers holds all E experts inside the block (an all-gather over its EP group,
    collective), its own shard again after."""
    held = []
    for layer in layers:
        for m in layer.modules() if isinstance(layer, torch.nn.Module) else ():
            if isinstance(m, Experts) and m.ep is not None:
                group, n = m.ep
                for p in (m.gate_up_proj, m.down_proj):
                    parts = [torch.empty_like(p.data) for _ in range(n)]
                    dist.all_gather(parts, p.data.contiguous(), group=group)
                    held.append((p, p.data))
                    p.data = torch.cat(parts)
    try:
        yield
    finally:
        for p, shard in held:
            p.data = shard


def install(engine, shards: list, dp: int) -> None:
    """The engine's gradient reduction and checkpoint save made shard-aware (see the module's docstring)."""
    reduce, save = engine.allreduce_gradients, engine.save_checkpoint

    def allreduce_gradients(*args, **kwargs):
        trained = [p for p, _ in shards if p.requires_grad]
        for p in trained:  # DeepSpeed's reduction skips what does not require a gradient
            p.requires_grad_(False)
        try:
            reduce(*args, **kwargs)
        finally:
            for p in trained:
                p.requires_grad_(True)
        if engine.is_gradient_accumulation_boundary():
            for p, group in shards:
                if p.grad is not None:
                    if dist.get_world_size(group) > 1:
                        dist.all_reduce(p.grad, group=group)
                    p.grad.div_(dp)

    def save_checkpoint(*args, **kwargs):
        with gathered(engine.module.forward_funcs):
            return save(*args, **kwargs)
    engine.allreduce_gradients, engine.save_checkpoint = allreduce_gradients, save_checkpoint
