"""The tensor-parallel plans of the families of patches (Qwen2-VL / Qwen2.5-VL, Qwen3-VL, Qwen3.5), as data
(mmpipe.registry.Family.tp_plan; the marks: mmpipe.model.tensor_parallel, whose `parallelize` applies them). LLaVA's
is mmpipe.families.LLAVA_TP_PLAN; these reuse its decoder split (Megatron's Llama: q / k / v and gate / up by column,
heads whole on a rank, kv heads fewer than TP ranks whole on each; o and down by row; embedding and head by
vocabulary, a tied head reading the embedding's own vocab slice).

The tower is split too, unlike LLaVA's, for these three families: it runs on every patch of a row, not on a fixed
576-token crop. At Qwen2.5-VL-72B's 16k patches per row its 32 blocks of 1280 (0.67 B parameters) cost
2 x 0.67 B x 16 384 = 22 TFLOPs a row forward, and its activations grow with the patches; replicated, every TP rank
would repeat all of it, split each does 1/TP, for two all-reduces of [P, 1280] per block (the decoder's are
[L, 8192]). The vision heads split like the decoder's (each head's attention, window or full, is its own, so
Qwen2.5-VL's windows and Qwen3-VL's per-image attention run unchanged on each rank's heads); the 2D rotary is per
head (head_dim from the config, not the rank's width). FusedAttention's qkv [3, H, Dh] rows split per part (Fused(3):
this rank's q, k and v heads). The patch embedding (a 1176 x 1280 matmul and Qwen3's position table) and the norms
stay whole: small, and a split would cost a collective for nothing. The mergers (Qwen2-VL's mlp.0 / mlp.2, Qwen3-VL's
and each DeepStack merger's linear_fc1 / linear_fc2) are column then row: their output, the merged tokens or a
DeepStack set [B, P / 4, D_text], is whole on every TP rank after the row's all-reduce, so each TP rank sends its
stage's whole fields to the same TP rank of the next stage (a DeepStack set crossing a cut included).

Qwen3.5's Gated DeltaNet splits by heads: in_proj_qkv and its depthwise conv1d by channel parts [q | k | v] (each a
1/TP: this rank's key heads' q and k, its value heads' v), in_proj_z / in_proj_b / in_proj_a and the per-value-head
dt_bias / A_log by rows, out_proj by row. Each key head serves Hv / Hk consecutive value heads, so rank r's value
heads r x Hv / TP .. read exactly its key heads r x Hk / TP ..: the recurrence, its state [dk, dv] per value head,
the short convolution (one filter per channel) and the gated norm (per head) need no collective. Its full-attention
layers split as the decoder's with their output gate: q_proj's rows are [H, 2, Dh] (each head's q then its gate),
so its contiguous 1/TP is H / TP heads with their gates.

The MoE variants (Qwen3-VL-MoE's Qwen3MoeBlock, Qwen3.5-MoE's DeltaNetMoeBlock / GatedAttentionMoeBlock) split
their attention as the dense blocks do, and their sparse MLP (mmpipe.model.moe.SparseMoe) thus:

    mlp.gate (the router) [E, D]            replicated: every TP rank routes every token, the same top k
    mlp.experts.gate_up_proj [E, 2F, D]     each expert column-split: this rank's F / TP rows of its gate and of its up
    mlp.experts.down_proj [E, D, F]         each expert row-split: this rank's F / TP columns
    mlp.shared_expert (Qwen3.5-MoE)         gate / up column, down row, as a dense MLP; its sigmoid gate [1, D] whole

Megatron's expert tensor parallelism, picked over the experts whole on a TP rank (rank t keeping E / TP of them,
also exact, the same one all-reduce of [N, D] a layer) because the work a rank does then does not depend on where
the router sends the tokens: every (token, choice) pair costs 2 D 2F + 2 F D = 6 D F multiply-adds, 6 D F / TP on
each rank for every pair, where with whole experts a rank does 6 D F for each pair routed to its E / TP experts,
anywhere from none to all of them (Qwen3-VL-30B-A3B: D 2048, F 768, top 8: 75 MFLOP a token, 38 per rank at TP 2
either way on average). And --ep keeps its meaning unchanged: it splits each expert's slices along E over the data
ranks of one TP coordinate (mmpipe.runtime.experts), so an EP group of TP rank t exchanges the tokens it routes with
the other ranks of TP rank t, which hold the same F / TP slice of their experts.

The forward (_experts_forward): the experts' output is each rank's partial sum (its F / TP of every expert's down
projection), weighted by the router's top-k weights, added per token, then all-reduced over TP once ([N, D], as
a dense MLP's down row). The router's weights w multiply those partial outputs, so each rank's gradient of w from
them is its slice's share: w enters the TP region through copy_to_tp (identity forward, gradient all-reduced), so
dL/dw = sum over TP of g . y_r = g . y on every rank, and so is the router's, and its input's. Summing the router
weight's gradient over TP instead (the `summed` mark) would be wrong twice: the load-balancing loss's gradient
reaches the router through the probabilities, whole and equal on every TP rank (each rank computes the same loss),
which the sum would count TP times; and the input's gradient through the router would stay each rank's share. So
the aux loss is counted once: each TP rank computes it whole from the replicated router, nothing sums it.
The MoE heads take the vocabulary split of VOCAB_ENDS: MoeHead's lm_head by vocabulary, TiedMoeHead (a tied head's
forward_fn object) entering the TP region and reading the embedding's vocab slice; the aux term is whole on each.

Under --sequence-parallel (the plan's SEQUENCE: an MoE block is POSITIONS like a dense one) the sparse MLP takes this
rank's 1/TP of the row's positions after the norm, and Megatron-Core's choice is kept: the tokens are not gathered
before the router. Each TP rank routes its own positions (router logits, softmax, top k on [N / TP, D]: the router's
work and its fp32 probabilities [N / TP, E] kept for backward fall by TP, and nothing is gathered that the router
could not use); then, because every expert is split by its FFN width, each rank's F / TP slices must see every
routed token: the positions x, their top-k ids and weights are all-gathered over TP into the row (as Megatron-Core's
all-gather token dispatcher gathers hidden states, routing map and probabilities over its TP x EP group), the
experts run on it exactly as under TP alone (--ep's exchange inside), and their weighted partial outputs are
reduce-scattered back to each rank's positions (_experts_forward). The bytes equal TP alone's all-reduce of [N, D]
(its two halves: a ring all-reduce is a reduce-scatter then an all-gather) plus 2 N top_k small values. The
gathered x is flattened [N, D], ranks in order (rank r's B x L / TP positions, then rank r + 1's): the experts are
per token, so any order serves as long as the reduce-scatter hands each rank back the same slice.
The statistics (top-k counts and probability sums over the rank's real positions: its slice of the row's mask) are
then each rank's share, so each layer's are summed over TP (reduce_from_tp: one all-reduce of [B, 2, E] a layer,
its backward the identity): every rank carries the whole row's sums, as under TP alone, and the head's aux loss,
a product of two sums, is TP alone's on every rank (Megatron-Core likewise all-reduces each layer's tokens per
expert over its TP x CP group, its sequence_partition_group). The router weight, whole on each rank and now fed by
its positions only, is summed over TP once a step as the norms are (POSITIONS: tp_summed); its gradient from the aux
loss on rank r is the loss's gradient at the whole sums times rank r's positions' share, and the step's sum adds
the shares, so nothing is counted twice.
"""
from __future__ import annotations

