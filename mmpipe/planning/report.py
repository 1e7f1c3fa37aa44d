"""What `mmpipe plan` prints: the header (model, cluster, device, row), the row's budget line, an MoE model's
parameters and all-to-all, the layouts' table (one schedule, or every schedule side by side), the best layout's
stages, and the same layouts as JSON. It reads a resolved PlanRun (mmpipe.planning.request) and the layouts
(mmpipe.planning.plan.plan); it decides nothing.

Each row kind (mmpipe.model.costs: PatchRow, CropRow) names its budget flag (`row.flag`) and its kind
(`row.kind`), whose words and line ROW_WORDS below hold."""
from __future__ import annotations

import dataclasses
import json

from ..config import ModelConfig
from ..data.image_kinds import image_kind
from ..model.costs import PatchRow
from ..registry import family_of
from .costmodel import Device, row_positions
from .data_rows import rows_line
from .images import crop_line, crop_words, frame_words
from .layout import GiB, Layout
from .request import PlanRun
from .schedule_registry import ALL, BASELINE, BOTH, asked, schedule_named


def budget_words(row, between: str = " than ") -> str:
    """The row's vision budget flag and value, e.g. '--max-patches than 16384', '--max-tiles 37'."""
    return f"{row.flag}{between}{row.budget}"


def print_json(run: PlanRun, layouts: list[Layout]) -> None:
    """Every layout as JSON. throughput: rows/s (samples/s unless packed); positions_per_s = rows/s x L, padding
    included; an MoE model's layouts carry their EP (a dense model's keep their keys: no ep)."""
    s = run.spec
    length = row_positions(s.cfg, s.text_len, s.images, s.row)
    row = image_kind(s.cfg).row_json(s.row)  # the row's budget flag and its images' grids or tilings
    moe = family_of(s.cfg).experts(s.cfg) is not None
    # the TP / SP axes asked for: each layout's tp / sp (without --tp / --sp, the keys as before)
    tp, sp = s.tps != (1,), s.sps != (1,)
    keys = [{k: v for k, v in lay.__dict__.items() if (moe or k != "ep") and (tp or k != "tp") and (sp or k != "sp")}
            for lay in layouts]
    print(json.dumps([{**d, "throughput": lay.throughput, "decoder_length": length,
                       "positions_per_s": lay.throughput * length, **row} for d, lay in zip(keys, layouts)], indent=1))


def print_plan(run: PlanRun, layouts: list[Layout], seconds: float, beside: str = "") -> None:
    """The plan as text. beside: a line after the best layout (plan.fixed_first_stage's)."""
    s = run.spec
    moe = family_of(s.cfg).experts(s.cfg)
    length = row_positions(s.cfg, s.text_len, s.images, s.row)
    print(_header(run))
    print(_row_line(run, length))
    if moe:
        print(_moe_line(s.cfg, moe, s.text_len, length, s.precision))
    for note in run.tp_notes:
        print(note)
    tp, sp = s.tps != (1,), s.sps != (1,)
    if tp:
        print(f"tp: {', '.join(map(str, s.tps))}: each stage's layers split over TP ranks of a node by the "
              f"{s.cfg.family} family's plan (memory and time per TP rank, Megatron's 2 all-reduces forward and 2 "
              f"backward a block; docs/tensor_parallel.md); `mmpipe train --tp` runs fp32 (ZeRO 0 or 1) today")
    if sp:
        print(f"sp: {', '.join(map(str, s.sps))}: each row's positions split over SP ranks of a node (Ulysses: "
              f"activations and FLOPs per SP rank / SP, the loss a tile of logits at a time, weights whole, "
              f"4 all-to-alls forward and 4 backward a decoder block; docs/sequence_parallel.md)")
    tp = (tp, sp)  # the intra-stage columns: TP, SP
    rate = (lambda lay: lay.throughput * length) if run.pack else (lambda lay: lay.throughput)
    label = "positions/s" if run.pack else "samples/s"
    replayed = [x for x in asked(run.schedule) if x is not BASELINE]  # their B / W seconds and memory in the rows
    if run.schedule in (BOTH, ALL):
        _print_both(layouts, run.top, asked(run.schedule), (rate, label), bool(moe), tp)
    else:
        if replayed:  # DualPipeV keeps W inside B (DeepSpeed's BackwardPass): no W seconds of its own
            ops = ("forward, input-backward (B) and weight-backward (W)" if any(x.split_backward for x in replayed)
                   else "forward and backward")
            print(f"schedule {run.schedule}: step and bubble from replaying its order with each stage's {ops} "
                  f"seconds; memory at its micro-batches in flight")
        _print_one(layouts, run.top, rate, label, bool(moe), tp)
    if run.pack and s.load is None:
        print(f"positions/s = rows/s x {length}, padding included; useful tokens/s = positions/s x (1 - padding "
              f"share), which the data decides and plan cannot know: `mmpipe train --pack` reports it "
              f"(summary.json data.padding_share)")
    elif run.pack:
        print(f"positions/s = rows/s x {length}, padding included; useful tokens/s = positions/s x (1 - padding "
              f"share), {s.load.padding:.1%} in --data's rows")
    best = next((lay for lay in layouts if lay.step), None)
    if run.pack:
        print(rows_line(s.load, best))
    if best:
        _print_best(best, replayed, bool(moe), tp)
    if beside:
        print(beside)
    print(f"(planned in {seconds:.2f} s, nothing allocated)")


