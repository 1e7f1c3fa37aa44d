"""The Qwen3.5 layers (dense, and Qwen3.5-MoE's sparse ones, below): Qwen3-VL's tower without DeepStack (its layers,
imported), and a hybrid decoder whose layers are Gated DeltaNet (linear attention) or, at text.full_attention_indexes,
gated full attention.

Layer list (`qwen3_5_specs`), Qwen3.5-9B's decoder as the example (32 layers of 4096: 3 linear then 1 full, x 8):

    Qwen3PatchEmbed, Qwen3VisionBlock x n, Qwen3Merger   mmpipe.model.qwen3_vl's (the same math, no DeepStack)
    Qwen3Embed             Qwen2-VL's: the merged tokens onto the <|image_pad|> placeholders
    DeltaNetBlock          zero-centred RMSNorm (x (1 + w)), Gated DeltaNet (below), RMSNorm, SwiGLU
    GatedAttentionBlock    zero-centred RMSNorm, attention whose q_proj also gives a per-channel output gate
                           (sigmoid), q / k zero-centred RMSNorms per head, the interleaved multimodal rotary on the
                           first rotary_dim of each head (256 x 0.25 = 64), causal within each sample
    ZeroCentredNorm        the final norm
    head                   tied or untied (mmpipe.model.llava's)

Gated DeltaNet, per layer (Qwen3.5-9B: 16 key heads of 128, 32 value heads of 128, kernel 4):

    qkv = silu(causal depthwise conv over the row (kernel K) of in_proj_qkv(x))  -> q, k [Hk, dk], v [Hv, dv]
    q, k l2-normed per head, q x dk^-1/2; each key head serves Hv / Hk consecutive value heads
    beta = sigmoid(in_proj_b x), alpha = exp(g), g = -exp(A_log) softplus(in_proj_a x + dt_bias)     [Hv]
    S_t = alpha_t S_{t-1} + k_t beta_t (v_t - alpha_t S_{t-1}^T k_t)^T      the per-head state S [dk, dv]
    o_t = S_t^T q_t; out_proj(RMSNorm(o_t) w silu(in_proj_z x))

Packed rows (several samples in a row, `segments`): exact per sample. The convolution's taps are masked by segment
equality (a tap t - j counts only when position t - j is in t's sample). The recurrence restarts every sample at a
zero state by the gate: alpha = 0 at each sample start (g = -inf there), which is the delta rule's own way to forget.
A -inf inside the chunked form's cumulative log-decay would give -inf - -inf = NaN, so `chunk_delta_rule` takes
that limit exactly instead: every decay product that spans a sample start is 0 (masks on the within-chunk pairs, on
the carried state's read and on its carry to the next chunk), the rest are the finite products of the sample's own
gates. One chunked kernel thus serves packed rows, single samples and generation (an initial state). On CUDA with
MMPIPE_DELTA_RULE=fla, where flash-linear-attention (`fla`) imports, the training forward runs its chunked kernel
instead, the rows' sample starts as its cu_seqlens (`fla_delta_rule`; its test against this torch path, the
reference, skips without a GPU). Parameter names follow
transformers' Qwen3_5ForConditionalGeneration (mmpipe.hf.qwen3_5 maps them).

Qwen3.5-MoE (transformers' Qwen3_5MoeForConditionalGeneration, text.moe set): every decoder layer, of either kind,
has the sparse MLP (mmpipe.model.moe.SparseMoe: the softmax top-k router, renormalised, the fused 3-D experts and
the shared expert scaled by sigmoid(shared_expert_gate x)); DeltaNetMoeBlock and GatedAttentionMoeBlock add their
router statistics to the carried `moe_stats`, made by the decoder's first layer (whichever kind it is), and the
MoeHead (or TiedMoeHead, on a tied embedding) finishes the load-balancing loss, as in Qwen3-VL-MoE (docs/moe.md).
"""
from __future__ import annotations

import functools
import os
from dataclasses import dataclass

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec
from torch import nn

