"""What one layer costs per sample, by kind: the rules mmpipe.planning.costmodel applies to every
layer of a model's list. A family names the rule of each of its layer classes
(mmpipe.model.families); how the numbers are counted is in costmodel's docstring.

A rule sees the model config, the layer's parameter count and the tokens per sample: `n` on the
vision side (the tower's tokens), `seq` in the decoder (its positions: image + text). LLaVA's
layers use the rules of the moondream layers of the same shape, under the same names.
"""
from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from ..config import ModelConfig


@dataclass(frozen=True)
class Cost:
    tokens: int   # sequence positions per sample the layer runs on
    fwd: float    # forward FLOPs per sample
    act: float    # activation elements kept for the backward, per sample
    fp32: float   # of which always fp32 (LN and softmax statistics, the loss's logits)
    out: float    # output elements per sample: what a boundary after the layer sends


@dataclass(frozen=True)
class LayerRule:
    name: str  # the layer kind it is reported as (mmpipe plan, the partition summary)
    cost: Callable[[ModelConfig, int, int, int], Cost]  # (cfg, params, n, seq) -> Cost
    takes: str  # its input, for profiling: pixels, vision, image, sequence or sequence+image
    embedding: bool = False   # pixels / token ids in: no input gradient, only weight gradients
    uses_image: bool = False  # reads the image beside the sequence (the stage tuple's `vision`)
    per_crop: bool = False    # runs once per crop slot: moondream multi-crop multiplies it by 1 + max_crops

    def cost_of(self, cfg: ModelConfig, params: int, n: int, seq: int) -> Cost:
        """The layer's cost per sample; a per-crop layer of a multi-crop model (vision.max_crops > 0)
        encodes 1 + max_crops crops of n tokens each (moondream2: 13 x 729 = 9477 tokens per sample),
        so every term scales by the slots (attention too: each crop attends only within itself)."""
        c, k = self.cost(cfg, params, n, seq), cfg.vision.crop_slots
        if not self.per_crop or k == 1:
            return c
        return Cost(c.tokens * k, c.fwd * k, c.act * k, c.fp32 * k, c.out * k)


def _patch_embed(cfg, params, n, seq):  # the patch matrix the linear saw
    return Cost(n, 2.0 * params * n, n * cfg.vision.patch_dim, 0.0, n * cfg.vision.dim)


def _vision_block(cfg, params, n, seq):
    v = cfg.vision
    return Cost(n, 2.0 * params * n + 4.0 * n * n * v.dim, (9 * v.dim + 2 * v.ff_dim) * n + (4 + v.n_heads) * n,
                (4 + v.n_heads) * n, n * v.dim)


def _vision_norm(cfg, params, n, seq):
    return Cost(n, 2.0 * params * n, cfg.vision.dim * n + 2 * n, 2 * n, n * cfg.vision.dim)


def _projector(cfg, params, n, seq):
    # keeps fc1's input (moondream2: global + pooled local crop features, 2 x 1152), fc1 out, gelu out
    return Cost(n, 2.0 * params * n, cfg.vision.proj_in_dim * n + 2 * cfg.proj_inner_dim * n, 0.0, n * cfg.text.dim)


def _text_embed(cfg, params, n, seq):  # a lookup, not a matmul; token ids are all it keeps
    return Cost(seq, float(cfg.text.dim * seq), 0.0, 0.0, seq * cfg.text.dim)


def _cross_attn_block(cfg, params, n, seq):
    """Text queries (seq = T) over N image keys, gated: q and proj over T, k v over N, q k^T and attn v
    (4 T N D), the gated MLP over T. Kept: besides the projections, each position's own-sample mask
    over the image keys (T x N, as SDPA's float mask) and its per-position gate (3 T)."""
    t, h = cfg.text, cfg.cross_attn_heads or cfg.text.n_heads
    fwd = 2.0 * 2 * t.dim * t.dim * (seq + n) + 4.0 * seq * n * t.dim + 2.0 * 2 * t.dim * t.ff_dim * seq
    act = (9 * t.dim + 2 * t.ff_dim + 7 + h) * seq + 3 * t.dim * n + seq * n
    return Cost(seq, fwd, act, (4 + h) * seq, seq * t.dim)


def _row_geometry(seq: int, rot_dim: int) -> tuple[float, float]:
    """(act, fp32) a decoder block keeps for its row's own geometry (mmpipe.model.attention.row_geometry):
    SDPA's per-row L x L mask, as the query's dtype, and the fp32 rotary cos and sin at each sample's own
    positions, 2 x L x rot_dim (e.g. tiny at L = 28, rot_dim 8: 784 + 448 per row)."""
    return seq * seq + 2.0 * rot_dim * seq, 2.0 * rot_dim * seq


def _phi_block(cfg, params, n, seq):
    t = cfg.text
    act, fp32 = _row_geometry(seq, t.rotary_dim)
    return Cost(seq, 2.0 * params * seq + 4.0 * seq * seq * t.dim,
                (7 * t.dim + 2 * t.ff_dim) * seq + (2 + t.n_heads) * seq + act, (2 + t.n_heads) * seq + fp32,
                seq * t.dim)


def _llama_block(cfg, params, n, seq):  # the Phi block's, + gate/up/product of SwiGLU; rotary on whole heads
    t = cfg.text
    act, fp32 = _row_geometry(seq, t.head_dim)
    return Cost(seq, 2.0 * params * seq + 4.0 * seq * seq * t.dim,
                (7 * t.dim + 3 * t.ff_dim) * seq + (2 + t.n_heads) * seq + act, (2 + t.n_heads) * seq + fp32,
                seq * t.dim)


def _final_norm(cfg, params, n, seq):  # RMSNorm
    return Cost(seq, 2.0 * params * seq, cfg.text.dim * seq + seq, seq, seq * cfg.text.dim)


def _lm_head(cfg, params, n, seq):  # + the fp32 logits of the loss's log-softmax
    t = cfg.text
    return Cost(seq, 2.0 * params * seq, 2 * t.dim * seq + 2 * seq + t.vocab_size * seq,
                2 * seq + t.vocab_size * seq, seq * t.vocab_size)


PATCH_EMBED = LayerRule("PatchEmbed", _patch_embed, "pixels", embedding=True, per_crop=True)
VISION_BLOCK = LayerRule("VisionBlock", _vision_block, "vision", per_crop=True)
VISION_NORM = LayerRule("VisionNorm", _vision_norm, "vision", per_crop=True)
PROJECTOR = LayerRule("Projector", _projector, "vision")
TEXT_EMBED = LayerRule("TextEmbed", _text_embed, "image", embedding=True)
# moves the image into the stage tuple: from here to the last CrossAttnBlock every boundary carries it
CROSS_ATTN_TEXT_EMBED = LayerRule("CrossAttnTextEmbed", _text_embed, "image", embedding=True, uses_image=True)
CROSS_ATTN_BLOCK = LayerRule("CrossAttnBlock", _cross_attn_block, "sequence+image", uses_image=True)
DECODER_BLOCK = LayerRule("DecoderBlock", _phi_block, "sequence")
LLAMA_BLOCK = LayerRule("LlamaBlock", _llama_block, "sequence")
FINAL_NORM = LayerRule("FinalNorm", _final_norm, "sequence")
LM_HEAD = LayerRule("LMHead", _lm_head, "sequence")
