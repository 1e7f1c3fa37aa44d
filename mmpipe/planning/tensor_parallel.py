"""The TP axis of `mmpipe plan --tp N[,N...]` (issue 54, item 7): a family's tensor-parallel plan
(mmpipe.registry.Family.tp_plan, what `mmpipe train --tp` applies: mmpipe.model.tensor_parallel) read as costs.

Each layer's rows at TP t are its rows at TP 1 with what one TP rank holds, does and exchanges
(`tp_layer_costs`). Which weights are split is the plan's own answer (`split_dims`, what a TP checkpoint's shards
are concatenated along), read off the layer built on the meta device:

    parameters  split weights / t, the rest whole (norms, replicated towers, kv weights with fewer kv heads
                than ranks); gradients and optimizer states follow (they are the parameters' own)
    FLOPs       forward = the replicated weights' 2 x params x tokens + the rest / t (the split matmuls and the
                per-head attention: each rank runs its heads); backward and ZB-H1's W scaled alike; an embedding's
                lookup whole
    activations a vocab-parallel head: its fp32 logits / t (no rank holds the row's full-vocabulary logits);
                a split block keeps whole 6 tensors of its output's width per position (Megatron's replicated
                region without sequence parallelism: the block's input, the two norms' inputs and outputs, the
                residual sum) and its fp32 statistics, the rest of what it keeps / t (q, k, v, the attention
                output, the row-parallel inputs, the MLP's intermediates). E.g. a LlamaBlock keeps
                (9 D + 2 kv + 4 F) L values: 6 D L whole, (3 D + 2 kv + 4 F) L / t. A layer whose rows keep less
                than 6 outputs (a merger, whose output is a quarter of its patches) is counted whole: an upper bound
    all-reduces Megatron's: a row-parallel linear's output summed over the TP group forward, its column region's
                input gradient backward (copy_to_tp), so a block with r row linears (LlamaBlock: o_proj, down_proj)
                all-reduces r x its output [B, L, D] forward and r backward; a vocab embedding its lookup forward;
                a vocab head its input's gradient backward. Each is a ring over t ranks of the node's link:
                2 (t - 1) / t x bytes / device.link seconds (tp_seconds)

An MoE block (mmpipe.model.tp_plans: Megatron's expert tensor parallelism) splits its attention as a dense block and
each expert by its FFN width F (gate / up column, down row over F / t), the router replicated:

    parameters  all E experts' 3 D F / t on a rank (expert_params / t: --ep then keeps E / ep of those, so a rank holds
                E / ep experts x 1 / t of each); the router [E, D] and the norms whole
    FLOPs       the rule's (the active parameters: top_k experts a position) less the router's 2 E D a position, / t
    activations the rule's top_k x 4 F a position (each choice's gate, up, silu, product) / t; whole: the 6 widths
                above, the dispatched copies of x (top_k x D a position), the router's logits and probabilities
                (2 E: E of them fp32) and a shared expert's gate output (D + 2)
    all-reduces one more row region: the experts' weighted partial outputs [N, D] summed once forward, their input x
                [N, D] and the top-k weights [N, top_k] entering the TP region (copy_to_tp) summed backward; a shared
                expert's down is a row linear of its own
    all-to-all  unchanged: --ep's groups are per TP coordinate (mmpipe.runtime.experts), each TP rank sends its
                (position, choice) rows, D wide, to the same TP rank of its EP peers and takes back partial outputs
                of D: positions x top_k x D a block, as at TP 1

Under --sequence-parallel (Megatron's; mmpipe.model.tensor_parallel, the plan's SEQUENCE) the decoder blocks and the
final norm keep 1/TP of everything, the 6 widths and the statistics too (Megatron's (34 / t) s b h a layer: all of it
over t), and a stage boundary inside the decoder sends [B, L / TP, D] per TP rank; the collectives move the same
bytes, each all-reduce now an all-gather and a reduce-scatter, its two halves, and backward an all-gather more per
row region (its column linears' input gathered again: they keep the positions, not the row).

Without it a stage boundary sends the whole activation per TP rank (pipe_partitioned off: mmpipe.runtime.pipeline), and
the data-parallel all-reduce each rank's shard of the gradients over DP (the rows' trainable parameters, per rank).
TP stays inside a node (its all-reduces are on every block's critical path): `check_tp` skips a degree that does not
divide the GPUs per node.
"""
from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..flags import degrees
from ..model.builder import layer_specs, shapes_only
from ..registry import family_of
from .costmodel import BYTES, Device, LayerCost