import functools
import types

from .cross_attention import CrossAttnBlock, CrossAttnTextEmbed
from .gemma3 import Gemma3Block, Gemma3Embed, Gemma3FinalNorm, Gemma3SlidingBlock
from .gemma4 import BLOCKS as GEMMA4_BLOCKS
from .gemma4 import MOE_BLOCKS as GEMMA4_MOE_BLOCKS
from .gemma4 import Gemma4Embed, Gemma4FinalNorm, Gemma4Head, Gemma4MoeHead, Gemma4TiedMoeHead, gemma4_tied_head
from .llava import FinalNorm, LMHeadLinear, SwiGLU, TowerMLP, tied_head
from .moe import Experts, MoeHead, Qwen3MoeBlock, SparseMoe, TiedMoeHead
from .qwen2_vl import QwenBlock, QwenEmbed, QwenMerger, QwenVisionBlock
from .qwen3_5 import DeltaNetBlock, DeltaNetMoeBlock, GatedAttentionBlock, GatedAttentionMoeBlock, Qwen35FinalNorm
from .qwen3_vl import DEEPSTACK_ADDS, DEEPSTACK_MERGERS, Qwen3Block, Qwen3Embed, Qwen3Merger, Qwen3VisionBlock
from .tensor_parallel import (
    ADDS,
    CARRIED,
    COLUMN,
    ENTRY,
    HEADS,
    KV,
    KV_HEADS,
    POSITIONS,
    ROW,
    SCATTER,
    SEQUENCE,
    SIZES,
    SUMMED,
    VOCAB,
    Fused,
    Own,
    Shard,
    _keep,
    _positions,
    enter_tp,
    enter_tp_ids,
    leave_tp,
    parallelize,
    reduce_from_tp,
    split_dims,
    tp_sizes,
)

