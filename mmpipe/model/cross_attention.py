"""Cross-attention fusion: the decoder reads the image through gated cross-attention layers
instead of finding it spliced into its sequence (Flamingo; Llama 3.2 Vision; the first seed's
vision encoder + text model joined by cross-modal attention).

Layer list (`fusion: cross_attention`, 4 decoder blocks, cross_attn_every 2):

    PatchEmbed, VisionBlock x N, VisionNorm, Projector, CrossAttnTextEmbed,
    CrossAttnBlock, DecoderBlock, DecoderBlock, CrossAttnBlock(last), DecoderBlock, DecoderBlock, LMHead

The text embedding starts a text-only row [B, L, D] (no image positions: N = 0 in the row layout,
mmpipe.model.stage) and moves the projected images [B x M, N_img, D] into the stage tuple's `vision`
field; every CrossAttnBlock reads it there, and the last one drops it, so no boundary after it
carries the image. Each text position attends to the images of its own sample only (the slots whose
has_image is its segment), so packed rows (--pack, --max-images) give each sample what it gets
alone. Each CrossAttnBlock is

    x = x + tanh(s a_attn) * xattn(ln1 x, image)      text queries, image keys / values
    x = x + tanh(s a_mlp)  * mlp(ln2 x)

(s = cross_attn_gate_scale, default 1) with both gates a at zero at initialisation: the model
starts as the plain language model and the image is let in as training opens the gates. A
text-only sample (no slot of its segment) gets neither term, so it is exactly the plain decoder. The blocks
sit in the `projector` freeze group: with `--freeze text` the language model stays as it is and
only the fusion (and what feeds it: the Projector adds each image token's learned position)
trains, Flamingo's recipe.
"""
from __future__ import annotations

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec
from torch import nn

from ..config import ModelConfig
from .attention import GeluMLP
from .layers import DecoderBlock, LMHead, TextEmbed, vision_specs
from .rows import slot_images
from .stage import StageTuple, unpack_in, unpack_out


class CrossAttention(nn.Module):
    """Multi-head attention from text queries [B, T, D] to image keys / values [B, M x N, D], each text
    position to the images of its own sample (image_mask); no rotary (the image has no text order)."""

    def __init__(self, dim: int, n_heads: int):
        super().__init__()
        # the head width from the config, not from an input's width: under --tp a rank holds n_heads / TP of the
        # heads (q, kv split by heads, mmpipe.model.tp_plans.CROSS_ATTN_BLOCK) while x and the image stay D wide
        self.n_heads, self.head_dim = n_heads, dim // n_heads
        self.q = nn.Linear(dim, dim)
        self.kv = nn.Linear(dim, 2 * dim)
        self.proj = nn.Linear(dim, dim)

    def image_kv(self, image: torch.Tensor, rows: int) -> tuple[torch.Tensor, torch.Tensor]:
        """image [rows x M, N, D] -> k, v [rows, H, M x N, Dh]: what generation computes once per image and
        reuses for every token."""
        image = image.reshape(rows, -1, image.shape[-1])  # a row's M image slots side by side
        B, N, _ = image.shape
        k, v = self.kv(image).view(B, N, 2, self.n_heads, self.head_dim).permute(2, 0, 3, 1, 4)
        return k, v

    def forward(self, x: torch.Tensor, kv: tuple[torch.Tensor, torch.Tensor], mask: torch.Tensor) -> torch.Tensor:
        B, T, _ = x.shape
        q = self.q(x).view(B, T, self.n_heads, self.head_dim).transpose(1, 2)  # [B, H, T, Dh]
        out = F.scaled_dot_product_attention(q, *kv, attn_mask=mask)  # [B, H, T, Dh]
        return self.proj(out.transpose(1, 2).reshape(B, T, self.n_heads * self.head_dim))


def image_mask(segments: torch.Tensor, has_image: torch.Tensor, n: int) -> tuple[torch.Tensor, torch.Tensor]:
    """segments [B, T], has_image [B, M] (each slot's segment, 0 unused), n image tokens per slot ->
    (mask bool [B, 1, T, M x n]: a text position sees the image tokens of its own sample's slots; keep
    [B, T, 1]: 1 where it has any). A position without an image (a text-only sample, padding) gets
    neither cross-attention term; its mask row is all True only so that SDPA has keys to normalise over."""
    owner = has_image.repeat_interleave(n, dim=1)[:, None, :]  # [B, 1, M x n]
    allowed = (segments[:, :, None] == owner) & (owner > 0)  # [B, T, M x n]
    keep = allowed.any(dim=-1, keepdim=True)
    return (allowed | ~keep)[:, None], keep


