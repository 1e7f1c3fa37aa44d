"""Ulysses sequence parallelism inside a pipeline stage (issue 58, first slice; docs/sequence_parallel.md).

A stage's SP ranks each hold 1/SP of every row's decoder positions: rank r the contiguous positions
r x L/SP .. (r + 1) x L/SP - 1 of a row of L (run_config refuses an L that SP does not divide). What is per position
(norms, MLPs, the head, the loss's cross-entropy) runs on the slice unchanged. Attention needs every position: before
it DeepSpeed's Ulysses all-to-all (deepspeed.sequence.layer.DistributedAttention, its _SeqAllToAll) trades positions
for heads, so each rank holds the whole row's q / k / v of H/SP query heads (and Hkv/SP kv heads: query heads
r x H/SP .. read kv heads r x Hkv/SP .., GQA's grouping, as TP's split has it); after it, the outputs go back.

What the layers derive from the row's integer tensors (which every rank loads whole: mmpipe.runtime.wire) is the
whole row's: the packed samples' mask (row_attention), the rotary positions (row_positions, M-RoPE's
mrope_positions). The mask is applied after the all-to-all, where each rank has the whole row, so packed samples stay
apart exactly as on one device; the rotary cos / sin [B, 1, L, Dh] are sliced to the rank's positions, since q and k
are rotated before the all-to-all, on the slice.

`parallelize_sequence(layers, shard)` applies it to a stage's built layers, by wrapping (no layer asks whether SP is
on): the decoder embedding's output hidden is narrowed to the rank's slice (the embedding runs whole on every SP rank,
each rank's gradient its positions' share; the vision tower before it encodes each rank's own images and gathers
their features: mmpipe.model.sp_tower), and each decoder block's
`geometry` returns its mask wrapped in `UlyssesMask` (attention.attend hands a Split-typed mask the q, k, v) and its
rotary sliced; Qwen3-VL's DeepStack adds place their set on the whole row and keep the slice. The loss (`sp_loss`)
takes its slice of the labels and LossNorm weights, and the total over SP is its value (all-reduced forward, identity
backward: each rank backpropagates its own positions' share, the all-to-all's backward carrying each position's share
of the other ranks' keys and values back to it). Every trained parameter's gradient is then summed over the SP group
once a step, at the step boundary before DeepSpeed's DP all-reduce (`sum_gradients_at_step`): each rank saw 1/SP of
the positions.
"""
from __future__ import annotations

import functools
import os
from types import SimpleNamespace

import torch
import torch.nn.functional as F

from .attention import Split, attend
from .llava import LlamaBlock, LlavaEmbed, LMHeadLinear, tied_head
from .moe import MoeHead, Qwen3MoeBlock, TiedMoeHead, split_aux
from .qwen2_vl import QwenBlock, QwenEmbed
from .qwen3_5 import (
    DeltaNetBlock,
    DeltaNetMoeBlock,
    GatedAttentionBlock,
    GatedAttentionMoeBlock,
    GatedDeltaNet,
    chunk_delta_rule,
    fla_delta_rule,
    sample_starts,
    segment_conv,
    use_fla,
)
from .qwen3_vl import DEEPSTACK_ADDS, DeepstackAdd, Qwen3Block, Qwen3Embed
from .sp_tower import LLAVA_TOWER, QWEN2_VL_TOWER, QWEN3_TOWER, TOWER, split_tower
from .stage import unpack_in, unpack_out
from .tensor_parallel import (
    SIZES,
    Shard,
    at_reduce_grads,
    enter_tp,
    reduce_from_tp,
    step_gradients,
    sum_gradients,  # noqa: F401 (the per-p.grad SP sum, re-exported: the in-process tests run it)
    sum_tensors,
    vocab_parallel_ce,
)


