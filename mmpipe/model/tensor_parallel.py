"""Tensor parallelism inside the pipeline (issue 54, first slice): a family's split declared as data and applied
by one function, `parallelize`, to a layer built whole under its seed (so one device == TP by construction).

A family's plan (mmpipe.registry.Family.tp_plan) maps a layer class, or a tied head's forward_fn, to
{submodule name: mark}; a submodule not named stays whole on every TP rank (replicated). The marks:

    column      nn.Linear y = x W^T + b, W [out, in]: this rank keeps rows r*out/TP .. (r+1)*out/TP of W and b
                (Megatron's ColumnParallelLinear, output not gathered); its input enters the TP region
                (copy_to_tp: identity forward, gradient all-reduced backward). Heads are whole rows
                (q_proj [H*Dh, D], head h rows h*Dh .. (h+1)*Dh - 1), so a contiguous 1/TP of rows is
                H/TP whole heads, and a contiguous 1/TP of k_proj's rows the Hkv/TP kv heads those
                query heads read (kv head j serves query heads j*H/Hkv .. : query heads r*H/TP .. read
                kv heads r*Hkv/TP .., when TP divides Hkv; run_config refuses it where not)
    row         nn.Linear: this rank keeps columns r*in/TP .. of W; y = reduce_from_tp(x_r W_r^T) + b (the
                bias once, after the sum: Megatron's RowParallelLinear)
    vocab       nn.Embedding: rows r*V/TP .. of the table; an id outside them looks up zeros and the sum over
                the TP group (reduce_from_tp) is the full lookup. nn.Linear: a head's column split, its
                logits left as this rank's 1/TP of the vocabulary for the vocab-parallel loss
                (vocab_parallel_lm_loss). A function (a tied head's forward_fn, reading the embedding's
                vocab-split matrix): its first input enters the TP region
    kv          nn.Linear k_proj / v_proj of grouped-query attention, its kv head count the attribute the plan
                marks kv_heads in the same module: column when TP divides the kv heads; with fewer kv heads
                than TP ranks (TP a multiple of them) the weight stays whole on every rank and each rank uses
                the one kv head its query heads read, kv head r // (TP / Hkv) (e.g. 1 kv head, TP 2: both
                ranks head 0), as vLLM replicates them. Each rank's gradient of that weight is then its query
                heads' share, so it is summed over the TP group (a gradient hook): the whole weight's gradient,
                the same on every rank, as a replicated weight's must be
    heads       an attention module's query head count, named as "module.attribute" (self_attn.n_heads):
                divided by TP after the splits
    kv_heads    its kv head count ("self_attn.kv_heads"): divided by TP, or 1 where fewer than TP

Nothing in a layer asks whether TP is on: the split Linear / Embedding get this module's forwards.
"""
from __future__ import annotations

import functools
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

COLUMN, ROW, VOCAB, KV, REPLICATED = "column", "row", "vocab", "kv", "replicated"
HEADS, KV_HEADS = "heads", "kv_heads"  # marks of an attribute (a head count), not of a submodule
MARKS = (COLUMN, ROW, VOCAB, KV, REPLICATED, HEADS, KV_HEADS)


@dataclass(frozen=True)
class Shard:
    """This rank's place on the TP axis: its group (None: a single-process stand-in, no collective), its rank in it
    and the group's size."""
    group: object
    rank: int
    size: int


