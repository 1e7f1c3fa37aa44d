"""The SP axis of `mmpipe plan --sp N[,N...]` (issue 58, item 5): Ulysses sequence parallelism inside each stage, as
`mmpipe train --sp N` runs it (docs/sequence_parallel.md), read as costs.

Each layer's rows at SP s are its rows at SP 1 as one SP rank holds and runs them (`sp_layer_costs`):

    parameters  whole on every SP rank (replicated: the weights, gradients and optimizer states are SP 1's)
    positions   each rank holds L / s of the row's positions from the embedding to the loss, so every kept
                activation and every boundary send is / s
    tower       split by whole images (mmpipe.model.sp_tower: the greedy on patch counts, a rank's load at most
                total / s + the largest image) only where one stage holds the tower's first and last layer: there
                a rank's tower FLOPs and kept activations are ceil(M / s) / M of the row's (M images of equal size
                a row, the planner's unit: the greedy's exact load at a micro-batch of one row, and at b rows an
                upper bound, ceil(b M / s) <= b ceil(M / s)), and after the merger one all-gather, padded to the
                largest rank's N_max tokens, hands every rank the whole [B, P / merge^2, D] again: (s - 1) x N_max
                x D_all elements in per rank (hidden and Qwen3-VL's DeepStack sets), as many out in the backward's
                reduce-scatter (sp_seconds, at device.link). A cut inside the tower leaves it replicated, every
                rank running all of it (LayerCost.replicated, picked by sp_stage_rows). Either way the merger's
                send is whole. E.g. qwen3-vl-8b with 1 image a row at s = 2: ceil(1 / 2) / 1 = the whole tower on
                one rank (the other idle), with 4 images 2 / 4
    head        the tiled loss (mmpipe.model.sequence_parallel.TiledCrossEntropy) keeps the head's input hidden
                [L / s, D] (its save_for_backward: hidden, the weight, the labels and LossNorm weights the batch
                holds anyway) and no logits; it makes them a tile of positions at a time, forward and again
                backward, so the head's fp32 logits are one tile's, min(tile_positions(V), L / s) x V (`_tiled_head`),
                not the slice's L / s x V. E.g. qwen3-vl-8b at L = 133,376, s = 2: 1,767 x 151,936 x 4 B = 1.0 GiB,
                not 66,688 x 151,936 x 4 B = 37.7 GiB
    FLOPs       / s: the linears run on L / s positions; between the all-to-alls a rank attends over the whole
                row's L positions for H / s heads, so attention's L^2 part is / s too
    all-to-all  each decoder block's attention trades positions for heads before attention (q, k, v: [L / s, D]
                and 2 x [L / s, kv]) and heads for positions after it ([L / s, D]): (2 D + 2 kv) L / s elements a
                sample forward, as many backward; an all-to-all keeps 1 / s of its tensor and sends the rest, so
                it costs (s - 1) / s x bytes / device.link (sp_seconds). E.g. qwen3-vl-8b (D 4096, 8 kv heads of
                128) at L = 131,072, s = 4, bf16: (8192 + 2048) x 32,768 x 2 B = 671 MB a block forward, 3 / 4 of
                it over 450 GB/s = 1.1 ms
    gradients   each SP rank's gradient is its positions' share: summed over the SP ranks once a step, as DP's,
                so the step's all-reduce runs over dp x s ranks (pipeline_step_seconds' dp)

SP shares the node with TP (tp x sp must divide the GPUs per node: both collectives sit on every block's critical
path) and needs the heads and KV heads divided (each rank attends with H / s of them); under TP the heads a TP rank
holds, H / tp (sp_divides: the pairs `mmpipe train --tp --sp` takes), and its all-to-all carries that rank's heads.
"""
from __future__ import annotations

import dataclasses

from ..config import ModelConfig
from ..flags import degrees
from ..model.builder import layer_specs
from ..model.sequence_parallel import tile_positions
from ..model.sp_tower import TOWER
from ..registry import family_of
from .costmodel import BYTES, Device, LayerCost


def _attention_block(r: LayerCost) -> bool:
    """A decoder block (its rule's name ends in Block, group text): the layers whose attention runs the all-to-alls."""
    return r.group == "text" and r.name.endswith("Block")


def _head(cfg: ModelConfig, r: LayerCost) -> bool:
    """The loss's head (costs.LM_HEAD / LINEAR_HEAD: its output the row's logits, tokens x V)."""
    return r.name == "LMHead" and r.out_elems == r.tokens * cfg.text.vocab_size