from ..config import ModelConfig
from . import costs
from .attention import apply_partial_rotary, attend, cached_attention
from .llava import FinalNorm, LlamaBlock, SwiGLU, decoder_specs
from .moe import MoeBlock, SparseMoe, moe_head, sparse_cost
from .qwen2_vl import mrope_geometry
from .qwen3_vl import (
    Qwen3Embed,
    Qwen3Merger,
    Qwen3PatchEmbed,
    Qwen3Text,
    Qwen3VisionBlock,
    interleaved_rotary,
    qwen3_tower_checks,
)
from .stage import StageField, StageTuple

# ---- its model JSON's sections and their checks (the registry entry's layout and checks) ----

@dataclass(frozen=True)
class HybridText(Qwen3Text):
    """The Qwen3.5 family's decoder (mmpipe.model.qwen3_5): the layers that are full attention, the others Gated
    DeltaNet (transformers' layer_types as indices; Qwen3.5: every 4th, 3, 7, 11, ...: a shrunk model keeps one of
    each kind, mmpipe.check.equivalence.shrunk), and the linear layers' geometry: key / value heads and their widths,
    the short convolution's kernel (Qwen3.5-9B: 16 / 32 heads of 128 / 128, kernel 4)."""
    full_attention_indexes: tuple[int, ...] = ()
    linear_key_heads: int = 0
    linear_value_heads: int = 0
    linear_key_dim: int = 0
    linear_value_dim: int = 0
    linear_conv_kernel: int = 0


def qwen3_5_checks(cfg: ModelConfig) -> list[tuple[bool, str, str]]:
    """Qwen3's tower checks, the partial interleaved rotary (sections summing to rotary_dim / 2,
    Qwen3.5: 256 x 0.25 = 64 -> 11 + 11 + 10 = 32), the layer pattern with the linear layers' geometry, and a
    Qwen3.5-MoE decoder's section (every layer of either kind sparse: mmpipe.model.qwen3_5)."""
    t = cfg.text
    full = list(t.full_attention_indexes)
    checks = [c for c in qwen3_tower_checks(cfg) if c[1] not in ("text.partial_rotary_factor", "text.mrope_section")]
    linear = len(full) < t.n_layers
    return checks + (t.moe.checks(t) if t.moe else []) + [
        (len(t.mrope_section) == 3 and sum(t.mrope_section) == t.rotary_dim // 2, "text.mrope_section",
         f"{list(t.mrope_section)}: 3 sections summing to rotary_dim / 2 = {t.rotary_dim // 2}"),
        (all(0 <= i < t.n_layers for i in full) and full == sorted(set(full)), "text.full_attention_indexes",
         f"{full}: increasing layer indices of a {t.n_layers}-layer decoder"),
    ] + [(not linear or n > 0, f"text.{k}", f"{n}: the linear layers' geometry (heads, widths, kernel) must be > 0")
         for k, n in (("linear_key_heads", t.linear_key_heads), ("linear_value_heads", t.linear_value_heads),
                      ("linear_key_dim", t.linear_key_dim), ("linear_value_dim", t.linear_value_dim),
                      ("linear_conv_kernel", t.linear_conv_kernel))] + [
        (not linear or t.linear_value_heads % max(t.linear_key_heads, 1) == 0, "text.linear_value_heads",
         f"{t.linear_value_heads} value heads: a multiple of the {t.linear_key_heads} key heads")]


CHUNK = 64  # positions per chunk of the delta rule (transformers' and flash-linear-attention's default)


