"""The Gemma 3 family (transformers' Gemma3ForConditionalGeneration): SigLIP tower, pooled projector, a Gemma 3
decoder whose image tokens attend to each other both ways and whose layers are 5 sliding-window to 1 global.

Layer list (`gemma3_specs`), gemma-3-4b as the example:

    VisionEmbed                 pixels [B, 3, 896, 896] -> [B, 4096, 1152] (SigLIP: conv 14 px patches + positions)
    TowerBlock x 27             SigLIP encoder layers (mmpipe.model.llava's, bidirectional)
    Gemma3Projector             post-LayerNorm, 4 x 4 average pool (64 x 64 -> 16 x 16 = 256 tokens), Gemma RMSNorm,
                                x @ W [1152, 2560]: [B, 256, 2560]
    Gemma3Embed                 embeds input_ids x sqrt(2560) (bf16-rounded like HF's scale), then the 256 features
                                over each image's <image_soft_token> placeholders
    Gemma3SlidingBlock x 5,     sandwich-normed blocks (pre and post norms around attention and MLP), QK-norm, GQA,
    Gemma3Block x 1, ...        GELU-tanh MLP; a sliding block sees 1024 positions back and rotates by base 1e4,
                                a global one sees its whole sample and rotates by base 1e6 at linear factor 8
    Gemma3FinalNorm             Gemma RMSNorm (x (1 + w))
    head                        the embedding's matrix (TiedLayerSpec), or an untied LMHeadLinear

Attention in a row (mmpipe.model.attention.row_attention): causal within each sample, never across samples, and
the positions of one image block (contiguous image_token_id placeholders: `image_blocks`) see each other both
ways, as transformers' token_type_ids mask does; a sliding layer then keeps only the pairs less than
sliding_window apart (transformers' AND(sliding window, OR(causal, block))). Generation keeps a sliding layer's
last sliding_window - 1 keys and values only (`Gemma3Block.decode`).
"""
from __future__ import annotations

import math
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from ..config import ModelConfig
from . import costs
from .attention import apply_partial_rotary, attend, cached_attention, row_attention, row_cached, row_positions
from .llava import ClipVision, FinalNorm, LlamaText, LlavaEmbed, LMHeadLinear, TowerBlock, VisionEmbed, tied_head
from .rows import place_images
from .stage import StageTuple, unpack_in, unpack_out

# ---- its model JSON's sections and their checks ----


@dataclass(frozen=True)
class Gemma3Vision(ClipVision):
    """SigLIP's tower (every layer, then its post-LayerNorm) and the projector's pooling to mm_tokens soft tokens
    per image: 896 px / 14 = 64 x 64 patches, average-pooled 4 x 4 to 16 x 16 = 256."""
    mm_tokens: int = 256
    # Pan-and-scan (transformers' Gemma3ImageProcessor do_pan_and_scan, off in every released processor config): an
    # image whose long side is at least min_ratio x its short one is also cut into 2..max_crops crops of at least
    # min_crop px along it, each a slot of its own beside the whole image (mmpipe.data.gemma3.Gemma3PanScan)
    pan_and_scan: bool = False
    pan_and_scan_min_crop: int = 256
    pan_and_scan_max_crops: int = 4
    pan_and_scan_min_ratio: float = 1.2

    @property
    def pooled_side(self) -> int:  # e.g. sqrt(256) = 16
        return math.isqrt(self.mm_tokens)

    @property
    def n_features(self) -> int:  # <image_soft_token> placeholders per image
        return self.mm_tokens


@dataclass(frozen=True)
class Gemma3Text(LlamaText):
    """Gemma 3's decoder: every sliding_pattern-th layer global (5 sliding, then 1 global), sliding layers
    attending sliding_window positions back with their own rotary base, global ones at rope_theta / rope_factor
    (linear scaling), attention scaled by query_pre_attn_scalar^-0.5, and tied embeddings by default."""
    partial_rotary_factor: float = 1.0
    tie_embeddings: bool = True
    sliding_window: int = 1024
    sliding_pattern: int = 6
    local_rope_theta: float = 10000.0
    rope_factor: float = 1.0
    query_pre_attn_scalar: int = 256

    def is_sliding(self, i: int) -> bool:
        """Decoder layer i is a sliding one: transformers' layer_types, (i + 1) % pattern != 0."""
        return bool((i + 1) % self.sliding_pattern)


