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

The MoE variants (Qwen3-VL-MoE, Qwen3.5-MoE) have no plan here yet: --tp refuses them (mmpipe.run_config).
"""
from __future__ import annotations

from .llava import LMHeadLinear, SwiGLU, TowerMLP, tied_head
from .qwen2_vl import QwenBlock, QwenEmbed, QwenMerger, QwenVisionBlock
from .qwen3_5 import DeltaNetBlock, GatedAttentionBlock
from .qwen3_vl import DEEPSTACK_MERGERS, Qwen3Block, Qwen3Embed, Qwen3Merger, Qwen3VisionBlock
from .tensor_parallel import COLUMN, HEADS, KV, KV_HEADS, ROW, SIZES, SUMMED, VOCAB, Fused

ATTENTION = {"self_attn.q_proj": COLUMN, "self_attn.k_proj": KV, "self_attn.v_proj": KV, "self_attn.o_proj": ROW,
             "self_attn.n_heads": HEADS, "self_attn.kv_heads": KV_HEADS}
MLP = {"mlp.gate_proj": COLUMN, "mlp.up_proj": COLUMN, "mlp.down_proj": ROW}
DECODER = {**ATTENTION, **MLP}  # LLaVA's LlamaBlock split
# Qwen3's and Qwen3.5's q / k norms, over each head's width: whole on each rank, their gradients summed over TP
QK_NORMS = {"self_attn.q_norm": SUMMED, "self_attn.k_norm": SUMMED}
VOCAB_ENDS = {LMHeadLinear: {"lm_head": VOCAB}, tied_head: {"": VOCAB}}
# a tower block's fused attention: [q | k | v] each split by heads, proj by row
TOWER_ATTENTION = {"attn.qkv": Fused(3), "attn.proj": ROW,
                   **{f"attn.{n}": HEADS for n in ("n_heads", "n_kv_heads", "kv_dim")}}
PATCH_MERGER = {"linear_fc1": COLUMN, "linear_fc2": ROW}


def _tower_sizes(cfg) -> tuple:
    v = cfg.vision
    return (("vision attention heads (vision.n_heads)", v.n_heads), ("vision FFN width (vision.ff_dim)", v.ff_dim),
            ("merger width (vision.dim x merge_size^2)", v.dim * v.merge_size ** 2))


def _hybrid_sizes(cfg) -> tuple:
    t = cfg.text
    return _tower_sizes(cfg) + (("Gated DeltaNet key heads (text.linear_key_heads)", t.linear_key_heads),
                                ("Gated DeltaNet value heads (text.linear_value_heads)", t.linear_value_heads))


QWEN2_VL_TP_PLAN = {
    # Qwen2-VL's tower MLP is fc1 / fc2, Qwen2.5-VL's SwiGLU with bias (vision.mlp): split by the MLP's class
    QwenVisionBlock: {**TOWER_ATTENTION, "mlp": {SwiGLU: {"gate_proj": COLUMN, "up_proj": COLUMN, "down_proj": ROW},
                                                 TowerMLP: {"fc1": COLUMN, "fc2": ROW}}},
    QwenMerger: {"mlp.0": COLUMN, "mlp.2": ROW},
    QwenEmbed: {"embed_tokens": VOCAB},
    QwenBlock: DECODER,
    **VOCAB_ENDS,
    SIZES: _tower_sizes,
}

QWEN3_TOWER = {Qwen3VisionBlock: {**TOWER_ATTENTION, "mlp.linear_fc1": COLUMN, "mlp.linear_fc2": ROW},
               Qwen3Merger: PATCH_MERGER, Qwen3Embed: {"embed_tokens": VOCAB}}

QWEN3_VL_TP_PLAN = {
    **QWEN3_TOWER,
    **{merger: PATCH_MERGER for merger in DEEPSTACK_MERGERS},  # DeepstackAdd<k> has no weights
    Qwen3Block: {**DECODER, **QK_NORMS},
    **VOCAB_ENDS,
    SIZES: _tower_sizes,
}

_DELTANET_QKV = Fused(("key_dim", "key_dim", "value_dim"))  # the owner's widths, read before they are divided
QWEN3_5_TP_PLAN = {
    **QWEN3_TOWER,
    DeltaNetBlock: {"linear_attn.in_proj_qkv": _DELTANET_QKV, "linear_attn.conv1d": _DELTANET_QKV,
                    **{f"linear_attn.{n}": COLUMN for n in ("in_proj_z", "in_proj_b", "in_proj_a", "dt_bias",
                                                            "A_log")},
                    "linear_attn.out_proj": ROW, "linear_attn.norm": SUMMED,
                    **{f"linear_attn.{n}": HEADS for n in ("hk", "hv", "key_dim", "value_dim")}, **MLP},
    # q_proj [H, 2, Dh]: a contiguous 1/TP is H / TP heads with their gates
    GatedAttentionBlock: {**DECODER, **QK_NORMS},
    **VOCAB_ENDS,
    SIZES: _hybrid_sizes,
}