def _header(run: PlanRun) -> str:
    s, m = run.spec, run.model_args
    cfg, device = s.cfg, s.device
    peak = (f"{device.peak_flops / 1e12:.0f} TFLOP/s" if device.peak_flops >= 1e12 else
            f"{device.peak_flops / 1e9:.1f} GFLOP/s")
    image = (f"{cfg.vision.n_tokens} image tokens"
             f"{f' (ViT on 1 + {cfg.vision.crop_slots - 1} crops)' if cfg.vision.crop_slots > 1 else ''}")
    if run.video_frames and not s.row:  # Gemma 4's frames, fixed slots of the row (images.frames_clip_row)
        image = frame_words(cfg, run, s.images)
    return (f"{cfg.name} on {s.gpus} x {device.name} ({peak} at {device.efficiency:.0%}{_overheads(device)}, "
            f"{device.memory / GiB:.0f} GiB, link {device.link / 1e9:.0f} GB/s); global batch {s.global_batch}, "
            f"text {s.text_len} {'attending to' if cfg.cross_attn_layers else '+'} "
            f"{ROW_WORDS[s.row.kind][0](cfg, run, s.row) if s.row else image}, {s.precision}, ZeRO-{s.zero}"
            f"{', checkpointing' if s.checkpointing else ''}{', frozen: ' + m.freeze if m.freeze else ''}"
            f"{f', LoRA rank {m.lora} on {m.lora_groups} (base frozen)' if m.lora else ''}")


def _overheads(device: Device) -> str:
    """A calibrated device's fixed costs, e.g. ', + 0.50 ms per slot, + 2.00 ms per step'; '' for a data sheet's."""
    fixed = (f", + {device.microbatch_overhead * 1e3:.2f} ms per slot, + {device.step_overhead * 1e3:.2f} ms per step"
             if device.microbatch_overhead or device.step_overhead else "")
    return fixed + (f", + {device.split_overhead * 1e3:.2f} ms per zb-h1 W" if device.split_overhead else "")


def _row_line(run: PlanRun, length: int) -> str:
    """The row's decoder positions (and a dynamic-resolution row's budget used)."""
    s = run.spec
    rows = (f"{'; rows hold several samples (--pack)' if run.pack else '; one sample per row'}; global batch "
            f"and micro-batch count rows")
    if s.row:
        return ROW_WORDS[s.row.kind][1](s.cfg, s.row, s.text_len, length) + rows
    per_image = row_positions(s.cfg, 0)  # an image's decoder positions N_dec
    if s.images > 1 or run.pack:
        return f"decoder positions per row: {s.images} image slots x {per_image} + {s.text_len} text = {length}" + rows
    return f"decoder positions per row: {per_image} image + {s.text_len} text = {length}, one sample per row"


