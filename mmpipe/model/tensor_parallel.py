"""Tensor parallelism inside the pipeline (issue 54, first slice): a family's split declared as data and applied
by one function, `parallelize`, to a layer built whole under its seed (so one device == TP by construction).

A family's plan (mmpipe.registry.Family.tp_plan) maps a layer class, or a tied head's forward_fn, to
{submodule name: mark}; a submodule not named stays whole on every TP rank (replicated). The marks:

    column      nn.Linear y = x W^T + b, W [out, in]: this rank keeps rows r*out/TP .. (r+1)*out/TP of W and b
                (Megatron's ColumnParallelLinear, output not gathered); its input enters the TP region
                (copy_to_tp: identity forward, gradient all-reduced backward), or entered it at an `entry` around it
                (below: one copy for every column linear reading the same input). Heads are whole rows
                (q_proj [H*Dh, D], head h rows h*Dh .. (h+1)*Dh - 1), so a contiguous 1/TP of rows is
                H/TP whole heads, and a contiguous 1/TP of k_proj's rows the Hkv/TP kv heads those
                query heads read (kv head j serves query heads j*H/Hkv .. : query heads r*H/TP .. read
                kv heads r*Hkv/TP .., when TP divides Hkv; run_config refuses it where not)
    row         nn.Linear: this rank keeps columns r*in/TP .. of W; y = reduce_from_tp(x_r W_r^T) + b (the
                bias once, after the sum: Megatron's RowParallelLinear)
    vocab       nn.Embedding: rows r*V/TP .. of the table; an id outside them looks up zeros and the sum over
                the TP group (reduce_from_tp) is the full lookup. nn.Linear: a head's column split, its
                logits left as this rank's 1/TP of the vocabulary for the vocab-parallel loss
                (mmpipe.model.objectives.vocab_parallel_lm_loss). A function (a tied head's forward_fn, reading
                the embedding's vocab-split matrix): its first input enters the TP region
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
    summed      a module whose weights every rank holds whole but applies to its own heads only (Qwen3's q / k
                RMSNorms over each head's width, Gated DeltaNet's gated norm): each rank's gradient is its heads'
                share, summed over the TP group (once a step, as a kv weight fewer than TP's), so the copies stay
                equal. Measured on qwen3-vl-tiny at TP 2 without it: q_norm's gradient off by 3.2e-3
    Fused(..)   column over a weight whose output rows stack parts [p0 | p1 | ..] (a fused projection): each part
                split as column, this rank keeping its 1/TP of each in order. FusedAttention's qkv, rows [3, H, Dh]:
                Fused(3), this rank's heads of q, of k and of v; Gated DeltaNet's in_proj_qkv and its depthwise
                conv1d, channels [q | k | v] of key_dim, key_dim, value_dim: Fused(("key_dim", "key_dim",
                "value_dim")), the widths read from the module holding them. An nn.Conv1d (depthwise, one channel
                per group) keeps its channels' slice; its channels and groups become this rank's
    entry       a module whose first input enters the TP region once (a forward pre-hook: copy_to_tp of it), for
                every column / kv linear inside it, which then reads it without a copy of its own: Megatron's one
                gradient all-reduce where a column region begins (an attention's q, k, v; a SwiGLU's gate, up; Gated
                DeltaNet's in_proj_*), not one per linear. Exact only on a module whose input reaches nothing but
                those linears (each rank's gradient of it then its heads' share, summed once): not an MoE MLP, whose
                replicated router reads it too (its experts and shared expert keep their own copies)
    {cls: ..}   a nested plan: the submodule is split by the entries of its own class (a block whose MLP is SwiGLU
                or fc1 / fc2 by config), names relative to it
    Own(..)     a module that is none of the above (an MoE block's fused 3-D experts): the mark's split(module, shard)
                keeps its slices and gives it its forward, its dims(module) says what split_dims reports for it

A mark column on an nn.Parameter (not a module: Gated DeltaNet's per-value-head dt_bias, A_log [Hv]) keeps its
rows r*n/TP ..: per-head values of the heads this rank holds. A plan's SIZES key (not a class) is a function
cfg -> ((what, count), ..): the counts beyond the decoder's heads / vocabulary / FFN width that TP must divide
(a split tower's heads and MLP width; Gated DeltaNet's key and value heads), refused in one line before launch
(mmpipe.run_config, tp_sizes).

A plan's SEQUENCE key (not a class) is Megatron's sequence parallelism (`--sequence-parallel`): {layer class or
tied head function: SCATTER or POSITIONS}, the layers of the region where each TP rank holds 1/TP of the row's
positions (rank r: positions r*L/TP .. (r+1)*L/TP - 1 of a row of L, dim 1 of [B, L, D]) instead of the whole row:

    SCATTER     the decoder embedding: its output hidden (the vocab lookup's all-reduce, the images placed: the whole
                row on every rank) leaves split, this rank's positions (Megatron's scatter_to_sequence_parallel_region:
                the slice forward, an all-gather of the row's gradient backward, so the vocab table and the tower
                see every position's gradient), and so does any per-position float field it makes (Gemma 4's
                per-layer inputs)
    POSITIONS   a layer on this rank's positions (the decoder blocks, the final norm, the head): the same marks, with
                each edge of its TP regions moved: an entry (an `entry` module, a column / kv linear's own copy, a
                vocab head's input) all-gathers the row (its backward a reduce-scatter of the gradient), where
                without SP it copied the whole row in (backward all-reduce); a row linear's partial outputs are
                reduce-scattered to this rank's positions (backward an all-gather), where they were all-reduced.
                A ring all-reduce is a reduce-scatter then an all-gather, so the bytes are the same: 2 (TP - 1) / TP
                x [B, L, D] each way a region. The column linears behind an entry keep this rank's positions for
                their weight gradients, not the gathered row, and gather it again backward, once for all of them
                (_GatheredLinear: one all-gather more a region, Megatron's trade), so the region's input is kept
                at 1/TP too. Its parameters left whole (the norms, a row linear's bias) see only
                this rank's positions: their gradients are summed over TP once a step (below)

Attention, its mask and rotary run inside the TP region on the gathered row, as without SP: they read the whole row's
integer tensors (segments, positions), which every rank holds. A stage boundary inside the region sends [B, L/TP, D]
from each TP rank to the same TP rank of the next stage. Layers outside it (the tower, projector, mergers) run as
under TP alone. The whole-row sums (`summed` weights, kv weights fewer than TP, under SP the POSITIONS layers'
replicated weights, an entered column linear's LoRA A) are marked `tp_summed` and summed over the TP group once a
step in buckets (`sum_gradients_at_step`), not by a hook per backward.

Nothing in a layer asks whether TP is on: the split Linear / Embedding get this module's forwards.
"""
from __future__ import annotations