def gemma3_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    v, t = cfg.vision, cfg.text
    side = v.pooled_side
    return [
        (v.kind == "siglip", "vision.kind", f"'{v.kind}': Gemma 3's tower is SigLIP (siglip)"),
        (v.feature_layer == -1 and v.feature_select == "full", "vision.feature_layer",
         "Gemma 3's projector reads the tower's last state, every patch (-1, full)"),
        (side * side == v.mm_tokens and side > 0 and v.grid % side == 0, "vision.mm_tokens",
         f"{v.mm_tokens} must be a square whose side divides the {v.grid} x {v.grid} patch grid"),
        (v.pan_and_scan_min_crop >= 1 and v.pan_and_scan_max_crops >= 1 and v.pan_and_scan_min_ratio > 0,
         "vision.pan_and_scan_min_crop", f"{v.pan_and_scan_min_crop} / pan_and_scan_max_crops "
         f"{v.pan_and_scan_max_crops} must be >= 1, pan_and_scan_min_ratio {v.pan_and_scan_min_ratio} > 0"),
        (t.n_heads % t.kv_heads == 0, "text.n_kv_heads", f"{t.n_kv_heads} does not divide n_heads {t.n_heads}"),
        (t.partial_rotary_factor == 1.0, "text.partial_rotary_factor", "Gemma 3 rotates whole heads (1.0)"),
        (t.sliding_window >= 1 and t.sliding_pattern >= 1, "text.sliding_window",
         f"{t.sliding_window} / sliding_pattern {t.sliding_pattern} must be >= 1"),
        (t.rope_factor > 0, "text.rope_factor", f"{t.rope_factor} must be > 0"),
        (t.local_rope_theta > 0, "text.local_rope_theta", f"{t.local_rope_theta} must be > 0"),
        (t.query_pre_attn_scalar > 0, "text.query_pre_attn_scalar", f"{t.query_pre_attn_scalar} must be > 0"),
        (0 <= cfg.image_token_id < t.vocab_size, "image_token_id",
         f"{cfg.image_token_id} is not a token id of the {t.vocab_size}-token vocabulary"),
        # <start_of_image> / <end_of_image>, around every image block (mmpipe.data.gemma3)
        (0 <= cfg.vision_start_id < t.vocab_size, "vision_start_id",
         f"{cfg.vision_start_id} is not a token id of the {t.vocab_size}-token vocabulary"),
        (0 <= cfg.vision_end_id < t.vocab_size, "vision_end_id",
         f"{cfg.vision_end_id} is not a token id of the {t.vocab_size}-token vocabulary"),
    ]


# ---- the layers ----