# the attention's and the SwiGLU's input enter the TP region once each (ENTRY): 2 gradient all-reduces a block, as
# Megatron's, not one per q / k / v / gate / up (5)
ATTENTION = {"self_attn": ENTRY, "self_attn.q_proj": COLUMN, "self_attn.k_proj": KV, "self_attn.v_proj": KV,
             "self_attn.o_proj": ROW,
             "self_attn.n_heads": HEADS, "self_attn.kv_heads": KV_HEADS}
MLP = {"mlp": ENTRY, "mlp.gate_proj": COLUMN, "mlp.up_proj": COLUMN, "mlp.down_proj": ROW}
DECODER = {**ATTENTION, **MLP}  # LLaVA's LlamaBlock split
# Qwen3's and Qwen3.5's q / k norms, over each head's width: whole on each rank, their gradients summed over TP
QK_NORMS = {"self_attn.q_norm": SUMMED, "self_attn.k_norm": SUMMED}
VOCAB_ENDS = {LMHeadLinear: {"lm_head": VOCAB}, tied_head: {"": VOCAB}}
MOE_VOCAB_ENDS = {MoeHead: {"lm_head": VOCAB}, TiedMoeHead: {"": VOCAB}}  # (logits, aux): the aux whole on each rank
# a tower block's fused attention: [q | k | v] each split by heads, proj by row
TOWER_ATTENTION = {"attn.qkv": Fused(3), "attn.proj": ROW,
                   **{f"attn.{n}": HEADS for n in ("n_heads", "n_kv_heads", "kv_dim")}}
PATCH_MERGER = {"linear_fc1": COLUMN, "linear_fc2": ROW}


def sequence_plan(embed, blocks, norm=FinalNorm, adds=(), heads=()) -> dict:
    """A plan's SEQUENCE entry (--sequence-parallel, mmpipe.model.tensor_parallel): the decoder embedding scatters its
    row, the blocks (dense or MoE: module docstring), the final norm and the heads (the MoE ones too; a family's own
    `heads` besides) run on 1/TP of its positions, DeepStack's adds add their slice."""
    heads = (LMHeadLinear, tied_head, MoeHead, TiedMoeHead, *heads)
    return {SEQUENCE: {embed: SCATTER, **{b: POSITIONS for b in (*blocks, norm, *heads)}, **{a: ADDS for a in adds}}}


def _tower_sizes(cfg) -> tuple:
    v = cfg.vision
    return (("vision attention heads (vision.n_heads)", v.n_heads), ("vision FFN width (vision.ff_dim)", v.ff_dim),
            ("merger width (vision.dim x merge_size^2)", v.dim * v.merge_size ** 2))


def _experts_forward(self, x, idx, weights):
    """Experts.forward on this rank's F / TP of every expert (module docstring): x and the router's weights enter the
    TP region (their gradients all-reduced), the weighted partial outputs leave it (all-reduced once). Under SP x,
    idx and weights are this rank's positions' [N / TP, ..]: entering gathers them (flattened, as [1, N / TP, ..], so
    the ranks' tokens follow each other in rank order; backward x's and the weights' gradients reduce-scattered), the
    ids too (integers: no gradient), and leaving reduce-scatters the partial outputs to this rank's tokens."""
    shard = self.tp_shard
    x, idx, weights = enter_tp(x[None], shard)[0], enter_tp_ids(idx[None], shard)[0], enter_tp(weights[None], shard)[0]
    return leave_tp(Experts.forward(self, x, idx, weights)[None], shard)[0]