def _print_best(best: Layout, replayed: list, moe: bool, tp: tuple = (False, False)) -> None:
    """The best layout's stages: layers, parameters, memory, forward and backward (B and W, and each replayed
    schedule's memory); an MoE model's parameters per rank, and its all-to-all where one runs (EP > 1). tp: the
    layout's TP, its parameters and memory per TP rank, its all-reduces' milliseconds a micro-batch."""
    print(f"\nbest: {best.stages} stages x dp {best.dp}{f' x tp {best.tp}' if tp[0] else ''}"
          f"{f' x sp {best.sp}' if tp[1] else ''}"
          f"{f' (ep {best.ep})' if moe else ''}, micro {best.micro} "
          f"x GAS {best.gas}{', schedule ' + best.schedule if replayed else ''}")
    print(f"{'stage':>5} {'layers':>9} {'first..last':<28} {'params':>12} {'GiB':>7} {'act GiB':>8} "
          f"{'fwd ms':>8} {'bwd ms':>8}" + (f" {'B ms':>8} {'W ms':>8}" if replayed else "")
          + "".join(f" {x.short + ' GiB':>7}" for x in replayed))
    for r in best.stage_rows:
        print(f"{r['stage']:>5} {r['layers'][0]:>4}..{r['layers'][1]:<3} {r['first'] + '..' + r['last']:<28} "
              f"{r['params']:>12,} {r['memory_gib']:>7.2f} {r['activations_gib']:>8.2f} {r['forward_ms']:>8.2f} "
              f"{r['backward_ms']:>8.2f}" + (f" {r['input_backward_ms']:>8.2f} {r['weight_backward_ms']:>8.2f}"
                                              if replayed else "")
              + "".join(f" {r[x.short + '_memory_gib']:>7.2f}" for x in replayed))
    if tp[0] and best.tp > 1:
        print(f"per TP rank (1 of {best.tp}): params and GiB above; TP all-reduces a micro-batch: "
              + "; ".join(f"stage {r['stage']} {r['tp_ms']:.2f} ms" for r in best.stage_rows))
    if tp[1] and best.sp > 1:
        print(f"per SP rank (1 of {best.sp}, 1 / {best.sp} of each row's positions): GiB above; SP all-to-alls (and "
              f"the split tower's all-gather) a micro-batch: "
              + "; ".join(f"stage {r['stage']} {r['sp_ms']:.2f} ms" for r in best.stage_rows))
    if moe:  # at EP 1 every expert is on its rank: no all-to-all runs, so none is printed
        a2a = (lambda r: f", all-to-all {r['a2a_mib']:.1f} MiB / {r['a2a_ms']:.2f} ms a micro-batch"
               ) if best.ep > 1 else (lambda r: "")
        print("per rank: " + "; ".join(f"stage {r['stage']} {r['rank_params']:,.0f} params{a2a(r)}"
                                       for r in best.stage_rows))