class GemmaRMSNorm(nn.Module):
    """Gemma's RMSNorm: in fp32, x / rms(x) x (1 + w), w starting at 0, cast back (HF's Gemma3RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.zeros(dim))

    def forward(self, x):
        y = x.float()
        y = y * torch.rsqrt(y.pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class Gemma3Projector(nn.Module):
    """The tower's post-LayerNorm, then [B, g^2, Dv] -> avg-pool k x k on the g x g grid -> [B, (g/k)^2, Dv],
    Gemma RMSNorm, x @ mm_input_projection_weight [Dv, Dt] (no bias)."""
    group = "projector"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.grid, self.kernel = v.grid, v.grid // v.pooled_side  # e.g. 64 patches a side, 64 / 16 = 4
        self.post_layernorm = nn.LayerNorm(v.dim, eps=v.ln_eps)
        self.mm_soft_emb_norm = GemmaRMSNorm(v.dim, v.ln_eps)
        self.mm_input_projection_weight = nn.Parameter(torch.randn(v.dim, cfg.text.dim) * 0.02)

    def forward(self, args):
        t = unpack_in(self, args)
        x = self.post_layernorm(t.hidden)  # [B, g^2, Dv], row-major over the grid
        B, _, D = x.shape
        x = F.avg_pool2d(x.transpose(1, 2).reshape(B, D, self.grid, self.grid), self.kernel)
        x = self.mm_soft_emb_norm(x.flatten(2).transpose(1, 2))
        return t._replace(hidden=(x @ self.mm_input_projection_weight).type_as(t.hidden)).pack()


class Gemma3Embed(LlavaEmbed):
    """Token embedding x sqrt(dim) (HF casts the scale to the weight's dtype: sqrt(2560) = 50.6 in bf16), then the
    image features over the placeholders (unscaled, as HF's masked_scatter after its scaled lookup)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.scale = cfg.text.dim ** 0.5

    def embed(self, ids):
        w = self.embed_tokens.weight
        return self.embed_tokens(ids) * torch.tensor(self.scale, dtype=w.dtype)

    def forward(self, args):
        t = unpack_in(self, args)
        emb = self.embed(t.input_ids)
        return t._replace(hidden=place_images(emb, t.input_ids, t.hidden, t.has_image, self.image_token_id)).pack()

    def decode(self, t: StageTuple, cache: dict, start: int):
        return unpack_out(self, self(t.pack())) if start == 0 else t._replace(hidden=self.embed(t.input_ids))


def image_blocks(input_ids: torch.Tensor, token: int) -> torch.Tensor:
    """long [B, L]: k > 0 for the k-th run of contiguous `token` placeholders in the row (one image's block), 0
    elsewhere; once per input_ids tensor (row_cached), so every layer's row_attention finds the same tensor.
    E.g. ids [1 9 9 5 9 9 2] with token 9 -> [0 1 1 0 2 2 0]."""
    def build():
        img = input_ids == token
        starts = img.clone()
        starts[:, 1:] &= ~img[:, :-1]
        return starts.long().cumsum(-1) * img
    return row_cached((input_ids,), ("image_blocks", token), build)


def gemma_rotary(positions: torch.Tensor, dim: int, theta: float, factor: float):
    """cos, sin [B, 1, L, dim] at positions [B, L]: rotate-half RoPE of base theta, linear scaling (inv_freq /
    factor), in fp32, as HF's Gemma3RotaryEmbedding."""
    inv = 1.0 / (theta ** (torch.arange(0, dim, 2, device=positions.device, dtype=torch.float32) / dim)) / factor
    emb = positions[..., None].float() * inv
    emb = torch.cat([emb, emb], -1)
    return emb.cos()[:, None], emb.sin()[:, None]


class Gemma3Attention(nn.Module):
    def __init__(self, cfg: ModelConfig, sliding: bool):
        super().__init__()
        t = cfg.text
        self.n_heads, self.kv_heads, self.head_dim = t.n_heads, t.kv_heads, t.head_dim
        self.window = t.sliding_window if sliding else None
        self.theta, self.factor = (t.local_rope_theta, 1.0) if sliding else (t.rope_theta, t.rope_factor)
        # SDPA scales by head_dim^-0.5; Gemma by query_pre_attn_scalar^-0.5 (27B: 168 = 5376 / 32, heads of 128)
        self.q_gain = (t.head_dim / t.query_pre_attn_scalar) ** 0.5
        self.q_proj = nn.Linear(t.dim, t.n_heads * t.head_dim, bias=t.qkv_bias)
        self.k_proj = nn.Linear(t.dim, t.kv_heads * t.head_dim, bias=t.qkv_bias)
        self.v_proj = nn.Linear(t.dim, t.kv_heads * t.head_dim, bias=t.qkv_bias)
        self.o_proj = nn.Linear(t.n_heads * t.head_dim, t.dim, bias=t.qkv_bias)
        self.q_norm = GemmaRMSNorm(t.head_dim, t.ln_eps)
        self.k_norm = GemmaRMSNorm(t.head_dim, t.ln_eps)

    def forward(self, x, mask, rotary, cache: dict | None = None):
        B, T, _ = x.shape
        q = self.q_norm(self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2))
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2))
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_partial_rotary(q, *rotary), apply_partial_rotary(k, *rotary)
        q = q * self.q_gain
        if cache is None:
            out = attend(q, k, v, mask)
        else:
            out = cached_attention(q, k, v, cache, mask)
            if self.window:  # the next query (one position on) sees only the last window - 1 of these keys
                cache["k"], cache["v"] = cache["k"][:, :, -(self.window - 1):], cache["v"][:, :, -(self.window - 1):]
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class Gemma3MLP(nn.Module):
    def __init__(self, dim: int, ff_dim: int):
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, ff_dim, bias=False), nn.Linear(dim, ff_dim, bias=False)
        self.down_proj = nn.Linear(ff_dim, dim, bias=False)

    def forward(self, x):
        return self.down_proj(F.gelu(self.gate_proj(x), approximate="tanh") * self.up_proj(x))