WHOLE_WIDTHS = 6  # a split block's replicated tensors of its output's width per position (module docstring)


@dataclasses.dataclass(frozen=True)
class Split:
    """One layer at TP t: its split parameters (of LayerCost.params), its row-parallel linears, whether it is a
    vocab-split embedding or head (no row linear: an nn.Embedding or a head's column split), and whether the plan's
    SEQUENCE runs it on 1/TP of the row's positions under --sequence-parallel (a block, the final norm, a head)."""
    params: int
    rows: int
    vocab: bool
    positions: bool = False


def layer_splits(cfg: ModelConfig, tp: int) -> list[Split]:
    """Per layer of cfg's list, what the family's plan splits at `tp` ranks (mmpipe.model.tensor_parallel.split_dims
    on the layer built on the meta device: a tied head's spec builds its embedding, whose table is the split)."""
    from ..model.tensor_parallel import POSITIONS, split_dims
    plan, out, seen = family_of(cfg).tp_plan, [], {}
    with shapes_only():
        for spec in layer_specs(cfg):
            key = (spec.typename, repr(spec.module_kwargs), getattr(spec, "forward_fn", None) is not None)
            if key not in seen:
                layer = spec.build()
                dims, state = split_dims(layer, plan, tp), dict(layer.named_parameters())
                split = sum(state[k].numel() for k in dims if k in state)
                rows = sum(1 for k, d in dims.items() if _row_split(state.get(k), d))
                # split weights and no row linear: a vocabulary's (today's plans end every column region in a row)
                seen[key] = Split(split, rows, bool(split) and rows == 0, _role(plan, spec) == POSITIONS)
            out.append(seen[key])
    return out


def _role(plan: dict, spec):
    """The plan's SEQUENCE role of a layer spec (None: none): keyed by its class, or a tied head's forward_fn, a
    function or an instance of a class the plan names (TiedMoeHead), as tensor_parallel.parallelize reads it."""
    from ..model.tensor_parallel import SEQUENCE
    roles, fn = plan.get(SEQUENCE, {}), getattr(spec, "forward_fn", None)
    if fn is None:
        return roles.get(spec.typename)
    return roles[fn] if fn in roles else roles.get(type(fn))


def _name(spec) -> str:  # a class's, a function's name; an instance's class's
    fn = getattr(spec, "forward_fn", None)
    key = spec.typename if fn is None else fn
    return getattr(key, "__name__", None) or type(key).__name__


def _row_split(param, dim) -> bool:
    """A row-parallel weight: split along its last (input) dim, a Linear's [out, in] by 1 or an MoE block's experts'
    down [E, D, F] by 2 (its output then summed over TP); not a LoRA adapter (--lora is not planned at TP > 1)."""
    return param is not None and isinstance(dim, int) and param.dim() >= 2 and dim == param.dim() - 1


def _moe_whole(cfg: ModelConfig, r: LayerCost) -> float:
    """An MoE block's activations whole on every TP rank beyond the dense block's (module docstring), per sample:
    positions x (top_k x D dispatched copies of x + E router logits + a shared expert gate's D + 2; the rule's
    other E, the fp32 probabilities, are among the statistics kept whole anyway); 0 for any other layer. E.g.
    qwen3-vl-235b-a22b (D 4096, 128 experts, top 8): (8 x 4096 + 128) L."""
    if not r.expert_params:
        return 0.0
    m, d = cfg.text.moe, cfg.text.dim
    return float(r.tokens * (m.top_k * d + m.experts + (d + 2 if m.shared_ff_dim else 0)))


