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
Clipping (fp32, ZeRO 0): DeepSpeed's `clip_grad_norm_` adds each rank's own squared norms over the stages, then
averages the result over DP, so a rank's norm would count its shard's experts only; the global norm here adds the
shards' squared norms over the EP group once (every expert once), the replicated weights as DeepSpeed counts them
(model_parallel, mmpipe.runtime.pipeline), then sums over the stages: the single-device model's norm.
Checkpoints: every rank gathers its EP group's shards, and their AdamW moments, into whole tensors for the save (the
layer files and the optimizer file, written by DP rank 0, then hold all E experts, as a run without EP writes them),
then returns to its shard. A load reads whole tensors into whole-sized experts and keeps this rank's slice of the
weights and the moments, so a checkpoint resumes under any EP (1 included) and any DP it divides.
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


def _sharded(layers) -> list[Experts]:
    return [m for layer in layers for m in (layer.modules() if isinstance(layer, torch.nn.Module) else ())
            if isinstance(m, Experts) and m.ep is not None]


def _moments(optimizer, p) -> list[str]:
    """The keys of p's optimizer state that are shaped like p (AdamW's exp_avg, exp_avg_sq; not its step)."""
    state = optimizer.state.get(p, {}) if optimizer is not None else {}
    return [k for k, v in state.items() if torch.is_tensor(v) and v.shape == p.shape]


@contextlib.contextmanager
def gathered(layers, optimizer=None):
    """Every sharded Experts of these layers holds all E experts inside the block, and so do the weights' optimizer
    moments (an all-gather over its EP group, collective), its own shard again after."""
    def whole(t: torch.Tensor, group, n: int) -> torch.Tensor:
        parts = [torch.empty_like(t) for _ in range(n)]
        dist.all_gather(parts, t.contiguous(), group=group)
        return torch.cat(parts)
    held = []
    for m in _sharded(layers):
        group, n = m.ep
        for p in (m.gate_up_proj, m.down_proj):
            for k in _moments(optimizer, p):
                held.append((optimizer.state[p], k, optimizer.state[p][k]))
                optimizer.state[p][k] = whole(optimizer.state[p][k], group, n)
            held.append((p, "data", p.data))
            p.data = whole(p.data, group, n)
    try:
        yield
    finally:
        for owner, key, shard in held:
            if key == "data":
                owner.data = shard
            else:
                owner[key] = shard


@contextlib.contextmanager
def loading(layers, optimizer=None):
    """Sharded experts sized whole (contents undefined) for a checkpoint's whole tensors to load into; after, each
    keeps its slice of what was loaded, weights and, where the load brought whole ones, moments. Local."""
    sharded = _sharded(layers)
    for m in sharded:
        for p in (m.gate_up_proj, m.down_proj):
            p.data = p.data.new_empty((m.experts, *p.shape[1:]))
    try:
        yield
    finally:
        for m in sharded:
            group, n = m.ep
            per, r = m.experts // n, dist.get_rank(group)
            for p in (m.gate_up_proj, m.down_proj):
                state = optimizer.state.get(p, {}) if optimizer is not None else {}
                for k in _moments(optimizer, p):
                    state[k] = state[k][r * per:(r + 1) * per].clone()
                p.data = p.data[r * per:(r + 1) * per].clone()


def clip_norm(params, shards, max_norm: float, mpu, ep_group) -> torch.Tensor:
    """Clip every gradient of `params` by the global norm of the whole model (see the module's docstring): `shards`
    the expert shards among them; returns the norm."""
    mine = {id(p) for p in shards}
    params = [p for p in params if p.grad is not None]
    rep = [p.grad.float().pow(2).sum() for p in params if id(p) not in mine and (
        mpu.get_model_parallel_rank() == 0 or getattr(p, "model_parallel", False))]
    own = [p.grad.float().pow(2).sum() for p in params if id(p) in mine]
    zero = torch.zeros((), device=params[0].device)
    shard_sq = torch.stack(own).sum() if own else zero.clone()
    dist.all_reduce(shard_sq, group=ep_group)  # every expert of the stage, once
    sq = (torch.stack(rep).sum() if rep else zero) + shard_sq
    dist.all_reduce(sq, group=mpu.get_model_parallel_group())  # over the stages
    norm = sq.sqrt()
    scale = (max_norm / (norm + 1e-6)).clamp(max=1.0)  # clip_grad_norm_'s coefficient
    for p in params:
        p.grad.mul_(scale)
    return norm


def install(engine, shards: list, dp: int, ep_group) -> None:
    """The engine's gradient reduction, clipping, checkpoint save and load made shard-aware (see the module's
    docstring)."""
    reduce, save, load = engine.allreduce_gradients, engine.save_checkpoint, engine.load_checkpoint

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
        with gathered(engine.module.forward_funcs, engine.optimizer):
            return save(*args, **kwargs)

    def load_checkpoint(*args, **kwargs):
        with loading(engine.module.forward_funcs, engine.optimizer):
            return load(*args, **kwargs)

    def clip_fp32_gradients():  # fp32 and ZeRO 0, EP's only precision for now (mmpipe.run_config._check_ep)
        return clip_norm(engine.module.parameters(), [p for p, _ in shards], engine.gradient_clipping(), engine.mpu,
                         ep_group)

    engine.allreduce_gradients, engine.save_checkpoint = allreduce_gradients, save_checkpoint
    engine.load_checkpoint, engine.clip_fp32_gradients = load_checkpoint, clip_fp32_gradients
