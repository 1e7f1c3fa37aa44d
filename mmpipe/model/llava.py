"""The LLaVA-shaped layers: CLIP / SigLIP tower, 2-layer GELU projector, Llama / Qwen2 / Mistral decoder.

Layer list (`llava_specs`), LLaVA-1.5-7B as the example:

    VisionEmbed                  pixels [B, 3, 336, 336] -> [B, 577, 1024] (CLIP: class token + 576 patches, pre-LN)
    TowerBlock x n_blocks_used   23 of CLIP-L's 24 blocks: feature layer -2 is block 23's output
    LlavaProjector               drops the class token ('default'), 1024 -> 4096 -> 4096, GELU: [B, 576, 4096]
    LlavaEmbed                   embeds input_ids [B, L] and writes the 576 features over the <image> positions
    LlamaBlock x n_layers        RMSNorm, RoPE (config theta), GQA, SwiGLU, optional qkv bias (Qwen2)
    FinalNorm                    RMSNorm
    head                         LlavaEmbed's matrix through TiedLayerSpec when tied, else LMHeadLinear

Names of parameters follow Hugging Face's modules (q_proj, gate_proj, ...), so mmpipe.hf.llava maps
them one to one. The decoder is causal within each sample of the row (one sample: as in HF's LLaVA).
"""
from __future__ import annotations

from dataclasses import dataclass

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from ..config import VISION_ACTS, ModelConfig, TextConfig, VisionConfig
from .attention import apply_partial_rotary, attend, cached_attention, row_geometry
from .rows import mark_pair_rows, place_images
from .stage import StageTuple, unpack_in, unpack_out

# ---- its model JSON's sections and their checks (the registry entry's layout and checks) ----

@dataclass(frozen=True)
class ClipVision(VisionConfig):
    """The LLaVA family's tower: "siglip" (no class token) or "clip" (class token + pre-LayerNorm), its MLP
    activation, which hidden state feeds the projector (HF's vision_feature_layer: -2 is the second to last layer's
    output, LLaVA-1.5) and whether the first token is dropped ("default", CLIP's class token) or kept ("full")."""
    kind: str = "siglip"
    act: str = "gelu_tanh"
    feature_layer: int = -1
    feature_select: str = "full"

    @property
    def n_positions(self) -> int:  # CLIP adds the class token, e.g. 24^2 + 1 = 577
        return self.n_tokens + (self.kind == "clip")

    @property
    def n_features(self) -> int:  # LLaVA image features (= <image> placeholders), e.g. 577 - 1 = 576
        return self.n_positions - (self.feature_select == "default")

    @property
    def n_blocks_used(self) -> int:  # blocks up to the feature layer, e.g. 24 layers at -2: 23
        return self.feature_layer % (self.n_layers + 1)


@dataclass(frozen=True)
class LlamaText(TextConfig):
    """The LLaVA families' decoders (Llama / Qwen2 / Mistral): Qwen2's bias on q/k/v, input embedding and LM head
    sharing one matrix (TiedLayerSpec)."""
    qkv_bias: bool = False
    tie_embeddings: bool = False


def llava_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """The fields only the LLaVA family's layers read: its tower, grouped-query attention, <image>."""
    v, t = cfg.vision, cfg.text
    return [
        (v.kind in ("siglip", "clip"), "vision.kind", f"'{v.kind}' is not a known tower (valid: siglip, clip)"),
        (v.act in VISION_ACTS, "vision.act", f"'{v.act}' is not supported (valid: {', '.join(VISION_ACTS)})"),
        (v.feature_select in ("default", "full"), "vision.feature_select",
         f"'{v.feature_select}' (valid: default, full)"),
        (-v.n_layers - 1 <= v.feature_layer <= v.n_layers and v.n_blocks_used >= 1, "vision.feature_layer",
         f"{v.feature_layer} does not name a block's output of a {v.n_layers}-layer tower"),
        (t.n_heads % t.kv_heads == 0, "text.n_kv_heads", f"{t.n_kv_heads} does not divide n_heads {t.n_heads}"),
        (0 <= cfg.image_token_id < t.vocab_size, "image_token_id",
         f"{cfg.image_token_id} is not a token id of the {t.vocab_size}-token vocabulary"),
        (cfg.layout is not None, "fusion", f"'{cfg.fusion}': the LLaVA family places the image on placeholders"),
    ]