def tp_layer_costs(cfg: ModelConfig, rows: list[LayerCost], tp: int, sequence: bool = False) -> list[LayerCost]:
    """rows (costmodel.layer_costs at TP 1) as one TP rank of `tp` holds and runs them (module docstring); tp = 1:
    rows unchanged. The all-reduce elements per sample go in tp_ar_fwd / tp_ar_bwd. sequence: --sequence-parallel
    (module docstring: the plan's POSITIONS layers keep 1/TP of everything)."""
    if tp == 1:
        return rows
    rows = [_sequence_row(cfg, r, _rank_row(cfg, r, s, tp), s, tp) if sequence else _rank_row(cfg, r, s, tp)
            for r, s in zip(rows, layer_splits(cfg, tp))]
    return _carried(cfg, rows, tp, sequence)


def _carried(cfg: ModelConfig, rows: list[LayerCost], tp: int, sequence: bool) -> list[LayerCost]:
    """Each row's carried fields (costmodel._carry) as one TP rank carries them: a field of the plan's CARRIED
    (Gemma 4's K/V, the rank's kv heads) at its width at tp; under --sequence-parallel a per-position field the
    decoder embedding makes with the row (Gemma 4's per-layer inputs, scattered with it: tensor_parallel._scattered)
    on 1/TP of the positions. A per-position field's positions are the row's (r.tokens of a decoder layer). E.g.
    gemma-4-e4b (2 kv heads), 1282 positions, after its last K/V producer: 17.72 M floats carried at TP 1, 15.75 M a
    rank at TP 2 (the K/V fields halved), 8.86 M with SP (the per-layer inputs, 42 x 256 a position, halved too);
    gemma-4-e2b's one kv head stays whole on each rank."""
    from ..model.stage import live_fields
    from ..model.tensor_parallel import CARRIED, SCATTER, SEQUENCE
    family = family_of(cfg)
    widths, roles = family.tp_plan.get(CARRIED, {}), family.tp_plan.get(SEQUENCE, {}) if sequence else {}
    specs = layer_specs(cfg)
    outs = live_fields(family.fields(cfg), [s.typename for s in specs])[1:]
    out = []
    for r, fields in zip(rows, outs):
        less = 0.0
        for f in (f for f in fields if f.floating and f.per_position):
            whole = f.per_position(cfg) * r.tokens
            if f.name in widths:
                less += whole - widths[f.name](cfg, tp) * r.tokens
            elif roles.get(f.made_by) == SCATTER:
                less += whole * (1 - 1 / tp)
        out.append(dataclasses.replace(r, carried_elems=r.carried_elems - less) if less else r)
    return out


def _sequence_row(cfg: ModelConfig, whole: LayerCost, r: LayerCost, s: Split, tp: int) -> LayerCost:
    """A layer under --sequence-parallel (whole: its row at TP 1, r: at TP tp): a block or the final norm (POSITIONS,
    not a vocab head) keeps and sends 1/TP of all it keeps and sends at TP 1, its replicated region (the 6 widths,
    the fp32 statistics) now on this rank's positions too; the head saves its gathered input and its logits'
    vocabulary slice as without SP. Its collectives move the bytes they did (an all-gather and a reduce-scatter are
    the two halves of a ring all-reduce, (t - 1) / t x bytes each), and half an all-reduce more per row region
    backward (the re-gather). An MoE block routes its positions but runs its experts on the row gathered over TP
    (mmpipe.model.tp_plans): the dispatched copies of x (top_k x D a position of the row) stay whole on each rank,
    and its experts' row region re-gathers nothing (they keep the gathered copies)."""
    if not s.positions or s.vocab:
        return r
    # what the layer keeps at TP 1 (whole: its split part and its replicated region), all of it over tp; r, the TP
    # rank's row, has the split part over tp already and the replicated region whole
    # backward, each region's row gathered again for its column linears' weight gradients (they keep the positions,
    # not the row: tensor_parallel._GatheredLinear): an all-gather, half a ring all-reduce of the row
    dispatched = r.tokens * cfg.text.moe.top_k * cfg.text.dim if r.expert_params else 0.0
    regathers = s.rows - (1 if r.expert_params else 0)  # the experts' down_proj [E, D, F] is a row split, not entered
    return dataclasses.replace(r, act_elems=whole.act_elems / tp + dispatched * (1 - 1 / tp),
                               act_fp32_elems=whole.act_fp32_elems / tp,
                               out_elems=r.out_elems / tp,  # what it sends across a cut, a checkpointed block keeps
                               tp_ar_bwd=r.tp_ar_bwd + regathers * r.out_elems / 2)