def _tiled_head(cfg: ModelConfig, whole: LayerCost, r: LayerCost, sp: int, tp: int = 1) -> LayerCost:
    """The head's row r at SP `sp` (whole: at SP 1) under the tiled loss: all but its fp32 logits / sp as any layer's
    (r has that), and of the logits one tile's, min(tile_positions(V / tp), L / sp) positions x the rank's V / tp
    (whole: one TP rank's rows at tp > 1; a tile is as many bytes at any TP). Per sample: a micro-batch's tile spans its
    micro x L / sp positions, so micro x this is an upper bound on the tile for micro > 1. E.g. qwen3-vl-8b at
    L = 133,376, sp 2: 4096 x 66,688 bf16 hidden + 1,767 x 151,936 fp32 logits = 0.5 GiB + 1.0 GiB a sample."""
    logits = min(whole.act_fp32_elems, whole.out_elems)  # the fp32 logits (LM_HEAD's 2 L statistics beside them)
    tile = min(tile_positions(cfg.text.vocab_size // tp), whole.tokens / sp) * logits / whole.tokens
    return dataclasses.replace(r, act_elems=(whole.act_elems - logits) / sp + tile,
                               act_fp32_elems=(whole.act_fp32_elems - logits) / sp + tile)


def sp_layer_costs(cfg: ModelConfig, rows: list[LayerCost], sp: int, tp: int = 1, images: int = 1
                   ) -> list[LayerCost]:
    """rows (at SP 1, or one TP rank's at `tp`) as one SP rank of `sp` holds and runs them (module docstring); sp = 1:
    rows unchanged. The all-to-all elements per sample go in sp_a2a: under TP a rank exchanges its own heads, D / tp
    of q and its kv heads (Hkv / tp, or the 1 it uses where tp exceeds Hkv), repeated up to sp where fewer
    (mmpipe.model.sequence_parallel.kv_for_sp). The head keeps the tiled loss's (_tiled_head; under TP its tiles
    are of the rank's V / tp logits, the vocab-parallel loss a tile at a time). The tower (tower_span) split by
    images: `images` a row (_split_tower)."""
    if sp == 1:
        return rows
    t = cfg.text
    kv_heads = t.kv_heads // tp if t.kv_heads % tp == 0 else 1
    kv = (kv_heads if kv_heads % sp == 0 else sp) * (t.dim // t.n_heads)
    split = [dataclasses.replace(
        r, fwd_flops=r.fwd_flops / sp, bwd_flops=r.bwd_flops / sp, w_flops=r.w_flops / sp,
        act_elems=r.act_elems / sp, act_fp32_elems=r.act_fp32_elems / sp, out_elems=r.out_elems / sp,
        carried_elems=(r.carried_elems - r.carried_fp32_elems) / sp + r.carried_fp32_elems,  # moe_stats: whole
        tp_ar_fwd=r.tp_ar_fwd / sp, tp_ar_bwd=r.tp_ar_bwd / sp,
        sp_a2a=(2 * t.dim / tp + 2 * kv) * r.tokens / sp if _attention_block(r) else 0.0) for r in rows]
    split = [_tiled_head(cfg, whole, r, sp, tp) if _head(cfg, whole) else r for whole, r in zip(rows, split)]
    span = tower_span(cfg)
    if span is not None and len(rows) == len(layer_specs(cfg)):  # the model's table (not a hand-made excerpt)
        a, b = span
        split[a:b] = _split_tower(rows[a:b], sp, images)
    return split


def tower_span(cfg: ModelConfig) -> tuple[int, int] | None:
    """The layers mmpipe.model.sp_tower splits over SP, [first, end): from the tower's first layer (its patch
    embedding) to its last (the merger / projector), as the family's sp_plan names them; None for a family
    without a tower plan (nothing to split)."""
    tower = family_of(cfg).sp_plan.get(TOWER)
    if tower is None:
        return None
    types = [s.typename for s in layer_specs(cfg)]
    first = [i for i, k in enumerate(types) if isinstance(k, type) and issubclass(k, tower.entry)]
    last = [i for i, k in enumerate(types) if isinstance(k, type) and issubclass(k, tower.exit)]
    return (first[0], last[-1] + 1) if first and last and first[0] <= last[-1] else None


def _split_tower(rows: list[LayerCost], sp: int, images: int) -> list[LayerCost]:
    """The tower's rows (whole: SP 1's, or one TP rank's) as one SP rank runs them where its stage holds all of the
    tower (module docstring): FLOPs and kept activations x ceil(M / sp) / M, the last layer's output (and the
    sets it carries) whole (the all-gather's result), its sp_gather N_max x D_all a sample; each row's
    `replicated` the whole row (a cut inside the tower). E.g. M = 3 images at sp 2: 2 / 3 of the tower a rank."""
    m = max(1, images)
    f = -(-m // sp) / m  # ceil(M / sp) / M: the busiest rank's share of the row's images
    out = []
    for i, r in enumerate(rows):
        last = i == len(rows) - 1
        sets = r.carried_elems - r.carried_fp32_elems
        out.append(dataclasses.replace(
            r, fwd_flops=r.fwd_flops * f, bwd_flops=r.bwd_flops * f, w_flops=r.w_flops * f,
            act_elems=r.act_elems * f, act_fp32_elems=r.act_fp32_elems * f,
            out_elems=r.out_elems if last else r.out_elems * f,
            carried_elems=r.carried_elems if last else sets * f + r.carried_fp32_elems,
            tp_ar_fwd=r.tp_ar_fwd * f, tp_ar_bwd=r.tp_ar_bwd * f,
            sp_gather=f * (r.out_elems + sets) if last else 0.0, replicated=r))
    return out


def sp_stage_rows(rows: list[LayerCost], parts: list[int]) -> list[LayerCost]:
    """rows (sp_layer_costs') as the stages `parts` run them: the tower split where one stage holds all of it, each
    tower row its `replicated` (whole on every SP rank) where a boundary falls inside the tower."""
    tower = [i for i, r in enumerate(rows) if r.replicated is not None]
    if not tower or not any(tower[0] < p <= tower[-1] for p in parts):
        return rows
    return [r.replicated if r.replicated is not None else r for r in rows]


def replicated_rows(rows: list[LayerCost]) -> list[LayerCost]:
    """rows with the tower whole on every SP rank (a cut inside it): sp_stage_rows with such a cut."""
    return [r.replicated if r.replicated is not None else r for r in rows]


def cuts_tower(rows: list[LayerCost], a: int, b: int) -> bool:
    """Whether a stage of layers [a, b) holds part of the split tower but not all of it."""
    tower = [i for i, r in enumerate(rows) if r.replicated is not None]
    return bool(tower) and a <= tower[-1] and b > tower[0] and not (a <= tower[0] and b > tower[-1])


def sp_divides(cfg: ModelConfig, tp: int, sp: int) -> bool:
    """`mmpipe train --tp tp --sp sp` takes cfg's decoder (run_config._check_sp's rule): sp divides the attention heads
    a TP rank holds, H / tp, and its KV heads (Hkv / tp, or 1 where tp exceeds Hkv) are divided by sp or, under TP,
    divide it."""
    t = cfg.text
    kv = t.kv_heads // tp if t.kv_heads % tp == 0 else 1
    return (t.n_heads // tp) % sp == 0 and (kv % sp == 0 or (tp > 1 and sp % kv == 0))


def sp_seconds(rows: list[LayerCost], parts: list[int], micro: int, precision: str, sp: int, device: Device
               ) -> list[tuple[float, float]]:
    """Per stage, its all-to-alls of one micro-batch, (forward, backward) seconds: (sp - 1) / sp x elements x micro
    x dtype bytes / device.link each way (a checkpointed block's recompute runs its forward ones again in the
    backward); the split tower's all-gather (forward) and reduce-scatter (backward): (sp - 1) x N_max x D_all x
    micro x dtype bytes / device.link each (rows: sp_stage_rows' for these parts). E.g. N_max x D_all = 2048 x 4096
    at sp 2, bf16, 450 GB/s: 16.8 MB, 37 us."""
    if sp == 1:
        return [(0.0, 0.0)] * (len(parts) - 1)
    per = (sp - 1) / sp * micro * BYTES[precision] / device.link
    gather = (sp - 1) * micro * BYTES[precision] / device.link
    out = []
    for a, b in zip(parts, parts[1:]):
        g = sum(r.sp_gather for r in rows[a:b]) * gather
        out.append((sum(r.sp_a2a for r in rows[a:b]) * per + g,
                    sum(r.sp_a2a * (2 if r.recompute else 1) for r in rows[a:b]) * per + g))
    return out


def check_sp(text: str, cfg: ModelConfig, gpus_per_node: int, tps: tuple[int, ...]
             ) -> tuple[tuple[int, ...], list[str]]:
    """--sp N[,N...] -> (the degrees to plan, a note per degree left out and why): each >= 1 (else ConfigError); above
    1 only where it divides the heads and KV heads and, with the smallest TP asked, the GPUs per node."""
    keep, notes, t = [], [], cfg.text
    for sp in degrees("--sp", text):
        why = ("" if sp == 1 else
               f"it does not divide {cfg.name}'s {t.n_heads} attention heads" if t.n_heads % sp else
               f"it does not divide {cfg.name}'s {t.kv_heads} KV heads" if t.kv_heads % sp else
               f"{min(tps)} TP x {sp} SP does not divide {gpus_per_node} GPUs per node (both stay inside a node)"
               if gpus_per_node % (min(tps) * sp) else "")
        if why:
            notes.append(f"sp: {sp} left out: {why}")
        else:
            keep.append(sp)
    return tuple(keep) or (1,), notes