def _all_reduce(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    x = x.contiguous().clone()
    if shard.group is not None:
        dist.all_reduce(x, group=shard.group)
    return x


class _CopyToTP(torch.autograd.Function):
    """Entering the TP region: every rank holds the same x and uses it with its own slice of the weights, so
    the gradient of x is the sum of the ranks' partial gradients."""

    @staticmethod
    def forward(ctx, x, shard):
        ctx.shard = shard
        return x.view_as(x)

    @staticmethod
    def backward(ctx, grad):
        return _all_reduce(grad, ctx.shard), None


class _ReduceFromTP(torch.autograd.Function):
    """Leaving the TP region: the ranks' partial outputs summed; the sum's gradient is each part's."""

    @staticmethod
    def forward(ctx, x, shard):
        return _all_reduce(x, shard)

    @staticmethod
    def backward(ctx, grad):
        return grad, None


def copy_to_tp(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    return _CopyToTP.apply(x, shard)


def reduce_from_tp(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    return _ReduceFromTP.apply(x, shard)


def _slice(t: torch.Tensor, dim: int, shard: Shard) -> torch.Tensor:
    n = t.shape[dim]
    if n % shard.size:
        raise ValueError(f"tensor parallelism: {n} does not split into {shard.size} equal parts")
    step = n // shard.size
    return t.narrow(dim, shard.rank * step, step).clone()


def _keep(module: nn.Module, name: str, dim: int, shard: Shard) -> None:
    p = getattr(module, name)
    if p is not None:
        kept = nn.Parameter(_slice(p.data, dim, shard), requires_grad=p.requires_grad)
        kept.__dict__.update(p.__dict__)  # DeepSpeed's marks on it (a later tied copy's ds_pipe_replicated)
        kept.tp_split = dim  # counted on every TP rank in the gradient norm (mark_norm_counting)
        setattr(module, name, kept)


def _column_forward(self, x):
    return F.linear(copy_to_tp(x, self.tp_shard), self.weight, self.bias)


def _row_forward(self, x):
    y = reduce_from_tp(F.linear(x, self.weight), self.tp_shard)
    return y if self.bias is None else y + self.bias


def _vocab_embedding_forward(self, ids):
    start = self.tp_shard.rank * self.num_embeddings
    local = ids - start
    outside = (local < 0) | (local >= self.num_embeddings)
    emb = F.embedding(local.masked_fill(outside, 0), self.weight)
    return reduce_from_tp(emb.masked_fill(outside[..., None], 0.0), self.tp_shard)


def _kv_heads(layer: nn.Module, items: dict, linear: str) -> int:
    """The kv head count of the attention holding `linear` ("self_attn.k_proj"): its attribute the plan marks
    kv_heads ("self_attn.kv_heads")."""
    parent = linear.rpartition(".")[0]
    name = next(n for n, m in items.items() if m == KV_HEADS and n.rpartition(".")[0] == parent)
    return getattr(layer.get_submodule(parent), name.rpartition(".")[2])


def _one_kv_head_forward(self, x):
    y = F.linear(copy_to_tp(x, self.tp_shard), self.weight, self.bias)
    width = self.out_features // self.tp_kv_heads  # head_dim
    head = self.tp_shard.rank // (self.tp_shard.size // self.tp_kv_heads)
    return y.narrow(-1, head * width, width)


def _replicate_kv(module: nn.Linear, shard: Shard, kv_heads: int) -> None:
    """Fewer kv heads than TP ranks: the whole weight on every rank, this rank's kv head taken from its output, the
    gradient summed over the TP group (module docstring, kv)."""
    module.tp_kv_heads = kv_heads
    for p in module.parameters(recurse=False):
        p.register_hook(lambda g: _all_reduce(g, shard))
    module.tp_shard = shard
    module.forward = types.MethodType(_one_kv_head_forward, module)


def _split_module(module: nn.Module, mark: str, shard: Shard, where: str, kv_heads: int) -> None:
    if mark == REPLICATED:
        return
    if mark == KV and isinstance(module, nn.Linear) and kv_heads % shard.size:
        return _replicate_kv(module, shard, kv_heads)
    if isinstance(module, nn.Linear) and mark in (COLUMN, VOCAB, ROW, KV):
        if mark == ROW:
            _keep(module, "weight", 1, shard)
            forward = _row_forward
        else:
            _keep(module, "weight", 0, shard)
            _keep(module, "bias", 0, shard)
            forward = _column_forward
        module.in_features, module.out_features = module.weight.shape[1], module.weight.shape[0]
    elif isinstance(module, nn.Embedding) and mark == VOCAB:
        _keep(module, "weight", 0, shard)
        module.num_embeddings = module.weight.shape[0]
        forward = _vocab_embedding_forward
    else:
        raise ValueError(f"tensor-parallel plan: {where} is a {type(module).__name__}, which '{mark}' cannot split")
    module.tp_shard = shard
    module.forward = types.MethodType(forward, module)


def parallelize(layer, plan: dict, shard: Shard):
    """Split a built layer (an nn.Module) in place by its class's plan ({submodule name: mark}, "" the layer
    itself), keeping this rank's slice of each split weight, and return it; a tied head's forward_fn (a
    function, or DeepSpeed's functools.partial of it on the tied module) comes back wrapped so that its first
    input enters the TP region. A layer whose class the plan does not name is returned untouched (replicated)."""
    if isinstance(layer, functools.partial) and layer.func in plan:  # DeepSpeed's tied forward_fn on its module
        return functools.partial(_tp_head(layer.func, shard), *layer.args, **layer.keywords)
    if not isinstance(layer, nn.Module) or type(layer) not in plan:
        return layer
    items, modules, kind = plan[type(layer)], dict(layer.named_modules()), type(layer).__name__
    for name, mark in items.items():
        if mark not in MARKS:
            raise ValueError(f"tensor-parallel plan of {kind}: {name}: {mark!r} is not one of {MARKS}")
        if mark not in (HEADS, KV_HEADS) and name not in modules:
            raise ValueError(f"tensor-parallel plan of {kind}: it has no submodule {name!r}")
    for name, mark in items.items():  # the weights first: a kv split reads the whole model's kv head count
        if mark not in (HEADS, KV_HEADS):
            kv = _kv_heads(layer, items, name) if mark == KV else 0
            _split_module(modules[name], mark, shard, f"{kind}.{name}", kv)
    for name, mark in items.items():  # then the head counts become this rank's (1 kv head where fewer than TP)
        if mark in (HEADS, KV_HEADS):
            owner, _, attr = name.rpartition(".")
            setattr(modules[owner], attr, max(1, getattr(modules[owner], attr) // shard.size))
    return layer


def _tp_head(fn, shard: Shard):
    @functools.wraps(fn)
    def head(module, args):
        return fn(module, (copy_to_tp(args[0], shard), *args[1:]))
    return head


def split_dims(layer: nn.Module, plan: dict, tp: int) -> dict[str, int]:
    """{state-dict key: the dim it is split along} for a whole layer of a plan's class at `tp` ranks: what a TP
    checkpoint's shards are concatenated along (mmpipe.runtime.checkpoint.load_reference). A key not listed is
    whole in every shard."""
    dims, items = {}, plan.get(type(layer), {})
    for name, mark in items.items():
        if mark in (HEADS, KV_HEADS, REPLICATED) or mark == KV and _kv_heads(layer, items, name) % tp:
            continue  # a head count; a replicated module; fewer kv heads than ranks: whole on each
        module, prefix = (layer.get_submodule(name), f"{name}.") if name else (layer, "")
        if mark == ROW:
            dims[prefix + "weight"] = 1
        elif mark in (COLUMN, VOCAB, KV):
            dims[prefix + "weight"] = 0
            if isinstance(module, nn.Linear) and module.bias is not None:
                dims[prefix + "bias"] = 0
    return dims


def gather_state(shards: list[dict], dims: dict[str, int]) -> dict:
    """One layer's state dict from its TP shards (in TP rank order): split tensors concatenated, the others
    rank 0's (they are equal on every rank: replicated weights take the same gradients)."""
    return {k: torch.cat([s[k] for s in shards], dim=dims[k]) if k in dims else v for k, v in shards[0].items()}


def mark_norm_counting(params, shard_rank: int) -> None:
    """DeepSpeed 0.19.8's clip_grad_norm_ (runtime/utils.py) sums squared gradient norms over its "model parallel"
    group - for a pipeline, every rank of one data-parallel replica: all stages x all TP ranks - counting a
    parameter where it is marked model_parallel, or on that group's rank 0 (stage 0, TP rank 0). So that the
    global norm counts each parameter once: a TP slice (tp_split) is marked on every TP rank (the slices are
    disjoint), a replicated weight only on TP rank 0 (TP copies of it: TP x its square otherwise), a tied copy
    (ds_pipe_replicated, its first stage's kept) on no later stage, as at TP 1 (runtime/pipeline.py)."""
    for p in params:
        first_copy = not getattr(p, "ds_pipe_replicated", False)
        p.model_parallel = first_copy and (hasattr(p, "tp_split") or shard_rank == 0)


def vocab_parallel_ce(logits: torch.Tensor, labels: torch.Tensor, shard: Shard, vocab: int,
                      ignore_index: int) -> torch.Tensor:
    """Per-position cross-entropy [B, T] from this rank's 1/TP of the vocabulary's logits [B, T, V/TP] (rows
    r*V/TP ..), never holding the full row: DeepSpeed's own deepspeed.sequence.cross_entropy.
    vocab_parallel_cross_entropy (the torch backend: max, sum of exp and the label's logit all-reduced over the
    TP group; its backward softmax - onehot on this rank's slice, no collective). 0 at ignored positions."""
    from deepspeed.sequence.cross_entropy import vocab_parallel_cross_entropy
    local = logits.shape[-1]
    return vocab_parallel_cross_entropy(logits, labels, tp_group=shard.group, vocab_start_index=shard.rank * local,
                                        vocab_end_index=(shard.rank + 1) * local, global_vocab_size=vocab,
                                        ignore_index=ignore_index, reduction="none")


def vocab_parallel_lm_loss(shard: Shard, vocab: int):
    """(loss, eval_sum): mmpipe.model.builder's lm_loss and lm_loss_sum on vocab-split logits (vocab_parallel_ce),
    the same value on every TP rank: the labelled positions' mean, or their LossNorm-weighted sum, or the sum."""
    from .builder import IGNORE_INDEX
    from .moe import split_aux

    def ce(logits, labels):
        return vocab_parallel_ce(logits, labels, shard, vocab, IGNORE_INDEX)

    def loss(logits, labels):
        logits, aux = split_aux(logits)
        if aux is not None:
            return loss(logits, labels) + aux
        if isinstance(labels, (tuple, list)):
            labels, weights = labels
            return (ce(logits, labels) * weights).sum()
        return ce(logits, labels).sum() / (labels != IGNORE_INDEX).sum()

    def eval_sum(logits, labels):
        return ce(split_aux(logits)[0], labels).sum()
    return loss, eval_sum