class CrossAttnBlock(nn.Module):
    """Gated cross-attention + gated MLP, placed before a decoder block (see the module docstring)."""
    group = "projector"

    def __init__(self, cfg: ModelConfig, last: bool = False):
        super().__init__()
        t = cfg.text
        self.last = last  # the last block that needs the image drops it from the stage tuple
        self.ln1 = nn.LayerNorm(t.dim, eps=t.ln_eps)
        self.attn = CrossAttention(t.dim, cfg.cross_attn_heads or t.n_heads)
        self.attn_gate = nn.Parameter(torch.zeros(1))
        self.ln2 = nn.LayerNorm(t.dim, eps=t.ln_eps)
        self.mlp = GeluMLP(t.dim, t.ff_dim)
        self.mlp_gate = nn.Parameter(torch.zeros(1))
        self.gate_scale = cfg.cross_attn_gate_scale

    def fuse(self, t: StageTuple, kv: tuple[torch.Tensor, torch.Tensor]) -> torch.Tensor:
        """t.hidden [B, T, D] -> [B, T, D], given the row's image k, v (CrossAttention.image_kv)."""
        x = t.hidden
        mask, keep = image_mask(t.segments, t.has_image, t.vision.shape[1])
        keep = keep.to(x.dtype)  # [B, T, 1]: a position without an image passes through untouched
        x = x + keep * torch.tanh(self.gate_scale * self.attn_gate) * self.attn(self.ln1(x), kv, mask)
        return x + keep * torch.tanh(self.gate_scale * self.mlp_gate) * self.mlp(self.ln2(x))

    def forward(self, args):
        t = unpack_in(self, args)
        rows = t.vision.shape[0] // t.has_image.shape[1]  # B, or B / 2: dpo's pairs sharing their images
        kv = self.attn.image_kv(t.vision, rows)  # each pair's images' keys / values once, row b reads its pair's
        x = self.fuse(t, tuple(a[slot_images(t.hidden.shape[0], 1, rows, a.device)] for a in kv))
        return t._replace(hidden=x, vision=None if self.last else t.vision).pack()

    def decode(self, t: StageTuple, cache: dict, start: int) -> StageTuple:
        """Cached generation (mmpipe.inference.generate): the image's keys / values are computed on the first
        call and reused for every new token; no position, and the new tokens' segments give their mask."""
        if "kv" not in cache:
            cache["kv"] = self.attn.image_kv(t.vision, t.hidden.shape[0])
        return t._replace(hidden=self.fuse(t, cache["kv"]), vision=None if self.last else t.vision)


class CrossAttnTextEmbed(TextEmbed):
    """Token embedding of a text-only sequence; the projected image moves to the `vision` field."""

    def forward(self, args):
        t = unpack_in(self, args)  # hidden: the projected images [B x M, N_img, D]
        emb = self.wte(t.input_ids)  # [B, L, D]: the text alone
        if not emb.requires_grad and torch.is_grad_enabled():
            # a frozen embedding's output is off the autograd graph, and DeepSpeed runs backward on
            # every float it sends to the next stage: a leaf gives that backward something to reach
            emb = emb.detach().requires_grad_()
        return t._replace(hidden=emb, vision=t.hidden.to(emb.dtype)).pack()

    def decode(self, t: StageTuple, cache: dict, start: int) -> StageTuple:
        """Cached generation: the prompt as in forward; afterwards only the new tokens, with the
        image kept from the prompt's call (the blocks after need it on every step)."""
        if start == 0:
            out = unpack_out(self, self(t.pack()))
            cache["image"] = out.vision
            return out
        return t._replace(hidden=self.wte(t.input_ids), vision=cache["image"])


def cross_attention_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """The layer list above: the Projector adds the image positions, and a CrossAttnBlock precedes decoder
    blocks 0, k, 2k, ... (cfg.cross_attn_layers); the last one drops the image."""
    at = cfg.cross_attn_layers  # e.g. 4 blocks, every 2: [0, 2]
    decoder = []
    for i in range(cfg.text.n_layers):
        if i in at:
            decoder.append(LayerSpec(CrossAttnBlock, cfg, last=i == at[-1]))
        decoder.append(LayerSpec(DecoderBlock, cfg))
    return vision_specs(cfg, image_pos=True) + [LayerSpec(CrossAttnTextEmbed, cfg)] + decoder + [LayerSpec(LMHead, cfg)]