class ZeroCentredNorm(nn.Module):
    """RMSNorm whose weight starts at 0 and scales by (1 + w), in fp32 (transformers' Qwen3_5RMSNorm)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.zeros(dim))

    def forward(self, x: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return (y * (1.0 + self.weight.float())).type_as(x)


class GatedNorm(nn.Module):
    """RMSNorm of each value head's output (weight from 1), times silu(z) (transformers' Qwen3_5RMSNormGated)."""

    def __init__(self, dim: int, eps: float):
        super().__init__()
        self.eps, self.weight = eps, nn.Parameter(torch.ones(dim))

    def forward(self, x: torch.Tensor, z: torch.Tensor) -> torch.Tensor:
        y = x.float() * torch.rsqrt(x.float().pow(2).mean(-1, keepdim=True) + self.eps)
        return ((self.weight * y.to(x.dtype)) * F.silu(z.float())).to(x.dtype)


def sample_starts(segments: torch.Tensor) -> torch.Tensor:
    """bool [B, L]: a position whose segment differs from the one before it (and position 0): where the recurrence
    restarts. E.g. segments [1 1 1 2 2 0 0] -> [T F F T F T F] (padding is a run of its own)."""
    starts = torch.ones_like(segments, dtype=torch.bool)
    starts[:, 1:] = segments[:, 1:] != segments[:, :-1]
    return starts


def chunk_delta_rule(q, k, v, g, beta, starts=None, state=None, chunk: int = CHUNK):
    """The gated delta rule, chunked: q, k [B, L, H, dk] (l2-normed, q scaled), v [B, L, H, dv], g, beta [B, L, H]
    (log decay <= 0, write strength), starts bool [B, L] (the state is zeroed before these positions: alpha = 0
    there; None: no restart), state [B, H, dk, dv] carried in (None: zeros). -> (o [B, L, H, dv], final state).

    Per chunk of C positions with log-decay prefix sums c (c_i = g_1 + .. + g_i in the chunk) and runs (positions
    with no start between them): the within-chunk delta rule is the unit lower-triangular system
    (I + tril(beta_i k_i.k_j G_ij, -1)) [U | W] = [beta V | beta K exp(c) r], G_ij = exp(c_i - c_j) when j <= i in
    one run, else 0, and r_i = 1 when i is in the run the carried state S belongs to (no start in the chunk up to
    i); then V' = U - W S, o = (Q exp(c) r) S + (Q K^T . G) V', S <- S exp(c_C) r_C + (K exp(c_C - c) m)^T V', m_j =
    1 when j is in the chunk's last run. Python loops over chunks (L / 64), never over positions."""
    B, L, H, dk = k.shape
    dv = v.shape[-1]
    dt = v.dtype  # the layer's dtype (q, k come l2-normed in fp32)
    q, k, v, g, beta = (x.float() for x in (q, k, v, g, beta))
    starts = torch.zeros(B, L, dtype=torch.bool, device=q.device) if starts is None else starts
    pad = (-L) % chunk  # zero k, v, beta and g past the end: the padded positions leave the state as it is
    if pad:
        q, k, v = (F.pad(x, (0, 0, 0, 0, 0, pad)) for x in (q, k, v))
        g, beta = (F.pad(x, (0, 0, 0, pad)) for x in (g, beta))
        starts = F.pad(starts, (0, pad))
    n = (L + pad) // chunk
    # [B, H, n, C, d] and [B, H, n, C]
    q, k, v = (x.transpose(1, 2).reshape(B, H, n, chunk, -1) for x in (q, k, v))
    g, beta = (x.transpose(1, 2).reshape(B, H, n, chunk) for x in (g, beta))
    run = starts.reshape(B, 1, n, chunk).long().cumsum(-1)  # run index within the chunk, 0 = the carried state's
    c = g.cumsum(-1)
    lower = torch.ones(chunk, chunk, dtype=torch.bool, device=q.device).tril()
    same = (run[..., :, None] == run[..., None, :]) & lower  # [B, 1, n, C, C]: j <= i, one run
    G = (c[..., :, None] - c[..., None, :]).masked_fill(~same, float("-inf")).exp()
    r = (run == 0).float()  # [B, 1, n, C]
    last = (run == run[..., -1:]).float()
    kb, vb = k * beta[..., None], v * beta[..., None]
    A = (kb @ k.transpose(-1, -2)) * G  # its diagonal beta_i |k_i|^2 is not read: unitriangular
    U = torch.linalg.solve_triangular(A, vb, upper=False, unitriangular=True)
    W = torch.linalg.solve_triangular(A, kb * (c.exp() * r)[..., None], upper=False, unitriangular=True)
    qs = q * (c.exp() * r)[..., None]
    inner = (q @ k.transpose(-1, -2)) * G
    kc = k * ((c[..., -1:] - c).exp() * last)[..., None]
    carry = (c[..., -1].exp() * r[..., -1])[..., None, None]  # [B, H, n, 1, 1]
    S = torch.zeros(B, H, dk, dv, device=q.device) if state is None else state.float()
    out = []
    # unbind, not [:, :, i]: an indexed chunk's backward writes a zero tensor of the whole [.., n, ..] for each
    # chunk (n x L values: quadratic in the positions), unbind's backward stacks the n chunks' gradients once
    chunks = zip(*(x.unbind(2) for x in (U, W, qs, inner, kc, carry)))
    for u, w, qc, qk, kci, cr in chunks:
        vi = u - w @ S
        out.append(qc @ S + qk @ vi)
        S = S * cr + kci.transpose(-1, -2) @ vi
    o = torch.stack(out, 2).reshape(B, H, n * chunk, dv)[:, :, :L].transpose(1, 2)
    return o.to(dt), S


