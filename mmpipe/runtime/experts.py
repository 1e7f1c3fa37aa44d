"""Expert parallelism (`--ep N`, issue 43; docs/moe.md): an MoE model's experts split over groups of N data-parallel
ranks of each stage, the tokens exchanged by all-to-all (mmpipe.model.moe.Experts.exchange).

Groups, for each stage's DP ranks d = 0 .. DP - 1 (DeepSpeed's topology: rank = stage x DP + d), and under --tp for
each TP coordinate t of the stage apart (PipeModelDataParallelTopology: rank = (stage x DP + d) x TP + t; the ranks
of TP coordinate t hold the same F / TP slice of every expert, mmpipe.model.tp_plans, so EP splits those slices along
the experts among them exactly as it splits whole experts without TP):

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
(model_parallel, mmpipe.runtime.pipeline), then sums over the stages: the single-device model's norm. Under --tp that
last sum runs over the stages x TP ranks of the replica (DeepSpeed's model-parallel group of the pipeline grid): each
TP rank's shards are its F / TP slices (every slice once), a replicated weight is counted on TP rank 0 only
(mmpipe.model.tensor_parallel.mark_norm_counting).
bf16 (DeepSpeed's BF16_Optimizer, at ZeRO 0 or 1): DeepSpeed's own MoE machinery takes over. The shards are
marked as its MoE parameters (allreduce False, group_name `ep_size_N`) and our EP / expert-data-parallel groups are
registered under that name in `deepspeed.utils.groups`; `deepspeed.initialize` then sees the Experts modules as MoE
layers (`moe_layers`), so the optimizer puts the shards in a parameter group of their own, partitions their fp32
copy over the expert-data-parallel group instead of all DP, and takes the global norm with the shards' squared
norms summed over the EP group (deepspeed.runtime.utils.get_norm_with_moe_layers: the model's norm). After it the
engine is told it has no MoE layers, so a checkpoint takes the ordinary pipeline path (layer files, gathered whole
as above) rather than DeepSpeed's per-expert files, and the experts' gradients are reduced after the rest by the
engine's own `_reduce_expert_gradients` (summed over the expert-data-parallel group, divided by DP, as above).
The fp32 weights and moments are in each rank's own optimizer file (bf16_zero_pp_rank_*), so a bf16 run resumes
under the same EP and DP only.
Checkpoints: every rank gathers its EP group's shards, and (fp32) their AdamW moments, into whole tensors for the
save (the layer files and the optimizer file, written by DP rank 0, then hold all E experts, as a run without EP
writes them), then returns to its shard. A load gives each shard its slice of the whole tensors (the module's own
load takes it, Experts._own_slice; the moments are cut after), so an fp32 checkpoint resumes under any EP (1
included) and any DP it divides.
"""
from __future__ import annotations

import contextlib
import itertools

import torch
import torch.distributed as dist

from ..model.moe import Experts


def _coordinates(topo) -> list[dict]:
    """Each coordinate of the grid's axes but data (pipe; model under --tp; seq and model under --sp), as topology
    keywords, in one order on every rank: {pipe} alone on DeepSpeed's PipeDataParallelTopology."""
    axes = [a for a in topo.get_axis_names() if a != "data"]
    return [dict(zip(axes, at)) for at in itertools.product(*(range(topo.get_dim(a)) for a in axes))]