def _patch_words(cfg: ModelConfig, run: PlanRun, patches: PatchRow) -> str:
    """The header's image part for a dynamic-resolution row: its images, each size's resized size and grid."""
    p, m, merge = cfg.vision.patch_size, len(patches.grids), cfg.vision.merge_size ** 2
    if run.video_frames:  # the row's last grids are its clip's (clip_row)
        slots = run.video_slots
        clip = patches.grids[-slots:]
        _, h, w = clip[0]
        temporal = sum(g[0] for g in clip)
        images = PatchRow(patches.patches, patches.grids[:m - slots])
        size = run.video_size or "vision.image_size"
        words = (f"a clip of {run.video_frames} frames of {size} px -> {temporal} temporal patches of {w * p}x{h * p} "
                 f"px ({temporal} x {h} x {w} patches, {temporal * h * w // merge} image tokens"
                 f"{f', {slots} slots' if slots > 1 else ''})")
        return words + (f" + {_patch_words(cfg, dataclasses.replace(run, video_frames=None), images)}"
                        if images.grids else "")
    sizes = run.image_size.split(",") if run.image_size else [""]
    kinds = dict.fromkeys((sizes[k % len(sizes)], g) for k, g in enumerate(patches.grids))  # in order, once each
    words = [f"{f'{size} px -> ' if size else ''}{w * p}x{h * p} px ({h} x {w} patches, {t * h * w // merge} image "
             f"tokens{' each' if len(kinds) == 1 and m > 1 else ''})" for size, (t, h, w) in kinds]
    return f"{m} image{'s' if m > 1 else ''} " + ("of " + words[0] if len(kinds) == 1 else "(" + "; ".join(words) + ")")


def _patch_line(cfg: ModelConfig, patches: PatchRow, text_len: int, length: int) -> str:
    """A dynamic-resolution row's budgets: patches used of P, decoder positions of L."""
    merge, m = cfg.vision.merge_size ** 2, len(patches.grids)
    return (f"vision patches per row: {patches.used} of --max-patches {patches.patches} "
            f"({1 - patches.used / patches.patches:.0%} padding); decoder positions per row: {m} x 2 brackets + "
            f"{patches.patches // merge} image ({patches.used // merge} used) + {text_len} text = {length}")


# a row kind (PatchRow.kind, CropRow.kind) -> (its header words (cfg, run, row), its budget line (cfg, row, text
# length, decoder length))
ROW_WORDS = {"patches": (_patch_words, _patch_line), "crops": (crop_words, crop_line)}


def _inner_head(tp: tuple) -> str:
    """The intra-stage columns' heads asked for (tp: (TP asked, SP asked))."""
    return (" TP" if tp[0] else "") + (" SP" if tp[1] else "")


def _inner(lay: Layout, tp: tuple) -> str:
    return (f" {lay.tp:>3}" if tp[0] else "") + (f" {lay.sp:>3}" if tp[1] else "")


def _print_one(layouts, top, rate=lambda lay: lay.throughput, label: str = "samples/s", moe: bool = False,
               tp: tuple = (False, False)) -> None:
    """moe: an EP column after DP and the all-to-all's share of the step (`a2a`) after the step. tp: a TP column
    after DP."""
    w = max(10, len(label))
    def ep(lay: Layout) -> str:  # the TP, SP and EP columns asked for
        return _inner(lay, tp) + (f" {lay.ep:>3}" if moe else "")
    a2a = (lambda lay: f" {lay.step['a2a_share']:>6.1%}" if lay.step else f" {'':>6}") if moe else (lambda lay: "")
    print(f"{'PP':>3} {'DP':>3}{_inner_head(tp)}{' EP' if moe else ''} {'micro':>5} {'GAS':>4} {'bubble':>7} "
          f"{'step s':>8}"
          f"{'    a2a' if moe else ''} {label:>{w}} {'max GiB':>8}  partition / why not")
    for lay in layouts[:top] + [lay for lay in layouts[top:] if not lay.step][:3]:
        if lay.step:
            peak = max(lay.step.get("memory_gib") or [r["memory_gib"] for r in lay.stage_rows])
            print(f"{lay.stages:>3} {lay.dp:>3}{ep(lay)} {lay.micro:>5} {lay.gas:>4} {lay.step['bubble']:>7.1%} "
                  f"{lay.step['step_s']:>8.3f}{a2a(lay)} {rate(lay):>{w}.1f} {peak:>8.1f}  {lay.parts}")
        else:
            print(f"{lay.stages:>3} {lay.dp:>3}{ep(lay)} {lay.micro:>5} {lay.gas:>4} {'':>7} {'':>8}{a2a(lay)} "
                  f"{'':>{w}} {'':>8}  does not fit: {lay.reason}")