ACTS = {"gelu_tanh": lambda x: F.gelu(x, approximate="tanh"), "gelu": F.gelu,
        "quick_gelu": lambda x: x * torch.sigmoid(1.702 * x)}  # CLIP's


class VisionEmbed(nn.Module):
    """Conv patch embedding (+ class token and pre-LayerNorm for CLIP) + learned positions."""
    group = "vision"

    def __init__(self, cfg: ModelConfig, crop_rows: bool = False):
        super().__init__()
        v = cfg.vision
        self.clip = v.kind == "clip"
        self.crop_rows = crop_rows  # LLaVA-NeXT's: its projector lays out each row's crops (rows.mark_pair_rows)
        self.patch_embedding = nn.Conv2d(v.channels, v.dim, v.patch_size, v.patch_size, bias=not self.clip)
        self.position_embedding = nn.Embedding(v.n_positions, v.dim)
        if self.clip:
            self.class_embedding = nn.Parameter(torch.randn(v.dim) * 0.02)
            self.pre_layrnorm = nn.LayerNorm(v.dim, eps=v.ln_eps)

    def forward(self, inputs):
        t = unpack_in(self, inputs)  # hidden: pixels [B, M, C, H, W] -> B x M images
        t = mark_pair_rows(t) if self.crop_rows else t  # dpo's pairs sharing their crops
        pixels = t.hidden.flatten(0, t.hidden.dim() - 4)
        x = self.patch_embedding(pixels.to(self.patch_embedding.weight.dtype))  # [B, D, H/p, W/p]
        x = x.flatten(2).transpose(1, 2)  # [B, N_patch, D], row-major over the grid
        if self.clip:
            x = torch.cat([self.class_embedding.expand(x.shape[0], 1, -1), x], dim=1)  # [B, 1 + N_patch, D]
        x = x + self.position_embedding.weight
        if self.clip:
            x = self.pre_layrnorm(x)
        return t._replace(hidden=x).pack()