def shard_experts(layers, topo, ep: int) -> tuple[list[tuple[torch.nn.Parameter, object]], object]:
    """Split every Experts module of this rank's layers (every stage it holds: DualPipeV's two share the rank's pipe
    coordinate, so one EP group serves both) over its EP group: ((parameter, expert-data-parallel group) of each
    shard, the EP group). Collective over the world (every rank creates every group, in one order)."""
    dp, me = topo.get_dim("data"), dist.get_rank()
    ep_group = edp_group = None
    for at in _coordinates(topo):  # each stage's, and each TP / SP coordinate's, groups of its DP ranks
        for b in range(dp // ep):
            ranks = [topo.get_rank(**at, data=b * ep + i) for i in range(ep)]
            group = dist.new_group(ranks)
            ep_group = group if me in ranks else ep_group
        for i in range(ep):
            ranks = [topo.get_rank(**at, data=b * ep + i) for b in range(dp // ep)]
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
    """A checkpoint load: the experts' weights take their slice of the files' whole tensors as the module loads them
    (Experts._own_slice); after it, moments the load brought whole (fp32: the stage file's AdamW state) are cut to
    this rank's slice too. Local."""
    try:
        yield
    finally:
        for m in _sharded(layers):
            group, n = m.ep
            per, r = m.experts // n, dist.get_rank(group)
            for p in (m.gate_up_proj, m.down_proj):
                state = optimizer.state.get(p, {}) if optimizer is not None else {}
                for k, v in list(state.items()):
                    if torch.is_tensor(v) and v.shape == (m.experts, *p.shape[1:]):
                        state[k] = v[r * per:(r + 1) * per].clone()


def clip_norm(params, shards, max_norm: float, mpu, ep_group) -> torch.Tensor:
    """Clip every gradient of `params` by the global norm of the whole model (see the module's docstring): `shards`
    the expert shards among them; returns the norm."""
    mine = {id(p) for p in shards}
    params = [p for p in params if p.grad is not None]
    rep = [p.grad.float().pow(2).sum() for p in params if id(p) not in mine and (
        mpu.get_model_parallel_rank() == 0 or getattr(p, "model_parallel", False))]
    # a shard replicated over SP (--sp: each SP rank holds its EP coordinate's experts whole) is counted on SP rank 0
    # only, as mark_norm_counting marks it (model_parallel False elsewhere); under --tp every TP rank's slice counts
    own = [p.grad.float().pow(2).sum() for p in params if id(p) in mine and getattr(p, "model_parallel", True)]
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


MOE_GROUP = "ep_size_{}"  # DeepSpeed's name for the expert groups of EP size N (deepspeed.utils.groups)


@contextlib.contextmanager
def deepspeed_moe(shards: list, ep: int, ep_group):
    """bf16: deepspeed.initialize inside this sees the shards as DeepSpeed MoE parameters in groups named
    ep_size_N (see the module's docstring). The engine finds MoE layers by class; Experts is counted as one for
    the call's duration."""
    from deepspeed.runtime import engine as ds_engine
    from deepspeed.utils import groups
    name = MOE_GROUP.format(ep)
    for p, edp_group in shards:
        p.allreduce, p.group_name = False, name  # deepspeed.moe.utils.is_moe_param
        groups._EXPERT_DATA_PARALLEL_GROUP[name] = edp_group
    groups._EXPERT_PARALLEL_GROUP[name] = ep_group
    moe_layer = ds_engine.MoE
    ds_engine.MoE = (moe_layer, Experts)
    try:
        yield
    finally:
        ds_engine.MoE = moe_layer


def install(engine, shards: list, dp: int, ep_group) -> None:
    """The engine's gradient reduction, clipping, checkpoint save and load made shard-aware (see the module's
    docstring)."""
    save, load = engine.save_checkpoint, engine.load_checkpoint
    # the whole module, not its forward_funcs: under DualPipeV those are the active phase's layers only, and the
    # save writes both phases' layer files (DualPipeVModule.save_state_dict)
    held = [engine.module]

    def save_checkpoint(*args, **kwargs):
        with gathered(held, engine.optimizer):
            return save(*args, **kwargs)

    def load_checkpoint(*args, **kwargs):
        with loading(held, engine.optimizer):
            return load(*args, **kwargs)

    engine.save_checkpoint, engine.load_checkpoint = save_checkpoint, load_checkpoint
    if engine.has_moe_layers:  # bf16, through DeepSpeed's MoE groups (deepspeed_moe)
        _install_bf16(engine)
    else:
        _install_fp32(engine, shards, dp, ep_group)


def _install_bf16(engine) -> None:
    from deepspeed.runtime.pipe.engine import MEMORY_OPT_ALLREDUCE_SIZE
    from deepspeed.utils import groups
    engine.has_moe_layers = False  # checkpoints: the pipeline's layer files, not DeepSpeed's per-expert ones
    # --tp: each TP rank's shards are its F / TP slices of its experts. DeepSpeed 0.19.8's norm of an MoE group
    # (runtime/utils.py get_global_norm_of_tensors, moe_ep_group set) sums the squares over the pipeline's stages
    # and the EP group only, unless expert tensor parallelism is on (groups.expert_tensor_parallel_world_size > 1):
    # then over the model-parallel group, stages x TP. Left at 1, each TP rank clipped by a norm holding its own
    # slices' experts (qwen3-vl MoE tiny, TP 2 x EP 2: the experts' norm 24-33% under the model's, the TP ranks'
    # global norms 7e-7 apart, so their replicated weights drifted apart). Nothing else DeepSpeed runs for
    # mmpipe reads it (only its own sharded_moe layers do).
    groups.expert_tensor_parallel_world_size = getattr(engine.module, "tp", 1)
    reduce = engine._bf16_reduce_grads

    def _bf16_reduce_grads():
        reduce()  # the replicated weights, over DP (the engine leaves the experts' out: has_moe_layers False)
        engine._reduce_expert_gradients(engine.optimizer.get_grads_for_reduction()[1], MEMORY_OPT_ALLREDUCE_SIZE)
    engine._bf16_reduce_grads = _bf16_reduce_grads


def _install_fp32(engine, shards: list, dp: int, ep_group) -> None:
    reduce = engine.allreduce_gradients

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

    def clip_fp32_gradients():  # fp32 and ZeRO 0 (mmpipe.run_config._check_ep)
        return clip_norm(engine.module.parameters(), [p for p, _ in shards], engine.gradient_clipping(), engine.mpu,
                         ep_group)

    engine.allreduce_gradients, engine.clip_fp32_gradients = allreduce_gradients, clip_fp32_gradients