def cu_seqlens(starts: torch.Tensor) -> torch.Tensor:
    """The rows of starts [B, L] (bool, every row's position 0 a start: sample_starts) laid end to end as one sequence
    list, flash-attention's way: int64 [N + 1] of each run's first position in the flattened B x L and B x L at the
    end, e.g. [[T F F T], [T F T F]] -> [0, 3, 4, 6, 8]. Padding is a run of its own, as in the torch path."""
    first = starts.reshape(-1).nonzero().squeeze(1)
    return torch.cat([first, first.new_tensor([starts.numel()])]).long()


@functools.cache
def fla_chunk_gated_delta_rule():
    """flash-linear-attention's chunked gated delta rule (`fla.ops.gated_delta_rule.chunk_gated_delta_rule`, Triton,
    CUDA) where the `fla` package imports, else None. Not a dependency of mmpipe: installed by whoever wants it."""
    try:
        from fla.ops.gated_delta_rule import chunk_gated_delta_rule
    except Exception:  # not installed, or installed without a working Triton: the torch path serves
        return None
    return chunk_gated_delta_rule


def use_fla(x: torch.Tensor) -> bool:
    """The training forward runs flash-linear-attention's kernel with MMPIPE_DELTA_RULE=fla, on CUDA, where it
    imports. Opt-in: its test against the torch path (tests/test_hf_qwen3_5.py, scripts/gpu_check.sh) has not run on
    a GPU yet; once it has, this may become CUDA's default."""
    return x.is_cuda and os.environ.get("MMPIPE_DELTA_RULE", "") == "fla" and fla_chunk_gated_delta_rule() is not None


def fla_delta_rule(q, k, v, g, beta, starts: torch.Tensor | None) -> torch.Tensor:
    """chunk_delta_rule's output from flash-linear-attention's kernel (no state in or out: the training forward):
    every row's samples become sequences of one flattened batch (cu_seqlens at each sample start), which the kernel
    restarts from a zero state, as the torch path's gate does. q is scaled already (scale 1), q, k l2-normed; q, k
    and beta run in v's dtype, the log decays g in fp32."""
    B, L, H, _ = q.shape
    if starts is None:  # each row one sequence
        starts = torch.zeros(B, L, dtype=torch.bool, device=q.device)
        starts[:, 0] = True
    flat = [x.reshape(1, B * L, *x.shape[2:]) for x in (q, k, v, g, beta)]
    q, k, v = (x.to(v.dtype) for x in flat[:3])
    o, _ = fla_chunk_gated_delta_rule()(q, k, v, flat[3].float(), flat[4].to(v.dtype), scale=1.0,
                                         cu_seqlens=cu_seqlens(starts))
    return o.reshape(B, L, H, -1)


def segment_conv(x: torch.Tensor, weight: torch.Tensor, segments: torch.Tensor | None,
                 past: torch.Tensor | None = None):
    """The causal depthwise convolution of x [B, L, C] with weight [C, 1, K] (out_t = sum_j w[K-1-j] x_{t-j}), a tap
    t - j counted only when it is in t's sample (segments [B, L]; None: all one sample), then silu. past [B, K-1, C]:
    the inputs before x (generation), one sample with it. K shifted copies, one per tap: K = 4 multiplies a row."""
    K, L = weight.shape[-1], x.shape[1]
    w = weight[:, 0].to(x.dtype)  # [C, K]
    full = x if past is None else torch.cat([past.to(x.dtype), x], 1)
    P = full.shape[1] - L  # inputs before x's first position
    out = x * w[:, K - 1]
    for j in range(1, K):
        shifted = F.pad(full, (0, 0, j, 0))[:, P:P + L]  # x_{t-j}, zeros before the first input
        if segments is not None and past is None:
            ok = torch.zeros_like(segments, dtype=torch.bool)
            ok[:, j:] = segments[:, j:] == segments[:, :-j]
            shifted = shifted * ok[..., None].to(x.dtype)
        out = out + shifted * w[:, K - 1 - j]
    return F.silu(out)