class Gemma3Block(nn.Module):
    """A global-attention decoder layer: x + post_attn(attn(in(x))), then x + post_ff(mlp(pre_ff(x)))."""
    group = "text"
    sliding = False

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t = cfg.text
        self.image_token_id = cfg.image_token_id
        self.input_layernorm = GemmaRMSNorm(t.dim, t.ln_eps)
        self.self_attn = Gemma3Attention(cfg, self.sliding)
        self.post_attention_layernorm = GemmaRMSNorm(t.dim, t.ln_eps)
        self.pre_feedforward_layernorm = GemmaRMSNorm(t.dim, t.ln_eps)
        self.mlp = Gemma3MLP(t.dim, t.ff_dim)
        self.post_feedforward_layernorm = GemmaRMSNorm(t.dim, t.ln_eps)

    def forward(self, args):
        t = unpack_in(self, args)
        return t._replace(hidden=self.run(t, 0)).pack()

    def decode(self, t: StageTuple, cache: dict, start: int):
        """Cached generation: the new positions start.. (one at a time) see the keys cached before them (a sliding
        layer's last window - 1), prefill (start 0) the row's mask."""
        return t._replace(hidden=self.run(t, start, cache))

    def run(self, t: StageTuple, start: int, cache: dict | None = None):
        a = self.self_attn
        if start:
            T = t.segments.shape[-1]
            pos = torch.arange(start, start + T, device=t.segments.device).expand(t.segments.shape[0], T)
            mask, rotary = None, gemma_rotary(pos, a.head_dim, a.theta, a.factor)
        else:
            rotary = row_cached((t.segments,), ("gemma_rotary", a.head_dim, a.theta, a.factor),
                                lambda: gemma_rotary(row_positions(t.segments), a.head_dim, a.theta, a.factor))
            mask = row_attention(t.segments, blocks=image_blocks(t.input_ids, self.image_token_id), window=a.window)
        x = t.hidden + self.post_attention_layernorm(a(self.input_layernorm(t.hidden), mask, rotary, cache))
        return x + self.post_feedforward_layernorm(self.mlp(self.pre_feedforward_layernorm(x)))


class Gemma3SlidingBlock(Gemma3Block):
    """A sliding-window decoder layer (5 of every 6): its window, its own rotary base."""
    sliding = True


class Gemma3FinalNorm(FinalNorm):
    make_norm = GemmaRMSNorm


def gemma3_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """VisionEmbed, TowerBlock x every tower layer, Gemma3Projector, Gemma3Embed, the decoder's blocks by their
    type, Gemma3FinalNorm, the head (tied to the embedding through TiedLayerSpec by default)."""
    t = cfg.text
    tied = t.tie_embeddings
    first = (TiedLayerSpec("embed", Gemma3Embed, cfg, tied_weight_attr="embed_tokens.weight") if tied
             else LayerSpec(Gemma3Embed, cfg))
    head = (TiedLayerSpec("embed", Gemma3Embed, cfg, forward_fn=tied_head, tied_weight_attr="embed_tokens.weight")
            if tied else LayerSpec(LMHeadLinear, cfg))
    blocks = [LayerSpec(Gemma3SlidingBlock if t.is_sliding(i) else Gemma3Block, cfg) for i in range(t.n_layers)]
    return ([LayerSpec(VisionEmbed, cfg)] + [LayerSpec(TowerBlock, cfg) for _ in range(cfg.vision.n_layers)]
            + [LayerSpec(Gemma3Projector, cfg), first] + blocks + [LayerSpec(Gemma3FinalNorm, cfg), head])