def _split_experts(experts: Experts, shard: Shard) -> None:
    """Each expert's gate | up rows [2F] as two parts (this rank's F / TP of each) and its down columns [F]."""
    ff = experts.down_proj.shape[2]
    _keep(experts, "gate_up_proj", 1, shard, [ff, ff])
    _keep(experts, "down_proj", 2, shard)
    experts.tp_shard = shard
    experts.forward = types.MethodType(_experts_forward, experts)


EXPERTS = Own(_split_experts, lambda e: {"gate_up_proj": (1, (e.down_proj.shape[2],) * 2), "down_proj": 2})


def _moe_entries(mlp: SparseMoe) -> dict:
    """The sparse MLP's split: the router replicated (not named), the experts, the shared expert where it has one."""
    shared = {"shared_expert": ENTRY, "shared_expert.gate_proj": COLUMN, "shared_expert.up_proj": COLUMN,
              "shared_expert.down_proj": ROW}
    return {"experts": EXPERTS, **(shared if hasattr(mlp, "shared_expert") else {})}


def _sequence_moe_forward(self, x, real):
    """SparseMoe.forward on this rank's positions x [B, L / TP, D] (SP, module docstring): the row's real-position
    mask [B, L] cut to them; the layer's statistics summed over TP, the whole row's on every rank."""
    y, stats = SparseMoe.forward(self, x, _positions(real, self.tp_shard))
    return y, reduce_from_tp(stats, self.tp_shard)


def _split_moe(mlp: SparseMoe, shard: Shard) -> None:
    """The sparse MLP split (_moe_entries); under SP on this rank's positions like its block: the shared expert's
    region gathers and reduce-scatters as a dense MLP's, the experts as _experts_forward, the statistics summed."""
    parallelize(mlp, {SparseMoe: _moe_entries(mlp), SEQUENCE: {SparseMoe: POSITIONS}}, shard)
    if shard.sequence:
        mlp.tp_shard = shard
        mlp.forward = types.MethodType(_sequence_moe_forward, mlp)


# the block's mlp, a SparseMoe with or without a shared expert (one class: a nested plan cannot tell them apart)
MOE_MLP = {"mlp": Own(_split_moe, lambda m: split_dims(m, {SparseMoe: _moe_entries(m)}, 1))}


def moe_sizes(cfg) -> tuple:
    """An MoE model's widths TP must divide (each expert's FFN, the shared expert's), () for a dense one."""
    m = cfg.text.moe
    if m is None:
        return ()
    return (("expert FFN width (text.moe.ff_dim)", m.ff_dim),) + (
        (("shared expert FFN width (text.moe.shared_ff_dim)", m.shared_ff_dim),) if m.shared_ff_dim else ())


def _hybrid_sizes(cfg) -> tuple:
    t = cfg.text
    return _tower_sizes(cfg) + moe_sizes(cfg) + (
        ("Gated DeltaNet key heads (text.linear_key_heads)", t.linear_key_heads),
        ("Gated DeltaNet value heads (text.linear_value_heads)", t.linear_value_heads))


QWEN2_VL_TP_PLAN = {
    # Qwen2-VL's tower MLP is fc1 / fc2, Qwen2.5-VL's SwiGLU with bias (vision.mlp): split by the MLP's class
    QwenVisionBlock: {**TOWER_ATTENTION, "mlp": {SwiGLU: {"": ENTRY, "gate_proj": COLUMN, "up_proj": COLUMN,
                                                          "down_proj": ROW},
                                                 TowerMLP: {"fc1": COLUMN, "fc2": ROW}}},
    QwenMerger: {"mlp.0": COLUMN, "mlp.2": ROW},
    QwenEmbed: {"embed_tokens": VOCAB},
    QwenBlock: DECODER,
    **VOCAB_ENDS,
    SIZES: _tower_sizes,
    **sequence_plan(QwenEmbed, (QwenBlock,)),
}

