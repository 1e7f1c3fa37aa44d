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
on): the decoder embedding's output hidden is narrowed to the rank's slice (the embedding, and a replicated vision
tower before it, run whole on every SP rank: each rank's gradient is its positions' share), and each decoder block's
`geometry` returns its mask wrapped in `UlyssesMask` (attention.attend hands a Split-typed mask the q, k, v) and its
rotary sliced. The loss (`sp_loss`) takes its slice of the labels and LossNorm weights, and the total over SP is
its value (all-reduced forward, identity backward: each rank backpropagates its own positions' share, the all-to-all's
backward carrying each position's share of the other ranks' keys and values back to it). Every trained parameter's
gradient is then summed over the SP group (`sum_gradients_over`): each rank saw 1/SP of the positions.
"""
from __future__ import annotations

import torch
import torch.distributed as dist

from .attention import Split, attend
from .llava import LlamaBlock, LlavaEmbed
from .stage import unpack_out
from .tensor_parallel import Shard, reduce_from_tp

FAMILIES = ("llava", "qwen2_vl")  # whose decoder is embedding, LlamaBlock (QwenBlock), norm, head: checked here
WHY_NOT = {  # the families --sp refuses, and what their decoder has that this slice does not split yet
    "qwen3_vl": "its DeepStack sets are added to the row's positions inside the decoder (not sliced yet)",
    "qwen3_5": "its Gated DeltaNet recurrence runs along the row (no head-split all-to-all around it yet)",
    "gemma3": "its carried per-layer fields and image blocks are not sliced yet",
    "gemma4": "its per-layer inputs and shared K/V travel whole-row (not sliced yet)",
}


def span(length: int, shard: Shard) -> tuple[int, int]:
    """(first position, count) of this rank's slice of a row of `length`: contiguous, length / SP each."""
    if length % shard.size:
        raise ValueError(f"sequence parallelism: a row of {length} positions does not split into {shard.size} "
                         f"equal slices (run_config refuses such a run before launch)")
    n = length // shard.size
    return shard.rank * n, n


def local(x: torch.Tensor, shard: Shard, dim: int) -> torch.Tensor:
    """x's slice of this rank's positions along dim (a row's L)."""
    start, n = span(x.shape[dim], shard)
    return x.narrow(dim, start, n)


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
        out = self.exchange(q.transpose(1, 2), k.transpose(1, 2), v.transpose(1, 2), 0)  # [B, L / SP, H, Dh]
        return out.transpose(1, 2)


def _sliced_geometry(block: LlamaBlock, shard: Shard):
    whole = block.geometry  # the block's own (mask, rotary) of the whole row: LlamaBlock's or QwenBlock's M-RoPE

    def geometry(t, start: int, cache):
        if start or cache is not None:
            raise RuntimeError("sequence parallelism: cached generation does not run under --sp")
        mask, (cos, sin) = whole(t, start, cache)
        return UlyssesMask(mask, shard), (local(cos, shard, -2), local(sin, shard, -2))  # [B, 1, L / SP, Dh]
    return geometry


def _sliced_embedding(embed: LlavaEmbed, shard: Shard):
    whole = embed.forward

    def forward(args):
        t = unpack_out(embed, whole(args))  # the whole row's embedding, images placed
        return t._replace(hidden=local(t.hidden, shard, 1)).pack()
    return forward


def parallelize_sequence(layers, shard: Shard) -> None:
    """The stage's layers (and tied modules) under SP, in place (module docstring): the decoder embedding keeps its
    slice of the row, each decoder block attends through the all-to-all. A layer seen twice (a tied module) once."""
    done = set()
    for layer in layers:
        if id(layer) in done:
            continue
        done.add(id(layer))
        if isinstance(layer, LlavaEmbed):
            layer.forward = _sliced_embedding(layer, shard)
        elif isinstance(layer, LlamaBlock):
            layer.geometry = _sliced_geometry(layer, shard)


def sp_loss(loss_fn, shard: Shard):
    """loss_fn (the objective's, on one rank's logits [B, L / SP, V]) on this rank's slice of the labels (and
    LossNorm weights [B, L]): their weighted sum is additive over positions, so the slices' sum is the whole row's.
    The value returned is that sum over SP (logged, the same on every SP rank); its gradient is this rank's own."""
    def loss(logits, labels):
        if not isinstance(labels, (tuple, list)):
            raise ValueError("sequence parallelism: the loss needs LossNorm's per-position weights (a labelled mean "
                             "per micro-batch does not add up over slices)")
        return reduce_from_tp(loss_fn(logits, tuple(local(x, shard, 1) for x in labels)), shard)
    return loss


def sum_gradients_over(params, shard: Shard) -> None:
    """Each trained parameter's gradient summed over the SP group as it is made (once per backward: a leaf's hook
    sees its gradient summed over its uses), so every SP rank steps with the whole rows' gradient."""
    seen = set()
    for p in params:
        if p.requires_grad and id(p) not in seen:
            seen.add(id(p))
            p.register_hook(lambda g: _summed(g, shard))


def _summed(g: torch.Tensor, shard: Shard) -> torch.Tensor:
    g = g.contiguous().clone()
    dist.all_reduce(g, group=shard.group)
    return g