def padded(length: int, shard: Shard) -> int:
    """A row of `length` positions padded up to a multiple of SP (docs/sequence_parallel.md, "Rows that SP does not
    divide"): 87 positions at SP 2 -> 88, at SP 4 -> 88; a multiple stays as it is."""
    return -(-length // shard.size) * shard.size


def span(length: int, shard: Shard) -> tuple[int, int]:
    """(first position, count) of this rank's slice of a row of `length` (a multiple of SP: padded first)."""
    if length % shard.size:
        raise ValueError(f"sequence parallelism: a row of {length} positions does not split into {shard.size} "
                         f"equal slices (pad it first: sequence_parallel.padded)")
    n = length // shard.size
    return shard.rank * n, n


def pad(x: torch.Tensor, shard: Shard, dim: int, fill=0) -> torch.Tensor:
    """x along dim (a row's L) padded at its end with `fill` to padded(L); x itself where SP divides L."""
    extra = padded(x.shape[dim], shard) - x.shape[dim]
    if not extra:
        return x
    tail = x.new_full((*x.shape[:dim], extra, *x.shape[dim + 1:]), fill)
    return torch.cat([x, tail], dim)


def local(x: torch.Tensor, shard: Shard, dim: int, fill=0) -> torch.Tensor:
    """x's slice of this rank's positions along dim (a row's L, padded with `fill` to a multiple of SP)."""
    x = pad(x, shard, dim, fill)
    start, n = span(x.shape[dim], shard)
    return x.narrow(dim, start, n)


def padded_row(t, shard: Shard):
    """The stage tuple with its per-position integer tensors (input_ids, segments [B, L]) padded to a multiple of SP:
    the added positions are segment 0, padding as a packed row's own tail is (never attended by a real position,
    never labelled, not counted by the MoE router statistics), with token id 0 (a text id in every family: no image
    placeholder). Idempotent: what the row's whole-row layers (embedding, masks, rotary, DeepStack, the delta rule's
    segments) derive from it then covers every position an SP rank holds."""
    if t.segments.shape[1] % shard.size == 0:
        return t
    return t._replace(input_ids=pad(t.input_ids, shard, 1), segments=pad(t.segments, shard, 1))


class UlyssesMask(Split):
    """A row mask (any of attention.row_attention's) applied after DeepSpeed's all-to-all: attention.attend passes a
    Split its q, k, v [B, heads, L / SP, Dh] (this rank's positions, every head); DistributedAttention trades them for
    [B, L, heads / SP, Dh] (every position, this rank's heads), the inner mask attends there as on one device, and
    the outputs come back as [B, H, L / SP, Dh]. Split's own fields are unused: only its attend is."""

    def __init__(self, inner, shard: Shard):  # noqa: D107 (Split.__init__ not called: nothing of it is used)
        from deepspeed.sequence.layer import DistributedAttention
        self.inner, self.shard = inner, shard
        # batch first (batch_dim_idx 0 at the call): heads scattered (dim 2), positions gathered (dim 1)
        self.exchange = DistributedAttention(self._attend_local, shard.group, scatter_idx=2, gather_idx=1)

    def _attend_local(self, q, k, v):  # [B, L, h, Dh] each, the whole row of this rank's heads
        out = attend(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), self.inner)
        return out.transpose(1, 2)

    def attend(self, q, k, v):
        k, v = (kv_for_sp(x, self.shard) for x in (k, v))
        out = self.exchange(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0)  # [B, L / SP, H, Dh]
        return out.transpose(1, 2)