# ---- cost rules (mmpipe.planning.costmodel) ----


def _projector_cost(cfg, params, n, seq):
    """post-LayerNorm over the n = g^2 patches (5 FLOPs a value), the pool, the RMSNorm and the Dv x Dt matmul over
    m pooled tokens. Kept, as autograd keeps it (tests/test_gemma3.py): the LayerNorm's input and output (2 n Dv)
    and statistics (2 n), and per pooled token the pooled, normalised and normed-and-scaled values (3 Dv) and the
    RMSNorm's statistic (1)."""
    v, m = cfg.vision, cfg.vision.mm_tokens
    fwd = 5.0 * n * v.dim + n * v.dim + 2.0 * m * v.dim * cfg.text.dim
    return costs.Cost(n, fwd, 2 * n * v.dim + 2 * n + m * (3 * v.dim + 1), 2 * n + m, m * cfg.text.dim)


def _block_cost(sliding: bool):
    def cost(cfg, params, n, seq):
        """A Gemma 3 block per position: the projections (2 x params), q k^T and attn v over the keys it sees
        (min(seq, window) for a sliding layer: 4 x seq x keys x H x Dh). Kept per position, as autograd keeps it
        (tests/test_gemma3.py, a one-sample row): 10 D (x, the sandwich norms' inputs and outputs, o_proj's out, the
        residual), 5 q (q before and after its norm, after RoPE and scaling, attention out), 4 kv (k likewise, v),
        4 F (gate, gelu, up, product), 2 H + KV + 4 statistics (q / k norms, log-sum-exp, the 4 sandwich norms)
        and the rotary cos / sin (2 Dh). E.g. gemma-3-27b (D 5376, q 32 x 128, kv 16 x 128, F 21504) keeps
        10 x 5376 + 5 x 4096 + 4 x 2048 + 4 x 21504 + 64 + 16 + 4 + 256 = 168788 values a position. No L x L
        mask: CUDA's FlexAttention keeps a BlockMask; the CPU split keeps each sample's s^2 mask where it has an
        image block or a window cuts (not counted). Gemma's norms compute in fp32: in bf16 their saved values are
        fp32 copies (counted at the training dtype here)."""
        t = cfg.text
        q, kv = t.n_heads * t.head_dim, t.kv_heads * t.head_dim
        keys = min(seq, t.sliding_window) if sliding else seq
        fwd = 2.0 * params * seq + 4.0 * seq * keys * q
        stats = 2 * t.n_heads + t.kv_heads + 4
        act = (10 * t.dim + 5 * q + 4 * kv + 4 * t.ff_dim + stats + 2 * t.head_dim) * seq
        return costs.Cost(seq, fwd, act, (stats + 2 * t.head_dim) * seq, seq * t.dim)
    return cost


GEMMA3_PROJECTOR = costs.LayerRule("Gemma3Projector", _projector_cost, "vision")
GEMMA3_BLOCK = costs.LayerRule("Gemma3Block", _block_cost(False), "sequence")
GEMMA3_SLIDING_BLOCK = costs.LayerRule("Gemma3SlidingBlock", _block_cost(True), "sequence")
GEMMA3_COSTS = {VisionEmbed: costs.PATCH_EMBED, TowerBlock: costs.VISION_BLOCK, Gemma3Projector: GEMMA3_PROJECTOR,
                Gemma3Embed: costs.TEXT_EMBED, Gemma3Block: GEMMA3_BLOCK, Gemma3SlidingBlock: GEMMA3_SLIDING_BLOCK,
                Gemma3FinalNorm: costs.FINAL_NORM, LMHeadLinear: costs.LINEAR_HEAD, tied_head: costs.LINEAR_HEAD}