def _rank_row(cfg: ModelConfig, r: LayerCost, s: Split, tp: int) -> LayerCost:
    if not s.params:
        return r
    off = 1 - 1 / tp  # the share of a split quantity another rank holds
    params = r.params - s.params * off  # trainable_params, gradients and optimizer states follow the rank's own
    # the FLOPs a rank does: all but the replicated weights' matmuls split (the lookup of an embedding: whole)
    split_flops = 0.0 if r.embedding else max(0.0, r.fwd_flops - 2.0 * (r.params - s.params) * r.tokens)
    scale = (r.fwd_flops - split_flops * off) / r.fwd_flops if r.fwd_flops else 1.0
    act, fp32 = r.act_elems, r.act_fp32_elems
    if s.vocab and not r.embedding:  # the head: its fp32 logits [L, V] (its output) split
        act, fp32 = act - r.out_elems * off, fp32 - r.out_elems * off
    elif s.rows:  # a block: all but its replicated region (WHOLE_WIDTHS outputs, an MoE block's dispatch and
        # router) and fp32 statistics split
        act -= max(0.0, act - fp32 - WHOLE_WIDTHS * r.out_elems - _moe_whole(cfg, r)) * off
    if s.vocab and r.embedding:  # the lookup's rows summed over TP forward
        ar_fwd, ar_bwd = r.out_elems, 0.0
    elif s.vocab:  # the head's input enters the TP region: its gradient summed backward
        ar_fwd, ar_bwd = 0.0, float(r.tokens * cfg.text.dim)
    else:  # an MoE block's router weights [N, top_k] enter the experts' TP region too (tp_plans._experts_forward)
        ar_fwd = ar_bwd = s.rows * r.out_elems
        ar_bwd += r.tokens * cfg.text.moe.top_k if r.expert_params else 0.0
    # the experts (of params) split alike: --ep's share of them is 1 / ep of this rank's slices
    experts = r.expert_params // tp
    return dataclasses.replace(
        r, params=round(params), fwd_flops=r.fwd_flops * scale, bwd_flops=r.bwd_flops * scale,
        w_flops=r.w_flops * scale, act_elems=act, act_fp32_elems=fp32, tp_ar_fwd=ar_fwd, tp_ar_bwd=ar_bwd,
        expert_params=experts)


def tp_seconds(rows: list[LayerCost], parts: list[int], micro: int, precision: str, tp: int, device: Device
               ) -> list[tuple[float, float]]:
    """Per stage, its TP all-reduces of one micro-batch, (forward, backward) seconds: each a ring over the tp ranks
    of a node, 2 (tp - 1) / tp x elements x micro x dtype bytes / device.link (a checkpointed block's forward ones
    twice: its recompute). E.g. qwen2.5-vl-72b's decoder block
    at L = 4,096 + text, D 8,192, bf16, micro 1, tp 8 over 450 GB/s: 2 x [L, 8192] x 2 B forward, each 7 / 4 x
    bytes / link."""
    if tp == 1:
        return [(0.0, 0.0)] * (len(parts) - 1)
    ring = 2 * (tp - 1) / tp * micro * BYTES[precision] / device.link
    # a checkpointed block's recompute in the backward runs its forward all-reduces again
    return [(sum(r.tp_ar_fwd for r in rows[a:b]) * ring,
             sum(r.tp_ar_bwd + (r.tp_ar_fwd if r.recompute else 0.0) for r in rows[a:b]) * ring)
            for a, b in zip(parts, parts[1:])]