def kv_for_sp(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """k or v [B, Hkv, L / SP, Dh] with fewer kv heads than SP ranks (Hkv dividing SP; under --tp Hkv is the TP rank's
    own, Hkv / TP or the 1 it uses where TP exceeds Hkv) -> [B, SP, L / SP, Dh], each kv head repeated SP / Hkv times
    in place, so the all-to-all gives SP rank s kv head s // (SP / Hkv): the one its query heads s x H/SP .. read
    (GQA's grouping, as a kv weight fewer than TP's ranks is replicated). Its gradient sums the copies. E.g. qwen-tiny
    at TP 2 x SP 2: 1 kv head a TP rank, both SP ranks get it. x itself where SP divides Hkv."""
    heads = x.shape[1]
    return x if heads % shard.size == 0 else x.repeat_interleave(shard.size // heads, 1)


def _sliced_geometry(block: LlamaBlock, shard: Shard):
    whole = block.geometry  # the block's own (mask, rotary) of the whole row: LlamaBlock's or QwenBlock's M-RoPE

    def geometry(t, start: int, cache):
        if start or cache is not None:
            raise RuntimeError("sequence parallelism: cached generation does not run under --sp")
        mask, (cos, sin) = whole(padded_row(t, shard), start, cache)
        return UlyssesMask(mask, shard), (local(cos, shard, -2), local(sin, shard, -2))  # [B, 1, L / SP, Dh]
    return geometry


def _sliced_embedding(embed: LlavaEmbed, shard: Shard):
    whole = embed.forward

    def forward(args):
        row = padded_row(unpack_in(embed, args), shard)
        t = unpack_out(embed, whole(row.pack()))  # the whole (padded) row's embedding, images placed
        return t._replace(hidden=local(t.hidden, shard, 1)).pack()
    return forward


def _sliced_deepstack(add: DeepstackAdd, shard: Shard):
    """Qwen3-VL's DeepstackAdd<k> on a slice: the set deepstack_k [B, P / merge^2, D] is per image token, whole on
    every SP rank (gathered after the tower: sp_tower); the layer's own forward places it on a zero row [B, L, D] (its
    k-th image placeholder of the whole row takes token k), and this rank adds its slice of that (0 + x: exact)."""
    whole = add.forward

    def forward(args):
        t = padded_row(unpack_in(add, args), shard)
        B, _, D = t.hidden.shape
        row = t.hidden.new_zeros(B, t.input_ids.shape[1], D)
        placed = unpack_out(add, whole(t._replace(hidden=row).pack())).hidden
        return t._replace(hidden=t.hidden + local(placed, shard, 1), **{f"deepstack_{add.index}": None}).pack()
    return forward


def _to_heads(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """[B, L / SP, H, d] (this rank's positions, every head) -> [B, L, H / SP, d] (every position, its heads)."""
    from deepspeed.sequence.layer import _SeqAllToAll
    return _SeqAllToAll.apply(shard.group, x, 2, 1, 0)


def _to_positions(x: torch.Tensor, shard: Shard) -> torch.Tensor:
    """_to_heads' inverse: [B, L, H / SP, d] -> [B, L / SP, H, d]."""
    from deepspeed.sequence.layer import _SeqAllToAll
    return _SeqAllToAll.apply(shard.group, x, 1, 2, 0)


def _deltanet_forward(net: GatedDeltaNet, shard: Shard):
    """Qwen3.5's Gated DeltaNet on a slice (GatedDeltaNet.forward with two all-to-alls, training only): the per-position
    projections run on this rank's positions; q / k / v (channels head-major), beta and the log decay g go through the
    all-to-all to [B, L, heads / SP, ..], where the depthwise conv (one channel at a time: this rank's channels of its
    weight, the taps masked to each sample as on one device) and the delta rule (per value head, restarting at every
    sample of the whole row) run unchanged on this rank's key heads r x Hk/SP .. and the value heads they serve,
    r x Hv/SP .. (as TP's split); the output comes back to [B, L / SP, Hv, dv] for the gated norm and out_proj."""
    def forward(x, segments, cache=None):
        if cache is not None or segments is None:
            raise RuntimeError("sequence parallelism: cached generation does not run under --sp")
        B, T, _ = x.shape
        segments = pad(segments, shard, 1)  # the whole row's, padded as the slices are
        hk, hv, dk, dv, n = net.hk // shard.size, net.hv // shard.size, net.dk, net.dv, shard.size
        q, k, v = net.in_proj_qkv(x).split([net.key_dim, net.key_dim, net.value_dim], -1)
        q, k = (_to_heads(a.reshape(B, T, net.hk, dk), shard) for a in (q, k))
        v = _to_heads(v.reshape(B, T, net.hv, dv), shard)
        L = q.shape[1]
        weight = torch.cat([w.chunk(n)[shard.rank] for w in net.conv1d.weight.split([net.key_dim, net.key_dim,
                                                                                     net.value_dim])])
        qkv = segment_conv(torch.cat([q.flatten(2), k.flatten(2), v.flatten(2)], -1), weight, segments)
        q, k, v = qkv.split([hk * dk, hk * dk, hv * dv], -1)
        q, k = (net._l2(a.reshape(B, L, hk, dk)).repeat_interleave(hv // hk, 2) for a in (q, k))
        q = q * dk ** -0.5
        beta = _to_heads(net.in_proj_b(x).sigmoid()[..., None], shard)[..., 0]
        g = -net.A_log.float().exp() * F.softplus(net.in_proj_a(x).float() + net.dt_bias)
        g = _to_heads(g[..., None], shard)[..., 0]
        v, starts = v.reshape(B, L, hv, dv), sample_starts(segments)
        o = fla_delta_rule(q, k, v, g, beta, starts) if use_fla(x) else chunk_delta_rule(q, k, v, g, beta, starts)[0]
        o = _to_positions(o.contiguous(), shard)  # [B, T, Hv, dv]
        z = net.in_proj_z(x).view(B, T, net.hv, dv)
        return net.out_proj(net.norm(o, z).reshape(B, T, -1))
    return forward


def slice_embedding(layer, shard: Shard) -> None:
    layer.forward = _sliced_embedding(layer, shard)


def _reads_positions(layer, shard: Shard) -> None:
    """A decoder block's linears all read this rank's positions (the all-to-all runs between them, never inside
    one): their input_split (tensor_parallel._mark_inputs: under --tp a row linear's feature slice) gains positions
    r L / SP .. of the padded row (dim 1), what a LoRA adapter's dropout mask is cut from (lora.SplitDropout)."""
    for m in layer.modules():
        if isinstance(m, torch.nn.Linear):
            m.input_split = (*getattr(m, "input_split", ()), (1, shard.rank, shard.size))


def attend_by_heads(layer, shard: Shard) -> None:  # a LlamaBlock-shaped block: its geometry, then the all-to-all
    layer.geometry = _sliced_geometry(layer, shard)
    _reads_positions(layer, shard)


def deltanet_by_heads(layer, shard: Shard) -> None:
    layer.linear_attn.forward = _deltanet_forward(layer.linear_attn, shard)
    _reads_positions(layer, shard)


def slice_deepstack(layer, shard: Shard) -> None:
    layer.forward = _sliced_deepstack(layer, shard)


def _sliced_router(moe, shard: Shard):
    """An MoE block's SparseMoe on a slice: the router and experts are per position (under --ep the experts' tokens
    are this rank's slice's, exchanged within the EP group of its SP coordinate); the row's real-position mask
    [B, L] is the whole row's, so it takes its slice; the layer's statistics [B, 2, E] (top-k counts and router
    probability sums: sums over positions) are summed over SP, so every rank carries the whole row's, as one device
    does: the head's load-balancing loss, a product of the two sums, is then the single device's on every SP rank.
    The sum's backward is the identity: each rank takes the aux loss's gradient at the whole row's statistics into
    its own positions' share, and the SP sum of the gradients adds the shares."""
    whole = moe.forward

    def forward(x, real):
        y, stats = whole(x, local(real, shard, 1, False))
        return y, reduce_from_tp(stats, shard)
    return forward


def moe_attend_by_heads(layer, shard: Shard) -> None:  # an MoE block: its attention as the dense one's
    attend_by_heads(layer, shard)
    layer.mlp.forward = _sliced_router(layer.mlp, shard)


def moe_deltanet_by_heads(layer, shard: Shard) -> None:  # an MoE Gated DeltaNet block: as the dense one
    deltanet_by_heads(layer, shard)
    layer.mlp.forward = _sliced_router(layer.mlp, shard)


def _tp_tiled(hidden: torch.Tensor, weight: torch.Tensor, tp: Shard | None) -> TiledLogits:
    """TiledLogits of a head's hidden and weight; under --tp (tp: the vocab-split weight's shard) the hidden enters
    the TP region (its gradient, each TP rank's vocabulary share, summed over TP) and the tiles' loss is the
    vocab-parallel cross-entropy of this rank's V / TP rows."""
    return TiledLogits(hidden if tp is None else enter_tp(hidden, tp), weight, shard=tp)


def tiled_head(layer, shard: Shard) -> None:  # noqa: ARG001 (a plan entry's signature)
    """An untied head (LMHeadLinear, MoeHead: its `lm_head` projection) returns TiledLogits, its hidden and weight, not
    logits: sp_loss tiles them."""
    proj = layer.lm_head
    proj.forward = lambda hidden: _tp_tiled(hidden, proj.weight, getattr(proj, "tp_shard", None))


def tiled_tied_head(head: functools.partial, shard: Shard) -> functools.partial:  # noqa: ARG001
    """A tied head (DeepSpeed's partial(forward_fn, the tied embedding): llava.tied_head, moe.TiedMoeHead) returning
    TiledLogits of its hidden (the first float of its tuple) and the embedding's weight. forward_fn itself runs on a
    stand-in embedding whose weight has no rows (logits [B, T, 0]: nothing), so an MoE head still computes and
    keeps its aux loss (moe.head_aux reads it through __wrapped__)."""
    fn = head.func

    def forward(embed, args):
        weight = embed.embed_tokens.weight
        _, aux = split_aux(fn(SimpleNamespace(embed_tokens=SimpleNamespace(weight=weight[:0])), args))
        tiled = _tp_tiled(args[0], weight, getattr(embed.embed_tokens, "tp_shard", None))
        return tiled if aux is None else (tiled, aux)
    forward.__wrapped__ = getattr(fn, "__wrapped__", fn)
    return functools.partial(forward, *head.args, **head.keywords)


# the families' plans (mmpipe.registry.Family.sp_plan, attached in mmpipe.families): the decoder embedding keeps its
# slice, each decoder block attends (or runs Gated DeltaNet) through the all-to-all, DeepStack adds their slice, the
# head hands the loss its hidden and weight (TiledLogits: the tiled loss); the tower, projector / mergers and norm
# run unchanged on what they get. A tied head is keyed by its forward_fn (a function, or TiedMoeHead's class).
HEADS = {LMHeadLinear: tiled_head, tied_head: tiled_tied_head}
MOE_HEADS = {MoeHead: tiled_head, TiedMoeHead: tiled_tied_head}
LLAVA_SP_PLAN = {LlavaEmbed: slice_embedding, LlamaBlock: attend_by_heads, **HEADS, **LLAVA_TOWER}
QWEN2_VL_SP_PLAN = {QwenEmbed: slice_embedding, QwenBlock: attend_by_heads, **HEADS, **QWEN2_VL_TOWER}
QWEN3_VL_SP_PLAN = {Qwen3Embed: slice_embedding, Qwen3Block: attend_by_heads, Qwen3MoeBlock: moe_attend_by_heads,
                    **{add: slice_deepstack for add in DEEPSTACK_ADDS}, **HEADS, **MOE_HEADS, **QWEN3_TOWER}
QWEN3_5_SP_PLAN = {Qwen3Embed: slice_embedding, GatedAttentionBlock: attend_by_heads, DeltaNetBlock: deltanet_by_heads,
                   GatedAttentionMoeBlock: moe_attend_by_heads, DeltaNetMoeBlock: moe_deltanet_by_heads,
                   **HEADS, **MOE_HEADS, **QWEN3_TOWER,
                   # beyond the attention heads SP must divide (each rank runs H / SP of them after the all-to-all)
                   SIZES: lambda cfg: (("Gated DeltaNet key heads", cfg.text.linear_key_heads),
                                       ("Gated DeltaNet value heads", cfg.text.linear_value_heads))}


def parallelize_sequence(layers, shard: Shard, plan: dict) -> list:
    """The stage's layers (and tied modules) under SP (module docstring), each as the family's plan (Family.sp_plan:
    layer class, or a tied head's forward_fn, -> how) says; a layer the plan does not name runs unchanged. Modules
    change in place (a layer seen twice, a tied module, once); returns the list with each tied head (DeepSpeed's
    partial) replaced by its tiled one."""
    done, out = set(), []
    for layer in layers:
        if isinstance(layer, functools.partial):
            inner = getattr(layer.func, "__wrapped__", None)  # under --tp a head function wrapped by tensor_parallel
            how = (plan.get(layer.func) or plan.get(type(layer.func)) or plan.get(inner, None)
                   or plan.get(type(inner)))
            out.append(how(layer, shard) if how else layer)
            continue
        out.append(layer)
        if id(layer) in done:
            continue
        done.add(id(layer))
        how = plan.get(type(layer))
        if how is not None:
            how(layer, shard)
    if TOWER in plan:  # the tower's images split over SP where this stage holds all of it (mmpipe.model.sp_tower)
        split_tower(out, shard, plan[TOWER])
    return out


def sp_loss(loss_fn, shard: Shard):
    """loss_fn (the objective's, on one rank's logits [B, L / SP, V]) on this rank's slice of the labels (and
    LossNorm weights [B, L], padded as the row: weight 0): their weighted sum is additive over
    positions, so the slices' sum is the whole row's. The value returned is that sum over SP (logged, the same on
    every SP rank); its gradient is this rank's own. An MoE head's load-balancing term (already the whole row's on
    every SP rank: _sliced_router) is added once, after the sum."""
    def loss(out, labels):
        if not isinstance(labels, (tuple, list)):
            raise ValueError("sequence parallelism: the loss needs LossNorm's per-position weights (a labelled mean "
                             "per micro-batch does not add up over slices)")
        logits, aux = split_aux(out)
        mine = tuple(local(x, shard, 1) for x in labels)  # padding: label 0 at weight 0, adding 0 x its CE
        # a tiled head's (TiledLogits): lm_loss's LossNorm sum, a tile of logits at a time (the SFT objective's SP
        # form: objectives.TOKENS; dpo's reads TiledLogits.ce)
        part = logits.loss(*mine) if isinstance(logits, TiledLogits) else loss_fn(logits, mine)
        total = reduce_from_tp(part, shard)
        return total if aux is None else total + aux
    return loss


# Tiled loss (issue 58's "nothing ever materialises full-row logits: tile the loss, as ALST does"): the head hands the
# loss its hidden and weight, and the loss makes logits a tile of positions at a time, in forward and again in
# backward, so a rank holds tile x V logits at once, not its L / SP x V (qwen3-vl-8b at L = 131,072 and SP 4: 32,768
# x 151,936 x 4 B = 18.5 GiB of fp32 logits, and their gradient as much, where a tile of 1,767 positions is 1 GiB)
TILE_BYTES = 1 << 30  # fp32 logits of one tile (ALST's TiledFusedLogitsLoss sizes its shards likewise, ~1 GiB)
TILE_ENV = "MMPIPE_SP_TILE_BYTES"  # another tile size, in bytes of fp32 logits (docs/sequence_parallel.md)


def tile_positions(vocab: int, tile_bytes: int | None = None) -> int:
    """Positions a tile holds: as many fp32 logit rows of `vocab` as fit tile_bytes (151,936 -> 1,767 at 1 GiB), >= 1;
    tile_bytes None: $MMPIPE_SP_TILE_BYTES, else TILE_BYTES."""
    tile_bytes = tile_bytes or int(os.environ.get(TILE_ENV) or TILE_BYTES)
    return max(1, tile_bytes // (4 * vocab))


class TiledLogits:
    """What a head under --sp returns in place of logits [B, T, V]: its input hidden [B, T, D] and the vocabulary
    projection's weight [V, D]; sp_loss computes the LossNorm-weighted cross-entropy from them a tile at a time
    (TiledCrossEntropy). Not a tuple: split_aux takes it as the logits of a head without an aux loss."""

    def __init__(self, hidden: torch.Tensor, weight: torch.Tensor, tile: int | None = None, shard: Shard | None = None):
        self.hidden, self.weight, self.shard = hidden, weight, shard  # shard: a vocab-split weight's (--tp), or None
        self.tile = tile or tile_positions(weight.shape[0])  # (under TP a tile holds V / TP logits a position)

    def loss(self, labels: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """sum over positions of cross-entropy x weight (lm_loss's LossNorm form), fp32."""
        return (self.ce(labels) * weights).sum()

    def ce(self, labels: torch.Tensor) -> torch.Tensor:
        """The per-position cross-entropy [B, T] (fp32, 0 where labels are -100): what every objective reads (the SFT
        loss weighs it, DPO sums it per sample: objectives.Objective.split_sequence), never the logits whole."""
        return TiledCrossEntropy.apply(self.hidden, self.weight, labels, self.tile, self.shard)


def _tile_loss(h: torch.Tensor, weight: torch.Tensor, labels: torch.Tensor, shard: Shard | None = None) -> torch.Tensor:
    """One tile's per-position cross-entropy [n]: h [n, D], labels [n] (lm_loss's arithmetic, fp32; 0 at label -100);
    under --tp (shard) over the TP group's whole vocabulary from this rank's rows of it (vocab_parallel_ce: the same
    value on every TP rank, its gradient this rank's logits')."""
    # cross_entropy's default ignore_index, -100, is builder.IGNORE_INDEX (not imported: builder -> lora ->
    # tensor_parallel -> this module would be a cycle)
    logits = F.linear(h, weight).float()
    return (F.cross_entropy(logits, labels, reduction="none") if shard is None else
            vocab_parallel_ce(logits[None], labels[None], shard, weight.shape[0] * shard.size, -100)[0])


class TiledCrossEntropy(torch.autograd.Function):
    """cross_entropy(hidden @ weight^T) [B, T] per position of hidden [B, T, D], `tile` positions at a time: forward
    keeps no logits (only its inputs), backward recomputes each tile's logits and takes its gradients by autograd
    against the tile's incoming gradient (a checkpoint per tile), adding the weight's over tiles. Peak: one tile's
    logits and their gradient, tile x V each."""

    @staticmethod
    def forward(ctx, hidden, weight, labels, tile, shard=None):
        ctx.save_for_backward(hidden, weight, labels)
        ctx.tile, ctx.shard = tile, shard
        h, y = hidden.flatten(0, 1), labels.flatten()
        ce = torch.cat([_tile_loss(h[s:s + tile], weight, y[s:s + tile], shard) for s in range(0, h.shape[0], tile)])
        return ce.view(labels.shape)

    @staticmethod
    def backward(ctx, grad):
        hidden, weight, labels = ctx.saved_tensors
        h, y, g = hidden.detach().flatten(0, 1), labels.flatten(), grad.flatten()
        grad_h = torch.zeros_like(h) if ctx.needs_input_grad[0] else None
        grad_w = torch.zeros_like(weight) if ctx.needs_input_grad[1] else None
        for s in range(0, h.shape[0], ctx.tile):
            with torch.enable_grad():
                h_t = h[s:s + ctx.tile].requires_grad_(grad_h is not None)
                w_t = weight.detach().requires_grad_(grad_w is not None)
                wanted = [x for x in (h_t, w_t) if x.requires_grad]
                got = iter(torch.autograd.grad(_tile_loss(h_t, w_t, y[s:s + ctx.tile], ctx.shard), wanted,
                                               g[s:s + ctx.tile]) if wanted else ())
            if grad_h is not None:
                grad_h[s:s + ctx.tile] = next(got)
            if grad_w is not None:
                grad_w += next(got)
        return (None if grad_h is None else grad_h.view_as(hidden)), grad_w, None, None, None


def sum_gradients_at_step(engine, shard: Shard) -> None:
    """`engine` (a PipelineEngine over a module under SP) sums its trained parameters' gradients over the SP group once
    a step: at ReduceGrads, after the step's micro-batches accumulated each rank's share locally and the tied weights'
    copies were summed (ReduceTiedGrads), before DeepSpeed's own DP all-reduce and the optimizer step (so the norm and
    clipping read the whole gradient). The same sum as adding each micro-batch's share over SP as it is made, but one
    all-reduce a step (a model under 500M trained elements) where that was GAS x #tensors: qwen-tiny at GAS 2, 112 of
    them, 234 ms -> 2.3 ms a step on 2 gloo ranks; the results differ by float reordering, <= 3e-8
    (docs/sequence_parallel.md). The gradients summed are where the optimizer keeps them (tensor_parallel.
    step_gradients, as TP's sum): p.grad, or under bf16 DeepSpeed's BF16_Optimizer's own accumulation buffers (it
    clears p.grad after every backward: a sum over p.grad left each rank's share in them, 45-104% off the whole
    gradient at qwen-tiny's QwenBlock, tests/test_sp_objectives.py)."""
    params = list({id(p): p for p in engine.module.parameters() if p.requires_grad}.values())
    at_reduce_grads(engine, lambda: sum_tensors(step_gradients(engine.optimizer, params), shard))
    if shard.rank and hasattr(engine.optimizer, "bf16_groups"):
        _count_none(engine.optimizer)


def _count_none(optimizer) -> None:
    """DeepSpeed 0.19.8's BF16_Optimizer.step takes the global norm of the gradients a rank counts
    (get_grads_for_norm, then get_global_norm_of_tensors: torch.stack of their norms, summed over the model-parallel
    group). Every weight is replicated over SP and counted on SP rank 0 only, so an SP rank > 0 at TP 1 counts none and
    the stack of nothing raised ("stack expects a non-empty TensorList"); it counts a zero instead (its share of the
    sum is 0 either way)."""
    counted = optimizer.get_grads_for_norm

    def grads_for_norm(for_clipping=False):
        out = counted(for_clipping)
        if for_clipping or out[0]:
            return out
        return [torch.zeros(1, device=optimizer.fp32_groups_flat_partition[0].device)], out[1]
    optimizer.get_grads_for_norm = grads_for_norm
