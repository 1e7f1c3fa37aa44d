"""Mixture-of-experts decoder blocks (issue 43; docs/moe.md): Qwen3-VL-MoE's sparse MLP as a pipeline layer.

A block is the Qwen3-VL decoder block (mmpipe.model.qwen3_vl.Qwen3Block: attention, q / k norms, interleaved
multimodal rotary) whose MLP is `text.moe.experts` SwiGLU experts behind a softmax top-k router, with
transformers' Qwen3VLMoe names and layouts, so import and export move tensors unchanged:

    mlp.gate.weight             [E, D]          the router: logits = x W^T, softmax in fp32, top k, the k weights
                                                renormalised to sum 1 (moe.norm_topk), cast back to x's dtype
    mlp.experts.gate_up_proj    [E, 2 F, D]     expert e: gate, up = x W_e^T split in two halves; silu(gate) x up
    mlp.experts.down_proj       [E, D, F]       expert e: h W_e^T
    mlp.shared_expert.*, mlp.shared_expert_gate     with moe.shared_ff_dim > 0 (Qwen3.5-MoE): a SwiGLU every token
                                                runs, scaled by sigmoid(shared_expert_gate x), added (SparseMoe)

The sparse blocks are Qwen3MoeBlock here and Qwen3.5-MoE's two kinds (mmpipe.model.qwen3_5), all MoeBlock.
Dispatch drops no token: every (token, choice) pair is sorted by expert (a stable argsort of the flat top-k
indices) and each expert multiplies exactly its contiguous run, however long; no capacity, no padding. The runs go
through torch's grouped matmul (F.grouped_mm, one kernel for all experts, per-expert offsets on the device: no host
sync) where torch has one for the device and dtype, else a loop over the experts that received tokens (the runs'
lengths read once on the host). Both give the same output and gradients (tests/test_moe.py).

The load-balancing loss is transformers' load_balancing_loss_func over all layers of the micro-batch's real
positions (segments > 0; padding masked as transformers' attention_mask does):

    aux = E x sum_e (c_e / N) (p_e / N),  c_e: top-k choices of expert e summed over layers and positions,
                                          p_e: router probability of e summed likewise, N = layers x positions

It is not a sum of per-layer losses (c and p are summed over layers before the product), so each block adds its
layer's per-row sums to the float stage field `moe_stats` [B, 2, E] (row b: c_e, p_e), made by the first MoE
block and kept to the head; a stage boundary sends it as one more float tensor (2 E floats a row; c has no
gradient, p carries the router's). The head (MoeHead) returns (logits, aux_coef x aux) and
mmpipe.model.builder.lm_loss adds the second to the LM loss: one loss on the last stage, whose backward reaches
every stage's routers through `moe_stats`.
"""
from __future__ import annotations

import functools

import torch
import torch.nn.functional as F
from deepspeed.pipe import LayerSpec, TiedLayerSpec
from torch import nn

from ..config import ModelConfig
from . import costs
from .llava import LMHeadLinear, SwiGLU
from .qwen3_vl import Qwen3Block, qwen3_vl_specs
from .stage import StageField, StageTuple, live_fields, unpack_in

DISPATCH = ("auto", "grouped", "loop")


def grouped_mm_ok(x: torch.Tensor) -> bool:
    """Whether torch's grouped matmul serves x's device and dtype: torch >= 2.10's F.grouped_mm runs on the CPU
    (fp32, bf16; checked here, torch 2.14.1) and on CUDA in bf16 from compute capability 9.0 (H100); elsewhere the
    loop over experts."""
    if not hasattr(F, "grouped_mm"):
        return False
    if x.device.type == "cpu":
        return x.dtype in (torch.float32, torch.bfloat16)
    if x.device.type == "cuda":
        return x.dtype == torch.bfloat16 and torch.cuda.get_device_capability(x.device) >= (9, 0)
    return False


class TopKRouter(nn.Module):
    """x [N, D] -> (probs fp32 [N, E], top-k expert ids [N, k], their weights [N, k] in x's dtype)."""

    def __init__(self, dim: int, experts: int, top_k: int, norm_topk: bool):
        super().__init__()
        self.weight = nn.Parameter(torch.empty(experts, dim).normal_(0.0, 0.02))
        self.top_k, self.norm_topk = top_k, norm_topk

    def forward(self, x: torch.Tensor):
        logits = F.linear(x, self.weight)
        probs = logits.softmax(-1, dtype=torch.float32)
        top, idx = probs.topk(self.top_k, dim=-1)
        if self.norm_topk:
            top = top / top.sum(-1, keepdim=True)
        return probs, idx, top.to(logits.dtype)