def _moe_line(cfg: ModelConfig, m, text_len: int, length: int, precision: str) -> str:
    """An MoE model's parameters (total, active per token, the experts --ep splits) and what each block's
    all-to-all moves per row (costmodel.all_to_all). m: its MoE section (the family's experts answer)."""
    from .costmodel import BYTES, moe_param_counts
    n = moe_param_counts(cfg)
    per_row = length * m.top_k * cfg.text.dim * BYTES[precision]
    return (f"MoE: {m.experts} experts, top {m.top_k}, in {n['blocks']} blocks: {n['total']:,} parameters, "
            f"{n['active']:,} active per token, {n['experts']:,} in experts (1 / EP of them per rank); each block's "
            f"all-to-all {length} positions x {m.top_k} x {cfg.text.dim} x {BYTES[precision]} B = "
            f"{per_row / 2 ** 20:.3g} MiB a row, 2 forward + 2 backward, (EP - 1) / EP of it off the rank")


def _print_both(layouts, top, schedules, rated=(lambda lay: lay.throughput, "samples/s"), moe: bool = False,
                tp: tuple = (False, False)) -> None:
    """One row per layout: each schedule's bubble and step ('-': it cannot run the layout, DualPipeV below 2 x PP
    micro-batches), which is faster and by how much (moe: an EP column). rated: (the rate of a layout, its label)."""
    rate, label = rated
    w = max(10, len(label))
    cols = [(s, len(s.name) + 4) for s in schedules]  # a bubble column as wide as '<name> bub'
    print(f"{'PP':>3} {'DP':>3}{_inner_head(tp)}{' EP' if moe else ''} {'micro':>5} {'GAS':>4} "
          + " ".join(f"{s.name + ' bub':>{n}} {s.name + ' s':>8}" for s, n in cols)
          + f"  {'faster':<15} {label:>{w}} {'max GiB':>8}  partition / why not")
    for lay in layouts[:top] + [lay for lay in layouts[top:] if not lay.step][:3]:
        ep = _inner(lay, tp) + (f" {lay.ep:>3}" if moe else "")
        if not lay.step:
            print(f"{lay.stages:>3} {lay.dp:>3}{ep} {lay.micro:>5} {lay.gas:>4} "
                  + " ".join(f"{'':>{n}} {'':>8}" for _, n in cols)
                  + f"  {'':<15} {'':>{w}} {'':>8}  does not fit: {lay.reason}")
            continue
        steps = " ".join(f"{lay.predictions[s.name]['bubble']:>{n}.1%} {lay.predictions[s.name]['step_s']:>8.3f}"
                         if s.name in lay.predictions else f"{'-':>{n}} {'-':>8}" for s, n in cols)
        peak = max(lay.step.get("memory_gib") or [r["memory_gib"] for r in lay.stage_rows])
        print(f"{lay.stages:>3} {lay.dp:>3}{ep} {lay.micro:>5} {lay.gas:>4} {steps}  {_faster(lay):<15} "
              f"{rate(lay):>{w}.1f} {peak:>8.1f}  {lay.parts}")


def _faster(lay: Layout) -> str:
    """The schedule the layout runs fastest (lay.schedule) and its gain over the baseline's step; when that is
    the baseline, why: another schedule does not fit ('zb: mem') or is no faster ('equal')."""
    base = lay.predictions[BASELINE.name]["step_s"]
    if lay.schedule != BASELINE.name:
        return f"{lay.schedule} {1 - lay.step['step_s'] / base:.1%}"
    crowded = [schedule_named(name).short for name, p in lay.predictions.items() if not p.get("fits", True)]
    if crowded:
        return f"{BASELINE.name} ({', '.join(crowded)}: mem)"
    equal = any(p["step_s"] == base for name, p in lay.predictions.items() if name != BASELINE.name)
    return BASELINE.name + (" (equal)" if equal else "")