def sequence_parallel_problems(tp: int, model: ModelConfig | None, data, lora: int) -> list[str]:
    """`--sequence-parallel` (Megatron's, mmpipe.model.tensor_parallel: the decoder's norms and residuals on 1/TP of
    a row's positions) at `tp`: one line per problem. It needs --tp above 1, a plan whose SEQUENCE gives every layer
    from the decoder embedding on a role (every built-in plan's but the cross-attention family's), a row of decoder
    positions TP divides (refused, not padded: the row length is --text-len + the image tokens, so the fix is one
    flag). `lora` (the rank) is not refused: an adapter on a row layer reduce-scatters its A x with the base's rows
    (tensor_parallel.adapters_split), its dropout mask each rank's slice (tests/test_lora_dropout_split.py)."""
    from ..data.packing import row_shape
    from ..model.tensor_parallel import sequence_roles
    if tp <= 1:
        return ["--sequence-parallel: it needs --tp 2 or more (it splits each TP group's row by position)"]
    plan = family_of(model).tp_plan if model is not None else {}
    if not plan:
        return []  # no plan: --tp itself is refused (run_config._check_tp)
    layers = [(_name(spec), _role(plan, spec)) for spec in layer_specs(model)]
    out = [f"--sequence-parallel on {model.name}: {why}" for why in sequence_roles(layers)]
    if data is not None:
        length = row_shape(model, data.max_images, data.text_len, data.vision_budget).length
        if length % tp:
            out.append(f"--sequence-parallel: --tp {tp} does not divide {model.name}'s {length} decoder positions per "
                       f"row (--text-len {data.text_len} + the image tokens): each TP rank holds L / TP of them")
    return out


def check_tp(text: str, cfg: ModelConfig, gpus_per_node: int, gpus: int) -> tuple[tuple[int, ...], list[str]]:
    """--tp N[,N...] -> (the degrees to plan, a note per degree left out and why): each >= 1 (else ConfigError);
    above 1 only for a family with a tensor-parallel plan (the one note 'planned at TP 1 only' otherwise), dividing
    the sizes `mmpipe train --tp` checks (heads, vocabulary, FFN width, the plan's SIZES; kv heads divided or
    dividing) and the GPUs per node (TP stays inside a node)."""
    tps = degrees("--tp", text)
    if not family_of(cfg).tp_plan:
        above = [tp for tp in tps if tp > 1]
        return (1,), ([f"tp: {cfg.name} ({family_of(cfg).label}) has no tensor-parallel plan yet: planned at TP 1 only"]
                      if above else [])
    keep, notes = [], []
    for tp in tps:
        why = _tp_refusal(cfg, tp, gpus_per_node, gpus)
        if why:
            notes.append(f"tp: {tp} left out: {why}")
        else:
            keep.append(tp)
    return tuple(keep) or (1,), notes


def _tp_refusal(cfg: ModelConfig, tp: int, gpus_per_node: int, gpus: int) -> str:
    """Why TP `tp` cannot run cfg on this cluster ('' where it can): as mmpipe.run_config._check_tp's sizes."""
    from ..model.tensor_parallel import tp_sizes
    if tp == 1:
        return ""
    if gpus_per_node % tp or gpus % tp:
        return f"it does not divide {gpus_per_node} GPUs per node (TP stays inside a node)"
    t = cfg.text
    for what, n in (("attention heads", t.n_heads), ("vocabulary", t.vocab_size), ("FFN width", t.ff_dim),
                    *tp_sizes(cfg, family_of(cfg).tp_plan)):
        if n % tp:
            return f"it does not divide {cfg.name}'s {n} {what}"
    if t.kv_heads % tp and tp % t.kv_heads:
        return f"it neither divides nor is a multiple of {cfg.name}'s {t.kv_heads} KV heads"
    return ""