class Experts(nn.Module):
    """E SwiGLU experts stored as transformers stores them: gate_up_proj [E, 2F, D], down_proj [E, D, F]; after
    `shard(group)`, this rank's E / ep of them, the others' reached through an all-to-all (expert parallelism)."""

    def __init__(self, dim: int, ff_dim: int, experts: int):
        super().__init__()
        self.gate_up_proj = nn.Parameter(torch.empty(experts, 2 * ff_dim, dim).normal_(0.0, 0.02))
        self.down_proj = nn.Parameter(torch.empty(experts, dim, ff_dim).normal_(0.0, 0.02))
        self.dispatch = "auto"  # tests pin "grouped" or "loop"
        self.experts, self.ep = experts, None  # ep: (process group, its size) once sharded

    @staticmethod
    def act(gate: torch.Tensor) -> torch.Tensor:
        """The gate's activation: SiLU (SwiGLU); Gemma 4's experts override it with GELU-tanh."""
        return F.silu(gate)

    @property
    def num_experts(self) -> int:  # DeepSpeed's name: its engine reads it off the MoE layers (mmpipe.runtime.experts)
        return self.experts

    def shard(self, group) -> None:
        """Keep experts [r E / n, (r + 1) E / n) of the n ranks of `group` (r: this rank's place in it): built whole
        under the layer's seed, as the single-device model builds them, then cut, so EP == single device."""
        import torch.distributed as dist
        n, r = dist.get_world_size(group), dist.get_rank(group)
        if self.experts % n:
            raise ValueError(f"{self.experts} experts do not split over {n} expert-parallel ranks")
        per = self.experts // n
        with torch.no_grad():
            for name in ("gate_up_proj", "down_proj"):
                whole = getattr(self, name)
                kept = nn.Parameter(whole[r * per:(r + 1) * per].clone())
                kept.__dict__.update(whole.__dict__)  # a --tp split's mark (tp_split: the norm counts it per TP rank)
                setattr(self, name, kept)
        self.ep = (group, n)
        self.register_load_state_dict_pre_hook(Experts._own_slice)

    def _own_slice(self, state_dict, prefix, *_):
        """A checkpoint's whole [E, ...] experts (as every checkpoint stores them) loaded into a shard: its slice, so
        the module's load, not the parameters' shapes, does the resharding (any EP loads any other's files)."""
        group, n = self.ep
        import torch.distributed as dist
        per, r = self.experts // n, dist.get_rank(group)
        for name in ("gate_up_proj", "down_proj"):
            w = state_dict.get(prefix + name)
            if w is not None and w.shape[0] == self.experts:
                state_dict[prefix + name] = w[r * per:(r + 1) * per]

    def forward(self, x: torch.Tensor, idx: torch.Tensor, weights: torch.Tensor) -> torch.Tensor:
        """x [N, D]; idx, weights [N, k] -> [N, D]: each token's k experts' outputs, weighted and summed."""
        k = idx.shape[-1]
        flat = idx.reshape(-1)
        order = flat.argsort(stable=True)  # (token, choice) pairs grouped by expert, token order within each
        token = order // k
        counts = torch.bincount(flat, minlength=self.experts)
        xs = x[token]
        ys = self.run(xs, counts) if self.ep is None else self.exchange(xs, counts)
        ys = ys * weights.reshape(-1)[order, None]
        return torch.zeros_like(x).index_add_(0, token, ys.to(x.dtype))

    def run(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """This rank's experts on xs [n, D], grouped by expert: counts[e] rows for local expert e, in order."""
        grouped = self.dispatch == "grouped" or (self.dispatch == "auto" and grouped_mm_ok(xs))
        if grouped:
            offs = counts.cumsum(0).to(torch.int32)  # end of each expert's run; an empty run is an empty group
            gate, up = F.grouped_mm(xs, self.gate_up_proj.transpose(1, 2), offs=offs).chunk(2, dim=-1)
            return F.grouped_mm(self.act(gate) * up, self.down_proj.transpose(1, 2), offs=offs)
        parts, start = [], 0
        for e, n in enumerate(counts.tolist()):  # only the experts that have tokens run
            if n:
                gate, up = F.linear(xs[start:start + n], self.gate_up_proj[e]).chunk(2, dim=-1)
                parts.append(F.linear(self.act(gate) * up, self.down_proj[e]))
                start += n
        return torch.cat(parts) if parts else xs.new_zeros(0, self.down_proj.shape[1])

    def exchange(self, xs: torch.Tensor, counts: torch.Tensor) -> torch.Tensor:
        """Expert parallelism: xs (grouped by global expert, so each owner's rows are one contiguous run) to the
        ranks owning their experts, through them, and back, by two differentiable all-to-alls of uneven splits
        (every row goes, however many: no capacity). The owner regroups what it receives (by source, then expert)
        by expert for `run`, and puts the results back in the order they came."""
        import torch.distributed as dist
        group, n = self.ep
        per = self.experts // n
        got = torch.empty_like(counts)  # [n x per]: what each source rank sends to each of my experts
        dist.all_to_all_single(got, counts, group=group)
        send, recv = counts.view(n, per).sum(1).tolist(), got.view(n, per).sum(1).tolist()
        xr = AllToAll.apply(xs.contiguous(), recv, send, group)
        local = torch.arange(per, device=xs.device).repeat(n).repeat_interleave(got)  # each received row's expert
        perm = local.argsort(stable=True)
        yr = self.run(xr[perm], torch.bincount(local, minlength=per))[perm.argsort()]
        return AllToAll.apply(yr.contiguous(), send, recv, group)


class AllToAll(torch.autograd.Function):
    """A differentiable all-to-all of uneven splits over torch.distributed's own all_to_all_single (the op
    torch.distributed.nn.functional.all_to_all_single wraps, which torch 2.14 deprecates with a FutureWarning on
    every call): rows x [sum(send), D] go out in runs of `send` rows to each rank, [sum(recv), D] come back; the
    backward sends the gradients back the same way, reversed."""

    @staticmethod
    def forward(ctx, x: torch.Tensor, recv: list[int], send: list[int], group) -> torch.Tensor:
        import torch.distributed as dist
        ctx.recv, ctx.send, ctx.group = recv, send, group
        out = x.new_empty(sum(recv), *x.shape[1:])
        dist.all_to_all_single(out, x, recv, send, group=group)
        return out

    @staticmethod
    def backward(ctx, grad: torch.Tensor):
        import torch.distributed as dist
        out = grad.new_empty(sum(ctx.send), *grad.shape[1:])
        dist.all_to_all_single(out, grad.contiguous(), ctx.send, ctx.recv, group=ctx.group)
        return out, None, None, None


class SparseMoe(nn.Module):
    """The block's MLP: router `gate` and `experts` (transformers' names), and with moe.shared_ff_dim > 0 a shared
    expert every token runs (Qwen3.5-MoE's, Qwen3-Next's, transformers' Qwen3NextSparseMoeBlock; GLM-style models
    have one too), scaled per token by a sigmoid gate:

        mlp.shared_expert.{gate,up,down}_proj.weight   [Fs, D], [Fs, D], [D, Fs]   SwiGLU of width Fs = shared_ff_dim
        mlp.shared_expert_gate.weight                  [1, D]                      y += sigmoid(x w^T) x shared(x)

    forward -> (y [B, L, D], the layer's per-row statistics [B, 2, E] fp32: top-k counts and router probability sums
    over the row's real positions; the shared expert adds nothing to them)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__()
        t, m = cfg.text, cfg.text.moe
        self.gate = TopKRouter(t.dim, m.experts, m.top_k, m.norm_topk)
        self.experts = Experts(t.dim, m.ff_dim, m.experts)
        if m.shared_ff_dim:  # replicated like any dense weight: --ep shards the Experts module only
            self.shared_expert = SwiGLU(t.dim, m.shared_ff_dim)
            self.shared_expert_gate = nn.Linear(t.dim, 1, bias=False)

    def forward(self, x: torch.Tensor, real: torch.Tensor):
        B, L, D = x.shape
        probs, idx, w = self.gate(x.reshape(-1, D))
        y = self.experts(x.reshape(-1, D), idx, w).view(B, L, D)
        if hasattr(self, "shared_expert"):
            y = y + torch.sigmoid(self.shared_expert_gate(x)) * self.shared_expert(x)
        return y, route_stats(probs, idx, real)


def route_stats(probs: torch.Tensor, idx: torch.Tensor, real: torch.Tensor) -> torch.Tensor:
    """A layer's per-row router statistics [B, 2, E] fp32 from probs [B L, E], idx [B L, k] and real [B, L] (the
    row's real positions): each expert's top-k count and its probability sum over them (aux_loss sums them)."""
    (B, L), E = real.shape, probs.shape[-1]
    m = real.reshape(-1, 1).to(probs.dtype)  # [B L, 1]
    counts = torch.zeros_like(probs).scatter_add_(1, idx, m.expand_as(idx).contiguous())
    return torch.stack([counts.view(B, L, E).sum(1), (probs * m).view(B, L, E).sum(1)], dim=1)


class MoeBlock:
    """What every sparse decoder block shares (a mixin before its dense block class, whose MLP it replaces by
    SparseMoe): `run_moe(t, start, cache) -> (hidden, the layer's statistics)`, written by each block; forward and
    decode add the statistics to the carried `moe_stats` (made by the list's first MoE block), run leaves them out."""

    def forward(self, args):
        t = unpack_in(self, args)
        hidden, stats = self.run_moe(t, 0)
        carried = t.moe_stats
        return t._replace(hidden=hidden, moe_stats=stats if carried is None else carried + stats).pack()

    def run(self, t: StageTuple, start: int, cache: dict | None = None):
        return self.run_moe(t, start, cache)[0]  # LlamaBlock's interface, the statistics left out

    def decode(self, t: StageTuple, cache: dict, start: int) -> StageTuple:
        """Cached generation: as forward, so the tuple keeps the schema's moe_stats for the layers after (whose
        decode may run their forward on it); nothing reads it there."""
        hidden, stats = self.run_moe(t, start, cache)
        carried = t.moe_stats
        return t._replace(hidden=hidden, moe_stats=stats if carried is None else carried + stats)


class PreNormMoeBlock(MoeBlock):
    """MoeBlock for a LlamaBlock-shaped dense block (pre-norm attention, then pre-norm MLP; its `geometry` gives the
    mask and rotary): the MLP is SparseMoe. Mixed in before the dense class: Qwen3MoeBlock, InternMoeBlock."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.mlp = SparseMoe(cfg)

    def run_moe(self, t: StageTuple, start: int, cache: dict | None = None):
        mask, rotary = self.geometry(t, start, cache)
        x = t.hidden + self.self_attn(self.input_layernorm(t.hidden), mask, rotary, cache)
        y, stats = self.mlp(self.post_attention_layernorm(x), t.segments > 0)
        return x + y, stats


class Qwen3MoeBlock(PreNormMoeBlock, Qwen3Block):
    """Qwen3Block with the sparse MLP; adds its layer's router statistics to the carried `moe_stats`."""


MOE_STATS = StageField("moe_stats", True, made_by=Qwen3MoeBlock)  # kept to the head, which reads it


def aux_loss(stats: torch.Tensor, real_positions: torch.Tensor, layers: int) -> torch.Tensor:
    """transformers' load_balancing_loss_func from the summed statistics: stats [B, 2, E] (counts, probabilities),
    real_positions: the micro-batch's real positions (a tensor), layers: the MoE layers that added to stats."""
    s = stats.sum(0)
    n = (real_positions * layers).clamp(min=1).to(s.dtype)
    return s.shape[-1] * ((s[0] / n) * (s[1] / n)).sum()


class MoeHead(LMHeadLinear):
    """The untied head of an MoE model: (logits [B, L, V], aux_coef x the micro-batch's load-balancing loss)."""

    def __init__(self, cfg: ModelConfig):
        super().__init__(cfg)
        self.layers, self.coef = cfg.text.n_layers, cfg.text.moe.aux_coef
        self.last_aux = torch.zeros(())  # the last micro-batch's aux_loss, 0 before the first

    def forward(self, args):
        t = unpack_in(self, args)
        aux = self.coef * aux_loss(t.moe_stats, (t.segments > 0).sum(), self.layers)
        self.last_aux = aux.detach()  # what the pipeline reports as the micro-batch's aux_loss (VLMPipeline)
        return self.lm_head(t.hidden), aux

    def decode(self, t: StageTuple, cache: dict, start: int):
        return self.lm_head(t.hidden)


class TiedMoeHead:
    """The MoE head tied to the input embedding (a Qwen3-VL-MoE saved with tie_word_embeddings, as transformers
    then loads it): a TiedLayerSpec's forward_fn, (embed, args) -> what MoeHead returns, keeping last_aux likewise.
    DeepSpeed calls it as partial(fn, the tied embedding), so no layer of the list holds it and bind_fields cannot
    name its tuple: `fields` is the one entering the list's last layer, computed from the whole list (moe_head)."""

    def __init__(self, cfg: ModelConfig, fields: tuple[StageField, ...]):
        self.fields, self.layers, self.coef = fields, cfg.text.n_layers, cfg.text.moe.aux_coef
        self.last_aux = torch.zeros(())

    def __call__(self, embed: nn.Module, args):
        t = StageTuple.unpack(args, self.fields)
        aux = self.coef * aux_loss(t.moe_stats, (t.segments > 0).sum(), self.layers)
        self.last_aux = aux.detach()
        return F.linear(t.hidden, embed.embed_tokens.weight), aux


def head_aux(head) -> torch.Tensor:
    """The last micro-batch's weighted aux loss kept by a stage's last layer: MoeHead, or DeepSpeed's
    partial(TiedMoeHead, embedding) (the reference's TiedCall holds the same object as forward_fn)."""
    fn = head.func if isinstance(head, functools.partial) else head.__dict__.get("forward_fn", head)
    return getattr(fn, "__wrapped__", fn).last_aux  # under --tp the partial's func wraps it (tensor_parallel._tp_head)


def split_aux(out) -> tuple[torch.Tensor, torch.Tensor | None]:
    """A head's output -> (logits, the weighted auxiliary loss or None): MoeHead returns both, other heads logits."""
    return (out[0], out[1]) if isinstance(out, (tuple, list)) else (out, None)


def moe_head(specs: list[LayerSpec], cfg: ModelConfig) -> list[LayerSpec]:
    """A family's whole layer list with its head replaced by the one that finishes the load-balancing loss: MoeHead
    for an untied head (LMHeadLinear), TiedMoeHead on the embedding for a tied one."""
    from ..registry import family_of  # the config layer, asked once the families are registered
    head = specs[-1]
    if isinstance(head, TiedLayerSpec):
        fields = live_fields(family_of(cfg).fields(cfg), [s.typename for s in specs])[-2]
        return specs[:-1] + [TiedLayerSpec(head.key, head.typename, cfg, forward_fn=TiedMoeHead(cfg, fields),
                                           tied_weight_attr=head.tied_weight_attr)]
    assert head.typename is LMHeadLinear, f"an MoE head replaces LMHeadLinear, not {head.typename.__name__}"
    return specs[:-1] + [LayerSpec(MoeHead, cfg)]


def qwen3_vl_moe_specs(cfg: ModelConfig) -> list[LayerSpec]:
    """Qwen3-VL's layer list with every decoder block sparse and the head that returns the auxiliary loss."""
    return moe_head(qwen3_vl_specs(cfg, block=Qwen3MoeBlock), cfg)


def qwen3_vl_layers(cfg: ModelConfig) -> list[LayerSpec]:
    """The qwen3_vl family's layer list: sparse when the text config has an moe section, else dense."""
    return qwen3_vl_moe_specs(cfg) if cfg.text.moe else qwen3_vl_specs(cfg)


def moe_fields(cfg: ModelConfig) -> tuple[StageField, ...]:
    return (MOE_STATS,) if cfg.text.moe else ()


def expert_params(cfg: ModelConfig) -> int:
    """One expert's weights: 3 D F (gate, up, down)."""
    return 3 * cfg.text.dim * cfg.text.moe.ff_dim


def sparse_cost(dense_rule, cfg, params, n, seq):
    """A sparse block's cost from its dense kind's rule (`dense_rule(cfg, params, n, seq)`, which counts one SwiGLU
    of text.ff_dim): that rule on the ACTIVE parameters (the router, the shared expert and its gate, and top_k of
    the E experts each position runs), and top_k experts' activations in place of the dense MLP's; the dispatch's
    sort and the gathered copies of x (top_k x D a position) counted. A shared expert of width Fs keeps a SwiGLU's
    4 Fs a position, its gate's logit and sigmoid and the output they scale (D + 2). The all-to-all of --ep is the
    planner's (mmpipe.planning.costmodel), not the rule's."""
    m, t = cfg.text.moe, cfg.text
    active = params - (m.experts - m.top_k) * expert_params(cfg)
    dense = dense_rule(cfg, active, n, seq)
    shared = 4 * m.shared_ff_dim + t.dim + 2 if m.shared_ff_dim else 0
    extra = (m.top_k * (t.dim + 4 * m.ff_dim) + shared - 4 * t.ff_dim + 2 * m.experts) * seq
    return costs.Cost(dense.tokens, dense.fwd, dense.act + extra, dense.fp32 + m.experts * seq, dense.out)


def _moe_block(cfg, params, n, seq):
    """A first cut (docs/moe.md): Qwen3-VL's dense block rule made sparse (sparse_cost)."""
    return sparse_cost(costs._llama_block, cfg, params, n, seq)


MOE_BLOCK = costs.LayerRule("Qwen3MoeBlock", _moe_block, "sequence", experts=True)