QWEN3_TOWER = {Qwen3VisionBlock: {**TOWER_ATTENTION, "mlp.linear_fc1": COLUMN, "mlp.linear_fc2": ROW},
               Qwen3Merger: PATCH_MERGER, Qwen3Embed: {"embed_tokens": VOCAB}}

QWEN3_VL_TP_PLAN = {
    **QWEN3_TOWER,
    **{merger: PATCH_MERGER for merger in DEEPSTACK_MERGERS},  # DeepstackAdd<k> has no weights
    Qwen3Block: {**DECODER, **QK_NORMS},
    Qwen3MoeBlock: {**ATTENTION, **QK_NORMS, **MOE_MLP},
    **VOCAB_ENDS,
    **MOE_VOCAB_ENDS,
    SIZES: lambda cfg: _tower_sizes(cfg) + moe_sizes(cfg),
    **sequence_plan(Qwen3Embed, (Qwen3Block, Qwen3MoeBlock), adds=DEEPSTACK_ADDS),
}

_DELTANET_QKV = Fused(("key_dim", "key_dim", "value_dim"))  # the owner's widths, read before they are divided
DELTANET = {"linear_attn": ENTRY, "linear_attn.in_proj_qkv": _DELTANET_QKV, "linear_attn.conv1d": _DELTANET_QKV,
            **{f"linear_attn.{n}": COLUMN for n in ("in_proj_z", "in_proj_b", "in_proj_a", "dt_bias", "A_log")},
            "linear_attn.out_proj": ROW, "linear_attn.norm": SUMMED,
            **{f"linear_attn.{n}": HEADS for n in ("hk", "hv", "key_dim", "value_dim")}}
QWEN3_5_TP_PLAN = {
    **QWEN3_TOWER,
    DeltaNetBlock: {**DELTANET, **MLP},
    DeltaNetMoeBlock: {**DELTANET, **MOE_MLP},
    # q_proj [H, 2, Dh]: a contiguous 1/TP is H / TP heads with their gates
    GatedAttentionBlock: {**DECODER, **QK_NORMS},
    GatedAttentionMoeBlock: {**ATTENTION, **QK_NORMS, **MOE_MLP},
    **VOCAB_ENDS,
    **MOE_VOCAB_ENDS,
    SIZES: _hybrid_sizes,
    **sequence_plan(Qwen3Embed, (DeltaNetBlock, GatedAttentionBlock, DeltaNetMoeBlock, GatedAttentionMoeBlock),
                    Qwen35FinalNorm),
}

# Gemma 3 (mmpipe.model.gemma3): the decoder split as Qwen3's, sliding and global blocks alike (the window and the
# image blocks are a mask over positions, the rotary base a per-head rotation: each rank's heads run unchanged); the
# sandwich norms (input / post-attention / pre- and post-feedforward) act on the whole [.., D] rows after o / down's
# all-reduce, so they stay replicated; the q / k norms (Gemma RMSNorm over one head's width) are `summed`. The
# embedding by vocabulary: Gemma3Embed scales the summed lookup by sqrt(D) after the all-reduce (a scale of a sum is
# the sum of the scaled rows), and the tied head reads its vocab slice (transformers' Gemma 3 has no final logit
# soft-cap: final_logit_softcapping None, Gemma 2's 30.0 dropped). The SigLIP tower and the pooled projector are
# replicated, as LLaVA's: fixed 896-px crops (4096 patches pooled to 256 tokens), 0.4 B of gemma-3-4b's 4.3 B.
_GEMMA3_BLOCK = {**DECODER, **QK_NORMS}
GEMMA3_TP_PLAN = {Gemma3Block: _GEMMA3_BLOCK, Gemma3SlidingBlock: _GEMMA3_BLOCK,
                  Gemma3Embed: {"embed_tokens": VOCAB}, **VOCAB_ENDS,
                  # --sequence-parallel: the sandwich norms on 1/TP of the positions, as any norm of the region
                  **sequence_plan(Gemma3Embed, (Gemma3Block, Gemma3SlidingBlock), Gemma3FinalNorm)}