class TowerAttention(nn.Module):
    """Separate q/k/v/out projections with bias (CLIP, SigLIP), bidirectional."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        self.n_heads = n_heads
        self.q_proj, self.k_proj, self.v_proj, self.out_proj = (nn.Linear(dim, dim) for _ in range(4))

    def forward(self, x):
        B, T, D = x.shape
        q, k, v = (p(x).view(B, T, self.n_heads, -1).transpose(1, 2) for p in (self.q_proj, self.k_proj, self.v_proj))
        return self.out_proj(F.scaled_dot_product_attention(q, k, v).transpose(1, 2).reshape(B, T, D))


class TowerMLP(nn.Module):
    def __init__(self, dim: int, ff_dim: int, act: str):
        super().__init__()
        self.fc1, self.fc2, self.act = nn.Linear(dim, ff_dim), nn.Linear(ff_dim, dim), ACTS[act]

    def forward(self, x):
        return self.fc2(self.act(self.fc1(x)))


class TowerBlock(nn.Module):
    """CLIP / SigLIP encoder layer: pre-LN, x + attn(ln1 x), then x + mlp(ln2 x)."""
    group = "vision"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        v = cfg.vision
        self.layer_norm1 = nn.LayerNorm(v.dim, eps=v.ln_eps)
        self.self_attn = TowerAttention(v.dim, v.n_heads)
        self.layer_norm2 = nn.LayerNorm(v.dim, eps=v.ln_eps)
        self.mlp = TowerMLP(v.dim, v.ff_dim, v.act)

    def forward(self, args):
        t = unpack_in(self, args)
        x = t.hidden + self.self_attn(self.layer_norm1(t.hidden))
        return t._replace(hidden=x + self.mlp(self.layer_norm2(x))).pack()


class LlavaProjector(nn.Module):
    """Feature selection + linear_1, GELU, linear_2: [B, N_pos, D_vision] -> [B, N_features, D_text]."""
    group = "projector"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.drop_first = cfg.vision.feature_select == "default"
        self.linear_1 = nn.Linear(cfg.vision.dim, cfg.proj_inner_dim)
        self.linear_2 = nn.Linear(cfg.proj_inner_dim, cfg.text.dim)

    def forward(self, args):
        t = unpack_in(self, args)
        x = t.hidden[:, 1:] if self.drop_first else t.hidden
        return t._replace(hidden=self.linear_2(F.gelu(self.linear_1(x)))).pack()


class LlavaEmbed(nn.Module):
    """Token embedding; the image features replace the <image> placeholders, in order. The same
    module is the tied LM head (`tied_head`)."""
    group = "text"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.image_token_id = cfg.image_token_id
        self.embed_tokens = nn.Embedding(cfg.text.vocab_size, cfg.text.dim)
        # HF's initializer_range: at nn.Embedding's N(0, 1) a tied head starts with logits of std
        # ~sqrt(dim), a first loss of ~30 instead of ~ln(V) (llava-tiny)
        nn.init.normal_(self.embed_tokens.weight, std=0.02)

    def forward(self, args):
        t = unpack_in(self, args)  # hidden: image features [B (x M), N_feat, D]; input_ids [B, T] with placeholders
        emb = self.embed_tokens(t.input_ids)  # [B, T, D]
        return t._replace(hidden=place_images(emb, t.input_ids, t.hidden, t.has_image, self.image_token_id)).pack()

    def decode(self, t: StageTuple, cache: dict, start: int):
        return unpack_out(self, self(t.pack())) if start == 0 else t._replace(hidden=self.embed_tokens(t.input_ids))


def tied_head(embed: LlavaEmbed, args) -> torch.Tensor:
    """The LM head sharing the input embedding: hidden [B, T, D] @ E^T -> logits [B, T, V]."""
    return F.linear(args[0], embed.embed_tokens.weight)


class LlamaAttention(nn.Module):
    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t = cfg.text
        self.n_heads, self.kv_heads, self.head_dim, self.theta = t.n_heads, t.kv_heads, t.head_dim, t.rope_theta
        self.q_proj = nn.Linear(t.dim, t.n_heads * t.head_dim, bias=t.qkv_bias)
        self.k_proj = nn.Linear(t.dim, t.kv_heads * t.head_dim, bias=t.qkv_bias)
        self.v_proj = nn.Linear(t.dim, t.kv_heads * t.head_dim, bias=t.qkv_bias)
        self.o_proj = nn.Linear(t.n_heads * t.head_dim, t.dim, bias=False)

    def forward(self, x, mask, rotary, cache: dict | None = None):
        """x [B, T, D] under `mask` with RoPE `rotary` (cos, sin), both from row_geometry (training and the
        prompt: causal within each sample of the row; generation's new positions: no mask). With a cache
        (generation) the keys and values of the positions before join these."""
        B, T, _ = x.shape
        q = self.q_proj(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)
        k = self.k_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_partial_rotary(q, *rotary), apply_partial_rotary(k, *rotary)
        if cache is None:
            out = attend(q, k, v, mask)
        else:
            out = cached_attention(q, k, v, cache, mask)
        return self.o_proj(out.transpose(1, 2).reshape(B, T, -1))


class SwiGLU(nn.Module):
    def __init__(self, dim: int, ff_dim: int, bias: bool = False):  # bias: Qwen2.5-VL's vision MLP
        super().__init__()
        self.gate_proj, self.up_proj = nn.Linear(dim, ff_dim, bias=bias), nn.Linear(dim, ff_dim, bias=bias)
        self.down_proj = nn.Linear(ff_dim, dim, bias=bias)

    def forward(self, x):
        return self.down_proj(F.silu(self.gate_proj(x)) * self.up_proj(x))


class LlamaBlock(nn.Module):
    """x + attn(rms x), then x + swiglu(rms x)."""
    group = "text"

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t = cfg.text
        self.input_layernorm = nn.RMSNorm(t.dim, eps=t.ln_eps)
        self.self_attn = LlamaAttention(cfg)
        self.post_attention_layernorm = nn.RMSNorm(t.dim, eps=t.ln_eps)
        self.mlp = SwiGLU(t.dim, t.ff_dim)

    def forward(self, args):
        t = unpack_in(self, args)
        return t._replace(hidden=self.run(t, 0)).pack()

    def decode(self, t: StageTuple, cache: dict, start: int):
        """Cached generation: the new positions start.., attending to the keys and values cached before them."""
        return t._replace(hidden=self.run(t, start, cache))

    def run(self, t: StageTuple, start: int, cache: dict | None = None):
        """t.hidden [B, T, D] -> [B, T, D]: causal within each sample of the row, RoPE positions from 0 per
        sample (forward, prefill: start 0), or generation's new positions start.. (row_geometry)."""
        mask, rotary = self.geometry(t, start, cache)
        x = t.hidden + self.self_attn(self.input_layernorm(t.hidden), mask, rotary, cache)
        return x + self.mlp(self.post_attention_layernorm(x))

    def geometry(self, t: StageTuple, start: int, cache: dict | None):
        """(mask, (cos, sin)) for t's positions: row_geometry's (QwenBlock's multimodal rotary overrides it)."""
        return row_geometry(t.segments, self.self_attn.head_dim, self.self_attn.theta, start=start)


class FinalNorm(nn.Module):
    """The decoder's last norm. A family whose norm differs (Gemma's x (1 + w), Qwen3.5's zero-centred) subclasses it
    naming its norm in `make_norm`: its own class keeps its cost rule and HF names, the rest is this one."""
    group = "text"
    make_norm = nn.RMSNorm  # (dim, eps)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.norm = self.make_norm(cfg.text.dim, cfg.text.ln_eps)

    def forward(self, args):
        t = unpack_in(self, args)
        return t._replace(hidden=self.norm(t.hidden)).pack()

    def decode(self, t: StageTuple, cache: dict, start: int):
        return unpack_out(self, self(t.pack()))


class LMHeadLinear(nn.Module):
    """Untied head: hidden [B, T, D] -> logits [B, T, V], no bias."""
    group = "text"
    adapters = False  # no LoRA on the vocabulary projection (mmpipe.model.lora)

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        self.lm_head = nn.Linear(cfg.text.dim, cfg.text.vocab_size, bias=False)

    def forward(self, args):
        return self.lm_head(unpack_in(self, args).hidden)

    def decode(self, t: StageTuple, cache: dict, start: int):
        return self(t.pack())


def decoder_specs(cfg: ModelConfig, embed=None, block=None) -> list[LayerSpec]:
    """The text side of the LLaVA-shaped families: the embedding `embed` (LlavaEmbed; tied with the head
    through TiedLayerSpec when text.tie_embeddings), `block` (LlamaBlock) x n_layers, FinalNorm, the head."""
    embed, block, t = embed or LlavaEmbed, block or LlamaBlock, cfg.text
    first = (TiedLayerSpec("embed", embed, cfg, tied_weight_attr="embed_tokens.weight")
             if t.tie_embeddings else LayerSpec(embed, cfg))
    head = (TiedLayerSpec("embed", embed, cfg, forward_fn=tied_head, tied_weight_attr="embed_tokens.weight")
            if t.tie_embeddings else LayerSpec(LMHeadLinear, cfg))
    return [first] + [LayerSpec(block, cfg) for _ in range(t.n_layers)] + [LayerSpec(FinalNorm, cfg), head]


def llava_specs(cfg: ModelConfig) -> list[LayerSpec]:
    return ([LayerSpec(VisionEmbed, cfg)] + [LayerSpec(TowerBlock, cfg) for _ in range(cfg.vision.n_blocks_used)]
            + [LayerSpec(LlavaProjector, cfg)] + decoder_specs(cfg))