import contextlib
import dataclasses
import functools
import types
from dataclasses import dataclass

import torch
import torch.distributed as dist
import torch.nn.functional as F
from torch import nn

COLUMN, ROW, VOCAB, KV, REPLICATED, SUMMED = "column", "row", "vocab", "kv", "replicated", "summed"
ENTRY = "entry"  # a module whose input enters the TP region once for the column linears inside it
HEADS, KV_HEADS = "heads", "kv_heads"  # marks of an attribute (a head count), not of a submodule
MARKS = (COLUMN, ROW, VOCAB, KV, REPLICATED, SUMMED, HEADS, KV_HEADS, ENTRY)
SIZES = "sizes"  # a plan's key beside its classes: cfg -> ((what, count), ..) that TP must divide
SEQUENCE = "sequence"  # a plan's key: {layer class / head function: SCATTER or POSITIONS} (--sequence-parallel)
SCATTER, POSITIONS, ADDS = "scatter", "positions", "adds"
# a plan's key: {stage field name: (cfg, tp) -> its floats a position on one TP rank}, for a carried per-position field
# that holds the rank's heads (Gemma 4's K/V: its kv heads), so that the planner counts what each rank carries
CARRIED = "carried"


@dataclass(frozen=True)
class Fused:
    """The mark of a fused projection (module docstring): parts, an int (that many equal parts) or the names of the
    attributes of the module holding the weight that give each part's width."""
    parts: int | tuple[str, ...]

    def sizes(self, owner: nn.Module, n: int) -> list[int]:
        if isinstance(self.parts, int):
            return [n // self.parts] * self.parts
        return [getattr(owner, a) for a in self.parts]


@dataclass(frozen=True)
class Own:
    """The mark of a module the plan's own function splits (module docstring): split(module, shard) in place;
    dims(module) -> {parameter name: dim, or (dim, whole part widths)} of the whole module, as split_dims gives."""
    split: object
    dims: object


@dataclass(frozen=True)
class Shard:
    """This rank's place on the TP axis: its group (None: a single-process stand-in, no collective), its rank in it
    and the group's size; sequence: --sequence-parallel (given to parallelize: the plan's SEQUENCE layers hold 1/TP of
    the row's positions; on a split module: its TP region's edges gather / reduce-scatter positions)."""
    group: object
    rank: int
    size: int
    sequence: bool = False


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


def _all_gather(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """[B, L/TP, ..] of each rank -> [B, L, ..], the ranks' positions in rank order (the group's collective runs on
    dim 0: positions moved there). A single-process stand-in (group None) repeats its own slice (shapes only)."""
    if shard.group is None:
        return torch.cat([x] * shard.size, 1)
    x = x.transpose(0, 1).contiguous()
    out = x.new_empty((x.shape[0] * shard.size, *x.shape[1:]))
    dist.all_gather_into_tensor(out, x, group=shard.group)
    return out.transpose(0, 1).contiguous()


def _reduce_scatter(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """[B, L, ..] of each rank -> [B, L/TP, ..]: this rank's positions of the ranks' sum."""
    if shard.size > 1 and x.shape[1] % shard.size:
        raise ValueError(f"sequence parallelism: a row of {x.shape[1]} positions does not split into {shard.size} "
                         f"equal slices (run_config refuses such a run before launch)")
    if shard.group is None:
        return x.narrow(1, shard.rank * x.shape[1] // shard.size, x.shape[1] // shard.size).clone()
    x = x.transpose(0, 1).contiguous()
    out = x.new_empty((x.shape[0] // shard.size, *x.shape[1:]))
    dist.reduce_scatter_tensor(out, x, group=shard.group)
    return out.transpose(0, 1).contiguous()


def _positions(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    n = x.shape[1] // shard.size
    if x.shape[1] % shard.size:
        raise ValueError(f"sequence parallelism: a row of {x.shape[1]} positions does not split into {shard.size} "
                         f"equal slices (run_config refuses such a run before launch)")
    return x.narrow(1, shard.rank * n, n)


class _GatherPositions(torch.autograd.Function):
    """Entering a TP region under SP: the row gathered from the ranks' positions; every rank's gradient of the whole
    row is its heads' share, so this rank's positions take the sum over the ranks (a reduce-scatter)."""

    @staticmethod
    def forward(ctx, x, shard):
        ctx.shard = shard
        return _all_gather(x, shard)

    @staticmethod
    def backward(ctx, grad):
        return _reduce_scatter(grad, ctx.shard), None


class _ReduceScatterPositions(torch.autograd.Function):
    """Leaving a TP region under SP: the partial outputs summed, each rank keeping its positions; the gradient of the
    sum at every position is the whole row's, gathered."""

    @staticmethod
    def forward(ctx, x, shard):
        ctx.shard = shard
        return _reduce_scatter(x, shard)

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.shard), None


class _ScatterPositions(torch.autograd.Function):
    """The whole row (the same on every rank) -> this rank's positions; backward the row's gradient gathered."""

    @staticmethod
    def forward(ctx, x, shard):
        ctx.shard = shard
        return _positions(x, shard).clone()

    @staticmethod
    def backward(ctx, grad):
        return _all_gather(grad, ctx.shard), None


def enter_tp(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """An input entering a TP region: copied (the whole row on each rank) or, under SP, gathered from the positions."""
    return _GatherPositions.apply(x, shard) if shard.sequence else _CopyToTP.apply(x, shard)


def enter_tp_ids(ids: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Integers entering a TP region beside its input (an MoE router's top-k ids): as they are, or under SP gathered
    from the positions as enter_tp gathers the input (no gradient)."""
    return _all_gather(ids, shard) if shard.sequence else ids


def leave_tp(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """Partial outputs leaving a TP region: all-reduced or, under SP, reduce-scattered to this rank's positions."""
    return _ReduceScatterPositions.apply(x, shard) if shard.sequence else _ReduceFromTP.apply(x, shard)


def scatter_positions(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    return _ScatterPositions.apply(x, shard)


def _slice(t: torch.Tensor, dim: int, shard: Shard) -> torch.Tensor:
    n = t.shape[dim]
    if n % shard.size:
        raise ValueError(f"tensor parallelism: {n} does not split into {shard.size} equal parts")
    step = n // shard.size
    return t.narrow(dim, shard.rank * step, step).clone()


def _slice_parts(t: torch.Tensor, dim: int, sizes: list[int] | None, shard: Shard) -> torch.Tensor:
    """A fused weight's slice: this rank's 1/TP of each part along dim, in order (sizes None: one part)."""
    if sizes is None:
        return _slice(t, dim, shard)
    if sum(sizes) != t.shape[dim]:
        raise ValueError(f"tensor parallelism: parts {sizes} do not make up the {t.shape[dim]} rows of a fused weight")
    return torch.cat([_slice(part, dim, shard) for part in t.split(sizes, dim)], dim)


def _keep(module: nn.Module, name: str, dim: int, shard: Shard, sizes: list[int] | None = None) -> None:
    p = getattr(module, name)
    if p is not None:
        kept = nn.Parameter(_slice_parts(p.data, dim, sizes, shard), requires_grad=p.requires_grad)
        kept.__dict__.update(p.__dict__)  # DeepSpeed's marks on it (a later tied copy's ds_pipe_replicated)
        kept.tp_split = dim  # counted on every TP rank in the gradient norm (mark_norm_counting)
        setattr(module, name, kept)


def _entered(module: nn.Module, x: torch.Tensor) -> torch.Tensor:
    """A column linear's input in the TP region: as it is where an entry module copied it in (tp_entered), else
    copied here."""
    return x if getattr(module, "tp_entered", False) else enter_tp(x, module.tp_shard)


def _linear(x: torch.Tensor, weight: torch.Tensor, bias) -> torch.Tensor:
    """F.linear, or on a row an entry gathered under SP (its tp_row token) the linear that keeps the rank's positions
    for its backward instead of the row (_GatheredLinear)."""
    token = getattr(x, "tp_row", None)
    return F.linear(x, weight, bias) if token is None else _GatheredLinear.apply(x, weight, bias, token)


def _local(module: nn.Linear, x: torch.Tensor, bias: bool = True) -> torch.Tensor:
    """A split linear's own matmul, between its collectives: x W^T (+ b), or what a split-backward schedule put in
    its place (module.tp_local(x, bias): mmpipe.runtime.schedule defers its weight gradient from B to W; the copy /
    all-reduce / gather / reduce-scatter around it stay where they are, so the deferred g^T x reads this rank's x and
    g)."""
    if module.tp_local is not None:  # every linear _split_module split has the attribute (None unless deferred)
        return module.tp_local(x, bias)
    return _linear(x, module.weight, module.bias if bias else None)


def gathered_rows(token: _Row) -> torch.Tensor:
    """The row an entry gathered under SP, gathered again from this rank's positions (a split-backward schedule's W:
    its deferred weight gradients read the row, which the forward did not keep)."""
    return _all_gather(token.local.detach(), token.shard)


class _Row:
    """The row an entry gathered under SP, for the backward of the linears reading it: its positions (local) and, once
    the first of them asks, the row re-gathered, kept until the last of them (users) has used it."""

    def __init__(self, local: torch.Tensor, shard: Shard):
        self.local, self.shard, self.users, self.row = local, shard, 0, None

    def gathered(self) -> torch.Tensor:
        row = self.row if self.row is not None else _all_gather(self.local.detach(), self.shard)
        self.users -= 1
        self.row = row if self.users > 0 else None
        return row


class _GatheredLinear(torch.autograd.Function):
    """y = x W^T + b on the gathered row x, saving this rank's positions [B, L / TP, D] rather than x [B, L, D]: the
    weight's gradient gathers them again (once per entry for all its linears: an all-gather more a region backward),
    Megatron's trade under sequence parallelism (its linear with async communication re-gathers the input), so the
    region's input is kept at 1/TP like the norms around it. The input's gradient g W needs no x."""

    @staticmethod
    def forward(ctx, x, weight, bias, token):
        ctx.save_for_backward(token.local, weight)
        ctx.token, ctx.has_bias = token, bias is not None
        token.users += 1
        return F.linear(x, weight, bias)

    @staticmethod
    def backward(ctx, grad):
        _, weight = ctx.saved_tensors
        row = ctx.token.gathered()
        g = grad.reshape(-1, grad.shape[-1])
        grad_w = g.t() @ row.reshape(-1, row.shape[-1]) if ctx.needs_input_grad[1] else None
        grad_b = g.sum(0) if ctx.has_bias and ctx.needs_input_grad[2] else None
        return grad @ weight, grad_w, grad_b, None


def _column_forward(self, x):
    return _local(self, _entered(self, x))


def _row_forward(self, x):
    y = leave_tp(_local(self, x, bias=False), self.tp_shard)
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
    y = _local(self, _entered(self, x))
    width = self.out_features // self.tp_kv_heads  # head_dim
    head = self.tp_shard.rank // (self.tp_shard.size // self.tp_kv_heads)
    return y.narrow(-1, head * width, width)


def _sum_gradients(module: nn.Module, shard: Shard) -> None:
    """Each of the module's own parameters' gradient to be summed over the TP group once a step (module docstring,
    summed; sum_gradients_at_step)."""
    for p in module.parameters(recurse=False):
        p.tp_summed = True


def _replicate_kv(module: nn.Linear, shard: Shard, kv_heads: int) -> None:
    """Fewer kv heads than TP ranks: the whole weight on every rank, this rank's kv head taken from its output, the
    gradient summed over the TP group (module docstring, kv)."""
    module.tp_kv_heads, module.tp_mark = kv_heads, KV  # tp_mark: how an adapter on it splits (adapters_split)
    _sum_gradients(module, shard)
    module.tp_shard, module.tp_local = shard, None  # tp_local: _local
    module.forward = types.MethodType(_one_kv_head_forward, module)


def _split_module(module: nn.Module, mark, shard: Shard, where: str, kv_heads: int, sizes=None) -> None:
    """Split one submodule by its mark (sizes: a Fused mark's part widths)."""
    if mark in (REPLICATED, ENTRY):  # an entry: parallelize's last pass (_enter)
        return
    if mark == SUMMED:
        return _sum_gradients(module, shard)
    if mark == KV and isinstance(module, nn.Linear) and kv_heads % shard.size:
        return _replicate_kv(module, shard, kv_heads)
    fused = isinstance(mark, Fused)
    if isinstance(module, nn.Linear) and (fused or mark in (COLUMN, VOCAB, ROW, KV)):
        # what an adapter on it splits by, its whole sizes and part widths (adapters_split)
        module.tp_mark, module.tp_sizes = ROW if mark == ROW else VOCAB if mark == VOCAB else COLUMN, sizes
        module.tp_whole = module.in_features, module.out_features
        if mark == ROW:
            _keep(module, "weight", 1, shard)
            forward = _row_forward
        else:
            _keep(module, "weight", 0, shard, sizes)
            _keep(module, "bias", 0, shard, sizes)
            forward = _column_forward
        module.in_features, module.out_features = module.weight.shape[1], module.weight.shape[0]
    elif isinstance(module, nn.Embedding) and mark == VOCAB:
        _keep(module, "weight", 0, shard)
        module.num_embeddings = module.weight.shape[0]
        forward = _vocab_embedding_forward
    elif isinstance(module, nn.Conv1d) and (fused or mark == COLUMN) and module.groups == module.in_channels:
        _keep(module, "weight", 0, shard, sizes)  # depthwise: each channel its own filter, no collective
        _keep(module, "bias", 0, shard, sizes)
        module.in_channels = module.out_channels = module.groups = module.weight.shape[0]
        return
    else:
        raise ValueError(f"tensor-parallel plan: {where} is a {type(module).__name__}, which '{mark}' cannot split")
    module.tp_shard, module.tp_local = shard, None  # tp_local: _local (set by a split-backward schedule)
    module.forward = types.MethodType(forward, module)


def _entries(layer: nn.Module, items: dict, kind: str) -> dict:
    """A layer's {name: mark} with each nested plan ({class: items}) replaced by the entries of the submodule's own
    class, named from the layer."""
    out = {}
    for name, mark in items.items():
        if not isinstance(mark, dict):
            out[name] = mark
            continue
        sub = layer.get_submodule(name)
        if type(sub) not in mark:
            raise ValueError(f"tensor-parallel plan of {kind}: {name} is a {type(sub).__name__}, which its nested "
                             f"plan does not name")
        out.update({f"{name}.{k}" if k else name: v for k, v in _entries(sub, mark[type(sub)], kind).items()})
    return out


def _get(layer: nn.Module, name: str):
    """The submodule ("" the layer itself) or the parameter a plan's name points to, else None."""
    modules = dict(layer.named_modules())
    return modules[name] if name in modules else dict(layer.named_parameters()).get(name)


def _target(layer: nn.Module, name: str):
    """(owner module, attribute) of a plan's name: "" the layer itself, "a.b" attribute b of submodule a."""
    owner, _, attr = name.rpartition(".")
    return layer.get_submodule(owner), attr


def _split(layer: nn.Module, items: dict, name: str, mark, shard: Shard, kind: str) -> None:
    """Split the module or the parameter `name` of a layer (not a head count)."""
    (owner, attr), target = _target(layer, name), _get(layer, name)
    if isinstance(mark, Own):
        return mark.split(target, shard)
    sizes = mark.sizes(owner, target.weight.shape[0]) if isinstance(mark, Fused) else None
    if isinstance(target, nn.Parameter):
        if mark != COLUMN:
            raise ValueError(f"tensor-parallel plan of {kind}: {name} is a parameter, which only 'column' splits")
        return _keep(owner, attr, 0, shard)
    kv = _kv_heads(layer, items, name) if mark == KV else 0
    _split_module(target, mark, shard, f"{kind}.{name}", kv, sizes)


def _resolve(layer: nn.Module, plan: dict) -> dict:
    """The layer's {name: mark}, nested plans expanded, every name and mark checked."""
    kind = type(layer).__name__
    entries = plan[type(layer)]  # or a function of the built layer: submodules the config decides (Gemma 4's v_proj)
    items = _entries(layer, entries(layer) if callable(entries) else entries, kind)
    for name, mark in items.items():
        if not isinstance(mark, (Fused, Own)) and mark not in MARKS:
            raise ValueError(f"tensor-parallel plan of {kind}: {name}: {mark!r} is not one of {MARKS}, a Fused or "
                             f"an Own")
        if mark not in (HEADS, KV_HEADS) and _get(layer, name) is None:
            raise ValueError(f"tensor-parallel plan of {kind}: it has no submodule or parameter {name!r}")
    return items


def parallelize(layer, plan: dict, shard: Shard):
    """Split a built layer (an nn.Module) in place by its class's plan ({submodule name: mark}, "" the layer
    itself), keeping this rank's slice of each split weight, and return it; a tied head's forward_fn (a
    function, or DeepSpeed's functools.partial of it on the tied module) comes back wrapped so that its first
    input enters the TP region. A layer whose class the plan does not name is returned untouched (replicated).
    Under shard.sequence, the plan's SEQUENCE role of the layer (module docstring) moves its TP regions' edges."""
    # DeepSpeed's tied forward_fn on its module: a function, or an instance of a class the plan names (TiedMoeHead)
    if isinstance(layer, functools.partial) and (layer.func in plan or type(layer.func) in plan):
        fn = layer.func
        here = _sequence_shard(plan, fn if fn in plan else type(fn), shard)
        return functools.partial(_tp_head(fn, here), *layer.args, **layer.keywords)
    if not isinstance(layer, nn.Module):
        return layer
    here = _sequence_shard(plan, type(layer), shard)
    if type(layer) in plan:
        _split_layer(layer, plan, here)
    role = plan.get(SEQUENCE, {}).get(type(layer)) if shard.sequence else None
    if role == POSITIONS:  # its whole weights see this rank's positions only: summed over TP once a step
        for p in layer.parameters():
            if not hasattr(p, "tp_split"):
                p.tp_summed = True
    elif role == SCATTER:
        layer.forward = _scattered(layer, layer.forward, dataclasses.replace(shard, sequence=False))
    elif role == ADDS:
        layer.forward = _added(layer, layer.forward, dataclasses.replace(shard, sequence=False))
    _mark_inputs(layer, here)
    return layer


def _mark_inputs(layer: nn.Module, shard: Shard) -> None:
    """Each linear's input as a part of the single device's (input_split: ((dim, rank, parts), ..)), what a LoRA
    adapter's dropout mask on it is cut from (mmpipe.model.lora.SplitDropout): a row linear reads the feature slice
    [.., r D / TP : (r + 1) D / TP] (dim -1); in a POSITIONS layer under --sequence-parallel (shard.sequence) a linear
    outside the TP region (a replicated one: an MoE router; a column linear not behind an entry, whose own copy
    gathers after the adapter reads x) reads this rank's positions (dim 1); an entered column / kv linear reads the
    gathered row and a replicated one outside SP the whole input: the whole mask, the same on every rank. tp_sequence:
    an adapter on it reads positions somewhere (its input or a row base's reduce-scattered A x), so its whole weights
    are summed over TP once a step (adapters_split)."""
    for m in layer.modules():
        if isinstance(m, nn.Linear):
            row, entered = getattr(m, "tp_mark", None) == ROW, getattr(m, "tp_entered", False)
            m.input_split = (((-1, shard.rank, shard.size),) if row else
                             ((1, shard.rank, shard.size),) if shard.sequence and not entered else ())
            m.tp_sequence = shard.sequence


def _sequence_shard(plan: dict, key, shard: Shard) -> Shard:
    """The shard a layer's split modules take: sequence only for a POSITIONS layer of the plan's SEQUENCE."""
    on = shard.sequence and plan.get(SEQUENCE, {}).get(key) == POSITIONS
    return shard if on == shard.sequence else dataclasses.replace(shard, sequence=on)


def _scattered(layer: nn.Module, forward, shard: Shard):
    """A SCATTER layer's forward: its output tuple's hidden (the whole row) leaves as this rank's positions, and so
    does every other float field it makes sized by the row (StageField.per_position: Gemma 4's per-layer inputs
    [B, L, n_layers x P], which each block adds to its positions)."""
    from .stage import unpack_out

    def scattered(args):
        t = unpack_out(layer, forward(args))
        rows = [f.name for f in layer.__dict__.get("stage_out", ()) if f.floating and f.per_position]
        fields = {n: scatter_positions(getattr(t, n), shard) for n in rows if getattr(t, n) is not None}
        return t._replace(hidden=scatter_positions(t.hidden, shard), **fields).pack()
    return scattered


def _added(layer: nn.Module, forward, shard: Shard):
    """An ADDS layer's forward: its whole-row term (its forward on a zero row [B, L, D]) scattered and added to this
    rank's positions; the other fields as its own output has them (a DeepStack set dropped)."""
    from .stage import unpack_in, unpack_out

    def added(args):
        t = unpack_in(layer, args)
        B, _, D = t.hidden.shape
        row = t.hidden.new_zeros(B, t.input_ids.shape[1], D)
        out = unpack_out(layer, forward(t._replace(hidden=row).pack()))
        return out._replace(hidden=t.hidden + scatter_positions(out.hidden, shard)).pack()
    return added


def sequence_roles(layers) -> list[str]:
    """Why --sequence-parallel cannot run a layer list under a plan ([] where it can): each layer from the first
    SCATTER on (the decoder, the final norm, the head) must have a SEQUENCE role; layers is ((name, role), ..) in
    order, role None where the plan's SEQUENCE has none."""
    roles = [role for _, role in layers]
    if SCATTER not in roles:
        return ["its plan has no sequence-parallel form (no SEQUENCE entry scatters the decoder's row)"]
    after = layers[roles.index(SCATTER) + 1:]
    return [f"{name} has no sequence-parallel form" for name in dict.fromkeys(n for n, r in after if r is None)]


def _split_layer(layer: nn.Module, plan: dict, shard: Shard) -> None:
    items, kind = _resolve(layer, plan), type(layer).__name__
    for name, mark in items.items():  # the weights first: a kv split reads the whole model's kv head count
        if mark not in (HEADS, KV_HEADS):
            _split(layer, items, name, mark, shard, kind)
    for name, mark in items.items():  # then the head counts become this rank's (1 kv head where fewer than TP)
        if mark in (HEADS, KV_HEADS):
            owner, attr = _target(layer, name)
            setattr(owner, attr, max(1, getattr(owner, attr) // shard.size))
        elif mark == ENTRY:
            _enter(layer.get_submodule(name), shard)


def _entry_hook(shard: Shard, module: nn.Module, args: tuple) -> tuple:
    x = enter_tp(args[0], shard)
    if shard.sequence:  # its linears keep the positions, not the row (_GatheredLinear)
        x.tp_row = _Row(args[0], shard)
    return (x, *args[1:])


def _enter(module: nn.Module, shard: Shard) -> None:
    """An entry (module docstring): its first input copied into the TP region once, the column / kv linears inside
    it (split before this) reading it as it is. Their input gradients are each rank's share; copy_to_tp's
    backward sums them over the ranks once, as each linear's own copy did one by one (sum is linear:
    sum_r (gq_r + gk_r + gv_r) = sum_r gq_r + sum_r gk_r + sum_r gv_r)."""
    module.register_forward_pre_hook(functools.partial(_entry_hook, shard))
    for m in module.modules():
        if isinstance(m, nn.Linear) and getattr(m, "tp_mark", None) in (COLUMN, KV):
            m.tp_entered = True


@contextlib.contextmanager
def adapters_split(layer: nn.Module):
    """--lora on a layer whose linears this rank split (mmpipe.model.lora.add_adapters injects peft's adapters inside
    it). peft sizes an adapter by its linear's in_features / out_features: inside, those are the whole linear's, so
    A [r, in] and B [out, r] draw under the layer's adapter seed exactly what the whole model's draw; after, this
    rank keeps its slices, by Megatron's and peft's convention for a split base (peft.tuners.lora.tp_layer):
      column (q / k / v, gate / up, a fused qkv: B's rows split part by part as the base's): A whole on every rank,
        B split by rows, its input entering the TP region (copy_to_tp): the gradient of A x is summed over TP
        there, so A's gradient, and x's through A, are the whole ones on every rank, with no hook
      row (o, down): A split by columns as the base, its partial products summed over TP (reduce_from_tp); B whole,
        its input and its output's gradient the same on every rank, so its gradient is the whole one
      kv whole on every rank (fewer kv heads than TP ranks): B whole and narrowed to this rank's kv head as the base,
        its gradient summed over TP (each rank's is its query heads' share); A as for column.
      a column / kv base inside an entry (its input copied in once for the module, tp_entered): B reads A x without
        a copy (x's gradient through A is then this rank's share, summed at the entry with the base's), so A's
        gradient, each rank's share, is summed over TP by a gradient hook ([r, in] per adapter, not [N, r]).
      under --sequence-parallel an adapter that reads positions (a row base's B reads the reduce-scattered A x; a
        replicated or non-entered linear's A reads x itself: _mark_inputs) has its whole weights summed over TP once
        a step (tp_summed), as the POSITIONS layer's own whole weights.
    A layer with no split linear (the reference, TP 1) is untouched."""
    split = [m for m in layer.modules() if isinstance(m, nn.Linear) and hasattr(m, "tp_mark")]
    local = {m: (m.in_features, m.out_features) for m in split}
    for m in split:
        m.in_features, m.out_features = m.tp_whole if m.tp_mark != KV else local[m]
    try:
        yield
    finally:
        for m, sizes in local.items():
            m.in_features, m.out_features = sizes
    for adapted in list(layer.modules()):
        if getattr(adapted, "base_layer", None) in local:
            _split_adapter(adapted, adapted.base_layer)
        if getattr(getattr(adapted, "base_layer", None), "tp_sequence", False):  # reads positions (_mark_inputs)
            for name, p in adapted.named_parameters():
                if ".lora_" in f".{name}" and not hasattr(p, "tp_split"):
                    p.tp_summed = True


def _split_adapter(adapted: nn.Module, base: nn.Linear) -> None:
    """One peft LoRA layer's adapters split as its base linear was (adapters_split)."""
    if base.tp_mark == VOCAB:
        raise ValueError("tensor parallelism: a LoRA adapter on a vocab-split head is not supported")
    for name in adapted.lora_A:
        a, b = adapted.lora_A[name], adapted.lora_B[name]
        if base.tp_mark == ROW:
            _split_module(a, ROW, base.tp_shard, f"{name}.lora_A", 0)
        elif base.tp_mark == KV:
            _replicate_kv(b, base.tp_shard, base.tp_kv_heads)
        else:
            _split_module(b, COLUMN, base.tp_shard, f"{name}.lora_B", 0, base.tp_sizes)
        if base.tp_mark != ROW and getattr(base, "tp_entered", False):
            b.tp_entered = True
            _sum_gradients(a, base.tp_shard)


def tp_sizes(cfg, plan: dict) -> tuple:
    """The counts beyond the decoder's own that TP must divide (the plan's SIZES, module docstring): ((what, n), ..)."""
    return tuple(plan[SIZES](cfg)) if SIZES in plan else ()


def _tp_head(fn, shard: Shard):
    @functools.wraps(fn)
    def head(module, args):
        return fn(module, (enter_tp(args[0], shard), *args[1:]))
    return head


def split_dims(layer: nn.Module, plan: dict, tp: int) -> dict:
    """{state-dict key: the dim it is split along, or (dim, the whole part widths) for a fused weight} for a whole
    layer of a plan's class at `tp` ranks: what a TP checkpoint's shards are concatenated along
    (mmpipe.runtime.checkpoint.load_reference). A key not listed is whole in every shard."""
    if type(layer) not in plan:
        return {}
    dims, items = {}, _resolve(layer, plan)
    for name, mark in items.items():
        if mark in (HEADS, KV_HEADS, REPLICATED, SUMMED, ENTRY) or mark == KV and _kv_heads(layer, items, name) % tp:
            continue  # a head count; a replicated module; fewer kv heads than ranks: whole on each
        (owner, _), target = _target(layer, name), _get(layer, name)
        if isinstance(target, nn.Parameter):
            dims[name] = 0
            continue
        prefix = f"{name}." if name else ""
        if isinstance(mark, Own):
            dims.update({prefix + k: d for k, d in mark.dims(target).items()})
            continue
        sizes = mark.sizes(owner, target.weight.shape[0]) if isinstance(mark, Fused) else None
        adapters = getattr(target, "lora_A", {})  # a linear under peft's adapters (--lora): its base_layer split
        if adapters:
            target, prefix = target.base_layer, f"{prefix}base_layer."
        if mark == ROW:
            dims[prefix + "weight"] = 1
        else:
            dims[prefix + "weight"] = (0, tuple(sizes)) if sizes else 0
            if isinstance(target, (nn.Linear, nn.Conv1d)) and target.bias is not None:
                dims[prefix + "bias"] = dims[prefix + "weight"]
        for a in adapters:  # a row base's A split by columns, a column base's B by rows as its weight (adapters_split)
            dims[f"{name}.lora_A.{a}.weight" if mark == ROW else f"{name}.lora_B.{a}.weight"] = dims[prefix + "weight"]
    return dims


def _cat(tensors: list[torch.Tensor], dim) -> torch.Tensor:
    """The whole tensor from its TP slices: along dim, or for a fused weight ((dim, part widths)) part by part."""
    if isinstance(dim, int):
        return torch.cat(tensors, dim=dim)
    d, sizes = dim
    local = [n // len(tensors) for n in sizes]
    return torch.cat([torch.cat(parts, dim=d) for parts in zip(*(t.split(local, d) for t in tensors))], dim=d)


def gather_state(shards: list[dict], dims: dict) -> dict:
    """One layer's state dict from its TP shards (in TP rank order): split tensors concatenated, the others
    rank 0's (they are equal on every rank: replicated weights take the same gradients)."""
    return {k: _cat([s[k] for s in shards], dims[k]) if k in dims else v for k, v in shards[0].items()}


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


# DeepSpeed's own bucket for the pipeline engine's DP all-reduce (MEMORY_OPT_ALLREDUCE_SIZE, elements)
BUCKET = 500_000_000


def sum_gradients(params, shard: Shard, bucket: int = BUCKET) -> int:
    """Each trained parameter's accumulated gradient (p.grad: fp32 at ZeRO 0, the layout --sp trains) summed over the
    SP group in place, flattened into buckets of up to `bucket` elements per dtype: one all-reduce per bucket, not one
    per parameter. A missing gradient counts as zeros (as DeepSpeed's DP reduction does), so every SP rank sends
    buckets of the same sizes. Returns the number of all-reduces."""
    for p in params:
        if p.grad is None:
            p.grad = torch.zeros_like(p)
    return sum_tensors([p.grad for p in params], shard, bucket)


def sum_tensors(tensors, shard: Shard, bucket: int = BUCKET) -> int:
    """`tensors` summed over the shard's group in place, in buckets of up to `bucket` elements per dtype (one
    all-reduce each); the number of all-reduces."""
    from torch._utils import _flatten_dense_tensors, _unflatten_dense_tensors
    grads: dict[torch.dtype, list[list[torch.Tensor]]] = {}
    for g in tensors:
        runs = grads.setdefault(g.dtype, [[]])
        if runs[-1] and sum(t.numel() for t in runs[-1]) + g.numel() > bucket:
            runs.append([])
        runs[-1].append(g)
    calls = 0
    for run in (r for runs in grads.values() for r in runs if r):
        flat = _flatten_dense_tensors(run)
        dist.all_reduce(flat, group=shard.group)
        for g, summed in zip(run, _unflatten_dense_tensors(flat, run)):
            g.copy_(summed)
        calls += 1
    return calls


def step_gradients(optimizer, params) -> list[torch.Tensor]:
    """The tensors holding `params`' gradients accumulated over the step's micro-batches, the ones the optimizer's norm,
    clip and update read at ReduceGrads. fp32 and ZeRO-1 (DeepSpeedZeroOptimizer, bf16 too): p.grad. DeepSpeed
    0.19.8's BF16_Optimizer (bf16 at ZeRO 0, or ZeRO 1 with fp32 grad_accum_dtype): after every backward it adds
    p.grad into its own buffer (fp32_groups_gradients[i][j], a view of a flat buffer in grad_accum_dtype:
    update_hp_grads, or a hook per parameter under immediate_grad_update) and clears p.grad before the next one
    (clear_lp_grads), so at ReduceGrads p.grad holds the last micro-batch's share at most and the buffer the step's:
    a sum over p.grad would leave what the optimizer reads each rank's share. Marked as holding a gradient
    (fp32_groups_has_gradients), so its norm counts it on every rank, as the summed weight it is."""
    where = {id(lp): (i, j) for i, group in enumerate(getattr(optimizer, "bf16_groups", ()))
             for j, lp in enumerate(group)}
    grads = []
    for p in params:
        if id(p) in where:
            i, j = where[id(p)]
            optimizer.fp32_groups_has_gradients[i][j] = True
            grads.append(optimizer.fp32_groups_gradients[i][j])
            continue
        if p.grad is None:
            p.grad = torch.zeros_like(p)
        grads.append(p.grad)
    return grads


def at_reduce_grads(engine, sum_step) -> None:
    """`engine` (a PipelineEngine) runs `sum_step()` once a step at ReduceGrads, then DeepSpeed's own ReduceGrads:
    after the step's micro-batches accumulated each rank's gradient share and the tied copies were summed
    (ReduceTiedGrads), before the DP all-reduce (ZeRO-1's too), the norm and clipping. --tp's summed parameters and
    --sp's whole model take their once-a-step sum here."""
    from deepspeed.runtime.pipe import schedule as ds
    reduce_grads = engine._INSTRUCTION_MAP[ds.ReduceGrads]

    def exec_reduce_grads(self):
        sum_step()
        reduce_grads(self)
    engine.__dict__["_INSTRUCTION_MAP"] = {**engine._INSTRUCTION_MAP, ds.ReduceGrads: exec_reduce_grads}


def summed_parameters(params) -> list:
    """The trained parameters whose gradient is each TP rank's share (marked tp_summed: module docstring), once each,
    in the module's order (the same on every TP rank, so the buckets match)."""
    return list({id(p): p for p in params if p.requires_grad and getattr(p, "tp_summed", False)}.values())


def sum_summed_gradients(params, shard: Shard, optimizer=None) -> int:
    """The tp_summed parameters' accumulated gradients (where `optimizer` keeps them: step_gradients) summed over the
    TP group in place, in buckets (one all-reduce per 500M elements of a dtype: sum_tensors); the number of
    all-reduces."""
    params = summed_parameters(params)
    if not params or shard.group is None:
        return 0
    return sum_tensors(step_gradients(optimizer, params), shard)


def sum_gradients_at_step(engine, shard: Shard) -> None:
    """`engine` (a PipelineEngine over a module under TP) sums its tp_summed gradients over the TP group once a step,
    at ReduceGrads: after the step's micro-batches accumulated each rank's share and the tied copies were summed,
    before DeepSpeed's DP all-reduce (ZeRO-1's too: the pipeline engine's stage 1 reduces p.grad there) and the
    clipped norm. A sum is linear, so summing the GAS micro-batches' accumulated shares once equals summing each
    micro-batch's as it is made (what a gradient hook per backward did: GAS x #tensors all-reduces a step), up to
    float reordering (mmpipe.model.sequence_parallel.sum_gradients_at_step, the same for --sp)."""
    params = summed_parameters(engine.module.parameters())
    at_reduce_grads(engine, lambda: sum_summed_gradients(params, shard, engine.optimizer))


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