def _gemma4_block(block) -> dict:
    """A Gemma 4 block's split, read from the built block: its attention as the decoder's with the q / k norms summed,
    but a shared layer (mode "reuse") has no k / v projections (it attends to its producer's K/V field, which holds
    the producer rank's kv heads: `kv` becomes this rank's count on both) and a full layer under k_eq_v no v_proj
    (v is k's projection, split with it); the GELU-tanh MLP (double width on shared layers) column then row; the MoE
    blocks' experts Megatron's expert-TP way (EXPERTS), their router replicated. The per-layer input gate
    (D -> P) and projection (P -> D) stay replicated: small (E2B: 2 x 1536 x 256 a layer) and their P-wide product
    is normed over the whole D after, so a split would cost an all-reduce for 0.4 M parameters."""
    a = block.self_attn
    attention = {"self_attn": ENTRY, "self_attn.q_proj": COLUMN, "self_attn.q_norm": SUMMED,
                 "self_attn.o_proj": ROW, "self_attn.n_heads": HEADS, "self_attn.kv": KV_HEADS}
    if not a.shared:
        attention.update({"self_attn.k_proj": KV, "self_attn.k_norm": SUMMED,
                          **({} if a.k_is_v else {"self_attn.v_proj": KV})})
    return {**attention, **MLP, **({"experts": EXPERTS, "": ROUTE_POSITIONS} if block.sparse else {})}


def _sequence_feed_forward(self, x, real):
    """Gemma4Block.feed_forward on this rank's positions (SP): the real-position mask cut to them, the MoE layer's
    statistics summed over TP, as SparseMoe's (_sequence_moe_forward; module docstring)."""
    y, stats = type(self).feed_forward(self, x, _positions(real, self.tp_shard))
    return y, reduce_from_tp(stats, self.tp_shard)


def _route_positions(block, shard: Shard) -> None:
    if shard.sequence:
        block.tp_shard = shard
        block.feed_forward = types.MethodType(_sequence_feed_forward, block)


# a Gemma 4 MoE block's own mark (its router and experts are the block's, not a SparseMoe's): under SP its statistics
ROUTE_POSITIONS = Own(_route_positions, lambda block: {})