class GatedDeltaNet(nn.Module):
    """The linear-attention mixer (module docstring), transformers' parameter names."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t = cfg.text
        self.hk, self.hv, self.dk, self.dv = t.linear_key_heads, t.linear_value_heads, t.linear_key_dim, \
            t.linear_value_dim
        self.key_dim, self.value_dim = self.hk * self.dk, self.hv * self.dv
        conv = 2 * self.key_dim + self.value_dim
        self.conv1d = nn.Conv1d(conv, conv, t.linear_conv_kernel, groups=conv, bias=False,
                                padding=t.linear_conv_kernel - 1)
        self.dt_bias = nn.Parameter(torch.ones(self.hv))
        self.A_log = nn.Parameter(torch.empty(self.hv).uniform_(0.01, 16).log())
        self.norm = GatedNorm(self.dv, t.ln_eps)
        self.out_proj = nn.Linear(self.value_dim, t.dim, bias=False)
        self.in_proj_qkv = nn.Linear(t.dim, conv, bias=False)
        self.in_proj_z = nn.Linear(t.dim, self.value_dim, bias=False)
        self.in_proj_b = nn.Linear(t.dim, self.hv, bias=False)
        self.in_proj_a = nn.Linear(t.dim, self.hv, bias=False)

    def forward(self, x: torch.Tensor, segments: torch.Tensor | None, cache: dict | None = None) -> torch.Tensor:
        """x [B, T, D] -> [B, T, D]. segments [B, T]: the row's samples (forward, prefill); with a cache holding
        "conv" / "state" (generation's later steps) the T new positions continue the cached sample."""
        B, T, _ = x.shape
        K = self.conv1d.kernel_size[0]
        mixed = self.in_proj_qkv(x)
        past = None if cache is None else cache.get("conv")
        state = None if cache is None else cache.get("state")
        qkv = segment_conv(mixed, self.conv1d.weight, segments, past)
        q, k, v = qkv.split([self.key_dim, self.key_dim, self.value_dim], -1)
        rep = self.hv // self.hk  # each key head serves rep consecutive value heads
        q, k = (self._l2(a.reshape(B, T, self.hk, self.dk)).repeat_interleave(rep, 2) for a in (q, k))
        q = q * self.dk ** -0.5
        v = v.reshape(B, T, self.hv, self.dv)
        beta = self.in_proj_b(x).sigmoid()
        g = -self.A_log.float().exp() * F.softplus(self.in_proj_a(x).float() + self.dt_bias)
        starts = sample_starts(segments) if state is None and segments is not None else None
        if cache is None and use_fla(x):  # training on CUDA, MMPIPE_DELTA_RULE=fla: its kernel, no state kept
            o, S = fla_delta_rule(q, k, v, g, beta, starts), None
        else:
            o, S = chunk_delta_rule(q, k, v, g, beta, starts, state)
        if cache is not None:  # generation: one sample per row, its last K - 1 inputs and state go on
            cache["conv"] = (mixed if past is None else torch.cat([past, mixed], 1))[:, -(K - 1):]
            cache["state"] = S
        z = self.in_proj_z(x).view(B, T, self.hv, self.dv)
        return self.out_proj(self.norm(o, z).reshape(B, T, -1))

    @staticmethod
    def _l2(x: torch.Tensor) -> torch.Tensor:
        """x / sqrt(|x|^2 + 1e-6) per head, in fp32 (flash-linear-attention's l2norm, as transformers uses it)."""
        x = x.float()
        return x * torch.rsqrt((x * x).sum(-1, keepdim=True) + 1e-6)


class GatedAttention(nn.Module):
    """Full attention with an output gate: q_proj gives each head [q | gate] (2 x head_dim), the output is
    o_proj(attention x sigmoid(gate)); q / k zero-centred RMSNorms per head; rotary on the first rotary_dim."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t = cfg.text
        self.n_heads, self.kv_heads, self.head_dim, self.theta = t.n_heads, t.kv_heads, t.head_dim, t.rope_theta
        self.q_proj = nn.Linear(t.dim, 2 * t.n_heads * t.head_dim, bias=False)
        self.k_proj = nn.Linear(t.dim, t.kv_heads * t.head_dim, bias=False)
        self.v_proj = nn.Linear(t.dim, t.kv_heads * t.head_dim, bias=False)
        self.o_proj = nn.Linear(t.n_heads * t.head_dim, t.dim, bias=False)
        self.q_norm, self.k_norm = ZeroCentredNorm(t.head_dim, t.ln_eps), ZeroCentredNorm(t.head_dim, t.ln_eps)

    def forward(self, x, mask, rotary, cache: dict | None = None):
        B, T, _ = x.shape
        q, gate = self.q_proj(x).view(B, T, self.n_heads, 2 * self.head_dim).chunk(2, dim=-1)
        q = self.q_norm(q).transpose(1, 2)
        k = self.k_norm(self.k_proj(x).view(B, T, self.kv_heads, self.head_dim)).transpose(1, 2)
        v = self.v_proj(x).view(B, T, self.kv_heads, self.head_dim).transpose(1, 2)
        q, k = apply_partial_rotary(q, *rotary), apply_partial_rotary(k, *rotary)
        out = attend(q, k, v, mask) if cache is None else cached_attention(q, k, v, cache, mask)
        out = out.transpose(1, 2).reshape(B, T, -1) * torch.sigmoid(gate.reshape(B, T, -1))
        return self.o_proj(out)


class Qwen35Block(LlamaBlock):
    """The residual frame both layer kinds share: x + mixer(norm x), then x + SwiGLU(norm x), zero-centred norms."""

    def __init__(self, cfg: ModelConfig):
        nn.Module.__init__(self)
        t = self.text = cfg.text
        self.token, self.merge = cfg.image_token_id, cfg.vision.merge_size
        self.input_layernorm = ZeroCentredNorm(t.dim, t.ln_eps)
        self.post_attention_layernorm = ZeroCentredNorm(t.dim, t.ln_eps)
        self.mlp = SwiGLU(t.dim, t.ff_dim)

    def run(self, t: StageTuple, start: int, cache: dict | None = None):
        x = t.hidden + self.mix(self.input_layernorm(t.hidden), t, start, cache)
        return x + self.mlp(self.post_attention_layernorm(x))


class DeltaNetBlock(Qwen35Block):
    """A linear-attention decoder layer (Gated DeltaNet): per-sample exact on packed rows (module docstring).
    Generation: the prefill keeps the last K - 1 conv inputs and the state, each step continues them."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.linear_attn = GatedDeltaNet(cfg)

    def mix(self, x, t: StageTuple, start: int, cache: dict | None):
        return self.linear_attn(x, t.segments if start == 0 else None, cache)


class GatedAttentionBlock(Qwen35Block):
    """A full-attention decoder layer: causal within each sample, Qwen3-VL's multimodal positions (the row's grids)
    under the interleaved rotary on the first rotary_dim of each head; cached decoding keeps the rope delta."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.self_attn = GatedAttention(cfg)

    def mix(self, x, t: StageTuple, start: int, cache: dict | None):
        return self.self_attn(x, *self.geometry(t, start, cache), cache)

    def geometry(self, t: StageTuple, start: int, cache: dict | None):
        rd, theta, section = self.text.rotary_dim, self.text.rope_theta, self.text.mrope_section
        return mrope_geometry(t, start, cache, self.token, self.merge, ("mrope3.5", rd, theta, section),
                              lambda pos: interleaved_rotary(pos, rd, theta, section))


class Qwen35FinalNorm(FinalNorm):
    make_norm = ZeroCentredNorm


class Qwen35MoeBlock(MoeBlock):
    """The sparse frame (a mixin before a Qwen3.5 layer kind): x + mixer(norm x), then x + SparseMoe(norm x), the
    layer's router statistics beside (MoeBlock carries them)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.mlp = SparseMoe(cfg)  # in place of the dense SwiGLU the layer kind built

    def run_moe(self, t: StageTuple, start: int, cache: dict | None = None):
        x = t.hidden + self.mix(self.input_layernorm(t.hidden), t, start, cache)
        y, stats = self.mlp(self.post_attention_layernorm(x), t.segments > 0)
        return x + y, stats


class DeltaNetMoeBlock(Qwen35MoeBlock, DeltaNetBlock):
    """A Gated DeltaNet layer with the sparse MLP (Qwen3.5-MoE's linear_attention layers)."""


class GatedAttentionMoeBlock(Qwen35MoeBlock, GatedAttentionBlock):
    """A gated full-attention layer with the sparse MLP (Qwen3.5-MoE's full_attention layers)."""


BLOCKS = {"linear_attention": DeltaNetBlock, "full_attention": GatedAttentionBlock}
MOE_BLOCKS = {"linear_attention": DeltaNetMoeBlock, "full_attention": GatedAttentionMoeBlock}


def decoder_blocks(text) -> dict[str, type]:
    """The layer class of each kind: sparse when the text section has an moe section, else dense."""
    return MOE_BLOCKS if text.moe else BLOCKS


def moe_fields(cfg: ModelConfig) -> tuple[StageField, ...]:
    """`moe_stats` (mmpipe.model.moe) for a Qwen3.5-MoE model: made by the first decoder layer's class, whichever
    kind layer 0 is (Qwen3.5: linear), kept to the head; () for a dense model."""
    if not cfg.text.moe:
        return ()
    return (StageField("moe_stats", True, made_by=MOE_BLOCKS[layer_types(cfg.text)[0]]),)


def layer_types(text) -> tuple[str, ...]:
    """Each decoder layer's kind as transformers' layer_types spells it, from text.full_attention_indexes."""
    return tuple("full_attention" if i in text.full_attention_indexes else "linear_attention"
                 for i in range(text.n_layers))


def _deltanet_block(cfg: ModelConfig, params: int, n: int, seq: int) -> costs.Cost:
    """A Gated DeltaNet layer's cost per sample of seq positions: linear in seq (no L x L term, no mask).
    FLOPs: 2 x params x seq (the projections and the MLP), the short convolution 2 K per channel, and per value head
    and position the chunked delta rule at chunk C: C (5 dk + 3 dv) for the within-chunk matrices (k_beta k^T, q k^T:
    2 C dk each; the two triangular solves: C dk + C dv; (q k^T) V': 2 C dv) + 6 dk dv for the carried state's read,
    correction and update. E.g. Qwen3.5-9B's 32 value heads of 128 at C = 64: 32 x (64 x 1024 + 98304) = 5.2 MFLOPs a
    position, against 4 x L x 4096 = 134 MFLOPs for a full layer's scores at L = 8192.
    Activations: what autograd keeps, counted (tests/test_hf_qwen3_5.py measures it exactly, fp32, and the fp32 part of
    a bf16 layer). Per position: 6 D (residuals, the two norms' fp32 input and output) + 4 F (MLP) + 5 conv channels
    (the projection, the three masked taps, the conv before silu) + 6 Hv dv (v, z, o, the gated norm's steps) + 2 Hk dk
    (q, k before the l2 norm) + 4 Hv + 2 Hk + 5 (beta, g, the norms' statistics). Per position of the row padded to
    whole chunks (Lp): 5 Hv C (the decay matrix, the two within-chunk products, a chunk's q k^T in the loop), 8 Hv dk
    and 3 Hv dv (q, k, k beta and its decayed copies, W; v beta, U, the corrected values), 7 Hv + 2 (decays, masks);
    the loop's per-chunk keys (3 n - 2 of Hv x dk x C: a chunk's own, its decayed copy past the first) and the carried
    state twice a chunk (2 Hv dk dv); per row n (Hv + 1) + (n - 1) Hv. In a bf16 layer the delta rule, the l2 and
    RMS norms stay fp32: all the chunk terms, 6 D, 4 Hv dv, 2 Hk dk, 3 Hv + 2 Hk + 2 a position."""
    t = cfg.text
    hv, hk, dk, dv, K, C = (t.linear_value_heads, t.linear_key_heads, t.linear_key_dim, t.linear_value_dim,
                            t.linear_conv_kernel, CHUNK)
    conv = 2 * hk * dk + hv * dv
    fwd = 2.0 * params * seq + 2.0 * K * conv * seq + hv * seq * (C * (5 * dk + 3 * dv) + 6 * dk * dv)
    chunks = -(-seq // C)
    kernel = chunks * C * (5 * hv * C + 8 * hv * dk + 3 * hv * dv + 7 * hv + 2) + (3 * chunks - 2) * hv * dk * C \
        + chunks * (2 * hv * dk * dv + hv + 1) + (chunks - 1) * hv
    act = (6 * t.dim + 4 * t.ff_dim + 5 * conv + 6 * hv * dv + 2 * hk * dk + 4 * hv + 2 * hk + 5) * seq + kernel
    fp32 = (6 * t.dim + 4 * hv * dv + 2 * hk * dk + 3 * hv + 2 * hk + 2) * seq + kernel
    return costs.Cost(seq, fwd, act, fp32, seq * t.dim)


def _gated_attention_block(cfg: ModelConfig, params: int, n: int, seq: int) -> costs.Cost:
    """A gated full-attention layer's cost per sample of seq positions. FLOPs: 2 x params x seq (q_proj's output gate
    included) + 4 L^2 W for the scores and their weighted sum at the heads' width W = heads x head_dim (Qwen3.5-27B:
    6144 for a 5120-wide model). Activations, counted as autograd keeps them on CPU's split by sample (tests/
    test_hf_qwen3_5.py measures them exactly): per position 6 D + 7 W (q through its norm and rotary, the split's
    gathered q and output, the gate, its sigmoid, their product) + 4 kv (k likewise, v) + 4 F + the rotary's cos and
    sin (2 rotary_dim) + 2 + 2 H + kv heads (the statistics of the norms and the softmax); in a bf16 layer 6 D + 3 W +
    3 kv + 2 rotary_dim + 2 + 2 H + kv heads of them stay fp32 (the norms compute in fp32)."""
    t = cfg.text
    w, kv, rd = t.n_heads * t.head_dim, t.kv_heads * t.head_dim, t.rotary_dim
    stats = 2 + 2 * t.n_heads + t.kv_heads
    act = (6 * t.dim + 7 * w + 4 * kv + 4 * t.ff_dim + 2 * rd + stats) * seq
    fp32 = (6 * t.dim + 3 * w + 3 * kv + 2 * rd + stats) * seq
    return costs.Cost(seq, 2.0 * params * seq + 4.0 * seq * seq * w, act, fp32, seq * t.dim)


GATED_ATTENTION_BLOCK = costs.LayerRule("GatedAttentionBlock", _gated_attention_block, "sequence")
DELTANET_BLOCK = costs.LayerRule("DeltaNetBlock", _deltanet_block, "sequence")
# Qwen3.5-MoE's: each kind's rule on the active parameters, the experts' activations for the dense MLP's
# (mmpipe.model.moe.sparse_cost)
DELTANET_MOE_BLOCK = costs.LayerRule("DeltaNetMoeBlock", functools.partial(sparse_cost, _deltanet_block), "sequence",
                                     experts=True)
GATED_ATTENTION_MOE_BLOCK = costs.LayerRule("GatedAttentionMoeBlock",
                                            functools.partial(sparse_cost, _gated_attention_block), "sequence",
                                            experts=True)


def qwen3_5_specs(cfg: ModelConfig) -> list[LayerSpec]:
    v, t = cfg.vision, cfg.text
    tower = [LayerSpec(Qwen3PatchEmbed, cfg)] + [LayerSpec(Qwen3VisionBlock, cfg) for _ in range(v.n_layers)]
    text = decoder_specs(cfg, Qwen3Embed)  # [embed, block x n, FinalNorm, head]: blocks and norm replaced
    blocks = decoder_blocks(t)
    text[1:1 + t.n_layers] = [LayerSpec(blocks[kind], cfg) for kind in layer_types(t)]
    text[1 + t.n_layers] = LayerSpec(Qwen35FinalNorm, cfg)
    specs = tower + [LayerSpec(Qwen3Merger, cfg)] + text
    return moe_head(specs, cfg) if t.moe else specs  # the head that finishes the load-balancing loss