def _kv_width_at(sliding: bool, cfg, tp: int) -> int:
    """A shared K/V field's floats a position on one TP rank: 2 x its kv heads (H_kv / TP; 1 where fewer than TP,
    the rank's one) x Dh, e.g. gemma-4-e4b's full layers at TP 2: 2 x 2 / 2 x 512 = 1024 of 2048."""
    t = cfg.text
    kv = t.layer_kv_heads(sliding)
    return 2 * (kv // tp if kv % tp == 0 else 1) * t.layer_head_dim(sliding)


def _gemma4_sizes(cfg) -> tuple:
    t = cfg.text
    return moe_sizes(cfg) + ((("per-layer input vocabulary (text.ple_vocab)", t.ple_vocab),) if t.ple_dim else ())


# Gemma 4 (mmpipe.model.gemma4): every block class (sliding / global x plain / store / shared, dense or MoE) by
# _gemma4_block; Gemma4Embed's token table and its per-layer input table by vocabulary (E2B's per-layer table,
# 262,144 x 35 x 256 = 2.3 B parameters, is its largest tensor; its lookup's all-reduce is [L, n_layers x P], once
# a micro-batch); the heads by vocabulary, the soft-cap cap x tanh(logits / cap) elementwise on each rank's slice.
# The tower replicated, as Gemma 3's: its images fit a fixed soft-token budget (0.15-0.55 B parameters).
# --sequence-parallel: the embedding scatters the row and its per-layer inputs (a per-position field:
# tensor_parallel._scattered), every block, the final norm and the heads on 1/TP of the positions; a K/V producer's
# field is made inside its attention region from the gathered row (this rank's kv heads, every position), so its
# readers attend to it unchanged; the MoE blocks route their positions (ROUTE_POSITIONS, EXPERTS).
GEMMA4_TP_PLAN = {
    **{cls: _gemma4_block for cls in (*GEMMA4_BLOCKS.values(), *GEMMA4_MOE_BLOCKS.values())},
    # the per-layer table where the model has one (E2B / E4B; not 26B-A4B / 31B)
    Gemma4Embed: lambda e: {"embed_tokens": VOCAB, **({"embed_tokens_per_layer": VOCAB} if e.ple else {})},
    Gemma4Head: {"lm_head": VOCAB}, gemma4_tied_head: {"": VOCAB},
    Gemma4MoeHead: {"lm_head": VOCAB}, Gemma4TiedMoeHead: {"": VOCAB},
    SIZES: _gemma4_sizes,
    CARRIED: {"kv_sliding": functools.partial(_kv_width_at, True), "kv_full": functools.partial(_kv_width_at, False)},
    **sequence_plan(Gemma4Embed, (*GEMMA4_BLOCKS.values(), *GEMMA4_MOE_BLOCKS.values()), Gemma4FinalNorm,
                    heads=(Gemma4Head, gemma4_tied_head, Gemma4MoeHead, Gemma4TiedMoeHead)),
}


# The cross-attention family (mmpipe.model.cross_attention; family moondream, fusion cross_attention): its text
# embedding, decoder blocks and head are the prefix family's (mmpipe.families.MOONDREAM_TP_PLAN: Phi's parallel block,
# the vocab ends). Each gated cross-attention block splits Megatron's way by its cross-attention heads: q (the text's
# queries) by column, kv (the image's keys | values, rows [2, H, Dh]) Fused(2), this rank's heads of k and of v, so a
# rank's query heads read its own image heads; proj by row (the heads' partial outputs summed once); the gated MLP's
# fc1 by column, fc2 by row: two all-reduces of [B, T, D] forward, as a decoder block. q and kv read different inputs
# (ln1 of the text, the projected image), so each enters the TP region on its own copy (no `entry`, which copies a
# module's first input only): backward the text's [B, T, D] and the image's [B x M, N, D] gradients all-reduced, the
# image's every block, as every block reads it. The tanh gates (one scalar each) stay whole and unsummed: each
# multiplies an output already summed over TP (proj's, fc2's), whole on every rank, so each rank's gradient of it is
# the whole one, as a norm's. The mask (a text position to its own sample's image slots) is per position, the same on
# every rank. The image field [B x M, N, D] is whole on each TP rank, so a stage boundary before the last block sends
# it from each TP rank to the same TP rank of the next stage, as the hidden state.
# The tower and projector replicated, as moondream's: they run once per image on a fixed crop (moondream2's SigLIP:
# 0.4 B of 1.9 B on 378 px; xattn-base's ViT-B/16: 86 M of 244 M on 224 px, 196 tokens: 2 x 86 M x 196 = 34 GFLOP an
# image forward, where its 12 decoder and 3 cross-attention blocks cost 2 x 106 M x 512 = 109 GFLOP a 512-position
# row), and Flamingo's recipe freezes it (--freeze vision: no backward); split, it would all-reduce [N, 768] twice a
# block each way.
CROSS_ATTN_BLOCK = {"attn.q": COLUMN, "attn.kv": Fused(2), "attn.proj": ROW, "attn.n_heads": HEADS,
                    "mlp.fc1": COLUMN, "mlp.fc2": ROW}


def _cross_attention_sizes(decoder: dict, cfg) -> tuple:
    """The prefix family's counts (its fused qkv's kv heads) and the cross-attention heads where the config sets its
    own (0: the decoder's heads, checked already)."""
    own = (("cross-attention heads (cross_attn_heads)", cfg.cross_attn_heads),) if cfg.cross_attn_heads else ()
    return tp_sizes(cfg, decoder) + own


def cross_attention_plan(decoder: dict) -> dict:
    """The cross-attention family's plan from the prefix family's (`decoder`): its DecoderBlock, TextEmbed and LMHead
    entries, the text embedding's table by vocabulary, each CrossAttnBlock as CROSS_ATTN_BLOCK. No SEQUENCE entry
    (--sequence-parallel refused, one line: no layer scatters this list's row)."""
    return {**{k: v for k, v in decoder.items() if k not in (SIZES, SEQUENCE)}, CrossAttnTextEmbed: {"wte": VOCAB},
            CrossAttnBlock: CROSS_ATTN_BLOCK, SIZES: functools.partial(_cross_attention_sizes, decoder)}
